// A bench row on a GPU: its KV pool and step tensors copied from the host row (the dense check
// keeps reading the host pool, which holds the same values). Private to the bench runner.
#pragma once

#include <memory>

#include "attnrt/backend/attention_backend.h"
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
  // Waits for every call issued so far.
  virtual void synchronize() = 0;
};

// A copy of `host` (every layer of `model`) and of q / k / v on `device`, with an output buffer
// shaped like `out`. Work on it goes to the legacy default stream, which the CUDA bench timer
// records its events on. Throws attnrt::Error in a build without CUDA.
std::unique_ptr<DeviceRow> make_device_row(Device device, const ModelSpec& model,
                                           const KVCacheConfig& config, const KVCache& host,
                                           const HostBuffer& q, const HostBuffer& k,
                                           const HostBuffer& v, const HostBuffer& out);

}  // namespace attnrt::bench
