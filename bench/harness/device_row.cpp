#include "bench/harness/device_row.h"

#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"

namespace attnrt::bench {

namespace {

const DeviceServices& services_on(Device device) {
  const DeviceServices* s = device.kind == DeviceKind::cpu
                                ? nullptr
                                : Registry::global().device_services(device.kind);
  ATTNRT_CHECK(s != nullptr, "bench: rows on {} need a backend that runs there, and this build has none",
               device_name(device));
  return *s;
}

class ServicesRow final : public DeviceRow {
 public:
  ServicesRow(const DeviceServices& services, const ModelSpec& model, const KVCacheConfig& config,
              const KVCache& host, const HostBuffer& q, const HostBuffer& k, const HostBuffer& v,
              const HostBuffer& out, bool own_stream)
      : storage_(services.make_kv_storage(model, config)) {
    KVCache& cache = *storage_.cache;
    for (const LayerSpec& l : model.layers) {
      if (!l.uses_kv_cache()) continue;
      const KVLayerView h = host.layer(l.layer_id);
      if (h.k_scale != 1.f || h.v_scale != 1.f) cache.set_kv_scales(l.layer_id, h.k_scale, h.v_scale);
      cache.copy_layer_from_host(l.layer_id, h.k, h.v);
    }
    // Backends built on this cache take its stream: the default one, which the timer records on,
    // unless the row keeps the cache's own.
    if (!own_stream) cache.set_stream_handle(nullptr);
    tensors_ = services.make_tensors(cache);
    q_ = upload(*tensors_, q);
    k_ = upload(*tensors_, k);
    v_ = upload(*tensors_, v);
    out_ = tensors_->allocate(out.bytes(), out.view());
  }

  KVCache& cache() override { return *storage_.cache; }

  AttnArgs args() const override {
    AttnArgs a;
    a.q = q_;
    a.k = k_;
    a.v = v_;
    a.out = out_;
    return a;
  }

  // On the cache's stream, after the kernels that wrote out.
  void download_out(const HostBuffer& out) override {
    tensors_->download(out_, out.data(), out.bytes());
  }

  void synchronize() override { storage_.cache->synchronize(); }

 private:
  KVStorage storage_;
  std::unique_ptr<DeviceTensors> tensors_;  // after storage_: destroyed before the cache
  TensorView q_, k_, v_, out_;
};

}  // namespace

std::unique_ptr<DeviceRow> make_device_row(Device device, const ModelSpec& model,
                                           const KVCacheConfig& config, const KVCache& host,
                                           const HostBuffer& q, const HostBuffer& k,
                                           const HostBuffer& v, const HostBuffer& out,
                                           bool own_stream) {
  return std::make_unique<ServicesRow>(services_on(device), model, config, host, q, k, v, out,
                                       own_stream);
}

std::unique_ptr<DeviceTensors> make_device_tensors(Device device, KVCache& cache) {
  return services_on(device).make_tensors(cache);
}

std::string host_sync_mode(Device device) { return services_on(device).host_sync_mode(device); }

}  // namespace attnrt::bench
