#include "attnrt/core/error.h"
#include "tools/attnrt/commands.h"

namespace attnrt::cli {

void add_bench_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "(being written)");
  cmd->callback([] { fail("'bench' is not available in this build yet"); });
}

}  // namespace attnrt::cli
