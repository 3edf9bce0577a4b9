// The MHA-form rows of `attnrt bench --suite mla` (docs/workloads.md "MLA rows"): one DeepSeek-V3
// MLA layer served through AttentionRuntime's MHA-form calls. The timed region is the layer's
// attention as an engine calls it: the causal part (forward_mla_mha, which also stores the step's
// latent rows), then for every prefix chunk its gather (gather_prefix_chunk) and its attention
// merged into the running result (forward_mla_prefix_chunk). The model's decompression of the
// gathered rows (W_UK / W_UV, tools/sim/mla_weights.h) runs once before timing and is not timed:
// the timed gathers refill the same buffers the chunks' k / v were decompressed from.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/runtime/attention_runtime.h"
#include "bench/harness/ceilings.h"
#include "bench/harness/device_row.h"
#include "bench/harness/row_check.h"
#include "bench/harness/row_figures.h"
#include "bench/harness/runner.h"
#include "bench/harness/values.h"
#include "src/model/layer_builders.h"
#include "tools/sim/mla_weights.h"

namespace attnrt::bench {

namespace {

LayerSpec mha_layer(const Workload& w) {
  LayerSpec l =
      layer_builders::mla_layer(0, w.q_heads, w.kv_lora_rank, w.head_dim - w.kv_lora_rank);
  l.qk_nope_head_dim = w.qk_nope_head_dim;
  l.mha_v_head_dim = w.mha_v_head_dim;
  l.scaling = 1.f / std::sqrt(static_cast<float>(w.qk_head_dim()));
  return l;
}

// The chunk capacity that splits each prefix into w.prefix_chunks chunks:
// batch * ceil(prefix / chunks) keys (8 * 1024 for mla-extend-8x4096+512).
int64_t chunk_capacity(const Workload& w) {
  if (w.prefix_len == 0 || w.prefix_chunks == 0) return Options{}.max_chunk_capacity;
  return int64_t{w.batch} * ((w.prefix_len + w.prefix_chunks - 1) / w.prefix_chunks);
}

HostBuffer random_bf16(std::initializer_list<int64_t> shape, const ValueTable& values,
                       uint64_t seed) {
  HostBuffer b(DType::bf16, shape);
  values.fill(b.data(), b.numel(), seed);
  return b;
}

// One row on one backend. The constructor builds the runtime (its latent pool, each request's
// pages a random permutation of the pool's, page 0 reserved) and begins the step; the form the
// backend chose is then known (form()). prepare() fills the pool and the step's inputs and
// decompresses the extend tokens' and every chunk's k / v; attend() is the timed call sequence.
class MhaRun {
 public:
  MhaRun(const Workload& w, const std::string& backend, int threads, uint64_t seed)
      : w_(w), layer_(mha_layer(w)), seed_(seed) {
    ModelSpec m;
    m.name = "bench-mla-mha";
    m.dtype = DType::bf16;
    m.max_context_len = std::max(w.kv_len(), 16);
    m.layers = {layer_};
    Options o;
    o.attention_backend = backend;
    o.page_size = w.page_size;
    o.kv_cache_dtype = std::string(dtype_name(w.kv_dtype));
    o.num_threads = threads;
    // The row measures the MHA form whatever its prefix sums to.
    o.chunked_prefix_cache_threshold = 1;
    o.max_chunk_capacity = chunk_capacity(w);
    const int pages_per_request = (w.kv_len() + w.page_size - 1) / w.page_size;
    const int64_t pages = int64_t{w.batch} * pages_per_request;
    RuntimeConfig c;
    c.max_requests = w.batch;
    c.kv_slots = pages * w.page_size;
    c.max_num_tokens = static_cast<int>(std::max<int64_t>(w.num_tokens(), 1));
    c.max_context_len = w.kv_len();
    c.cuda_graphs = false;
    rt_ = std::make_unique<AttentionRuntime>(m, o, c);

    std::vector<int64_t> order(pages);
    std::iota(order.begin(), order.end(), int64_t{1});
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
    std::vector<int64_t> rows(w.batch), slots(w.kv_len());
    for (int r = 0; r < w.batch; ++r) {
      rows[r] = rt_->req_to_token().alloc();
      for (int j = 0; j < w.kv_len(); ++j) {
        const int64_t page = order[static_cast<size_t>(r) * pages_per_request + j / w.page_size];
        slots[j] = page * w.page_size + j % w.page_size;
      }
      rt_->req_to_token().write(static_cast<int>(rows[r]), 0, slots);
    }
    batch_ = make_extend_batch(rows, std::vector<int32_t>(w.batch, w.prefix_len),
                               std::vector<int32_t>(w.batch, w.new_tokens));
    batch_.out_cache_loc.clear();
    for (int64_t row : rows) {
      for (int t = 0; t < w.new_tokens; ++t) {
        batch_.out_cache_loc.push_back(rt_->req_to_token().get(static_cast<int>(row),
                                                               w.prefix_len + t));
      }
    }
    rt_->begin_step(batch_);
    begun_ = true;
  }

  ~MhaRun() {
    if (begun_) rt_->end_step();
  }

  MhaRun(const MhaRun&) = delete;
  MhaRun& operator=(const MhaRun&) = delete;

  MlaForm form() const { return rt_->mla_form(); }
  AttentionRuntime& runtime() { return *rt_; }
  const ForwardBatch& batch() const { return batch_; }
  const LayerSpec& layer_spec() const { return layer_; }
  const Workload& workload() const { return w_; }
  const HostBuffer& q() const { return q_; }
  // The latent pool's rows on the host, with the rows the step stored: the pool itself, or a copy
  // of a GPU pool refreshed with the step's rows.
  const void* pool() {
    const KVLayerView kv = rt_->kv_cache().layer(0);
    if (!gpu_) return kv.k;
    rt_->kv_cache().download_rows(0, batch_.out_cache_loc, pool_.data(), pool_.data());
    return pool_.data();
  }
  // The output of the last attend(), downloaded first where it lives on the GPU.
  const HostBuffer& out() {
    if (gpu_) gpu_->download(dout_, out_.data(), out_.bytes());
    return out_;
  }
  const sim::MlaWeights& weights() const { return *weights_; }

  // The pool's values, the step's inputs and every chunk's decompressed k / v; on a GPU pool
  // (the cuda backend) device copies of them, which attend() then uses.
  void prepare() {
    const KVLayerView kv = rt_->kv_cache().layer(0);
    pool_ = HostBuffer(kv.dtype, {kv.num_rows, kv.k_row_stride});
    const ValueTable pool_values(w_.kv_dtype, seed_ + 1);
    pool_values.fill(pool_.data(), kv.num_rows * kv.k_row_stride, seed_ + 2);
    rt_->kv_cache().copy_layer_from_host(0, pool_.data(), pool_.data());
    if (kv.device.kind != DeviceKind::cpu) gpu_ = make_device_tensors(kv.device, rt_->kv_cache());
    const ValueTable values(DType::bf16, seed_ + 3);
    const int64_t T = w_.num_tokens();
    const int hq = w_.q_heads, qk = w_.qk_head_dim(), dv = w_.v_head_dim();
    q_ = random_bf16({T, hq, qk}, values, seed_ + 4);
    latent_ = random_bf16({T, 1, w_.head_dim}, values, seed_ + 5);
    weights_ = std::make_unique<sim::MlaWeights>(layer_, seed_ + 6);
    k_ = HostBuffer(DType::bf16, {T, hq, qk});
    v_ = HostBuffer(DType::bf16, {T, hq, dv});
    weights_->decompress(latent_.view(), k_.view(), v_.view());
    out_ = HostBuffer(DType::bf16, {T, hq, dv});
    lse_ = HostBuffer(DType::f32, {T, hq});
    const PrefixChunkPlan& plan = rt_->prefix_chunk_plan();
    for (int c = 0; c < plan.num_chunks(); ++c) {
      const int64_t n = plan.chunks[c].num_tokens;
      Chunk& ch = chunks_.emplace_back();
      ch.latent = HostBuffer(DType::bf16, {n, 1, w_.head_dim});
      ch.k = HostBuffer(DType::bf16, {n, hq, qk});
      ch.v = HostBuffer(DType::bf16, {n, hq, dv});
      rt_->gather_prefix_chunk(0, c, ch.latent.view());
      weights_->decompress(ch.latent.view(), ch.k.view(), ch.v.view());
      ch.dlatent = place(ch.latent);
      ch.dk = place(ch.k);
      ch.dv = place(ch.v);
    }
    dq_ = place(q_);
    dk_ = place(k_);
    dv_ = place(v_);
    dlatent_ = place(latent_);
    dout_ = place(out_);
    dlse_ = place(lse_);
  }

  // The layer's attention as an engine calls it (the timed region).
  void attend() {
    const auto body = [&] {
      rt_->forward_mla_mha(
          0, {.q = dq_, .k = dk_, .v = dv_, .out = dout_, .lse = dlse_, .latent = dlatent_});
      for (size_t c = 0; c < chunks_.size(); ++c) {
        Chunk& ch = chunks_[c];
        rt_->gather_prefix_chunk(0, static_cast<int>(c), ch.dlatent);
        rt_->forward_mla_prefix_chunk(
            0, static_cast<int>(c),
            {.q = dq_, .k = ch.dk, .v = ch.dv, .out = dout_, .lse = dlse_});
      }
    };
    if (gpu_) {
      gpu_->fenced(body);
    } else {
      body();
    }
  }

  // Host time of the step's plan (begin_step, the prefix-chunk plan included), each after the
  // end of the step before it.
  TimingStats time_plan(int repeats) {
    return time_host_call(
        [&] {
          rt_->end_step();
          rt_->begin_step(batch_);
        },
        repeats);
  }

 private:
  struct Chunk {
    HostBuffer latent, k, v;
    TensorView dlatent, dk, dv;  // what attend() passes: the buffers above or their GPU copies
  };
  TensorView place(const HostBuffer& h) { return gpu_ ? upload(*gpu_, h) : h.view(); }
  Workload w_;
  LayerSpec layer_;
  uint64_t seed_;
  std::unique_ptr<AttentionRuntime> rt_;
  ForwardBatch batch_;
  bool begun_ = false;
  HostBuffer pool_, q_, latent_, k_, v_, out_, lse_;
  std::unique_ptr<DeviceTensors> gpu_;
  TensorView dq_, dk_, dv_, dlatent_, dout_, dlse_;
  std::vector<Chunk> chunks_;
  std::unique_ptr<sim::MlaWeights> weights_;
};

// Sampled query rows recomputed in float64 in the absorbed form straight from the latent pool
// through the req_to_token rows (the prefix and the extend tokens 0 .. t of the query's request),
// with the same weights: q_lat = [W_UK q_nope | q_rope], out = W_UV^T out_lat. Independent of the
// chunk plan, the gathers and the merges, which it checks.
CheckResult absorbed_check(MhaRun& run, double max_work, double tol, uint64_t seed) {
  const Workload& w = run.workload();
  const int64_t tokens = w.num_tokens();
  const int hq = w.q_heads, qk = w.qk_head_dim(), row_dim = w.head_dim, rank = w.kv_lora_rank;
  const int dv = w.v_head_dim();
  // The absorbed form costs 2 * Hq * (576 + 512) per pair against the MHA form's 2 * Hq * 320.
  const double per_row = attention_work(w) / static_cast<double>(tokens) *
                         (row_dim + rank) / static_cast<double>(qk + dv);
  const std::vector<int64_t> rows = sample_query_rows(tokens, per_row, max_work, seed);
  const int64_t n = static_cast<int64_t>(rows.size());
  HostBuffer q(DType::f32, {n, hq, qk}), q_lat(DType::f32, {n, hq, row_dim});
  for (int64_t s = 0; s < n; ++s) {
    const uint16_t* src = run.q().ptr<uint16_t>() + rows[s] * hq * qk;
    for (int64_t e = 0; e < int64_t{hq} * qk; ++e) {
      q.ptr<float>()[s * hq * qk + e] = bf16_to_float(src[e]);
    }
  }
  run.weights().absorb_q(q.view(), q_lat.view());
  HostBuffer out_lat(DType::f32, {n, hq, rank}), want(DType::f32, {n, hq, dv});
  const KVLayerView kv = run.runtime().kv_cache().layer(0);
  const double scale = run.layer_spec().softmax_scale();
  const void* pool = run.pool();
  const ReqToTokenPool& r2t = run.runtime().req_to_token();

#pragma omp parallel for schedule(dynamic)
  for (int64_t s = 0; s < n; ++s) {
    const int r = static_cast<int>(rows[s] / w.new_tokens);
    const int t = static_cast<int>(rows[s] % w.new_tokens);
    const int row = static_cast<int>(run.batch().req_pool_indices[r]);
    const int nk = w.prefix_len + t + 1;
    std::vector<double> keys(static_cast<size_t>(nk) * row_dim);
    for (int j = 0; j < nk; ++j) {
      const int64_t base = int64_t{r2t.get(row, j)} * kv.k_row_stride;
      for (int e = 0; e < row_dim; ++e) {
        keys[static_cast<size_t>(j) * row_dim + e] =
            double{load_as_float(pool, kv.dtype, base + e)} * kv.k_scale;
      }
    }
    std::vector<double> logits(nk), o(rank);
    for (int h = 0; h < hq; ++h) {
      const float* ql = q_lat.ptr<float>() + (s * hq + h) * row_dim;
      double m = -INFINITY;
      for (int j = 0; j < nk; ++j) {
        double dot = 0;
        for (int e = 0; e < row_dim; ++e) dot += ql[e] * keys[static_cast<size_t>(j) * row_dim + e];
        logits[j] = dot * scale;
        m = std::max(m, logits[j]);
      }
      std::fill(o.begin(), o.end(), 0.0);
      double den = 0;
      for (int j = 0; j < nk; ++j) {
        const double p = std::exp(logits[j] - m);
        den += p;
        for (int e = 0; e < rank; ++e) o[e] += p * keys[static_cast<size_t>(j) * row_dim + e];
      }
      float* dst = out_lat.ptr<float>() + (s * hq + h) * rank;
      for (int e = 0; e < rank; ++e) dst[e] = static_cast<float>(o[e] / den);
    }
  }
  run.weights().project_out(out_lat.view(), want.view());

  double worst = 0;
  std::vector<double> ref(dv);
  const HostBuffer& got = run.out();
  for (int64_t s = 0; s < n; ++s) {
    for (int h = 0; h < hq; ++h) {
      const float* wv = want.ptr<float>() + (s * hq + h) * dv;
      for (int e = 0; e < dv; ++e) ref[e] = wv[e];
      worst = std::max(worst,
                       rel_err(got.ptr<uint16_t>() + (rows[s] * hq + h) * dv, ref.data(), dv));
    }
  }
  CheckResult c;
  c.rows_checked = static_cast<int>(n);
  c.max_rel_err = worst;
  c.tolerance = tol;
  c.passed = worst <= tol;
  c.method = fmt::format(
      "float64 recomputation in the absorbed form from the latent pool of {} of {} query rows x "
      "{} heads",
      n, tokens, hq);
  return c;
}

void say(const BenchConfig& config, const std::string& line) {
  if (config.progress) config.progress(line);
}

// The reference backend on the row (scaled down when large): its outputs against the tested
// backend's on that shape, and its speed.
ReferenceResult measure_mha_reference(const BenchConfig& config, const Workload& w, int threads,
                                      double backend_work_per_second) {
  ReferenceResult ref;
  ref.workload = fit_workload(w, config.reference_max_bytes, config.reference_max_work,
                              "reference measured scaled down");
  const uint64_t seed = config.seed ^ 0x7e7e7e7e;
  MhaRun tested(ref.workload, config.backend, threads, seed);
  MhaRun oracle(ref.workload, "reference", threads, seed);
  tested.prepare();
  oracle.prepare();
  tested.attend();
  oracle.attend();
  ref.check = compare_outputs(tested.out(), oracle.out(), ref.workload, config.check_tolerance);
  auto timer = make_device_timer(Device::cpu());
  ref.time = time_repeated(*timer, [&] { oracle.attend(); }, 0, config.reference_repeats);
  ref.work_per_second = attention_work(ref.workload) / ref.time.median;
  ref.speedup = backend_work_per_second / ref.work_per_second;
  ref.note = ref.workload == w
                 ? fmt::format("reference on the same shape, median of {}", ref.time.repeats)
                 : fmt::format("reference on {}, median of {}; speed-up compares attention work "
                               "per second",
                               ref.workload.shape(), ref.time.repeats);
  return ref;
}

}  // namespace

RowResult run_mla_mha_row(const BenchConfig& config, const Workload& w, const Ceilings& ceilings) {
  RowResult row;
  start_row(row, w, mla_workloads(), counted_bytes(w), counted_flops(w));
  const int threads = resolve_threads(config.threads);
  try {
    double work_per_second = 0;
    {
      say(config, fmt::format("{}: setting up {}", w.name, w.shape()));
      MhaRun run(w, config.backend, threads, config.seed);
      if (run.form() != MlaForm::mha) {
        row.status = "n/a";
        row.error = fmt::format("{} serves MLA extends in the absorbed form", config.backend);
        return row;
      }
      run.prepare();
      run.attend();
      say(config, fmt::format("{}: checking", w.name));
      row.check = absorbed_check(run, config.check_max_work, config.check_tolerance, config.seed);
      if (!row.check.passed) {
        mark_check_failed(row);
        return row;
      }
      say(config, fmt::format("{}: timing ({} repeats)", w.name, config.repeats));
      auto timer = make_device_timer(config.device);
      row.time = time_repeated(*timer, [&] { run.attend(); }, config.warmup, config.repeats);
      row.plan = run.time_plan(config.repeats);
      work_per_second = attention_work(w) / row.time.median;
      set_rate(row, ceilings);
      row.notes.push_back(
          w.prefix_chunks > 0
              ? fmt::format("MHA form: the causal part and {} prefix chunks (gather, attention, "
                            "merge) per call; the decompression of the chunks' latent rows is not "
                            "timed",
                            run.runtime().prefix_chunk_plan().num_chunks())
              : std::string("MHA form: the causal part per call (no prefix)"));
    }
    if (config.compare_reference) {
      say(config, fmt::format("{}: measuring the reference backend", w.name));
      row.reference = measure_mha_reference(config, w, threads, work_per_second);
      mark_reference_mismatch(row);
    }
  } catch (const Error& e) {
    row.status = "error";
    row.error = e.what();
  }
  return row;
}

}  // namespace attnrt::bench
