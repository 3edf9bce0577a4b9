// The paged side of the attention kernels that read K/V from the pools: page-table access
// (incremental tables, see ReqInfo) and pool slots, the row-table write-back of the pages a step
// commits, the key range of a split, and for the mma.sync decode CTAs (attention.cuh,
// decode_keys_m.cuh) the fp8 tile placements and the cp.async loads of the Q and K/V tiles.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/primitives.cuh"

namespace attnrt::cuda {

// Where the page id of page `j` of request `r` lies (incremental page tables, see ReqInfo).
__device__ __forceinline__ const int32_t* page_id_at(const AttnParams& p, const ReqInfo& r, int j) {
  return j < r.pt_known ? p.row_table + r.pt_row + j : p.page_table + r.pt_start + j - r.pt_known;
}
__device__ __forceinline__ int32_t page_id(const AttnParams& p, const ReqInfo& r, int j) {
  return j < r.pt_known ? p.row_table[r.pt_row + j] : p.page_table[r.pt_start + j - r.pt_known];
}

// Pool slot of key `j` on page `page` (page_mask = page size - 1), through the SWA map if any.
__device__ __forceinline__ int64_t slot_of_page(const AttnParams& p, int page_mask, int32_t page,
                                                int j) {
  int64_t s = (static_cast<int64_t>(page) << p.page_shift) | (j & page_mask);
  if (p.slot_map) s = p.slot_map[s];
  return s;
}

// Pages that become committed with this step go back to the persistent row table, once per
// launch: by the CTA of KV head 0, split 0 and the request's first rows, its `nt` threads
// striding (every layer's launch writes the same values). Other CTAs of the launch read these
// pages from the step's array (j >= pt_known), so nothing reads what is written here.
__device__ __forceinline__ void write_back_committed_pages(const AttnParams& p, const ReqInfo& req,
                                                           const WorkItem& item, int kvh, int tid,
                                                           int nt) {
  if (kvh == 0 && item.split == 0 && item.f0 == 0) {
    for (int j = req.pt_known + tid; j < req.pt_commit; j += nt)
      p.row_table[req.pt_row + j] = p.page_table[req.pt_start + j - req.pt_known];
  }
}

__device__ __forceinline__ int ceil_div_i(int a, int b) { return (a + b - 1) / b; }

// The keys of split `split` of a decode-shaped or generic CTA whose rows are tokens t_first ..
// t_last: the keys they see, in num_splits chunks of whole bn-key tiles. Tree rows here keep every
// key up to the request's end (the mask hides the drafts past a row), so their split points are
// those of the whole request.
__device__ __forceinline__ KeyRange split_range(const Mask<true>& mask, int t_first, int t_last,
                                                int split, int bn) {
  KeyRange keys = mask.span(t_first, t_last);
  if (mask.tree()) keys.hi = mask.req.kv_len;
  return split_keys(keys, mask.req.num_splits, split, bn);
}

// Shared-memory placement of the fp8 K / V tiles of the decode CTAs, chosen so that their
// fragment reads are free of bank conflicts.
//
// 16-byte chunk `c` of K row `key` (attention.cuh and decode_keys_m.cuh): a quarter warp reads
// chunks c4 (+4i) of two consecutive rows -> flip chunk bit 2 on odd rows (head dims 128 and 256).
template <int D>
__device__ __forceinline__ int fp8_k_chunk(int key, int c) {
  return D >= 128 ? c ^ ((key & 1) << 2) : c;
}

// 32-byte group `group` of V row `key` in attention.cuh (head dims 128 and 256; 64 has a 2-way
// conflict): a warp reads one 4-byte word of group J from rows 2c4 (+1, +8, +9) -> rotate the
// group by (row / 2) % 4.
template <int D>
__device__ __forceinline__ int fp8_v_group(int key, int group) {
  return group ^ ((key >> 1) & (D >= 128 ? 3 : 1));
}

// 16-byte chunk `c` of V row `key` in decode_keys_m.cuh: a quarter warp reads chunk g
// (head dim 128; half chunk g at 64) of rows 2 c4 (+1, +8, +9), so the chunk is rotated by
// 2 ((key / 2) % 4) -- free of bank conflicts at 128, 2-way at 64 (all even rows share the
// lower half of the banks there).
template <int D>
__device__ __forceinline__ int keys_m_v_chunk(int key, int c) {
  return D >= 128 ? c ^ (((key >> 1) & 3) << 1) : c ^ ((key >> 1) & 3);
}

// Where a decode CTA's fp8 V chunks go: into the 32-byte groups of fp8_v_group (attention.cuh's
// P V reads) or by keys_m_v_chunk (decode_keys_m.cuh's V^T reads).
enum class Fp8VPlacement { groups, keys_m };

// Issues the cp.async loads of tile `t` of a decode CTA (Cfg: attention.cuh's AttnConfig or
// decode_keys_m.cuh's KeysMConfig) into stage t % kStages: Cfg::kBN keys whose pool slots are
// sSlot[stage][key] (-1 = no key, the row zero-filled), KV head `kvh`, into the stage's K tile at
// sK + stage * kTileBytes and V tile at sV + stage * kTileBytes. 16-bit rows are swizzled; fp8 K
// chunks are placed by fp8_k_chunk, fp8 V chunks as VP says.
template <typename Cfg, Fp8VPlacement VP>
__device__ __forceinline__ void load_kv_tile(const AttnParams& p, int t, const int64_t* sSlot,
                                             unsigned char* sK, unsigned char* sV, int kvh,
                                             int tid) {
  constexpr int D = Cfg::kHeadDim, BN = Cfg::kBN, NT = Cfg::kThreads, LC = Cfg::kLoadChunks;
  const int stage = t % Cfg::kStages;
  const int64_t* slots = sSlot + stage * BN;
  unsigned char* dk = sK + stage * Cfg::kTileBytes;
  unsigned char* dv = sV + stage * Cfg::kTileBytes;
  const unsigned char* kbase = static_cast<const unsigned char*>(p.k);
  const unsigned char* vbase = static_cast<const unsigned char*>(p.v);
#pragma unroll
  for (int n = 0; n < BN * LC / NT; ++n) {
    const int i = tid + n * NT;
    const int key = i / LC, c = i % LC;
    const int64_t s = slots[key];
    const bool valid = s >= 0;
    const unsigned char* ks = kbase;
    const unsigned char* vs = vbase;
    if (valid) {
      ks += (s * p.k_row_stride + kvh * D) * Cfg::kElem + c * 16;
      vs += (s * p.v_row_stride + kvh * D) * Cfg::kElem + c * 16;
    }
    if constexpr (!Cfg::kFp8) {
      cp_async_16(dk + key * D * 2 + swz(key, c) * 16, ks, valid);
      cp_async_16(dv + key * D * 2 + swz(key, c) * 16, vs, valid);
    } else if constexpr (VP == Fp8VPlacement::groups) {
      const int vc = (fp8_v_group<D>(key, c >> 1) << 1) | (c & 1);
      cp_async_16(dk + key * D + fp8_k_chunk<D>(key, c) * 16, ks, valid);
      cp_async_16(dv + key * D + vc * 16, vs, valid);
    } else {
      cp_async_16(dk + key * D + fp8_k_chunk<D>(key, c) * 16, ks, valid);
      cp_async_16(dv + key * D + keys_m_v_chunk<D>(key, c) * 16, vs, valid);
    }
  }
}

// Issues the cp.async copies of rows f0 .. f0 + ROWS of the flattened (token, head-in-group)
// index of `req` for KV head kvh into the swizzled [ROWS][D] tile sQ, NT threads striding; rows
// past the request's tokens are zero-filled.
template <typename T, int ROWS, int D, int NT>
__device__ __forceinline__ void load_q_tile(const AttnParams& p, const ReqInfo& req, int f0,
                                            int kvh, T* sQ, int tid) {
  constexpr int CH = D / 8;
  const int G = p.group;
  for (int i = tid; i < ROWS * CH; i += NT) {
    const int r = i / CH, c = i % CH;
    const int f = f0 + r, t = f / G, hg = f % G;
    const bool valid = t < req.qlen;
    const T* src = static_cast<const T*>(p.q);
    if (valid)
      src += (req.qo_start + t) * p.q_stride_tok + (kvh * G + hg) * p.q_stride_head + c * 8;
    cp_async_16(sQ + r * D + swz(r, c) * 8, src, valid);
  }
}

// The slots of the first Cfg::kStages tiles of the key range `kr` (num_tiles tiles of Cfg::kBN
// keys), into sSlot[tile][key] (-1 = no key), before the key loop's first loads.
template <typename Cfg>
__device__ __forceinline__ void resolve_first_slots(const AttnParams& p, const ReqInfo& req,
                                                    const KeyRange& kr, int num_tiles,
                                                    int page_mask, int64_t* sSlot, int tid) {
  constexpr int BN = Cfg::kBN;
  for (int t = 0; t < Cfg::kStages && t < num_tiles; ++t) {
    for (int k = tid; k < BN; k += Cfg::kThreads) {
      const int j = kr.lo + t * BN + k;
      sSlot[t * BN + k] =
          j < kr.hi ? slot_of_page(p, page_mask, page_id(p, req, j >> p.page_shift), j) : -1;
    }
  }
}

}  // namespace attnrt::cuda
