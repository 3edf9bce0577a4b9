// Serving traces for `attnrt run`: one request per JSON line (format and defaults: docs/trace.md).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace attnrt::sim {

struct TraceRequest {
  std::string id;
  int arrival_step = 0;  // the scheduler iteration at which the request becomes visible
  int prompt_len = 0;    // tokens to prefill (>= 1), the shared prefix included
  int output_len = 0;    // tokens to generate (>= 1); the first comes out of the prefill
  // Requests naming the same shared prefix start with the same `shared_prefix_len` tokens (a system
  // prompt): it is prefilled once and then reused from the cache in whole pages. "" = none.
  std::string shared_prefix;
  int shared_prefix_len = 0;
  // The iteration at which the client cancels the request (-1 = never); see docs/trace.md.
  int abort_step = -1;
  int line = 0;  // 1-based line in the trace file (0 for generated traces), for error messages
};

struct Trace {
  std::string origin;  // file path, or "built-in"
  std::vector<TraceRequest> requests;

  int64_t total_prompt_tokens() const;
  int64_t total_output_tokens() const;
  int last_arrival_step() const;
};

// Parses JSON lines. Blank lines are skipped. Throws attnrt::Error naming `origin`, the line number
// and the field for malformed JSON, unknown fields, missing or out-of-range values, duplicate ids
// and a shared prefix given different lengths on different lines.
Trace parse_trace(std::string_view text, std::string_view origin);
Trace load_trace(const std::string& path);

// The trace `attnrt run` replays when no --trace is given: a few dozen requests with mixed prompt
// and output lengths, staggered arrivals (the first at step 2, a late wave after a pause, so the
// engine has idle iterations), and two groups sharing a system prompt. Deterministic: generated in
// code from a fixed seed, identical on every machine.
Trace builtin_trace();

// A random trace for a soak run (`attnrt run --soak-steps`): requests arrive over about `steps`
// iterations at a rate that keeps about `max_running` requests busy, with prompts of 1 to
// 4 x `chunk` tokens (so many are prefilled in several chunks), outputs of 1 to 48 tokens, a shared
// prefix on one request in eight, and an abort_step on about one request in `abort_every` (0 =
// none) that falls anywhere from its arrival to well past its expected end. Deterministic in
// `seed`.
Trace soak_trace(int steps, int max_running, int chunk, int abort_every, uint64_t seed);

// The trace back as JSON lines (parse_trace(to_jsonl(t)) == t up to `line` and `origin`).
std::string to_jsonl(const Trace& trace);

}  // namespace attnrt::sim
