#include "backends/cpu/linear_backend.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attnrt/core/error.h"
#include "attnrt/memory/linear_state_pool.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/kernels/attention_kernels.h"
#include "backends/cpu/linear_kernels.h"

namespace attnrt {

namespace {

// Channels per conv work item: enough for full vectors, small enough to spread a decode step's
// few requests over every thread.
constexpr int kConvBlock = 256;

void load_f32(const void* base, DType t, int64_t offset, int64_t n, float* dst) {
  if (t == DType::f32) {
    std::memcpy(dst, static_cast<const float*>(base) + offset,
                static_cast<size_t>(n) * sizeof(float));
  } else {
    cpu::convert_to_float(t, static_cast<const char*>(base) + offset * dtype_size(t), n, dst);
  }
}

void store_f32(void* base, DType t, int64_t offset, int64_t n, const float* src) {
  switch (t) {
    case DType::f32:
      std::memcpy(static_cast<float*>(base) + offset, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::bf16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
      return;
    }
    case DType::f16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = float_to_fp16(src[i]);
      return;
    }
    default:
      fail("cpu linear backend: cannot store {} values", dtype_name(t));
  }
}

// Rows of a per-token tensor (token stride t.strides[0], rows contiguous) as fp32 [rows, width].
void tokens_to_f32(const TensorView& t, int64_t rows, int64_t width, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    load_f32(t.data, t.dtype, r * t.strides[0], width, dst + r * width);
  }
}

float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

}  // namespace

CpuLinearBackend::CpuLinearBackend(const BackendContext& ctx)
    : LinearAttnBackend(ctx), num_threads_(cpu_num_threads(ctx.options)) {}

void CpuLinearBackend::forward_linear(const LinearArgs& args, const LayerSpec& layer,
                                      const ForwardBatch& batch) {
  if (!begin_layer(args, layer, batch)) return;
  const LinearLayerState& st = pool().layer(layer.layer_id);
  const LinearStateShape& sh = st.shape;
  const int64_t T = plan_.num_tokens;
  const int K = layer.linear.conv_kernel, dim = sh.conv_dim;
  const int64_t aw = args.a.numel() / T, bw = args.b.empty() ? 0 : args.b.numel() / T;

  x_.resize(static_cast<size_t>(T * dim));
  a_.resize(static_cast<size_t>(T * aw));
  b_.resize(static_cast<size_t>(T * bw));
  tokens_to_f32(args.mixed_qkv, T, dim, x_.data());
  tokens_to_f32(args.a, T, aw, a_.data());
  if (bw > 0) tokens_to_f32(args.b, T, bw, b_.data());
  wt_.resize(static_cast<size_t>(K) * dim);
  const float* w = args.conv_weight.ptr<float>();
  for (int c = 0; c < dim; ++c) {
    for (int j = 0; j < K; ++j)
      wt_[static_cast<size_t>(j) * dim + c] = w[static_cast<size_t>(c) * K + j];
  }
  bias_.assign(static_cast<size_t>(dim), 0.f);
  if (!args.conv_bias.empty()) std::copy_n(args.conv_bias.ptr<float>(), dim, bias_.begin());

  run_conv(layer, st);
  run_recurrence(layer, st, args);

  const int64_t ow = static_cast<int64_t>(sh.heads) * sh.rows;
  for (int64_t t = 0; t < T; ++t)
    store_f32(args.out.data, args.out.dtype, t * args.out.strides[0], ow, &o_[t * ow]);
}

// Conv of every request over channel blocks: from the slot's window (or zeros without a prefix),
// writing the new window back; verify walks each token's ancestor chain through the per-token
// windows instead and leaves the slot alone.
void CpuLinearBackend::run_conv(const LayerSpec& layer, const LinearLayerState& st) {
  const LinearStateShape& sh = st.shape;
  const int dim = sh.conv_dim, K = layer.linear.conv_kernel, W = sh.conv_width;
  const int blocks = (dim + kConvBlock - 1) / kConvBlock;
  const int64_t items = static_cast<int64_t>(plan_.reqs.size()) * blocks;
  const int n = plan_.draft_tokens;
  y_.resize(x_.size());
  const int threads = cpu_threads_for(plan_.num_tokens * dim * K, num_threads_);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> win0(static_cast<size_t>(W) * kConvBlock), win(win0.size()),
        next(win0.size());
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const size_t i = static_cast<size_t>(item / blocks);
      const int c0 = static_cast<int>(item % blocks) * kConvBlock;
      const int nc = std::min(kConvBlock, dim - c0);
      const linear::RequestWork& r = plan_.reqs[i];
      if (r.tokens == 0) continue;
      // win0 = the request's starting window for these channels, rows nc apart.
      for (int row = 0; row < W; ++row) {
        float* dst = &win0[static_cast<size_t>(row) * nc];
        if (r.has_initial_state) {
          load_f32(st.conv, st.conv_dtype, st.conv_offset(r.slot) + int64_t{row} * dim + c0, nc,
                   dst);
        } else {
          std::fill(dst, dst + nc, 0.f);
        }
      }
      const float* x = &x_[static_cast<size_t>(r.token_start) * dim + c0];
      float* y = &y_[static_cast<size_t>(r.token_start) * dim + c0];
      if (!plan_.verify) {
        cpu::linear::conv_rows(win0.data(), nc, x, dim, r.tokens, &wt_[c0], dim, &bias_[c0], nc, K,
                               y, dim);
        // New window: the last W rows of win0 ++ x.
        for (int row = 0; row < W; ++row) {
          const int64_t src = int64_t{r.tokens} + row;  // row index in win0 ++ x
          const float* from = src < W ? &win0[static_cast<size_t>(src) * nc] : x + (src - W) * dim;
          store_f32(st.conv, st.conv_dtype, st.conv_offset(r.slot) + int64_t{row} * dim + c0, nc,
                    from);
        }
        continue;
      }
      const int32_t* parents = &plan_.parents[i * static_cast<size_t>(n)];
      for (int t = 0; t < r.tokens; ++t) {
        const float* base = win0.data();
        if (parents[t] >= 0) {
          for (int row = 0; row < W; ++row) {
            load_f32(st.inter_conv, st.conv_dtype,
                     st.inter_conv_offset(static_cast<int64_t>(i), parents[t], n) +
                         int64_t{row} * dim + c0,
                     nc, &win[static_cast<size_t>(row) * nc]);
          }
          base = win.data();
        }
        cpu::linear::conv_rows(base, nc, x + int64_t{t} * dim, dim, 1, &wt_[c0], dim, &bias_[c0],
                               nc, K, y + int64_t{t} * dim, dim);
        for (int row = 0; row < W; ++row) {
          const float* from =
              row + 1 < W ? base + static_cast<size_t>(row + 1) * nc : x + int64_t{t} * dim;
          store_f32(st.inter_conv, st.conv_dtype,
                    st.inter_conv_offset(static_cast<int64_t>(i), t, n) + int64_t{row} * dim + c0,
                    nc, from);
        }
      }
    }
  }
}

// The recurrence, one (request, head) per work item.
void CpuLinearBackend::run_recurrence(const LayerSpec& layer, const LinearLayerState& st,
                                      const LinearArgs& args) {
  const LinearStateShape& sh = st.shape;
  const LinearSpec& ls = layer.linear;
  const bool mamba = layer.kind == LayerKind::mamba2, kda = layer.kind == LayerKind::kda;
  const int dim = sh.conv_dim, heads = sh.heads, rows = sh.rows, cols = sh.cols;
  const int64_t per_head = static_cast<int64_t>(rows) * cols;
  const int64_t ow = static_cast<int64_t>(heads) * rows;
  const int64_t aw = kda ? int64_t{heads} * cols : heads, bw = mamba ? 0 : heads;
  const int key_heads = mamba ? ls.n_groups : ls.num_k_heads;
  const int n = plan_.draft_tokens;
  const int chunk = std::max(1, ls.chunk_size);
  const float scale =
      layer.scaling > 0.f ? layer.scaling : 1.f / std::sqrt(static_cast<float>(cols));
  const float* A_log = args.A_log.ptr<float>();
  const float* dt_bias = args.dt_bias.ptr<float>();
  const float* Dp = mamba ? args.D.ptr<float>() : nullptr;
  const bool in_place = st.ssm_dtype == DType::f32;
  o_.resize(static_cast<size_t>(plan_.num_tokens * ow));
  const int64_t items = static_cast<int64_t>(plan_.reqs.size()) * heads;
  // Per token and head: a few passes over the state (decay, k.S, the rank-1 update, q.S).
  const int threads = cpu_threads_for(plan_.num_tokens * heads * per_head * 4, num_threads_);

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> work(in_place ? 0 : static_cast<size_t>(per_head));
    const size_t c_max =
        static_cast<size_t>(std::min<int64_t>(chunk, std::max<int64_t>(plan_.max_tokens, 1)));
    std::vector<float> Q(c_max * cols), Kt(c_max * cols), G(c_max * cols), beta(c_max), L(c_max),
        dts(c_max), decay(static_cast<size_t>(cols));
    std::vector<float> scratch(
        mamba ? cpu::linear::ssd_chunk_scratch(static_cast<int>(c_max))
              : cpu::linear::delta_chunk_scratch(static_cast<int>(c_max), cols, rows));

    // Token t (global row) of head h: delta-rule inputs into Q/Kt/G/beta at index j.
    const int group = heads / key_heads;
    auto delta_inputs = [&](int64_t t, int h, size_t j) {
      const float* y = &y_[static_cast<size_t>(t) * dim];
      const int kh = h / group;
      float* q = &Q[j * cols];
      float* k = &Kt[j * cols];
      std::copy_n(y + int64_t{kh} * cols, cols, q);
      std::copy_n(y + int64_t{key_heads} * cols + int64_t{kh} * cols, cols, k);
      cpu::linear::l2_normalise(q, cols, scale);
      cpu::linear::l2_normalise(k, cols, 1.f);
      const float rate = -std::exp(A_log[h]);
      float* g = &G[j * cols];
      if (kda) {
        for (int c = 0; c < cols; ++c) {
          g[c] = rate * softplus(a_[static_cast<size_t>(t * aw) + int64_t{h} * cols + c] +
                                 dt_bias[int64_t{h} * cols + c]);
        }
      } else {
        g[0] = rate * softplus(a_[static_cast<size_t>(t * aw + h)] + dt_bias[h]);
      }
      beta[j] = sigmoid(b_[static_cast<size_t>(t * bw + h)]);
    };
    auto v_ptr = [&](int64_t t, int h) {
      return &y_[static_cast<size_t>(t) * dim + 2 * int64_t{key_heads} * cols + int64_t{h} * rows];
    };
    // Mamba2 pointers into the conv output: x of head h, B and C of its group.
    auto x_ptr = [&](int64_t t, int h) {
      return &y_[static_cast<size_t>(t) * dim + int64_t{h} * rows];
    };
    auto b_ptr = [&](int64_t t, int h) {
      return &y_[static_cast<size_t>(t) * dim + int64_t{heads} * rows + int64_t{h / group} * cols];
    };
    auto c_ptr = [&](int64_t t, int h) { return b_ptr(t, h) + int64_t{key_heads} * cols; };
    // One recurrent step of token t, head h, on state S.
    auto step = [&](float* S, int64_t t, int h) {
      float* out = &o_[static_cast<size_t>(t * ow) + int64_t{h} * rows];
      if (mamba) {
        const float dt = softplus(a_[static_cast<size_t>(t * aw + h)] + dt_bias[h]);
        cpu::linear::ssd_step(S, rows, cols, x_ptr(t, h), b_ptr(t, h), c_ptr(t, h),
                              std::exp(dt * -std::exp(A_log[h])), dt, Dp[h], out);
        return;
      }
      delta_inputs(t, h, 0);
      if (kda) {
        for (int c = 0; c < cols; ++c) decay[c] = std::exp(G[c]);
      } else {
        std::fill(decay.begin(), decay.end(), std::exp(G[0]));
      }
      cpu::linear::delta_step(S, rows, cols, Q.data(), Kt.data(), v_ptr(t, h), decay.data(),
                              beta[0], out);
    };

#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const size_t i = static_cast<size_t>(item / heads);
      const int h = static_cast<int>(item % heads);
      const linear::RequestWork& r = plan_.reqs[i];
      if (r.tokens == 0) continue;
      const int64_t slot_off = st.ssm_offset(r.slot) + int64_t{h} * per_head;
      if (plan_.verify) {
        // Token t: its parent's checkpoint (the root: the slot, or zeros) into checkpoint t, then
        // one step in place there (through `work` for a bf16 state).
        const int32_t* parents = &plan_.parents[i * static_cast<size_t>(n)];
        for (int t = 0; t < r.tokens; ++t) {
          const int64_t dst_off =
              st.inter_ssm_offset(static_cast<int64_t>(i), t, n) + int64_t{h} * per_head;
          float* S = in_place ? static_cast<float*>(st.inter_ssm) + dst_off : work.data();
          if (parents[t] >= 0) {
            load_f32(
                st.inter_ssm, st.ssm_dtype,
                st.inter_ssm_offset(static_cast<int64_t>(i), parents[t], n) + int64_t{h} * per_head,
                per_head, S);
          } else if (r.has_initial_state) {
            load_f32(st.ssm, st.ssm_dtype, slot_off, per_head, S);
          } else {
            std::fill(S, S + per_head, 0.f);
          }
          step(S, r.token_start + t, h);
          if (!in_place) store_f32(st.inter_ssm, st.ssm_dtype, dst_off, per_head, S);
        }
        continue;
      }
      float* S = in_place ? static_cast<float*>(st.ssm) + slot_off : work.data();
      if (r.has_initial_state) {
        if (!in_place) load_f32(st.ssm, st.ssm_dtype, slot_off, per_head, S);
      } else {
        std::fill(S, S + per_head, 0.f);
      }
      if (is_decode(plan_.mode) || r.tokens == 1) {
        for (int t = 0; t < r.tokens; ++t) step(S, r.token_start + t, h);
      } else {
        for (int64_t c0 = 0; c0 < r.tokens; c0 += chunk) {
          const int C = static_cast<int>(std::min<int64_t>(chunk, r.tokens - c0));
          const int64_t t0 = r.token_start + c0;
          float* out = &o_[static_cast<size_t>(t0 * ow) + int64_t{h} * rows];
          if (mamba) {
            const float A = -std::exp(A_log[h]);
            float acc = 0.f;
            for (int j = 0; j < C; ++j) {
              dts[j] = softplus(a_[static_cast<size_t>((t0 + j) * aw + h)] + dt_bias[h]);
              acc += dts[j] * A;
              L[j] = acc;
            }
            cpu::linear::ssd_chunk(S, rows, cols, C, x_ptr(t0, h), dim, b_ptr(t0, h), c_ptr(t0, h),
                                   dim, L.data(), dts.data(), Dp[h], out, ow, scratch.data());
            continue;
          }
          for (int j = 0; j < C; ++j) {
            delta_inputs(t0 + j, h, static_cast<size_t>(j));
            if (j > 0) {  // cumulative log decay from the chunk start
              const int width = kda ? cols : 1;
              for (int c = 0; c < width; ++c) G[j * cols + c] += G[(j - 1) * cols + c];
            }
          }
          cpu::linear::delta_chunk(S, rows, cols, C, Q.data(), Kt.data(), v_ptr(t0, h), dim,
                                   G.data(), !kda, beta.data(), out, ow, scratch.data());
        }
      }
      if (!in_place) store_f32(st.ssm, st.ssm_dtype, slot_off, per_head, S);
    }
  }
}

}  // namespace attnrt
