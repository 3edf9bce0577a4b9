// LinearStatePool tensors in GPU memory: allocation, zeroing and copies stream-ordered on the
// cuda backend's stream (the CudaKVCache's, followed when it changes), so that alloc / copy /
// commit_verify never wait for the GPU; host transfers (tests, tooling) synchronise that stream.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/linear_state_pool.h"

namespace attnrt::cuda {

class CudaKVCache;

class CudaLinearStateMemory final : public LinearStateMemory {
 public:
  // On `cache`'s stream; with no cache, on a stream of its own.
  explicit CudaLinearStateMemory(const CudaKVCache* cache);
  ~CudaLinearStateMemory() override;
  CudaLinearStateMemory(const CudaLinearStateMemory&) = delete;
  CudaLinearStateMemory& operator=(const CudaLinearStateMemory&) = delete;

  cudaStream_t stream() const;
  Device device() const override { return Device::cuda(device_); }
  void* allocate_zeroed(size_t bytes) override;
  void release(void* p) override;
  void zero(void* dst, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void to_host(void* host_dst, const void* src, size_t bytes) override;
  void from_host(void* dst, const void* host_src, size_t bytes) override;

 private:
  const CudaKVCache* cache_ = nullptr;
  cudaStream_t own_stream_ = nullptr;
  int device_ = 0;
};

// GPU memory for a LinearStatePool beside `kv_cache` (a CudaKVCache: its stream), or on a stream
// of its own when kv_cache is null. Throws attnrt::Error when no CUDA device is usable or
// kv_cache is not a CUDA KV cache.
std::unique_ptr<LinearStateMemory> make_cuda_linear_state_memory(const KVCache* kv_cache);

}  // namespace attnrt::cuda
