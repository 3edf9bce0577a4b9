// The backend options shared by every subcommand that builds a backend (info, run, check, bench).
// Flag names follow the reference serving engine's, so its users' launch lines carry over.
#pragma once

#include <CLI/CLI.hpp>

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

}  // namespace attnrt::cli
