// Row gather / scatter between device buffers: K/V rows moved inside a pool (accepted tree paths
// after a verify) and rows of a pool gathered for a download; the scatter of a step's SWA write
// slots into the device full->SWA map.
#include <cstdint>

#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

namespace {

constexpr int kCopyThreads = 128;

// One block per row; 16-byte words when every row start is 16-byte aligned, else bytes.
template <typename Word>
__global__ void copy_rows_kernel(const CopyRowsParams p) {
  const int64_t i = blockIdx.x;
  const int64_t s = p.src_rows != nullptr ? p.src_rows[i] : i;
  const int64_t d = p.dst_rows != nullptr ? p.dst_rows[i] : i;
  const Word* src =
      reinterpret_cast<const Word*>(static_cast<const char*>(p.src) + s * p.src_stride);
  Word* dst = reinterpret_cast<Word*>(static_cast<char*>(p.dst) + d * p.dst_stride);
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) dst[w] = src[w];
}

__global__ void scatter_slots_kernel(int64_t* map, const int64_t* index, const int64_t* value,
                                     int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count && index[i] >= 0) map[index[i]] = value[i];  // < 0: a token stored nowhere
}

bool aligned16(const void* p, int64_t stride) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && stride % 16 == 0;
}

}  // namespace

cudaError_t launch_copy_rows(const CopyRowsParams& p, cudaStream_t stream) {
  if (p.count == 0 || p.row_bytes == 0) return cudaSuccess;
  if (p.count > INT32_MAX || p.row_bytes < 0) return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>(p.count);
  if (p.row_bytes % 16 == 0 && aligned16(p.src, p.src_stride) && aligned16(p.dst, p.dst_stride)) {
    copy_rows_kernel<uint4><<<blocks, kCopyThreads, 0, stream>>>(p);
  } else {
    copy_rows_kernel<unsigned char><<<blocks, kCopyThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t launch_scatter_slots(int64_t* map, const int64_t* index, const int64_t* value,
                                 int64_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (count < 0 || count > INT32_MAX) return cudaErrorInvalidValue;
  const auto blocks = static_cast<unsigned>((count + kCopyThreads - 1) / kCopyThreads);
  scatter_slots_kernel<<<blocks, kCopyThreads, 0, stream>>>(map, index, value, count);
  return cudaGetLastError();
}

}  // namespace attnrt::cuda
