// The per-tile steps the prefill CTAs whose warpgroups hold whole m64 blocks (prefill.cuh, 16-bit;
// prefill_fp8.cuh, fp8) share: the K / V tile copies through the page table, and on the m64 wgmma
// accumulator layout the mask, the online softmax, the O rescale and the epilogue. warp wq of a
// warpgroup holds 16 rows of each m64 block, this thread rows g and g + 8 (h = 0, 1) and, of every
// 8 columns, 2 * c4 and 2 * c4 + 1 (registers 4j + 2h, 4j + 2h + 1 of column block j).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/prefill_store.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

// The request's page table (incremental, see ReqInfo): page pj from the row table below
// pt_known, else from the step's array.
struct PrefillPages {
  const int32_t* pt_step;
  const int32_t* pt_row;
  int known;

  __device__ __forceinline__ PrefillPages(const AttnParams& p, const ReqInfo& req)
      : pt_step(p.page_table + req.pt_start - req.pt_known),
        pt_row(p.row_table != nullptr ? p.row_table + req.pt_row : nullptr),
        known(req.pt_known) {}
  __device__ __forceinline__ int32_t page(int pj) const {
    return pj < known ? pt_row[pj] : pt_step[pj];
  }
};

// One K / V tile of BN keys from key kb: this thread's keys kb + key0 + n * STEP (n < PASSES),
// 16-byte chunk `chunk` of each row (elements of E; kbase / vbase at the KV head), into the
// 128-byte swizzled tiles dk / dv; keys at or past hi zero-filled. All page lookups of a tile are
// issued before its copies so their latencies overlap. Slots fit 32 bits (page ids are int32 and
// a pool of 2^31 tokens is far beyond any GPU).
template <int BN, int PASSES, int STEP, typename E>
__device__ __forceinline__ void load_prefill_tile(const AttnParams& p, const PrefillPages& pages,
                                                  int kb, int hi, int key0, int chunk,
                                                  const E* kbase, const E* vbase, unsigned char* dk,
                                                  unsigned char* dv) {
  const int pshift = p.page_shift, pmask = (1 << p.page_shift) - 1;
  int32_t slot[PASSES];
#pragma unroll
  for (int n = 0; n < PASSES; ++n) {
    const int j = kb + key0 + n * STEP;
    slot[n] = j < hi ? (pages.page(j >> pshift) << pshift) | (j & pmask) : -1;
  }
  if (p.slot_map != nullptr) {
#pragma unroll
    for (int n = 0; n < PASSES; ++n)
      if (slot[n] >= 0) slot[n] = static_cast<int32_t>(p.slot_map[slot[n]]);
  }
  constexpr int kChunkElems = 16 / static_cast<int>(sizeof(E));
#pragma unroll
  for (int n = 0; n < PASSES; ++n) {
    const int key = key0 + n * STEP;
    const bool valid = slot[n] >= 0;
    const int64_t s = valid ? slot[n] : 0;
    const uint32_t so = swz128_offset(BN, key, chunk);
    cp_async_16(dk + so, kbase + s * p.k_row_stride + chunk * kChunkElems, valid);
    cp_async_16(dv + so, vbase + s * p.v_row_stride + chunk * kChunkElems, valid);
  }
}

// What the mask needs of this thread's rows: per block mb, the token and mask row of rows g and
// g + 8, and the first and last token of its warp's 16 rows (clamped to the request). r0 of block
// mb: the flattened row of the warp's first row.
template <int MB, bool TREE>
struct PrefillRows {
  int t[MB][2], wt_lo[MB], wt_hi[MB];
  MaskRow rows[MB][2];

  __device__ __forceinline__ PrefillRows(const Mask<TREE>& mask, int first_row, int g, int G,
                                         int qlen) {
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
      const int r0 = first_row + mb * 64;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        t[mb][h] = (r0 + g + 8 * h) / G;
        rows[mb][h] = mask.row(t[mb][h]);
      }
      wt_lo[mb] = min(r0 / G, qlen - 1);
      wt_hi[mb] = min((r0 + 15) / G, qlen - 1);
    }
  }
};

// Softcap (log2 units afterwards), then the mask on blocks whose warp rows need one, on the logits
// s of keys kb .. kb + BN of a split ending at hi.
template <int MB, int BN, bool TREE>
__device__ __forceinline__ void cap_and_mask(float (&s)[MB][BN / 2], const SoftCap& cap,
                                             const Mask<TREE>& mask,
                                             const PrefillRows<MB, TREE>& rows, int kb, int hi,
                                             int c4) {
  if (cap.on) {
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[mb][i] = cap(s[mb][i]);
  }
#pragma unroll
  for (int mb = 0; mb < MB; ++mb) {
    if (mask.needs_mask(kb, BN, hi, rows.wt_lo[mb], rows.wt_hi[mb])) {
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = kb + nb * 8 + 2 * c4 + (e & 1);
          if (!mask.visible(rows.rows[mb][e >> 1], j, hi)) s[mb][nb * 4 + e] = -INFINITY;
        }
    }
  }
}

// Online softmax of one tile (a quad of lanes shares a row): m in log2 units (the true maximum),
// s becomes the weights 2^(s * sl - m + OFFSET) (0, or 8 to fill e4m3's range), l their running
// sum, alpha each row's rescale. Returns whether any row maximum of this thread moved.
template <int MB, int BN, int OFFSET>
__device__ __forceinline__ bool online_softmax(float (&s)[MB][BN / 2], float (&m)[MB][2],
                                               float (&l)[MB][2], float (&alpha)[MB][2], float sl) {
  bool moved = false;
#pragma unroll
  for (int mb = 0; mb < MB; ++mb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb)
        mx = fmaxf(mx, fmaxf(s[mb][nb * 4 + 2 * h], s[mb][nb * 4 + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      const float m_new = fmaxf(m[mb][h], mx * sl);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      alpha[mb][h] = fast_exp2(m[mb][h] - m_use);
      moved = moved || m_new != m[mb][h];
      m[mb][h] = m_new;
      const float shift = OFFSET == 0 ? -m_use : static_cast<float>(OFFSET) - m_use;
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb) {
        float& x0 = s[mb][nb * 4 + 2 * h];
        float& x1 = s[mb][nb * 4 + 2 * h + 1];
        x0 = fast_exp2(fmaf(x0, sl, shift));
        x1 = fast_exp2(fmaf(x1, sl, shift));
        sum += x0 + x1;
      }
      l[mb][h] = l[mb][h] * alpha[mb][h] + sum;
    }
  return moved;
}

// O *= alpha row by row, skipped when no row maximum of the warp moved.
template <int MB, int NO, int ON>
__device__ __forceinline__ void rescale_o(float (&o)[MB][NO][ON / 2], const float (&alpha)[MB][2],
                                          bool moved) {
  if (!__any_sync(0xffffffff, moved)) return;
#pragma unroll
  for (int mb = 0; mb < MB; ++mb)
#pragma unroll
    for (int nb = 0; nb < NO; ++nb)
#pragma unroll
      for (int i = 0; i < ON / 8; ++i) {
        o[mb][nb][4 * i] *= alpha[mb][0];
        o[mb][nb][4 * i + 1] *= alpha[mb][0];
        o[mb][nb][4 * i + 2] *= alpha[mb][1];
        o[mb][nb][4 * i + 3] *= alpha[mb][1];
      }
}

// The epilogue: each row's sum over its quad, then the row (store_prefill_row) for rows of the
// request; the stored maximum is m - OFFSET, that of the weights the sums hold (online_softmax).
template <typename T, int D, int ON, int OFFSET, int MB, bool TREE>
__device__ __forceinline__ void store_prefill_rows(const AttnParams& p, const ReqInfo& req,
                                                   const WorkItem& item, int kvh, int first_row,
                                                   int g, int c4, const PrefillRows<MB, TREE>& rows,
                                                   const float (&l)[MB][2], const float (&m)[MB][2],
                                                   const float (&o)[MB][D / ON][ON / 2]) {
#pragma unroll
  for (int mb = 0; mb < MB; ++mb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float ll = l[mb][h];
      ll += __shfl_xor_sync(0xffffffff, ll, 1);
      ll += __shfl_xor_sync(0xffffffff, ll, 2);
      const int f = first_row + mb * 64 + g + 8 * h;
      const int t = rows.t[mb][h], hg = f - t * p.group;
      if (t >= req.qlen) continue;
      store_prefill_row<T, D, ON>(p, req, item.split, t, kvh * p.group + hg, c4, h, ll,
                                  OFFSET == 0 ? m[mb][h] : m[mb][h] - OFFSET, o[mb]);
    }
}

}  // namespace attnrt::cuda
