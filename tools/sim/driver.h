// The step driver of `attnrt run`: replays a trace through the scheduler, runs every planned step
// on an AttentionRuntime (random q/k/v per layer per step, outputs poisoned with NaN first),
// recomputes a sample of steps with the `reference` backend over the same pools (checker.h),
// writes the step --dump-step names as a replay case (case_dumper.h), and reports per ForwardMode
// (report.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_mode.h"
#include "attnrt/model/model_spec.h"
#include "tools/sim/checker.h"
#include "tools/sim/report.h"
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
  // Rows of a checked step's attention layers that the reference recomputes (the others are still
  // scanned for unwritten outputs); linear-attention layers are always checked whole.
  CheckRows check_rows;
  // Pool invariants (Scheduler::check_invariants, the linear-state pool's): every N steps and after
  // every step that aborted or retracted a request; 0 = only at the end of the run (always done).
  int check_invariants_every = 0;
  uint64_t seed = 1;   // q/k/v data, acceptance sampling, tree shapes
  int dump_step = -1;  // write this step's first full-attention layer as a case
  std::string dump_dir;
  // Layers run: the first `layers` of the model; 0 = all; -1 = all, except for hybrid
  // (linear-attention) models, which run their layers up to and including the first attention
  // layer after a linear one (one period of the layer pattern: their recurrent states make every
  // layer costly on two cores), and, when every backend runs on the CPU, models whose attention
  // layers are too costly together (default_cpu_layers). The report says which layers ran.
  int layers = -1;
};

// The default cut of a model run on the CPU: multiply-adds per query token and visible key, summed
// over the attention layers (q heads x (qk dim + v dim) each), that the first layers may reach.
// 600k keeps every dense preset whole (Llama-3-8B: 262k, Gemma-3-12B: 393k) and four layers of
// DeepSeek-V3 (139k each: 128 heads x (576 + 512)).
inline constexpr int64_t kCpuLayerBudget = 600'000;
inline constexpr size_t kMinDefaultLayers = 2;
// How many first layers of `model` stay within kCpuLayerBudget (at least kMinDefaultLayers, at
// most all).
size_t default_cpu_layers(const ModelSpec& model);

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

// Runs the whole trace. Throws attnrt::Error for bad input (options, trace, pool too small) and for
// a broken pool invariant (naming the step, the pool, the invariant and the slot or row);
// mismatches against reference, pool leaks and a --dump-step that named no step with tokens are
// reported in RunReport (ok() false), not thrown, so that the report of the run is still printed.
RunReport run_trace(const ModelSpec& model, const Options& options, const Trace& trace,
                    const RunConfig& config, const ProgressFn& progress = {});

}  // namespace attnrt::sim
