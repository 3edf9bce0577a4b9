#include "bench/harness/runner.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string_view>

#include "attnrt/backend/options.h"
#include "attnrt/backend/selection.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/env.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/model/model_spec.h"
#include "backends/cpu/cpu_backend.h"
#include "bench/harness/device_row.h"
#include "bench/harness/row_check.h"
#include "bench/harness/row_figures.h"
#include "bench/harness/values.h"

namespace attnrt::bench {

namespace {

// The dense check's relative L2 tolerance for fp8 prefill rows (Workload::fp8_prefill): q and the
// softmax weights each rounded to e4m3, 2^-4 relative at most, so 2^-3 (the 16-bit rows: 2e-2).
constexpr double kFp8PrefillCheckTolerance = 0.125;

ModelSpec bench_model(const Workload& w) {
  ModelSpec m;
  m.name = "bench";
  m.dtype = DType::bf16;
  m.max_context_len = std::max(w.kv_len(), 16);
  LayerSpec l;
  l.layer_id = 0;
  l.kind = LayerKind::full;
  l.num_q_heads = w.q_heads;
  l.num_kv_heads = w.kv_heads;
  l.head_dim = w.head_dim;
  l.v_head_dim = w.v_head_dim();
  if (w.is_mla()) {
    // The absorbed form of src/model/layer_builders.h mla_layer: one latent head, V its first
    // kv_lora_rank columns.
    l.kind = LayerKind::mla;
    l.kv_lora_rank = w.kv_lora_rank;
    l.qk_rope_head_dim = w.head_dim - w.kv_lora_rank;
  }
  m.layers.push_back(l);
  return m;
}

int tree_depth(const std::vector<int32_t>& parent) {
  int depth = 0;
  for (size_t t = 0; t < parent.size(); ++t) {
    int d = 0;
    for (int u = static_cast<int>(t); parent[u] >= 0; u = parent[u]) ++d;
    depth = std::max(depth, d);
  }
  return depth;
}

// One workload laid out in a paged pool: requests' pages drawn from a random permutation of the
// pool, every cached K/V element random, and this step's q/k/v random.
struct RowData {
  Workload w;
  ModelSpec model;
  KVCacheConfig config;
  std::unique_ptr<KVCache> kv;
  std::unique_ptr<ReqToTokenPool> req_to_token;
  ForwardBatch batch;
  std::vector<int32_t> parents;  // verify: per request block
  HostBuffer q, k, v;

  RowData(const Workload& workload, uint64_t seed) : w(workload), model(bench_model(workload)) {
    const int per_request_pages = (w.kv_len() + w.page_size - 1) / w.page_size;
    const int64_t pages = int64_t{w.batch} * per_request_pages;
    config.full_slots = pages * w.page_size;
    config.page_size = w.page_size;
    config.dtype = w.kv_dtype;
    config.max_num_tokens = static_cast<int>(std::max<int64_t>(w.num_tokens(), 1));
    kv = make_host_kv_cache(model, config);
    req_to_token = std::make_unique<ReqToTokenPool>(w.batch, w.kv_len());

    // Page 0 is reserved; usable pages 1..pages are handed out in a random order so no request
    // reads contiguous memory by accident.
    std::vector<int64_t> order(pages);
    std::iota(order.begin(), order.end(), int64_t{1});
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
    std::vector<int64_t> rows(w.batch);
    std::vector<int64_t> slots(w.kv_len());
    for (int r = 0; r < w.batch; ++r) {
      rows[r] = req_to_token->alloc();
      for (int j = 0; j < w.kv_len(); ++j) {
        int64_t page = order[static_cast<size_t>(r) * per_request_pages + j / w.page_size];
        slots[j] = page * w.page_size + j % w.page_size;
      }
      req_to_token->write(static_cast<int>(rows[r]), 0, slots);
    }

    const std::vector<int32_t> prefix(w.batch, w.prefix_len);
    switch (w.kind) {
      case WorkloadKind::decode:
        batch = make_decode_batch(rows, std::vector<int32_t>(w.batch, w.kv_len()));
        break;
      case WorkloadKind::prefill:
      case WorkloadKind::extend:
        batch = make_extend_batch(rows, prefix, std::vector<int32_t>(w.batch, w.new_tokens));
        break;
      case WorkloadKind::verify_chain:
      case WorkloadKind::verify_tree: {
        parents = verify_parents(w);
        SpecInfo spec;
        spec.draft_token_num = w.new_tokens;
        spec.topk = w.topk;
        for (int r = 0; r < w.batch; ++r) {
          spec.parents.insert(spec.parents.end(), parents.begin(), parents.end());
        }
        batch = make_verify_batch(rows, prefix, std::move(spec));
        break;
      }
    }
    batch.out_cache_loc.clear();
    for (int r = 0; r < w.batch; ++r) {
      for (int t = 0; t < w.new_tokens; ++t) {
        batch.out_cache_loc.push_back(req_to_token->get(static_cast<int>(rows[r]), w.prefix_len + t));
      }
    }

    const KVLayerView view = kv->layer(0);
    ValueTable kv_values(w.kv_dtype, seed + 1);
    // An MLA pool has one latent row per token: V is a view of its first kv_lora_rank columns.
    const bool latent = w.is_mla();
    ATTNRT_CHECK(view.k_row_stride == int64_t{view.kv_heads} * view.head_dim &&
                     view.v_row_stride == (latent ? view.k_row_stride
                                                  : int64_t{view.kv_heads} * view.v_head_dim),
                 "bench expects dense token-major KV rows; the pool has row strides {} / {}",
                 view.k_row_stride, view.v_row_stride);
    kv_values.fill(view.k, view.num_rows * view.k_row_stride, seed + 2);
    if (!latent) kv_values.fill(view.v, view.num_rows * view.v_row_stride, seed + 3);

    const int64_t t = w.num_tokens();
    q = HostBuffer(DType::bf16, {t, w.q_heads, w.head_dim});
    k = HostBuffer(DType::bf16, {t, w.kv_heads, w.head_dim});
    v = HostBuffer(DType::bf16, {t, w.kv_heads, w.v_head_dim()});
    ValueTable act(DType::bf16, seed + 4);
    act.fill(q.data(), q.numel(), seed + 5);
    act.fill(k.data(), k.numel(), seed + 6);
    act.fill(v.data(), v.numel(), seed + 7);
  }

  const LayerSpec& layer() const { return model.layers[0]; }
};

// A backend bound to one RowData, with its own output buffer. On a GPU the backend gets a device
// copy of the row (pool, q / k / v, out); `out` on the host is filled by collect().
struct BackendRun {
  Options options;
  std::unique_ptr<DeviceRow> gpu;
  std::unique_ptr<AttentionBackend> backend;
  HostBuffer out;
  RowData* data = nullptr;

  // `own_stream`: on a GPU, the row's work goes to its KV cache's own stream rather than the
  // legacy default stream the device timer records on (make_device_row).
  BackendRun(RowData& d, const std::string& name, int threads, const Registry& registry,
             Device device, bool own_stream = false, bool deterministic = false)
      : data(&d) {
    const Workload& w = d.w;
    options.attention_backend = name;
    options.deterministic = deterministic;
    options.page_size = w.page_size;
    options.kv_cache_dtype = std::string(dtype_name(w.kv_dtype));
    const BackendEntry* entry = registry.find(name);
    options.fp8_prefill_attention =
        w.fp8_prefill && entry != nullptr && entry->caps.fp8_prefill_attention;
    options.num_threads = threads;
    if (is_verify(w.kind)) {
      options.speculative_num_draft_tokens = w.new_tokens;
      options.speculative_eagle_topk = w.topk;
      options.speculative_num_steps =
          w.topk > 1 ? std::max(1, tree_depth(d.parents)) : w.new_tokens - 1;
    }
    // Validation against the backend's caps gives the user the same message `attnrt run` would.
    Selection selection = resolve_backends(options, d.model, registry);
    out = HostBuffer(DType::bf16, {w.num_tokens(), w.q_heads, w.v_head_dim()});
    BackendContext ctx;
    ctx.model = &d.model;
    ctx.options = &options;
    ctx.kv_cache = d.kv.get();
    ctx.req_to_token = d.req_to_token.get();
    ctx.device = device;
    if (device.kind != DeviceKind::cpu) {
      gpu = make_device_row(device, d.model, d.config, *d.kv, d.q, d.k, d.v, out, own_stream);
      ctx.kv_cache = &gpu->cache();
    }
    backend = create_backend(selection, ctx, registry);
  }

  KVCache& cache() { return gpu ? gpu->cache() : *data->kv; }

  void plan() {
    cache().begin_step(data->batch);
    backend->init_forward_metadata(data->batch);
  }

  void forward() {
    AttnArgs args;
    if (gpu) {
      args = gpu->args();
    } else {
      args.q = data->q.view();
      args.k = data->k.view();
      args.v = data->v.view();
      args.out = out.view();
    }
    args.save_kv = true;
    backend->forward(args, data->layer(), data->batch);
  }

  // After a forward: the output on the host, and on a GPU the step's K/V stored in the host pool
  // too (the host store quantises exactly as the device's), which the dense check reads.
  void collect() {
    if (!gpu) return;
    gpu->download_out(out);
    data->kv->begin_step(data->batch);
    data->kv->store_step_kv(0, data->k.view(), data->v.view());
  }

  // Host time of the plan. A GPU backend keeps the committed page tables of its rows on the
  // device once a step's kernels ran, so each timed plan follows a forward, as in serving; the GPU
  // is drained outside the timed region. A backend that times its plan's phases (cuda) gets a
  // second pass of the same steps with that timing on, into `parts`.
  // ATTNRT_BENCH_PLAN_SPIN_US=N busy-waits N us between the drain and each plan (untimed): a core
  // that slept through a blocking wait is then awake and clocked up again, for A/B timing.
  TimingStats time_plan(int repeats, std::optional<PlanParts>* parts = nullptr) {
    if (!gpu) {
      return time_host_call([&] { backend->init_forward_metadata(data->batch); }, repeats);
    }
    const double spin = plan_spin_seconds();
    const int steps = std::max(repeats, 20) + 2;
    auto drain = [&] {
      forward();
      gpu->synchronize();
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(spin);
      while (std::chrono::steady_clock::now() < until) {
      }
    };
    std::vector<double> samples;
    for (int i = 0; i < steps; ++i) {
      cache().begin_step(data->batch);
      const auto t0 = std::chrono::steady_clock::now();
      backend->init_forward_metadata(data->batch);
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      drain();
      if (i >= 2) samples.push_back(t);
    }
    if (parts != nullptr && backend->set_plan_timing(true)) {
      std::array<std::vector<double>, 5> part;
      for (int i = 0; i < steps; ++i) {
        cache().begin_step(data->batch);
        backend->init_forward_metadata(data->batch);
        const std::array<double, 5> p = backend->plan_part_seconds();
        drain();
        if (i < 2) continue;
        for (size_t k = 0; k < p.size(); ++k) part[k].push_back(p[k]);
      }
      backend->set_plan_timing(false);
      *parts = PlanParts{TimingStats::from_samples(std::move(part[0])),
                         TimingStats::from_samples(std::move(part[1])),
                         TimingStats::from_samples(std::move(part[2])),
                         TimingStats::from_samples(std::move(part[3])),
                         TimingStats::from_samples(std::move(part[4]))};
    }
    return TimingStats::from_samples(std::move(samples));
  }

  static double plan_spin_seconds() {
    const auto us = env_integer("ATTNRT_BENCH_PLAN_SPIN_US", 0, 1000000, "bench",
                                "microseconds, 0 to 1000000");
    return static_cast<double>(us.value_or(0)) * 1e-6;
  }
};

// Attention of sampled query rows recomputed in float64 straight from the pool through the
// req_to_token rows and the docs/workloads.md masks, independently of any backend's plan.
CheckResult dense_check(const RowData& d, const HostBuffer& out, double max_work, double tol,
                        uint64_t seed) {
  const Workload& w = d.w;
  const int64_t tokens = w.num_tokens();
  const std::vector<int64_t> rows =
      sample_query_rows(tokens, attention_work(w) / static_cast<double>(tokens), max_work, seed);
  const KVLayerView view = d.kv->layer(0);
  const int hq = w.q_heads, hkv = w.kv_heads, dim = w.head_dim, group = hq / hkv;
  const int dv = w.v_head_dim();  // MLA: the first kv_lora_rank columns of the latent row
  const double scale = d.layer().softmax_scale();
  std::vector<double> errs(rows.size(), 0.0);

#pragma omp parallel for schedule(dynamic)
  for (int64_t s = 0; s < static_cast<int64_t>(rows.size()); ++s) {
    const int64_t tok = rows[s];
    const int r = static_cast<int>(tok / w.new_tokens), t = static_cast<int>(tok % w.new_tokens);
    const int row = static_cast<int>(d.batch.req_pool_indices[r]);
    // Keys this query sees: the whole prefix, then its own new tokens by the mode's mask.
    std::vector<int64_t> keys;
    for (int j = 0; j < w.prefix_len; ++j) keys.push_back(d.req_to_token->get(row, j));
    if (w.kind == WorkloadKind::verify_tree) {
      for (int u = 0; u < w.new_tokens; ++u) {
        bool ancestor = false;
        for (int a = t; a >= 0; a = d.parents[a]) ancestor = ancestor || a == u;
        if (ancestor) keys.push_back(d.req_to_token->get(row, w.prefix_len + u));
      }
    } else {
      for (int u = 0; u <= t; ++u) keys.push_back(d.req_to_token->get(row, w.prefix_len + u));
    }
    const size_t nk = keys.size();
    // One KV head at a time: its K row is converted once for the `group` query heads sharing it,
    // and memory stays O(group * keys) however long the context is.
    std::vector<double> logits(static_cast<size_t>(group) * nk), o(static_cast<size_t>(group) * dv);
    std::vector<double> qf(static_cast<size_t>(group) * dim), m(group), den(group);
    std::vector<double> kv_row(dim);
    double worst = 0;
    for (int g = 0; g < hkv; ++g) {
      for (int a = 0; a < group; ++a) {
        const uint16_t* qrow = d.q.ptr<uint16_t>() + (tok * hq + g * group + a) * dim;
        for (int e = 0; e < dim; ++e) qf[a * dim + e] = bf16_to_float(qrow[e]);
      }
      std::fill(m.begin(), m.end(), -INFINITY);
      for (size_t j = 0; j < nk; ++j) {
        const int64_t base = keys[j] * view.k_row_stride + int64_t{g} * dim;
        for (int e = 0; e < dim; ++e) {
          kv_row[e] = double{load_as_float(view.k, view.dtype, base + e)} * view.k_scale;
        }
        for (int a = 0; a < group; ++a) {
          double dot = 0;
          for (int e = 0; e < dim; ++e) dot += qf[a * dim + e] * kv_row[e];
          logits[a * nk + j] = dot * scale;
          m[a] = std::max(m[a], dot * scale);
        }
      }
      std::fill(o.begin(), o.end(), 0.0);
      std::fill(den.begin(), den.end(), 0.0);
      for (size_t j = 0; j < nk; ++j) {
        const int64_t base = keys[j] * view.v_row_stride + int64_t{g} * dv;
        for (int e = 0; e < dv; ++e) {
          kv_row[e] = double{load_as_float(view.v, view.dtype, base + e)} * view.v_scale;
        }
        for (int a = 0; a < group; ++a) {
          double p = std::exp(logits[a * nk + j] - m[a]);
          den[a] += p;
          for (int e = 0; e < dv; ++e) o[a * dv + e] += p * kv_row[e];
        }
      }
      for (int a = 0; a < group; ++a) {
        for (int e = 0; e < dv; ++e) o[a * dv + e] /= den[a];
        const uint16_t* got = out.ptr<uint16_t>() + (tok * hq + g * group + a) * dv;
        worst = std::max(worst, rel_err(got, o.data() + a * dv, dv));
      }
    }
    errs[s] = worst;
  }

  CheckResult c;
  c.rows_checked = static_cast<int>(rows.size());
  c.max_rel_err = *std::max_element(errs.begin(), errs.end());
  c.tolerance = tol;
  c.passed = c.max_rel_err <= tol;
  c.method = fmt::format("float64 recomputation from the pool of {} of {} query rows x {} heads",
                         rows.size(), tokens, hq);
  return c;
}

const Registry& registry_of(const BenchConfig& config) {
  return config.registry != nullptr ? *config.registry : Registry::global();
}

void say(const BenchConfig& config, const std::string& line) {
  if (config.progress) config.progress(line);
}

std::string fmt_bytes(double b) {
  if (b >= double(1ull << 30)) return fmt::format("{:.2f} GiB", b / double(1ull << 30));
  return fmt::format("{:.1f} MiB", b / double(1 << 20));
}

ReferenceResult measure_reference(const BenchConfig& config, const Workload& w, int threads,
                                  double backend_work_per_second) {
  ReferenceResult ref;
  ref.workload = fit_workload(w, config.reference_max_bytes, config.reference_max_work,
                              "reference measured scaled down");
  RowData data(ref.workload, config.seed ^ 0x7e7e7e7e);
  BackendRun tested(data, config.backend, threads, registry_of(config), config.device,
                    /*own_stream=*/false, config.deterministic);
  BackendRun oracle(data, "reference", threads, registry_of(config), Device::cpu());
  tested.plan();
  tested.forward();
  tested.collect();
  oracle.plan();
  oracle.forward();
  ref.check = compare_outputs(tested.out, oracle.out, ref.workload, config.check_tolerance);
  auto timer = make_device_timer(Device::cpu());
  // The comparison run above already warmed the reference up.
  ref.time = time_repeated(*timer, [&] { oracle.forward(); }, 0, config.reference_repeats);
  ref.work_per_second = attention_work(ref.workload) / ref.time.median;
  ref.speedup = backend_work_per_second / ref.work_per_second;
  if (ref.workload == w) {
    ref.note = fmt::format("reference on the same shape, median of {}", ref.time.repeats);
  } else {
    ref.note = fmt::format(
        "reference on {} (the full row would take too long), median of {}; speed-up compares "
        "attention work per second",
        ref.workload.shape(), ref.time.repeats);
  }
  return ref;
}

}  // namespace

std::string auto_bench_backend(std::string* reason) {
  Workload w = standard_workloads().front();
  Options options;
  options.page_size = w.page_size;
  Selection selection = resolve_backends(options, bench_model(w));
  if (reason != nullptr) {
    for (const std::string& r : selection.reasons) {
      if (r.rfind("decode", 0) == 0 || reason->empty()) *reason = r;
    }
  }
  return selection.decode;
}

bool BenchResult::all_passed() const {
  return std::all_of(rows.begin(), rows.end(),
                     [](const RowResult& r) { return r.status == "ok" || r.status == "n/a"; }) &&
         std::all_of(linear_rows.begin(), linear_rows.end(),
                     [](const LinearRowResult& r) { return r.status == "ok"; }) &&
         std::all_of(dsa_rows.begin(), dsa_rows.end(),
                     [](const DsaRowResult& r) { return r.status == "ok" || r.status == "n/a"; });
}

RowResult run_row(const BenchConfig& config, const Workload& w, const Ceilings& ceilings) {
  if (w.is_mla_mha()) return run_mla_mha_row(config, w, ceilings);
  RowResult row;
  start_row(row, w, w.is_mla() ? mla_workloads() : attention_workloads(), counted_bytes(w),
            counted_flops(w));
  const int threads = resolve_threads(config.threads);
  try {
    double work_per_second = 0;
    {
      say(config, fmt::format("{}: setting up {} ({} of KV)", w.name, w.shape(), fmt_bytes(row.bytes)));
      RowData data(w, config.seed);
      BackendRun run(data, config.backend, threads, registry_of(config), config.device,
                     /*own_stream=*/false, config.deterministic);
      run.plan();
      run.forward();
      run.collect();
      say(config, fmt::format("{}: checking", w.name));
      // fp8 prefill rows: q and P rounded to e4m3 (2^-4 relative each) on top of the fp8 KV.
      const double tolerance = w.fp8_prefill
                                   ? std::max(config.check_tolerance, kFp8PrefillCheckTolerance)
                                   : config.check_tolerance;
      row.check = dense_check(data, run.out, config.check_max_work, tolerance, config.seed);
      if (!row.check.passed) {
        mark_check_failed(row);
        return row;
      }
      say(config, fmt::format("{}: timing ({} repeats)", w.name, config.repeats));
      row.plan = run.time_plan(config.repeats);
      auto timer = make_device_timer(config.device);
      row.time = time_repeated(*timer, [&] { run.forward(); }, config.warmup, config.repeats);
      work_per_second = attention_work(w) / row.time.median;
      set_rate(row, ceilings);
    }
    if (is_verify(w.kind)) {
      Workload dw = decode_companion(w);
      say(config, fmt::format("{}: timing the decode {} it is compared with", w.name, dw.shape()));
      RowData data(dw, config.seed + 17);
      BackendRun run(data, config.backend, threads, registry_of(config), config.device,
                     /*own_stream=*/false, config.deterministic);
      run.plan();
      run.forward();
      run.collect();
      CheckResult c = dense_check(data, run.out, config.check_max_work / 4,
                                  config.check_tolerance, config.seed);
      ATTNRT_CHECK(c.passed, "{}: the decode {} it is compared with fails its check ({:.3g})",
                   w.name, dw.shape(), c.max_rel_err);
      auto timer = make_device_timer(config.device);
      row.decode_time = time_repeated(*timer, [&] { run.forward(); }, config.warmup, config.repeats);
      row.decode_workload = dw;
      row.decode_ratio = row.time.median / row.decode_time.median;
    }
    if (config.compare_reference) {
      say(config, fmt::format("{}: measuring the reference backend", w.name));
      row.reference = measure_reference(config, w, threads, work_per_second);
      mark_reference_mismatch(row);
    }
  } catch (const Error& e) {
    row.status = "error";
    row.error = e.what();
  }
  return row;
}

// The plan rows run on their KV cache's own non-blocking stream, as AttentionRuntime's steps do
// (they need no device timer); ATTNRT_BENCH_PLAN_STREAM=legacy puts them on the legacy default
// stream, where each call also orders itself against every blocking stream, for A/B timing.
bool plans_on_own_stream() {
  const char* env = std::getenv("ATTNRT_BENCH_PLAN_STREAM");
  if (env == nullptr || *env == '\0') return true;
  const std::string_view v(env);
  ATTNRT_CHECK(v == "own" || v == "legacy",
               "bench: ATTNRT_BENCH_PLAN_STREAM={} is invalid; use own or legacy", env);
  return v == "own";
}

std::vector<PlanTiming> measure_plans_bs256(const BenchConfig& config) {
  const int threads = resolve_threads(config.threads);
  const bool own_stream = plans_on_own_stream();
  std::vector<PlanTiming> out;
  Workload decode;
  decode.name = "plan-decode-256x2048";
  decode.batch = 256;
  decode.prefix_len = 2047;
  Workload verify = decode;
  verify.name = "plan-verify-chain-256x(2048+8)";
  verify.kind = WorkloadKind::verify_chain;
  verify.prefix_len = 2048;
  verify.new_tokens = 8;
  Workload extend = verify;
  extend.name = "plan-extend-256x(2048+16)";
  extend.kind = WorkloadKind::extend;
  extend.new_tokens = 16;
  for (const Workload& w : {decode, verify, extend}) {
    PlanTiming p;
    p.workload = w;
    p.stream = own_stream ? "own" : "legacy";
    try {
      say(config, fmt::format("{}: timing the host plan", w.name));
      RowData data(w, config.seed + 31);
      BackendRun run(data, config.backend, threads, registry_of(config), config.device, own_stream,
                     config.deterministic);
      run.plan();
      run.forward();
      p.time = run.time_plan(std::max(config.repeats, 50), &p.parts);
    } catch (const Error& e) {
      p.error = e.what();
    }
    out.push_back(std::move(p));
  }
  return out;
}

BenchResult run_bench(const BenchConfig& config) {
  ATTNRT_CHECK(!config.workloads.empty() || !config.linear_workloads.empty() ||
                   !config.dsa_workloads.empty(),
               "no workloads to run");
  // Looking the backend up registers the built-in backends, and with them the GPU probes.
  const BackendEntry& entry = registry_of(config).get(config.backend);
  ATTNRT_CHECK(std::find(entry.caps.devices.begin(), entry.caps.devices.end(),
                         config.device.kind) != entry.caps.devices.end(),
               "bench: backend '{}' does not run on {}", config.backend,
               device_name(config.device));
  ATTNRT_CHECK(config.repeats >= 1, "--repeats {} is invalid: use at least 1 (10 or more for "
                                    "figures worth recording)", config.repeats);
  BenchResult result;
  result.backend = config.backend;
  result.threads = resolve_threads(config.threads);
  if (config.backend == "cpu") result.backend_simd_target = ::attnrt::cpu_simd_target();
  result.repeats = config.repeats;
  result.warmup = config.warmup;
  // Only DSA rows on a backend that does not serve DSA: every row is n/a, nothing is measured.
  std::string no_dsa;
  const bool only_na = config.workloads.empty() && config.linear_workloads.empty() &&
                       !backend_serves_dsa(config, &no_dsa);
  if (only_na) {
    result.ceilings.device = config.device;
    result.ceilings.threads = result.threads;
    const std::string why = "not measured: no row runs (" + no_dsa + ")";
    result.ceilings.memory.unavailable = why;
    result.ceilings.fp32.unavailable = why;
    result.ceilings.bf16.unavailable = why;
    result.timer_method = "none (no row runs)";
    result.dsa_rows = run_dsa_rows(config, config.dsa_workloads, result.ceilings);
    return result;
  }
  say(config, fmt::format("measuring the ceilings of {} on {} threads", device_name(config.device),
                          result.threads));
  CeilingOptions co = config.ceiling_options;
  co.threads = result.threads;
  result.ceilings = measure_ceilings(config.device, co);
  if (config.device.kind == DeviceKind::cuda) result.host_sync = host_sync_mode(config.device);
  result.timer_method = make_device_timer(config.device)->method();
  for (const Workload& w : config.workloads) {
    result.rows.push_back(run_row(config, w, result.ceilings));
  }
  for (const LinearWorkload& w : config.linear_workloads) {
    result.linear_rows.push_back(run_linear_row(config, w, result.ceilings));
  }
  if (!config.dsa_workloads.empty()) {
    result.dsa_rows = run_dsa_rows(config, config.dsa_workloads, result.ceilings);
  }
  // The step costs are those of attention steps: measured when attention rows ran.
  if (config.device.kind != DeviceKind::cpu && config.gpu_step_costs && !config.workloads.empty()) {
    result.plans = measure_plans_bs256(config);
    say(config, "graph replay: a 32-layer decode step, eager and as a CUDA graph");
    result.graph = measure_graph_overhead(config);
  }
  return result;
}

}  // namespace attnrt::bench
