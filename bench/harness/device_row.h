// A bench row on a GPU: its KV pool and step tensors copied from the host row (the dense check
// keeps reading the host pool, which holds the same values). Private to the bench runner.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

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
  // Waits for every call issued so far to its stream.
  virtual void synchronize() = 0;
};

// A copy of `host` (every layer of `model`) and of q / k / v on `device`, with an output buffer
// shaped like `out`. Work on it goes to the legacy default stream, which the CUDA bench timer
// records its events on; with `own_stream` (rows timed without that timer) to the KV cache's own
// non-blocking stream instead, as in AttentionRuntime. Throws attnrt::Error in a build without
// CUDA.
std::unique_ptr<DeviceRow> make_device_row(Device device, const ModelSpec& model,
                                           const KVCacheConfig& config, const KVCache& host,
                                           const HostBuffer& q, const HostBuffer& k,
                                           const HostBuffer& v, const HostBuffer& out,
                                           bool own_stream = false);

// The tensors of a linear-attention row on a GPU, for a runtime whose backends issue their work to
// the stream of its (device) KV cache. The CUDA bench timer records its events and its cache flush
// on the default stream, so each timed call is fenced: the runtime's stream first waits for the
// default stream, and the default stream then waits for the runtime's. Private to the bench runner.
class DeviceTensors {
 public:
  virtual ~DeviceTensors() = default;
  // A device copy of `h` (same dtype and shape), alive as long as this object.
  virtual TensorView upload(const HostBuffer& h) = 0;
  // Copies the device tensor `src` into `dst` (same bytes) once the runtime's stream is done.
  virtual void download(const TensorView& src, const HostBuffer& dst) = 0;
  // Issues `body` to the runtime's stream between the work before and after it on the default
  // stream.
  virtual void fenced(const std::function<void()>& body) = 0;
};

// For a runtime whose KV cache `cache` is on `device`. Throws attnrt::Error for a host cache or in
// a build without CUDA.
std::unique_ptr<DeviceTensors> make_device_tensors(Device device, KVCache& cache);

// The cuda backend's per-phase plan timing (CudaBackend::set_plan_timing): turns it on or off and
// returns whether `backend` keeps one (false for every other backend and without CUDA).
bool set_plan_part_timing(AttentionBackend& backend, bool on);
// Host seconds of the last plan's phases: capture query, staging acquire, prepare, write, copy.
std::array<double, 5> last_plan_parts(const AttentionBackend& backend);

// How the host thread waits for `device` ("spin", "yield", "blocking sync" or "auto": spin while
// the process holds no more contexts than there are cores). ATTNRT_BENCH_SYNC=spin|yield|blocking
// |auto sets that first (cudaSetDeviceFlags), for A/B timing of the host's steps. Throws
// attnrt::Error for another value, and in a build without CUDA.
std::string host_sync_mode(Device device);

}  // namespace attnrt::bench
