// Host-side CUDA helpers for the cuda backend: error checks that raise attnrt::Error, owning device
// and pinned buffers, and the pinned staging ring the per-step uploads go through.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "attnrt/core/error.h"

namespace attnrt::cuda {

#define ATTNRT_CUDA_CHECK(expr)                                                            \
  do {                                                                                     \
    const cudaError_t attnrt_cuda_err_ = (expr);                                           \
    if (attnrt_cuda_err_ != cudaSuccess)                                                   \
      ::attnrt::fail("CUDA error in {} ({}:{}): {}", #expr, __FILE__, __LINE__,            \
                     cudaGetErrorString(attnrt_cuda_err_));                                \
  } while (0)

// Owning device allocation (cudaMalloc); grows by reallocation, never in a captured region.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { reserve(bytes); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  // Makes room for `bytes`; the old contents are dropped when it has to grow.
  void reserve(size_t bytes);
  // Same, stream-ordered (cudaMallocAsync / cudaFreeAsync): growing never waits for the GPU.
  void reserve_async(size_t bytes, cudaStream_t stream);
  void* data() const { return ptr_; }
  template <typename T>
  T* ptr() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void release();
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Pinned host memory (cudaHostAlloc) so that uploads are truly asynchronous.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void reserve(size_t bytes);
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  // Buffers replaced by a larger one; a copy enqueued earlier may still read them, so they live
  // until the owner is destroyed (growth is geometric, so this stays small).
  std::vector<void*> retired_;
};

// A ring of pinned staging buffers. A step's metadata is written into the next buffer and copied
// to the device with one cudaMemcpyAsync; the buffer is reused only after the event recorded
// behind that copy has completed, which in practice never waits (the GPU would have to be a full
// ring of steps behind the host).
class StagingRing {
 public:
  static constexpr int kSlots = 8;
  StagingRing() = default;
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;
  // A host buffer of at least `bytes` that no pending copy reads.
  void* acquire(size_t bytes, cudaStream_t stream);
  // Enqueues the copy of the acquired buffer's first `bytes` to `device_dst` and marks the buffer
  // busy until the copy has run.
  void upload(void* device_dst, size_t bytes, cudaStream_t stream);

 private:
  struct Slot {
    PinnedBuffer buf;
    cudaEvent_t done = nullptr;
    bool pending = false;
  };
  std::array<Slot, kSlots> slots_{};
  int current_ = -1;
};

bool stream_is_capturing(cudaStream_t stream);

}  // namespace attnrt::cuda
