// Host time of the cuda backend's step plan without a GPU (Google Benchmark): HostPlanner at batch
// 256 with the shapes of `attnrt bench`'s plan rows (measure_plans_bs256: decode 256x2048, chain
// verify 256x(2048+8), extend 256x(2048+16); 32 q / 8 KV heads, d128, pages of 16 drawn from a
// shuffled pool), in steady state: each plan follows the previous step's "launch", so the committed
// pages are in the row table as in serving, and writes into the next of 8 staging buffers (the
// backend's ring). Also the per-step work every backend pays around its plan: make_step_layout
// (AttentionRuntime::check_step runs it every step, in place) and the host KV cache's begin_step.
// And the host cost of a DCP group's step (DcpAttention::begin_step + end_step, docs/dcp.md):
// decode of 8 requests x 131072 tokens over 2 `cpu` ranks, lengths growing by one each step.
//
//   attnrt_plan_bench --benchmark_repetitions=9 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/model/model_spec.h"
#include "attnrt/runtime/dcp.h"
#include "backends/cuda/cuda_plan.h"

namespace attnrt {
namespace {

// kDecodeRagged: decode with lengths drawn from [256, 2048] (serving batches are not uniform).
// kDecodeScattered: the decode batch on 256 rows drawn at random from a pool of 2048 (a serving
// pool holds more rows than one batch, so a batch's row states are not adjacent).
// kPrefill: a prefill of 8 requests x 2048 tokens from empty rows (prefill-8x2048's shape), whose
// work list the plan writes in L2-sized sections of requests by default (PlannerConfig::section_keys).
enum Kind { kDecode = 0, kVerify = 1, kExtend = 2, kDecodeRagged = 3, kDecodeScattered = 4, kPrefill = 5 };
constexpr int kScatteredPoolRows = 2048;
constexpr int kPrefillBatch = 8;

constexpr int kBatch = 256;
constexpr int kPage = 16;
constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128;

// The batch and request rows of measure_plans_bs256's workloads.
struct Workload {
  ReqToTokenPool pool;
  ForwardBatch batch;

  explicit Workload(Kind kind, int page = kPage)
      : pool(kind == kDecodeScattered ? kScatteredPoolRows : kBatch, 2048 + 16) {
    const bool decode = kind == kDecode || kind == kDecodeRagged || kind == kDecodeScattered;
    const int n_req = kind == kPrefill ? kPrefillBatch : kBatch;
    const int prefix = decode ? 2047 : kind == kPrefill ? 0 : 2048;
    const int q = decode ? 1 : kind == kVerify ? 8 : kind == kPrefill ? 2048 : 16;
    const int kv = prefix + q;
    const int per_req = (kv + page - 1) / page;
    std::vector<int64_t> order(static_cast<size_t>(n_req) * per_req);
    std::iota(order.begin(), order.end(), int64_t{1});
    std::shuffle(order.begin(), order.end(), std::mt19937_64(42));
    std::vector<int64_t> rows(n_req), slots(kv);
    if (kind == kDecodeScattered) {
      std::vector<int64_t> all(pool.size());
      for (int64_t& row : all) row = pool.alloc();
      std::shuffle(all.begin(), all.end(), std::mt19937_64(5));
      std::copy_n(all.begin(), n_req, rows.begin());
    }
    for (int r = 0; r < n_req; ++r) {
      if (kind != kDecodeScattered) rows[r] = pool.alloc();
      for (int j = 0; j < kv; ++j)
        slots[j] = order[static_cast<size_t>(r) * per_req + j / page] * page + j % page;
      pool.write(static_cast<int>(rows[r]), 0, slots);
    }
    std::vector<int32_t> lens(n_req, kv);
    if (kind == kDecodeRagged) {
      std::mt19937 rng(7);
      for (int32_t& l : lens) l = 256 + static_cast<int32_t>(rng() % (kv - 255));
    }
    if (decode) {
      batch = make_decode_batch(rows, lens);
    } else if (kind == kVerify) {
      batch = make_verify_batch(rows, std::vector<int32_t>(n_req, prefix),
                                SpecInfo::chain(n_req, q));
    } else {
      batch = make_extend_batch(rows, std::vector<int32_t>(n_req, prefix),
                                std::vector<int32_t>(n_req, q));
    }
    for (int r = 0; r < n_req; ++r)
      for (int t = 0; t < q; ++t)
        batch.out_cache_loc.push_back(
            pool.get(static_cast<int>(rows[r]), lens[r] - q + t));
  }
};

// The staging ring: prepare() and write() fill the next buffer, which grows when a step does not
// fit (the first steps upload whole page tables).
struct Staging {
  std::array<std::vector<uint64_t>, 8> slots;
  size_t next = 0;
  Staging() {
    for (std::vector<uint64_t>& s : slots) s.assign(size_t{8} << 10, 0);  // 64 KiB
  }
};

using Clock = std::chrono::steady_clock;

// Times of prepare() and write(), summed over steps.
struct PhaseTimes {
  Clock::duration prepare{}, write{};
};

// One step into the next staging buffer, timed per phase when `times` is given.
void plan_step(cuda::HostPlanner& planner, Workload& w, Staging& staging, int page,
               PhaseTimes* times = nullptr) {
  std::vector<uint64_t>& slot = staging.slots[staging.next++ % staging.slots.size()];
  Clock::time_point t0, t1;
  if (times != nullptr) t0 = Clock::now();
  const cuda::StepPlan& plan =
      planner.prepare(w.batch, &w.pool, page, 0, nullptr, false, false, slot.data());
  if (times != nullptr) t1 = Clock::now();
  std::vector<uint64_t> grown;
  if (plan.bytes > slot.size() * 8) grown.assign(plan.bytes / 8 + 1, 0);
  planner.write(grown.empty() ? slot.data() : grown.data());
  if (!grown.empty()) slot.swap(grown);
  planner.launched();
  if (times != nullptr) {
    const Clock::time_point t2 = Clock::now();
    times->prepare += t1 - t0;
    times->write += t2 - t1;
  }
}

// `mla`: DeepSeek-V3's MLA layer (128 q heads, one latent KV head, 576 / 512) instead of the
// d128 GQA layer: the plan cuts its rows into 64-row items (cuda::choose_shape).
cuda::PlannerConfig planner_config(bool mla = false) {
  cuda::PlannerConfig cfg;
  cfg.groups = {mla ? 128 : kQHeads / kKvHeads};
  cfg.head_dims = {mla ? cuda::kMlaHeadDim : kHeadDim};
  // Resident CTAs per SM of the kernel shapes (decode, prefill, verify, decode32) on the H200:
  // the d128 bf16 CTAs, or the MLA CTAs (one per SM).
  cfg.occupancy = {mla ? std::array<int, 4>{1, 1, 1, 1} : std::array<int, 4>{2, 1, 1, 2}};
  cfg.num_kv_heads_max = mla ? 1 : kKvHeads;
  cfg.sm_count = 132;
  return cfg;
}

void BM_HostPlan(benchmark::State& state) {
  const auto kind = static_cast<Kind>(state.range(0));
  const int page = static_cast<int>(state.range(1));
  Workload w(kind, page);
  cuda::PlannerConfig cfg = planner_config(state.range(2) != 0);
  // Sections of `sections` MiB of K / V (the cuda backend's default is 24 on an H100 / H200).
  if (state.range(3) > 0)
    cfg.section_keys = {(state.range(3) << 20) / (kKvHeads * 2 * kHeadDim * 2)};
  cuda::HostPlanner planner(cfg);
  planner.enable_row_table(w.pool.size(), (w.pool.max_context_len() + page - 1) / page);
  Staging staging;
  // Committed pages in the row table.
  for (int i = 0; i < 16; ++i) plan_step(planner, w, staging, page);
  for (auto _ : state) {
    plan_step(planner, w, staging, page);
    benchmark::ClobberMemory();
  }
  state.counters["bytes"] = static_cast<double>(planner.plan().bytes);
  state.counters["incremental"] = planner.plan().incremental ? 1 : 0;
  state.counters["steady"] = planner.plan().steady ? 1 : 0;
}
// The same plan with cold caches: `evict` MiB are streamed through between two plans (outside the
// timed region), as when `attnrt bench --backend cuda` starts every plan after a forward and a GPU
// drain: 64 MiB (twice the L3 here) leaves nothing of the plan's working set in any cache or the
// TLB; 4 MiB empties the core's L1 and L2 but leaves most of the L3. The counters split the time
// into prepare() and write() (clock reads around each, so their sum is a little above the total).
void BM_HostPlanColdCaches(benchmark::State& state) {
  const auto kind = static_cast<Kind>(state.range(0));
  Workload w(kind);
  cuda::HostPlanner planner(planner_config());
  planner.enable_row_table(w.pool.size(), (w.pool.max_context_len() + kPage - 1) / kPage);
  Staging staging;
  std::vector<uint64_t> evict(static_cast<size_t>(state.range(1)) << 17, 1);
  for (int i = 0; i < 16; ++i) plan_step(planner, w, staging, kPage);
  PhaseTimes times;
  uint64_t sink = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (uint64_t& x : evict) sink += x++;
    benchmark::DoNotOptimize(sink);
    state.ResumeTiming();
    plan_step(planner, w, staging, kPage, &times);
    benchmark::ClobberMemory();
  }
  const double n = static_cast<double>(state.iterations()) * 1e3;
  auto us = [&](Clock::duration d) {
    return std::chrono::duration<double, std::nano>(d).count() / n;
  };
  state.counters["plan_us"] = us(times.prepare + times.write);
  state.counters["prepare_us"] = us(times.prepare);
  state.counters["write_us"] = us(times.write);
}
// The minimum over repetitions as well: on a shared machine it is the figure least moved by
// other work.
double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

BENCHMARK(BM_HostPlanColdCaches)
    ->ComputeStatistics("min", min_of)
    ->ArgNames({"kind", "evict_mib"})
    ->Args({kDecode, 64})
    ->Args({kVerify, 64})
    ->Args({kExtend, 64})
    ->Args({kDecodeRagged, 64})
    ->Args({kDecodeScattered, 64})
    ->Args({kDecode, 4})
    ->Iterations(300);

BENCHMARK(BM_HostPlan)
    ->ArgNames({"kind", "page", "mla", "sections"})
    ->Args({kDecode, 16, 0, 0})
    ->Args({kVerify, 16, 0, 0})
    ->Args({kExtend, 16, 0, 0})
    ->Args({kDecodeRagged, 16, 0, 0})
    ->Args({kDecodeScattered, 16, 0, 0})
    ->Args({kDecode, 1, 0, 0})
    ->Args({kDecode, 64, 1, 0})
    ->Args({kVerify, 64, 1, 0})
    ->Args({kPrefill, 16, 0, 0})
    ->Args({kPrefill, 16, 0, 24});

void BM_MakeStepLayout(benchmark::State& state) {
  Workload w(static_cast<Kind>(state.range(0)));
  for (auto _ : state) {
    StepLayout l = make_step_layout(w.batch);
    benchmark::DoNotOptimize(l);
  }
}
BENCHMARK(BM_MakeStepLayout)->ArgName("kind")->Arg(kDecode)->Arg(kVerify)->Arg(kExtend);

// Into a layout kept across steps, as AttentionRuntime::check_step does.
void BM_MakeStepLayoutInPlace(benchmark::State& state) {
  Workload w(static_cast<Kind>(state.range(0)));
  StepLayout l;
  for (auto _ : state) {
    make_step_layout(w.batch, l);
    benchmark::DoNotOptimize(l);
  }
}
BENCHMARK(BM_MakeStepLayoutInPlace)->ArgName("kind")->Arg(kDecode)->Arg(kVerify)->Arg(kExtend);

// A model of one small full-attention layer (1 head of 8): the host work of a step does not
// depend on the heads.
ModelSpec one_small_layer(const char* name, DType dtype, int max_context_len) {
  ModelSpec m;
  m.name = name;
  m.dtype = dtype;
  m.max_context_len = max_context_len;
  LayerSpec l;
  l.layer_id = 0;
  l.kind = LayerKind::full;
  l.num_q_heads = 1;
  l.num_kv_heads = 1;
  l.head_dim = 8;
  l.v_head_dim = 8;
  m.layers.push_back(l);
  return m;
}

// The host KV cache's begin_step (out_cache_loc checks) on a one-layer pool of the same slots.
void BM_KVCacheBeginStep(benchmark::State& state) {
  Workload w(static_cast<Kind>(state.range(0)));
  const ModelSpec m = one_small_layer("plan-bench", DType::bf16, w.pool.max_context_len());
  KVCacheConfig cfg;
  cfg.page_size = kPage;
  cfg.full_slots = (static_cast<int64_t>(kBatch) * ((2048 + 16 + kPage - 1) / kPage) + 1) * kPage;
  cfg.max_num_tokens = static_cast<int>(w.batch.num_tokens());
  std::unique_ptr<KVCache> kv = make_host_kv_cache(m, cfg);
  for (auto _ : state) kv->begin_step(w.batch);
}
BENCHMARK(BM_KVCacheBeginStep)->ArgName("kind")->Arg(kDecode)->Arg(kVerify)->Arg(kExtend);

// DcpAttention::begin_step + end_step of a steady decode: `batch` requests of `context` tokens
// (reserve_prefix: slots on their owners, no prefill) over `ranks` ranks of the `cpu` (backend 0)
// or `reference` (1) backend, page size 1, one small layer (the step's host work does not depend
// on the heads). Each step decodes the next token of every request; after 4096 steps the
// requests are freed and reserved again (untimed). direct 0: every entry on a key-list row (a
// copy of its keys, the path before request rows were read directly; set_direct_rows(false)).
// The cpu backend's own plan copies each request's slots too (its layout); reference's does not,
// so its figure is the group's own host work. Counter `copied`: slot ids written per step.
void BM_DcpDecodeBeginStep(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0)), context = static_cast<int>(state.range(1));
  const int ranks = static_cast<int>(state.range(2));
  const bool reference = state.range(3) != 0, direct = state.range(4) != 0;
  constexpr int kSteps = 4096;
  const ModelSpec m = one_small_layer("dcp-bench", DType::f32, context + kSteps);
  Options o;
  o.attention_backend = reference ? "reference" : "cpu";
  o.kv_cache_dtype = "fp32";
  o.dcp_size = ranks;
  RuntimeConfig c;
  c.max_requests = batch;
  c.max_num_tokens = std::max(batch, 64);
  c.max_context_len = m.max_context_len;
  c.kv_slots = static_cast<int64_t>(batch) * ((m.max_context_len + ranks - 1) / ranks + 64);
  c.cuda_graphs = false;
  DcpAttention g(m, o, c);
  g.set_direct_rows(direct);
  std::vector<int64_t> rows(batch);
  std::iota(rows.begin(), rows.end(), int64_t{0});
  int step = kSteps;
  std::vector<int32_t> seq(batch);
  for (auto _ : state) {
    if (step == kSteps) {
      state.PauseTiming();
      for (int r = 0; r < batch; ++r) {
        g.free_request(r);
        g.reserve_prefix(r, context - 1);
      }
      step = 0;
      state.ResumeTiming();
    }
    std::fill(seq.begin(), seq.end(), context + step++);
    ForwardBatch b = make_decode_batch(rows, seq);
    b.out_cache_loc.assign(static_cast<size_t>(batch), 0);
    g.begin_step(b);
    g.end_step();
  }
  int64_t copied = 0;
  for (int r = 0; r < ranks; ++r) copied += g.rank(r).step_counts().copied;
  state.counters["copied"] = static_cast<double>(copied);
}
BENCHMARK(BM_DcpDecodeBeginStep)
    ->ArgNames({"batch", "context", "ranks", "backend", "direct"})
    ->ArgsProduct({{8}, {131072}, {2}, {0, 1}, {0, 1}})
    ->ArgsProduct({{64}, {8192}, {2}, {0, 1}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace attnrt

BENCHMARK_MAIN();
