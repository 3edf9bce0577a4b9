#include "bench/harness/device_row.h"

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "attnrt/core/error.h"

#if defined(ATTNRT_HAS_CUDA)
#include <cuda_runtime_api.h>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/cuda_util.h"
#endif

namespace attnrt::bench {

#if defined(ATTNRT_HAS_CUDA)

namespace {

class CudaRow final : public DeviceRow {
 public:
  CudaRow(Device device, const ModelSpec& model, const KVCacheConfig& config, const KVCache& host,
          const HostBuffer& q, const HostBuffer& k, const HostBuffer& v, const HostBuffer& out,
          bool own_stream)
      : device_(device) {
    ATTNRT_CUDA_CHECK(cudaSetDevice(device.index));
    storage_ = cuda::make_cuda_kv_storage(model, config);
    cache_ = static_cast<cuda::CudaKVCache*>(storage_.cache.get());
    for (const LayerSpec& l : model.layers) {
      if (!l.uses_kv_cache()) continue;
      const KVLayerView h = host.layer(l.layer_id);
      if (h.k_scale != 1.f || h.v_scale != 1.f)
        cache_->set_kv_scales(l.layer_id, h.k_scale, h.v_scale);
      cache_->copy_layer_from_host(l.layer_id, h.k, h.v);
    }
    // Backends built on this cache take its stream: the default one, which the timer records on,
    // unless the row keeps the cache's own.
    if (!own_stream) cache_->set_stream(nullptr);
    q_ = upload(q);
    k_ = upload(k);
    v_ = upload(v);
    out_.reserve(out.bytes());
    out_view_ = out.view();
    out_view_.data = out_.data();
    out_view_.device = device_;
  }

  KVCache& cache() override { return *cache_; }

  AttnArgs args() const override {
    AttnArgs a;
    a.q = q_.view;
    a.k = k_.view;
    a.v = v_.view;
    a.out = out_view_;
    return a;
  }

  // On the cache's stream, after the kernels that wrote out: a plain cudaMemcpy runs on the
  // legacy default stream, which the cache's own (non-blocking) stream does not wait for.
  void download_out(const HostBuffer& out) override {
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(out.data(), out_.data(), out.bytes(),
                                      cudaMemcpyDeviceToHost, cache_->stream()));
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(cache_->stream()));
  }

  void synchronize() override { ATTNRT_CUDA_CHECK(cudaStreamSynchronize(cache_->stream())); }

 private:
  struct Tensor {
    cuda::DeviceBuffer buf;
    TensorView view;
  };
  Tensor upload(const HostBuffer& h) {
    Tensor t;
    t.buf.reserve(h.bytes());
    // Complete before the call returns, whichever stream the kernels that read it run on.
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(t.buf.data(), h.data(), h.bytes(), cudaMemcpyHostToDevice,
                                      cache_->stream()));
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(cache_->stream()));
    t.view = h.view();
    t.view.data = t.buf.data();
    t.view.device = device_;
    return t;
  }

  Device device_;
  KVStorage storage_;
  cuda::CudaKVCache* cache_ = nullptr;
  Tensor q_, k_, v_;
  cuda::DeviceBuffer out_;
  TensorView out_view_;
};

class CudaTensors final : public DeviceTensors {
 public:
  CudaTensors(Device device, KVCache& cache) : device_(device) {
    auto* c = dynamic_cast<cuda::CudaKVCache*>(&cache);
    ATTNRT_CHECK(c != nullptr, "bench: the runtime's KV cache is not on a CUDA device");
    stream_ = c->stream();
    ATTNRT_CUDA_CHECK(cudaSetDevice(device.index));
    ATTNRT_CUDA_CHECK(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming));
    ATTNRT_CUDA_CHECK(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
  }
  ~CudaTensors() override {
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(before_);
    cudaEventDestroy(after_);
  }

  TensorView upload(const HostBuffer& h) override {
    buffers_.emplace_back(std::max<size_t>(h.bytes(), 1));
    // On the runtime's stream and complete on return (a plain cudaMemcpy from pageable memory may
    // return before its DMA ran, on a stream the runtime's does not wait for).
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(buffers_.back().data(), h.data(), h.bytes(),
                                      cudaMemcpyHostToDevice, stream_));
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    TensorView v = h.view();
    v.data = buffers_.back().data();
    v.device = device_;
    return v;
  }

  void download(const TensorView& src, const HostBuffer& dst) override {
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(dst.data(), src.data, dst.bytes(), cudaMemcpyDeviceToHost, stream_));
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
  std::vector<cuda::DeviceBuffer> buffers_;
};

}  // namespace

std::unique_ptr<DeviceTensors> make_device_tensors(Device device, KVCache& cache) {
  ATTNRT_CHECK(device.kind == DeviceKind::cuda, "bench: no device tensors on {}",
               device_name(device));
  return std::make_unique<CudaTensors>(device, cache);
}

std::unique_ptr<DeviceRow> make_device_row(Device device, const ModelSpec& model,
                                           const KVCacheConfig& config, const KVCache& host,
                                           const HostBuffer& q, const HostBuffer& k,
                                           const HostBuffer& v, const HostBuffer& out,
                                           bool own_stream) {
  ATTNRT_CHECK(device.kind == DeviceKind::cuda, "bench: no device rows on {}", device_name(device));
  return std::make_unique<CudaRow>(device, model, config, host, q, k, v, out, own_stream);
}

bool set_plan_part_timing(AttentionBackend& backend, bool on) {
  auto* cuda = dynamic_cast<cuda::CudaBackend*>(&backend);
  if (cuda == nullptr) return false;
  cuda->set_plan_timing(on);
  return true;
}

std::array<double, 5> last_plan_parts(const AttentionBackend& backend) {
  const auto* cuda = dynamic_cast<const cuda::CudaBackend*>(&backend);
  if (cuda == nullptr) return {};
  const cuda::CudaBackend::PlanParts& p = cuda->last_plan_parts();
  return {p.capture, p.staging, p.prepare, p.write, p.copy};
}

std::string host_sync_mode(Device device) {
  ATTNRT_CHECK(device.kind == DeviceKind::cuda, "bench: no host sync mode on {}",
               device_name(device));
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

#else

bool set_plan_part_timing(AttentionBackend&, bool) { return false; }

std::array<double, 5> last_plan_parts(const AttentionBackend&) { return {}; }

std::string host_sync_mode(Device device) {
  fail("bench: rows on {} need CUDA, and this build has none", device_name(device));
}

std::unique_ptr<DeviceRow> make_device_row(Device device, const ModelSpec&, const KVCacheConfig&,
                                           const KVCache&, const HostBuffer&, const HostBuffer&,
                                           const HostBuffer&, const HostBuffer&, bool) {
  fail("bench: rows on {} need CUDA, and this build has none", device_name(device));
}

std::unique_ptr<DeviceTensors> make_device_tensors(Device device, KVCache&) {
  fail("bench: rows on {} need CUDA, and this build has none", device_name(device));
}

#endif

}  // namespace attnrt::bench
