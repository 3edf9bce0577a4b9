#include <cmath>
#include <cstring>

#include "attnrt/core/error.h"
#include "attnrt/core/fault_injection.h"
#include "attnrt/memory/kv_cache.h"
#include "src/memory/kv_scatter.h"

namespace attnrt {

MHATokenToKVPool::MHATokenToKVPool(int64_t rows, DType dtype, const std::vector<LayerSpec>& layers)
    : rows_(rows), dtype_(dtype) {
  kv_scatter::check_pool("MHATokenToKVPool", rows, dtype);
  layers_.reserve(layers.size());
  for (const LayerSpec& l : layers) {
    ATTNRT_CHECK(l.uses_kv_cache() && l.kind != LayerKind::mla,
                 "MHATokenToKVPool: layer {} is {}; this pool holds full / sliding-window "
                 "attention layers only",
                 l.layer_id, layer_kind_name(l.kind));
    const int v_dim = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
    ATTNRT_CHECK(l.layer_id >= 0 && l.num_kv_heads > 0 && l.head_dim > 0,
                 "MHATokenToKVPool: layer {} has {} kv heads and head_dim {}; all must be > 0 "
                 "(layer id >= 0)",
                 l.layer_id, l.num_kv_heads, l.head_dim);
    index_.add(l.layer_id, "MHATokenToKVPool");
    Layer& x = layers_.emplace_back();
    x.layer_id = l.layer_id;
    x.kv_heads = l.num_kv_heads;
    x.head_dim = l.head_dim;
    x.v_head_dim = v_dim;
    fault_point(FaultSite::host_alloc, "MHATokenToKVPool layer buffers");
    x.k = HostBuffer(dtype, {rows, l.num_kv_heads, l.head_dim});
    x.v = HostBuffer(dtype, {rows, l.num_kv_heads, v_dim});
    // Zeroed so that the reserved row and never-written slots read as 0, never as stale bytes.
    std::memset(x.k.data(), 0, x.k.bytes());
    std::memset(x.v.data(), 0, x.v.bytes());
    x.kp = x.k.data();
    x.vp = x.v.data();
  }
}

void MHATokenToKVPool::bind_storage(int layer_id, void* k, void* v) {
  Layer& l = find(layer_id);
  ATTNRT_CHECK(k != nullptr && v != nullptr,
               "bind_storage(layer {}): k and v must both point at the engine's buffers", layer_id);
  l.k = HostBuffer();
  l.v = HostBuffer();
  l.kp = k;
  l.vp = v;
}

bool MHATokenToKVPool::holds(int layer_id) const { return index_.holds(layer_id); }

const MHATokenToKVPool::Layer& MHATokenToKVPool::find(int layer_id) const {
  return layers_[static_cast<size_t>(index_.at(layer_id, "MHATokenToKVPool"))];
}

KVLayerView MHATokenToKVPool::layer(int layer_id) const {
  const Layer& l = find(layer_id);
  KVLayerView view;
  view.k = l.kp;
  view.v = l.vp;
  view.dtype = dtype_;
  view.device = Device::cpu();
  view.num_rows = rows_;
  view.kv_heads = l.kv_heads;
  view.head_dim = l.head_dim;
  view.v_head_dim = l.v_head_dim;
  view.k_row_stride = static_cast<int64_t>(l.kv_heads) * l.head_dim;
  view.v_row_stride = static_cast<int64_t>(l.kv_heads) * l.v_head_dim;
  view.k_scale = l.k_scale;
  view.v_scale = l.v_scale;
  return view;
}

void MHATokenToKVPool::set_scales(int layer_id, float k_scale, float v_scale) {
  Layer& l = find(layer_id);
  ATTNRT_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
               "KV scales of layer {} are k_scale {} and v_scale {}; scales must be finite and > 0",
               layer_id, k_scale, v_scale);
  l.k_scale = k_scale;
  l.v_scale = v_scale;
}

void MHATokenToKVPool::set_kv_buffer(int layer_id, std::span<const int64_t> loc,
                                     const TensorView& k, const TensorView& v) {
  const Layer& l = find(layer_id);
  const auto tokens = static_cast<int64_t>(loc.size());
  kv_scatter::check_input("k", k, tokens, l.kv_heads, l.head_dim, layer_id);
  kv_scatter::check_input("v", v, tokens, l.kv_heads, l.v_head_dim, layer_id);
  kv_scatter::check_slots(layer_id, loc, rows_);
  kv_scatter::scatter(k, loc, dtype_, l.kp, l.k_scale);
  kv_scatter::scatter(v, loc, dtype_, l.vp, l.v_scale);
}

size_t MHATokenToKVPool::bytes() const {
  size_t total = 0;
  for (const Layer& l : layers_) total += l.k.bytes() + l.v.bytes();
  return total;
}

}  // namespace attnrt
