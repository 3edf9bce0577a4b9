#include "attnrt/core/device.h"

#include <fmt/format.h>

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace attnrt {

bool built_with_cuda() {
#ifdef ATTNRT_HAS_CUDA
  return true;
#else
  return false;
#endif
}

namespace {

CudaDeviceInfo probe() {
  CudaDeviceInfo info;
#ifdef ATTNRT_HAS_CUDA
  cudaRuntimeGetVersion(&info.runtime_version);
  if (cudaDriverGetVersion(&info.driver_version) != cudaSuccess || info.driver_version == 0) {
    info.reason = "no CUDA driver is installed (libcuda.so not found)";
    return info;
  }
  cudaError_t err = cudaGetDeviceCount(&info.device_count);
  if (err != cudaSuccess) {
    info.reason = fmt::format("CUDA driver {} present but no usable device: {}",
                              info.driver_version, cudaGetErrorString(err));
    cudaGetLastError();
    return info;
  }
  if (info.device_count == 0) {
    info.reason = "no CUDA device found";
    return info;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    info.reason = "cudaGetDeviceProperties failed for device 0";
    return info;
  }
  info.name = prop.name;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  info.total_memory = prop.totalGlobalMem;
  if (info.driver_version < info.runtime_version) {
    info.reason = fmt::format("CUDA driver {} is older than the runtime {} this binary was built with",
                              info.driver_version, info.runtime_version);
    return info;
  }
  info.usable = true;
#else
  info.reason = "attnrt was built without CUDA (nvcc not found at build time or -DATTNRT_CUDA=OFF)";
#endif
  return info;
}

}  // namespace

const CudaDeviceInfo& query_cuda() {
  static const CudaDeviceInfo info = probe();
  return info;
}

}  // namespace attnrt
