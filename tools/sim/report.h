// The report of `attnrt run`: per (model, mode) statistics, the pool checks, the failures of the
// reference checks, and their text and JSON forms.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "attnrt/batch/forward_mode.h"
#include "tools/sim/scheduler.h"

namespace attnrt::sim {

// Largest tolerated |out - reference| is atol + rtol * |reference|, by output dtype.
struct Tolerance {
  double atol = 0, rtol = 0;
};

// How many rows a checked step compares (`attnrt run --check-rows`): 0 = no limit.
struct CheckRows {
  int max_tokens = 64;
  int max_heads = 16;
  bool all() const { return max_tokens == 0 && max_heads == 0; }
};

struct ModeStats {
  ModelRole role = ModelRole::target;
  ForwardMode mode = ForwardMode::IDLE;
  std::string backend;  // the backend that served this mode (after hybrid routing)
  int64_t steps = 0, tokens = 0;
  double seconds = 0;  // begin_step + every layer's forward + end_step
  int64_t checked_steps = 0;
  // Output rows (token x head) of the checked steps' attention layers: compared against reference,
  // and in all (the check compares a sample, `attnrt run --check-rows`).
  int64_t checked_rows = 0, checkable_rows = 0;
  int64_t graph_steps = 0;  // steps that ran as CUDA graphs (AttentionRuntime::forward_step_graph)
  // MLA layer calls in the MHA form (docs/mla.md) and the prefix chunks they merged.
  int64_t mha_layers = 0, prefix_chunks = 0;
  double max_abs_err = 0, max_rel_err = 0;  // over checked steps, vs reference
  double tokens_per_second() const { return seconds > 0 ? tokens / seconds : 0; }
};

struct CheckFailure {
  int step = 0;
  ModelRole role = ModelRole::target;
  ForwardMode mode = ForwardMode::IDLE;
  int layer = 0;
  int64_t token = 0;  // query row of the step
  int head = 0, column = 0;
  double got = 0, expected = 0, abs_err = 0;
  std::string what;  // one line: step, mode, layer, where, error, tolerance
};

struct RunReport {
  std::string model, trace_origin;
  int requests = 0;
  int64_t prompt_tokens = 0, output_tokens = 0;
  std::string prefill_backend, decode_backend, kv_dtype;
  int page_size = 1;
  double swa_ratio = 0;  // SWA-hybrid model: its SWA pool's slots per full slot; 0 otherwise
  SpecConfig spec;
  std::vector<ModeStats> modes;  // target modes first, in ForwardMode order, then draft modes
  int iterations = 0;
  double wall_seconds = 0;
  int64_t verify_rounds = 0, accepted_drafts = 0;  // over every request's verify rounds
  PoolReport target_pool;
  std::optional<PoolReport> draft_pool;
  std::vector<CheckFailure> failures;  // the first few of each (model, mode)
  int64_t failure_count = 0;           // checked layer outputs beyond tolerance, in total
  Tolerance tolerance;
  std::string check_note;    // why no step was checked against reference, if none was
  CheckRows check_rows;      // what a checked step compared
  std::string dump_written;  // the case directory written for --dump-step, if any
  std::string dump_error;    // why --dump-step wrote nothing (no such step, IDLE step)
  // Hybrid models: the linear-attention backends, and the state-slot check at the end (every
  // request's slot freed again).
  std::string linear_prefill_backend, linear_decode_backend;
  bool linear_pool_ok = true;
  std::string linear_pool_detail;
  int linear_slots = 0;
  // Aborts (trace abort_step) by what the request was doing, retractions under memory pressure, and
  // how often the pool invariants were checked (all passed, or the run stopped with an error).
  AbortCounts aborts;
  int64_t retractions = 0;
  int64_t invariant_checks = 0;
  // Target tokens per second of wall time over the first and the last tenth of the steps (steps
  // counted by index; the whole step loop timed: scheduling, inputs, kernels, checks); 0 when the
  // run has fewer than 10 steps.
  double first_tenth_tokens_per_s = 0, last_tenth_tokens_per_s = 0;
  std::vector<double> tenth_tokens_per_s;  // all ten tenths, first to last (empty: < 10 steps)
  int64_t steps = 0;
  // What the run changed about the model or the trace, one sentence each (layers left out, shared
  // prefixes not reused, ...).
  std::vector<std::string> notes;

  ModeStats totals() const;
  bool ok() const;
};

// The end-of-run table (one row per model and mode, totals, pool check, failures) as text, and the
// same content as JSON.
std::string format_report(const RunReport& report);
nlohmann::json report_to_json(const RunReport& report);

// An error as the report prints it: "1.23e-04", or "inf".
std::string error_text(double e);

}  // namespace attnrt::sim
