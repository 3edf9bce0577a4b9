// Absorbed-form MLA attention on Hopper warpgroup MMAs (sm_90a): DeepSeek-V3's latent cache (one KV
// head of 576 columns per token: 512 latent + 64 rope; V is the first 512 of the same row), q heads
// as the rows of the MMA. Serves every mode the plan sends it: DECODE, TARGET_VERIFY chains and
// trees, DRAFT_EXTEND, and absorbed-form extends, split-KV included (the plan's work items, the
// same partials and merge as the other CTAs).
//
// A CTA owns 64 flattened (token, head) rows of one request and streams the request's latent rows
// once in 64-key tiles through a two-stage cp.async ring, so at 16 heads a decode token is one CTA
// and at 128 heads two CTAs read the same tiles (the second from L2). Two warpgroups share the
// tile:
//  - S = Q K^T: warpgroup w scores keys 32w .. 32w + 31 of the tile against all 64 rows (an
//    m64n32k16 MMA over the 576 columns, both operands in shared memory); the two halves' row
//    maxima meet in shared memory, so both warpgroups hold the same running maximum.
//  - P (bf16) goes to shared memory, both halves side by side, and
//  - O += P V: warpgroup w accumulates output columns 256w .. 256w + 255 of all 64 rows (128 fp32
//    accumulators a thread), V read MN-major from the same tile.
// Shared memory: Q 72 KB, two 72 KB latent tiles, P 8 KB: one CTA per SM. The pool slot of each
// tile's rows is looked up a tile ahead, so page size 1 costs no extra latency. An fp8 latent cache
// (e4m3 / e5m2, one scale per layer as the pool stores it) is copied raw into two 36 KB stages in
// the second tile's space and converted exactly (through f16) into one bf16 tile per iteration.
// Masks (causal, tree, window) and softcap as every other CTA (common/mask.cuh); the row sums of
// the two halves are added at the end.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

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
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

namespace {

template <bool FP8>
struct MlaCfg {
  static constexpr int kD = kMlaHeadDim;      // 576: qk columns
  static constexpr int kDv = kMlaVHeadDim;    // 512: the first kDv columns are V
  static constexpr int kRows = kMlaTileRows;  // 64 query rows
  static constexpr int kBN = 64;              // keys per tile
  static constexpr int kHalf = kBN / 2;       // keys scored by one warpgroup
  static constexpr int kON = kDv / 2;         // output columns of one warpgroup
  static constexpr int kThreads = 256;
  static constexpr int kQBytes = kRows * kD * 2;
  static constexpr int kTileBytes = kMlaTileBytes;  // fp8: a bf16 tile and two raw stages
  static constexpr int kPBytes = kRows * kBN * 2;
  // Row maxima of each half and, at the end, row sums: [2][kRows] floats.
  static constexpr int kXBytes = 2 * kRows * 4;
  static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kTileBytes + kPBytes + kXBytes;
  // Copies: eight threads per row, two rows each (kBN = kRows = 64).
  static_assert(kThreads == 4 * kBN && kBN == kRows && kBN == kMlaTileKeys);
  static_assert(kSmemBytes <= 227 * 1024);
};

// Named barrier of the CTA's 256 threads (barrier 0 is __syncthreads).
__device__ __forceinline__ void cta_bar(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(MlaCfg<false>::kThreads) : "memory");
}

// T: q / out (bf16); FP8: the latent cache holds fp8 bytes (E5M2 or e4m3), converted to bf16 in
// shared memory once per tile.
template <typename T, bool FP8, bool E5M2>
__global__ void __launch_bounds__(MlaCfg<FP8>::kThreads, 1)
    mla_attention_kernel(const AttnParams p) {
  using C = MlaCfg<FP8>;
  constexpr int D = C::kD, BN = C::kBN, ROWS = C::kRows, ON = C::kON, HALF = C::kHalf;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
  unsigned char* smem = smem_raw + pad;
  const uint32_t sQ = raw + pad;
  const uint32_t sKV = sQ + C::kQBytes;
  const uint32_t sP = sKV + 2 * C::kTileBytes;
  unsigned char* p_tile = smem + C::kQBytes + 2 * C::kTileBytes;
  float* x_rows = reinterpret_cast<float*>(p_tile + C::kPBytes);  // [2][ROWS]

  // wg through a shuffle: ptxas then knows it is the same in a whole warp and keeps the MMA
  // descriptors built from it in uniform registers (from tid it moved each one over before every
  // MMA: two R2UR an MMA).
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wq = warp & 3;
  const int wg = __shfl_sync(0xffffffff, warp >> 2, 0);
  const int g = lane >> 2, c4 = lane & 3;
  const int kvh = blockIdx.x;
  const MlaItem w(p, ROWS);
  // A padded item of a batch-invariant graph step (GraphLayout::det_splits): nothing to do.
  if (w.item.split >= w.req.num_splits) return;
  const WorkItem& item = w.item;
  const ReqInfo& req = w.req;
  const int G = p.group;
  const int t_first = w.t_first, t_last = w.t_last, lo = w.lo, hi = w.hi, num_tiles = w.num_tiles;
  const Mask<true> mask{p, req};

  // Copies: eight threads per row, two rows per thread (ld_row and ld_row + 32, of Q and of every
  // tile), thread ld_c taking 16-byte chunk ld_c of each 64-column block; in the swizzled layout
  // its chunks then sit at one base offset plus constants (rows 32 apart share the swizzle).
  const int ld_row = tid >> 3, ld_c = tid & 7;
  const uint32_t ld_swz = ld_row * 128 + ((ld_c ^ (ld_row & 7)) << 4);
  constexpr int kBlocks = D / 64;  // 64-column blocks of a row

  mla_load_q64<T>(p, req, item, kvh, smem, ld_row, ld_c, ld_swz);
  // Dependent launch: so far only the work item, the request and q were read.
  grid_dependency_wait();
  launch_dependent_grids();
  write_back_committed_pages(p, req, item, kvh, tid, C::kThreads);

  MlaTileCopier<T, FP8, E5M2, 2> copier{
      p, req, smem + C::kQBytes, lo, hi, num_tiles, kvh, ld_row, ld_c, ld_swz, 32};
  copier.prefetch_slots(0);
  if (num_tiles > 0) copier.load(0);
  cp_async_commit();  // Q and tile 0
  copier.prefetch_slots(1);
  if constexpr (FP8) {
    // Q times 2^64 (this thread's own chunks, once they landed; the loop's barriers publish it).
    cp_async_wait<0>();
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2)
#pragma unroll
      for (int i = 0; i < kBlocks; ++i)
        scale_q_chunk(smem + ld_swz + r2 * 32 * 128 + i * ROWS * 128);
  }
  constexpr float kUnit = FP8 ? kMlaFp8Unit : 1.f;  // of S and O
  constexpr float kPScale = FP8 ? kMlaFp8PScale : 1.f;

  // This thread's rows (the same in both warpgroups): g and g + 8 of warp wq's 16.
  int row_t[2];
  MaskRow rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_t[h] = (item.f0 + wq * 16 + g + 8 * h) / G;
    rows[h] = mask.row(row_t[h]);
  }
  const int rt_lo = t_first, rt_hi = t_last;

  const SoftCap cap(p.softcap, p.softmax_scale);
  const float sl = cap.exp_scale(p.scale_log2);

  // Output columns 256 wg + 128 nb + 8 i + 2 c4 (+1) of rows g, g + 8: o[nb][4 i + 2 h (+1)].
  float o[2][64];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int i = 0; i < 64; ++i) o[nb][i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  for (int it = 0; it < num_tiles; ++it) {
    cp_async_wait<0>();
    if constexpr (!FP8) fence_proxy_async_smem();
    __syncthreads();  // tile it landed; every warp is done with tile it - 1 (its stage is free)
    if (it + 1 < num_tiles) copier.load(it + 1);
    cp_async_commit();
    copier.prefetch_slots(it + 2);
    if constexpr (FP8) {
      copier.convert(it & 1);
      fence_proxy_async_smem();
      __syncthreads();
    }
    const int kb = lo + it * BN;
    if (mask.hides(kb, BN, rt_lo, rt_hi)) continue;  // the same for the whole CTA
    const uint32_t tK = sKV + (FP8 ? 0 : (it & 1) * C::kTileBytes);
    // Descriptors: one built per operand and tile, the k-steps' offsets added to its address
    // field (addresses stay below 2^18, so the field never carries into the next).
    const uint64_t dq = wgmma_desc(sQ, 16);
    const uint64_t dk = wgmma_desc(tK + wg * HALF * 128, 16);
    const uint64_t dp = wgmma_desc(sP, 16);
    const uint64_t dv = wgmma_desc(tK + wg * 4 * BN * 128, BN * 128);

    // ---- S = Q K^T over this warpgroup's 32 keys.
    float s[HALF / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint64_t da = dq + (((kk >> 2) * ROWS * 128 + (kk & 3) * 32) >> 4);
      const uint64_t db = dk + (((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4);
      wgmma_ss<HALF, T>(s, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();

    if constexpr (FP8) {
#pragma unroll
      for (int i = 0; i < HALF / 2; ++i) s[i] *= kUnit;
    }
    if (cap.on) {
#pragma unroll
      for (int i = 0; i < HALF / 2; ++i) s[i] = cap(s[i]);
    }
    const int k0 = kb + wg * HALF;
    if (mask.needs_mask(kb, BN, hi, rt_lo, rt_hi)) mla_mask_keys<HALF>(mask, rows, s, k0, hi, c4);

    // ---- Row maxima of both halves, then the online softmax (log2 units).
    float mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float v = mla_row_max<HALF>(s, h);
      mx[h] = v;
      if (c4 == 0) x_rows[wg * ROWS + wq * 16 + g + 8 * h] = v;
    }
    cta_bar(1);
#pragma unroll
    for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], x_rows[(wg ^ 1) * ROWS + wq * 16 + g + 8 * h]);

    // Lazy rescaling (common/math.cuh). Both warpgroups see the same maxima, so they decide alike.
    bool moved = false;
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m_use;
      const bool move = lazy_max(m[h], mx[h] * sl, m_use, alpha[h]);
      moved = moved || move;
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < HALF / 8; ++nb) {
        float& x0 = s[nb * 4 + 2 * h];
        float& x1 = s[nb * 4 + 2 * h + 1];
        x0 = fast_exp2(fmaf(x0, sl, -m_use));
        x1 = fast_exp2(fmaf(x1, sl, -m_use));
        sum += x0 + x1;
      }
      l[h] = l[h] * alpha[h] + sum;
    }
    if (__any_sync(0xffffffff, moved)) mla_scale_rows(o, alpha);

    // ---- P to shared memory: [64 rows][64 keys] bf16, one swizzled 128-byte row per query row.
    const float p_scale[2] = {kPScale, kPScale};
    mla_store_p<T, HALF>(p_tile, s, wg * HALF, p_scale, wq, g, c4);
    fence_proxy_async_smem();
    cta_bar(2);

    // ---- O[:, 256 wg ..] += P V: 16 keys a step, two N = 128 MMAs (V MN-major).
    wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < BN / 16; ++k16) {
      const uint64_t da = dp + ((k16 * 32) >> 4);
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        const uint64_t db = dv + ((k16 * 16 * 128 + nb * 2 * BN * 128) >> 4);
        wgmma_ss_mn<128, T>(o[nb], da, db, 1);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
  }
  cp_async_wait<0>();

  // ---- Epilogue: the two halves' row sums meet, then output (or this split's partial).
  __syncthreads();  // x_rows is reused
  mla_store_rows64<T>(p, req, item, kvh, wg, wq, g, c4, l, m, row_t, o, kUnit, x_rows);
}

// An fp8 latent: the paired-tile CTA (mla_pairs.cu, converting in place) at pages of up to
// mla_pairs_fp8_max_page() slots (every page size by default), this file's CTA above that or with
// ATTNRT_MLA_PAIRS=0. H100, mla-decode-h128-64x4096-fp8: the paired-tile CTA 1.20x this one at
// page 1 (272 against 227 TFLOP/s), 1.03x at page 64 (273 against 266).
template <bool E5M2>
struct MlaFp8Cta {
  using Split = GridCta<mla_attention_kernel<__nv_bfloat16, true, E5M2>, MlaCfg<true>>;
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey& key, int num_items,
                            cudaStream_t stream, bool dependent) {
    if (mla_pairs_enabled() && (1 << p.page_shift) <= mla_pairs_fp8_max_page())
      return mla_pairs_entry(key).launch(p, key, num_items, stream, dependent);
    return Split::launch(p, key, num_items, stream, dependent);
  }
  static int occupancy(const AttnKernelKey& key) { return Split::occupancy(key); }
};

}  // namespace

AttnCtaEntry mla_attention_entry(const AttnKernelKey& key) {
  if (key.head_dim != kMlaHeadDim || key.v_head_dim != kMlaVHeadDim || key.fp16) return {};
  using B = __nv_bfloat16;
  switch (key.kv) {
    case KvKind::same_as_q:
      if (mla_pairs_enabled()) return mla_pairs_entry(key);
      return GridCta<mla_attention_kernel<B, false, false>, MlaCfg<false>>::entry();
    case KvKind::e4m3:
      return {&MlaFp8Cta<false>::launch, &MlaFp8Cta<false>::occupancy};
    case KvKind::e5m2:
      return {&MlaFp8Cta<true>::launch, &MlaFp8Cta<true>::occupancy};
  }
  return {};
}

}  // namespace attnrt::cuda
