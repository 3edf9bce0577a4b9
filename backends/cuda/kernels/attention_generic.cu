// The generic-dims attention kernel (see attention_generic.h). One CTA per (KV head, work item)
// like the tensor-core kernel; each warp takes one query row at a time: lane j scores key j of a
// 32-key block (its whole K row against the row's q in shared memory), the warp updates the online
// softmax state, then every lane accumulates its own 8-dim chunks of V over the block's keys.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "backends/cuda/kernels/attention_generic.h"
#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/paged_kv.cuh"

namespace attnrt::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kLaneChunks = (kGenericMaxDim / 8 + 31) / 32;  // 8-dim V chunks per lane
// Split-KV chunks are rounded to this many keys (any value partitions the keys consistently: every
// CTA of a request derives the same ranges).
constexpr int kSplitKeys = 32;

// Eight stored K/V elements from element index e (a multiple of 8) as floats: 16-bit KV of the
// activation type, or fp8 bytes (the scales are applied by the caller).
template <typename T>
__device__ __forceinline__ void load8(const void* base, int64_t e, KvKind kind, float (&x)[8]) {
  if (kind == KvKind::same_as_q) {
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(base) + e);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = to_float(v[i]);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(base) + e);
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
    const bool e5m2 = kind == KvKind::e5m2;
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = fp8_to_float(b[i], e5m2);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    generic_attention_kernel(const AttnParams p, const int D, const int Dv, const int rows) {
  __shared__ float sQ[kWarps][kGenericMaxDim];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kvh = blockIdx.x;
  const WorkItem item = p.work[blockIdx.y];
  const ReqInfo req = p.reqs[item.req];
  // A padded item of a batch-invariant graph step (GraphLayout::det_splits): nothing to do.
  if (item.split >= req.num_splits) return;
  const int G = p.group;

  write_back_committed_pages(p, req, item, kvh, threadIdx.x, kThreads);

  const int t_first = item.f0 / G;
  const int t_last = min(req.qlen - 1, (item.f0 + rows - 1) / G);
  const Mask<true> mask{p, req};
  const KeyRange kr = split_range(mask, t_first, t_last, item.split, kSplitKeys);
  const SoftCap cap(p.softcap, p.softmax_scale);
  const int page_mask = (1 << p.page_shift) - 1;
  const int dch = D / 8, vch = Dv / 8;
  const bool split = req.num_splits > 1;
  float* q_s = sQ[warp];

  for (int r = warp; r < rows; r += kWarps) {
    const int f = item.f0 + r, t = f / G, hg = f % G;
    if (t >= req.qlen) break;
    const int head = kvh * G + hg;
    const T* q = static_cast<const T*>(p.q) + (req.qo_start + t) * p.q_stride_tok +
                 head * p.q_stride_head;
    for (int d = lane; d < D; d += 32) q_s[d] = to_float(q[d]);
    __syncwarp();

    // The row's own key range inside the split: causal rows stop at themselves, windowed rows
    // start at their window.
    const MaskRow row = mask.row(t);
    const KeyRange rk = mask.row_span(row, t);
    const int lo = max(kr.lo, rk.lo), hi = min(kr.hi, rk.hi);

    float m = -INFINITY, l = 0.f;
    float acc[kLaneChunks][8];
#pragma unroll
    for (int i = 0; i < kLaneChunks; ++i) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[i][e] = 0.f;
    }
    for (int j0 = lo; j0 < hi; j0 += 32) {
      const int j = j0 + lane;
      float s = -INFINITY;
      int64_t slot = -1;
      if (mask.visible(row, j, hi)) {
        slot = slot_of_page(p, page_mask, page_id(p, req, j >> p.page_shift), j);
        const int64_t base = slot * p.k_row_stride + static_cast<int64_t>(kvh) * D;
        float dot = 0.f;
        for (int c = 0; c < dch; ++c) {
          float k8[8];
          load8<T>(p.k, base + c * 8, p.kv_kind, k8);
#pragma unroll
          for (int e = 0; e < 8; ++e) dot += q_s[c * 8 + e] * k8[e];
        }
        s = cap.on ? cap(dot) : dot * p.scale_log2;
      }
      float mx = s;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
      const float m_new = fmaxf(m, mx);
      if (m_new == -INFINITY) continue;  // nothing visible yet (the same for the whole warp)
      const float alpha = exp2f(m - m_new);
      const float pj = s == -INFINITY ? 0.f : exp2f(s - m_new);
      float sum = pj;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
      l = l * alpha + sum;
      m = m_new;
#pragma unroll
      for (int i = 0; i < kLaneChunks; ++i) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e] *= alpha;
      }
      const int n = min(32, hi - j0);
      for (int jj = 0; jj < n; ++jj) {
        const float pw = __shfl_sync(0xffffffff, pj, jj);
        const int64_t sl = __shfl_sync(0xffffffff, slot, jj);
        if (pw == 0.f) continue;
        const int64_t vbase = sl * p.v_row_stride + static_cast<int64_t>(kvh) * Dv;
#pragma unroll
        for (int i = 0; i < kLaneChunks; ++i) {
          const int c = lane + 32 * i;
          if (c < vch) {
            float v8[8];
            load8<T>(p.v, vbase + c * 8, p.kv_kind, v8);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[i][e] += pw * v8[e];
          }
        }
      }
    }

    if (split) {
      const int64_t prow = req.part_start + static_cast<int64_t>(item.split) * req.qlen + t;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      float* dst = p.part_o + (prow * p.num_q_heads + head) * Dv;
#pragma unroll
      for (int i = 0; i < kLaneChunks; ++i) {
        const int c = lane + 32 * i;
        if (c < vch) {
#pragma unroll
          for (int e = 0; e < 8; ++e) dst[c * 8 + e] = acc[i][e] * inv;
        }
      }
      if (lane == 0) p.part_lse[prow * p.num_q_heads + head] = l > 0.f ? m + log2f(l) : -INFINITY;
    } else {
      float den = l;
      if (p.sinks) den += exp2f(p.sinks[head] * kLog2e - (m == -INFINITY ? 0.f : m));
      const float inv = den > 0.f ? p.v_scale / den : 0.f;
      T* dst = static_cast<T*>(p.out) + (req.qo_start + t) * p.o_stride_tok +
               head * p.o_stride_head;
#pragma unroll
      for (int i = 0; i < kLaneChunks; ++i) {
        const int c = lane + 32 * i;
        if (c < vch) {
#pragma unroll
          for (int e = 0; e < 8; ++e) dst[c * 8 + e] = from_float<T>(acc[i][e] * inv);
        }
      }
      if (p.lse_out && lane == 0)
        p.lse_out[(req.qo_start + t) * p.lse_stride_tok + head] = (m + log2f(den)) * kLn2;
    }
    __syncwarp();  // q_s is rewritten by the next row
  }
}

template <typename T>
struct GenericCta {
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey& k, int num_items,
                            cudaStream_t stream, bool) {
    if (k.head_dim <= 0 || k.v_head_dim <= 0 || k.head_dim % 8 != 0 || k.v_head_dim % 8 != 0 ||
        k.head_dim > kGenericMaxDim || k.v_head_dim > kGenericMaxDim)
      return cudaErrorInvalidValue;
    const dim3 grid(p.num_kv_heads, num_items);
    generic_attention_kernel<T>
        <<<grid, kThreads, 0, stream>>>(p, k.head_dim, k.v_head_dim, tile_rows(k.shape));
    return cudaGetLastError();
  }
  static int occupancy(const AttnKernelKey&) {
    return resident_ctas<generic_attention_kernel<T>>(kThreads, 0);
  }
};

}  // namespace

AttnCtaEntry attention_generic_entry(bool fp16) {
  return fp16 ? AttnCtaEntry{&GenericCta<__half>::launch, &GenericCta<__half>::occupancy}
              : AttnCtaEntry{&GenericCta<__nv_bfloat16>::launch,
                             &GenericCta<__nv_bfloat16>::occupancy};
}

}  // namespace attnrt::cuda
