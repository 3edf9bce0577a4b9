// The fp8 steps of the warp-specialised fp8 prefill CTA (prefill_fp8_ws.cuh) on an m64 block of
// rows, head dim 128: q's e4m3 packing, S = Q K^T, the packing of the weights P into the A operand
// of O += P V, and that MMA; the V transpose of 64 keys (transpose_v64) is prefill_fp8.cuh's,
// shared with the one-warpgroup fp8 CTA. They are the steps of that CTA (whose header comment
// describes the layouts), which keeps its MMAs and packing inline: it was verified and measured on
// the GPU in that form (the same layout functions of fp8_pv_layout.h serve both, and its q scale,
// fp8_q_scale, is taken from there).
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/fp8_pv_layout.h"
#include "backends/cuda/kernels/prefill_fp8.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

// Bytes of a K / Q row (one 128-byte swizzle block; the transposed V tile of 64 keys,
// fp8_pv_layout.h's kFp8VtBytes, has as many rows).
inline constexpr int kFp8HeadDim = PrefillFp8Config::kHeadDim;
static_assert(kFp8HeadDim == 128 && kFp8VtBytes == 64 * kFp8HeadDim);
// The weights P' = 2^8 P lie in [0, 256] (online_softmax's OFFSET; e4m3 reaches 448).
inline constexpr int kFp8POffset = 8;

// The 8 elements of T in v times qs, as 8 e4m3 bytes.
template <typename T>
__device__ __forceinline__ uint2 quantise8_e4m3(const uint4& v, float qs) {
  const T* e = reinterpret_cast<const T*>(&v);
  return make_uint2(pack4_e4m3(to_float(e[0]) * qs, to_float(e[1]) * qs, to_float(e[2]) * qs,
                               to_float(e[3]) * qs),
                    pack4_e4m3(to_float(e[4]) * qs, to_float(e[5]) * qs, to_float(e[6]) * qs,
                               to_float(e[7]) * qs));
}

// S = Q K^T of one m64 block against BN keys: Q at sq (64 rows of 128 bytes), K at tk (BN rows),
// both K-major in the 128-byte swizzled layout; four k32 steps. The caller fences and commits.
template <int BN>
__device__ __forceinline__ void mma_s_e4m3(float (&s)[BN / 2], uint32_t sq, uint32_t tk) {
#pragma unroll
  for (int kk = 0; kk < kFp8HeadDim / 32; ++kk)
    wgmma_ss_e4m3<BN>(s, wgmma_desc(sq + kk * 32, 16), wgmma_desc(tk + kk * 32, 16), kk > 0);
}

// P' of BN keys (the S accumulator after the softmax) into the e4m3 A operand, 32 keys a step
// (fp8_pv_layout.h: each thread packs its own values).
template <int BN>
__device__ __forceinline__ void pack_p_e4m3(const float (&s)[BN / 2], uint32_t (&pa)[BN / 32][4]) {
#pragma unroll
  for (int k32 = 0; k32 < BN / 32; ++k32)
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const float* x = s + 16 * k32;
      pa[k32][a] = pack4_e4m3(x[pv_fragment_index(a, 0)], x[pv_fragment_index(a, 1)],
                              x[pv_fragment_index(a, 2)], x[pv_fragment_index(a, 3)]);
    }
}

// O += P V over BN keys: P' from registers, V from the transposed tiles at vt (BN / 64 of
// kFp8VtBytes, each holding 64 keys in fp8_pv_layout.h's order). The caller fences and commits.
template <int BN>
__device__ __forceinline__ void mma_pv_e4m3(float (&o)[kFp8HeadDim / 2],
                                            const uint32_t (&pa)[BN / 32][4], uint32_t vt) {
#pragma unroll
  for (int k32 = 0; k32 < BN / 32; ++k32)
    wgmma_rs_e4m3<kFp8HeadDim>(o, pa[k32], wgmma_desc_sw64(vt + vt_k32_offset(k32)));
}

}  // namespace attnrt::cuda
