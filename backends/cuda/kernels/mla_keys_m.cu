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
// One warpgroup; Q 18 KB, two 72 KB latent tiles, P^T 2 KB: one CTA per SM (16-bit caches).
//
// An fp8 cache is read without a bf16 copy of the tile: the raw rows land in stages of 64 keys
// (mla_raw_offset's layout) and each warp loads its MMA operands from them with ldmatrix and
// converts them in registers to f16 (e4m3: one conversion a pair, exact; e5m2: the upper byte of
// an f16, moved), the A operand of register-sourced MMAs (wgmma_rs_k):
//  - S^T: ldmatrix gives thread (g, c4) bytes 4 c4 .. 4 c4 + 3 of a key row's 16-byte chunk, so
//    the MMA's k order inside each 16 columns is a fixed permutation of the columns (k = 2 c4 + e
//    is column 4 c4 + e, k = 2 c4 + 8 + e is column 4 c4 + 2 + e); Q is stored in that order.
//  - O^T: ldmatrix.trans gives thread (g, c4) columns 2 g and 2 g + 1 of keys 2 c4 and 2 c4 + 1;
//    one byte permute makes row g of the MMA column 2 g and row g + 8 column 2 g + 1, so output
//    row g + 8 h of a warp's 16 is dimension 2 g + h of its 16 (adjacent: stored in pairs).
// Q and P are f16 then: Q times a power of two that brings the item's largest |q| to [2^13, 2^14)
// (no overflow, the scale undone on S), P as computed (at most 2^8 with the lazy maximum). With
// no producer warpgroup and no conversion pass through shared memory, two stages (95 KB) let two
// CTAs share an SM. (The producer-warpgroup form before it converted each tile into a bf16 copy
// in shared memory: 3.7 us a tile, slower than the bf16 cache with half the bytes.)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

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
struct KeysMCfg {
  static constexpr int kD = kMlaHeadDim;
  static constexpr int kCols = 16;  // (token, head) rows of an item: the MMA's N
  static constexpr int kBN = 64;    // keys a tile: the MMA's M
  static constexpr int kThreads = 128;
  static constexpr int kQBytes = kCols * kD * 2;
  // 16-bit: two tiles in the wgmma layout; fp8: kRawStages raw tiles (mla_raw_offset).
  // fp8: two stages, so that two CTAs share an SM (H100, h16-64x8192-fp8: 148 us; four stages at
  // one CTA an SM, twice the bytes in flight: 217 us; the consumer's chain is latency-bound).
  static constexpr int kRawStages = 2;
  static constexpr int kStages = FP8 ? kRawStages : 2;
  static constexpr int kStageBytes = FP8 ? kMlaRawTileBytes : kMlaTileBytes;
  static constexpr int kPBytes = kCols * kBN * 2;
  static constexpr int kXBytes = 4 * kCols * 4;  // [warp][column] maxima or sums
  // The page ids of two loads (16-bit IDS instance): 4 rows x 128 threads, 4 bytes each.
  static constexpr int kIdsBytes = FP8 ? 0 : 2 * 4 * kThreads * 4;
  static constexpr int kSmemBytes =
      1024 + kQBytes + kStages * kStageBytes + kPBytes + kXBytes + kIdsBytes;
  static constexpr int kMinBlocks = FP8 && kSmemBytes * 2 <= 227 * 1024 ? 2 : 1;
  static_assert(kQBytes % 1024 == 0 && kBN == kMlaTileKeys && kStages >= 2);
};

__device__ __forceinline__ void wg_bar() { asm volatile("bar.sync 1, 128;\n" ::: "memory"); }
// Register-sourced MMA groups (two k steps each) in flight while the next operands are loaded and
// converted, and how many groups ahead their ldmatrix is issued. H100, h16-64x8192-fp8: three sets
// with the ldmatrix one group ahead 128.6 us; none ahead 146.1; groups of four k steps with the
// ldmatrix two units ahead 130.6.
constexpr int kFp8Sets = 3;
constexpr int kFp8Ahead = 1;

// The fp8 path's Q: the item's 16 bf16 rows (landed, in the wgmma layout, read by every thread
// after a barrier) times a power of two, as f16 in the permuted k order of the header, in place.
// Returns the scale's inverse. red: a float per warp.
__device__ __forceinline__ float q_to_f16(unsigned char* sq, int tid, float* red) {
  constexpr int NC = 16, kGroups = NC * kMlaHeadDim / 16;
  constexpr int kPer = (kGroups + 127) / 128;
  uint4 v[kPer][2];
  uint32_t off[kPer];
  float mx = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int gidx = tid + 128 * i;
    const int n = min(gidx, kGroups - 1) / (kMlaHeadDim / 16), gi = min(gidx, kGroups - 1) % 36;
    off[i] = (gi >> 2) * NC * 128 + n * 128;
    const int c0 = (2 * (gi & 3)) ^ (n & 7), c1 = (2 * (gi & 3) + 1) ^ (n & 7);
    v[i][0] = *reinterpret_cast<const uint4*>(sq + off[i] + (c0 << 4));
    v[i][1] = *reinterpret_cast<const uint4*>(sq + off[i] + (c1 << 4));
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[i][0]);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float2 f = __bfloat1622float2(h[k]);
      mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  __syncthreads();
  mx = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
  int e = 0;
  if (mx > 0.f && mx <= 3.0e38f) frexpf(mx, &e);  // mx < 2^e
  const int sh = min(max(14 - e, -120), 120);
  const float scale = ldexpf(1.f, sh);
  __syncthreads();  // red is reused
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (tid + 128 * i >= kGroups) continue;
    const int gidx = tid + 128 * i, n = gidx / 36, gi = gidx % 36;
    const int c0 = (2 * (gi & 3)) ^ (n & 7), c1 = (2 * (gi & 3) + 1) ^ (n & 7);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[i][0]);
    uint32_t w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float2 f = __bfloat1622float2(h[k]);
      const __half2 q = __floats2half2_rn(f.x * scale, f.y * scale);
      // Pair k (columns 2k, 2k + 1) is word k / 2 (k even) or 4 + k / 2 (k odd) of the 16.
      w[(k & 1) * 4 + (k >> 1)] = *reinterpret_cast<const uint32_t*>(&q);
    }
    *reinterpret_cast<uint4*>(sq + off[i] + (c0 << 4)) = make_uint4(w[0], w[1], w[2], w[3]);
    *reinterpret_cast<uint4*>(sq + off[i] + (c1 << 4)) = make_uint4(w[4], w[5], w[6], w[7]);
  }
  return ldexpf(1.f, -sh);
}

// IDS: the copier's page ids by cp.async through shared memory (pages of up to 16 slots), else
// loaded into registers a tile ahead.
template <typename T, bool FP8, bool E5M2, bool IDS>
__global__ void __launch_bounds__(KeysMCfg<FP8>::kThreads, KeysMCfg<FP8>::kMinBlocks)
    mla_keys_m_kernel(const AttnParams p) {
  using C = KeysMCfg<FP8>;
  // The 16-bit type of Q and P in shared memory and of the MMAs.
  using PT = std::conditional_t<FP8, __half, T>;
  constexpr int D = C::kD, BN = C::kBN, NC = C::kCols, ST = C::kStages;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
  unsigned char* smem = smem_raw + pad;
  const uint32_t sQ = raw + pad;
  const uint32_t sKV = sQ + C::kQBytes;
  unsigned char* stages = smem + C::kQBytes;
  const uint32_t sP = sKV + ST * C::kStageBytes;
  unsigned char* p_tile = stages + ST * C::kStageBytes;
  float* x_cols = reinterpret_cast<float*>(p_tile + C::kPBytes);  // [4 warps][NC]
  const uint32_t sIds = sP + C::kPBytes + C::kXBytes;

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
  // rows once, then four key rows a tile (ld_row + 16 r).
  const int ld_row = tid >> 3, ld_c = tid & 7;
  const uint32_t ld_swz = ld_row * 128 + ((ld_c ^ (ld_row & 7)) << 4);
  {
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

  MlaTileCopier<T, FP8, E5M2, 4> copier{p,   req,    stages, lo,     hi, num_tiles,
                                        kvh, ld_row, ld_c,   ld_swz, 16};
  auto load = [&](int t) {
    if constexpr (FP8) {
      copier.load_raw_swizzled(stages + static_cast<unsigned>(t) % ST * C::kStageBytes);
    } else {
      copier.load(t);
    }
  };
  // The page ids of a thread's rows. Loaded into registers a tile ahead (prefetch_slots), ptxas
  // computes each row's address right after the load, and the warp waits there for the page
  // table before the tile's MMAs, which then issue the next copies later (the paired-tile CTA's
  // page-1 rows: 1.35x through shared memory). IDS: by cp.async into this thread's shared words
  // (ring slot t & 1), landed with the tile before them (cp.async.wait_group 0 at the top of
  // each tile).
  auto ids_at = [&](int t) { return sIds + ((t & 1) * 4 * C::kThreads + tid) * 4; };
  constexpr int kIdsStep = C::kThreads * 4;
  // Tiles 0 .. ST - 2 ahead, each its own group after Q's.
  if constexpr (FP8) cp_async_commit();
#pragma unroll
  for (int t = 0; t < ST - 1; ++t) {
    copier.prefetch_slots(t);
    if (t < num_tiles) load(t);
    cp_async_commit();
  }
  if constexpr (IDS) {
    copier.issue_ids(ST - 1, ids_at(ST - 1), kIdsStep);  // one more group
  } else {
    copier.prefetch_slots(ST - 1);
  }
  float inv_qs = 1.f;  // of S (fp8: Q's scale undone)
  if constexpr (FP8) {
    cp_async_wait<IDS ? ST : ST - 1>();  // Q
    __syncthreads();
    inv_qs = q_to_f16(smem, tid, x_cols);
    fence_proxy_async_smem();  // published by the first tile's barrier
  }

  // This thread's columns: nb * 8 + 2 c4 + e (nb, e in {0, 1}), i.e. (token, head) rows f0 + col.
  MaskRow col_row[2][2];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) col_row[nb][e] = mask.row((item.f0 + nb * 8 + 2 * c4 + e) / G);

  const SoftCap cap(p.softcap, p.softmax_scale);
  const float sl = cap.exp_scale(p.scale_log2);

  // O^T: 16-bit, dims mb * 64 + wq * 16 + g + 8 h (h = 0, 1); fp8, dims mb * 64 + wq * 16 + 2 g +
  // h; columns nb * 8 + 2 c4 + e: o[mb][nb * 4 + 2 h + e].
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
  // B of k step kk (16 columns) of S^T.
  auto q_desc = [&](int kk) { return dq + (((kk >> 2) * NC * 128 + (kk & 3) * 32) >> 4); };
  // fp8 ldmatrix addresses (mla_raw_offset): S^T's pair j of k steps: matrix lane >> 3 = keys
  // 16 wq + 8 (bit 0) of chunk 2 j + (bit 1); O^T's k steps 2 q, 2 q + 1 of dims block mb: matrix
  // lane >> 3 = keys 32 q + 8 (lane >> 3), chunk 4 mb + wq.
  const int lr = lane & 7, lm = lane >> 3;
  const uint32_t s_key = wq * 16 + lr + 8 * (lm & 1);
  const uint32_t s_base = s_key * 128 + (((lm >> 1) ^ lr) << 4);
  const uint32_t s_rope = 4 * BN * 128 + s_key * 64 + (((lm >> 1) ^ (lr >> 1)) << 4);
  const uint32_t v_base = (8 * lm + lr) * 128 + ((wq ^ lr) << 4);
  for (int it = 0; it < num_tiles; ++it) {
    cp_async_wait<ST - 2>();
    if constexpr (!FP8) fence_proxy_async_smem();
    __syncthreads();  // tile it landed; every warp is done with tile it - 1
    if constexpr (IDS) copier.slots_from_ids(it + ST - 1, ids_at(it + ST - 1), kIdsStep);
    if (it + ST - 1 < num_tiles) load(it + ST - 1);
    cp_async_commit();
    if constexpr (IDS) {
      copier.issue_ids(it + ST, ids_at(it + ST), kIdsStep);
    } else {
      copier.prefetch_slots(it + ST);
    }
    const int kb = lo + it * BN;
    if (mask.hides(kb, BN, t_first, t_last)) continue;
    const uint32_t stage = static_cast<unsigned>(it) % ST;
    const uint32_t tK = sKV + stage * C::kStageBytes;
    const unsigned char* stg = stages + stage * C::kStageBytes;

    // ---- S^T = K Q^T: 64 keys x 16 columns, in kChains accumulator chains (16-bit: four, added
    // after, instead of one chain of 36 dependent m64n16k16; H100: the chain's latency was not
    // what bounded the fp8 rows of the producer form, the rest unchanged).
    constexpr int kChains = FP8 ? 2 : 4;
    float s[8], s_part[kChains][8];
    if constexpr (FP8) {
      // Pair j of k steps: matrix lane >> 3 = keys 16 wq + 8 (bit 0) of chunk 2 j + (bit 1). Each
      // pair's ldmatrix is issued kFp8Ahead pairs early, so its latency hides under the
      // conversions and MMAs of the pairs before it.
      auto load_s = [&](uint32_t(&x)[4], int j) {
        ldmatrix_x4(x, stg + (j < 16 ? (j >> 2) * BN * 128 + (s_base ^ ((2 * j & 7) << 4))
                                     : (s_rope ^ ((2 * (j - 16)) << 4))));
      };
      constexpr int kPairs = D / 32;
      uint32_t a[kFp8Sets][2][4], x[kFp8Ahead + 1][4];
#pragma unroll
      for (int j = 0; j < kFp8Ahead; ++j) load_s(x[j], j);
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        const int set = j % kFp8Sets, xi = j % (kFp8Ahead + 1);
        if (j + kFp8Ahead < kPairs) load_s(x[(j + kFp8Ahead) % (kFp8Ahead + 1)], j + kFp8Ahead);
        if (j >= kFp8Sets) wgmma_wait<kFp8Sets - 1>();  // the MMAs that read a[set] are done
        fp8x4_to_f16<E5M2>(x[xi][0], a[set][0][0], a[set][0][2]);
        fp8x4_to_f16<E5M2>(x[xi][1], a[set][0][1], a[set][0][3]);
        fp8x4_to_f16<E5M2>(x[xi][2], a[set][1][0], a[set][1][2]);
        fp8x4_to_f16<E5M2>(x[xi][3], a[set][1][1], a[set][1][3]);
        wgmma_fence();
        wgmma_rs_k<NC, PT>(s_part[0], a[set][0], q_desc(2 * j), j > 0 ? 1 : 0);
        wgmma_rs_k<NC, PT>(s_part[1], a[set][1], q_desc(2 * j + 1), j > 0 ? 1 : 0);
        wgmma_commit();
      }
    } else {
      const uint64_t dk = wgmma_desc(tK, 16);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint64_t da = dk + (((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4);
        wgmma_ss<NC, T>(s_part[kk % kChains], da, q_desc(kk), kk >= kChains ? 1 : 0);
      }
      wgmma_commit();
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      s[i] = s_part[0][i];
#pragma unroll
      for (int c = 1; c < kChains; ++c) s[i] += s_part[c][i];
      if constexpr (FP8) s[i] *= inv_qs;
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
          *reinterpret_cast<PT*>(p_tile + off) = from_float<PT>(s[nb * 4 + 2 * h + e]);
        }
    fence_proxy_async_smem();
    wg_bar();

    // ---- O^T += V^T P^T: dims as M (eight blocks of 64), 16 keys a step.
    if constexpr (FP8) {
      // Group n: k steps 2 q, 2 q + 1 of dims block mb (q = n / 8, mb = n % 8); matrix lane >> 3 =
      // keys 32 q + 8 (lane >> 3) of chunk 4 mb + wq. Loaded kFp8Ahead groups early, as S's.
      auto load_v = [&](uint32_t(&x)[4], int n) {
        const int q = n >> 3, mb = n & 7;
        ldmatrix_x4_trans(x,
                          stg + (mb >> 1) * BN * 128 + q * 32 * 128 + (v_base ^ ((mb & 1) << 6)));
      };
      constexpr int kGroups = 2 * 8;
      uint32_t a[kFp8Sets][2][4], x[kFp8Ahead + 1][4];
#pragma unroll
      for (int n = 0; n < kFp8Ahead; ++n) load_v(x[n], n);
#pragma unroll
      for (int n = 0; n < kGroups; ++n) {
        const int q = n >> 3, mb = n & 7, set = n % kFp8Sets, xi = n % (kFp8Ahead + 1);
        if (n + kFp8Ahead < kGroups) load_v(x[(n + kFp8Ahead) % (kFp8Ahead + 1)], n + kFp8Ahead);
        if (n >= kFp8Sets) wgmma_wait<kFp8Sets - 1>();
        // Bytes (key 2 c4: dims 2 g, 2 g + 1; key 2 c4 + 1: the same) -> rows g (dim 2 g) and
        // g + 8 (dim 2 g + 1), keys 2 c4, 2 c4 + 1 in each.
#pragma unroll
        for (int i = 0; i < 4; ++i)
          fp8x4_to_f16<E5M2>(__byte_perm(x[xi][i], 0u, 0x3120), a[set][i >> 1][(i & 1) * 2],
                             a[set][i >> 1][(i & 1) * 2 + 1]);
        wgmma_fence();
        wgmma_rs_k<NC, PT>(o[mb], a[set][0], dp + ((2 * q * 32) >> 4), 1);
        wgmma_rs_k<NC, PT>(o[mb], a[set][1], dp + (((2 * q + 1) * 32) >> 4), 1);
        wgmma_commit();
      }
    } else {
      const uint64_t dv = wgmma_desc(tK, BN * 128);
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
    }
    wgmma_wait<0>();
  }
  cp_async_wait<0>();

  // ---- Epilogue: column sums over the keys (lanes of one c4, then the warps), then each thread
  // writes its 64 (dim, column) values.
  __syncthreads();  // x_cols is reused
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
  __syncthreads();
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = nb * 8 + 2 * c4 + e;
      const float ll = x_cols[col] + x_cols[NC + col] + x_cols[2 * NC + col] + x_cols[3 * NC + col];
      const int f = item.f0 + col, t = f / G, hg = f - t * G;
      if (t >= req.qlen) continue;
      // Warp 0's lanes g = 0 write the column's lse.
      const MlaRowOut<T> row(p, req, item.split, t, kvh * G + hg, ll, m[nb][e], 1.f,
                             wq == 0 && g == 0);
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
        if constexpr (FP8) {
          row.put2(mb * 64 + wq * 16 + 2 * g, o[mb][nb * 4 + e], o[mb][nb * 4 + 2 + e]);
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h)
            row.put(mb * 64 + wq * 16 + g + 8 * h, o[mb][nb * 4 + 2 * h + e]);
        }
      }
    }
}

// The 16-bit cache's launch: page ids through shared memory at pages of up to 16 slots.
struct KeysM16 {
  using B = __nv_bfloat16;
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey& key, int num_items,
                            cudaStream_t stream, bool dependent) {
    return p.page_shift <= 4
               ? GridCta<mla_keys_m_kernel<B, false, false, true>, KeysMCfg<false>>::launch(
                     p, key, num_items, stream, dependent)
               : GridCta<mla_keys_m_kernel<B, false, false, false>, KeysMCfg<false>>::launch(
                     p, key, num_items, stream, dependent);
  }
  static int occupancy(const AttnKernelKey& key) {
    return GridCta<mla_keys_m_kernel<B, false, false, false>, KeysMCfg<false>>::occupancy(key);
  }
};

}  // namespace

AttnCtaEntry mla_keys_m_entry(const AttnKernelKey& key) {
  if (key.head_dim != kMlaHeadDim || key.v_head_dim != kMlaVHeadDim || key.fp16) return {};
  using B = __nv_bfloat16;
  switch (key.kv) {
    case KvKind::same_as_q:
      return {&KeysM16::launch, &KeysM16::occupancy};
    case KvKind::e4m3:
      return GridCta<mla_keys_m_kernel<B, true, false, false>, KeysMCfg<true>>::entry();
    case KvKind::e5m2:
      return GridCta<mla_keys_m_kernel<B, true, true, false>, KeysMCfg<true>>::entry();
  }
  return {};
}

}  // namespace attnrt::cuda
