#include <cmath>
#include <cstring>

#include "attnrt/core/error.h"
#include "attnrt/core/fault_injection.h"
#include "attnrt/memory/kv_cache.h"
#include "src/memory/kv_scatter.h"

namespace attnrt {

MLATokenToKVPool::MLATokenToKVPool(int64_t rows, DType dtype, const std::vector<LayerSpec>& layers)
    : rows_(rows), dtype_(dtype) {
  kv_scatter::check_pool("MLATokenToKVPool", rows, dtype);
  layers_.reserve(layers.size());
  for (const LayerSpec& l : layers) {
    ATTNRT_CHECK(l.kind == LayerKind::mla,
                 "MLATokenToKVPool: layer {} is {}; this pool holds mla layers only", l.layer_id,
                 layer_kind_name(l.kind));
    const int v_dim = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
    ATTNRT_CHECK(l.layer_id >= 0 && l.num_kv_heads == 1 && l.head_dim > 0 && v_dim <= l.head_dim,
                 "MLATokenToKVPool: layer {} has {} kv heads, head_dim {}, v_head_dim {}; an mla "
                 "layer has one latent kv head and v_head_dim (kv_lora_rank) <= head_dim "
                 "(kv_lora_rank + qk_rope_head_dim)",
                 l.layer_id, l.num_kv_heads, l.head_dim, v_dim);
    index_.add(l.layer_id, "MLATokenToKVPool");
    Layer& x = layers_.emplace_back();
    x.layer_id = l.layer_id;
    x.row_dim = l.head_dim;
    x.v_dim = v_dim;
    fault_point(FaultSite::host_alloc, "MLATokenToKVPool layer buffer");
    x.kv = HostBuffer(dtype, {rows, 1, l.head_dim});
    // Zeroed so that the reserved row and never-written slots read as 0, never as stale bytes.
    std::memset(x.kv.data(), 0, x.kv.bytes());
    x.kvp = x.kv.data();
  }
}

void MLATokenToKVPool::bind_storage(int layer_id, void* k, void* v) {
  auto& l = const_cast<Layer&>(find(layer_id));
  ATTNRT_CHECK(k != nullptr && v == k,
               "bind_storage(mla layer {}): v must be k (V is the first kv_lora_rank columns of "
               "the latent row)",
               layer_id);
  l.kv = HostBuffer();
  l.kvp = k;
}

bool MLATokenToKVPool::holds(int layer_id) const { return index_.holds(layer_id); }

const MLATokenToKVPool::Layer& MLATokenToKVPool::find(int layer_id) const {
  return layers_[static_cast<size_t>(index_.at(layer_id, "MLATokenToKVPool"))];
}

KVLayerView MLATokenToKVPool::layer(int layer_id) const {
  const Layer& l = find(layer_id);
  KVLayerView view;
  view.k = l.kvp;
  view.v = l.kvp;
  view.dtype = dtype_;
  view.device = Device::cpu();
  view.num_rows = rows_;
  view.kv_heads = 1;
  view.head_dim = l.row_dim;
  view.v_head_dim = l.v_dim;
  view.k_row_stride = l.row_dim;
  view.v_row_stride = l.row_dim;
  view.k_scale = l.scale;
  view.v_scale = l.scale;
  return view;
}

void MLATokenToKVPool::set_scales(int layer_id, float k_scale, float v_scale) {
  Layer& l = const_cast<Layer&>(find(layer_id));
  ATTNRT_CHECK(std::isfinite(k_scale) && k_scale > 0,
               "KV scales of layer {}: k_scale {}; scales must be finite and > 0", layer_id,
               k_scale);
  ATTNRT_CHECK(v_scale == k_scale,
               "KV scales of layer {}: k_scale {} but v_scale {}; layer {} is an mla layer whose V "
               "is a view of the stored K row, so it has one scale: pass v_scale = k_scale",
               layer_id, k_scale, v_scale, layer_id);
  l.scale = k_scale;
}

void MLATokenToKVPool::set_kv_buffer(int layer_id, std::span<const int64_t> loc,
                                     const TensorView& k, const TensorView&) {
  const Layer& l = find(layer_id);
  const auto tokens = static_cast<int64_t>(loc.size());
  kv_scatter::check_input("k", k, tokens, 1, l.row_dim, layer_id);
  kv_scatter::check_slots(layer_id, loc, rows_);
  kv_scatter::scatter(k, loc, dtype_, l.kvp, l.scale);
}

size_t MLATokenToKVPool::bytes() const {
  size_t total = 0;
  for (const Layer& l : layers_) total += l.kv.bytes();
  return total;
}

}  // namespace attnrt
