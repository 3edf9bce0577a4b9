// Prefill / extend attention on Hopper warpgroup MMAs (wgmma, sm_90a), 16-bit K/V read from the
// paged pool, causal or not: EXTEND, MIXED and DRAFT_EXTEND steps whose CTAs hold 128 query rows
// (the plan's TileShape::prefill work items), and every step of the TileShape::verify and
// TileShape::decode32 work items (TARGET_VERIFY trees and chains, short extends; a decode32 item
// holds all of its request's <= 32 rows) on a 64-row CTA at head dims 64 and 128.
//
// A CTA owns 128 (or 64) flattened (token, head-in-group) rows of one KV head, so each K/V tile is
// read once per GQA group. Q and the K/V tiles live in shared memory in the 128-byte swizzled
// layout (wgmma.cuh); S = Q K^T is an m64nBNk16 MMA with both operands in shared memory, and the
// probabilities stay in registers as the A operand of O += P V, with V read transposed from the
// same tile layout. The tensor cores read shared memory themselves: no ldmatrix traffic, which
// bounded the earlier mma.sync version of this kernel (~300 TFLOP/s at d128 on the H200, against
// ~380 here, docs/BENCHMARKS.md).
//
// Shapes, each chosen by measurement on the H200:
//  - d64 / d128: ONE warpgroup per CTA holding all 128 rows as two m64 blocks, and two CTAs per
//    SM. Independent CTAs overlap one CTA's softmax with the other's MMAs; two warpgroups in one
//    CTA (one m64 block each) are held in step by the per-tile barrier and measured 9-17% slower.
//  - d256: two warpgroups of one m64 block each (two m64 blocks would need 256 O accumulators per
//    thread).
//  - verify (64 rows, d64 / d128): one warpgroup of one m64 block. At 16 draft tokens x group 4
//    a verify CTA does 16x the MMA work per K/V byte of a decode CTA; on the tensor cores'
//    shared-memory operands that work stays below the time the K/V takes to stream in, so the
//    shape is sized for bytes in flight: a smaller Q tile leaves room for a third stage.
//    TARGET_VERIFY trees apply the tree mask exactly as attention.cuh does: prefix keys unmasked,
//    draft u visible iff bit u of the row's mask, the window measured between tree depths.
// Per tile: a STAGES-deep cp.async ring with ONE barrier (the barrier that publishes tile i also
// proves every warp is done with the stage tile i + STAGES - 1 overwrites); the page-table
// lookups of a whole tile issued before its copies; masks only on tiles that straddle the causal
// diagonal, the window edge or the end of the key range; tiles no row of a warpgroup can see
// skipped; exp2 with the softmax scale folded into one FFMA per logit; the O rescale skipped when
// no row maximum of the warp moved. Softcap and window are run-time flags tested once per tile
// outside the element loops: template parameters would double the instantiations (CI compiles
// these on two cores) for features the large prefill rows do not use.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/cta_entry.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/paged_kv.cuh"
#include "backends/cuda/kernels/prefill.h"
#include "backends/cuda/kernels/prefill_store.cuh"
#include "backends/cuda/kernels/prefill_tile.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

// D: head dim; WG: warpgroups per CTA; BN: keys per tile; STAGES: K/V tiles resident;
// MIN_CTAS: CTAs per SM the register cap must allow; ROWS: query rows (the plan's prefill or
// verify tile; only the verify CTA carries the tree mask).
template <int D, int WG, int BN, int STAGES, int MIN_CTAS, int ROWS = kPrefillTileRows>
struct PrefillConfig {
  static constexpr int kHeadDim = D;
  static constexpr int kBN = BN;
  static constexpr int kStages = STAGES;
  static constexpr int kWarpgroups = WG;
  static constexpr int kThreads = WG * 128;
  static constexpr int kMinCtas = MIN_CTAS;
  static constexpr int kRows = ROWS;
  static constexpr bool kTree = ROWS == kPrefillVerifyTileRows;
  static constexpr int kMB = kRows / 64 / WG;  // m64 blocks per warpgroup
  static constexpr int kChunks = D / 8;
  static constexpr int kON = D > 128 ? 128 : D;  // N of one P V MMA (at most 128 accumulators)
  static constexpr int kQBytes = kRows * D * 2;
  static constexpr int kTileBytes = BN * D * 2;
  // 1024 bytes of slack: swizzle atoms must start on a 1024-byte boundary.
  static constexpr int kSmemBytes = 1024 + kQBytes + STAGES * 2 * kTileBytes;
  static constexpr int kKeysPerPass = kThreads / kChunks;
  static constexpr int kPasses = BN / kKeysPerPass;
  static_assert(kRows == kPrefillTileRows || kRows == kPrefillVerifyTileRows,
                "prefill CTAs must match the plan's prefill or verify tile");
  static_assert(kRows % (64 * WG) == 0 && D % 64 == 0 && BN % 64 == 0 && BN <= 128 &&
                kThreads % kChunks == 0 && BN % kKeysPerPass == 0 && STAGES >= 2);
};

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinCtas) prefill_kernel(const AttnParams p) {
  constexpr int D = Cfg::kHeadDim, BN = Cfg::kBN, ST = Cfg::kStages, MB = Cfg::kMB;
  constexpr int CH = Cfg::kChunks, NT = Cfg::kThreads, ON = Cfg::kON, NO = D / ON;
  constexpr int ROWS = Cfg::kRows;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
  unsigned char* smem = smem_raw + pad;
  const uint32_t sQ = raw + pad;  // shared-window addresses for the descriptors
  const uint32_t sKV = sQ + Cfg::kQBytes;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, c4 = lane & 3;
  const int kvh = blockIdx.x;
  const WorkItem item = p.work[blockIdx.y];
  const ReqInfo req = p.reqs[item.req];
  // A padded item of a batch-invariant graph step (GraphLayout::det_splits): nothing to do.
  if (item.split >= req.num_splits) return;
  const int G = p.group;
  const int t_first = item.f0 / G;
  const int t_last = min(req.qlen - 1, (item.f0 + ROWS - 1) / G);
  // Only the verify CTA carries the tree mask. A tree row sees its ancestors among the drafts,
  // and they precede it (the plan checks that every parent precedes its child): keys past the
  // row's own are invisible as in a chain, but the window is measured from the row's depth, which
  // can be anything from 0 to its index.
  const Mask<Cfg::kTree> mask{p, req};

  // Keys of this CTA's split: those the tile's rows can see, cut into num_splits chunks of whole
  // tiles. Derived from lengths only, like the general kernel, so the plan stays kernel-agnostic.
  const KeyRange kr = split_keys(mask.span(t_first, t_last), req.num_splits, item.split, BN);
  const int lo = kr.lo, hi = kr.hi;
  const int num_tiles = hi > lo ? (hi - lo + BN - 1) / BN : 0;

  // ---- Q: rows f0 .. f0 + ROWS of the flattened (token, head-in-group) index; rows past the
  // request's tokens are zero (finite logits, never stored).
  {
    const T* q = static_cast<const T*>(p.q);
    for (int i = tid; i < ROWS * CH; i += NT) {
      const int r = i / CH, c = i % CH;
      const int f = item.f0 + r, t = f / G, hg = f - t * G;
      const bool valid = t < req.qlen;
      const T* src =
          valid ? q + (req.qo_start + t) * p.q_stride_tok + (kvh * G + hg) * p.q_stride_head + c * 8
                : q;
      cp_async_16(smem + swz128_offset(ROWS, r, c), src, valid);
    }
  }

  // Launched as the dependent of the step's KV-store kernels (the verify CTA; the `dependent` of
  // launch_attention), the CTA has so far read only the work item, the request and q, which
  // those kernels do not write, and written nothing in global memory; their rows are read below.
  // Every thread gets here (no path returns earlier). Then the merge may be scheduled (it waits for
  // this grid before its first access). A plain launch passes both at once.
  grid_dependency_wait();
  launch_dependent_grids();

  write_back_committed_pages(p, req, item, kvh, tid, NT);

  // ---- K/V tile copies through the page table.
  const PrefillPages pages(p, req);
  const T* kbase = static_cast<const T*>(p.k) + kvh * D;
  const T* vbase = static_cast<const T*>(p.v) + kvh * D;
  const int ld_c = tid % CH, ld_key = tid / CH;
  auto load_tile = [&](int kb, int stage) {
    unsigned char* dk = smem + Cfg::kQBytes + stage * 2 * Cfg::kTileBytes;
    load_prefill_tile<BN, Cfg::kPasses, Cfg::kKeysPerPass>(p, pages, kb, hi, ld_key, ld_c, kbase,
                                                           vbase, dk, dk + Cfg::kTileBytes);
  };

  // Prologue: tiles 0 .. ST - 2 (Q rides in the first group). Every loop iteration commits one
  // group, empty or not, so wait_group<ST - 2> at iteration i means "tile i has landed".
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < num_tiles) load_tile(lo + s * BN, s);
    cp_async_commit();
  }

  // Rows: warpgroup wg owns rows wg * 64 * MB .. as MB blocks of 64; in block mb, warp wq of the
  // warpgroup holds 16 rows and this thread rows g and g + 8 of those. Skips are decided per
  // warpgroup (its four warps issue each MMA together), masks per warp and block.
  const int wg_row0 = wg * 64 * MB;
  const int first_row = item.f0 + wg_row0 + wq * 16;
  const PrefillRows<MB, Cfg::kTree> rows(mask, first_row, g, G, req.qlen);
  const bool wg_idle = (item.f0 + wg_row0) / G >= req.qlen;
  const int gt_lo = min((item.f0 + wg_row0) / G, req.qlen - 1);
  const int gt_hi = min((item.f0 + wg_row0 + 64 * MB - 1) / G, req.qlen - 1);

  const SoftCap cap(p.softcap, p.softmax_scale);
  const float sl = cap.exp_scale(p.scale_log2);  // logit -> log2 units after the softcap pass

  float o[MB][NO][ON / 2];
#pragma unroll
  for (int mb = 0; mb < MB; ++mb)
#pragma unroll
    for (int nb = 0; nb < NO; ++nb)
#pragma unroll
      for (int i = 0; i < ON / 2; ++i) o[mb][nb][i] = 0.f;
  float m[MB][2], l[MB][2];
#pragma unroll
  for (int mb = 0; mb < MB; ++mb) m[mb][0] = m[mb][1] = -INFINITY, l[mb][0] = l[mb][1] = 0.f;

  for (int it = 0; it < num_tiles; ++it) {
    // The copies were generic-proxy writes; the MMAs read through the async proxy.
    cp_async_wait<ST - 2>();
    fence_proxy_async_smem();
    __syncthreads();
    if (it + ST - 1 < num_tiles) load_tile(lo + (it + ST - 1) * BN, (it + ST - 1) % ST);
    cp_async_commit();
    const int kb = lo + it * BN;
    // A tile no row of the warpgroup sees is skipped, and so is everything for a warpgroup whose
    // rows all lie past the request's last token.
    if (wg_idle || mask.hides(kb, BN, gt_lo, gt_hi)) continue;
    const uint32_t tK = sKV + (it % ST) * 2 * Cfg::kTileBytes;
    const uint32_t tV = tK + Cfg::kTileBytes;

    // ---- S = Q K^T (this warpgroup's MB x 64 rows x BN keys), one commit for all blocks.
    float s[MB][BN / 2];
    wgmma_fence();
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint64_t da =
            wgmma_desc(sQ + (kk >> 2) * ROWS * 128 + (wg_row0 + mb * 64) * 128 + (kk & 3) * 32, 16);
        const uint64_t db = wgmma_desc(tK + (kk >> 2) * BN * 128 + (kk & 3) * 32, 16);
        wgmma_ss<BN, T>(s[mb], da, db, kk > 0 ? 1 : 0);
      }
    wgmma_commit();
    wgmma_wait<0>();

    // ---- Softcap (log2 units afterwards), the mask on tiles that need one, the online softmax
    // (p = 2^(s * sl - m), one FFMA and one MUFU per logit), the O rescale.
    cap_and_mask<MB, BN>(s, cap, mask, rows, kb, hi, c4);
    float alpha[MB][2];
    const bool moved = online_softmax<MB, BN, 0>(s, m, l, alpha, sl);
    rescale_o<MB, NO, ON>(o, alpha, moved);

    // ---- O += P V: P (S accumulator layout) is the register A operand, 16 keys per MMA.
    uint32_t pa[MB][BN / 16][4];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int k16 = 0; k16 < BN / 16; ++k16) {
        pa[mb][k16][0] = pack2<T>(s[mb][8 * k16], s[mb][8 * k16 + 1]);
        pa[mb][k16][1] = pack2<T>(s[mb][8 * k16 + 2], s[mb][8 * k16 + 3]);
        pa[mb][k16][2] = pack2<T>(s[mb][8 * k16 + 4], s[mb][8 * k16 + 5]);
        pa[mb][k16][3] = pack2<T>(s[mb][8 * k16 + 6], s[mb][8 * k16 + 7]);
      }
    wgmma_fence();
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int k16 = 0; k16 < BN / 16; ++k16)
#pragma unroll
        for (int nb = 0; nb < NO; ++nb) {
          const uint64_t db = wgmma_desc(tV + k16 * 16 * 128 + nb * (ON / 64) * BN * 128, BN * 128);
          wgmma_rs<ON, T>(o[mb][nb], pa[mb][k16], db);
        }
    wgmma_commit();
    wgmma_wait<0>();
  }
  cp_async_wait<0>();

  // ---- Epilogue: finish the row sums, then write the output (or this split's partial).
  store_prefill_rows<T, D, ON, 0>(p, req, item, kvh, first_row, g, c4, rows, l, m, o);
}

template <int D>
using PrefillCfg = std::conditional_t<
    D == 64, PrefillConfig<64, 1, 64, 3, 2>,
    std::conditional_t<D == 128, PrefillConfig<128, 1, 64, 2, 2>, PrefillConfig<256, 2, 64, 2, 1>>>;
// The verify CTA: Q 8 / 16 KB, so d64 holds four 16 KB stages at three CTAs per SM and d128
// three 32 KB stages at two (2 x 113 KB: the whole 228 KB of an H100 / H200 SM).
template <int D>
using PrefillVerifyCfg =
    std::conditional_t<D == 64, PrefillConfig<64, 1, 64, 4, 3, kPrefillVerifyTileRows>,
                       PrefillConfig<128, 1, 64, 3, 2, kPrefillVerifyTileRows>>;

// prefill_kernel's entry points at head dim D: the 128-row CTA, or (verify) the 64-row one, which
// head dim 256 does not have.
template <int D>
AttnCtaEntry prefill_kernel_entry(bool fp16, bool verify) {
  if (verify) {
    if constexpr (prefill_verify_dim(D)) {
      using Cfg = PrefillVerifyCfg<D>;
      return fp16 ? GridCta<prefill_kernel<__half, Cfg>, Cfg>::entry()
                  : GridCta<prefill_kernel<__nv_bfloat16, Cfg>, Cfg>::entry();
    }
    return {};
  }
  using Cfg = PrefillCfg<D>;
  return fp16 ? GridCta<prefill_kernel<__half, Cfg>, Cfg>::entry()
              : GridCta<prefill_kernel<__nv_bfloat16, Cfg>, Cfg>::entry();
}

}  // namespace attnrt::cuda
