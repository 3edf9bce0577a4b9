#include "backends/cuda/cuda_linear_state.h"

#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/core/fault_injection.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/cuda_util.h"

namespace attnrt::cuda {

CudaLinearStateMemory::CudaLinearStateMemory(const CudaKVCache* cache) : cache_(cache) {
  const CudaDeviceInfo& info = query_cuda();
  ATTNRT_CHECK(info.usable, "linear state pool on the GPU: no usable CUDA device ({})",
               info.reason);
  ATTNRT_CUDA_CHECK(cudaGetDevice(&device_));
  if (cache_ == nullptr) {
    ATTNRT_CUDA_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
  }
}

CudaLinearStateMemory::~CudaLinearStateMemory() {
  if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
}

cudaStream_t CudaLinearStateMemory::stream() const {
  return cache_ != nullptr ? cache_->stream() : own_stream_;
}

void* CudaLinearStateMemory::allocate_zeroed(size_t bytes) {
  fault_point(FaultSite::device_alloc, "linear state pool GPU memory");
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes > 0 ? bytes : 1);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail(
        "linear state pool: cannot allocate {} bytes of GPU memory ({}); lower the number of "
        "state slots (RuntimeConfig.linear_state_slots) or verify rows",
        bytes, cudaGetErrorString(err));
  }
  ATTNRT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream()));
  return p;
}

void CudaLinearStateMemory::release(void* p) {
  // Work queued on the stream may still use p: cudaFree waits for the device.
  cudaFree(p);
}

void CudaLinearStateMemory::zero(void* dst, size_t bytes) {
  ATTNRT_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream()));
}

void CudaLinearStateMemory::copy(void* dst, const void* src, size_t bytes) {
  ATTNRT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
}

void CudaLinearStateMemory::to_host(void* host_dst, const void* src, size_t bytes) {
  ATTNRT_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream()));
  ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream()));
}

void CudaLinearStateMemory::from_host(void* dst, const void* host_src, size_t bytes) {
  ATTNRT_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream()));
  ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream()));
}

std::unique_ptr<LinearStateMemory> make_cuda_linear_state_memory(const KVCache* kv_cache) {
  const CudaKVCache* cache = nullptr;
  if (kv_cache != nullptr) {
    cache = dynamic_cast<const CudaKVCache*>(kv_cache);
    ATTNRT_CHECK(cache != nullptr,
                 "linear state pool on the GPU: the KV cache is on {}; the pool goes where the "
                 "KV cache is",
                 device_name(kv_cache->device()));
  }
  return std::make_unique<CudaLinearStateMemory>(cache);
}

}  // namespace attnrt::cuda
