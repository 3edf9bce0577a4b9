// What a backend's device gives the layers above it: memory for the pools, whole-step graphs,
// device tensors for the tools, and a description of the device. A backend's registry entry holds
// its device's services (BackendEntry::device); the runtime, the trace simulator and the bench
// harness reach a device only through them and through the KVCache they return, so that adding a
// backend touches its own folder and one registration line. The host's services are built in and
// serve every backend that runs on the CPU.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "attnrt/core/device.h"
#include "attnrt/core/tensor.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/linear_state_pool.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

class AttentionBackend;
struct ForwardBatch;

// The tensors a captured step reads and writes for one attention layer: fixed addresses that
// never change: q [tokens, Hq, Dqk], k [tokens, Hkv, Dqk], v [tokens, Hkv, Dv], out
// [tokens, Hq, Dv] in the model's dtype, and for layers with sinks the sink logits, fp32 [Hq] (a
// weight: written once, read by every step). Rows are request-major as in ForwardBatch.
struct GraphLayerIO {
  TensorView q, k, v, out, sinks;
  // DSA layers (LayerSpec::has_indexer; docs/dsa.md "API"): the indexer's inputs, index q
  // [T, Hi, Di], index k [T, Di] and weights [T, Hi] in the model's dtype, written by the caller
  // like q / k / v, and the selection each step writes, int32 [T, index_topk]. Empty otherwise.
  TensorView index_q, index_k, index_weights, index_topk;
};

// Capture and replay of whole attention steps (docs/cuda_graphs.md), for AttentionRuntime.
class StepGraphRunner {
 public:
  virtual ~StepGraphRunner() = default;
  // The static tensors of an attention layer, first `tokens` rows.
  virtual GraphLayerIO io(const LayerSpec& layer, int64_t tokens) = 0;
  // One step of `batch` (already validated) padded to `bucket` requests: captures the graph of
  // (mode, bucket, chain / tree) when it is new, then plans and launches it.
  virtual void run(const ForwardBatch& batch, int bucket) = 0;
  virtual int captured() const = 0;
};

// Tensors on a device for the tools (bench rows, linear rows), ordered with the stream of the KV
// cache they were made for. Each timed call is fenced against the default stream, which a device
// timer records its events on.
class DeviceTensors {
 public:
  virtual ~DeviceTensors() = default;
  // A device copy of `n` bytes at `host` as a tensor shaped like `like` (data and device
  // replaced), alive as long as this object; complete on return.
  virtual TensorView upload(const void* host, size_t n, const TensorView& like) = 0;
  // A device buffer of `n` bytes shaped like `like`, alive as long as this object, not written.
  virtual TensorView allocate(size_t n, const TensorView& like) = 0;
  // Copies `n` bytes of the device tensor `src` to `host` once the stream is done with it.
  virtual void download(const TensorView& src, void* host, size_t n) = 0;
  // Issues `body` to the cache's stream between the work before and after it on the default
  // stream.
  virtual void fenced(const std::function<void()>& body) = 0;
};

// CUDA graphs of the work issued on one stream of their own, captured and replayed as an engine
// does with its framework's graph (torch.cuda.graph): for the tools that drive a group of ranks
// the way an engine would (DcpAttention's engine-captured graphs, docs/dcp.md "CUDA graphs").
class StreamCapture {
 public:
  virtual ~StreamCapture() = default;
  // The stream (a cudaStream_t, non-blocking), alive as long as this object.
  virtual void* stream() const = 0;
  // Starts capturing stream() (every thread's unsafe calls refused meanwhile, as torch's default).
  virtual void begin() = 0;
  // Ends the capture and instantiates it: the new graph's index. Throws the device's error when
  // the capture failed.
  virtual int end() = 0;
  // Ends a capture that failed (an exception inside it) and discards what it recorded.
  virtual void abort() = 0;
  // Replays graph `graph` on stream().
  virtual void launch(int graph) = 0;
  virtual void synchronize() = 0;
};

class DeviceServices {
 public:
  virtual ~DeviceServices() = default;
  virtual DeviceKind kind() const = 0;
  // What the machine has of this device kind (probed once and cached by the caller); `usable`
  // false with the reason when there is no usable device.
  virtual CudaDeviceInfo probe() const = 0;
  // The allocator and the KV cache of `model` on this device (KVStorage: one SWA mapping shared
  // by both).
  virtual KVStorage make_kv_storage(const ModelSpec& model, const KVCacheConfig& config) const = 0;
  // Memory for the linear-attention state pool beside `kv` (ordered with its stream).
  virtual std::unique_ptr<LinearStateMemory> make_linear_state_memory(const KVCache& kv) const = 0;
  // Whole-step graphs over `cache` (made by this device); `buckets` increasing, `verify_tokens` =
  // N of TARGET_VERIFY steps (0: no verify graphs). Throws attnrt::Error where the device has none.
  virtual std::unique_ptr<StepGraphRunner> make_graph_runner(const ModelSpec& model,
                                                             AttentionBackend& backend,
                                                             KVCache& cache,
                                                             std::vector<int> buckets,
                                                             int verify_tokens) const;
  // Device tensors beside `cache` (made by this device). Throws attnrt::Error on the host.
  virtual std::unique_ptr<DeviceTensors> make_tensors(KVCache& cache) const;
  // Captured graphs of a stream of their own on the current device. Throws attnrt::Error on the
  // host.
  virtual std::unique_ptr<StreamCapture> make_stream_capture() const;
  // How the host thread waits for the device ("spin", "yield", "blocking sync" or "auto");
  // ATTNRT_BENCH_SYNC=spin|yield|blocking|auto sets that first. "" on the host.
  virtual std::string host_sync_mode(Device device) const;
};

// The services of host memory: host pools (make_host_kv_storage), host linear state, no graphs.
std::shared_ptr<const DeviceServices> host_device_services();

}  // namespace attnrt
