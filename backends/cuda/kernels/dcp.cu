// DCP kernels (kernels/dcp.h): gather, pack, merge. Memory-bound and small (a decode step's rows);
// one thread per element, nothing shared.
#include <cmath>

#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/dcp.h"

namespace attnrt::cuda {

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

__global__ void dcp_gather_kernel(const DcpGatherParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_row = int64_t{p.heads} * p.dim;
  if (i >= p.count * per_row) return;
  const int64_t e = i / per_row, h = (i % per_row) / p.dim, j = i % p.dim;
  const int64_t from = p.rows[e] * p.src_stride_tok + h * p.src_stride_head + j;
  if (p.dtype == kF32) {
    static_cast<float*>(p.dst)[i] = static_cast<const float*>(p.src)[from];
  } else {  // f16 and bf16: the same 16 bits
    static_cast<uint16_t*>(p.dst)[i] = static_cast<const uint16_t*>(p.src)[from];
  }
}

// The rank d of n whose head range [d*hq/n, (d+1)*hq/n) holds head h.
__device__ int head_owner(int h, int hq, int n) {
  int d = static_cast<int>((int64_t{h} * n) / hq);
  while (d > 0 && int64_t{d} * hq / n > h) --d;
  while (d + 1 < n && int64_t{d + 1} * hq / n <= h) ++d;
  return d;
}

__global__ void dcp_pack_kernel(const DcpPackParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packed = p.dv + 1;
  if (i >= p.tokens * p.hq * packed) return;
  const int64_t t = i / (p.hq * packed);
  const int h = static_cast<int>((i / packed) % p.hq);
  const int j = static_cast<int>(i % packed);
  const int d = head_owner(h, p.hq, p.ranks);
  const int h0 = static_cast<int>(int64_t{d} * p.hq / p.ranks);
  const int h1 = static_cast<int>(int64_t{d + 1} * p.hq / p.ranks);
  const int64_t at = p.tokens * h0 * packed + (t * (h1 - h0) + (h - h0)) * packed + j;
  const int64_t e = p.entry[t];
  float v;
  if (e < 0) {
    v = j == p.dv ? -INFINITY : 0.f;
  } else if (j == p.dv) {
    v = p.lse[e * p.hq + h];
  } else {
    v = load_elem(p.out, p.out_dtype, (e * p.hq + h) * p.dv + j);
  }
  p.send[at] = v;
}

// One thread per (row, head, output column): it reads the lse of every rank (a few floats) and
// its column of each, in rank order; column 0 writes the lse.
__global__ void dcp_merge_kernel(const DcpMergeParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.tokens * p.heads * p.dv) return;
  const int64_t t = i / (int64_t{p.heads} * p.dv);
  const int hh = static_cast<int>((i / p.dv) % p.heads);
  const int j = static_cast<int>(i % p.dv);
  const int h = p.h0 + hh;
  const int64_t packed = p.dv + 1;
  const int64_t block = p.tokens * p.heads * packed;
  const float* part = p.recv + (t * p.heads + hh) * packed;
  const bool sink = p.sinks != nullptr;
  double m = sink ? double{p.sinks[h]} : -INFINITY;
  for (int s = 0; s < p.ranks; ++s) m = fmax(m, double{part[s * block + p.dv]});
  const int64_t o = t * p.out_stride_tok + int64_t{h} * p.out_stride_head + j;
  float* lse = p.lse != nullptr && j == 0 ? p.lse + t * p.lse_stride_tok + h * p.lse_stride_head
                                          : nullptr;
  if (m == -INFINITY) {
    store_elem(p.out, p.out_dtype, o, 0.f);
    if (lse != nullptr) *lse = -INFINITY;
    return;
  }
  double den = sink ? exp(double{p.sinks[h]} - m) : 0.0, acc = 0.0;
  for (int s = 0; s < p.ranks; ++s) {
    const float l = part[s * block + p.dv];
    if (l == -INFINITY) continue;
    const double w = exp(double{l} - m);
    den += w;
    acc += w * part[s * block + j];
  }
  store_elem(p.out, p.out_dtype, o, static_cast<float>(acc / den));
  if (lse != nullptr) *lse = static_cast<float>(m + log(den));
}

}  // namespace

cudaError_t launch_dcp_gather(const DcpGatherParams& p, cudaStream_t stream) {
  const int64_t n = p.count * p.heads * p.dim;
  if (n == 0) return cudaSuccess;
  dcp_gather_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_dcp_pack(const DcpPackParams& p, cudaStream_t stream) {
  const int64_t n = p.tokens * p.hq * (p.dv + 1);
  if (n == 0) return cudaSuccess;
  dcp_pack_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_dcp_merge(const DcpMergeParams& p, cudaStream_t stream) {
  const int64_t n = p.tokens * p.heads * p.dv;
  if (n == 0) return cudaSuccess;
  dcp_merge_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attnrt::cuda
