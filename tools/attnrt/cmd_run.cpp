#include "attnrt/core/error.h"
#include "tools/attnrt/commands.h"

namespace attnrt::cli {

void add_run_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("run", "(being written)");
  cmd->callback([] { fail("'run' is not available in this build yet"); });
}

}  // namespace attnrt::cli
