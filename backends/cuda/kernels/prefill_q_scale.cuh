// The consumers' in-place conversion of Q in the warp-specialised prefill CTAs whose MMAs take
// another type than q: e4m3 in the fp8 CTA (prefill_fp8_ws.cuh), f16 for bf16 q in the CTA over
// fp8 pages (prefill_ws.cuh with PrefillWsKv8Config). The producer copies the 16-bit rows as the
// 16-bit CTA does; each consumer then converts its own 64 rows at one power-of-two scale chosen
// from their |max| (a power of two, so the scaling itself rounds nothing), and the logits come out
// qs times the true ones: the caller's scales take 1 / qs.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/fp8_pv_layout.h"
#include "backends/cuda/kernels/prefill_ws_sync.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

// max(amax, |x|) over the 8 elements of T in v (NaN elements are skipped).
template <typename T>
__device__ __forceinline__ float amax8(const uint4& v, float amax) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(to_float(e[k])));
  return amax;
}

// The largest power of two qs with amax * qs <= limit, its exponent clamped to [-max_exp,
// max_exp]; 1 where amax is 0, NaN or infinite.
__device__ __forceinline__ float pow2_scale_below(float amax, float limit, int max_exp) {
  if (!(amax > 0.f) || !isfinite(amax)) return 1.f;
  int e;
  frexpf(limit / amax, &e);  // limit / amax = m * 2^e, m in [0.5, 1)
  return exp2f(static_cast<float>(min(max(e - 1, -max_exp), max_exp)));
}

// The consumers' thread ct (0 .. 255) converts its share of its consumer's 64 rows of the unit's
// Q: reads its chunks (fp8_pv_layout.h's q_convert_chunk) of the producer's 16-bit tile at sq
// (128-byte swizzle, column blocks of ROWS rows: q16_offset), reduces their |max| over the
// consumer's warpgroup (red: a float per warp of each consumer; the consumer's named barrier),
// then write(v, chunk, qs) puts each chunk back converted at qs = pow2_scale_below(amax, limit,
// max_exp), inside the bytes of the consumer's own rows (the two consumers never touch each
// other's). It fences (the S MMAs read Q through the async proxy) and syncs the consumer again.
// Returns 1 / qs. D: the head dim (D / 8 chunks a row). ROW_LIMIT: only rows below valid_rows
// count towards the |max| (a Q tile by TMA holds the next request's tokens past its own; they are
// converted too, saturating, but never stored).
template <typename T, int ROWS, int D, bool ROW_LIMIT = false, typename Write>
__device__ __forceinline__ float scale_q_rows(const unsigned char* sq, int ct, float (&red)[2][4],
                                              float limit, int max_exp, Write&& write,
                                              int valid_rows = ROWS) {
  constexpr int kPasses = q_convert_passes(D);
  const int cw = ct >> 7;
  // The consumer's own named barrier (a constant id: with an id in a register ptxas reserves all
  // 16 barriers).
  auto consumer_sync = [&] {
    if (cw == 0)
      named_bar_sync(kWsConsumerBar, 128);
    else
      named_bar_sync(kWsConsumerBar + 1, 128);
  };
  uint4 qv[kPasses];
  float amax = 0.f;
#pragma unroll
  for (int n = 0; n < kPasses; ++n) {
    const QChunk q = q_convert_chunk<D>(ct, n);
    qv[n] = *reinterpret_cast<const uint4*>(sq + q16_offset(ROWS, q.r, q.c));
    if (!ROW_LIMIT || q.r < valid_rows) amax = amax8<T>(qv[n], amax);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((ct & 31) == 0) red[cw][q_amax_slot(ct)] = amax;
  // Every thread of the consumer has its chunks in registers and its warp's maximum in red.
  consumer_sync();
  amax = fmaxf(fmaxf(red[cw][0], red[cw][1]), fmaxf(red[cw][2], red[cw][3]));
  const float qs = pow2_scale_below(amax, limit, max_exp);
#pragma unroll
  for (int n = 0; n < kPasses; ++n) write(qv[n], q_convert_chunk<D>(ct, n), qs);
  fence_proxy_async_smem();
  // Every row is written before any warp's S MMAs read the block (and every thread has read red,
  // which the next unit rewrites only after this barrier).
  consumer_sync();
  return 1.f / qs;
}

// bf16 q for f16 MMAs: the largest |q| * qs lands in (2^13, 2^14], well inside f16's range
// (65504), and every bf16 value down to 2^-30 of the largest stays exact in f16 (its 8
// significant bits within f16's 11, normal or subnormal); a smaller one moves by at most 2^-25,
// 2^-38 of the largest. The exponent clamp keeps qs and 1 / qs normal floats; it binds only for a
// |max| below 2^-106.
inline constexpr float kF16QLimit = 16384.f;
inline constexpr int kF16QMaxExp = 120;

// The 8 elements of T in v times qs, as 8 f16 values.
template <typename T>
__device__ __forceinline__ uint4 scale8_f16(const uint4& v, float qs) {
  const T* e = reinterpret_cast<const T*>(&v);
  return make_uint4(pack2<__half>(to_float(e[0]) * qs, to_float(e[1]) * qs),
                    pack2<__half>(to_float(e[2]) * qs, to_float(e[3]) * qs),
                    pack2<__half>(to_float(e[4]) * qs, to_float(e[5]) * qs),
                    pack2<__half>(to_float(e[6]) * qs, to_float(e[7]) * qs));
}

// scale_q_rows to f16 in place (each chunk back where it was read: the tile stays the 16-bit
// layout the S MMAs read). Returns 1 / qs.
template <typename T, int ROWS, int D>
__device__ __forceinline__ float scale_q_rows_f16(unsigned char* sq, int ct, float (&red)[2][4]) {
  return scale_q_rows<T, ROWS, D>(
      sq, ct, red, kF16QLimit, kF16QMaxExp, [&](const uint4& v, QChunk q, float qs) {
        *reinterpret_cast<uint4*>(sq + q16_offset(ROWS, q.r, q.c)) = scale8_f16<T>(v, qs);
      });
}

}  // namespace attnrt::cuda
