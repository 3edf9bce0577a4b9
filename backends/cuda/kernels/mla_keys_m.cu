// The keys-on-M MLA CTA: work items of at most 16 (token, head) rows (decode at 16 heads or fewer,
// as under tensor parallelism 8, and verify or extend rows that few) with the latent tile's 64 keys
// as the MMA's M dimension, so no MMA row is padding. mla_decode.cu's 64-row CTA would compute 64
// rows for these 16 and, at 3 us of MMA and barrier work a tile, could not keep up with the latent
// stream; here a tile's MMAs are a quarter of that and the rows are memory-bound.
//
//  - S^T = K Q^T: m64n16k16 over the 576 columns, A = the latent tile (K-major), B = the 16 query
//    rows (K-major), 8 accumulators a thread.
//  - The softmax runs down the columns: each (token, head) column's maximum and sum over the tile's
//    64 keys meet across the four warps in shared memory; the running maximum moves lazily (2^8).
//  - P^T (bf16, [16 columns][64 keys]) goes to shared memory, and O^T = V^T P^T: eight m64n16k16
//    per 16 keys, A = the tile read M-major (the head dim as M), 64 fp32 accumulators a thread.
// One warpgroup; Q 18 KB, two 72 KB latent tiles, P^T 2 KB: one CTA per SM.
//
// An fp8 cache adds a second warpgroup, the producer: it copies the raw rows in stages of 32 keys
// (three 18 KB stages, two in flight while it converts one) and converts each thread's own chunks
// into the bf16 tile of their tile (it & 1, exactly, in units of 2^-112 as in mla_decode.cu), so
// the conversion of tile it + 1 runs while the consumer's MMAs and softmax run on tile it. With
// one warpgroup doing both, a tile paid the conversion, then the MMAs, with nothing overlapping
// either (fp8 ran at 0.6-0.8x the bf16 speed with half its bytes). Named barriers hand the two
// bf16 tiles over: "full" (2 + b: the producer arrives once tile b's rows are converted and
// fenced for the async proxy, the consumer waits) and "free" (4 + b: the consumer arrives at the
// start of the tile after the one it read, the producer waits before converting into it again).
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
#include "backends/cuda/kernels/prefill_ws_sync.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

namespace {

template <bool FP8>
struct KeysMCfg {
  static constexpr int kD = kMlaHeadDim;
  static constexpr int kCols = 16;  // (token, head) rows of an item: the MMA's N
  static constexpr int kBN = 64;    // keys a tile: the MMA's M
  // fp8: the producer warpgroup (threads 128 ..) after the consumer.
  static constexpr int kThreads = FP8 ? 256 : 128;
  static constexpr int kQBytes = kCols * kD * 2;
  static constexpr int kTileBytes = kMlaTileBytes;
  static constexpr int kRawKeys = 32, kRawStages = 3;  // fp8 stages
  static constexpr int kRawBytes = FP8 ? kRawStages * kRawKeys * kD : 0;
  static constexpr int kPBytes = kCols * kBN * 2;
  static constexpr int kXBytes = 4 * kCols * 4;  // [warp][column] maxima or sums
  static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kTileBytes + kRawBytes + kPBytes + kXBytes;
  static_assert(kQBytes % 1024 == 0 && kBN == kMlaTileKeys && kRawKeys % 16 == 0);
};

// The consumer warpgroup's own barrier, and the fp8 hand-over of bf16 tile b (see above).
__device__ __forceinline__ void wg_bar() { asm volatile("bar.sync 1, 128;\n" ::: "memory"); }
constexpr int kTileFullBar = 2, kTileFreeBar = 4;
constexpr int kSChains = 4;
// The consumer's barrier where the whole CTA is the consumer (16-bit caches) or not.
template <bool FP8>
__device__ __forceinline__ void consumer_bar() {
  if constexpr (FP8) {
    wg_bar();
  } else {
    __syncthreads();
  }
}

// The fp8 producer warpgroup's loop: UNIT-key loads into the three raw stages (two ahead of the
// one it converts), the thread's own chunks of each converted into bf16 tile (load / parts) & 1 at
// its key offset once the consumer has released that tile (after the tile two before it).
template <class Copier>
__device__ __forceinline__ void produce_fp8_tiles(Copier& copier, unsigned char* tiles,
                                                  int num_tiles) {
  constexpr int kParts = kMlaTileKeys / Copier::kUnit;
  const int loads = num_tiles * kParts;
  copier.prefetch_slots(0);
  if (loads > 0) copier.load_into(0);
  cp_async_commit();
  copier.prefetch_slots(1);
  if (loads > 1) copier.load_into(1);
  cp_async_commit();
  copier.prefetch_slots(2);
  for (int u = 0, stage = 0; u < loads; ++u) {
    cp_async_wait<1>();  // load u landed (u + 1 may be in flight)
    const int t = u / kParts, part = u - t * kParts, b = t & 1;
    if (part == 0 && t >= 2) named_bar_sync(kTileFreeBar + b, 256);
    copier.convert(stage, tiles + b * kMlaTileBytes, part * Copier::kUnit);
    const int ahead = stage == 0 ? 2 : stage - 1;  // (u + 2) % 3: load u - 1's, converted
    if (u + 2 < loads) copier.load_into(ahead);
    cp_async_commit();
    copier.prefetch_slots(u + 3);
    if (part == kParts - 1) {
      fence_proxy_async_smem();
      named_bar_arrive(kTileFullBar + b, 256);
    }
    stage = stage == 2 ? 0 : stage + 1;
  }
  cp_async_wait<0>();
}

template <typename T, bool FP8, bool E5M2>
__global__ void __launch_bounds__(KeysMCfg<FP8>::kThreads, 1)
    mla_keys_m_kernel(const AttnParams p) {
  using C = KeysMCfg<FP8>;
  constexpr int D = C::kD, BN = C::kBN, NC = C::kCols;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
  unsigned char* smem = smem_raw + pad;
  const uint32_t sQ = raw + pad;
  const uint32_t sKV = sQ + C::kQBytes;
  const uint32_t sP = sKV + 2 * C::kTileBytes + C::kRawBytes;
  unsigned char* p_tile = smem + C::kQBytes + 2 * C::kTileBytes + C::kRawBytes;
  float* x_cols = reinterpret_cast<float*>(p_tile + C::kPBytes);  // [4 warps][NC]

  const int tid = threadIdx.x, lane = tid & 31, wq = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;
  const int kvh = blockIdx.x;
  const MlaItem w(p, NC);
  // A padded item of a batch-invariant graph step (GraphLayout::det_splits): nothing to do.
  if (w.item.split >= w.req.num_splits) return;
  const WorkItem& item = w.item;
  const ReqInfo& req = w.req;
  const int G = p.group;
  const int t_first = w.t_first, t_last = w.t_last, lo = w.lo, hi = w.hi, num_tiles = w.num_tiles;
  const Mask<true> mask{p, req};

  // Copies: eight threads a row, thread ld_c taking chunk ld_c of every 64-column block: Q's 16
  // rows once (by the consumer), then four key rows a tile (ld_row + 16 r; fp8: two of each
  // 32-key load, by the producer).
  const int ld_row = (FP8 ? tid & 127 : tid) >> 3, ld_c = tid & 7;
  const uint32_t ld_swz = ld_row * 128 + ((ld_c ^ (ld_row & 7)) << 4);
  if (!FP8 || tid < 128) {
    const int f = item.f0 + ld_row, t = f / G, hg = f - t * G;
    const bool valid = t < req.qlen;
    const T* src = static_cast<const T*>(p.q);
    if (valid) src += (req.qo_start + t) * p.q_stride_tok + (kvh * G + hg) * p.q_stride_head;
#pragma unroll
    for (int i = 0; i < D / 64; ++i)
      cp_async_16(smem + ld_swz + i * NC * 128, src + (valid ? ld_c * 8 + i * 64 : 0), valid);
  }
  grid_dependency_wait();
  launch_dependent_grids();
  write_back_committed_pages(p, req, item, kvh, tid, C::kThreads);

  MlaTileCopier<T, FP8, E5M2, 4> copier{
      p, req, smem + C::kQBytes, lo, hi, num_tiles, kvh, ld_row, ld_c, ld_swz, 16};
  if constexpr (FP8) {
    if (tid >= 128) {
      // Loads of kRawKeys keys, two rows of each a thread, into the stages after the two tiles.
      using RawCopier =
          MlaTileCopier<T, true, E5M2, C::kRawKeys / 16, C::kRawKeys, 2 * C::kTileBytes>;
      const int loads = num_tiles * (BN / C::kRawKeys);
      RawCopier raw{p, req, smem + C::kQBytes, lo, hi, loads, kvh, ld_row, ld_c, ld_swz, 16};
      produce_fp8_tiles(raw, smem + C::kQBytes, num_tiles);
      return;
    }
    // Q times 2^64 (this thread's own chunks, once they landed), published to the async proxy.
    cp_async_commit();
    cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < D / 64; ++i) scale_q_chunk(smem + ld_swz + i * NC * 128);
    fence_proxy_async_smem();
    wg_bar();
  } else {
    copier.prefetch_slots(0);
    if (num_tiles > 0) copier.load(0);
    cp_async_commit();  // Q and tile 0
    copier.prefetch_slots(1);
  }
  constexpr float kUnit = FP8 ? kMlaFp8Unit : 1.f;  // of S and O
  constexpr float kPScale = FP8 ? kMlaFp8PScale : 1.f;

  // This thread's columns: nb * 8 + 2 c4 + e (nb, e in {0, 1}), i.e. (token, head) rows f0 + col.
  MaskRow col_row[2][2];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) col_row[nb][e] = mask.row((item.f0 + nb * 8 + 2 * c4 + e) / G);

  const SoftCap cap(p.softcap, p.softmax_scale);
  const float sl = cap.exp_scale(p.scale_log2);

  // O^T: dims mb * 64 + wq * 16 + g + 8 h (h = 0, 1), columns nb * 8 + 2 c4 + e:
  // o[mb][nb * 4 + 2 h + e].
  float o[8][8];
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int i = 0; i < 8; ++i) o[mb][i] = 0.f;
  float m[2][2], l[2][2];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) m[nb][e] = -INFINITY, l[nb][e] = 0.f;

  const uint64_t dq = wgmma_desc(sQ, 16);
  const uint64_t dp = wgmma_desc(sP, 16);
  for (int it = 0; it < num_tiles; ++it) {
    if constexpr (FP8) {
      // Tile it - 1 is read (its P V waited for); the producer waits for it after the next tile
      // only (tiles num_tiles - 2 and - 1 are not reused).
      if (it >= 1 && it + 1 < num_tiles) named_bar_arrive(kTileFreeBar + ((it - 1) & 1), 256);
      named_bar_sync(kTileFullBar + (it & 1), 256);
    } else {
      cp_async_wait<0>();
      fence_proxy_async_smem();
      __syncthreads();  // tile it landed; every warp is done with tile it - 1
      if (it + 1 < num_tiles) copier.load(it + 1);
      cp_async_commit();
      copier.prefetch_slots(it + 2);
    }
    const int kb = lo + it * BN;
    if (mask.hides(kb, BN, t_first, t_last)) continue;
    const uint32_t tK = sKV + (it & 1) * C::kTileBytes;
    const uint64_t dk = wgmma_desc(tK, 16);
    const uint64_t dv = wgmma_desc(tK, BN * 128);

    // ---- S^T = K Q^T: 64 keys x 16 columns.
    // Four accumulator chains (kk mod 4), added after, instead of one chain of 36 dependent
    // m64n16k16 (H100: the fp8 h16 rows 1.004-1.007x, the rest unchanged; so the chain's
    // latency is not what bounds the fp8 CTA's consumer).
    float s[8], s_part[kSChains][8];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint64_t da = dk + (((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4);
      const uint64_t db = dq + (((kk >> 2) * NC * 128 + (kk & 3) * 32) >> 4);
      wgmma_ss<NC, T>(s_part[kk % kSChains], da, db, kk >= kSChains ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      s[i] = s_part[0][i];
#pragma unroll
      for (int c = 1; c < kSChains; ++c) s[i] += s_part[c][i];
    }

    if constexpr (FP8) {
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] *= kUnit;
    }
    if (cap.on) {
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = cap(s[i]);
    }
    if (mask.needs_mask(kb, BN, hi, t_first, t_last)) {
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = kb + wq * 16 + g + 8 * h;
            if (!mask.visible(col_row[nb][e], j, hi)) s[nb * 4 + 2 * h + e] = -INFINITY;
          }
    }

    // ---- Column maxima over the 64 keys: this thread's two keys, the warp's 16 (lanes of one c4),
    // then the four warps.
    float mx[2][2];
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = fmaxf(s[nb * 4 + e], s[nb * 4 + 2 + e]);
        v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 4));
        v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 8));
        v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 16));
        mx[nb][e] = v;
        if (g == 0) x_cols[wq * NC + nb * 8 + 2 * c4 + e] = v;
      }
    wg_bar();
    bool moved = false;
    float alpha[2][2];
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = nb * 8 + 2 * c4 + e;
        float v = fmaxf(fmaxf(x_cols[col], x_cols[NC + col]),
                        fmaxf(x_cols[2 * NC + col], x_cols[3 * NC + col]));
        float m_use;
        const bool move = lazy_max(m[nb][e], v * sl, m_use, alpha[nb][e]);
        moved = moved || move;
        float sum = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& x = s[nb * 4 + 2 * h + e];
          x = fast_exp2(fmaf(x, sl, -m_use));
          sum += x;
        }
        l[nb][e] = l[nb][e] * alpha[nb][e] + sum;
      }
    if (__any_sync(0xffffffff, moved)) {
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) o[mb][nb * 4 + 2 * h + e] *= alpha[nb][e];
    }

    // ---- P^T to shared memory: [16 columns][64 keys], one swizzled 128-byte row per column.
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = nb * 8 + 2 * c4 + e, key = wq * 16 + g + 8 * h;
          const uint32_t off = col * 128 + (((key >> 3) ^ (col & 7)) << 4) + (key & 7) * 2;
          *reinterpret_cast<T*>(p_tile + off) = from_float<T>(s[nb * 4 + 2 * h + e] * kPScale);
        }
    fence_proxy_async_smem();
    wg_bar();

    // ---- O^T += V^T P^T: dims as M (eight blocks of 64), 16 keys a step.
    wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < BN / 16; ++k16) {
      const uint64_t db = dp + ((k16 * 32) >> 4);
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
        const uint64_t da = dv + ((k16 * 16 * 128 + mb * BN * 128) >> 4);
        wgmma_ss_tn<NC, T>(o[mb], da, db, 1);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
  }
  cp_async_wait<0>();

  // ---- Epilogue: column sums over the keys (lanes of one c4, then the warps), then each thread
  // writes its 64 (dim, column) values.
  consumer_bar<FP8>();  // x_cols is reused
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = l[nb][e];
      v += __shfl_xor_sync(0xffffffff, v, 4);
      v += __shfl_xor_sync(0xffffffff, v, 8);
      v += __shfl_xor_sync(0xffffffff, v, 16);
      if (g == 0) x_cols[wq * NC + nb * 8 + 2 * c4 + e] = v;
    }
  consumer_bar<FP8>();
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = nb * 8 + 2 * c4 + e;
      const float ll = x_cols[col] + x_cols[NC + col] + x_cols[2 * NC + col] + x_cols[3 * NC + col];
      const int f = item.f0 + col, t = f / G, hg = f - t * G;
      if (t >= req.qlen) continue;
      // Warp 0's lanes g = 0 write the column's lse.
      const MlaRowOut<T> row(p, req, item.split, t, kvh * G + hg, ll, m[nb][e], kUnit,
                             wq == 0 && g == 0);
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int h = 0; h < 2; ++h) row.put(mb * 64 + wq * 16 + g + 8 * h, o[mb][nb * 4 + 2 * h + e]);
    }
}

}  // namespace

AttnCtaEntry mla_keys_m_entry(const AttnKernelKey& key) {
  if (key.head_dim != kMlaHeadDim || key.v_head_dim != kMlaVHeadDim || key.fp16) return {};
  using B = __nv_bfloat16;
  switch (key.kv) {
    case KvKind::same_as_q:
      return GridCta<mla_keys_m_kernel<B, false, false>, KeysMCfg<false>>::entry();
    case KvKind::e4m3:
      return GridCta<mla_keys_m_kernel<B, true, false>, KeysMCfg<true>>::entry();
    case KvKind::e5m2:
      return GridCta<mla_keys_m_kernel<B, true, true>, KeysMCfg<true>>::entry();
  }
  return {};
}

}  // namespace attnrt::cuda
