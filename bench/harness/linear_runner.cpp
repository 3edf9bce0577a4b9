// The linear-attention rows of `attnrt bench`: one gdn / kda / mamba2 layer served through
// AttentionRuntime (so the state pool sits where the chosen backends run), random bf16 inputs,
// outputs of sampled requests checked against the reference backend, then timed.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/runtime/attention_runtime.h"
#include "bench/harness/device_row.h"
#include "bench/harness/row_figures.h"
#include "bench/harness/runner.h"
#include "bench/harness/values.h"

namespace attnrt::bench {

namespace {

TensorView shaped(const TensorView& base, std::initializer_list<int64_t> shape) {
  return TensorView(base.data, base.dtype, shape, base.device);
}

HostBuffer uniform(int64_t n, float lo, float hi, std::mt19937_64& rng) {
  HostBuffer b(DType::f32, {std::max<int64_t>(n, 1)});
  std::uniform_real_distribution<float> d(lo, hi);
  for (int64_t i = 0; i < b.numel(); ++i) b.ptr<float>()[i] = d(rng);
  return b;
}

// Rows [first, first + count) of each range, stacked: the per-token tensors of a subset of the
// requests.
HostBuffer gather_rows(const HostBuffer& src, int64_t width,
                       const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  int64_t rows = 0;
  for (const auto& r : ranges) rows += r.second;
  HostBuffer out(src.dtype(), {std::max<int64_t>(rows, 1), std::max<int64_t>(width, 1)});
  const size_t row_bytes = static_cast<size_t>(width) * dtype_size(src.dtype());
  auto* dst = static_cast<char*>(out.data());
  for (const auto& [first, count] : ranges) {
    std::memcpy(dst, static_cast<const char*>(src.data()) + first * row_bytes, count * row_bytes);
    dst += count * row_bytes;
  }
  return out;
}

// The layer's parameters (fp32, LinearArgs' layout) and the per-token inputs of the untimed
// prefix step and of the timed step, request-major, [tokens, width] in the activation dtype.
struct LinearRowData {
  LinearWorkload w;
  LinearWidths x;
  HostBuffer conv_w, conv_b, A_log, dt_bias, D;
  HostBuffer pre_x, pre_a, pre_b;  // B * prefix_len tokens
  HostBuffer step_x, step_a, step_b;

  LinearRowData(const LinearWorkload& workload, uint64_t seed)
      : w(workload), x(linear_widths(workload)) {
    std::mt19937_64 rng(seed);
    const int K = w.spec.conv_kernel;
    conv_w = uniform(int64_t{x.conv_dim} * K, -0.6f, 0.6f, rng);
    conv_b = uniform(x.conv_dim, -0.3f, 0.3f, rng);
    A_log = uniform(x.heads, -1.5f, 0.5f, rng);
    dt_bias = uniform(w.kind == LayerKind::kda ? x.a : x.heads, -1.f, 1.f, rng);
    D = uniform(x.heads, -1.f, 1.f, rng);
    ValueTable values(w.act_dtype, seed + 1);
    auto tokens = [&](int64_t n, int width, uint64_t s) {
      HostBuffer b(w.act_dtype, {std::max<int64_t>(n, 1), std::max(width, 1)});
      values.fill(b.data(), b.numel(), s);
      return b;
    };
    const int64_t pre = int64_t{w.batch} * w.prefix_len;
    pre_x = tokens(pre, x.conv_dim, seed + 2);
    pre_a = tokens(pre, x.a, seed + 3);
    pre_b = tokens(pre, x.b, seed + 4);
    step_x = tokens(w.num_tokens(), x.conv_dim, seed + 5);
    step_a = tokens(w.num_tokens(), x.a, seed + 6);
    step_b = tokens(w.num_tokens(), x.b, seed + 7);
  }
};

// The tensors of one layer call, wherever they live.
struct CallTensors {
  TensorView x, a, b, out;
};

// One runtime holding the row's layer for `requests` requests, each bound to a state slot taken
// from a shuffled order (so no request reads its neighbour's state by accident); params and
// per-token tensors on the runtime's device.
class LinearRun {
 public:
  LinearRun(const LinearRowData& d, const std::string& backend, int requests, int64_t max_tokens,
            int max_context, int threads, uint64_t seed)
      : d_(d) {
    ModelSpec m;
    m.name = "bench-" + d.w.model;
    m.dtype = d.w.act_dtype;
    m.max_context_len = std::max(max_context, 16);
    m.layers = {d.w.layer()};
    Options o;
    o.attention_backend = backend;
    o.linear_attn_backend = backend;
    o.num_threads = threads;
    RuntimeConfig c;
    c.max_requests = requests;
    c.kv_slots = 16;
    c.max_num_tokens = static_cast<int>(std::max<int64_t>(max_tokens, 1));
    c.linear_state_dtype = d.w.state_dtype;
    c.linear_conv_dtype = d.w.state_dtype;
    c.cuda_graphs = false;
    rt_ = std::make_unique<AttentionRuntime>(m, o, c);
    device_ = rt_->kv_cache().device();
    if (device_.kind != DeviceKind::cpu) gpu_ = make_device_tensors(device_, rt_->kv_cache());

    LinearStatePool& pool = rt_->linear_state();
    std::vector<int> slots(requests);
    for (int& s : slots) s = pool.alloc();
    std::shuffle(slots.begin(), slots.end(), std::mt19937_64(seed));
    for (int r = 0; r < requests; ++r) {
      rows_.push_back(rt_->req_to_token().alloc());
      pool.bind(static_cast<int>(rows_.back()), slots[r]);
    }
    conv_w_ = place(d.conv_w);
    conv_b_ = place(d.conv_b);
    A_log_ = place(d.A_log);
    dt_bias_ = place(d.dt_bias);
    D_ = place(d.D);
  }

  AttentionRuntime& runtime() { return *rt_; }
  bool on_gpu() const { return gpu_ != nullptr; }

  // Host or device copies of per-token inputs, with an output buffer shaped like `out`.
  CallTensors tensors(const HostBuffer& x, const HostBuffer& a, const HostBuffer& b,
                      const HostBuffer& out) {
    return {place(x), place(a), place(b), place(out)};
  }

  // A step of `tokens` tokens per request (prefix: tokens each request consumed before).
  ForwardBatch batch(LinearMode mode, int prefix, int tokens) const {
    const size_t n = rows_.size();
    ForwardBatch b = mode == LinearMode::decode
                         ? make_decode_batch(rows_, std::vector<int32_t>(n, prefix + 1))
                         : make_extend_batch(rows_, std::vector<int32_t>(n, prefix),
                                             std::vector<int32_t>(n, tokens));
    // The layer stores no K/V: every token writes the dummy slot 0.
    b.out_cache_loc.assign(n * static_cast<size_t>(tokens), 0);
    return b;
  }

  void forward(const CallTensors& t, int64_t tokens) {
    const LinearWorkload& w = d_.w;
    const LinearWidths& x = d_.x;
    LinearArgs args;
    args.mixed_qkv = shaped(t.x, {tokens, x.conv_dim});
    args.conv_weight = shaped(conv_w_, {x.conv_dim, w.spec.conv_kernel});
    args.A_log = shaped(A_log_, {x.heads});
    if (w.kind == LayerKind::kda) {
      args.a = shaped(t.a, {tokens, x.heads, w.spec.head_k_dim});
      args.dt_bias = shaped(dt_bias_, {x.heads, w.spec.head_k_dim});
    } else {
      args.a = shaped(t.a, {tokens, x.heads});
      args.dt_bias = shaped(dt_bias_, {x.heads});
    }
    if (w.kind == LayerKind::mamba2) {
      args.conv_bias = shaped(conv_b_, {x.conv_dim});
      args.D = shaped(D_, {x.heads});
    } else {
      args.b = shaped(t.b, {tokens, x.heads});
    }
    args.out = shaped(t.out, {tokens, x.heads, x.out / x.heads});
    if (gpu_) {
      gpu_->fenced([&] { rt_->forward_linear(0, args); });
    } else {
      rt_->forward_linear(0, args);
    }
  }

  // Runs one whole step: begin_step, the layer, end_step.
  void step(const ForwardBatch& b, const CallTensors& t) {
    rt_->begin_step(b);
    forward(t, b.out_cache_loc.size());
    rt_->end_step();
  }

  void download(const CallTensors& t, const HostBuffer& out) {
    if (gpu_) gpu_->download(t.out, out.data(), out.bytes());
  }

 private:
  TensorView place(const HostBuffer& h) { return gpu_ ? upload(*gpu_, h) : h.view(); }

  const LinearRowData& d_;
  std::unique_ptr<AttentionRuntime> rt_;
  Device device_;
  std::unique_ptr<DeviceTensors> gpu_;
  std::vector<int64_t> rows_;
  TensorView conv_w_, conv_b_, A_log_, dt_bias_, D_;
};

// Relative L2 error of each (token, head) output vector of `got` (rows `got_rows` of the tested
// output) against the reference's float output.
// Output error of the checked rows, per (token, head) vector: the L2 error divided by the larger of
// the vector's own L2 norm and the RMS norm of that head's vectors over the checked rows of the
// same request. A linear layer's output can legitimately be near zero for one token (a small q.k or
// C.B dot product), where a kernel that multiplies bf16 operands is only accurate relative to the
// head's typical magnitude; `worst_vector` keeps the plain per-vector relative error for the
// record.
struct LinearErr {
  double worst = 0;         // the checked figure
  double worst_vector = 0;  // relative to each vector's own norm
};
LinearErr worst_rel_err(const HostBuffer& got, const std::vector<int64_t>& got_rows,
                        const HostBuffer& want, int width, int head_width, int rows_per_req) {
  LinearErr out;
  const int heads = width / head_width;
  const size_t n = got_rows.size();
  for (size_t r0 = 0; r0 < n; r0 += static_cast<size_t>(rows_per_req)) {
    const size_t r1 = std::min(n, r0 + static_cast<size_t>(rows_per_req));
    for (int h = 0; h < heads; ++h) {
      std::vector<double> num(r1 - r0), den(r1 - r0);
      double sum_den = 0;
      for (size_t i = r0; i < r1; ++i) {
        for (int e = 0; e < head_width; ++e) {
          const int64_t c = int64_t{h} * head_width + e;
          const double g = load_as_float(got.data(), got.dtype(), got_rows[i] * width + c);
          const double r = want.ptr<float>()[static_cast<int64_t>(i) * width + c];
          if (!std::isfinite(g)) return {INFINITY, INFINITY};
          num[i - r0] += (g - r) * (g - r);
          den[i - r0] += r * r;
        }
        sum_den += den[i - r0];
      }
      const double rms = std::sqrt(sum_den / static_cast<double>(r1 - r0));
      for (size_t k = 0; k < num.size(); ++k) {
        const double e = std::sqrt(num[k]), own = std::sqrt(den[k]);
        out.worst = std::max(out.worst, e / std::max({own, rms, 1e-30}));
        out.worst_vector = std::max(out.worst_vector, e / std::max(own, 1e-30));
      }
    }
  }
  return out;
}

// The reference backend on the first and last requests alone (same inputs, same prefix; extend
// rows: their first `check_tokens` tokens, which by causality see nothing later).
CheckResult check_against_reference(const BenchConfig& config, const LinearRowData& d,
                                    const HostBuffer& out, int threads) {
  const LinearWorkload& w = d.w;
  std::vector<int> reqs = {0};
  if (w.batch > 1) reqs.push_back(w.batch - 1);
  const int n = static_cast<int>(reqs.size());
  int tokens = w.new_tokens;
  if (w.mode == LinearMode::extend) {
    const double per_token = linear_counted_flops(w) / static_cast<double>(w.num_tokens());
    const int budget = static_cast<int>(config.check_max_work / (n * per_token));
    tokens = std::clamp(budget, std::min(16, w.new_tokens), w.new_tokens);
  }
  std::vector<std::pair<int64_t, int64_t>> pre_ranges, step_ranges;
  std::vector<int64_t> got_rows;
  for (int r : reqs) {
    pre_ranges.emplace_back(int64_t{r} * w.prefix_len, w.prefix_len);
    step_ranges.emplace_back(int64_t{r} * w.new_tokens, tokens);
    for (int t = 0; t < tokens; ++t) got_rows.push_back(int64_t{r} * w.new_tokens + t);
  }
  const LinearWidths& x = d.x;
  LinearRun ref(d, "reference", n, int64_t{n} * std::max(w.prefix_len, tokens),
                w.prefix_len + tokens, threads, config.seed);
  if (w.prefix_len > 0) {
    HostBuffer pre_out(DType::f32, {int64_t{n} * w.prefix_len, x.out});
    HostBuffer px = gather_rows(d.pre_x, x.conv_dim, pre_ranges);
    HostBuffer pa = gather_rows(d.pre_a, x.a, pre_ranges);
    HostBuffer pb = gather_rows(d.pre_b, x.b, pre_ranges);
    ref.step(ref.batch(LinearMode::extend, 0, w.prefix_len), ref.tensors(px, pa, pb, pre_out));
  }
  HostBuffer want(DType::f32, {int64_t{n} * tokens, x.out});
  HostBuffer sx = gather_rows(d.step_x, x.conv_dim, step_ranges);
  HostBuffer sa = gather_rows(d.step_a, x.a, step_ranges);
  HostBuffer sb = gather_rows(d.step_b, x.b, step_ranges);
  ref.step(ref.batch(w.mode, w.prefix_len, tokens), ref.tensors(sx, sa, sb, want));

  CheckResult c;
  c.rows_checked = static_cast<int>(got_rows.size());
  const LinearErr err = worst_rel_err(out, got_rows, want, x.out, x.out / x.heads, tokens);
  c.max_rel_err = err.worst;
  c.tolerance = config.check_tolerance;
  c.passed = c.max_rel_err <= c.tolerance;
  c.method = w.mode == LinearMode::decode
                 ? fmt::format(
                       "outputs of requests {} against the reference backend (float64) "
                       "run on them alone from the same {} prefix tokens",
                       n == 1 ? "0" : fmt::format("0 and {}", w.batch - 1), w.prefix_len)
                 : fmt::format(
                       "the first {} tokens of requests {} against the reference backend "
                       "(float64) run on those tokens alone; L2 error of each (token, head) "
                       "vector over the larger of its norm and the head's RMS norm on those "
                       "tokens (against its own norm alone: {:.3g})",
                       tokens, n == 1 ? "0" : fmt::format("0 and {}", w.batch - 1),
                       err.worst_vector);
  return c;
}

void say(const BenchConfig& config, const std::string& line) {
  if (config.progress) config.progress(line);
}

}  // namespace

LinearRowResult run_linear_row(const BenchConfig& config, const LinearWorkload& w,
                               const Ceilings& ceilings) {
  LinearRowResult row;
  start_row(row, w, all_linear_workloads(), linear_counted_bytes(w), linear_counted_flops(w));
  const int threads = resolve_threads(config.threads);
  try {
    say(config, fmt::format("{}: setting up {} {} ({:.1f} MiB moved per call)", w.name,
                            layer_kind_name(w.kind), w.shape(), row.bytes / double(1 << 20)));
    const LinearRowData d(w, config.seed);
    const LinearWidths& x = d.x;
    LinearRun run(d, config.backend, w.batch,
                  std::max(w.num_tokens(), int64_t{w.batch} * w.prefix_len),
                  w.prefix_len + w.new_tokens, threads, config.seed);
    if (w.prefix_len > 0) {
      HostBuffer pre_out(w.act_dtype, {int64_t{w.batch} * w.prefix_len, x.out});
      run.step(run.batch(LinearMode::extend, 0, w.prefix_len),
               run.tensors(d.pre_x, d.pre_a, d.pre_b, pre_out));
    }
    HostBuffer out(w.act_dtype, {w.num_tokens(), x.out});
    const CallTensors t = run.tensors(d.step_x, d.step_a, d.step_b, out);
    const ForwardBatch step = run.batch(w.mode, w.prefix_len, w.new_tokens);
    AttentionRuntime& rt = run.runtime();
    rt.begin_step(step);
    run.forward(t, w.num_tokens());
    run.download(t, out);
    say(config, fmt::format("{}: checking", w.name));
    row.check = check_against_reference(config, d, out, threads);
    if (!row.check.passed) {
      row.status = "mismatch";
      row.notes.push_back(
          fmt::format("not timed: output differs from the reference backend "
                      "(relative error {:.3g} > {:.3g})",
                      row.check.max_rel_err, row.check.tolerance));
      rt.end_step();
      return row;
    }
    say(config, fmt::format("{}: timing ({} repeats)", w.name, config.repeats));
    auto timer = make_device_timer(config.device);
    row.time = time_repeated(
        *timer, [&] { run.forward(t, w.num_tokens()); }, config.warmup, config.repeats);
    rt.end_step();
    row.tokens_per_second = static_cast<double>(w.num_tokens()) / row.time.median;
    set_rate(row, ceilings);
    if (const double fi = linear_flashinfer_flops(w); fi > 0) {
      std::string note = fmt::format(
          "counted as FlashInfer's GDN prefill benchmark (4 x tokens x value heads x Dk x Dv = "
          "{:.3g} FLOPs): {:.3g} TFLOP/s",
          fi, fi / row.time.median / 1e12);
      if (const std::optional<FlashInferFigure> f = flashinfer_published(w)) {
        note += fmt::format(
            "; FlashInfer publishes {:.3f} ms at this shape on an H100 ({:.1f} TFLOP/s, {}; q, k, "
            "v after the conv: conv, norms and gates are not in it), {:.2f}x this row's time",
            f->ms, fi / (f->ms * 1e-3) / 1e12, f->of, f->ms * 1e-3 / row.time.median);
      }
      row.notes.push_back(std::move(note));
    }
  } catch (const Error& e) {
    row.status = "error";
    row.error = e.what();
  }
  return row;
}

}  // namespace attnrt::bench
