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
// asked for; with p.merge_out merged into the row and lse already there (the four threads of the
// row read the running lse before its first thread writes the merged one). FAST: 1 / l through
// MUFU.RCP (no IEEE slow path), the lse only where one is stored, and the normalised row in
// 8-byte stores where it is 8-byte aligned (prefill_ws.cuh at head dims 128 and 192, where it was
// measured; the other CTAs keep the exact division and 4-byte stores).
template <typename T, int D, int ON, bool FAST = false>
__device__ __forceinline__ void store_prefill_row(const AttnParams& p, const ReqInfo& req,
                                                  int split_index, int t, int head, int c4, int h,
                                                  float ll, float mm,
                                                  const float (&o)[D / ON][ON / 2]) {
  constexpr int NO = D / ON;
  const auto div = [](float a, float b) {
    if constexpr (FAST) {
      return __fdividef(a, b);
    } else {
      return a / b;
    }
  };
  if (req.num_splits > 1) {
    const int64_t prow = req.part_start + static_cast<int64_t>(split_index) * req.qlen + t;
    const float inv = ll > 0.f ? div(1.f, ll) : 0.f;
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
    float inv = den > 0.f ? div(p.v_scale, den) : 0.f;
    T* dst = static_cast<T*>(p.out) + (req.qo_start + t) * p.o_stride_tok + head * p.o_stride_head +
             2 * c4;
    // -inf without keys; with FAST taken only where it is used (a log2 is ~25 instructions).
    const auto row_lse = [&] { return (m_use + log2f(den)) * kLn2; };
    float lse = FAST ? 0.f : row_lse();
    float* lse_dst =
        p.lse_out != nullptr ? p.lse_out + (req.qo_start + t) * p.lse_stride_tok + head : nullptr;
    if (p.merge_out) {
      if constexpr (FAST) lse = row_lse();
      // (o, lse) <- merge((o_running, lse_running), (this row, lse)).
      const float la = *lse_dst;
      const float m = fmaxf(la, lse);
      const float wa = la == -INFINITY ? 0.f : __expf(la - m);
      const float wn = lse == -INFINITY ? 0.f : __expf(lse - m);
      const float sum = wa + wn;
      const float keep = sum > 0.f ? wa / sum : 1.f;
      inv *= sum > 0.f ? wn / sum : 0.f;
#pragma unroll
      for (int nb = 0; nb < NO; ++nb)
#pragma unroll
        for (int i = 0; i < ON / 8; ++i) {
          T* e = dst + nb * ON + i * 8;
          *reinterpret_cast<uint32_t*>(e) =
              pack2<T>(fmaf(to_float(e[0]), keep, o[nb][4 * i + 2 * h] * inv),
                       fmaf(to_float(e[1]), keep, o[nb][4 * i + 2 * h + 1] * inv));
        }
      lse = sum > 0.f ? m + __logf(sum) : la;
      // Every thread of the row has read the running lse before the first one writes.
      __syncwarp(0xfu << (threadIdx.x & 28));
      if constexpr (FAST) {
        if (lse_dst != nullptr && c4 == 0) *lse_dst = lse;
      }
    } else if (FAST && ON % 16 == 0 && (reinterpret_cast<uintptr_t>(dst - 2 * c4) & 7) == 0) {
      // 8-byte stores: lanes c4 and c4 ^ 1 of the row's quad swap one column pair of each two
      // groups of 8 columns, so the even lane holds 4 adjacent columns of group i and the odd
      // one 4 of group i + 1. A warp's store then writes 32 whole bytes of each of its 8 rows
      // (16 with 4-byte stores), and a thread half as many stores. (The quad's lanes share the
      // row, so they take this branch together.)
      const bool odd = (c4 & 1) != 0;
      const unsigned quad = 0xfu << (threadIdx.x & 28);
      T* row = dst - 2 * c4 + 2 * (c4 & 2);
#pragma unroll
      for (int nb = 0; nb < NO; ++nb)
#pragma unroll
        for (int i = 0; i < ON / 8; i += 2) {
          const uint32_t a = pack2<T>(o[nb][4 * i + 2 * h] * inv, o[nb][4 * i + 2 * h + 1] * inv);
          const uint32_t b =
              pack2<T>(o[nb][4 * i + 4 + 2 * h] * inv, o[nb][4 * i + 4 + 2 * h + 1] * inv);
          const uint32_t r = __shfl_xor_sync(quad, odd ? a : b, 1);
          *reinterpret_cast<uint2*>(row + nb * ON + (i + (odd ? 1 : 0)) * 8) =
              make_uint2(odd ? r : a, odd ? b : r);
        }
      if (lse_dst != nullptr && c4 == 0) *lse_dst = row_lse();
    } else {
#pragma unroll
      for (int nb = 0; nb < NO; ++nb)
#pragma unroll
        for (int i = 0; i < ON / 8; ++i)
          *reinterpret_cast<uint32_t*>(dst + nb * ON + i * 8) =
              pack2<T>(o[nb][4 * i + 2 * h] * inv, o[nb][4 * i + 2 * h + 1] * inv);
      // FAST: the lse after the row's stores.
      if constexpr (FAST) {
        if (lse_dst != nullptr && c4 == 0) *lse_dst = row_lse();
      }
    }
    if constexpr (!FAST) {
      if (lse_dst != nullptr && c4 == 0) *lse_dst = lse;
    }
  }
}

}  // namespace attnrt::cuda
