// The split-KV merge and the KV-store kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/merge_limits.h"

namespace attnrt::cuda {

namespace {

// One block per (request, q head, slice of the head dims: gridDim.z slices, launch_merge's
// choice). The split lse values are read in parallel into shared memory (a request may have 128
// splits: reading them one after another would serialise 128 memory latencies); then the block's
// threads form kMergeThreads / (slice / 4) groups, each summing every group-th split over the
// slice's dims (4 per thread), and the groups are added through shared memory in a fixed order
// (slices wider than 4 * kMergeThreads dims take several passes). Slices keep several splits' loads
// in flight per thread where a request has many splits: with one block over MLA's 512 dims, each
// thread walked all of a request's splits one 16-byte load after another (one request of 16
// heads: 16 blocks on 132 SMs).
// Splits whose lse is -inf (no visible key) get weight 0. Launched as the dependent of the
// attention kernel, it reads the request before its wait (plan data, complete before the step's
// first kernel), everything else after it (the attention kernel's output); every CTA waits, those
// of unsplit requests too, so that the merge's completion implies the attention kernel's. After
// the wait a thread issues its partial rows' loads together with the lse loads, so the two sit in
// one memory round trip instead of two (the weights need the block's maximum first).
constexpr int kMergeThreads = 128;
// The most splits a thread walks: launch_merge slices the head dims so that enough groups share
// each 4-dim vector (H100: 128 splits at MLA's 512 dims 1.15-1.17x faster in 4 slices, each
// thread then walking 32 splits; 64 requests of a few splits 3% slower in slices, so requests of
// at most kMergeWalk splits keep one). The walk's loads are unrolled by as many.
constexpr int kMergeWalk = 8;

template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const MergeParams p) {
  // The block's slice (nothing here is the attention kernel's output: before the wait).
  const int slice_vecs = (p.head_dim / 4 + gridDim.z - 1) / gridDim.z;
  const int v_begin = blockIdx.z * slice_vecs;
  const int all_vecs = min(p.head_dim / 4, v_begin + slice_vecs);
  const int vecs = min(all_vecs - v_begin, kMergeThreads);
  const ReqInfo r = p.reqs[blockIdx.x];
  grid_dependency_wait();
  if (r.num_splits <= 1) return;
  const int h = blockIdx.y;
  const int S = min(r.num_splits, kMergeMaxSplits);
  __shared__ float w_s[kMergeMaxSplits];
  __shared__ float red[kMergeThreads / 32];
  __shared__ float stat[2];
  __shared__ float4 part_s[kMergeThreads];
  if (vecs <= 0) return;
  const int groups = kMergeThreads / vecs;
  const int grp = threadIdx.x / vecs, vi = threadIdx.x % vecs;
  // Partial row s of token t, this thread's 4 dims vv * 4 of head h.
  auto part_at = [&](int s, int t, int vv) {
    const int64_t prow = r.part_start + static_cast<int64_t>(s) * r.qlen + t;
    return *reinterpret_cast<const float4*>(p.part_o + (prow * p.num_q_heads + h) * p.head_dim +
                                            vv * 4);
  };
  const bool walks = grp < groups && v_begin + vi < all_vecs;
  for (int t = 0; t < r.qlen; ++t) {
    // The first pass's first kMergeWalk partials of this thread (every one where launch_merge
    // sliced the dims), loaded beside the lse.
    float4 ahead[kMergeWalk];
#pragma unroll
    for (int k = 0; k < kMergeWalk; ++k) {
      const int s = grp + k * groups;
      ahead[k] = walks && s < S ? part_at(s, t, v_begin + vi) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float lse = -INFINITY;
    if (threadIdx.x < S) {
      const int64_t prow = r.part_start + static_cast<int64_t>(threadIdx.x) * r.qlen + t;
      lse = p.part_lse[prow * p.num_q_heads + h];
    }
    float m = lse;
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      float M = red[0];
      for (int i = 1; i < kMergeThreads / 32; ++i) M = fmaxf(M, red[i]);
      stat[0] = M == -INFINITY ? 0.f : M;
    }
    __syncthreads();
    const float m_use = stat[0];
    // The weights, and their sum over the block's warps (red is free again: thread 0 read the
    // maxima before the barrier above), instead of thread 0 adding up to 128 of them in turn.
    const float wgt = lse == -INFINITY ? 0.f : exp2f(lse - m_use);
    if (threadIdx.x < S) w_s[threadIdx.x] = wgt;
    float wsum = threadIdx.x < S ? wgt : 0.f;
    for (int o = 16; o > 0; o >>= 1) wsum += __shfl_xor_sync(0xffffffff, wsum, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = wsum;
    __syncthreads();
    if (threadIdx.x == 0) {
      float den = 0.f;
      for (int i = 0; i < kMergeThreads / 32; ++i) den += red[i];
      if (p.sinks) den += exp2f(p.sinks[h] * kLog2e - m_use);
      stat[1] = den;
    }
    const int64_t row = r.qo_start + t;
    for (int v0 = v_begin; v0 < all_vecs; v0 += vecs) {
      const int vv = v0 + vi;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      if (grp < groups && vv < all_vecs) {
        // The same sum, in the same order, as one walk over s = grp, grp + groups, ..
        const bool first = v0 == v_begin;
        int s = grp;
        if (first) {
#pragma unroll
          for (int k = 0; k < kMergeWalk; ++k, s += groups) {
            if (s < S) {
              const float w = w_s[s];
              acc.x += w * ahead[k].x;
              acc.y += w * ahead[k].y;
              acc.z += w * ahead[k].z;
              acc.w += w * ahead[k].w;
            }
          }
        }
#pragma unroll kMergeWalk
        for (; s < S; s += groups) {
          const float w = w_s[s];
          const float4 o = part_at(s, t, vv);
          acc.x += w * o.x;
          acc.y += w * o.y;
          acc.z += w * o.z;
          acc.w += w * o.w;
        }
      }
      part_s[threadIdx.x] = acc;
      __syncthreads();
      const float den = stat[1];
      const float inv = den > 0.f ? p.v_scale / den : 0.f;
      if (threadIdx.x < vecs && v0 + threadIdx.x < all_vecs) {
        float4 sum = part_s[threadIdx.x];
        for (int gi = 1; gi < groups; ++gi) {
          const float4 x = part_s[gi * vecs + threadIdx.x];
          sum.x += x.x;
          sum.y += x.y;
          sum.z += x.z;
          sum.w += x.w;
        }
        const float vals[4] = {sum.x, sum.y, sum.z, sum.w};
        T* dst = static_cast<T*>(p.out) + row * p.o_stride_tok + h * p.o_stride_head + vv * 4;
        for (int i = 0; i < 4; ++i) dst[i] = from_float<T>(vals[i] * inv);
      }
      __syncthreads();  // part_s is rewritten by the next pass
    }
    const float den = stat[1];
    if (p.lse_out && threadIdx.x == 0 && blockIdx.z == 0)
      p.lse_out[row * p.lse_stride_tok + h] = den > 0.f ? (m_use + log2f(den)) * kLn2 : -INFINITY;
    __syncthreads();
  }
}

// One block per token; threads stride over heads x dims. The next store or the attention kernel
// may be scheduled at once: before their waits they touch nothing this kernel reads or writes. A
// V store launched as the dependent of the K store (launch_store_kv's `dependent`) reads the V
// rows and the slots, complete before the K store was launched, and writes the V pool, which the
// K store does not touch; so it stores first and waits last: then its completion implies the K
// store's, which is what the attention kernel's wait (for the grid just before it) relies on.
__global__ void store_kv_kernel(const StoreParams p) {
  launch_dependent_grids();
  const int64_t t = blockIdx.x;
  const int64_t slot = p.loc[t];
  // A negative slot is a token stored nowhere (a DCP rank's query that is no key there).
  const int n = slot >= 0 ? p.heads * p.dim : 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / p.dim, d = i % p.dim;
    // Stored = round(x / scale) with a true division, bit-identical to the host pools.
    const float x =
        load_elem(p.src, p.src_dtype, t * p.src_stride_tok + h * p.src_stride_head + d) / p.scale;
    const int64_t j = slot * p.dst_row_stride + i;
    if (p.dst_dtype == kE4M3 || p.dst_dtype == kE5M2) {
      static_cast<uint8_t*>(p.dst)[j] = float_to_fp8(x, p.dst_dtype == kE5M2);
    } else {
      store_elem(p.dst, p.dst_dtype, j, x);
    }
  }
  grid_dependency_wait();
}

// The same store for 16-bit sources whose rows are 16-byte vectors: one thread per 8 elements (a
// y block of the grid per 128 vectors of a token), so every thread issues its slot and source
// loads together and stores once -- the loop above waits for a load before each store (up to
// heads x dim / 128 round trips per token: ~7 us for one decode token of 8 x 128 on the H200).
// Same arithmetic per element (round(x / scale)), so the stored bits are those of the loop.
constexpr int kStoreVec = 8;
constexpr int kStoreThreads = 128;

__global__ void __launch_bounds__(kStoreThreads) store_kv_vec_kernel(const StoreParams p) {
  launch_dependent_grids();
  const int64_t t = blockIdx.x;
  const int v = blockIdx.y * kStoreThreads + threadIdx.x;  // vector of the token's row
  const int per_head = p.dim / kStoreVec;
  const int64_t slot = p.loc[t];
  if (v < p.heads * per_head && slot >= 0) {  // slot < 0: stored nowhere (see store_kv_kernel)
    const int h = v / per_head, d = (v - h * per_head) * kStoreVec;
    const uint4 raw = *reinterpret_cast<const uint4*>(
        static_cast<const uint16_t*>(p.src) + t * p.src_stride_tok + h * p.src_stride_head + d);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    float x[kStoreVec];
#pragma unroll
    for (int e = 0; e < kStoreVec; ++e) {
      const uint16_t bits = static_cast<uint16_t>(w[e / 2] >> (16 * (e % 2)));
      x[e] = p.src_dtype == kBF16 ? __bfloat162float(__ushort_as_bfloat16(bits))
                                  : __half2float(__ushort_as_half(bits));
    }
    const int64_t i = slot * p.dst_row_stride + int64_t{h} * p.dim + d;
    if (p.dst_dtype == kE4M3 || p.dst_dtype == kE5M2) {
      const bool e5m2 = p.dst_dtype != kE4M3;
      uint32_t q[2] = {0, 0};
#pragma unroll
      for (int e = 0; e < kStoreVec; ++e)
        q[e / 4] |= uint32_t{float_to_fp8(x[e] / p.scale, e5m2)} << (8 * (e % 4));
      *reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.dst) + i) = make_uint2(q[0], q[1]);
    } else if (p.dst_dtype == kF32) {
      float4* dst = reinterpret_cast<float4*>(static_cast<float*>(p.dst) + i);
      dst[0] = make_float4(x[0] / p.scale, x[1] / p.scale, x[2] / p.scale, x[3] / p.scale);
      dst[1] = make_float4(x[4] / p.scale, x[5] / p.scale, x[6] / p.scale, x[7] / p.scale);
    } else {
      uint32_t o[4];
#pragma unroll
      for (int e = 0; e < kStoreVec; e += 2) {
        const float a = x[e] / p.scale, b = x[e + 1] / p.scale;
        const uint16_t lo = p.dst_dtype == kBF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(a))
                                                 : __half_as_ushort(__float2half_rn(a));
        const uint16_t hi = p.dst_dtype == kBF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(b))
                                                 : __half_as_ushort(__float2half_rn(b));
        o[e / 2] = uint32_t{lo} | (uint32_t{hi} << 16);
      }
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.dst) + i) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  grid_dependency_wait();
}

// Whether store_kv_vec_kernel takes the store: 16-bit source rows of whole, aligned vectors and a
// destination whose rows keep the vectors aligned.
bool store_vec_fits(const StoreParams& p) {
  const bool src16 = p.src_dtype == kBF16 || p.src_dtype == kF16;
  const int64_t dst_elem = p.dst_dtype == kF32 ? 4 : (p.dst_dtype == kE4M3 || p.dst_dtype == kE5M2) ? 1 : 2;
  const int64_t dst_align = dst_elem * kStoreVec;  // bytes of one stored vector
  return src16 && p.dim % kStoreVec == 0 && p.src_stride_head % kStoreVec == 0 &&
         p.src_stride_tok % kStoreVec == 0 && reinterpret_cast<uintptr_t>(p.src) % 16 == 0 &&
         (p.dst_row_stride * dst_elem) % dst_align == 0 &&
         reinterpret_cast<uintptr_t>(p.dst) % dst_align == 0;
}

}  // namespace

cudaError_t launch_merge(const MergeParams& p, bool fp16, cudaStream_t stream, bool dependent) {
  if (p.num_reqs == 0) return cudaSuccess;
  if (p.head_dim <= 0 || p.head_dim % 4 != 0) return cudaErrorInvalidValue;
  // groups threads a 4-dim vector, so that each walks at most kMergeWalk splits; a slice is then
  // the vectors of kMergeThreads / groups threads (128 splits: 16 groups, slices of 32 dims).
  int slices = 1;
  if (p.max_splits > kMergeWalk) {
    const int groups = std::min((p.max_splits + kMergeWalk - 1) / kMergeWalk, kMergeThreads);
    const int slice_vecs = kMergeThreads / groups;
    slices = (p.head_dim / 4 + slice_vecs - 1) / slice_vecs;
  }
  const dim3 grid(p.num_reqs, p.num_q_heads, slices);
  return fp16 ? launch_kernel(merge_kernel<__half>, grid, dim3(kMergeThreads), 0, stream, dependent,
                              p)
              : launch_kernel(merge_kernel<__nv_bfloat16>, grid, dim3(kMergeThreads), 0, stream,
                              dependent, p);
}

cudaError_t launch_store_kv(const StoreParams& p, cudaStream_t stream, bool dependent) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (store_vec_fits(p)) {
    const int vecs = p.heads * (p.dim / kStoreVec);
    const dim3 grid(static_cast<unsigned>(p.num_tokens),
                    static_cast<unsigned>((vecs + kStoreThreads - 1) / kStoreThreads));
    return launch_kernel(store_kv_vec_kernel, grid, dim3(kStoreThreads), 0, stream, dependent, p);
  }
  return launch_kernel(store_kv_kernel, dim3(static_cast<unsigned>(p.num_tokens)), dim3(128), 0,
                       stream, dependent, p);
}

}  // namespace attnrt::cuda
