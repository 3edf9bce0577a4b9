// SIMD kernels of the cpu backend's linear-attention layers (Highway, dynamic dispatch), one head
// (or one channel block) per call; the host glue (linear_backend.cpp) runs them over requests and
// heads with OpenMP. fp32 throughout; the math is that of reference-semantics §8.8 / §8.9 and of
// src/linear (whose float64 forms they are tested against).
//
// Delta-rule state S of one head: [dv, dk] row-major (value-major, §4.7.2): row v holds S[:, v].
// Mamba2 state h of one head: [P, N] row-major.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attnrt::cpu::linear {

// Causal conv with SiLU over `tokens` tokens of `n` channels: the context is the K - 1 rows of
// `window` followed by the rows of `x`; y[t][c] = SiLU(bias[c] + sum_j wt[j][c] * ctx[t + j][c])
// with wt the transposed weights ([K, channels], row j multiplies the j-th oldest input).
void conv_rows(const float* window, int64_t window_stride, const float* x, int64_t x_stride,
               int64_t tokens, const float* wt, int64_t wt_stride, const float* bias, int n, int K,
               float* y, int64_t y_stride);

// x *= scale / sqrt(sum x^2 + 1e-6).
void l2_normalise(float* x, int n, float scale);

// One delta-rule token: S <- diag(decay) S (per key channel, decay = exp(g)); u = beta (v - S^T k);
// S += k u^T; out = S^T q.
void delta_step(float* S, int dv, int dk, const float* q, const float* k, const float* v,
                const float* decay, float beta, float* out);

// One chunk of C tokens of a delta-rule head, starting from S and leaving the state after the
// chunk in S. Q, K: [C, dk] (normalised, Q scaled); V: rows of dv values `v_stride` apart;
// G: [C, dk] cumulative log decays from the chunk start (with scalar_decay, only G[t * dk] is
// read: GDN); beta [C]; outputs: rows of dv values `o_stride` apart. `scratch` holds
// delta_chunk_scratch(C, dk, dv) floats.
size_t delta_chunk_scratch(int C, int dk, int dv);
void delta_chunk(float* S, int dv, int dk, int C, const float* Q, const float* K, const float* V,
                 int64_t v_stride, const float* G, bool scalar_decay, const float* beta, float* O,
                 int64_t o_stride, float* scratch);

// One Mamba2 token: h <- decay h + (dt x) B^T; out = h C + D x.
void ssd_step(float* H, int P, int N, const float* x, const float* B, const float* C, float decay,
              float dt, float D, float* out);

// One chunk of C Mamba2 tokens: x, B, C rows `x_stride` / `bc_stride` apart, L [C] cumulative
// log decays (dt * A) from the chunk start, dt [C]; outputs rows `o_stride` apart. `scratch`
// holds ssd_chunk_scratch(C) floats.
size_t ssd_chunk_scratch(int C);
void ssd_chunk(float* H, int P, int N, int C, const float* X, int64_t x_stride, const float* B,
               const float* Cm, int64_t bc_stride, const float* L, const float* dt, float D,
               float* O, int64_t o_stride, float* scratch);

}  // namespace attnrt::cpu::linear
