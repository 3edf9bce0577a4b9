// The backend options shared by every subcommand that builds a backend (info, run, check, bench).
// Flag names follow the reference serving engine's, so its users' launch lines carry over.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "attnrt/backend/options.h"

namespace attnrt::cli {

// Adds --attention-backend, --prefill-attention-backend, --decode-attention-backend,
// --speculative-attention-mode, --page-size, --kv-cache-dtype, --speculative-num-steps,
// --speculative-eagle-topk, --speculative-num-draft-tokens, --linear-attn-backend,
// --linear-attn-prefill-backend, --linear-attn-decode-backend, --threads and --deterministic to
// `cmd`, in an option group "Backend options". Parsed values are written into `options`, which must
// outlive the parse. Values are checked against the model and the backends by resolve_backends().
void add_backend_options(CLI::App& cmd, Options& options);

// The option group add_backend_options creates.
inline constexpr const char* kBackendOptionGroup = "Backend options";

// True when any option of that group appeared on the command line of `cmd` (after parsing).
bool backend_options_given(CLI::App& cmd);

// Validators of option values. Their messages name the value given and what is allowed; CLI11 puts
// the option in front: "--page-size: 0 is not allowed; use an integer in [1, 1024]". A value that
// is not a number at all gets the same kind of message, not CLI11's conversion error.
CLI::Validator int_in(int64_t lo, int64_t hi);
// `lo_open`: lo itself is not allowed, (lo, hi].
CLI::Validator real_in(double lo, double hi, bool lo_open = false);
CLI::Validator one_of(std::vector<std::string> allowed);
// Seeds: any integer in [0, 2^64 - 1].
CLI::Validator seed_value();

// The largest --threads: four threads per hardware thread of this machine.
int max_threads_option();

// With a cpu backend's thread count left automatic (no --threads, no ATTNRT_NUM_THREADS) on a
// machine whose 1-minute load average already reaches its hardware threads, prints a note on
// stderr: OpenMP's idle threads spin between steps and take the cores other processes need (a
// small trace ran 2-4x slower than on one thread), and says what to set instead.
void warn_if_machine_busy(const Options& options);

// Reports a parse error of `app` the way attnrt reports bad input: "error: ..." on stderr, the
// option and the value named; an unknown option is named with the closest known one of its
// subcommand. Returns the exit status: 0 for --help / --version (printed by CLI11), else 2.
int report_parse_error(CLI::App& app, const CLI::ParseError& e);

}  // namespace attnrt::cli
