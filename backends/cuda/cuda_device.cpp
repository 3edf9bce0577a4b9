#include "backends/cuda/cuda_device.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstdlib>
#include <string_view>
#include <vector>

#include "attnrt/core/error.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/cuda_linear_state.h"
#include "backends/cuda/cuda_util.h"

namespace attnrt::cuda {

cudaGraphExec_t end_capture_and_instantiate(cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  ATTNRT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  ATTNRT_CUDA_CHECK(err);
  return exec;
}

void abandon_capture(cudaStream_t stream) {
  cudaGraph_t broken = nullptr;
  cudaStreamEndCapture(stream, &broken);
  if (broken != nullptr) cudaGraphDestroy(broken);
  cudaGetLastError();
}

namespace {

CudaDeviceInfo probe_device() {
  CudaDeviceInfo info;
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
  info.l2_bytes = static_cast<size_t>(prop.l2CacheSize);
  if (info.driver_version < info.runtime_version) {
    info.reason = fmt::format("CUDA driver {} is older than the runtime {} this binary was built with",
                              info.driver_version, info.runtime_version);
    return info;
  }
  for (int i = 0; i < info.device_count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    char bus[32] = {};
    cudaDeviceGetPCIBusId(bus, sizeof(bus), i);
    info.gpus.push_back(fmt::format("{}: {}, {:.1f} GiB, {} SMs, PCI {}", i, p.name,
                                    static_cast<double>(p.totalGlobalMem) / (1 << 30),
                                    p.multiProcessorCount, bus));
  }
  for (int i = 0; i < info.device_count; ++i) {
    for (int j = i + 1; j < info.device_count; ++j) {
      int access = 0, atomics = 0, rank = 0;
      cudaDeviceCanAccessPeer(&access, i, j);
      cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, i, j);
      cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, i, j);
      cudaGetLastError();
      info.links.push_back(
          !access   ? fmt::format("{}-{}: no peer access (copies go through host memory)", i, j)
          : atomics ? fmt::format("{}-{}: NVLink (peer access with native atomics, performance "
                                  "rank {})",
                                  i, j, rank)
                    : fmt::format("{}-{}: PCIe (peer access without native atomics, performance "
                                  "rank {})",
                                  i, j, rank));
    }
  }
  info.usable = true;
  return info;
}

// Device tensors on the stream of a CudaKVCache. The CUDA bench timer records its events on the
// default stream, so fenced() makes the cache's stream wait for it and the default stream wait for
// the body.
class CudaTensors final : public DeviceTensors {
 public:
  explicit CudaTensors(CudaKVCache& cache) : device_(cache.device()), stream_(cache.stream()) {
    ATTNRT_CUDA_CHECK(cudaSetDevice(device_.index));
    ATTNRT_CUDA_CHECK(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming));
    ATTNRT_CUDA_CHECK(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
  }
  ~CudaTensors() override {
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(before_);
    cudaEventDestroy(after_);
  }

  TensorView allocate(size_t n, const TensorView& like) override {
    buffers_.emplace_back(std::max<size_t>(n, 1));
    TensorView v = like;
    v.data = buffers_.back().data();
    v.device = device_;
    return v;
  }

  TensorView upload(const void* host, size_t n, const TensorView& like) override {
    TensorView v = allocate(n, like);
    // On the cache's stream and complete on return (a plain cudaMemcpy from pageable memory may
    // return before its DMA ran, on a stream the cache's does not wait for).
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(v.data, host, n, cudaMemcpyHostToDevice, stream_));
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return v;
  }

  void download(const TensorView& src, void* host, size_t n) override {
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(host, src.data, n, cudaMemcpyDeviceToHost, stream_));
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void fenced(const std::function<void()>& body) override {
    ATTNRT_CUDA_CHECK(cudaEventRecord(before_, nullptr));
    ATTNRT_CUDA_CHECK(cudaStreamWaitEvent(stream_, before_, 0));
    body();
    ATTNRT_CUDA_CHECK(cudaEventRecord(after_, stream_));
    ATTNRT_CUDA_CHECK(cudaStreamWaitEvent(nullptr, after_, 0));
  }

 private:
  Device device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t before_ = nullptr, after_ = nullptr;
  std::vector<DeviceBuffer> buffers_;
};

// Graphs captured on a non-blocking stream of their own (cudaStreamCaptureModeGlobal, as
// torch.cuda.graph captures by default).
class CudaStreamCapture final : public StreamCapture {
 public:
  CudaStreamCapture() {
    ATTNRT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaStreamCapture() override {
    cudaStreamSynchronize(stream_);
    for (cudaGraphExec_t g : graphs_) cudaGraphExecDestroy(g);
    cudaStreamDestroy(stream_);
  }
  CudaStreamCapture(const CudaStreamCapture&) = delete;
  CudaStreamCapture& operator=(const CudaStreamCapture&) = delete;

  void* stream() const override { return stream_; }
  void begin() override {
    ATTNRT_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  }
  int end() override {
    graphs_.push_back(end_capture_and_instantiate(stream_));
    return static_cast<int>(graphs_.size()) - 1;
  }
  void abort() override { abandon_capture(stream_); }
  void launch(int graph) override {
    ATTNRT_CHECK(graph >= 0 && static_cast<size_t>(graph) < graphs_.size(),
                 "CUDA graphs: graph {}; {} were captured", graph, graphs_.size());
    ATTNRT_CUDA_CHECK(cudaGraphLaunch(graphs_[graph], stream_));
  }
  void synchronize() override { ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
  std::vector<cudaGraphExec_t> graphs_;
};

CudaKVCache& cuda_cache(KVCache& cache, const char* who) {
  auto* c = dynamic_cast<CudaKVCache*>(&cache);
  ATTNRT_CHECK(c != nullptr, "{}: the KV cache is on {}, not made by the cuda device", who,
               device_name(cache.device()));
  return *c;
}

class CudaServices final : public DeviceServices {
 public:
  DeviceKind kind() const override { return DeviceKind::cuda; }
  CudaDeviceInfo probe() const override { return probe_device(); }
  KVStorage make_kv_storage(const ModelSpec& model, const KVCacheConfig& config) const override {
    return make_cuda_kv_storage(model, config);
  }
  std::unique_ptr<LinearStateMemory> make_linear_state_memory(const KVCache& kv) const override {
    return make_cuda_linear_state_memory(&kv);
  }
  std::unique_ptr<StepGraphRunner> make_graph_runner(const ModelSpec& model,
                                                     AttentionBackend& backend, KVCache& cache,
                                                     std::vector<int> buckets,
                                                     int verify_tokens) const override {
    return make_cuda_graph_runner(model, backend, cache, std::move(buckets), verify_tokens);
  }
  std::unique_ptr<DeviceTensors> make_tensors(KVCache& cache) const override {
    return std::make_unique<CudaTensors>(cuda_cache(cache, "device tensors"));
  }
  std::unique_ptr<StreamCapture> make_stream_capture() const override {
    return std::make_unique<CudaStreamCapture>();
  }
  std::string host_sync_mode(Device device) const override;
};

std::string CudaServices::host_sync_mode(Device device) const {
  ATTNRT_CUDA_CHECK(cudaSetDevice(device.index));
  if (const char* env = std::getenv("ATTNRT_BENCH_SYNC"); env != nullptr && *env != '\0') {
    const std::string_view v(env);
    unsigned flags = 0;
    if (v == "spin") {
      flags = cudaDeviceScheduleSpin;
    } else if (v == "yield") {
      flags = cudaDeviceScheduleYield;
    } else if (v == "blocking") {
      flags = cudaDeviceScheduleBlockingSync;
    } else {
      ATTNRT_CHECK(v == "auto",
                   "bench: ATTNRT_BENCH_SYNC={} is invalid; use spin, yield, blocking or auto",
                   env);
      flags = cudaDeviceScheduleAuto;
    }
    ATTNRT_CUDA_CHECK(cudaSetDeviceFlags(flags));
  }
  unsigned flags = 0;
  ATTNRT_CUDA_CHECK(cudaGetDeviceFlags(&flags));
  switch (flags & cudaDeviceScheduleMask) {
    case cudaDeviceScheduleSpin:
      return "spin";
    case cudaDeviceScheduleYield:
      return "yield";
    case cudaDeviceScheduleBlockingSync:
      return "blocking sync";
    default:
      return "auto";
  }
}

}  // namespace

std::shared_ptr<const DeviceServices> cuda_device_services() {
  static const auto services = std::make_shared<const CudaServices>();
  return services;
}

}  // namespace attnrt::cuda
