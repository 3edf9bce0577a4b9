// Pieces shared by the tests of `attnrt run`'s driver: a small trace, a small run configuration
// and the per-mode statistics of a report.
#pragma once

#include <cstdint>
#include <string>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "tools/sim/driver.h"
#include "tools/sim/trace.h"

namespace attnrt::test {

// Four requests: two at step 1, the second and the third (step 3) sharing a 32-token prefix, and
// a short one at step 9.
inline sim::Trace four_request_trace(const std::string& origin) {
  return sim::parse_trace(
      "{\"id\": \"a\", \"arrival_step\": 1, \"prompt_len\": 40, \"output_len\": 6}\n"
      "{\"id\": \"b\", \"arrival_step\": 1, \"prompt_len\": 70, \"output_len\": 9, "
      "\"shared_prefix\": \"sys\", \"shared_prefix_len\": 32}\n"
      "{\"id\": \"c\", \"arrival_step\": 3, \"prompt_len\": 50, \"output_len\": 4, "
      "\"shared_prefix\": \"sys\", \"shared_prefix_len\": 32}\n"
      "{\"id\": \"d\", \"arrival_step\": 9, \"prompt_len\": 12, \"output_len\": 7}\n",
      origin);
}

// One request at step 0: a 5-token prompt and 2 output tokens.
inline sim::Trace one_request_trace() {
  return sim::parse_trace(
      "{\"id\": \"a\", \"arrival_step\": 0, \"prompt_len\": 5, \"output_len\": 2}\n", "one");
}

// At most 4 running requests and prefill chunks of 32 tokens in `max_total_tokens` pool slots;
// every `check_every`-th step checked; data drawn from `seed`.
inline sim::RunConfig small_run_config(int64_t max_total_tokens, int check_every, uint64_t seed) {
  sim::RunConfig rc;
  rc.scheduler.max_running_requests = 4;
  rc.scheduler.chunked_prefill_size = 32;
  rc.max_total_tokens = max_total_tokens;
  rc.check_every = check_every;
  rc.seed = seed;
  return rc;
}

// The `backend` with 3 speculative steps of EAGLE topk `topk`: 4 draft tokens on a chain, 6 on a
// tree.
inline Options speculative_options(const std::string& backend, int topk) {
  return Options{.attention_backend = backend,
                 .speculative_num_steps = 3,
                 .speculative_eagle_topk = topk,
                 .speculative_num_draft_tokens = topk == 1 ? 4 : 6};
}

// The statistics of `mode` steps of the `role` model (null: the run had none).
inline const sim::ModeStats* find_mode(const sim::RunReport& r, sim::ModelRole role,
                                       ForwardMode mode) {
  for (const sim::ModeStats& m : r.modes) {
    if (m.role == role && m.mode == mode) return &m;
  }
  return nullptr;
}

}  // namespace attnrt::test
