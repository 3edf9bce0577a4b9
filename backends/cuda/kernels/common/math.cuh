// Scalar math the kernels share: natural <-> base-2 constants, the one-MUFU exp2, the activations
// of the linear-attention layers (reference-semantics §8.8 / §8.9), and sums across lane groups.
#pragma once

#include <cuda_runtime.h>

namespace attnrt::cuda {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): natural -> log2 units
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): log2 -> natural units

// 2^x in one MUFU (subnormal results flush to zero: a softmax weight below 2^-126 of the row
// maximum's adds nothing to the sums).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Lazy rescaling of an online softmax, in log2 units: a row's reference maximum m moves only where
// a candidate (the row's maximum over a new tile) passes it by more than kLazyRescale, or where m
// is still -inf, so O and the row sum are rescaled a few times a row rather than at each new
// maximum. Probabilities then stay below 2^kLazyRescale (exact in fp32 sums and, as relative
// precision, in 16-bit P), and the output divides by a sum taken against the same m. On return m
// is the new reference, m_use what the logits subtract (0 while nothing is visible), alpha the
// running sums' factor (1 where m stayed); the result says whether m moved.
constexpr float kLazyRescale = 8.f;
__device__ __forceinline__ bool lazy_max(float& m, float cand, float& m_use, float& alpha) {
  const bool move = cand > m + kLazyRescale || (m == -INFINITY && cand != -INFINITY);
  const float m_new = move ? cand : m;
  m_use = m_new == -INFINITY ? 0.f : m_new;
  alpha = move ? fast_exp2(m - m_use) : 1.f;
  m = m_new;
  return move;
}

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
// SiLU through the approximate exp and division (MUFU.EX2, MUFU.RCP and a few FMAs; about 1e-6
// relative error, below the bf16 rounding of y): the accurate expf and IEEE division were most of
// the conv's ~25 instructions a channel a token. x far below zero: exp(-x) is inf (or above
// 2^126) and the quotient 0, silu's limit. Every conv path (decode, extend, verify) uses this one,
// so a verify's commit equals sequential decoding bit for bit.
__device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.f + __expf(-x)); }

// The sum of x over each aligned group of L lanes (L a power of two up to 32), in every lane.
template <int L>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = L / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace attnrt::cuda
