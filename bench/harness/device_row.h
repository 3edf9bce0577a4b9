// A bench row on a GPU: its KV pool and step tensors copied from the host row (the dense check
// keeps reading the host pool, which holds the same values). Private to the bench runner.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/device_services.h"
#include "attnrt/core/tensor.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/model/model_spec.h"

namespace attnrt::bench {

class DeviceRow {
 public:
  virtual ~DeviceRow() = default;
  virtual KVCache& cache() = 0;
  // q, k, v and out on the device, shaped as the host tensors.
  virtual AttnArgs args() const = 0;
  // Copies out to the host once the GPU is done with the step.
  virtual void download_out(const HostBuffer& out) = 0;
  // Waits for every call issued so far to its stream.
  virtual void synchronize() = 0;
};

// A copy of `host` (every layer of `model`) and of q / k / v on `device`, with an output buffer
// shaped like `out`. Work on it goes to the legacy default stream, which the CUDA bench timer
// records its events on; with `own_stream` (rows timed without that timer) to the KV cache's own
// non-blocking stream instead, as in AttentionRuntime. Made with the services of the backends that
// run on `device`; throws attnrt::Error where none does (a build without CUDA).
std::unique_ptr<DeviceRow> make_device_row(Device device, const ModelSpec& model,
                                           const KVCacheConfig& config, const KVCache& host,
                                           const HostBuffer& q, const HostBuffer& k,
                                           const HostBuffer& v, const HostBuffer& out,
                                           bool own_stream = false);

// Device tensors (include/attnrt/backend/device_services.h) beside a runtime's KV cache `cache` on
// `device`, from that device's services: the CUDA bench timer records its events and its cache
// flush on the default stream, so each timed call is fenced (DeviceTensors::fenced). Throws
// attnrt::Error for a host cache, or where no backend runs on `device`.
std::unique_ptr<DeviceTensors> make_device_tensors(Device device, KVCache& cache);
// A device copy of `h` made by `tensors`.
inline TensorView upload(DeviceTensors& tensors, const HostBuffer& h) {
  return tensors.upload(h.data(), h.bytes(), h.view());
}

// How the host thread waits for `device` ("spin", "yield", "blocking sync" or "auto": spin while
// the process holds no more contexts than there are cores). ATTNRT_BENCH_SYNC=spin|yield|blocking
// |auto sets that first (cudaSetDeviceFlags), for A/B timing of the host's steps. Throws
// attnrt::Error for another value, and where no backend runs on `device`.
std::string host_sync_mode(Device device);

}  // namespace attnrt::bench
