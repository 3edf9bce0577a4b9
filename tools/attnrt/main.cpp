#include <fmt/format.h>

#include <cstdio>
#include <exception>

#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "bench/harness/report.h"
#include "tools/attnrt/cli_options.h"
#include "tools/attnrt/commands.h"

int main(int argc, char** argv) {
  CLI::App app{
      "attnrt: the attention layer of an LLM serving engine.\n"
      "Paged KV caches, every forward mode (prefill with cached prefix, decode, mixed, speculative\n"
      "verify, draft extend) and backends chosen per phase by name or from the hardware and model."};
  app.set_version_flag(
      "--version",
      fmt::format("attnrt {} (commit {}, {})", ATTNRT_VERSION, attnrt::bench::build_commit(),
                  attnrt::built_with_cuda() ? "CUDA kernels built in"
                                            : "built without CUDA"),
      "Print the version, the commit it was built from and whether CUDA kernels are in; exit");
  app.require_subcommand(1);
  app.fallthrough(false);
  attnrt::cli::add_info_command(app);
  attnrt::cli::add_check_command(app);
  attnrt::cli::add_run_command(app);
  attnrt::cli::add_replay_command(app);
  attnrt::cli::add_bench_command(app);
  // CLI11 2.1 loops forever on an empty argument followed by an unknown option (the empty string
  // matches the backend option group's empty name): no argument may be empty.
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '\0') {
      std::fprintf(stderr,
                   "error: argument %d is empty; attnrt takes no empty arguments (a shell variable "
                   "that expanded to nothing?)\n",
                   i);
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return attnrt::cli::report_parse_error(app, e);
  } catch (const attnrt::cli::ExitCode& e) {
    return e.code;
  } catch (const attnrt::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "internal error: %s\n", e.what());
    return 3;
  }
  return 0;
}
