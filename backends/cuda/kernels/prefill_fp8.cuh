// Prefill / extend attention on Hopper's fp8 tensor cores (wgmma .e4m3, sm_90a): the 128-row CTA
// of prefill.cuh for an e4m3 KV pool with bf16 or fp16 q and output, head dim 128. It takes the
// same TileShape::prefill work items (EXTEND, MIXED and DRAFT_EXTEND steps, no tree mask), the same
// splits, partials and lse as the 16-bit CTA, so the host plan does not change.
//
// Design: one warpgroup holding the 128 rows as two m64 blocks, two CTAs per SM (as prefill.cuh at
// d64 / d128: one CTA's softmax overlaps the other's MMAs), a cp.async ring of K / V tiles of 64
// keys, two barriers per tile.
//  - q: read from global memory once, quantised to e4m3 in the CTA with one power-of-two scale per
//    CTA (2^floor(log2(448 / amax)) over its 128 rows), so the only rounding is e4m3's; the scale's
//    inverse is folded into the softmax scale (which already holds k_scale).
//  - S = Q K^T: m64n64k32 e4m3 MMAs, Q and K K-major in the 128-byte swizzled layout (a row of 128
//    fp8 bytes is one swizzle column block; a k32 step is 32 bytes, as a 16-bit k16 step).
//  - P: the online softmax in fp32 with the row maximum offset by 8 (log2 units), so the weights
//    lie in [0, 256] (e4m3 reaches 448), converted to e4m3 in registers as the A operand of
//    O += P V (m64n128k32). The row sums l add the same fp32 weights, and the stored maximum is
//    offset back, so the factor 2^8 cancels.
//  - V: fp8 MMAs read B K-major only, so V is transposed in shared memory: the tile lands by
//    cp.async as [64 keys][128 bytes] in a staging stage; while the S MMAs run, the warpgroup
//    reads 4 keys x 4 bytes with 32-bit loads, transposes them with byte permutes and stores
//    [128 head-dim rows][64 keys] in the 64-byte swizzled layout, the keys of every 32 permuted
//    as fp8_pv_layout.h says so that P needs no register exchange.
//  - Output: O x v_scale / l through prefill_store.cuh, as the 16-bit CTA.
// Causal, window, softcap and sinks as prefill.cuh (softcap and window run-time flags; sinks in
// the shared epilogue).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/cta_entry.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/fp8_pv_layout.h"
#include "backends/cuda/kernels/paged_kv.cuh"
#include "backends/cuda/kernels/prefill.h"
#include "backends/cuda/kernels/prefill_q_scale.cuh"
#include "backends/cuda/kernels/prefill_tile.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

struct PrefillFp8Config {
  static constexpr int kHeadDim = 128;  // bytes of a K / Q row: one 128-byte swizzle block
  static constexpr int kBN = 64;        // keys per tile: 64-byte rows of the transposed V
  static constexpr int kStages = 3;
  static constexpr int kThreads = 128;
  static constexpr int kMinCtas = 2;
  static constexpr int kRows = kPrefillTileRows;
  static constexpr int kMB = kRows / 64;
  static constexpr int kChunks = kHeadDim / 16;  // 16-byte chunks of an fp8 row
  static constexpr int kQBytes = kRows * kHeadDim;
  static constexpr int kTileBytes = kBN * kHeadDim;
  // Q, then per stage K and the V staging tile, then the transposed V; 1024 bytes of slack (swizzle
  // atoms start on a 1024-byte boundary).
  static constexpr int kSmemBytes = 1024 + kQBytes + kStages * 2 * kTileBytes + kTileBytes;
  static constexpr int kKeysPerPass = kThreads / kChunks;
  static constexpr int kPasses = kBN / kKeysPerPass;
  static_assert(kBN == 64, "the transposed V tile has 64-byte rows (64-byte swizzle)");
};

// The largest e4m3 value, and the power of two q is multiplied by: amax * scale <= 448.
inline constexpr float kE4m3Max = 448.f;
__device__ __forceinline__ float fp8_q_scale(float amax) {
  return pow2_scale_below(amax, kE4m3Max, 100);
}

// The V transpose of 64 keys by the 128 threads of a warpgroup (thread `tid`): the staged tile sv
// ([64 keys][128 bytes], 128-byte swizzle, as the copies land) into vt (position p of every
// head-dim row holding key pv_key(p)), this thread's 4 x 4 byte blocks (vt_block) by 32-bit loads,
// byte permutes and 32-bit stores.
__device__ __forceinline__ void transpose_v64(const unsigned char* sv, unsigned char* vt, int tid) {
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const VtBlock blk = vt_block(tid, n);
    uint32_t in[4], out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      in[i] = *reinterpret_cast<const uint32_t*>(
          sv + v_stage_offset(pv_key(4 * blk.pq + i), 4 * blk.dq));
    transpose4x4_bytes(in, out, [](uint32_t x, uint32_t y, uint32_t s) {
      return static_cast<uint32_t>(__byte_perm(x, y, s));
    });
#pragma unroll
    for (int b = 0; b < 4; ++b)
      *reinterpret_cast<uint32_t*>(vt + vt_offset(4 * blk.dq + b, 4 * blk.pq)) = out[b];
  }
}

template <typename T>
__global__ void __launch_bounds__(PrefillFp8Config::kThreads, PrefillFp8Config::kMinCtas)
    prefill_fp8_kernel(const AttnParams p) {
  using Cfg = PrefillFp8Config;
  constexpr int D = Cfg::kHeadDim, BN = Cfg::kBN, ST = Cfg::kStages, MB = Cfg::kMB;
  constexpr int CH = Cfg::kChunks, NT = Cfg::kThreads, ROWS = Cfg::kRows;
  extern __shared__ unsigned char smem_raw[];
  __shared__ float red[NT / 32];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
  unsigned char* smem = smem_raw + pad;
  const uint32_t sQ = raw + pad;
  const uint32_t sKV = sQ + Cfg::kQBytes;
  unsigned char* vt = smem + Cfg::kQBytes + ST * 2 * Cfg::kTileBytes;
  const uint32_t sVt = sQ + Cfg::kQBytes + ST * 2 * Cfg::kTileBytes;

  const int tid = threadIdx.x, lane = tid & 31, wq = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;
  const int kvh = blockIdx.x;
  const WorkItem item = p.work[blockIdx.y];
  const ReqInfo req = p.reqs[item.req];
  if (item.split >= req.num_splits) return;
  const int G = p.group;
  const int t_first = item.f0 / G;
  const int t_last = min(req.qlen - 1, (item.f0 + ROWS - 1) / G);
  const Mask<false> mask{p, req};
  const KeyRange kr = split_keys(mask.span(t_first, t_last), req.num_splits, item.split, BN);
  const int lo = kr.lo, hi = kr.hi;
  const int num_tiles = hi > lo ? (hi - lo + BN - 1) / BN : 0;

  // ---- Q: rows f0 .. f0 + ROWS (rows past the request's tokens are zero), 8 elements a load;
  // the CTA's amax, then e4m3 at the CTA's scale into the swizzled tile.
  float inv_qs;
  {
    constexpr int QCH = D / 8, QN = ROWS * QCH / NT;
    const T* q = static_cast<const T*>(p.q);
    uint4 qv[QN];
    float amax = 0.f;
#pragma unroll
    for (int n = 0; n < QN; ++n) {
      const int i = tid + n * NT, r = i / QCH, c = i % QCH;
      const int f = item.f0 + r, t = f / G, hg = f - t * G;
      qv[n] = make_uint4(0, 0, 0, 0);
      if (t < req.qlen)
        qv[n] = *reinterpret_cast<const uint4*>(q + (req.qo_start + t) * p.q_stride_tok +
                                                (kvh * G + hg) * p.q_stride_head + c * 8);
      const T* e = reinterpret_cast<const T*>(&qv[n]);
#pragma unroll
      for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(to_float(e[k])));
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) red[wq] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) amax = fmaxf(amax, red[w]);
    const float qs = fp8_q_scale(amax);
    inv_qs = 1.f / qs;
#pragma unroll
    for (int n = 0; n < QN; ++n) {
      const int i = tid + n * NT, r = i / QCH, c = i % QCH;
      const T* e = reinterpret_cast<const T*>(&qv[n]);
      const uint2 w = make_uint2(pack4_e4m3(to_float(e[0]) * qs, to_float(e[1]) * qs,
                                            to_float(e[2]) * qs, to_float(e[3]) * qs),
                                 pack4_e4m3(to_float(e[4]) * qs, to_float(e[5]) * qs,
                                            to_float(e[6]) * qs, to_float(e[7]) * qs));
      *reinterpret_cast<uint2*>(smem + swz128_offset(ROWS, r, c >> 1) + (c & 1) * 8) = w;
    }
    fence_proxy_async_smem();
  }

  grid_dependency_wait();
  launch_dependent_grids();

  write_back_committed_pages(p, req, item, kvh, tid, NT);

  // ---- K / V tile copies through the page table (fp8 rows: 8 chunks of 16 bytes).
  const PrefillPages pages(p, req);
  const uint8_t* kbase = static_cast<const uint8_t*>(p.k) + kvh * D;
  const uint8_t* vbase = static_cast<const uint8_t*>(p.v) + kvh * D;
  const int ld_c = tid % CH, ld_key = tid / CH;
  auto load_tile = [&](int kb, int stage) {
    unsigned char* dk = smem + Cfg::kQBytes + stage * 2 * Cfg::kTileBytes;
    load_prefill_tile<BN, Cfg::kPasses, Cfg::kKeysPerPass>(p, pages, kb, hi, ld_key, ld_c, kbase,
                                                           vbase, dk, dk + Cfg::kTileBytes);
  };

  // ---- The V transpose of a stage's 64 keys (transpose_v64).
  auto transpose_v = [&](int stage) {
    transpose_v64(smem + Cfg::kQBytes + stage * 2 * Cfg::kTileBytes + Cfg::kTileBytes, vt, tid);
  };

#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < num_tiles) load_tile(lo + s * BN, s);
    cp_async_commit();
  }

  const int first_row = item.f0 + wq * 16;
  const PrefillRows<MB, false> rows(mask, first_row, g, G, req.qlen);
  const int gt_lo = min(t_first, req.qlen - 1);
  const int gt_hi = t_last;

  // Logits of the fp8 product are qs times the true ones: the scales take 1 / qs.
  const SoftCap cap(p.softcap, p.softmax_scale * inv_qs);
  const float sl = cap.exp_scale(p.scale_log2 * inv_qs);
  // P' = 2^8 P: weights in [0, 256].
  constexpr int kPOffset = 8;

  float o[MB][1][D / 2];
#pragma unroll
  for (int mb = 0; mb < MB; ++mb)
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[mb][0][i] = 0.f;
  float m[MB][2], l[MB][2];
#pragma unroll
  for (int mb = 0; mb < MB; ++mb) m[mb][0] = m[mb][1] = -INFINITY, l[mb][0] = l[mb][1] = 0.f;

  for (int it = 0; it < num_tiles; ++it) {
    // Tile it has landed, and every thread is past the previous tile's P V MMAs (the transposed V
    // and the stage the next copy overwrites are free).
    cp_async_wait<ST - 2>();
    fence_proxy_async_smem();
    __syncthreads();
    if (it + ST - 1 < num_tiles) load_tile(lo + (it + ST - 1) * BN, (it + ST - 1) % ST);
    cp_async_commit();
    const int kb = lo + it * BN;
    if (mask.hides(kb, BN, gt_lo, gt_hi)) continue;  // the same for the whole CTA
    const uint32_t tK = sKV + (it % ST) * 2 * Cfg::kTileBytes;

    // ---- S = Q K^T, then the V transpose while the MMAs run.
    float s[MB][BN / 2];
    wgmma_fence();
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int kk = 0; kk < D / 32; ++kk) {
        const uint64_t da = wgmma_desc(sQ + mb * 64 * 128 + kk * 32, 16);
        const uint64_t db = wgmma_desc(tK + kk * 32, 16);
        wgmma_ss_e4m3<BN>(s[mb], da, db, kk > 0 ? 1 : 0);
      }
    wgmma_commit();
    transpose_v(it % ST);
    fence_proxy_async_smem();
    wgmma_wait<0>();

    // ---- Softcap, mask, the online softmax of P' (m the true maximum, the weights from m - 8),
    // the O rescale.
    cap_and_mask<MB, BN>(s, cap, mask, rows, kb, hi, c4);
    float alpha[MB][2];
    const bool moved = online_softmax<MB, BN, kPOffset>(s, m, l, alpha, sl);
    rescale_o<MB, 1, D>(o, alpha, moved);

    // ---- O += P V: P' in e4m3 as the register A operand, 32 keys per MMA, against the
    // transposed V (the key order of fp8_pv_layout.h).
    uint32_t pa[MB][BN / 32][4];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int k32 = 0; k32 < BN / 32; ++k32)
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const float* x = s[mb] + 16 * k32;
          pa[mb][k32][a] = pack4_e4m3(x[pv_fragment_index(a, 0)], x[pv_fragment_index(a, 1)],
                                      x[pv_fragment_index(a, 2)], x[pv_fragment_index(a, 3)]);
        }
    // Every thread's part of the transposed V is written (and fenced) before any MMA reads it.
    __syncthreads();
    wgmma_fence();
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int k32 = 0; k32 < BN / 32; ++k32)
        wgmma_rs_e4m3<D>(o[mb][0], pa[mb][k32], wgmma_desc_sw64(sVt + k32 * 32));
    wgmma_commit();
    wgmma_wait<0>();
  }
  cp_async_wait<0>();

  // ---- Epilogue: the stored maximum is that of P (m - 8), so that lse and the merge see P.
  store_prefill_rows<T, D, D, kPOffset>(p, req, item, kvh, first_row, g, c4, rows, l, m, o);
}

}  // namespace attnrt::cuda
