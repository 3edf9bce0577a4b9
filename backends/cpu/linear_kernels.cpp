// SIMD kernels of the cpu backend's linear-attention layers, compiled once per Highway target
// (foreach_target) and chosen at run time (HWY_DYNAMIC_DISPATCH). Every loop runs over a
// contiguous dimension (channels, key dims, value dims) in vector lanes with a scalar tail, so any
// head size works.
#include "backends/cpu/linear_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

// As the attention kernels: scalable-vector targets are left out (Arm builds use NEON).
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/linear_kernels.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attnrt::cpu::linear {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// exp of non-positive arguments (cumulative log decays); Highway's Exp needs no range care there.
HWY_INLINE VF ExpV(DF df, VF x) { return hn::Exp(df, x); }

HWY_INLINE float SumLanes(DF df, VF v) { return hn::GetLane(hn::SumOfLanes(df, v)); }

HWY_INLINE float Dot(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, int n) {
  const DF df;
  const int L = static_cast<int>(hn::Lanes(df));
  VF acc0 = hn::Zero(df), acc1 = hn::Zero(df);
  int i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    acc0 = hn::MulAdd(hn::LoadU(df, a + i), hn::LoadU(df, b + i), acc0);
    acc1 = hn::MulAdd(hn::LoadU(df, a + i + L), hn::LoadU(df, b + i + L), acc1);
  }
  for (; i + L <= n; i += L) acc0 = hn::MulAdd(hn::LoadU(df, a + i), hn::LoadU(df, b + i), acc0);
  float s = SumLanes(df, hn::Add(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a x
HWY_INLINE void Axpy(float* HWY_RESTRICT y, float a, const float* HWY_RESTRICT x, int n) {
  const DF df;
  const int L = static_cast<int>(hn::Lanes(df));
  const VF va = hn::Set(df, a);
  int i = 0;
  for (; i + L <= n; i += L)
    hn::StoreU(hn::MulAdd(va, hn::LoadU(df, x + i), hn::LoadU(df, y + i)), df, y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

void ConvRows(const float* window, int64_t window_stride, const float* x, int64_t x_stride,
              int64_t tokens, const float* wt, int64_t wt_stride, const float* bias, int n, int K,
              float* y, int64_t y_stride) {
  const DF df;
  const int L = static_cast<int>(hn::Lanes(df));
  const VF one = hn::Set(df, 1.f), cap = hn::Set(df, 80.f);
  auto ctx = [&](int64_t r) {
    return r < K - 1 ? window + r * window_stride : x + (r - (K - 1)) * x_stride;
  };
  for (int64_t t = 0; t < tokens; ++t) {
    float* out = y + t * y_stride;
    int c = 0;
    for (; c + L <= n; c += L) {
      VF acc = hn::LoadU(df, bias + c);
      for (int j = 0; j < K; ++j) {
        acc = hn::MulAdd(hn::LoadU(df, wt + j * wt_stride + c), hn::LoadU(df, ctx(t + j) + c), acc);
      }
      // SiLU; exp(-x) capped so that very negative x gives 0, not 0 * inf.
      const VF e = hn::Exp(df, hn::Min(hn::Neg(acc), cap));
      hn::StoreU(hn::Div(acc, hn::Add(one, e)), df, out + c);
    }
    for (; c < n; ++c) {
      float acc = bias[c];
      for (int j = 0; j < K; ++j) acc += wt[j * wt_stride + c] * ctx(t + j)[c];
      out[c] = acc / (1.f + std::exp(std::min(-acc, 80.f)));
    }
  }
}

void L2Normalise(float* x, int n, float scale) {
  const float f = scale / std::sqrt(Dot(x, x, n) + 1e-6f);
  const DF df;
  const int L = static_cast<int>(hn::Lanes(df));
  const VF vf = hn::Set(df, f);
  int i = 0;
  for (; i + L <= n; i += L) hn::StoreU(hn::Mul(hn::LoadU(df, x + i), vf), df, x + i);
  for (; i < n; ++i) x[i] *= f;
}

void DeltaStep(float* S, int dv, int dk, const float* q, const float* k, const float* v,
               const float* decay, float beta, float* out) {
  const DF df;
  const int L = static_cast<int>(hn::Lanes(df));
  for (int r = 0; r < dv; ++r) {
    float* HWY_RESTRICT row = S + static_cast<int64_t>(r) * dk;
    // Pass 1: decay the row and read S^T k from it.
    VF acc = hn::Zero(df);
    int c = 0;
    for (; c + L <= dk; c += L) {
      const VF s = hn::Mul(hn::LoadU(df, row + c), hn::LoadU(df, decay + c));
      hn::StoreU(s, df, row + c);
      acc = hn::MulAdd(s, hn::LoadU(df, k + c), acc);
    }
    float ks = SumLanes(df, acc);
    for (; c < dk; ++c) {
      row[c] *= decay[c];
      ks += row[c] * k[c];
    }
    // Pass 2: the delta-rule update and the output.
    const float u = beta * (v[r] - ks);
    const VF vu = hn::Set(df, u);
    acc = hn::Zero(df);
    c = 0;
    for (; c + L <= dk; c += L) {
      const VF s = hn::MulAdd(vu, hn::LoadU(df, k + c), hn::LoadU(df, row + c));
      hn::StoreU(s, df, row + c);
      acc = hn::MulAdd(s, hn::LoadU(df, q + c), acc);
    }
    float o = SumLanes(df, acc);
    for (; c < dk; ++c) {
      row[c] += u * k[c];
      o += row[c] * q[c];
    }
    out[r] = o;
  }
}

// out[c] = exp(a[c] - b[c]) * m[c] (b may be null: exp(a[c]) * m[c]).
HWY_INLINE void ExpDiffMul(const float* a, const float* b, const float* m, int n, float* out) {
  const DF df;
  const int L = static_cast<int>(hn::Lanes(df));
  int c = 0;
  for (; c + L <= n; c += L) {
    const VF d = b ? hn::Sub(hn::LoadU(df, a + c), hn::LoadU(df, b + c)) : hn::LoadU(df, a + c);
    hn::StoreU(hn::Mul(ExpV(df, d), hn::LoadU(df, m + c)), df, out + c);
  }
  for (; c < n; ++c) out[c] = std::exp(b ? a[c] - b[c] : a[c]) * m[c];
}

void DeltaChunk(float* S, int dv, int dk, int C, const float* Q, const float* K, const float* V,
                int64_t v_stride, const float* G, bool scalar_decay, const float* beta, float* O,
                int64_t o_stride, float* scratch) {
  float* kk = scratch;       // [C, C] decayed k_t . k_i, i <= t
  float* qk = kk + C * C;    // [C, C] decayed q_t . k_i, i <= t
  float* kd = qk + C * C;    // [C, dk] e^{G_t} k_t
  float* qd = kd + C * dk;   // [C, dk] e^{G_t} q_t
  float* U = qd + C * dk;    // [C, dv] corrected values u_t
  float* kl = U + C * dv;    // [C, dk] e^{G_last - G_i} k_i
  float* tmp = kl + C * dk;  // [dk]
  float* el = tmp + dk;      // [dk] e^{G_last}
  for (int t = 0; t < C; ++t) {
    const float* kt = K + t * dk;
    const float* qt = Q + t * dk;
    for (int i = 0; i <= t; ++i) {
      const float* ki = K + i * dk;
      if (scalar_decay) {
        const float e = std::exp(G[t * dk] - G[i * dk]);
        kk[t * C + i] = e * Dot(kt, ki, dk);
        qk[t * C + i] = e * Dot(qt, ki, dk);
      } else {
        ExpDiffMul(G + t * dk, G + i * dk, ki, dk, tmp);
        kk[t * C + i] = Dot(kt, tmp, dk);
        qk[t * C + i] = Dot(qt, tmp, dk);
      }
    }
    if (scalar_decay) {
      const float e = std::exp(G[t * dk]);
      for (int c = 0; c < dk; ++c) {
        kd[t * dk + c] = e * kt[c];
        qd[t * dk + c] = e * qt[c];
      }
    } else {
      ExpDiffMul(G + t * dk, nullptr, kt, dk, kd + t * dk);
      ExpDiffMul(G + t * dk, nullptr, qt, dk, qd + t * dk);
    }
  }
  // U starts as V - (e^{G_t} k_t)^T S0 and O as (e^{G_t} q_t)^T S0: one pass over the rows of S.
  for (int r = 0; r < dv; ++r) {
    const float* row = S + static_cast<int64_t>(r) * dk;
    for (int t = 0; t < C; ++t) {
      U[t * dv + r] = V[t * v_stride + r] - Dot(row, kd + t * dk, dk);
      O[t * o_stride + r] = Dot(row, qd + t * dk, dk);
    }
  }
  // Forward substitution: u_t = beta_t (U_t - sum_{i<t} kk[t][i] u_i); then the chunk's own
  // contribution to the outputs, o_t += sum_{i<=t} qk[t][i] u_i.
  for (int t = 0; t < C; ++t) {
    float* ut = U + t * dv;
    for (int i = 0; i < t; ++i) Axpy(ut, -kk[t * C + i], U + i * dv, dv);
    const DF df;
    const int L = static_cast<int>(hn::Lanes(df));
    const VF vb = hn::Set(df, beta[t]);
    int r = 0;
    for (; r + L <= dv; r += L) hn::StoreU(hn::Mul(hn::LoadU(df, ut + r), vb), df, ut + r);
    for (; r < dv; ++r) ut[r] *= beta[t];
    for (int i = 0; i <= t; ++i) Axpy(O + t * o_stride, qk[t * C + i], U + i * dv, dv);
  }
  // S_C = diag(e^{G_last}) S0 + sum_i (e^{G_last - G_i} k_i) u_i^T, row by row of S.
  const float* gl = G + (C - 1) * dk;
  for (int i = 0; i < C; ++i) {
    if (scalar_decay) {
      const float e = std::exp(gl[0] - G[i * dk]);
      for (int c = 0; c < dk; ++c) kl[i * dk + c] = e * K[i * dk + c];
    } else {
      ExpDiffMul(gl, G + i * dk, K + i * dk, dk, kl + i * dk);
    }
  }
  for (int c = 0; c < dk; ++c) el[c] = std::exp(scalar_decay ? gl[0] : gl[c]);
  const DF df;
  const int L = static_cast<int>(hn::Lanes(df));
  for (int r = 0; r < dv; ++r) {
    float* row = S + static_cast<int64_t>(r) * dk;
    int c = 0;
    for (; c + L <= dk; c += L)
      hn::StoreU(hn::Mul(hn::LoadU(df, row + c), hn::LoadU(df, el + c)), df, row + c);
    for (; c < dk; ++c) row[c] *= el[c];
    for (int i = 0; i < C; ++i) Axpy(row, U[i * dv + r], kl + i * dk, dk);
  }
}

void SsdStep(float* H, int P, int N, const float* x, const float* B, const float* Cv, float decay,
             float dt, float D, float* out) {
  const DF df;
  const int L = static_cast<int>(hn::Lanes(df));
  const VF vdecay = hn::Set(df, decay);
  for (int p = 0; p < P; ++p) {
    float* HWY_RESTRICT row = H + static_cast<int64_t>(p) * N;
    const float xb = dt * x[p];
    const VF vxb = hn::Set(df, xb);
    VF acc = hn::Zero(df);
    int n = 0;
    for (; n + L <= N; n += L) {
      const VF h = hn::MulAdd(vdecay, hn::LoadU(df, row + n), hn::Mul(vxb, hn::LoadU(df, B + n)));
      hn::StoreU(h, df, row + n);
      acc = hn::MulAdd(h, hn::LoadU(df, Cv + n), acc);
    }
    float y = SumLanes(df, acc);
    for (; n < N; ++n) {
      row[n] = decay * row[n] + xb * B[n];
      y += row[n] * Cv[n];
    }
    out[p] = y + D * x[p];
  }
}

void SsdChunk(float* H, int P, int N, int C, const float* X, int64_t x_stride, const float* B,
              const float* Cm, int64_t bc_stride, const float* Lc, const float* dt, float D,
              float* O, int64_t o_stride, float* scratch) {
  float* w = scratch;    // [C, C] e^{L_t - L_i} dt_i (B_i . C_t), i <= t
  float* f = w + C * C;  // [C] e^{L_last - L_i} dt_i
  for (int t = 0; t < C; ++t) {
    for (int i = 0; i <= t; ++i) {
      w[t * C + i] =
          std::exp(Lc[t] - Lc[i]) * dt[i] * Dot(B + i * bc_stride, Cm + t * bc_stride, N);
    }
  }
  // y_t = e^{L_t} h0 C_t (row by row of h0), then + sum_{i<=t} w[t][i] x_i + D x_t.
  for (int p = 0; p < P; ++p) {
    const float* row = H + static_cast<int64_t>(p) * N;
    for (int t = 0; t < C; ++t)
      O[t * o_stride + p] = std::exp(Lc[t]) * Dot(row, Cm + t * bc_stride, N);
  }
  for (int t = 0; t < C; ++t) {
    float* o = O + t * o_stride;
    for (int i = 0; i <= t; ++i) Axpy(o, w[t * C + i], X + i * x_stride, P);
    Axpy(o, D, X + t * x_stride, P);
  }
  // h_C = e^{L_last} h0 + sum_i (e^{L_last - L_i} dt_i x_i) B_i^T.
  const float ll = Lc[C - 1];
  for (int i = 0; i < C; ++i) f[i] = std::exp(ll - Lc[i]) * dt[i];
  const float el = std::exp(ll);
  const DF df;
  const int L = static_cast<int>(hn::Lanes(df));
  const VF vel = hn::Set(df, el);
  for (int p = 0; p < P; ++p) {
    float* row = H + static_cast<int64_t>(p) * N;
    int n = 0;
    for (; n + L <= N; n += L) hn::StoreU(hn::Mul(hn::LoadU(df, row + n), vel), df, row + n);
    for (; n < N; ++n) row[n] *= el;
    for (int i = 0; i < C; ++i) Axpy(row, f[i] * X[i * x_stride + p], B + i * bc_stride, N);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace attnrt::cpu::linear
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attnrt::cpu::linear {

HWY_EXPORT(ConvRows);
HWY_EXPORT(L2Normalise);
HWY_EXPORT(DeltaStep);
HWY_EXPORT(DeltaChunk);
HWY_EXPORT(SsdStep);
HWY_EXPORT(SsdChunk);

void conv_rows(const float* window, int64_t window_stride, const float* x, int64_t x_stride,
               int64_t tokens, const float* wt, int64_t wt_stride, const float* bias, int n, int K,
               float* y, int64_t y_stride) {
  HWY_DYNAMIC_DISPATCH(ConvRows)
  (window, window_stride, x, x_stride, tokens, wt, wt_stride, bias, n, K, y, y_stride);
}

void l2_normalise(float* x, int n, float scale) { HWY_DYNAMIC_DISPATCH(L2Normalise)(x, n, scale); }

void delta_step(float* S, int dv, int dk, const float* q, const float* k, const float* v,
                const float* decay, float beta, float* out) {
  HWY_DYNAMIC_DISPATCH(DeltaStep)(S, dv, dk, q, k, v, decay, beta, out);
}

size_t delta_chunk_scratch(int C, int dk, int dv) {
  return static_cast<size_t>(2 * C * C + 3 * C * dk + C * dv + 2 * dk);
}

void delta_chunk(float* S, int dv, int dk, int C, const float* Q, const float* K, const float* V,
                 int64_t v_stride, const float* G, bool scalar_decay, const float* beta, float* O,
                 int64_t o_stride, float* scratch) {
  HWY_DYNAMIC_DISPATCH(DeltaChunk)
  (S, dv, dk, C, Q, K, V, v_stride, G, scalar_decay, beta, O, o_stride, scratch);
}

void ssd_step(float* H, int P, int N, const float* x, const float* B, const float* C, float decay,
              float dt, float D, float* out) {
  HWY_DYNAMIC_DISPATCH(SsdStep)(H, P, N, x, B, C, decay, dt, D, out);
}

size_t ssd_chunk_scratch(int C) { return static_cast<size_t>(C * C + C); }

void ssd_chunk(float* H, int P, int N, int C, const float* X, int64_t x_stride, const float* B,
               const float* Cm, int64_t bc_stride, const float* L, const float* dt, float D,
               float* O, int64_t o_stride, float* scratch) {
  HWY_DYNAMIC_DISPATCH(SsdChunk)
  (H, P, N, C, X, x_stride, B, Cm, bc_stride, L, dt, D, O, o_stride, scratch);
}

}  // namespace attnrt::cpu::linear
#endif  // HWY_ONCE
