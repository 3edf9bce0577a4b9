// Runs benchmark rows: builds each workload in a paged pool with random data, checks the backend's
// output, times it, and measures the reference backend on the same (or a scaled-down) shape.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "attnrt/backend/registry.h"
#include "bench/harness/ceilings.h"
#include "bench/harness/dsa_workload.h"
#include "bench/harness/linear_workload.h"
#include "bench/harness/timing.h"
#include "bench/harness/workload.h"

namespace attnrt::bench {

struct BenchConfig {
  std::string backend;              // registry name of the backend under test
  std::vector<Workload> workloads;  // as they run (already scaled)
  std::vector<LinearWorkload> linear_workloads;  // --suite linear rows, as they run
  std::vector<DsaWorkload> dsa_workloads;        // --suite dsa rows, as they run
  double scale = 1.0;               // --scale, for the report
  std::string preset;               // --preset, for the report ("" = none)
  int repeats = 10;
  int warmup = 2;
  int threads = 0;  // 0 = resolve_threads(0)
  bool compare_reference = true;
  // --deterministic: the backend under test (and the graph-overhead runtime) in deterministic mode.
  bool deterministic = false;
  uint64_t seed = 0x5eed;
  // Shapes larger than these run on the reference backend scaled down (fit_workload) and the
  // speed-up compares work per second, not time.
  double reference_max_bytes = 64.0 * (1 << 20);
  double reference_max_work = 5e7;
  int reference_repeats = 3;
  // Work budget (FLOPs) of the dense float check of each row: decides how many query rows it
  // samples (at least 4, all of them when the row is small).
  double check_max_work = 2e9;
  double check_tolerance = 2e-2;  // relative L2 error per (query row, head)
  Device device = Device::cpu();
  CeilingOptions ceiling_options;
  // Where backends are looked up; nullptr = Registry::global().
  const Registry* registry = nullptr;
  // Progress lines ("decode-16x4096: timing ..."), e.g. to stderr. May be empty.
  std::function<void(const std::string&)> progress;
  // GPU runs only: the host plan time per step at batch 256 (decode, verify, extend) and what a
  // CUDA graph saves on a 32-layer decode step (BenchResult::plans, ::graph).
  bool gpu_step_costs = true;
};

struct CheckResult {
  std::string method;   // "dense float64 on 48 of 16 query rows x 32 heads", "full output vs reference"
  int rows_checked = 0;
  double max_rel_err = 0;  // max over checked (row, head) of |o - ref|_2 / |ref|_2
  double tolerance = 0;
  bool passed = false;
};

struct ReferenceResult {
  Workload workload;  // the shape reference ran (== the row's unless scaled down)
  TimingStats time;
  double work_per_second = 0;  // attention_work / median time
  double speedup = 0;          // backend work/s over reference work/s
  CheckResult check;           // backend vs reference outputs on `workload`
  std::string note;            // how it was measured
};

struct RowResult {
  Workload standard;  // the row as docs/workloads.md defines it
  Workload workload;  // what ran (scale_note says how it differs)
  std::string status = "ok";  // ok | mismatch | error | n/a
  std::string error;          // status error: the message; n/a: why the backend has no such row
  CheckResult check;          // dense check of the full row
  TimingStats time;           // seconds per forward call
  TimingStats plan;           // seconds per init_forward_metadata
  double bytes = 0;           // counted_bytes
  double flops = 0;           // counted_flops
  Bound bound = Bound::memory;
  double rate = 0;            // GB/s (memory rows) or GFLOP/s (compute rows)
  double pct_of_ceiling = 0;  // rate / the matching ceiling * 100; 0 when no ceiling
  std::optional<ReferenceResult> reference;
  // Verify rows: the decode B x P row at the same prefix and time / its time.
  std::optional<Workload> decode_workload;
  TimingStats decode_time;
  double decode_ratio = 0;
  std::vector<std::string> notes;

  std::string metric_unit() const { return bound == Bound::memory ? "GB/s" : "GFLOP/s"; }
};

// One linear-attention row (docs/bench.md "Linear-attention rows"): one layer's forward_linear for
// the step, on the backend's linear side through AttentionRuntime.
struct LinearRowResult {
  LinearWorkload standard;    // the row as docs/bench.md defines it
  LinearWorkload workload;    // what ran (scale_note says how it differs)
  std::string status = "ok";  // ok | mismatch | error
  std::string error;
  CheckResult check;  // outputs of sampled requests against the reference backend
  TimingStats time;   // seconds per forward_linear
  double bytes = 0;   // linear_counted_bytes
  double flops = 0;   // linear_counted_flops
  Bound bound = Bound::memory;
  double rate = 0;            // GB/s (decode) or GFLOP/s (extend)
  double pct_of_ceiling = 0;  // rate / the matching ceiling * 100; 0 when no ceiling
  double tokens_per_second = 0;
  std::vector<std::string> notes;

  std::string metric_unit() const { return bound == Bound::memory ? "GB/s" : "GFLOP/s"; }
};

// One DSA row (docs/workloads.md "DSA rows"): a part of one DSA layer's step, beside the dense MLA
// row of the same shape measured in the same run.
struct DsaRowResult {
  DsaWorkload standard;       // the row as docs/workloads.md defines it
  DsaWorkload workload;       // what ran (scale_note says how it differs)
  std::string status = "ok";  // ok | mismatch | error | n/a
  std::string error;          // status error: the message; n/a: why the backend has no such row
  // The step's outputs and selections against the reference backend (float64) on sampled query
  // tokens; selection_mismatches counts selected keys that differ from the reference's.
  CheckResult check;
  int64_t selected_checked = 0;
  int64_t selection_mismatches = 0;
  TimingStats time;  // seconds of the row's part (index: step minus sparse, per repetition)
  double bytes = 0;  // dsa_counted_bytes
  double flops = 0;  // dsa_counted_flops
  Bound bound = Bound::compute;
  double rate = 0;            // GB/s (index rows) or GFLOP/s
  double pct_of_ceiling = 0;  // rate / the matching ceiling * 100; 0 when no ceiling
  // The dense MLA row of the same shape (dsa_dense_companion), measured in the same run by the
  // mla suite's runner: its time, and the row's figure against it (dsa_target says which).
  std::optional<Workload> dense_workload;
  TimingStats dense_time;
  std::string figure_name;  // e.g. "dsa / dense time"
  double figure = 0;
  DsaTarget target;
  bool target_met = false;
  std::vector<std::string> notes;

  std::string metric_unit() const { return bound == Bound::memory ? "GB/s" : "GFLOP/s"; }
};

// Host seconds of the phases of a cuda plan (CudaBackend::PlanParts): the stream's capture query,
// the staging slot's acquire, the planner's prepare and write, the copy's issue. Timed in a pass
// of their own after the plan's, so the clock reads stay out of PlanTiming::time.
struct PlanParts {
  TimingStats capture, staging, prepare, write, copy;
};

// Host time of one plan (init_forward_metadata) at batch 256, each plan followed by its step as in
// serving.
struct PlanTiming {
  Workload workload;
  TimingStats time;                // seconds per plan
  std::optional<PlanParts> parts;  // backends that time their phases (cuda)
  std::string stream;              // the steps' GPU stream: "own" (the KV cache's) or "legacy"
  std::string error;               // why it could not be measured ("" when measured)
};

// One DECODE step of a 32-layer model issued eagerly (begin_step, a forward per layer, end_step)
// and as one CUDA-graph replay (AttentionRuntime::forward_step_graph), same inputs and pools.
struct GraphOverhead {
  std::string shape;  // e.g. "decode 64x1024, 32 layers (32 q / 8 KV heads, d128, page 16)"
  int layers = 0;
  TimingStats eager_issue, graph_issue;  // host seconds to issue the step
  TimingStats eager_step, graph_step;    // seconds from the first call to the GPU being done
  std::string error;                     // why it could not be measured ("" when measured)
};

struct BenchResult {
  std::string backend;
  int threads = 0;
  int repeats = 0;
  int warmup = 0;
  std::string backend_simd_target;  // what the cpu backend dispatches to ("" for other backends)
  Ceilings ceilings;
  std::vector<RowResult> rows;
  std::vector<LinearRowResult> linear_rows;
  std::vector<DsaRowResult> dsa_rows;
  std::string timer_method;
  std::vector<PlanTiming> plans;        // GPU runs (BenchConfig::gpu_step_costs)
  std::string host_sync;  // GPU runs: how the host thread waits for the device (device_row.h)
  std::optional<GraphOverhead> graph;  // GPU runs (BenchConfig::gpu_step_costs)
  // Every row ok (attention and DSA rows of status n/a, which the backend does not serve,
  // included).
  bool all_passed() const;
};

// The backend auto-selection picks for decode steps of the standard shape on this machine (what
// `attnrt run` would use), with the reason; throws attnrt::Error when nothing is selectable.
std::string auto_bench_backend(std::string* reason);

// Measures the ceilings, then every row (attention rows, then linear rows). Errors of one row (an
// unsupported shape, a failed check) are recorded in that row and the others still run;
// configuration errors throw attnrt::Error.
BenchResult run_bench(const BenchConfig& config);
// The GPU step costs of BenchConfig::gpu_step_costs (also run by run_bench).
std::vector<PlanTiming> measure_plans_bs256(const BenchConfig& config);
GraphOverhead measure_graph_overhead(const BenchConfig& config);

// One row against already measured ceilings. `workload` may be a scaled standard row (found by
// name) or any other shape.
RowResult run_row(const BenchConfig& config, const Workload& workload, const Ceilings& ceilings);

// One MLA row in the MHA form (Workload::is_mla_mha; run_row passes them here): the layer's
// attention through AttentionRuntime's MHA-form calls on a runtime of its own (backends from
// Registry::global()); status "n/a" when the backend serves MLA extends in the absorbed form.
RowResult run_mla_mha_row(const BenchConfig& config, const Workload& workload,
                          const Ceilings& ceilings);

// The DSA rows (docs/workloads.md "DSA rows"). Rows of one shape share their measurements: the
// step, the sparse attention over the step's selection and the dense companion are each measured
// once for all the rows of that shape that need them. A backend without DSA caps gets n/a rows.
std::vector<DsaRowResult> run_dsa_rows(const BenchConfig& config,
                                       const std::vector<DsaWorkload>& rows,
                                       const Ceilings& ceilings);
// True when `backend` (in the config's registry) serves DSA layers; else `why` says so.
bool backend_serves_dsa(const BenchConfig& config, std::string* why);

// One linear row: its states built (decode: an untimed EXTEND of prefix_len tokens), one checked
// call (the outputs of the first and last request, the first tokens of each for extend rows,
// against the reference backend run on those requests alone), then the timed calls. Each timed
// decode call is one more DECODE step of the same batch (the states advance in place, as in
// serving). Backends come from Registry::global(), where AttentionRuntime looks them up.
LinearRowResult run_linear_row(const BenchConfig& config, const LinearWorkload& workload,
                               const Ceilings& ceilings);

}  // namespace attnrt::bench
