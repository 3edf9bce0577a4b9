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

bool stream_is_capturing(cudaStream_t stream);

// Makes `waiter` wait (on the device) for everything enqueued on `producer` so far; nothing when
// they are the same stream. Used where work moves from one stream to another (set_stream), so that
// what the old stream still has queued (a pool's zeroing, an upload, a store) comes first. Streams
// made with cudaStreamNonBlocking never wait for the legacy default stream by themselves, so no
// memory one of them reads is ever written on the legacy stream (plain cudaMemset / cudaMemcpy)
// without an explicit order like this one or a synchronisation.
void order_after(cudaStream_t waiter, cudaStream_t producer);

// A ring of pinned staging buffers. A step's metadata is written into the next buffer and copied
// to the device with one cudaMemcpyAsync. A buffer is reused only once the copy that last read it
// has run; an event recorded behind every kGroup-th copy (not every copy: a record costs about as
// much host time as the rest of a small plan) vouches for the copies before it, and in practice
// it has long completed when a buffer comes round again (the GPU would have to be a full ring of
// steps behind the host). Checking that event costs a synchronize on a completed event (about
// 1.6 us of host time on the H200 host, where a decode plan at batch 256 costs ~10 us), so the
// ring is deep: one step in 16 records an event and one in 16 checks one, which keeps both out
// of the plan's 90th percentile. The buffers are a step's metadata each (tens of KiB).
class StagingRing {
 public:
  static constexpr int kSlots = 32;
  static constexpr int kGroup = 16;
  StagingRing() = default;
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;
  // A host buffer of at least `bytes` that no pending copy reads. `capturing`: the stream is
  // capturing a graph (no allocation, no waiting).
  void* acquire(size_t bytes, cudaStream_t stream, bool capturing);
  void* acquire(size_t bytes, cudaStream_t stream) {
    return acquire(bytes, stream, stream_is_capturing(stream));
  }
  // The acquired buffer, grown to at least `bytes` if it holds fewer. What was written into the
  // smaller one is not carried over, but that one stays readable until the ring is destroyed.
  void* reserve(size_t bytes, bool capturing);
  // Enqueues the copy of the acquired buffer's first `bytes` to `device_dst`.
  void upload(void* device_dst, size_t bytes, cudaStream_t stream, bool capturing);
  void upload(void* device_dst, size_t bytes, cudaStream_t stream) {
    upload(device_dst, bytes, stream, stream_is_capturing(stream));
  }
  // Enqueues ONE copy of `rows` consecutive rows of `row_bytes` from the acquired buffer to
  // device_dst + r * dst_pitch (cudaMemcpy2DAsync): packed on the host, apart on the device.
  void upload_rows(void* device_dst, size_t dst_pitch, size_t row_bytes, size_t rows,
                   cudaStream_t stream);

 private:
  struct Slot {
    PinnedBuffer buf;
    uint64_t copy_seq = 0;  // sequence number of the last eager copy that read it (0 = none)
  };
  struct Mark {
    cudaEvent_t event = nullptr;
    uint64_t seq = 0;  // every eager copy up to this one precedes the event
  };
  // Bookkeeping after a copy from the current buffer was enqueued.
  void mark_copy(cudaStream_t stream, bool capturing);
  // Waits (rarely: the copies are long done) until eager copy `seq` has run.
  void wait_copy(uint64_t seq, cudaStream_t stream);
  std::array<Slot, kSlots> slots_{};
  std::array<Mark, kSlots / kGroup + 1> marks_{};
  int next_mark_ = 0;
  uint64_t copies_ = 0;     // eager copies enqueued
  uint64_t completed_ = 0;  // eager copies known to have run
  int current_ = -1;
};

}  // namespace attnrt::cuda
