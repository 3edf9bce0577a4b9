#include "attnrt/core/error.h"
#include "tools/attnrt/commands.h"

namespace attnrt::cli {

void add_info_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "(being written)");
  cmd->callback([] { fail("'info' is not available in this build yet"); });
}

}  // namespace attnrt::cli
