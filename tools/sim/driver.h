// The step driver of `attnrt run`: replays a trace through the scheduler, runs every planned step
// on an AttentionRuntime (random q/k/v per layer per step, outputs poisoned with NaN first),
// recomputes a sample of steps with the `reference` backend over the same pools, and reports per
// ForwardMode.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_mode.h"
#include "attnrt/core/dtype.h"
#include "attnrt/model/model_spec.h"
#include "tools/sim/scheduler.h"
#include "tools/sim/trace.h"

namespace attnrt::sim {

struct RunConfig {
  SchedulerConfig scheduler;         // page_size and spec are taken from the options
  int64_t max_total_tokens = 16384;  // usable KV slots of the target pool (the draft's too)
  // SWA-hybrid models: slots of the sliding-window layers' pool per full-pool slot.
  double swa_full_tokens_ratio = 0.8;
  // Steps 0, N, 2N, ... of each (model, mode) are recomputed on `reference`, so that rare modes are
  // sampled as well as frequent ones; 0 turns checking off.
  int check_every = 8;
  uint64_t seed = 1;   // q/k/v data, acceptance sampling, tree shapes
  int dump_step = -1;  // write this step's first full-attention layer as a case
  std::string dump_dir;
  // Layers run: the first `layers` of the model; 0 = all; -1 = all, except for hybrid
  // (linear-attention) models, which run their layers up to and including the first attention
  // layer after a linear one (one period of the layer pattern: their recurrent states make every
  // layer costly on two cores). The report says which layers ran.
  int layers = -1;
};

// Largest tolerated |out - reference| is atol + rtol * |reference|, by output dtype.
struct Tolerance {
  double atol = 0, rtol = 0;
};
Tolerance output_tolerance(DType out_dtype);

struct ModeStats {
  ModelRole role = ModelRole::target;
  ForwardMode mode = ForwardMode::IDLE;
  std::string backend;  // the backend that served this mode (after hybrid routing)
  int64_t steps = 0, tokens = 0;
  double seconds = 0;  // begin_step + every layer's forward + end_step
  int64_t checked_steps = 0;
  int64_t graph_steps = 0;  // steps that ran as CUDA graphs (AttentionRuntime::forward_step_graph)
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
  std::string dump_written;  // the case directory written for --dump-step, if any
  std::string dump_error;    // why --dump-step wrote nothing (no such step, IDLE step)
  // Hybrid models: the linear-attention backends, and the state-slot check at the end (every
  // request's slot freed again).
  std::string linear_prefill_backend, linear_decode_backend;
  bool linear_pool_ok = true;
  std::string linear_pool_detail;
  int linear_slots = 0;
  // What the run changed about the model or the trace, one sentence each (layers left out, shared
  // prefixes not reused, ...).
  std::vector<std::string> notes;

  ModeStats totals() const;
  bool ok() const;
};

struct Progress {
  int64_t steps_done = 0, steps_estimate = 0;
  int64_t tokens = 0;
  double wall_seconds = 0;
  ModelRole role = ModelRole::target;
  ForwardMode mode = ForwardMode::IDLE;
};
using ProgressFn = std::function<void(const Progress&)>;

// Fills unset speculative options as engines do: topk 1 when only the step count is given, and
// num_draft_tokens = num_steps + 1 for a chain. Throws attnrt::Error when a tree (topk > 1) lacks
// --speculative-num-draft-tokens or when topk / draft tokens are given without
// --speculative-num-steps.
Options complete_spec_options(Options options);

// The one-layer draft model used with speculative decoding: the target's first layer with a KV
// cache.
ModelSpec make_draft_model(const ModelSpec& target);

// Runs the whole trace. Throws attnrt::Error for bad input (options, trace, pool too small);
// mismatches against reference, pool leaks and a --dump-step that named no step with tokens are
// reported in RunReport (ok() false), not thrown, so that the report of the run is still printed.
RunReport run_trace(const ModelSpec& model, const Options& options, const Trace& trace,
                    const RunConfig& config, const ProgressFn& progress = {});

// The end-of-run table (one row per model and mode, totals, pool check, failures) as text, and the
// same content as JSON.
std::string format_report(const RunReport& report);
nlohmann::json report_to_json(const RunReport& report);

}  // namespace attnrt::sim
