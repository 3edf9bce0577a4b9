// DSA's indexer on the GPU (dsa.h; docs/dsa.md "The index score", "The selection").
//
// Scores: one CTA per (scored token, 128 candidates), a thread per candidate. The CTA rounds the
// token's index queries to fp8 as round_index_query does (per head: the power-of-two scale from
// the binary form of amax / 448, e4m3 codes read back), dequantises its candidates' keys from the
// paged cache into shared memory (codes times the slot's scale, both exact), and takes per head an
// fp32 dot product, across heads an fp64 sum of w_h * relu(dot), as the cpu backend does.
//
// Scores on tensor cores (dsa_score_mma_kernel, the default; ATTNRT_DSA_INDEXER=cuda_core runs
// dsa_score_kernel instead): one CTA per (scored token, 1 to 8 tiles of 128 candidates), four
// warps. The CTA stages the token's rounded queries once as bf16 (the e4m3 codes times 2^112,
// exact) in shared memory, then looks up the slots of all its candidates. Each warp then owns 32
// candidates of every tile: it loads their fp8 codes (a 4-byte word per lane, the next tile's in
// flight during this tile's MMAs), converts them to bf16 (the codes times 2^-112, exact: fp8x4_to)
// into its own rows of shared memory (rows padded by 16 bytes, so ldmatrix is conflict-free), and
// takes the heads x 32 dot block of codes on m16n8k16 bf16 MMAs with fp32 accumulation (the factors
// 2^112 and 2^-112 cancel, the products are exact). The epilogue applies the power-of-two scales
// after the dot (exact), sums w_h * q_scale_h * relu(dot) over its heads in fp64, adds up the eight
// lane groups by shuffles and writes one score per lane. Only the fp32 summation order differs from
// the CUDA-core kernel.
//
// Selection: one CTA per token. At most topk candidates: all of them. Otherwise a radix select on
// the scores as order-preserving uint32 keys (four 8-bit passes over a shared histogram) finds
// the topk-th largest key tau and how many keys equal to tau are taken; a pass over the
// candidates in increasing token index then takes every key above tau and the first of those
// equal to it (the tie rule: lower token index first), placing each by a block prefix count, so
// the slots come out in increasing token index. Histogram adds are aggregated per warp and bin;
// the last pass gives each thread 8 consecutive candidates (two block scans per 4096).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cub/block/block_scan.cuh>
#include <string_view>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/dsa.h"
#include "backends/cuda/kernels/primitives.cuh"

namespace attnrt::cuda {

namespace {

constexpr int kScoreCands = 128;  // candidates (threads) of a score CTA
constexpr int kSelectThreads = 512;
constexpr int kSelectItems = 8;  // consecutive candidates per thread in the selection's last pass
constexpr int kHistItems = 16;   // scores per thread per round of a histogram pass
constexpr float kE4m3Max = 448.f;

constexpr int kMmaCands = 128;  // candidates of a tensor-core key tile: 32 per warp
constexpr int kMmaWarps = kMmaCands / 32;
constexpr int kMmaMaxTiles = 8;  // tiles of one tensor-core CTA at most (3 CTAs of 8 fit an SM)
// A tensor-core CTA takes one more tile (up to kMmaMaxTiles) per this many tiles of its launch.
constexpr int kMmaTilesPerCta = 1024;
// CTAs of a graph step's score launch, about (score_ctas_y): 16 waves of the CUDA-core CTA (two
// resident per SM) on 132 SMs.
constexpr int64_t kGraphScoreCtas = 4096;
constexpr float kQueryUp = 0x1p112f;  // undoes the 2^-112 of the keys' bf16 codes (fp8x4_to)

int g_indexer = -1;  // -1: not read yet; else a DsaIndexer

// Token index of candidate m of token t of `req`: m itself, or in a tree the m-th of the prefix
// and the drafts that are t or its ancestors.
__device__ __forceinline__ int32_t candidate(const DsaParams& p, const ReqInfo& req, int t,
                                             int32_t m) {
  if (!p.tree || m < req.prefix) return m;
  uint64_t bits = p.tree_mask[req.tree_start + t];
  for (int32_t k = m - req.prefix; k > 0; --k) bits &= bits - 1;
  return req.prefix + __ffsll(static_cast<long long>(bits)) - 1;
}

// Pool slot of token index j of `req` (the step plan's page tables, ReqInfo).
__device__ __forceinline__ int64_t slot_of(const DsaParams& p, const ReqInfo& req, int32_t j) {
  const int32_t page = j >> p.page_shift;
  const int32_t id = page < req.pt_known ? p.row_table[req.pt_row + page]
                                         : p.page_table[req.pt_start + page - req.pt_known];
  return (static_cast<int64_t>(id) << p.page_shift) | (j & ((1 << p.page_shift) - 1));
}

__device__ __forceinline__ int64_t codes_at(int64_t slot, int page, int dim) {
  return (slot / page) * page * (dim + 4) + (slot % page) * dim;
}
__device__ __forceinline__ int64_t scale_at(int64_t slot, int page, int dim) {
  return (slot / page) * page * (dim + 4) + int64_t{page} * dim + (slot % page) * 4;
}

// The power-of-two scale of one index query head (round_index_query: from the binary form of
// amax / 448), its dims at q[base + d * q_s2]. Warp-collective.
__device__ __forceinline__ float scale_of_amax(float amax) {
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  int e = 0;
  const float mant = frexpf(amax / kE4m3Max, &e);
  return ldexpf(1.f, mant == 0.5f ? e - 1 : e);
}
__device__ __forceinline__ float query_head_scale(const DsaParams& p, int64_t base, int lane) {
  float amax = 1e-4f;
  for (int d = lane; d < p.dim; d += 32)
    amax = fmaxf(amax, fabsf(load_elem(p.q, p.q_dtype, base + d * p.q_s2)));
  return scale_of_amax(amax);
}

// The round's count of scored tokens: the device's in a graph step, else the launch's.
__device__ __forceinline__ int32_t scored_count(const DsaParams& p) {
  return p.num_scored_dev != nullptr ? *p.num_scored_dev : p.num_scored;
}

__global__ void __launch_bounds__(kScoreCands) dsa_score_kernel(const DsaParams p) {
  extern __shared__ float smem[];
  if (static_cast<int32_t>(blockIdx.x) >= scored_count(p)) return;
  const int row = p.scored[blockIdx.x];
  const DsaToken tok = p.tokens[row];
  if (static_cast<int32_t>(blockIdx.y) * kScoreCands >= tok.num_cand) return;
  const int H = p.heads, D = p.dim, KS = D + 4;  // key rows padded: conflict-free float4 reads
  float* sq = smem;                              // [H][D] rounded queries
  float* sk = sq + H * D;                        // [kScoreCands][KS] dequantised keys
  int64_t* sslot = reinterpret_cast<int64_t*>(sk + kScoreCands * KS);  // [kScoreCands]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // The rounded index queries, a warp per head.
  for (int h = warp; h < H; h += kScoreCands / 32) {
    const int64_t base = row * p.q_s0 + h * p.q_s1;
    const float scale = query_head_scale(p, base, lane);
    for (int d = lane; d < D; d += 32) {
      const float x = load_elem(p.q, p.q_dtype, base + d * p.q_s2);
      sq[h * D + d] = fp8_to_float(float_to_fp8(x / scale, false), false) * scale;
    }
  }
  // Tiles of 128 candidates: blockIdx.y, then every gridDim.y-th (one tile per CTA in an eager
  // launch, whose grid covers the round's most candidates).
  const int words = D / 4;
  const int32_t num_cand = tok.num_cand;
  float* const scores = p.scores + tok.score_off;
  for (int32_t m0 = static_cast<int32_t>(blockIdx.y) * kScoreCands; m0 < num_cand;
       m0 += static_cast<int32_t>(gridDim.y) * kScoreCands) {
    // The candidates' slots, then their keys (codes read as words: dim is a multiple of 4).
    const int32_t m = m0 + tid;
    const bool live = m < num_cand;
    if (live) {
      const ReqInfo r = p.reqs[tok.req];  // re-read per tile: held across the loop, it spills
      sslot[tid] = slot_of(p, r, candidate(p, r, tok.t, m));
    } else {
      sslot[tid] = -1;
    }
    __syncthreads();
    for (int i = tid; i < kScoreCands * words; i += kScoreCands) {
      const int c = i / words, wd = i - c * words;
      const int64_t s = sslot[c];
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (s >= 0) {
        const float sc = *reinterpret_cast<const float*>(p.keys + scale_at(s, p.key_page, D));
        const uint32_t w4 =
            *reinterpret_cast<const uint32_t*>(p.keys + codes_at(s, p.key_page, D) + 4 * wd);
        v = make_float4(
            fp8_to_float(w4 & 0xff, false) * sc, fp8_to_float((w4 >> 8) & 0xff, false) * sc,
            fp8_to_float((w4 >> 16) & 0xff, false) * sc, fp8_to_float(w4 >> 24, false) * sc);
      }
      *reinterpret_cast<float4*>(sk + c * KS + 4 * wd) = v;
    }
    __syncthreads();
    if (live) {
      const float4* key = reinterpret_cast<const float4*>(sk + tid * KS);
      double sum = 0.0;
      for (int h = 0; h < H; ++h) {
        const float4* qh = reinterpret_cast<const float4*>(sq + h * D);
        float dot = 0.f;
        for (int d4 = 0; d4 < words; ++d4) {
          const float4 a = qh[d4], b = key[d4];
          dot = fmaf(a.x, b.x, dot);
          dot = fmaf(a.y, b.y, dot);
          dot = fmaf(a.z, b.z, dot);
          dot = fmaf(a.w, b.w, dot);
        }
        const double w = load_elem(p.w, p.w_dtype, row * p.w_s0 + h * p.w_s1);
        sum += w * fmaxf(dot, 0.f);
      }
      // +0 for every zero score, so that equal scores get equal keys in the selection.
      const float score = static_cast<float>(p.score_scale * sum);
      scores[m] = score == 0.f ? 0.f : score;
    }
    __syncthreads();  // the next tile overwrites sslot and sk
  }
}

// Shared memory of the tensor-core CTA: the queries' and the keys' bf16 rows (D + 8 columns),
// w_h * q_scale_h per head, then per candidate its codes' offset and its scale.
constexpr size_t mma_smem_bytes(int heads, int dim, int tiles) {
  return (static_cast<size_t>(heads) + kMmaCands) * (dim + 8) * sizeof(__nv_bfloat16) +
         static_cast<size_t>(heads) * sizeof(double) +
         static_cast<size_t>(tiles) * kMmaCands * (sizeof(int64_t) + sizeof(float));
}

__global__ void __launch_bounds__(kMmaCands, 3) dsa_score_mma_kernel(const DsaParams p, int tiles) {
  extern __shared__ __align__(16) unsigned char mma_smem[];
  if (static_cast<int32_t>(blockIdx.x) >= scored_count(p)) return;
  const int row = p.scored[blockIdx.x];
  const DsaToken tok = p.tokens[row];
  const int32_t span = tiles * kMmaCands;  // candidates of one pass of the CTA
  if (static_cast<int32_t>(blockIdx.y) * span >= tok.num_cand) return;
  const ReqInfo req = p.reqs[tok.req];
  // Rows of LD bf16 (16 bytes of padding: the eight rows of an ldmatrix hit eight bank groups):
  // sq [H][LD] query codes * 2^112, sk [kMmaCands][LD] key codes * 2^-112; swq [H] w_h * q
  // scale_h; per candidate of the CTA its codes' offset (soff) and its key scale (sscale).
  const int H = p.heads, D = p.dim, LD = D + 8;
  auto* sq = reinterpret_cast<__nv_bfloat16*>(mma_smem);
  __nv_bfloat16* sk = sq + H * LD;
  auto* swq = reinterpret_cast<double*>(sk + kMmaCands * LD);
  auto* soff = reinterpret_cast<int64_t*>(swq + H);
  auto* sscale = reinterpret_cast<float*>(soff + tiles * kMmaCands);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // The rounded index queries as bf16 codes, warp w taking heads w, w + 4, ...: every load of
  // the warp's heads and weights issued before any is used (one memory round trip per CTA, not
  // two per head).
  {
    constexpr int kHeads = kDsaMaxIndexHeads / kMmaWarps, kDims = kDsaMaxIndexDim / 32;
    float x[kHeads][kDims];
#pragma unroll
    for (int i = 0; i < kHeads; ++i)
#pragma unroll
      for (int j = 0; j < kDims; ++j) {
        const int h = warp + i * kMmaWarps, d = lane + 32 * j;
        x[i][j] = h < H && d < D ? load_elem(p.q, p.q_dtype, row * p.q_s0 + h * p.q_s1 + d * p.q_s2)
                                 : 0.f;
      }
    const int hw = warp + lane * kMmaWarps;  // lane i < kHeads holds head i's weight
    const float wl =
        lane < kHeads && hw < H ? load_elem(p.w, p.w_dtype, row * p.w_s0 + hw * p.w_s1) : 0.f;
#pragma unroll
    for (int i = 0; i < kHeads; ++i) {
      const int h = warp + i * kMmaWarps;  // warp-uniform
      const float w = __shfl_sync(0xffffffffu, wl, i);
      if (h >= H) break;
      float amax = 1e-4f;
#pragma unroll
      for (int j = 0; j < kDims; ++j)
        if (lane + 32 * j < D) amax = fmaxf(amax, fabsf(x[i][j]));
      const float scale = scale_of_amax(amax);
#pragma unroll
      for (int j = 0; j < kDims; ++j)
        if (lane + 32 * j < D)
          sq[h * LD + lane + 32 * j] = __float2bfloat16_rn(
              fp8_to_float(float_to_fp8(x[i][j] / scale, false), false) * kQueryUp);
      if (lane == 0) swq[h] = static_cast<double>(w) * scale;
    }
  }
  // Passes over `span` candidates: blockIdx.y, then every gridDim.y-th (one pass in an eager
  // launch, whose grid covers the round's most candidates).
  for (int32_t c0 = static_cast<int32_t>(blockIdx.y) * span; c0 < tok.num_cand;
       c0 += static_cast<int32_t>(gridDim.y) * span) {
    const int n = min(tok.num_cand - c0, span);  // this pass's candidates
    // Every candidate's slot, resolved once: its codes' offset and its scale (the page-table
    // reads of a thread's candidates in flight together, then their scales).
    {
      int64_t sl[kMmaMaxTiles];
#pragma unroll
      for (int k = 0; k < kMmaMaxTiles; ++k) {
        const int i = tid + k * kMmaCands;
        sl[k] = i < n ? slot_of(p, req, candidate(p, req, tok.t, c0 + i)) : -1;
      }
#pragma unroll
      for (int k = 0; k < kMmaMaxTiles; ++k) {
        const int i = tid + k * kMmaCands;
        if (i < n) {
          soff[i] = codes_at(sl[k], p.key_page, D);
          sscale[i] = *reinterpret_cast<const float*>(p.keys + scale_at(sl[k], p.key_page, D));
        }
      }
    }
    __syncthreads();

    // From here each warp works alone on candidates [tb, tb + 32) of every tile, in its own rows.
    __nv_bfloat16* wk = sk + warp * 32 * LD;
    const bool word_lane = lane < D / 4;  // lane l carries bytes 4l .. 4l + 3 of every key
    uint32_t code[32];
    auto load_codes = [&](int tb) {
#pragma unroll
      for (int j = 0; j < 32; ++j)
        code[j] = word_lane && tb + j < n
                      ? reinterpret_cast<const uint32_t*>(p.keys + soff[tb + j])[lane]
                      : 0u;
    };
    const int g = lane >> 2, t = lane & 3;  // the fragments' row group and column pair
    const int mtiles = H / 16;
    load_codes(warp * 32);
    for (int tile = 0; tile < tiles; ++tile) {
      const int tb = tile * kMmaCands + warp * 32;
      if (tb >= n) break;
      __syncwarp();  // the previous tile's ldmatrix reads are done
      if (word_lane) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          uint32_t lo, hi;
          fp8x4_to<__nv_bfloat16>(code[j], false, lo, hi);
          *reinterpret_cast<uint2*>(wk + j * LD + 4 * lane) = make_uint2(lo, hi);
        }
      }
      __syncwarp();
      if (tb + kMmaCands < n) load_codes(tb + kMmaCands);  // in flight during the MMAs

      // dot[h][c] = <q codes of head h, key codes of candidate tb + c>: A = queries (heads on M),
      // B = keys (candidates on N, four n-tiles of 8), K = the index dims.
      float acc[4][4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
#pragma unroll 2
      for (int k0 = 0; k0 < D; k0 += 16) {
        // b[np]: n-tiles 2np (regs 0, 1) and 2np + 1 (regs 2, 3), dims k0 .. k0 + 15.
        uint32_t b[2][4];
#pragma unroll
        for (int np = 0; np < 2; ++np)
          ldmatrix_x4(b[np], wk + (np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + k0 +
                                 ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          if (mt < mtiles) {
            uint32_t a[4];
            ldmatrix_x4(a, sq + (mt * 16 + (lane & 15)) * LD + k0 + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < 2; ++np) {
              mma_16816<__nv_bfloat16>(acc[mt][2 * np], a, b[np][0], b[np][1]);
              mma_16816<__nv_bfloat16>(acc[mt][2 * np + 1], a, b[np][2], b[np][3]);
            }
          }
        }
      }

      // acc[mt][nt][e] is dot[mt * 16 + g + (e >> 1) * 8][nt * 8 + 2t + (e & 1)]: per column the
      // lane's heads in fp64, then the sum over the eight row groups (lanes g = 0 .. 7).
      double sum[4][2];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) sum[nt][0] = sum[nt][1] = 0.0;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        if (mt < mtiles) {
          const double w0 = swq[mt * 16 + g], w1 = swq[mt * 16 + g + 8];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              sum[nt][e] += w0 * fmaxf(acc[mt][nt][e], 0.f) + w1 * fmaxf(acc[mt][nt][2 + e], 0.f);
        }
      }
      double v = 0.0;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
          for (int o = 4; o < 32; o <<= 1)
            sum[nt][e] += __shfl_xor_sync(0xffffffffu, sum[nt][e], o);
          if (g == nt * 2 + e) v = sum[nt][e];
        }
      // Lane (g, t) writes column (g >> 1) * 8 + 2t + (g & 1): the warp's 32 columns once each.
      const int i = tb + (g >> 1) * 8 + 2 * t + (g & 1);
      if (i < n) {
        // +0 for every zero score, so that equal scores get equal keys in the selection.
        const float score = static_cast<float>(p.score_scale * (sscale[i] * v));
        p.scores[tok.score_off + c0 + i] = score == 0.f ? 0.f : score;
      }
    }
    __syncthreads();  // the next pass overwrites soff and sscale
  }
}

// Order-preserving: a larger float gets a larger key.
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__global__ void __launch_bounds__(kSelectThreads) dsa_select_kernel(const DsaParams p) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_remaining;
  const int64_t row = p.row0 + blockIdx.x;
  const DsaToken tok = p.tokens[row];
  const ReqInfo req = p.reqs[tok.req];
  const int tid = threadIdx.x, lane = tid & 31, K = p.topk, n = tok.num_cand;
  int32_t* slots = p.sel_slots + row * K;
  int32_t* out = p.topk_out != nullptr ? p.topk_out + row * p.topk_s0 : nullptr;
  if (p.row_table_out != nullptr && tok.t == 0) {
    for (int j = req.pt_known + tid; j < req.pt_commit; j += kSelectThreads)
      p.row_table_out[req.pt_row + j] = p.page_table[req.pt_start + j - req.pt_known];
  }

  if (n <= K) {
    for (int m = tid; m < K; m += kSelectThreads) {
      const int32_t j = m < n ? candidate(p, req, tok.t, m) : -1;
      if (m < n) slots[m] = static_cast<int32_t>(slot_of(p, req, j));
      if (out != nullptr) out[m * p.topk_s1] = j;
    }
    return;
  }

  const float* scores = p.scores + tok.score_off;
  // Radix select, most significant byte first: after pass b, s_prefix holds the top bytes of the
  // topk-th largest key and s_remaining how many keys with those bytes are still to be taken.
  // Scores crowd into a few bins (the top byte is mostly the exponent), so a warp adds each of its
  // bins once (lanes of one bin found by __match_any_sync) instead of one atomic per key on a
  // handful of addresses.
  if (tid == 0) {
    s_prefix = 0;
    s_remaining = K;
  }
  uint32_t mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix;
    // kHistItems loads in flight per thread (the pass is bound by their latency, one CTA per
    // token); warp-uniform trip counts.
    for (int m0 = 0; m0 < n; m0 += kHistItems * kSelectThreads) {
      uint32_t u[kHistItems];
#pragma unroll
      for (int i = 0; i < kHistItems; ++i) {
        const int m = m0 + i * kSelectThreads + tid;
        u[i] = m < n ? order_key(scores[m]) : 0u;
      }
#pragma unroll
      for (int i = 0; i < kHistItems; ++i) {
        const int m = m0 + i * kSelectThreads + tid;
        const int bin = m < n && (u[i] & mask) == prefix ? static_cast<int>((u[i] >> shift) & 0xff)
                                                         : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, bin);
        if (bin >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
      }
    }
    __syncthreads();
    if (tid == 0) {
      int above = 0, b = 255;
      for (; b > 0 && above + hist[b] < s_remaining; --b) above += hist[b];
      s_remaining -= above;
      s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
    }
    mask |= 0xffu << shift;
    __syncthreads();
  }
  const uint32_t tau = s_prefix;
  const int take_equal = s_remaining;

  // Candidates in increasing token index: every key above tau, the first take_equal equal to it.
  // A thread takes kSelectItems consecutive candidates of a chunk, so that a chunk of
  // kSelectItems * kSelectThreads candidates costs two block scans.
  int placed = 0, equal_seen = 0;
  constexpr int kChunk = kSelectItems * kSelectThreads;
  for (int c0 = 0; c0 < n; c0 += kChunk) {
    const int first = c0 + tid * kSelectItems;
    uint32_t u[kSelectItems];
    int eq = 0;
#pragma unroll
    for (int i = 0; i < kSelectItems; ++i) {
      u[i] = first + i < n ? order_key(scores[first + i]) : 0u;
      eq += first + i < n && u[i] == tau ? 1 : 0;
    }
    int eq_rank = 0, eq_total = 0;
    Scan(scan).ExclusiveSum(eq, eq_rank, eq_total);
    __syncthreads();
    int sel = 0, eq_before = equal_seen + eq_rank;
    unsigned taken = 0;  // bit i: candidate first + i is selected
#pragma unroll
    for (int i = 0; i < kSelectItems; ++i) {
      const bool in = first + i < n;
      const bool is_eq = in && u[i] == tau;
      if (in && (u[i] > tau || (is_eq && eq_before < take_equal))) {
        taken |= 1u << i;
        ++sel;
      }
      eq_before += is_eq ? 1 : 0;
    }
    int pos = 0, sel_total = 0;
    Scan(scan).ExclusiveSum(sel, pos, sel_total);
    __syncthreads();
    for (int i = 0; taken != 0; ++i, taken >>= 1) {
      if ((taken & 1u) == 0) continue;
      const int32_t j = candidate(p, req, tok.t, first + i);
      slots[placed + pos] = static_cast<int32_t>(slot_of(p, req, j));
      if (out != nullptr) out[(placed + pos) * p.topk_s1] = j;
      ++pos;
    }
    placed += sel_total;
    equal_seen += eq_total;
  }
}

// CTAs per scored token of a score launch that has `passes` passes of candidates per token at
// most: all of them in an eager launch (one pass each); in a graph step, whose bound is the
// longest context, no more than make about kGraphScoreCtas CTAs in all (each then loops over
// every gridDim.y-th pass), so that a replay of short contexts does not pay for a grid of empty
// CTAs sized for max_context_len.
int64_t score_ctas_y(const DsaParams& p, int64_t passes) {
  if (p.num_scored_dev == nullptr) return passes;
  return std::clamp<int64_t>((kGraphScoreCtas + p.num_scored - 1) / p.num_scored, 1, passes);
}

cudaError_t launch_score_cuda_core(const DsaParams& p, cudaStream_t stream) {
  const size_t smem =
      (static_cast<size_t>(p.heads) * p.dim + static_cast<size_t>(kScoreCands) * (p.dim + 4)) *
          sizeof(float) +
      kScoreCands * sizeof(int64_t);
  static bool attr_set = false;
  if (!attr_set) {
    const size_t most = (static_cast<size_t>(kDsaMaxIndexHeads) * kDsaMaxIndexDim +
                         static_cast<size_t>(kScoreCands) * (kDsaMaxIndexDim + 4)) *
                            sizeof(float) +
                        kScoreCands * sizeof(int64_t);
    const cudaError_t e = cudaFuncSetAttribute(
        dsa_score_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(most));
    if (e != cudaSuccess) return e;
    attr_set = true;
  }
  const dim3 grid(
      static_cast<unsigned>(p.num_scored),
      static_cast<unsigned>(score_ctas_y(p, (p.max_cand + kScoreCands - 1) / kScoreCands)));
  dsa_score_kernel<<<grid, kScoreCands, smem, stream>>>(p);
  return cudaGetLastError();
}

// A CTA takes several tiles of a token (its queries staged once for all) when the launch has many.
cudaError_t launch_score_mma(const DsaParams& p, cudaStream_t stream) {
  static bool attr_set = false;
  if (!attr_set) {
    const cudaError_t e = cudaFuncSetAttribute(
        dsa_score_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(mma_smem_bytes(kDsaMaxIndexHeads, kDsaMaxIndexDim, kMmaMaxTiles)));
    if (e != cudaSuccess) return e;
    attr_set = true;
  }
  const int64_t token_tiles = (p.max_cand + kMmaCands - 1) / kMmaCands;
  const int tiles = static_cast<int>(
      std::clamp<int64_t>(int64_t{p.num_scored} * token_tiles / kMmaTilesPerCta, 1, kMmaMaxTiles));
  const dim3 grid(static_cast<unsigned>(p.num_scored),
                  static_cast<unsigned>(score_ctas_y(p, (token_tiles + tiles - 1) / tiles)));
  dsa_score_mma_kernel<<<grid, kMmaCands, mma_smem_bytes(p.heads, p.dim, tiles), stream>>>(p,
                                                                                           tiles);
  return cudaGetLastError();
}

}  // namespace

DsaIndexer dsa_indexer() {
  if (g_indexer < 0) {
    const char* v = std::getenv("ATTNRT_DSA_INDEXER");
    g_indexer = static_cast<int>(
        v != nullptr && std::string_view(v) == "cuda_core" ? DsaIndexer::cuda_core : DsaIndexer::mma);
  }
  return static_cast<DsaIndexer>(g_indexer);
}

void set_dsa_indexer(DsaIndexer k) { g_indexer = static_cast<int>(k); }

bool dsa_mma_takes(int heads, int dim) {
  return heads > 0 && heads % 16 == 0 && heads <= kDsaMaxIndexHeads && dim > 0 && dim % 16 == 0 &&
         dim <= kDsaMaxIndexDim;
}

cudaError_t launch_dsa_select(const DsaParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.dim <= 0 || p.dim % 4 != 0 || p.dim > kDsaMaxIndexDim || p.heads <= 0 ||
      p.heads > kDsaMaxIndexHeads || p.topk <= 0 || p.num_tokens > INT32_MAX)
    return cudaErrorInvalidValue;
  if (p.num_scored > 0) {
    const cudaError_t e = dsa_indexer() == DsaIndexer::mma && dsa_mma_takes(p.heads, p.dim)
                              ? launch_score_mma(p, stream)
                              : launch_score_cuda_core(p, stream);
    if (e != cudaSuccess) return e;
  }
  dsa_select_kernel<<<static_cast<unsigned>(p.num_tokens), kSelectThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attnrt::cuda
