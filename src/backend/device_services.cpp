#include "attnrt/backend/device_services.h"

#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"

namespace attnrt {

std::unique_ptr<StepGraphRunner> DeviceServices::make_graph_runner(const ModelSpec&,
                                                                   AttentionBackend&,
                                                                   KVCache& cache,
                                                                   std::vector<int>, int) const {
  fail("CUDA graphs need the KV cache on the GPU; this runtime's cache is on {}",
       device_name(cache.device()));
}

std::unique_ptr<DeviceTensors> DeviceServices::make_tensors(KVCache& cache) const {
  fail("bench: no device tensors on {}", device_name(cache.device()));
}

std::unique_ptr<StreamCapture> DeviceServices::make_stream_capture() const {
  fail("CUDA graphs: the host has no stream to capture");
}

std::string DeviceServices::host_sync_mode(Device) const { return ""; }

namespace {

class HostServices final : public DeviceServices {
 public:
  DeviceKind kind() const override { return DeviceKind::cpu; }
  CudaDeviceInfo probe() const override {
    CudaDeviceInfo info;
    info.reason = "the host is not a CUDA device";
    return info;
  }
  KVStorage make_kv_storage(const ModelSpec& model, const KVCacheConfig& config) const override {
    return make_host_kv_storage(model, config);
  }
  std::unique_ptr<LinearStateMemory> make_linear_state_memory(const KVCache&) const override {
    return make_host_linear_state_memory();
  }
};

}  // namespace

std::shared_ptr<const DeviceServices> host_device_services() {
  static const auto services = std::make_shared<const HostServices>();
  return services;
}

// The CUDA device as the registered backends see it (core/device.h): a build without CUDA
// registers no backend on it.
bool built_with_cuda() { return Registry::global().device_services(DeviceKind::cuda) != nullptr; }

const CudaDeviceInfo& query_cuda() {
  static const CudaDeviceInfo info = [] {
    if (const DeviceServices* cuda = Registry::global().device_services(DeviceKind::cuda))
      return cuda->probe();
    CudaDeviceInfo none;
    none.reason =
        "attnrt was built without CUDA (nvcc not found at build time or -DATTNRT_CUDA=OFF)";
    return none;
  }();
  return info;
}

}  // namespace attnrt
