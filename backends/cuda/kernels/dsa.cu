// DSA's indexer on the GPU (dsa.h; docs/dsa.md "The index score", "The selection").
//
// Scores: one CTA per (scored token, 128 candidates), a thread per candidate. The CTA rounds the
// token's index queries to fp8 as round_index_query does (per head: the power-of-two scale from
// the binary form of amax / 448, e4m3 codes read back), dequantises its candidates' keys from the
// paged cache into shared memory (codes times the slot's scale, both exact), and takes per head an
// fp32 dot product, across heads an fp64 sum of w_h * relu(dot), as the cpu backend does.
//
// Selection: one CTA per token. At most topk candidates: all of them. Otherwise a radix select on
// the scores as order-preserving uint32 keys (four 8-bit passes over a shared histogram) finds
// the topk-th largest key tau and how many keys equal to tau are taken; a pass over the
// candidates in increasing token index then takes every key above tau and the first of those
// equal to it (the tie rule: lower token index first), placing each by a block prefix count, so
// the slots come out in increasing token index.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/dsa.h"

namespace attnrt::cuda {

namespace {

constexpr int kScoreCands = 128;  // candidates (threads) of a score CTA
constexpr int kSelectThreads = 512;
constexpr float kE4m3Max = 448.f;

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

__global__ void __launch_bounds__(kScoreCands) dsa_score_kernel(const DsaParams p) {
  extern __shared__ float smem[];
  const int row = p.scored[blockIdx.x];
  const DsaToken tok = p.tokens[row];
  const int32_t m0 = static_cast<int32_t>(blockIdx.y) * kScoreCands;
  if (m0 >= tok.num_cand) return;
  const ReqInfo req = p.reqs[tok.req];
  const int H = p.heads, D = p.dim, KS = D + 4;  // key rows padded: conflict-free float4 reads
  float* sq = smem;                              // [H][D] rounded queries
  float* sk = sq + H * D;                        // [kScoreCands][KS] dequantised keys
  int64_t* sslot = reinterpret_cast<int64_t*>(sk + kScoreCands * KS);  // [kScoreCands]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // The rounded index queries, a warp per head.
  for (int h = warp; h < H; h += kScoreCands / 32) {
    const int64_t base = row * p.q_s0 + h * p.q_s1;
    float amax = 1e-4f;
    for (int d = lane; d < D; d += 32)
      amax = fmaxf(amax, fabsf(load_elem(p.q, p.q_dtype, base + d * p.q_s2)));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    int e = 0;
    const float mant = frexpf(amax / kE4m3Max, &e);
    const float scale = ldexpf(1.f, mant == 0.5f ? e - 1 : e);
    for (int d = lane; d < D; d += 32) {
      const float x = load_elem(p.q, p.q_dtype, base + d * p.q_s2);
      sq[h * D + d] = fp8_to_float(float_to_fp8(x / scale, false), false) * scale;
    }
  }
  // The candidates' slots, then their keys (codes read as words: dim is a multiple of 4).
  const int32_t m = m0 + tid;
  const bool live = m < tok.num_cand;
  sslot[tid] = live ? slot_of(p, req, candidate(p, req, tok.t, m)) : -1;
  __syncthreads();
  const int words = D / 4;
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
  if (!live) return;

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
  p.scores[tok.score_off + m] = score == 0.f ? 0.f : score;
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
  const int tid = threadIdx.x, K = p.topk, n = tok.num_cand;
  int32_t* slots = p.sel_slots + row * K;
  int32_t* out = p.topk_out != nullptr ? p.topk_out + row * p.topk_s0 : nullptr;

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
  if (tid == 0) {
    s_prefix = 0;
    s_remaining = K;
  }
  uint32_t mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix;
    for (int m = tid; m < n; m += kSelectThreads) {
      const uint32_t u = order_key(scores[m]);
      if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 0xff], 1);
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
  int placed = 0, equal_seen = 0;
  for (int c0 = 0; c0 < n; c0 += kSelectThreads) {
    const int m = c0 + tid;
    const uint32_t u = m < n ? order_key(scores[m]) : 0u;
    const int eq = m < n && u == tau ? 1 : 0;
    int eq_rank = 0, eq_total = 0;
    Scan(scan).ExclusiveSum(eq, eq_rank, eq_total);
    __syncthreads();
    const int sel = m < n && (u > tau || (eq && equal_seen + eq_rank < take_equal)) ? 1 : 0;
    int pos = 0, sel_total = 0;
    Scan(scan).ExclusiveSum(sel, pos, sel_total);
    __syncthreads();
    if (sel) {
      const int32_t j = candidate(p, req, tok.t, m);
      slots[placed + pos] = static_cast<int32_t>(slot_of(p, req, j));
      if (out != nullptr) out[(placed + pos) * p.topk_s1] = j;
    }
    placed += sel_total;
    equal_seen += eq_total;
  }
}

}  // namespace

cudaError_t launch_dsa_select(const DsaParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.dim <= 0 || p.dim % 4 != 0 || p.dim > kDsaMaxIndexDim || p.heads <= 0 ||
      p.heads > kDsaMaxIndexHeads || p.topk <= 0 || p.num_tokens > INT32_MAX)
    return cudaErrorInvalidValue;
  if (p.num_scored > 0) {
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
    const dim3 grid(static_cast<unsigned>(p.num_scored),
                    static_cast<unsigned>((p.max_cand + kScoreCands - 1) / kScoreCands));
    dsa_score_kernel<<<grid, kScoreCands, smem, stream>>>(p);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  dsa_select_kernel<<<static_cast<unsigned>(p.num_tokens), kSelectThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attnrt::cuda
