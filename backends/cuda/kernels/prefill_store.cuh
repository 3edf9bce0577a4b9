// The epilogue both 128-row prefill CTAs (prefill.cuh, prefill_ws.cuh) share: one finished row
// of an m64 warpgroup-MMA block into the output (or its split's partial).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/math.cuh"

namespace attnrt::cuda {

// Row h (0: fragment row g, 1: g + 8) of this thread's accumulator `o` (NO blocks of ON columns;
// the thread holds columns 2 * c4, 2 * c4 + 1 of every 8) for query token t of `req` and q head
// `head`, with the softmax state m (log2 units) and l (already summed over the row's four
// threads). A split writes its fp32 partial and lse (log2); otherwise the row is normalised
// (sinks in the denominator, v_scale folded in) and written in T, with the natural-log lse when
// asked for.
template <typename T, int D, int ON>
__device__ __forceinline__ void store_prefill_row(const AttnParams& p, const ReqInfo& req,
                                                  int split_index, int t, int head, int c4, int h,
                                                  float ll, float mm,
                                                  const float (&o)[D / ON][ON / 2]) {
  constexpr int NO = D / ON;
  if (req.num_splits > 1) {
    const int64_t prow = req.part_start + static_cast<int64_t>(split_index) * req.qlen + t;
    const float inv = ll > 0.f ? 1.f / ll : 0.f;
    float* dst = p.part_o + (prow * p.num_q_heads + head) * D + 2 * c4;
#pragma unroll
    for (int nb = 0; nb < NO; ++nb)
#pragma unroll
      for (int i = 0; i < ON / 8; ++i)
        *reinterpret_cast<float2*>(dst + nb * ON + i * 8) =
            make_float2(o[nb][4 * i + 2 * h] * inv, o[nb][4 * i + 2 * h + 1] * inv);
    if (c4 == 0) p.part_lse[prow * p.num_q_heads + head] = ll > 0.f ? mm + log2f(ll) : -INFINITY;
  } else {
    const float m_use = mm == -INFINITY ? 0.f : mm;
    float den = ll;
    if (p.sinks != nullptr) den += fast_exp2(p.sinks[head] * kLog2e - m_use);
    const float inv = den > 0.f ? p.v_scale / den : 0.f;
    T* dst = static_cast<T*>(p.out) + (req.qo_start + t) * p.o_stride_tok + head * p.o_stride_head +
             2 * c4;
#pragma unroll
    for (int nb = 0; nb < NO; ++nb)
#pragma unroll
      for (int i = 0; i < ON / 8; ++i)
        *reinterpret_cast<uint32_t*>(dst + nb * ON + i * 8) =
            pack2<T>(o[nb][4 * i + 2 * h] * inv, o[nb][4 * i + 2 * h + 1] * inv);
    if (p.lse_out != nullptr && c4 == 0)
      p.lse_out[(req.qo_start + t) * p.lse_stride_tok + head] = (m_use + log2f(den)) * kLn2;
  }
}

}  // namespace attnrt::cuda
