// Helpers shared by the GPU test files: the skip (with the reason) where no CUDA device is usable,
// dependent launches switched for a scope, and device copies of host tensors.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>

#include "attnrt/core/device.h"
#include "attnrt/core/tensor.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/kernels/launch.h"
#endif

#define SKIP_WITHOUT_GPU()                                                                      \
  do {                                                                                          \
    if (!query_cuda().usable) GTEST_SKIP() << "no usable CUDA device: " << query_cuda().reason; \
  } while (0)

namespace attnrt::test {

#ifdef ATTNRT_HAS_CUDA
// Programmatic dependent launches on or off while this object lives (kernels/launch.h).
class DependentLaunches {
 public:
  explicit DependentLaunches(bool on) : saved_(cuda::dependent_launch_enabled()) {
    cuda::set_dependent_launch(on);
  }
  ~DependentLaunches() { cuda::set_dependent_launch(saved_); }
  DependentLaunches(const DependentLaunches&) = delete;
  DependentLaunches& operator=(const DependentLaunches&) = delete;

 private:
  bool saved_;
};

// Device copy of a host tensor, freed with this object.
struct DevTensor {
  void* ptr = nullptr;
  TensorView view;
  DevTensor() = default;
  explicit DevTensor(const TensorView& host) {
    const size_t bytes = static_cast<size_t>(host.numel()) * dtype_size(host.dtype);
    EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, host.data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    // A plain cudaMemcpy from pageable memory may return before its DMA ran, on the legacy stream,
    // which the backends' non-blocking streams do not wait for.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    view = host;
    view.data = ptr;
    view.device = Device::cuda(0);
  }
  ~DevTensor() {
    if (ptr) cudaFree(ptr);
  }
  DevTensor(const DevTensor&) = delete;
  DevTensor& operator=(const DevTensor&) = delete;
  // Copies the device data back into `host` (same shape and dtype).
  void download(const TensorView& host) const {
    const size_t bytes = static_cast<size_t>(host.numel()) * dtype_size(host.dtype);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the kernels that wrote it ran elsewhere
    EXPECT_EQ(cudaMemcpy(host.data, ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
};
#endif

}  // namespace attnrt::test
