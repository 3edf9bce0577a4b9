#include "backends/cuda/cuda_util.h"

#include <algorithm>

namespace attnrt::cuda {

void DeviceBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_) return;
  release();
  const size_t want = std::max<size_t>(bytes, 256);
  ATTNRT_CUDA_CHECK(cudaMalloc(&ptr_, want));
  bytes_ = want;
}

void DeviceBuffer::reserve_async(size_t bytes, cudaStream_t stream) {
  if (bytes <= bytes_) return;
  if (ptr_ != nullptr) ATTNRT_CUDA_CHECK(cudaFreeAsync(ptr_, stream));
  ptr_ = nullptr;
  bytes_ = 0;
  const size_t want = std::max<size_t>(bytes + bytes / 2, 4096);
  ATTNRT_CUDA_CHECK(cudaMallocAsync(&ptr_, want, stream));
  bytes_ = want;
}

void DeviceBuffer::release() {
  if (ptr_ != nullptr) cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

PinnedBuffer::~PinnedBuffer() {
  for (void* p : retired_) cudaFreeHost(p);
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
}

void PinnedBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_) return;
  const size_t want = std::max<size_t>({bytes, 2 * bytes_, 4096});
  void* fresh = nullptr;
  ATTNRT_CUDA_CHECK(cudaHostAlloc(&fresh, want, cudaHostAllocDefault));
  if (ptr_ != nullptr) retired_.push_back(ptr_);
  ptr_ = fresh;
  bytes_ = want;
}

StagingRing::~StagingRing() {
  for (Slot& s : slots_) {
    if (s.done != nullptr) cudaEventDestroy(s.done);
  }
}

void* StagingRing::acquire(size_t bytes, cudaStream_t stream) {
  current_ = (current_ + 1) % kSlots;
  Slot& s = slots_[current_];
  const bool capturing = stream_is_capturing(stream);
  if (s.pending && !capturing) {
    ATTNRT_CUDA_CHECK(cudaEventSynchronize(s.done));
    s.pending = false;
  }
  if (s.buf.bytes() < bytes) {
    // Pinned allocation is forbidden while a stream captures, so every slot grows together, on
    // the first eager step of a size: a captured step of the same size then finds room in any.
    ATTNRT_CHECK(!capturing,
                 "cuda backend: a step needs {} bytes of staging during CUDA-graph capture but the "
                 "staging buffers hold {}; run one eager step of this size before capturing",
                 bytes, s.buf.bytes());
    for (Slot& other : slots_) other.buf.reserve(bytes);
  }
  return s.buf.data();
}

void StagingRing::upload(void* device_dst, size_t bytes, cudaStream_t stream) {
  Slot& s = slots_[current_];
  if (bytes == 0) return;
  ATTNRT_CUDA_CHECK(
      cudaMemcpyAsync(device_dst, s.buf.data(), bytes, cudaMemcpyHostToDevice, stream));
  if (stream_is_capturing(stream)) return;
  if (s.done == nullptr) ATTNRT_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
  ATTNRT_CUDA_CHECK(cudaEventRecord(s.done, stream));
  s.pending = true;
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  ATTNRT_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace attnrt::cuda
