#include "attnrt/core/error.h"
#include "tools/attnrt/commands.h"

namespace attnrt::cli {

void add_replay_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("replay", "(being written)");
  cmd->callback([] { fail("'replay' is not available in this build yet"); });
}

}  // namespace attnrt::cli
