#include "backends/cuda/cuda_util.h"

#include <algorithm>

#include "attnrt/core/fault_injection.h"

namespace attnrt::cuda {

void DeviceBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_) return;
  fault_point(FaultSite::device_alloc, "DeviceBuffer::reserve");
  release();
  const size_t want = std::max<size_t>(bytes, 256);
  ATTNRT_CUDA_CHECK(cudaMalloc(&ptr_, want));
  bytes_ = want;
}

void DeviceBuffer::reserve_async(size_t bytes, cudaStream_t stream) {
  if (bytes <= bytes_) return;
  fault_point(FaultSite::device_alloc, "DeviceBuffer::reserve_async");
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
  for (Mark& m : marks_) {
    if (m.event != nullptr) cudaEventDestroy(m.event);
  }
}

void StagingRing::wait_copy(uint64_t seq, cudaStream_t stream) {
  if (seq <= completed_) return;
  // The oldest mark at or after `seq`; without one (copies since the last mark), mark now.
  Mark* best = nullptr;
  for (Mark& m : marks_) {
    if (m.event != nullptr && m.seq >= seq && (best == nullptr || m.seq < best->seq)) best = &m;
  }
  if (best == nullptr) {
    best = &marks_[next_mark_];
    next_mark_ = (next_mark_ + 1) % static_cast<int>(marks_.size());
    if (best->event == nullptr)
      ATTNRT_CUDA_CHECK(cudaEventCreateWithFlags(&best->event, cudaEventDisableTiming));
    ATTNRT_CUDA_CHECK(cudaEventRecord(best->event, stream));
    best->seq = copies_;
  }
  ATTNRT_CUDA_CHECK(cudaEventSynchronize(best->event));
  completed_ = std::max(completed_, best->seq);
}

void* StagingRing::acquire(size_t bytes, cudaStream_t stream, bool capturing) {
  current_ = (current_ + 1) % kSlots;
  Slot& s = slots_[current_];
  if (s.copy_seq != 0 && !capturing) wait_copy(s.copy_seq, stream);
  return reserve(bytes, capturing);
}

void* StagingRing::reserve(size_t bytes, bool capturing) {
  Slot& s = slots_[current_];
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

void StagingRing::upload(void* device_dst, size_t bytes, cudaStream_t stream, bool capturing) {
  Slot& s = slots_[current_];
  if (bytes == 0) return;
  ATTNRT_CUDA_CHECK(
      cudaMemcpyAsync(device_dst, s.buf.data(), bytes, cudaMemcpyHostToDevice, stream));
  mark_copy(stream, capturing);
}

void StagingRing::upload_rows(void* device_dst, size_t dst_pitch, size_t row_bytes, size_t rows,
                              cudaStream_t stream) {
  Slot& s = slots_[current_];
  if (row_bytes == 0 || rows == 0) return;
  ATTNRT_CUDA_CHECK(cudaMemcpy2DAsync(device_dst, dst_pitch, s.buf.data(), row_bytes, row_bytes,
                                      rows, cudaMemcpyHostToDevice, stream));
  mark_copy(stream, stream_is_capturing(stream));
}

void StagingRing::mark_copy(cudaStream_t stream, bool capturing) {
  if (capturing) return;
  Slot& s = slots_[current_];
  s.copy_seq = ++copies_;
  if (copies_ % kGroup == 0) {
    Mark& m = marks_[next_mark_];
    next_mark_ = (next_mark_ + 1) % static_cast<int>(marks_.size());
    if (m.event == nullptr)
      ATTNRT_CUDA_CHECK(cudaEventCreateWithFlags(&m.event, cudaEventDisableTiming));
    ATTNRT_CUDA_CHECK(cudaEventRecord(m.event, stream));
    m.seq = copies_;
  }
}

void order_after(cudaStream_t waiter, cudaStream_t producer) {
  if (waiter == producer) return;
  cudaEvent_t done = nullptr;
  ATTNRT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(done, producer);
  const cudaError_t waited =
      recorded == cudaSuccess ? cudaStreamWaitEvent(waiter, done, 0) : recorded;
  cudaEventDestroy(done);  // released once the wait is satisfied
  ATTNRT_CUDA_CHECK(waited);
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  ATTNRT_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace attnrt::cuda
