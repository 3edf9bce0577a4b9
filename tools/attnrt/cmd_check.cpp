#include "attnrt/core/error.h"
#include "tools/attnrt/commands.h"

namespace attnrt::cli {

void add_check_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("check", "(being written)");
  cmd->callback([] { fail("'check' is not available in this build yet"); });
}

}  // namespace attnrt::cli
