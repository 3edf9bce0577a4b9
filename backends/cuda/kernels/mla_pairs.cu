// The paired-tile MLA CTA (sm_90a): the absorbed form over a bf16 or fp8 latent cache for the items
// of 64 (token, head) rows that mla_decode.cu's CTA serves (128-head decode, verify chains and
// trees, draft extends, absorbed extends, split-KV included), with the tensor cores kept busy
// while the softmax runs.
//
// mla_decode.cu's CTA splits every 64-key tile between its two warpgroups by keys for S = Q K^T
// (m64n32 MMAs, both operands in shared memory: 24 cycles of operand reads a k-step against 16 of
// math) and by output columns for P V, so each tile crosses three CTA barriers and nothing
// overlaps the softmax: 360 TFLOP/s on mla-decode-h128-64x4096 against 805 of the GEMM.
// Here the tiles go in pairs (a = 2j in stage 0, b = 2j + 1 in stage 1) and each warpgroup scores
// a whole tile (m64n64: the operand bytes per FLOP halve):
//  - warpgroup 0 holds output columns 0 .. 255 (O_L), warpgroup 1 columns 256 .. 511 (O_R);
//  - 0: S_a = Q K_a^T, the softmax of a against the running maximum m (m_a, factor alpha_a);
//    then O_L = alpha_a O_L + P_a V_aL with P_a from registers;
//  - 1: S_b = Q K_b^T, the softmax of b against m_a (m_b, alpha_b); O_R = alpha_a alpha_b O_R +
//    P_b V_bR with P_b from registers, P_b to shared memory;
//  - 0: P_a times alpha_b to shared memory, then O_L = alpha_b O_L + P_b V_bL;
//  - 1: O_R += (alpha_b P_a) V_aR.
// Both O halves and both row sums (l_0 over the a tiles, l_1 over the b tiles) then stand against
// m_b, the same running maximum (lazy, common/math.cuh's lazy_max), and the epilogue adds the two
// row sums. The four hand-overs (0 -> 1: m_a and alpha_a; 1 -> 0: m_b and alpha_b, each through
// its own row arrays and an mbarrier; P_a ready and P_b ready, named barriers) let one
// warpgroup's softmax run while the other's MMAs do.
//
// Shared memory: Q 72 KB, two 72 KB stages, four 64-float row arrays, six mbarriers, the page-id
// ring (8 KB): 226 KB.
// P of a tile goes into its own stage's rope block (columns 512 .. 575, read by the tile's S
// only), so it needs no space of its own. Each warpgroup copies its own column blocks of each tile
// with cp.async (any page size, rows past the split's end zero-filled), each stage's two parts
// completing on their own mbarrier, as soon as its own MMAs on them are done:
//  - stage 0: blocks 0 .. 3 by warpgroup 0 (after P_a V_aL), 4 .. 8 by 1 (after P_a V_aR);
//  - stage 1: blocks 4 .. 7 by 1 (after P_b V_bR), 0 .. 3 and 8 by 0 (after P_b V_bL);
// and S of the next tile takes the part copied first before the second (0: blocks 0 .. 3 first;
// 1: blocks 4 .. 7 first), so the later part's latency overlaps MMAs. An odd last tile pairs with
// an all-zero tile past the split (its keys masked: P = 0).
// An fp8 latent (e4m3 / e5m2, the pool's one scale a layer) needs no space of its own: a pair of
// column blocks' raw 16-column chunks of a row land in the even block's row in their global order
// (mla_fp8_layout.h: each 32-byte global sector of a copy as a 32-byte pair), in the same parts and
// at the same points as the bf16 copies, and the warpgroup that scores the tile converts both parts
// in place (mla_convert_in_place: a quarter warp reads a row's raw chunks, meets at a __syncwarp,
// and writes the row's bf16 chunks of both blocks), its own part first and the other warpgroup's
// while the first part's MMAs run. The other warpgroup reads its V columns after the hand-overs
// that follow the conversion. The conversion lies on both warpgroups' chains (H100,
// mla-decode-h128-64x4096-fp8: 279 TFLOP/s at page 64 and 273 at page 1 against mla_decode.cu's
// CTA's 266 and 227), so it takes fp8 latents at every page size (ATTNRT_MLA_FP8_PAIRS_MAX_PAGE
// lowers the limit). With a sector's two chunks 32 bytes apart (the layout before) its raw copies'
// LDGSTS took a shared-memory wavefront a thread (docs/BENCHMARKS.md).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "attnrt/core/env.h"
#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/cta_entry.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/mla.h"
#include "backends/cuda/kernels/mla_tile.cuh"
#include "backends/cuda/kernels/paged_kv.cuh"
#include "backends/cuda/kernels/prefill_ws_sync.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

namespace {

struct MlaPairsCfg {
  static constexpr int kD = kMlaHeadDim;      // 576: qk columns (9 blocks of 64)
  static constexpr int kDv = kMlaVHeadDim;    // 512: the first kDv columns are V
  static constexpr int kRows = kMlaTileRows;  // 64 query rows
  static constexpr int kBN = kMlaTileKeys;    // 64 keys a tile
  static constexpr int kON = kDv / 2;         // output columns of one warpgroup
  static constexpr int kThreads = 256;
  static constexpr int kQBytes = kRows * kD * 2;
  static constexpr int kTileBytes = kMlaTileBytes;
  static constexpr int kPAt = 8 * kBN * 128;  // P of a tile: its stage's rope block
  // m_a, alpha_a (warpgroup 0 -> 1), m_b, alpha_b (1 -> 0); the row sums at the end.
  static constexpr int kRowFloats = 4 * kRows;
  static constexpr int kBars = 6;  // full(stage, part) x 4, "m_a published", "m_b published"
  // The copiers' page ids: two loads' (a ring) x 4 rows x 256 threads, 4 bytes each.
  static constexpr int kIdsBytes = 2 * 4 * kThreads * 4;
  // MC: free(stage, part), the two CTAs' release of a part to the next tile's multicast.
  static constexpr int kFreeBytes = 4 * 8;
  static constexpr int kSmemBytes =
      1024 + kQBytes + 2 * kTileBytes + kRowFloats * 4 + kBars * 8 + kIdsBytes + kFreeBytes;
  static_assert(kSmemBytes <= 227 * 1024);
  static_assert(kRows * kBN * 2 == kBN * 128);  // a P tile fills the rope block exactly
};

// Named barriers (0 is __syncthreads), each one warpgroup's arrival and the other's wait, for the
// P tiles (read by the other warpgroup's MMAs through the async proxy). The row maxima and factors
// go through mbarriers, every thread of a warpgroup arriving (a release of its own reads and
// writes) and the other warpgroup waiting (an acquire): compute-sanitizer's racecheck follows the
// order so, and neither through bar.arrive / bar.sync nor through one lane's arrival after
// __syncwarp (184 hazards reported for that form; none for this one, at the same speed).
constexpr int kBarPa = 1;  // alpha_b P_a in stage 0's rope block (0 -> 1)
constexpr int kBarPb = 2;  // P_b in stage 1's rope block (1 -> 0)

// S (+)= Q K^T over the k16 steps of column blocks [B0, B1); FIRST: the first step overwrites S.
template <typename T, int B0, int B1, bool FIRST>
__device__ __forceinline__ void mla_pairs_s(float (&s)[MlaPairsCfg::kBN / 2], uint64_t dq,
                                            uint64_t dk) {
  constexpr int ROWS = MlaPairsCfg::kRows, BN = MlaPairsCfg::kBN;
#pragma unroll
  for (int kk = 4 * B0; kk < 4 * B1; ++kk) {
    const uint64_t da = dq + (((kk >> 2) * ROWS * 128 + (kk & 3) * 32) >> 4);
    const uint64_t db = dk + (((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4);
    wgmma_ss<BN, T>(s, da, db, FIRST && kk == 4 * B0 ? 0 : 1);
  }
}

// A warpgroup's named barrier over its own 128 threads (fp8: the converted tile published).
constexpr int kBarCvt = 3;  // + wg

// IDS: the copiers' page ids through shared memory (the launch takes it at pages of up to
// ATTNRT_MLA_PAIRS_IDS_MAX_PAGE slots, 16), else in registers.
// MC (registers, with kmap): the two CTAs of a cluster, the two 64-row items of one token, copy
// the whole tiles half each and multicast them (see mla_pairs_mc_kernel).
// FP8 / E5M2: the latent cache holds fp8 bytes (e4m3 or e5m2): each tile lands raw in the bf16
// stage (mla_fp8_layout.h) and the warpgroup that scores it converts it in place, part by part,
// its own part while the other warpgroup's copies are in flight, the other part while the first
// part's MMAs run; values times 2^-112, so Q is scaled by 2^64 once, P by 2^64 (in the exponent)
// and S and O by kMlaFp8Unit after their MMAs (mla_tile.cuh).
template <typename T, bool IDS, bool MC, bool FP8 = false, bool E5M2 = false>
__device__ __forceinline__ void mla_pairs_body(const AttnParams& p, const CUtensorMap* kmap) {
  static_assert(!(MC && FP8));
  using C = MlaPairsCfg;
  constexpr int BN = C::kBN, ROWS = C::kRows;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
  unsigned char* smem = smem_raw + pad;
  const uint32_t sQ = raw + pad;
  const uint32_t sKV = sQ + C::kQBytes;
  float* row_ma = reinterpret_cast<float*>(smem + C::kQBytes + 2 * C::kTileBytes);
  float* row_alpha_a = row_ma + ROWS;
  float* row_mb = row_alpha_a + ROWS;
  float* row_alpha_b = row_mb + ROWS;
  const uint32_t bars = sKV + 2 * C::kTileBytes + C::kRowFloats * 4;
  // full(stage, part): part 0 is warpgroup 0's blocks of the stage, part 1 warpgroup 1's.
  auto full = [bars](int stage, int part) { return bars + (2 * stage + part) * 8; };
  const uint32_t ma_bar = bars + 4 * 8, mb_bar = bars + 5 * 8;
  const uint32_t ids = bars + C::kBars * 8;
  auto free_bar = [ids](int stage, int part) {
    return ids + C::kIdsBytes + (2 * stage + part) * 8;
  };

  // wg through a shuffle: ptxas then knows it is the same in a whole warp, and the MMAs inside
  // `if (wg == 0)` are not serialised as divergent code (C7520).
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wq = warp & 3;
  const int wg = __shfl_sync(0xffffffff, tid >> 7, 0);
  const int g = lane >> 2, c4 = lane & 3;
  const int kvh = blockIdx.x;
  const MlaItem w(p, ROWS);
  // A padded item of a batch-invariant graph step (GraphLayout::det_splits): nothing to do.
  if (w.item.split >= w.req.num_splits) return;
  const WorkItem& item = w.item;
  const ReqInfo& req = w.req;
  const int lo = w.lo, hi = w.hi, num_tiles = w.num_tiles;
  const int num_pairs = (num_tiles + 1) / 2, loads = 2 * num_pairs;
  const Mask<true> mask{p, req};

  // MC: a part's 128 cp.async arrivals (none pending on a multicast tile) and thread 0's, with the
  // part's bytes from both CTAs' boxes on a multicast tile.
  if (tid < 4) mbar_init(full(tid >> 1, tid & 1), MC ? 129 : 128);
  if (tid == 4) mbar_init(ma_bar, 128);
  if (tid == 5) mbar_init(mb_bar, 128);
  if constexpr (MC) {
    if (tid >= 6 && tid < 10) mbar_init(free_bar((tid - 6) >> 1, tid & 1), 2);
    fence_mbarrier_init_cluster();
  }

  // ---- Q rows f0 .. f0 + 63 by all 256 threads, eight a row.
  const uint32_t q_swz = (tid >> 3) * 128 + (((tid & 7) ^ ((tid >> 3) & 7)) << 4);
  mla_load_q64<T>(p, req, item, kvh, smem, tid >> 3, tid & 7, q_swz);
  cp_async_commit();
  // The mbarriers are initialised (MC: in both CTAs, before any box or arrival of the peer).
  if constexpr (MC) {
    cluster_sync();
  } else {
    __syncthreads();
  }
  // Dependent launch: so far only the work item, the request and q were read.
  grid_dependency_wait();
  launch_dependent_grids();
  write_back_committed_pages(p, req, item, kvh, tid, C::kThreads);

  // Each warpgroup's copies: eight threads a row, rows ld_row + 16 r (r < 4) of a tile.
  const int wt = tid & 127, ld_row = wt >> 3, ld_c = wt & 7;
  const uint32_t ld_swz =
      FP8 ? mla_raw_in_place(ld_row, ld_c) : ld_row * 128 + ((ld_c ^ (ld_row & 7)) << 4);
  MlaTileCopier<T, FP8, E5M2, 4> copier{
      p, req, smem + C::kQBytes, lo, hi, num_tiles, kvh, ld_row, ld_c, ld_swz, 16};
  // Page ids. IDS (by default pages of up to 16 slots, where a thread's four rows of a tile lie
  // on four pages): by cp.async into shared memory, the next load's ids issued before each load's copies
  // (their own group), and cp.async.wait_group 2 before those copies finds this load's ids
  // landed with the previous load's copies and the next ids still in flight. A thread's loads go
  // in the order 0, 1, 2, 3, ... (warpgroup 0) or 0, 1, 3, 2, 5, 4, ... (warpgroup 1); the ring
  // slot is the parity of a load's place in that order. Loaded into registers instead
  // (prefetch_slots, one load ahead), ptxas puts each row's address arithmetic right after the
  // page-table load and the warp waits there: mla-decode-h128-64x4096-p1 1.35x through shared
  // memory, page 16 1.015x, but page 32 0.93x and page 64 (one page id a tile) 0.91x, so those
  // keep the registers (not explained: the ids' 4-byte copies go through the L1 with the tiles'
  // 16-byte ones, and a tile's mbarrier then also waits for the next load's ids).
  constexpr int kIdsStep = C::kThreads * 4;
  auto ids_at = [&](int t) {
    const int ring = (t & 1) ^ (wg == 1 && t >= 2 ? 1 : 0);
    return ids + (ring * 4 * C::kThreads + tid) * 4;
  };
  // Around the copies of a load whose successor in this thread's order is `next`.
  auto ids_ahead = [&](int next) {
    if constexpr (IDS) {
      copier.issue_ids(next, ids_at(next), kIdsStep);
      cp_async_wait<2>();
    }
  };
  auto ids_behind = [&](int next) {
    if constexpr (!IDS) copier.prefetch_slots(next);
  };
  // This warpgroup's part of tile t into `stage` (local_copy: its cp.async copies), completing on
  // full(stage, wg). MC: first its release of the part's previous tile (t - 2) to both CTAs; a
  // whole tile whose first key is a multiple of 32 slots then comes as two 32-slot boxes a block,
  // one from each CTA (this one's rows 32 cr .. 32 cr + 31), each multicast to both, issued once
  // the peer released the part too.
  const uint32_t cr = MC ? cluster_ctarank() : 0;
  auto part_copy = [&](int t, int stage, auto&& local_copy) {
    const uint32_t bar = full(stage, wg);
    if constexpr (MC) {
      if (t >= 2 && wt == 0) {
        mbar_arrive(free_bar(stage, wg));
        mbar_arrive_cluster(free_bar(stage, wg), cr ^ 1);
      }
      const int kb = lo + t * BN;
      if (t < num_tiles && kb + BN <= hi && (kb & 31) == 0) {
        if (wt == 0) {
          if (t >= 2) mbar_wait(free_bar(stage, wg), ((t >> 1) - 1) & 1);
          // Blocks 0 .. 3 (warpgroup 0), 4 .. 7 (1), and 8 (stage 0: warpgroup 1's; 1: 0's).
          const int b0 = wg == 0 ? 0 : 4;
          const bool rope = (stage == 0) == (wg == 1);
          mbar_arrive_expect_tx(bar, (rope ? 5 : 4) * BN * 128);
          const int row = static_cast<int>(cr == 0 ? copier.slot_at(0) : copier.slot_at(2));
          const uint32_t dst = sKV + stage * C::kTileBytes + 32 * cr * 128;
          for (int i = 0; i < (rope ? 5 : 4); ++i) {
            const int blk = i < 4 ? b0 + i : 8;
            tma_load_3d_multicast(dst + blk * BN * 128, kmap, 64 * blk, kvh, row, bar, 0x3);
          }
        }
        mbar_arrive_cp_async(bar);
        return;
      }
      local_copy();
      mbar_arrive_cp_async(bar);
      if (wt == 0) mbar_arrive(bar);
    } else {
      local_copy();
      mbar_arrive_cp_async(bar);
    }
  };
  // Both tiles of the first pair.
  if (num_pairs > 0) {
    if constexpr (IDS) {
      copier.issue_ids(0, ids_at(0), kIdsStep);
      copier.issue_ids(1, ids_at(1), kIdsStep);
      cp_async_wait<1>();  // Q and tile 0's ids
    } else {
      copier.prefetch_slots(0);
    }
    if (wg == 0) {
      part_copy(0, 0, [&] { copier.template load_part<IDS, 0, 4>(0, 0, ids_at(0), kIdsStep); });
    } else {
      part_copy(0, 0, [&] { copier.template load_part<IDS, 4, 9>(0, 0, ids_at(0), kIdsStep); });
    }
    if constexpr (IDS) {
      cp_async_commit();
      ids_ahead(wg == 0 ? 2 : 3);  // tile 1's ids landed
    } else {
      copier.prefetch_slots(1);
    }
    if (wg == 0) {
      part_copy(1, 1,
                [&] { copier.template load_part<IDS, 0, 4, 8, 9>(1, 1, ids_at(1), kIdsStep); });
    } else {
      part_copy(1, 1, [&] { copier.template load_part<IDS, 4, 8>(1, 1, ids_at(1), kIdsStep); });
    }
    cp_async_commit();
  }
  if constexpr (IDS) {
    if (num_pairs == 0) cp_async_wait<0>();  // else Q landed with tile 0's ids
  } else {
    cp_async_wait<1>();  // this thread's Q copies landed
  }
  if constexpr (FP8) {
    // Q times 2^64: this thread's own chunks (the barrier below publishes them).
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2)
#pragma unroll
      for (int i = 0; i < C::kD / 64; ++i)
        scale_q_chunk(smem + q_swz + r2 * 32 * 128 + i * ROWS * 128);
  }
  fence_proxy_async_smem();
  __syncthreads();  // every thread's

  // This thread's rows (the same in both warpgroups): g and g + 8 of warp wq's 16.
  int row_t[2];
  MaskRow rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_t[h] = (item.f0 + wq * 16 + g + 8 * h) / p.group;
    rows[h] = mask.row(row_t[h]);
  }
  const int rt_lo = w.t_first, rt_hi = w.t_last;
  const SoftCap cap(p.softcap, p.softmax_scale);
  // fp8: S comes out in units of 2^-48 (kMlaFp8Unit); without a softcap the unit goes into the
  // exponent's scale, with one S is scaled before the cap.
  const float sl = cap.exp_scale(p.scale_log2) * (FP8 && !cap.on ? kMlaFp8Unit : 1.f);
  // fp8: P enters the P V MMAs times 2^64 (its exponent raised by 64; the row sums undo it).
  constexpr float kPShift = FP8 ? 64.f : 0.f;
  const uint64_t dq = wgmma_desc(sQ, 16);

  // Output columns 256 wg + 128 nb + 8 i + 2 c4 (+1) of rows g, g + 8: o[nb][4 i + 2 h (+1)].
  float o[2][64];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int i = 0; i < 64; ++i) o[nb][i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  // Softcap and mask of tile kb's logits, then each row's maximum (scaled to log2 units).
  auto row_max = [&](float(&s)[BN / 2], int kb, float(&mx)[2]) {
    if (cap.on) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[i] = cap(FP8 ? s[i] * kMlaFp8Unit : s[i]);
    }
    if (mask.needs_mask(kb, BN, hi, rt_lo, rt_hi)) mla_mask_keys<BN>(mask, rows, s, kb, hi, c4);
#pragma unroll
    for (int h = 0; h < 2; ++h) mx[h] = mla_row_max<BN>(s, h) * sl;
  };
  // s becomes exp2(s sl - m_use) row by row (fp8: times 2^64); returns the rows' sums of this
  // thread's columns (without the 2^64).
  auto exps = [&](float(&s)[BN / 2], const float(&m_use)[2], float(&sum)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] = 0.f;
      const float mu = FP8 ? kPShift - m_use[h] : -m_use[h];
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb) {
        float& x0 = s[nb * 4 + 2 * h];
        float& x1 = s[nb * 4 + 2 * h + 1];
        x0 = fast_exp2(fmaf(x0, sl, mu));
        x1 = fast_exp2(fmaf(x1, sl, mu));
        sum[h] += x0 + x1;
      }
      if constexpr (FP8) sum[h] *= 0x1p-64f;
    }
  };
  // fp8: column blocks [B0, B1) (and [C0, C1)) of `stage`'s tile, landed raw, converted by this
  // warpgroup and published to its MMAs.
  auto convert = [&]<int B0, int B1, int C0 = 0, int C1 = 0>(int stage) {
    if constexpr (FP8) {
      const uint32_t tile = sKV + stage * C::kTileBytes;
      mla_convert_in_place<E5M2, B0, B1>(tile, wt);
      if constexpr (C1 > C0) mla_convert_in_place<E5M2, C0, C1>(tile, wt);
      fence_proxy_async_smem();
      named_bar_sync(kBarCvt + wg, 128);
    }
  };
  auto pack_p = [&](const float(&s)[BN / 2], uint32_t(&pa)[BN / 16][4]) {
#pragma unroll
    for (int k16 = 0; k16 < BN / 16; ++k16) {
      pa[k16][0] = pack2<T>(s[8 * k16], s[8 * k16 + 1]);
      pa[k16][1] = pack2<T>(s[8 * k16 + 2], s[8 * k16 + 3]);
      pa[k16][2] = pack2<T>(s[8 * k16 + 4], s[8 * k16 + 5]);
      pa[k16][3] = pack2<T>(s[8 * k16 + 6], s[8 * k16 + 7]);
    }
  };
  // P times f (per row) to the rope block of `stage`, the other warpgroup's A operand.
  auto store_p = [&](const float(&s)[BN / 2], int stage, const float(&f)[2]) {
    mla_store_p<T, BN>(smem + C::kQBytes + stage * C::kTileBytes + C::kPAt, s, 0, f, wq, g, c4);
  };
  // O += P V over this warpgroup's 256 columns of stage `stage`: P from registers ...
  auto pv_regs = [&](const uint32_t(&pa)[BN / 16][4], int stage) {
    const uint64_t dv = wgmma_desc(sKV + stage * C::kTileBytes + wg * 4 * BN * 128, BN * 128);
    wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < BN / 16; ++k16)
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
        wgmma_rs<128, T>(o[nb], pa[k16], dv + ((k16 * 16 * 128 + nb * 2 * BN * 128) >> 4));
    wgmma_commit();
  };
  // ... or from the stage's rope block (the other warpgroup's P).
  auto pv_smem = [&](int stage) {
    const uint32_t tile = sKV + stage * C::kTileBytes;
    const uint64_t dp = wgmma_desc(tile + C::kPAt, 16);
    const uint64_t dv = wgmma_desc(tile + wg * 4 * BN * 128, BN * 128);
    wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < BN / 16; ++k16)
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
        wgmma_ss_mn<128, T>(o[nb], dp + ((k16 * 32) >> 4),
                            dv + ((k16 * 16 * 128 + nb * 2 * BN * 128) >> 4), 1);
    wgmma_commit();
  };

  if (wg == 0) {
    // ================= warpgroup 0: tiles a, O_L =================
    const uint64_t dk = wgmma_desc(sKV, 16);
    ids_behind(2);
    for (int j = 0; j < num_pairs; ++j) {
      const uint32_t parity = j & 1;
      const int ta = 2 * j;
      float s[BN / 2];
      mbar_wait(full(0, 0), parity);
      fence_proxy_async_smem();
      convert.template operator()<0, 4>(0);
      wgmma_fence();
      mla_pairs_s<T, 0, 4, true>(s, dq, dk);
      mbar_wait(full(0, 1), parity);
      fence_proxy_async_smem();
      convert.template operator()<4, 9>(0);
      wgmma_fence();  // the wait's loop between the MMAs of one group
      mla_pairs_s<T, 4, 9, false>(s, dq, dk);
      wgmma_commit();
      wgmma_wait<0>();

      float mx[2], m_use[2], alpha_a[2], sum[2];
      row_max(s, lo + ta * BN, mx);
      bool moved = false;
#pragma unroll
      for (int h = 0; h < 2; ++h) moved |= lazy_max(m[h], mx[h], m_use[h], alpha_a[h]);
      exps(s, m_use, sum);
      if (c4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          row_ma[wq * 16 + g + 8 * h] = m[h];
          row_alpha_a[wq * 16 + g + 8 * h] = alpha_a[h];
        }
      }
      mbar_arrive(ma_bar);
#pragma unroll
      for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha_a[h] + sum[h];
      if (__any_sync(0xffffffff, moved)) mla_scale_rows(o, alpha_a);
      uint32_t pa[BN / 16][4];
      pack_p(s, pa);
      pv_regs(pa, 0);

      // Warpgroup 1's tile b moved the maximum to m_b by alpha_b: P_a joins O_R at that scale.
      mbar_wait(mb_bar, parity);
      float alpha_b[2];
      bool moved_b = false;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        alpha_b[h] = row_alpha_b[wq * 16 + g + 8 * h];
        m[h] = row_mb[wq * 16 + g + 8 * h];
        l[h] *= alpha_b[h];
        moved_b |= alpha_b[h] != 1.f;
      }
      store_p(s, 0, alpha_b);
      fence_proxy_async_smem();
      named_bar_arrive(kBarPa, 256);

      wgmma_wait<0>();  // P_a V_aL done: blocks 0 .. 3 of stage 0 are free
      ids_ahead(ta + 3);
      if (ta + 2 < loads) {
        part_copy(ta + 2, 0, [&] {
          copier.template load_part<IDS, 0, 4>(ta + 2, 0, ids_at(ta + 2), kIdsStep);
        });
        cp_async_commit();
      }
      ids_behind(ta + 3);
      if (__any_sync(0xffffffff, moved_b)) mla_scale_rows(o, alpha_b);
      named_bar_sync(kBarPb, 256);
      pv_smem(1);
      wgmma_wait<0>();  // P_b V_bL done: blocks 0 .. 3 and the rope block of stage 1 are free
      ids_ahead(ta + 4);
      if (ta + 3 < loads) {
        part_copy(ta + 3, 1, [&] {
          copier.template load_part<IDS, 0, 4, 8, 9>(ta + 3, 1, ids_at(ta + 3), kIdsStep);
        });
        cp_async_commit();
      }
      ids_behind(ta + 4);
    }
  } else {
    // ================= warpgroup 1: tiles b, O_R =================
    const uint64_t dk = wgmma_desc(sKV + C::kTileBytes, 16);
    ids_behind(3);
    for (int j = 0; j < num_pairs; ++j) {
      const uint32_t parity = j & 1;
      const int tb = 2 * j + 1;
      float s[BN / 2];
      mbar_wait(full(1, 1), parity);
      fence_proxy_async_smem();
      convert.template operator()<4, 8>(1);
      wgmma_fence();
      mla_pairs_s<T, 4, 8, true>(s, dq, dk);
      mbar_wait(full(1, 0), parity);
      fence_proxy_async_smem();
      convert.template operator()<0, 4, 8, 9>(1);
      wgmma_fence();
      mla_pairs_s<T, 0, 4, false>(s, dq, dk);
      mla_pairs_s<T, 8, 9, false>(s, dq, dk);
      wgmma_commit();
      wgmma_wait<0>();

      float mx[2], m_use[2], alpha_a[2], alpha_b[2], sum[2];
      row_max(s, lo + tb * BN, mx);
      mbar_wait(ma_bar, parity);
      bool moved = false;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        alpha_a[h] = row_alpha_a[wq * 16 + g + 8 * h];
        m[h] = row_ma[wq * 16 + g + 8 * h];
        lazy_max(m[h], mx[h], m_use[h], alpha_b[h]);
        alpha_a[h] *= alpha_b[h];
        moved |= alpha_a[h] != 1.f;
      }
      exps(s, m_use, sum);
      if (c4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          row_mb[wq * 16 + g + 8 * h] = m[h];
          row_alpha_b[wq * 16 + g + 8 * h] = alpha_b[h];
        }
      }
      mbar_arrive(mb_bar);
#pragma unroll
      for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha_a[h] + sum[h];
      if (__any_sync(0xffffffff, moved)) mla_scale_rows(o, alpha_a);
      uint32_t pa[BN / 16][4];
      pack_p(s, pa);
      pv_regs(pa, 1);
      const float one[2] = {1.f, 1.f};
      store_p(s, 1, one);
      fence_proxy_async_smem();
      named_bar_arrive(kBarPb, 256);

      named_bar_sync(kBarPa, 256);
      pv_smem(0);
      wgmma_wait<1>();  // P_b V_bR done: blocks 4 .. 7 of stage 1 are free
      ids_ahead(tb + 1);
      if (tb + 2 < loads) {
        part_copy(tb + 2, 1, [&] {
          copier.template load_part<IDS, 4, 8>(tb + 2, 1, ids_at(tb + 2), kIdsStep);
        });
        cp_async_commit();
      }
      ids_behind(tb + 1);
      wgmma_wait<0>();  // P_a V_aR done: blocks 4 .. 8 of stage 0 are free
      ids_ahead(tb + 4);
      if (tb + 1 < loads) {
        part_copy(tb + 1, 0, [&] {
          copier.template load_part<IDS, 4, 9>(tb + 1, 0, ids_at(tb + 1), kIdsStep);
        });
        cp_async_commit();
      }
      ids_behind(tb + 4);
    }
  }
  cp_async_wait<0>();

  // ---- Epilogue: both warpgroups' row sums stand against the same maximum; add them, then
  // output (or this split's partial).
  __syncthreads();  // the row arrays are reused
  mla_store_rows64<T>(p, req, item, kvh, wg, wq, g, c4, l, m, row_t, o, FP8 ? kMlaFp8Unit : 1.f,
                      row_ma);
  // MC: no CTA leaves while its peer may still arrive on its barriers.
  if constexpr (MC) cluster_sync();
}

template <typename T, bool IDS, bool FP8, bool E5M2>
__global__ void __launch_bounds__(MlaPairsCfg::kThreads, 1) mla_pairs_kernel(const AttnParams p) {
  mla_pairs_body<T, IDS, false, FP8, E5M2>(p, nullptr);
}

// At 128 heads a token's rows are two 64-row items, adjacent in the plan's request-major order and
// reading the same keys: launched as clusters of two CTAs, each copies half of every whole tile
// (32 of its 64 slots, by TMA at pages of 32 slots or more) and multicasts it to both, so the L2
// sends each latent tile to the two SMs once instead of twice (on mla-decode-h128-64x4096 the
// L2 -> SM stream was 3.3 TB/s and the L2 72% busy at 400 TFLOP/s).
template <typename T>
__global__ void __launch_bounds__(MlaPairsCfg::kThreads, 1)
    mla_pairs_mc_kernel(const AttnParams p, const __grid_constant__ CUtensorMap kmap) {
  mla_pairs_body<T, false, true>(p, &kmap);
}

// The switches (docs/backends.md), validated: a bad value is an error naming what is allowed.
EnvSwitch g_pairs("ATTNRT_MLA_PAIRS", 0, 1, 1, "cuda backend",
                  "1 (the paired-tile CTA for 64-row MLA items, the default) or 0 (mla_decode.cu's "
                  "CTA)");
// The clusters measured 1.01-1.03x when they landed and 0.95x one CTA an item on a later tree and
// another H100 host (two rounds: h128-64x4096 409 against 430 TFLOP/s), so they are off: their
// profile trades the L2 waits they remove for instruction fetch, HGMMA waits and the cluster
// barriers (docs/mla.md).
EnvSwitch g_mc("ATTNRT_MLA_MC", 0, 1, 0, "cuda backend",
               "1 (two-CTA multicast clusters at 128 heads and pages >= 32) or 0 (one CTA an "
               "item, the default)");
EnvSwitch g_fp8_max_page("ATTNRT_MLA_FP8_PAIRS_MAX_PAGE", 0, 128, 128, "cuda backend",
                         "the largest page size (0 .. 128) at which an fp8 latent takes the "
                         "paired-tile CTA; 0 never, 128 (every page size) the default");
// Where the page ids go through shared memory (the IDS instance) rather than registers: chosen at
// 16 slots when the registers instance still consumed each page id in the block that loaded it
// (page 1 1.35x, 32 0.93x, 64 0.91x with the shared-memory ids); the registers instance has
// since taken its ids late (1.055x at page 64), so the limit is a switch for the A/B at 1 .. 16.
EnvSwitch g_ids_max_page("ATTNRT_MLA_PAIRS_IDS_MAX_PAGE", 0, 128, 16, "cuda backend",
                         "the largest page size (0 .. 128) at which the paired-tile CTA takes its "
                         "page ids through shared memory; 16 the default, 0 never");

// The launch: page ids through shared memory at pages of up to ATTNRT_MLA_PAIRS_IDS_MAX_PAGE
// slots, in registers above (g_ids_max_page says why).
template <bool FP8, bool E5M2>
struct MlaPairsCta {
  template <bool IDS>
  using Cta = GridCta<mla_pairs_kernel<__nv_bfloat16, IDS, FP8, E5M2>, MlaPairsCfg>;
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey& key, int num_items,
                            cudaStream_t stream, bool dependent) {
    // The clusters take a 16-bit latent only (their boxes are whole bf16 tiles).
    if (!FP8 && p.page_shift >= 5 && p.group == 128 && num_items % 2 == 0 &&
        mla_pairs_mc_enabled()) {
      if (const std::optional<CUtensorMap> map = mla_latent_tensor_map(p, 32)) {
        constexpr auto kernel = mla_pairs_mc_kernel<__nv_bfloat16>;
        const cudaError_t attr = allow_dynamic_smem<kernel>(MlaPairsCfg::kSmemBytes);
        if (attr != cudaSuccess) return attr;
        const cudaError_t err = launch_kernel_clusters(
            kernel, dim3(p.num_kv_heads, num_items), dim3(MlaPairsCfg::kThreads),
            MlaPairsCfg::kSmemBytes, stream, dependent, dim3(1, 2, 1), p, *map);
        if (err == cudaSuccess) return err;
        cudaGetLastError();  // a device that cannot place the clusters: one CTA an item below
      }
    }
    return (1L << p.page_shift) <= g_ids_max_page.get()
               ? Cta<true>::launch(p, key, num_items, stream, dependent)
               : Cta<false>::launch(p, key, num_items, stream, dependent);
  }
  static int occupancy(const AttnKernelKey& key) { return Cta<false>::occupancy(key); }
};

}  // namespace

void set_mla_pairs(bool on) { g_pairs.set(on ? 1 : 0); }

bool mla_pairs_enabled() { return g_pairs.get() != 0; }

bool mla_pairs_mc_enabled() { return g_mc.get() != 0; }

void set_mla_pairs_mc(bool on) { g_mc.set(on ? 1 : 0); }

int mla_pairs_fp8_max_page() { return static_cast<int>(g_fp8_max_page.get()); }

int mla_pairs_ids_max_page() { return static_cast<int>(g_ids_max_page.get()); }

void set_mla_pairs_ids_max_page(int slots) { g_ids_max_page.set(slots); }

AttnCtaEntry mla_pairs_entry(const AttnKernelKey& key) {
  if (key.head_dim != kMlaHeadDim || key.v_head_dim != kMlaVHeadDim || key.fp16) return {};
  switch (key.kv) {
    case KvKind::same_as_q:
      return {&MlaPairsCta<false, false>::launch, &MlaPairsCta<false, false>::occupancy};
    case KvKind::e4m3:
      return {&MlaPairsCta<true, false>::launch, &MlaPairsCta<true, false>::occupancy};
    case KvKind::e5m2:
      return {&MlaPairsCta<true, true>::launch, &MlaPairsCta<true, true>::occupancy};
  }
  return {};
}

}  // namespace attnrt::cuda
