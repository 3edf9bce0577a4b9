// A read-only sweep over a device buffer, which evicts the L2 without dirtying it; and a read-only
// gather of rows at given slots (the ceiling of page-1 reads).
#include "backends/cuda/kernels/l2_evict.h"

namespace attnrt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kCtasPerSm = 4;
constexpr int kUnroll = 4;  // independent loads in flight per thread

// Loads every 16-byte word through the L2 (ld.global.cg: no L1 allocation). The folded words keep
// the loads alive: the store happens only if (acc | 1) equals `impossible`, a value known only at
// run time, which the launcher passes as 0.
__global__ void __launch_bounds__(kThreads)
    read_all_kernel(const uint4* __restrict__ p, size_t n, uint32_t impossible, uint32_t* sink) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcg(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if ((acc | 1u) == impossible) *sink = acc;
}

// One warp a row: lane c reads chunks c, c + 32, ... of row slots[r]; the next row's slot is loaded
// one row ahead, so a warp waits on one DRAM round trip per row, not two.
constexpr int kGatherThreads = 256;
constexpr int kGatherCtasPerSm = 8;  // 64 warps: every warp slot of an SM

__global__ void __launch_bounds__(kGatherThreads)
    gather_rows_kernel(const uint4* __restrict__ pool, const int32_t* __restrict__ slots,
                       int64_t n, int row_chunks, uint32_t impossible, uint32_t* sink) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t{gridDim.x} * (kGatherThreads / 32);
  int64_t r = int64_t{blockIdx.x} * (kGatherThreads / 32) + (threadIdx.x >> 5);
  uint32_t acc = 0;
  int32_t slot = r < n ? __ldcg(slots + r) : 0;
  for (; r < n; r += warps) {
    const int32_t next = r + warps < n ? __ldcg(slots + r + warps) : 0;
    const uint4* row = pool + int64_t{slot} * row_chunks;
    for (int c = lane; c < row_chunks; c += 32) {
      const uint4 v = __ldcg(row + c);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    slot = next;
  }
  if ((acc | 1u) == impossible) *sink = acc;
}

// The multiprocessors of the current device, both launchers' grid unit.
cudaError_t sm_count(int* sms) {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

}  // namespace

cudaError_t gather_rows_by_reading(const void* pool, const int32_t* slots, int64_t n,
                                   int row_bytes, uint32_t* sink, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(pool) % 16 != 0 || row_bytes <= 0 || row_bytes % 16 != 0 ||
      slots == nullptr || sink == nullptr || n < 0) {
    return cudaErrorInvalidValue;
  }
  int sms = 0;
  if (const cudaError_t err = sm_count(&sms); err != cudaSuccess) return err;
  gather_rows_kernel<<<kGatherCtasPerSm * sms, kGatherThreads, 0, s>>>(
      static_cast<const uint4*>(pool), slots, n, row_bytes / 16, 0u, sink);
  return cudaGetLastError();
}

cudaError_t evict_l2_by_reading(const void* buf, size_t bytes, uint32_t* sink, cudaStream_t s) {
  if (bytes == 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(buf) % 16 != 0 || bytes % 16 != 0 || sink == nullptr) {
    return cudaErrorInvalidValue;
  }
  int sms = 0;
  if (const cudaError_t err = sm_count(&sms); err != cudaSuccess) return err;
  read_all_kernel<<<kCtasPerSm * sms, kThreads, 0, s>>>(static_cast<const uint4*>(buf), bytes / 16,
                                                        0u, sink);
  return cudaGetLastError();
}

}  // namespace attnrt::cuda
