// The DSA rows of `attnrt bench --suite dsa` (docs/workloads.md "DSA rows"). A row's shape is laid
// out once: a latent pool and an index-key cache of random values (every request's pages a random
// permutation of the pool's), the step's random inputs (latent q and row, index q, index k,
// weights). Then, each measured once for the rows of that shape that need it:
//   - the DSA step: one forward of the DSA layer on the backend under test, checked against the
//     reference backend (outputs and selections) on sampled query tokens;
//   - the sparse attention alone: the same backend's MLA decode over the step's own selection
//     (each request's keys are its selected slots), checked against the step's output; timed
//     alternately with the step, so the indexer's time is their difference repetition by
//     repetition;
//   - the dense MLA row of the same shape, through the mla suite's runner (run_row).
// On a GPU the tested backend runs on a device copy of the pools (latent rows and index keys) and
// of the step's tensors (DeviceStep); the host pools, updated with the step's stores, stay what
// the reference check reads.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <tuple>

#include "attnrt/backend/options.h"
#include "attnrt/backend/selection.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/index_key_cache.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/model/model_spec.h"
#include "bench/harness/device_row.h"
#include "bench/harness/row_check.h"
#include "bench/harness/row_figures.h"
#include "bench/harness/runner.h"
#include "bench/harness/values.h"
#include "src/model/layer_builders.h"

namespace attnrt::bench {

namespace {

const Registry& registry_of(const BenchConfig& config) {
  return config.registry != nullptr ? *config.registry : Registry::global();
}

void say(const BenchConfig& config, const std::string& line) {
  if (config.progress) config.progress(line);
}

// The layer of a row: DeepSeek-V3.2's MLA in the absorbed form (softmax scale 1/sqrt(576), as the
// mla suite's rows), with the indexer, or without it for the sparse attention alone.
ModelSpec dsa_model(const DsaWorkload& w, bool indexer) {
  LayerSpec l = layer_builders::mla_layer(0, w.q_heads, w.kv_lora_rank, w.rope_dim);
  l.scaling = 1.f / std::sqrt(static_cast<float>(w.latent_dim()));
  if (indexer) {
    l.indexer = {.index_topk = w.index_topk,
                 .index_n_heads = w.index_heads,
                 .index_head_dim = w.index_head_dim};
  }
  ModelSpec m;
  m.name = indexer ? "bench-dsa" : "bench-dsa-sparse";
  m.dtype = DType::bf16;
  m.max_context_len = std::max(w.kv_len, 16);
  m.layers = {l};
  return m;
}

HostBuffer random_bf16(std::initializer_list<int64_t> shape, const ValueTable& values,
                       uint64_t seed) {
  HostBuffer b(DType::bf16, shape);
  values.fill(b.data(), b.numel(), seed);
  return b;
}

// Rows `rows` of a [T, ...] buffer, as a buffer of their own.
HostBuffer take_rows(const HostBuffer& b, const std::vector<int64_t>& rows) {
  std::array<int64_t, kMaxDims> shape = b.view().shape;
  shape[0] = static_cast<int64_t>(rows.size());
  HostBuffer out(b.dtype(), shape, b.view().ndim);
  const size_t row_bytes = b.bytes() / static_cast<size_t>(b.view().shape[0]);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(static_cast<char*>(out.data()) + i * row_bytes,
                static_cast<const char*>(b.data()) + rows[i] * row_bytes, row_bytes);
  }
  return out;
}

// The step's inputs and outputs for some of its query tokens.
struct StepIo {
  HostBuffer q, k, index_q, index_k, weights, out, topk;

  AttnArgs args() const {
    AttnArgs a;
    a.q = q.view();
    a.k = k.view();
    a.out = out.view();
    a.save_kv = true;
    a.indexer = {
        .q = index_q.view(), .k = index_k.view(), .weights = weights.view(), .topk = topk.view()};
    return a;
  }
  StepIo rows(const std::vector<int64_t>& r) const {
    return {take_rows(q, r),       take_rows(k, r),   take_rows(index_q, r), take_rows(index_k, r),
            take_rows(weights, r), take_rows(out, r), take_rows(topk, r)};
  }
};

// One shape laid out: the DSA layer's pools, the requests, the step and its inputs.
struct DsaData {
  DsaWorkload w;
  ModelSpec model;
  KVCacheConfig config;
  std::unique_ptr<KVCache> kv;
  std::unique_ptr<ReqToTokenPool> req_to_token;
  std::vector<int64_t> rows;
  ForwardBatch batch;
  StepIo io;

  DsaData(const DsaWorkload& workload, uint64_t seed)
      : w(workload), model(dsa_model(workload, true)) {
    const int per_request_pages = (w.kv_len + w.page_size - 1) / w.page_size;
    const int64_t pages = int64_t{w.batch} * per_request_pages;
    config.full_slots = pages * w.page_size;
    config.page_size = w.page_size;
    config.dtype = DType::bf16;
    config.max_num_tokens = static_cast<int>(w.num_tokens());
    kv = make_host_kv_cache(model, config);
    req_to_token = std::make_unique<ReqToTokenPool>(w.batch, w.kv_len);
    // Page 0 is reserved; the others are handed out in a random order.
    std::vector<int64_t> order(pages);
    std::iota(order.begin(), order.end(), int64_t{1});
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
    std::vector<int64_t> slots(w.kv_len);
    for (int r = 0; r < w.batch; ++r) {
      rows.push_back(req_to_token->alloc());
      for (int j = 0; j < w.kv_len; ++j) {
        const int64_t page = order[static_cast<size_t>(r) * per_request_pages + j / w.page_size];
        slots[j] = page * w.page_size + j % w.page_size;
      }
      req_to_token->write(static_cast<int>(rows.back()), 0, slots);
    }
    batch = w.prefill ? make_extend_batch(rows, std::vector<int32_t>(w.batch, 0),
                                          std::vector<int32_t>(w.batch, w.kv_len))
                      : make_decode_batch(rows, std::vector<int32_t>(w.batch, w.kv_len));
    batch.out_cache_loc.clear();
    for (int r = 0; r < w.batch; ++r) {
      for (int t = 0; t < w.new_tokens(); ++t) {
        batch.out_cache_loc.push_back(
            req_to_token->get(static_cast<int>(rows[r]), w.prefix_len() + t));
      }
    }

    const KVLayerView view = kv->layer(0);
    ValueTable(DType::bf16, seed + 1).fill(view.k, view.num_rows * view.k_row_stride, seed + 2);
    fill_index_keys(seed + 3);

    const int64_t t = w.num_tokens();
    ValueTable act(DType::bf16, seed + 4);
    io.q = random_bf16({t, w.q_heads, w.latent_dim()}, act, seed + 5);
    io.k = random_bf16({t, 1, w.latent_dim()}, act, seed + 6);
    io.index_q = random_bf16({t, w.index_heads, w.index_head_dim}, act, seed + 7);
    io.index_k = random_bf16({t, w.index_head_dim}, act, seed + 8);
    io.weights = random_bf16({t, w.index_heads}, act, seed + 9);
    io.out = HostBuffer(DType::bf16, {t, w.q_heads, w.kv_lora_rank});
    io.topk = HostBuffer(DType::i32, {t, w.index_topk});
  }

  // Every slot's index key: random N(0, 1) values quantised as the model stores them.
  void fill_index_keys(uint64_t seed) {
    IndexKeyView ik = kv->index_keys(0);
    const int dim = ik.dim;
    constexpr int kMaxDim = 1024;
    ATTNRT_CHECK(dim <= kMaxDim, "bench: index_head_dim {} is too large: at most {}", dim, kMaxDim);
    constexpr int64_t kChunk = 4096;  // slots per batch of random values
    std::vector<uint16_t> codes(static_cast<size_t>(kChunk) * dim);
    ValueTable values(DType::bf16, seed);
    for (int64_t first = 0; first < ik.num_rows; first += kChunk) {
      const int64_t n = std::min(kChunk, ik.num_rows - first);
      values.fill(codes.data(), n * dim, seed + static_cast<uint64_t>(first));
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        float key[kMaxDim];
        for (int e = 0; e < dim; ++e) key[e] = bf16_to_float(codes[i * dim + e]);
        const float scale = quantize_fp8_block(key, dim, ik.codes(first + i));
        std::memcpy(const_cast<uint8_t*>(ik.scale_ptr(first + i)), &scale, sizeof scale);
      }
    }
  }

  const LayerSpec& layer() const { return model.layers[0]; }
};

std::unique_ptr<AttentionBackend> make_backend(const std::string& name, const ModelSpec& model,
                                               Options& options, const DsaWorkload& w, KVCache* kv,
                                               const ReqToTokenPool* r2t, int threads,
                                               const Registry& registry,
                                               Device device = Device::cpu()) {
  options.attention_backend = name;
  options.page_size = w.page_size;
  options.kv_cache_dtype = "bf16";
  options.num_threads = threads;
  Selection selection = resolve_backends(options, model, registry);
  BackendContext ctx;
  ctx.model = &model;
  ctx.options = &options;
  ctx.kv_cache = kv;
  ctx.req_to_token = r2t;
  ctx.device = device;
  return create_backend(selection, ctx, registry);
}

// The tested backend's copy of a shape on a GPU: the latent pool and the index-key cache copied
// from the host ones, the step's tensors uploaded, out and topk allocated there. Work goes to the
// default stream, which the device timer records on.
struct DeviceStep {
  std::unique_ptr<DeviceRow> row;
  std::unique_ptr<DeviceTensors> tensors;
  TensorView index_q, index_k, weights, topk;

  DeviceStep(Device device, DsaData& d) {
    // The row's v is not read (an MLA layer stores and reads its latent rows through k).
    row = make_device_row(device, d.model, d.config, *d.kv, d.io.q, d.io.k, d.io.k, d.io.out);
    const IndexKeyView host = d.kv->index_keys(0);
    row->cache().copy_index_keys_from_host(0, host.data);
    tensors = make_device_tensors(device, row->cache());
    index_q = upload(*tensors, d.io.index_q);
    index_k = upload(*tensors, d.io.index_k);
    weights = upload(*tensors, d.io.weights);
    topk = tensors->allocate(d.io.topk.bytes(), d.io.topk.view());
  }

  KVCache& cache() { return row->cache(); }

  AttnArgs args() const {
    AttnArgs a = row->args();
    a.v = {};
    a.save_kv = true;
    a.indexer = {.q = index_q, .k = index_k, .weights = weights, .topk = topk};
    return a;
  }

  // After a step: its out and topk on the host, and its stores (latent rows and index keys) in
  // the host pools too, which the reference check reads (the host store quantises the index keys
  // exactly as the device's does).
  void collect(DsaData& d) {
    row->download_out(d.io.out);
    tensors->download(topk, d.io.topk.data(), d.io.topk.bytes());
    d.kv->begin_step(d.batch);
    d.kv->store_step_kv(0, d.io.k.view(), {});
    d.kv->store_step_index_k(0, d.io.index_k.view());
  }
};

// The query tokens the check recomputes on the reference backend: decode, the first and the last
// request; prefill, the last min(16, S) tokens of the request (each scores about S keys), run as
// an EXTEND over the prefix the step stored.
std::vector<int64_t> checked_tokens(const DsaWorkload& w) {
  if (!w.prefill)
    return w.batch > 1 ? std::vector<int64_t>{0, w.batch - 1} : std::vector<int64_t>{0};
  std::vector<int64_t> t;
  for (int i = std::max(0, w.kv_len - 16); i < w.kv_len; ++i) t.push_back(i);
  return t;
}

// Tokens of row `t` of a topk buffer (token indices, -1 after the last).
std::vector<int32_t> selection_of(const HostBuffer& topk, int64_t t, int k) {
  const int32_t* p = topk.ptr<int32_t>() + t * k;
  std::vector<int32_t> s;
  for (int i = 0; i < k && p[i] >= 0; ++i) s.push_back(p[i]);
  return s;
}

struct StepCheck {
  CheckResult check;
  int64_t selected = 0, mismatches = 0;
};

// The reference backend on the checked tokens against the tested step's outputs and selections.
// Run after the tested step, whose stores the reference's EXTEND prefix reads.
StepCheck check_against_reference(const BenchConfig& config, DsaData& d, int threads) {
  const DsaWorkload& w = d.w;
  const std::vector<int64_t> tokens = checked_tokens(w);
  ForwardBatch sub;
  std::vector<int64_t> loc;
  if (w.prefill) {
    const int m = static_cast<int>(tokens.size());
    sub = make_extend_batch({d.rows[0]}, {w.kv_len - m}, {m});
  } else {
    std::vector<int64_t> rows;
    for (int64_t t : tokens) rows.push_back(d.rows[t]);
    sub = make_decode_batch(rows, std::vector<int32_t>(rows.size(), w.kv_len));
  }
  for (int64_t t : tokens) loc.push_back(d.batch.out_cache_loc[t]);
  sub.out_cache_loc = loc;
  StepIo ref = d.io.rows(tokens);
  std::memset(ref.out.data(), 0, ref.out.bytes());
  Options options;
  auto oracle = make_backend("reference", d.model, options, w, d.kv.get(), d.req_to_token.get(),
                             threads, registry_of(config));
  d.kv->begin_step(sub);
  oracle->init_forward_metadata(sub);
  oracle->forward(ref.args(), d.layer(), sub);

  StepCheck c;
  double worst = 0;
  const int n = w.kv_lora_rank;
  std::vector<double> want(n);
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (int h = 0; h < w.q_heads; ++h) {
      const uint16_t* r = ref.out.ptr<uint16_t>() + (static_cast<int64_t>(i) * w.q_heads + h) * n;
      for (int e = 0; e < n; ++e) want[e] = bf16_to_float(r[e]);
      const uint16_t* got = d.io.out.ptr<uint16_t>() + (tokens[i] * w.q_heads + h) * n;
      worst = std::max(worst, rel_err(got, want.data(), n));
    }
    const std::vector<int32_t> a = selection_of(d.io.topk, tokens[i], w.index_topk);
    const std::vector<int32_t> b = selection_of(ref.topk, static_cast<int64_t>(i), w.index_topk);
    std::vector<int32_t> common;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
    c.selected += static_cast<int64_t>(b.size());
    c.mismatches += static_cast<int64_t>(std::max(a.size(), b.size()) - common.size());
  }
  c.check.rows_checked = static_cast<int>(tokens.size());
  c.check.max_rel_err = worst;
  c.check.tolerance = config.check_tolerance;
  // fp32 scores against float64 may swap keys whose scores agree to ~1e-7 (docs/dsa.md): one
  // selected key in a thousand may differ, and the output still agrees within the tolerance.
  c.check.passed = worst <= config.check_tolerance && c.mismatches * 1000 <= c.selected;
  c.check.method = fmt::format(
      "reference backend (float64) on {} of {} query tokens ({}) x {} heads: outputs, and "
      "selections ({} of {} selected keys differ)",
      tokens.size(), w.num_tokens(),
      w.prefill ? fmt::format("the last {}, as an EXTEND over the stored prefix", tokens.size())
                : "the first and the last request",
      w.q_heads, c.mismatches, c.selected);
  return c;
}

// The sparse attention alone: the backend's MLA decode (the layer without its indexer) over each
// request's selected slots, reading the step's latent rows from the pool.
struct SparseRun {
  ModelSpec model;
  Options options;
  std::unique_ptr<ReqToTokenPool> r2t;
  ForwardBatch batch;
  std::unique_ptr<AttentionBackend> backend;
  HostBuffer out;
  AttnArgs args;
  // On a GPU: a device copy of the latent pool of its own at page size 1 (the selected slots of a
  // request are not whole pages; the slot-major pool reads the same at any page size).
  std::unique_ptr<DeviceRow> gpu;

  // On the host pool, or (`device` not cpu) on a device copy of it.
  SparseRun(const BenchConfig& config, DsaData& d, int threads, Device device)
      : model(dsa_model(d.w, false)) {
    const DsaWorkload& w = d.w;
    r2t = std::make_unique<ReqToTokenPool>(w.batch, w.index_topk);
    std::vector<int64_t> rows;
    std::vector<int32_t> lens;
    for (int r = 0; r < w.batch; ++r) {
      const std::vector<int32_t> sel = selection_of(d.io.topk, r, w.index_topk);
      ATTNRT_CHECK(!sel.empty(), "{}: request {} selected no key", w.name, r);
      std::vector<int64_t> slots;
      for (int32_t j : sel) slots.push_back(d.req_to_token->get(static_cast<int>(d.rows[r]), j));
      rows.push_back(r2t->alloc());
      r2t->write(static_cast<int>(rows.back()), 0, slots);
      lens.push_back(static_cast<int32_t>(slots.size()));
      batch.out_cache_loc.push_back(slots.back());
    }
    const std::vector<int64_t> loc = batch.out_cache_loc;
    batch = make_decode_batch(rows, lens);
    batch.out_cache_loc = loc;
    out = HostBuffer(DType::bf16, {w.num_tokens(), w.q_heads, w.kv_lora_rank});
    DsaWorkload paged = w;
    KVCache* cache = d.kv.get();
    if (device.kind != DeviceKind::cpu) {
      KVCacheConfig one = d.config;
      one.page_size = 1;
      // The same rows as the host pool ((pages + 1) x page_size: its reserved page 0 too), so
      // every slot of its last page is in the copy: (full_slots + 1) x 1 rows at page size 1.
      one.full_slots = d.config.full_slots + d.w.page_size - 1;
      paged.page_size = 1;
      gpu = make_device_row(device, model, one, *d.kv, d.io.q, d.io.k, d.io.k, out);
      cache = &gpu->cache();
    }
    backend = make_backend(config.backend, model, options, paged, cache, r2t.get(), threads,
                           registry_of(config), device);
    args.q = gpu ? gpu->args().q : d.io.q.view();
    args.out = gpu ? gpu->args().out : out.view();
    args.save_kv = false;  // the latent rows are in the pool: only attention is measured
  }

  KVCache& cache(DsaData& d) { return gpu ? gpu->cache() : *d.kv; }

  // The output on the host once the GPU is done with it.
  void collect() {
    if (gpu) gpu->download_out(out);
  }
};

// Max relative error of two bf16 outputs [T, Hq, n], vector by vector.
double max_rel_err_bf16(const HostBuffer& got, const HostBuffer& want, int64_t vectors, int n) {
  double worst = 0;
  std::vector<double> w(n);
  for (int64_t v = 0; v < vectors; ++v) {
    for (int e = 0; e < n; ++e) w[e] = bf16_to_float(want.ptr<uint16_t>()[v * n + e]);
    worst = std::max(worst, rel_err(got.ptr<uint16_t>() + v * n, w.data(), n));
  }
  return worst;
}

// What one shape's measurements gave, shared by its rows.
struct ShapeMeasure {
  std::string error;  // set: every row of the shape is an error with this message
  StepCheck check;
  TimingStats step, sparse, index;
  std::optional<RowResult> dense;
  std::vector<std::string> notes;  // for every row of the shape
  double sparse_vs_step_err = 0;
};

TimingStats differences(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return TimingStats::from_samples(std::move(d));
}

ShapeMeasure measure_shape(const BenchConfig& config, const DsaWorkload& w, bool need_sparse,
                           bool need_dense, const Ceilings& ceilings) {
  ShapeMeasure m;
  const int threads = resolve_threads(config.threads);
  try {
    say(config, fmt::format("{}: setting up {} ({:.1f} MiB of index keys)", w.name, w.shape(),
                            dsa_index_bytes(w) / double(1 << 20)));
    DsaData d(w, config.seed);
    std::unique_ptr<DeviceStep> gpu;
    if (config.device.kind != DeviceKind::cpu) {
      say(config, fmt::format("{}: copying the pools to {}", w.name, device_name(config.device)));
      gpu = std::make_unique<DeviceStep>(config.device, d);
    }
    KVCache& cache = gpu ? gpu->cache() : *d.kv;
    Options options;
    auto tested = make_backend(config.backend, d.model, options, w, &cache,
                               d.req_to_token.get(), threads, registry_of(config), config.device);
    const AttnArgs args = gpu ? gpu->args() : d.io.args();
    cache.begin_step(d.batch);
    tested->init_forward_metadata(d.batch);
    tested->forward(args, d.layer(), d.batch);
    if (gpu) gpu->collect(d);
    say(config, fmt::format("{}: checking against the reference backend", w.name));
    m.check = check_against_reference(config, d, threads);
    if (!m.check.check.passed) return m;

    std::unique_ptr<SparseRun> sparse;
    if (need_sparse) {
      sparse = std::make_unique<SparseRun>(config, d, threads, config.device);
      sparse->cache(d).begin_step(sparse->batch);
      sparse->backend->init_forward_metadata(sparse->batch);
      sparse->backend->forward(sparse->args, sparse->model.layers[0], sparse->batch);
      sparse->collect();
      m.sparse_vs_step_err =
          max_rel_err_bf16(sparse->out, d.io.out, w.num_tokens() * w.q_heads, w.kv_lora_rank);
      ATTNRT_CHECK(m.sparse_vs_step_err <= config.check_tolerance,
                   "{}: the sparse attention alone over the step's selection differs from the "
                   "step's output (relative error {:.3g}, allowed {:.3g})",
                   w.name, m.sparse_vs_step_err, config.check_tolerance);
      m.notes.push_back(fmt::format(
          "sparse alone: the MLA decode over each request's selected slots (a fixed selection: "
          "the step's own), output equal to the step's within {:.1e}",
          m.sparse_vs_step_err));
    }
    // The step and (when measured) the sparse attention alternate, each after a cache flush,
    // each after its own begin_step (untimed): the step stores its rows at its own write slots.
    say(config, fmt::format("{}: timing ({} repeats)", w.name, config.repeats));
    auto timer = make_device_timer(config.device);
    cache.begin_step(d.batch);
    tested->init_forward_metadata(d.batch);
    auto run_step = [&] { tested->forward(args, d.layer(), d.batch); };
    auto run_sparse = [&] {
      sparse->backend->forward(sparse->args, sparse->model.layers[0], sparse->batch);
    };
    for (int i = 0; i < config.warmup; ++i) {
      cache.begin_step(d.batch);
      run_step();
      if (sparse) {
        sparse->cache(d).begin_step(sparse->batch);
        run_sparse();
      }
    }
    std::vector<double> step_s, sparse_s;
    for (int i = 0; i < config.repeats; ++i) {
      cache.begin_step(d.batch);
      timer->flush_caches();
      step_s.push_back(timer->time(run_step));
      if (sparse) {
        sparse->cache(d).begin_step(sparse->batch);
        timer->flush_caches();
        sparse_s.push_back(timer->time(run_sparse));
      }
    }
    m.step = TimingStats::from_samples(step_s);
    if (sparse) {
      m.sparse = TimingStats::from_samples(sparse_s);
      m.index = differences(step_s, sparse_s);
    }
  } catch (const Error& e) {
    m.error = e.what();
    return m;
  }
  if (need_dense) {
    BenchConfig dense_config = config;
    dense_config.compare_reference = false;
    const Workload dense = dsa_dense_companion(w);
    say(config, fmt::format("{}: the dense {} it is compared with", w.name, dense.name));
    RowResult r = run_row(dense_config, dense, ceilings);
    if (r.status == "n/a" && w.prefill) {
      m.notes.push_back(fmt::format("dense prefill in the absorbed form: {}", r.error));
      r = run_row(dense_config, dsa_dense_companion(w, true), ceilings);
    }
    if (r.status != "ok") {
      m.error = fmt::format("the dense {} it is compared with did not run: {} {}", r.workload.name,
                            r.status, r.error);
    } else {
      m.dense = std::move(r);
    }
  }
  return m;
}

void fill_row(DsaRowResult& row, const ShapeMeasure& m, const Ceilings& ceilings) {
  const DsaWorkload& w = row.workload;
  row.check = m.check.check;
  row.selected_checked = m.check.selected;
  row.selection_mismatches = m.check.mismatches;
  row.notes.insert(row.notes.end(), m.notes.begin(), m.notes.end());
  if (!m.error.empty()) {
    row.status = "error";
    row.error = m.error;
    return;
  }
  if (!row.check.passed) {
    row.status = "mismatch";
    row.notes.push_back("not timed: the check against the reference backend failed");
    return;
  }
  row.time = w.part == DsaPart::index ? m.index : w.part == DsaPart::sparse ? m.sparse : m.step;
  if (row.time.median > 0) {
    set_rate(row, ceilings);
  } else {
    row.notes.push_back(
        "the step was not slower than its sparse attention alone: the indexer's "
        "time is within the noise of this run (no rate)");
  }
  if (w.part == DsaPart::index) {
    row.notes.push_back(fmt::format(
        "index = step ({:.3g} ms) minus sparse alone ({:.3g} ms), per repetition; it includes "
        "the store of the step's index keys and the per-token key lists",
        m.step.median * 1e3, m.sparse.median * 1e3));
  }
  row.target = dsa_target(w);
  if (m.dense) {
    row.dense_workload = m.dense->workload;
    row.dense_time = m.dense->time;
  }
  switch (w.part) {
    case DsaPart::step:
      if (w.prefill) {
        row.figure_name = "dense / dsa time";
        row.figure = m.dense->time.median / row.time.median;
      } else {
        row.figure_name = "dsa / dense time";
        row.figure = row.time.median / m.dense->time.median;
      }
      break;
    case DsaPart::index:
      row.figure_name = "% of memory ceiling";
      row.figure = row.pct_of_ceiling;
      break;
    case DsaPart::sparse: {
      row.figure_name = "per-token rate % of dense";
      const double sparse_rate = dsa_selected_pairs(w) / row.time.median;
      const double dense_rate = static_cast<double>(w.batch) * w.kv_len / m.dense->time.median;
      row.figure = 100 * sparse_rate / dense_rate;
      row.notes.push_back(
          fmt::format("{:.4g} selected tokens/s against the dense decode's {:.4g} cached tokens/s",
                      sparse_rate, dense_rate));
      break;
    }
  }
  row.target_met = row.time.median > 0 && (row.target.at_most ? row.figure <= row.target.value
                                                              : row.figure >= row.target.value);
}

}  // namespace

bool backend_serves_dsa(const BenchConfig& config, std::string* why) {
  const BackendEntry& e = registry_of(config).get(config.backend);
  if (e.caps.dsa) return true;
  if (why != nullptr) {
    *why = fmt::format("{} does not serve DSA layers (no DSA caps; docs/dsa.md \"Backends\")",
                       config.backend);
  }
  return false;
}

std::vector<DsaRowResult> run_dsa_rows(const BenchConfig& config,
                                       const std::vector<DsaWorkload>& rows,
                                       const Ceilings& ceilings) {
  std::vector<DsaRowResult> out;
  for (const DsaWorkload& w : rows) {
    DsaRowResult row;
    start_row(row, w, dsa_workloads(), dsa_counted_bytes(w), dsa_counted_flops(w));
    out.push_back(std::move(row));
  }
  std::string why;
  if (!backend_serves_dsa(config, &why)) {
    for (DsaRowResult& row : out) {
      row.status = "n/a";
      row.error = why;
    }
    return out;
  }
  // The rows of one shape share one measurement.
  using Key = std::tuple<bool, int, int, int>;
  std::map<Key, std::vector<size_t>> shapes;
  std::vector<Key> order;
  for (size_t i = 0; i < rows.size(); ++i) {
    const DsaWorkload& w = rows[i];
    const Key key{w.prefill, w.batch, w.kv_len, w.index_topk};
    if (shapes.find(key) == shapes.end()) order.push_back(key);
    shapes[key].push_back(i);
  }
  for (const Key& key : order) {
    bool need_sparse = false, need_dense = false;
    for (size_t i : shapes[key]) {
      need_sparse = need_sparse || rows[i].part != DsaPart::step;
      need_dense = need_dense || rows[i].part != DsaPart::index;
    }
    const ShapeMeasure m =
        measure_shape(config, rows[shapes[key].front()], need_sparse, need_dense, ceilings);
    for (size_t i : shapes[key]) fill_row(out[i], m, ceilings);
  }
  return out;
}

}  // namespace attnrt::bench
