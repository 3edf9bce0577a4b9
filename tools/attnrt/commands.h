// Subcommands of the attnrt CLI. Each add_*_command registers its subcommand, options and help text on
// the app; its callback throws attnrt::Error for bad input (main prints the message and exits 2) or
// ExitCode to end with a given status (e.g. `check` found a mismatch).
#pragma once

#include <CLI/CLI.hpp>

namespace attnrt::cli {

struct ExitCode {
  int code;
};

void add_info_command(CLI::App& app);
void add_check_command(CLI::App& app);
void add_run_command(CLI::App& app);
void add_replay_command(CLI::App& app);
void add_bench_command(CLI::App& app);

}  // namespace attnrt::cli
