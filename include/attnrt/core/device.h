// Run-time discovery of CUDA devices. The binary links the CUDA runtime statically and must start on a
// machine with no GPU or no driver: query_cuda() then says why no device is usable.
#pragma once

#include <string>
#include <vector>

namespace attnrt {

struct CudaDeviceInfo {
  bool usable = false;
  std::string reason;  // why not usable (no driver, no device, built without CUDA, ...)
  std::string name;
  int device_count = 0;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t total_memory = 0;
  size_t l2_bytes = 0;  // the L2 cache
  // Every device ("index: name, memory, SMs, PCI bus id") and every pair's link as the runtime sees
  // it ("i-j: ..."): peer access with native atomics (NVLink), peer access without them (PCIe P2P),
  // or none (through host memory). Without NVML the link kind is inferred from these attributes.
  std::vector<std::string> gpus;
  std::vector<std::string> links;
  int driver_version = 0, runtime_version = 0;
};

// Cached after the first call. Answered by the services of the backends registered on the CUDA
// device (src/backend/device_services.cpp): a build without CUDA has none.
const CudaDeviceInfo& query_cuda();
bool built_with_cuda();

}  // namespace attnrt
