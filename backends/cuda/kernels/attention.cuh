// Paged attention on tensor cores (flash-attention-2 structure): one kernel for every
// full-attention mode. A CTA takes ROWS query rows of one KV head -- rows are (token, head in GQA
// group) pairs, so the query heads sharing a KV head read each K/V tile once -- and streams the
// keys of its split through double-buffered shared memory, with S = Q K^T and O += P V on
// mma.m16n8k16 and an online softmax in registers.
//
// Warps are arranged as ROWS/16 row groups times WPR key parts: a prefill CTA gives every warp its
// own 16 rows (WPR = 1); a decode CTA has 16 rows and its warps split each K/V tile, merging their
// softmax states through shared memory at the end (WPR = 4); the decode32 (32 rows, WPR = 4 or 2)
// and verify (64 rows, WPR = 1) CTAs, for fp8 KV and head dim 256 (prefill.cuh runs 16-bit KV at
// head dims 64 and 128), hold all the (draft token, head) rows of one request and KV head, so the
// request's K/V is streamed once. Only tiles that reach draft keys, the split's end or a window's
// edge evaluate the mask. The softmax folds the scale into one FFMA per logit before a single MUFU
// ex2 and skips the O rescale when no row maximum of the warp moved.
//
// fp8 KV stays fp8 in shared memory (half the bytes per stage, so twice the stages in flight) and
// is dequantised in registers right before each MMA: K is read with a permuted head-dim order
// (applied to Q too, the dot product does not care) and V with a permuted output-dim order (undone
// at the store), so that every thread reads whole 16-byte / 4-byte words and no pass over shared
// memory or extra barrier is needed. e4m3 -> f16 is one hardware conversion per pair; for bf16
// activations the f16 bits are moved into bf16 position by a shift, which divides the value by
// 2^112 exactly (e4m3 values, and e5m2 values from 2^-14 up, stay normal bf16 numbers); Q is
// multiplied by 2^56 (exact) so
// the logits keep a comfortable fp32 range, and both factors are undone in the fp32 epilogue.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/paged_kv.cuh"
#include "backends/cuda/kernels/primitives.cuh"

namespace attnrt::cuda {

template <int D, int WARPS, int ROWS, int BN, bool FP8, int STAGES = 2, int MIN_BLOCKS = 0>
struct AttnConfig {
  static constexpr int kHeadDim = D;
  static constexpr int kWarps = WARPS;
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kRows = ROWS;
  static constexpr int kBN = BN;
  static constexpr bool kFp8 = FP8;
  static constexpr int kStages = STAGES;  // K/V tiles in flight (cp.async pipeline depth)
  // Resident CTAs per SM the registers must allow (__launch_bounds__; 0 = no register cap: a
  // minimum of 1 was seen to change the allocation, 168 -> 203 registers for the decode CTA).
  static constexpr int kMinBlocks = MIN_BLOCKS;
  static constexpr int kRowGroups = ROWS / 16;
  static constexpr int kWpr = WARPS / kRowGroups;  // warps sharing a row group
  static constexpr int kKW = BN / kWpr;            // keys of a tile per warp
  static constexpr int kElem = FP8 ? 1 : 2;        // bytes per K/V element in shared memory
  static constexpr int kLoadChunks = D * kElem / 16;  // 16-byte chunks of one K or V row
  static_assert(ROWS % 16 == 0 && WARPS % kRowGroups == 0 && kKW % 16 == 0 && D % 64 == 0 &&
                STAGES >= 2 && BN <= kThreads && (BN * kLoadChunks) % kThreads == 0);

  // Shared memory (bytes): Q tile, STAGES stages of K and V tiles (the cross-warp merge area
  // reuses them once the key loop is over), then the slots of the next STAGES tiles' keys.
  static constexpr int kQBytes = ROWS * D * 2;
  static constexpr int kTileBytes = BN * D * kElem;  // one K or V stage
  static constexpr int kKVBytes = 2 * STAGES * kTileBytes;
  static constexpr int kMergeBytes = kWpr > 1 ? WARPS * 16 * (D + 2) * 4 : 0;
  static constexpr int kKVRegion = kKVBytes > kMergeBytes ? kKVBytes : kMergeBytes;
  static constexpr int kSlotBytes = STAGES * BN * 8;
  static constexpr int kSmemBytes = kQBytes + kKVRegion + kSlotBytes;
};

// Two bf16 values times 2^56 (exact unless |q| > 2^71).
__device__ __forceinline__ uint32_t bf16x2_times_2p56(uint32_t x) {
  const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&x);
  const float2 f = __bfloat1622float2(v);
  return pack2<__nv_bfloat16>(f.x * 0x1p56f, f.y * 0x1p56f);
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) attention_kernel(const AttnParams p) {
  constexpr int D = Cfg::kHeadDim, BN = Cfg::kBN, ROWS = Cfg::kRows, KW = Cfg::kKW;
  constexpr int NT = Cfg::kThreads, ST = Cfg::kStages;
  constexpr int TILE = Cfg::kTileBytes;
  constexpr bool FP8 = Cfg::kFp8;
  constexpr bool kUnits = FP8 && std::is_same_v<T, __nv_bfloat16>;  // 2^56 / 2^-112 factors
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  unsigned char* kv = smem + Cfg::kQBytes;
  unsigned char* sK = kv;              // stage s at sK + s * TILE
  unsigned char* sV = kv + ST * TILE;
  int64_t* sSlot = reinterpret_cast<int64_t*>(kv + Cfg::kKVRegion);  // [ST][BN], -1 = no key

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rg = warp / Cfg::kWpr, kp = warp % Cfg::kWpr;
  const int g = lane >> 2, c4 = lane & 3;
  const int kvh = blockIdx.x;
  const WorkItem item = p.work[blockIdx.y];
  const ReqInfo req = p.reqs[item.req];
  // A padded item of a batch-invariant graph step (GraphLayout::det_splits): nothing to do.
  if (item.split >= req.num_splits) return;
  const int G = p.group;
  const int t_first = item.f0 / G;
  const int t_last = min(req.qlen - 1, (item.f0 + ROWS - 1) / G);
  const Mask<true> mask{p, req};
  const KeyRange kr = split_range(mask, t_first, t_last, item.split, BN);
  const int page_mask = (1 << p.page_shift) - 1;
  const bool e5m2 = p.kv_kind == KvKind::e5m2;

  // ---- Q tile: rows f0 .. f0 + ROWS of the flattened (token, head-in-group) index.
  load_q_tile<T, ROWS, D, NT>(p, req, item.f0, kvh, sQ, tid);

  // Launched as the dependent of the step's KV-store kernels (launch_attention's `dependent`), the
  // CTA has so far read only the work item, the request and q, which those kernels do not write
  // (they write the pools' rows at the step's slots), and written only shared memory. Their rows
  // are read below, so the wait comes here; then the merge may be scheduled (it waits for this
  // grid before its first access).
  grid_dependency_wait();
  launch_dependent_grids();

  write_back_committed_pages(p, req, item, kvh, tid, NT);

  // Key slots are resolved one tile ahead of their loads (page table, optional SWA map), so the
  // dependent page-table reads never sit between a tile's turn and its cp.async.
  auto load_tile = [&](int t) {
    load_kv_tile<Cfg, Fp8VPlacement::groups>(p, t, sSlot, sK, sV, kvh, tid);
  };

  const int num_tiles = kr.hi > kr.lo ? ceil_div_i(kr.hi - kr.lo, BN) : 0;
  // Prologue: the slots of the first ST tiles, then the loads of the first ST - 1 (the Q tile
  // rides in the first group). Every iteration commits one group, empty or not, so
  // wait_group<ST - 1> always means "tile `it` has landed".
  resolve_first_slots<Cfg>(p, req, kr, num_tiles, page_mask, sSlot, tid);
  __syncthreads();
  for (int i = 0; i < ST - 1; ++i) {
    if (i < num_tiles) load_tile(i);
    cp_async_commit();
  }

  // Per-thread rows: g and g + 8 of the warp's row group.
  MaskRow rows[2];
  for (int h = 0; h < 2; ++h) rows[h] = mask.row((item.f0 + rg * 16 + g + 8 * h) / G);

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t qf[D / 16][4];

  // The logits' scale into log2 units rides in the exponent's FFMA below (sl); a softcap is
  // applied first and leaves its result in log2 units (sl = 1). The scale is positive, so the row
  // maximum of the unscaled logits times sl is the maximum in log2 units.
  const float qk_unit = kUnits ? 0x1p56f : 1.f;  // undoes 2^56 * 2^-112 in the logits
  const SoftCap cap(p.softcap, p.softmax_scale * qk_unit);
  const float sl = cap.exp_scale(p.scale_log2 * qk_unit);
  for (int it = 0; it < num_tiles; ++it) {
    const int stage = it % ST;
    const int kb = kr.lo + it * BN;
    if (it + ST - 1 < num_tiles) load_tile(it + ST - 1);
    cp_async_commit();
    // Page ids of tile it + ST: loaded now, stored as slots after this tile's math (the load
    // latency hides behind it), read after the barrier that ends this iteration.
    const bool prefetch = it + ST < num_tiles && tid < BN;
    const int pf_j = kb + ST * BN + tid;
    int32_t pf_page = 0;
    if (prefetch && pf_j < kr.hi) pf_page = page_id(p, req, pf_j >> p.page_shift);
    cp_async_wait<ST - 1>();
    __syncthreads();
    if (it == 0) {
      if constexpr (FP8) {
        // A fragments in the permuted head-dim order of the fp8 K reads: logical k-step kk of
        // thread c4 covers dims P .. P + 3, P = ((kk / 4) * 4 + c4) * 16 + (kk % 4) * 4.
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const int P = ((kk >> 2) * 4 + c4) * 16 + (kk & 3) * 4;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = rg * 16 + g + 8 * h;
            uint2 v = *reinterpret_cast<const uint2*>(sQ + r * D + swz(r, P >> 3) * 8 + (P & 7));
            if constexpr (kUnits) {
              v.x = bf16x2_times_2p56(v.x);
              v.y = bf16x2_times_2p56(v.y);
            }
            qf[kk][h] = v.x;
            qf[kk][2 + h] = v.y;
          }
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const int r = rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          const int c = kk * 2 + (lane >> 4);
          ldmatrix_x4(qf[kk], sQ + r * D + swz(r, c) * 8);
        }
      }
    }
    const unsigned char* tK = sK + stage * TILE;
    const unsigned char* tV = sV + stage * TILE;
    const int kw0 = kb + kp * KW;  // first key of this warp

    // S = Q K^T for the warp's KW keys.
    float s[KW / 8][4];
#pragma unroll
    for (int i = 0; i < KW / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    if constexpr (FP8) {
#pragma unroll
      for (int nb = 0; nb < KW / 8; ++nb) {
        const int key = kp * KW + nb * 8 + g;
#pragma unroll
        for (int i = 0; i < D / 64; ++i) {
          const uint4 raw = *reinterpret_cast<const uint4*>(
              tK + key * D + fp8_k_chunk<D>(key, i * 4 + c4) * 16);
          const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            uint32_t b0, b1;
            fp8x4_to<T>(w[q], e5m2, b0, b1);
            mma_16816<T>(s[nb], qf[i * 4 + q], b0, b1);
          }
        }
      }
    } else {
      const T* tK16 = reinterpret_cast<const T*>(tK);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t(&qa)[4] = qf[kk];
#pragma unroll
        for (int np = 0; np < KW / 16; ++np) {
          const int key = kp * KW + np * 16 + (lane & 7) + (lane >> 4) * 8;
          const int c = kk * 2 + ((lane >> 3) & 1);
          uint32_t b[4];
          ldmatrix_x4(b, tK16 + key * D + swz(key, c) * 8);
          mma_16816<T>(s[2 * np], qa, b[0], b[1]);
          mma_16816<T>(s[2 * np + 1], qa, b[2], b[3]);
        }
      }
    }

    // Logits, masked (only tiles that reach the split's end, the diagonal or the window's edge).
    const bool need_mask = mask.needs_mask(kw0, KW, kr.hi, t_first, t_last);
#pragma unroll
    for (int nb = 0; nb < KW / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nb][e];
        if (cap.on) x = cap(x);
        if (need_mask && !mask.visible(rows[e >> 1], kw0 + nb * 8 + 2 * c4 + (e & 1), kr.hi))
          x = -INFINITY;
        s[nb][e] = x;
      }
    }

    // Online softmax (rows g and g + 8; the four lanes of a quad share a row); m in log2 units,
    // p = 2^(x * sl - m): one FFMA and one MUFU per logit. The O rescale is skipped when no row
    // maximum of the warp moved (alpha is then exactly 1, or 0 for a row that has seen no visible
    // key yet, whose O is still 0).
    float alpha[2];
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < KW / 8; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      const float m_new = fmaxf(m[h], mx * sl);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      moved = moved || m_new != m[h];
      alpha[h] = fast_exp2(m[h] - m_use);
      m[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < KW / 8; ++nb) {
        s[nb][2 * h] = fast_exp2(fmaf(s[nb][2 * h], sl, -m_use));
        s[nb][2 * h + 1] = fast_exp2(fmaf(s[nb][2 * h + 1], sl, -m_use));
        sum += s[nb][2 * h] + s[nb][2 * h + 1];
      }
      l[h] = l[h] * alpha[h] + sum;
    }
    if (__any_sync(0xffffffff, moved)) {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[0];
        o[i][2] *= alpha[1];
        o[i][3] *= alpha[1];
      }
    }

    // O += P V: P (accumulator layout) becomes the A operand 16 keys at a time.
#pragma unroll
    for (int kb2 = 0; kb2 < KW / 16; ++kb2) {
      uint32_t a[4];
      a[0] = pack2<T>(s[2 * kb2][0], s[2 * kb2][1]);
      a[1] = pack2<T>(s[2 * kb2][2], s[2 * kb2][3]);
      a[2] = pack2<T>(s[2 * kb2 + 1][0], s[2 * kb2 + 1][1]);
      a[3] = pack2<T>(s[2 * kb2 + 1][2], s[2 * kb2 + 1][3]);
      if constexpr (FP8) {
        // B fragments for output dims 32J + 4g + q (q = 0..3, n-block 4J + q): one word from each
        // of the rows 2c4, 2c4 + 1, 2c4 + 8, 2c4 + 9, transposed bytewise.
        const int k0 = kp * KW + kb2 * 16 + 2 * c4;
#pragma unroll
        for (int J = 0; J < D / 32; ++J) {
          auto word = [&](int key) {
            return *reinterpret_cast<const uint32_t*>(tV + key * D +
                                                      fp8_v_group<D>(key, J) * 32 + 4 * g);
          };
          const uint32_t w0 = word(k0), w1 = word(k0 + 1), w8 = word(k0 + 8), w9 = word(k0 + 9);
          uint32_t b0[4], b1[4];
          fp8x4_to<T>(__byte_perm(w0, w1, 0x5140), e5m2, b0[0], b0[1]);
          fp8x4_to<T>(__byte_perm(w0, w1, 0x7362), e5m2, b0[2], b0[3]);
          fp8x4_to<T>(__byte_perm(w8, w9, 0x5140), e5m2, b1[0], b1[1]);
          fp8x4_to<T>(__byte_perm(w8, w9, 0x7362), e5m2, b1[2], b1[3]);
#pragma unroll
          for (int q = 0; q < 4; ++q) mma_16816<T>(o[4 * J + q], a, b0[q], b1[q]);
        }
      } else {
        const T* tV16 = reinterpret_cast<const T*>(tV);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          const int key = kp * KW + kb2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          const int c = dp * 2 + (lane >> 4);
          uint32_t b[4];
          ldmatrix_x4_trans(b, tV16 + key * D + swz(key, c) * 8);
          mma_16816<T>(o[2 * dp], a, b[0], b[1]);
          mma_16816<T>(o[2 * dp + 1], a, b[2], b[3]);
        }
      }
    }
    if (prefetch) {
      sSlot[((it + ST) % ST) * BN + tid] =
          pf_j < kr.hi ? slot_of_page(p, page_mask, pf_page, pf_j) : -1;
    }
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 2);
  }

  const bool split = req.num_splits > 1;
  const float o_unit = kUnits ? 0x1p112f : 1.f;  // undoes the 2^-112 of bf16-positioned fp8 V
  // Output dim of accumulator o[j][2h + e1] (the fp8 V fragments permute the output dims).
  auto out_dim = [&](int j, int e1) {
    return FP8 ? 32 * (j >> 2) + 8 * c4 + 4 * e1 + (j & 3) : 8 * j + 2 * c4 + e1;
  };
  // Writes one finished row element range; `mm`, `ll`: the row's max (log2) and sum.
  auto store_row = [&](int r_local, int d0, int nd, const float* vals, float mm, float ll) {
    const int f = item.f0 + r_local, t = f / G, hg = f % G;
    if (t >= req.qlen) return;
    const int head = kvh * G + hg;
    if (split) {
      const int64_t prow = req.part_start + static_cast<int64_t>(item.split) * req.qlen + t;
      const float inv = ll > 0.f ? o_unit / ll : 0.f;
      float* dst = p.part_o + (prow * p.num_q_heads + head) * D + d0;
      for (int i = 0; i < nd; ++i) dst[i] = vals[i] * inv;
      if (d0 == 0) p.part_lse[prow * p.num_q_heads + head] = ll > 0.f ? mm + log2f(ll) : -INFINITY;
    } else {
      float den = ll;
      if (p.sinks) den += exp2f(p.sinks[head] * kLog2e - (mm == -INFINITY ? 0.f : mm));
      const float inv = den > 0.f ? p.v_scale * o_unit / den : 0.f;
      T* dst = static_cast<T*>(p.out) + (req.qo_start + t) * p.o_stride_tok +
               head * p.o_stride_head + d0;
      for (int i = 0; i < nd; ++i) dst[i] = from_float<T>(vals[i] * inv);
      if (p.lse_out && d0 == 0)
        p.lse_out[(req.qo_start + t) * p.lse_stride_tok + head] = (mm + log2f(den)) * kLn2;
    }
  };

  if constexpr (Cfg::kWpr == 1) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // The lse is written by the lane holding dim 0 (i == 0, c4 == 0).
        if constexpr (FP8) {
          store_row(rg * 16 + g + 8 * h, out_dim(i, 0), 1, &o[i][2 * h], m[h], l[h]);
          store_row(rg * 16 + g + 8 * h, out_dim(i, 1), 1, &o[i][2 * h + 1], m[h], l[h]);
        } else {
          const float vals[2] = {o[i][2 * h], o[i][2 * h + 1]};
          store_row(rg * 16 + g + 8 * h, out_dim(i, 0), 2, vals, m[h], l[h]);
        }
      }
    }
  } else {
    // Merge the key parts of each row group through shared memory.
    float* mo = reinterpret_cast<float*>(kv);                  // [WARPS][16][D]
    float* mml = mo + Cfg::kWarps * 16 * D;                    // [WARPS][16][2]
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* dst = mo + (warp * 16 + g + 8 * h) * D;
        dst[out_dim(i, 0)] = o[i][2 * h];
        dst[out_dim(i, 1)] = o[i][2 * h + 1];
      }
    }
    if (c4 == 0) {
      for (int h = 0; h < 2; ++h) {
        mml[(warp * 16 + g + 8 * h) * 2] = m[h];
        mml[(warp * 16 + g + 8 * h) * 2 + 1] = l[h];
      }
    }
    __syncthreads();
    constexpr int kVec = 4;
    for (int i = tid; i < Cfg::kRowGroups * 16 * (D / kVec); i += NT) {
      const int row = i / (D / kVec), d0 = (i % (D / kVec)) * kVec;
      const int grp = row / 16, r16 = row % 16;
      float mm = -INFINITY;
      for (int w = 0; w < Cfg::kWpr; ++w)
        mm = fmaxf(mm, mml[((grp * Cfg::kWpr + w) * 16 + r16) * 2]);
      const float m_use = mm == -INFINITY ? 0.f : mm;
      float ll = 0.f, vals[kVec] = {0.f, 0.f, 0.f, 0.f};
      for (int w = 0; w < Cfg::kWpr; ++w) {
        const int ww = (grp * Cfg::kWpr + w) * 16 + r16;
        const float sc = exp2f(mml[ww * 2] - m_use);
        ll += mml[ww * 2 + 1] * sc;
        const float4 ov = *reinterpret_cast<const float4*>(mo + ww * D + d0);
        vals[0] += ov.x * sc;
        vals[1] += ov.y * sc;
        vals[2] += ov.z * sc;
        vals[3] += ov.w * sc;
      }
      store_row(row, d0, kVec, vals, mm, ll);
    }
  }
}

}  // namespace attnrt::cuda
