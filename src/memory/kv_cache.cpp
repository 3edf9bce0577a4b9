#include "attnrt/memory/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/core/fault_injection.h"
#include "src/core/index_scan.h"

namespace attnrt {

void KVCache::set_kv_scales(int layer_id, float, float) {
  fail("this KV cache does not take per-layer KV scales (layer {})", layer_id);
}

IndexKeyView KVCache::index_keys(int layer_id) const {
  fail("this KV cache keeps no DSA index keys (layer {}); DSA layers are served by the host "
       "backends (cpu, reference)",
       layer_id);
}

void KVCache::store_step_index_k(int layer_id, const TensorView&) {
  (void)index_keys(layer_id);
}

void KVCache::copy_index_keys_from_host(int layer_id, const void* src) {
  const IndexKeyView v = index_keys(layer_id);
  copy(v.data, src, static_cast<size_t>(v.num_rows) * (v.dim + 4));
}

void KVCache::bind_layer_storage(int layer_id, void*, void*) {
  fail("this KV cache cannot read an engine's own buffers (layer {})", layer_id);
}

void KVCache::copy(void* dst, const void* src, size_t bytes) {
  ATTNRT_CHECK(device().kind == DeviceKind::cpu,
               "this KV cache on {} does not copy device memory", device_name(device()));
  if (bytes > 0) std::memmove(dst, src, bytes);
}

namespace {

size_t row_bytes(const KVLayerView& view, int dim) {
  return static_cast<size_t>(view.kv_heads) * dim * dtype_size(view.dtype);
}

void check_host_layer(const KVLayerView& view, int layer_id, const char* what) {
  ATTNRT_CHECK(view.device.kind == DeviceKind::cpu, "{} needs a host KV cache; layer {} lives on {}",
               what, layer_id, device_name(view.device));
}

}  // namespace

void KVCache::copy_rows(std::span<const int> layers,
                        std::span<const std::pair<int64_t, int64_t>> moves) {
  for (int layer_id : layers) {
    const KVLayerView view = layer(layer_id);
    check_host_layer(view, layer_id, "moving accepted draft K/V rows");
    const size_t elem = dtype_size(view.dtype);
    const size_t k_bytes = row_bytes(view, view.head_dim);
    const size_t v_bytes = row_bytes(view, view.v_head_dim);
    auto row = [&](int64_t slot) {
      const int64_t r = view.pool_slot(slot);
      ATTNRT_CHECK(r > 0 && r < view.num_rows,
                   "moving K/V rows in layer {}: full slot {} maps to row {}, outside [1, {})",
                   layer_id, slot, r, view.num_rows);
      return r;
    };
    for (const auto& [src, dst] : moves) {
      const int64_t s = row(src), d = row(dst);
      auto* k = static_cast<char*>(view.k);
      auto* v = static_cast<char*>(view.v);
      std::memmove(k + d * view.k_row_stride * elem, k + s * view.k_row_stride * elem, k_bytes);
      if (v != k)
        std::memmove(v + d * view.v_row_stride * elem, v + s * view.v_row_stride * elem, v_bytes);
    }
  }
}

void KVCache::copy_layer_from_host(int layer_id, const void* k, const void* v) {
  const KVLayerView view = layer(layer_id);
  check_host_layer(view, layer_id, "copy_layer_from_host");
  const size_t elem = dtype_size(view.dtype);
  std::memcpy(view.k, k, static_cast<size_t>(view.num_rows) * view.k_row_stride * elem);
  if (view.v != view.k)
    std::memcpy(view.v, v, static_cast<size_t>(view.num_rows) * view.v_row_stride * elem);
}

void KVCache::download_rows(int layer_id, std::span<const int64_t>, void*, void*) {
  fail("download_rows(layer {}): the KV cache is on {}, which needs no host copy", layer_id,
       device_name(device()));
}

void KVCache::download_index_keys(int layer_id, void*) {
  fail("download_index_keys(layer {}): the KV cache is on {}, which needs no host copy", layer_id,
       device_name(device()));
}

StepSlotCheck::StepSlotCheck(const char* who, int64_t full_rows,
                             std::shared_ptr<const std::vector<int64_t>> full_to_swa)
    : who_(who),
      full_rows_(full_rows),
      map_(std::move(full_to_swa)),
      seen_(static_cast<size_t>(full_rows), 0) {}

namespace {

// The common case of StepSlotCheck: every slot in [0, rows), none but the dummy 0 stamped `epoch`
// in `seen` before (each gets stamped), and with a map every slot but 0 mapped to an SWA slot. No
// branch on the values and no message: on false the checked loop walks the slots in order and
// names the first bad one.
bool slots_pass(std::span<const int64_t> loc, int64_t rows, uint32_t* seen, uint32_t epoch,
                const int64_t* map) {
  const int64_t* p = loc.data();
  const size_t tokens = loc.size();
  if (!all_in_range(p, tokens, rows)) return false;
  unsigned bad = 0;
  for (size_t i = 0; i < tokens; ++i) {
    bad |= (seen[p[i]] == epoch) & (p[i] != 0);
    seen[p[i]] = epoch;
  }
  if (map != nullptr) {
    for (size_t i = 0; i < tokens; ++i) bad |= (map[p[i]] == 0) & (p[i] != 0);
  }
  return bad == 0;
}

}  // namespace

void StepSlotCheck::operator()(std::span<const int64_t> loc, int64_t* swa) {
  auto next_epoch = [&] {
    if (++epoch_ == 0) {  // wrapped: forget every stamp
      std::fill(seen_.begin(), seen_.end(), 0);
      epoch_ = 1;
    }
  };
  next_epoch();
  const bool good =
      slots_pass(loc, full_rows_, seen_.data(), epoch_, map_ != nullptr ? map_->data() : nullptr);
  if (!good) next_epoch();  // slots_pass stamped slots in the current epoch
  // A bad step: walk the slots in order and name the first bad one.
  const auto tokens = static_cast<int64_t>(loc.size());
  for (int64_t i = 0; !good && i < tokens; ++i) {
    const int64_t s = loc[i];
    ATTNRT_CHECK(s >= 0 && s < full_rows_,
                 "{}: out_cache_loc[{}] = {} is outside the KV pool's slots 0..{}", who_, i, s,
                 full_rows_ - 1);
    if (s == 0) continue;  // the dummy row: every padded token may write there
    if (seen_[s] == epoch_) {
      const auto first = std::find(loc.begin(), loc.begin() + i, s) - loc.begin();
      fail(
          "{}: out_cache_loc[{}] = {} repeats out_cache_loc[{}]; every token of a step needs its "
          "own slot (only the dummy slot 0 may repeat)",
          who_, i, s, first);
    }
    seen_[s] = epoch_;
    ATTNRT_CHECK(map_ == nullptr || (*map_)[s] != 0,
                 "{}: out_cache_loc[{}] = {} has no SWA slot (never allocated, or released by "
                 "free_swa); allocate step slots with the SWA allocator",
                 who_, i, s);
  }
  if (map_ != nullptr) {
    for (int64_t i = 0; i < tokens; ++i) swa[i] = (*map_)[loc[i]];
  }
}

namespace {

bool is_swa_layer(const LayerSpec& l) {
  return l.kind == LayerKind::swa || (l.uses_kv_cache() && l.sliding_window >= 0);
}

// Host KV cache over one or two slot spaces. Layers with the same [kv_heads, head_dim, v_head_dim]
// share one MHATokenToKVPool, mla layers one MLATokenToKVPool (full slot space); all pools of a
// slot space have the same rows. With a full->SWA map the sliding-window layers live in the SWA
// slot space and are written through a translation of out_cache_loc made once per step into
// swa_loc_, whose address never changes.
class HostKVCache final : public KVCache {
 public:
  HostKVCache(const ModelSpec& model, const KVCacheConfig& config, int64_t full_rows,
              int64_t swa_rows, std::shared_ptr<const std::vector<int64_t>> full_to_swa)
      : dtype_(config.dtype),
        page_size_(config.page_size),
        full_rows_(full_rows),
        map_(std::move(full_to_swa)),
        check_("KV cache", full_rows, map_) {
    using Shape = std::tuple<bool, int, int, int>;  // (swa, kv heads, head dim, v head dim)
    std::map<Shape, std::vector<LayerSpec>> groups;
    std::vector<LayerSpec> mla, dsa;
    int max_id = -1;
    for (const LayerSpec& l : model.layers) {
      max_id = std::max(max_id, l.layer_id);
      if (!l.uses_kv_cache()) continue;
      if (l.has_indexer()) dsa.push_back(l);
      if (l.kind == LayerKind::mla) {
        mla.push_back(l);
        continue;
      }
      const bool swa = map_ != nullptr && is_swa_layer(l);
      const int v_dim = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
      groups[{swa, l.num_kv_heads, l.head_dim, v_dim}].push_back(l);
    }
    entries_.resize(static_cast<size_t>(max_id + 1));
    for (const LayerSpec& l : model.layers) {
      ATTNRT_CHECK(l.layer_id >= 0, "KV cache: layer id {} is negative", l.layer_id);
      entries_[l.layer_id].kind = l.kind;
    }
    for (auto& [shape, layers] : groups) {
      const bool swa = std::get<0>(shape);
      pools_.push_back(
          std::make_unique<MHATokenToKVPool>(swa ? swa_rows : full_rows, dtype_, layers));
      for (const LayerSpec& l : layers) {
        entries_[l.layer_id].pool = pools_.back().get();
        entries_[l.layer_id].swa = swa;
      }
    }
    if (!mla.empty()) {
      pools_.push_back(std::make_unique<MLATokenToKVPool>(full_rows, dtype_, mla));
      for (const LayerSpec& l : mla) entries_[l.layer_id].pool = pools_.back().get();
    }
    if (!dsa.empty()) index_keys_ = std::make_unique<IndexKeyPool>(full_rows, page_size_, dsa);
    if (map_ != nullptr) {
      ATTNRT_CHECK(config.max_num_tokens >= 1,
                   "KV cache: max_num_tokens {} is invalid; it sizes the per-step SWA write-slot "
                   "buffer and must be >= 1",
                   config.max_num_tokens);
      fault_point(FaultSite::host_alloc, "KV cache SWA write-slot scratch");
      swa_loc_.assign(static_cast<size_t>(config.max_num_tokens), 0);
    }
  }

  KVLayerView layer(int layer_id) const override {
    const Entry& e = entry(layer_id);
    KVLayerView view = e.pool->layer(layer_id);
    if (e.swa) {
      view.slot_map = map_->data();
      view.slot_map_rows = full_rows_;
      view.step_write_loc = swa_loc_.data();
      view.is_swa = true;
    } else {
      view.step_write_loc = step_loc_;
    }
    return view;
  }

  void begin_step(const ForwardBatch& batch) override {
    step_loc_ = nullptr;
    step_tokens_ = -1;
    const std::vector<int64_t>& loc = batch.out_cache_loc;
    const auto tokens = static_cast<int64_t>(loc.size());
    if (map_ != nullptr) {
      ATTNRT_CHECK(tokens <= static_cast<int64_t>(swa_loc_.size()),
                   "KV cache: the step has {} tokens, more than max_num_tokens = {} that the SWA "
                   "write-slot buffer was sized for; raise max_num_tokens or split the step",
                   tokens, swa_loc_.size());
    }
    check_(loc, swa_loc_.data());
    step_loc_ = loc.data();
    step_tokens_ = tokens;
  }

  void store_step_kv(int layer_id, const TensorView& k, const TensorView& v) override {
    const Entry& e = entry(layer_id);
    ATTNRT_CHECK(step_tokens_ >= 0,
                 "store_step_kv(layer {}): no step has begun; call begin_step(batch) first",
                 layer_id);
    ATTNRT_CHECK(k.ndim >= 1 && k.shape[0] == step_tokens_,
                 "store_step_kv(layer {}): k is {}, but the step has {} tokens", layer_id,
                 k.describe(), step_tokens_);
    const int64_t* loc = e.swa ? swa_loc_.data() : step_loc_;
    e.pool->set_kv_buffer(layer_id,
                          std::span<const int64_t>(loc, static_cast<size_t>(step_tokens_)), k, v);
  }

  void set_kv_scales(int layer_id, float k_scale, float v_scale) override {
    entry(layer_id).pool->set_scales(layer_id, k_scale, v_scale);
  }

  IndexKeyView index_keys(int layer_id) const override {
    entry(layer_id);
    ATTNRT_CHECK(index_keys_ != nullptr && index_keys_->holds(layer_id),
                 "KV cache: layer {} has no indexer, so no index-key cache", layer_id);
    return index_keys_->layer(layer_id);
  }

  void store_step_index_k(int layer_id, const TensorView& k) override {
    index_keys(layer_id);
    ATTNRT_CHECK(step_tokens_ >= 0,
                 "store_step_index_k(layer {}): no step has begun; call begin_step(batch) first",
                 layer_id);
    index_keys_->store(layer_id, std::span<const int64_t>(step_loc_, static_cast<size_t>(step_tokens_)),
                       k);
  }

  // The index keys move with the latent rows.
  void copy_rows(std::span<const int> layers,
                 std::span<const std::pair<int64_t, int64_t>> moves) override {
    KVCache::copy_rows(layers, moves);
    if (index_keys_ != nullptr) index_keys_->copy_rows(layers, moves);
  }

  void bind_layer_storage(int layer_id, void* k, void* v) override {
    const Entry& e = entry(layer_id);
    ATTNRT_CHECK(!e.swa,
                 "KV cache: layer {} lives in the sliding-window slot space of an SWA-hybrid "
                 "cache, whose slots attnrt's allocator maps; an engine's own buffers can back "
                 "full-slot-space layers only",
                 layer_id);
    e.pool->bind_storage(layer_id, k, v);
  }

  Device device() const override { return Device::cpu(); }
  DType dtype() const override { return dtype_; }
  int page_size() const override { return page_size_; }

 private:
  struct Entry {
    TokenToKVPool* pool = nullptr;
    bool swa = false;
    LayerKind kind = LayerKind::full;
  };

  const Entry& entry(int layer_id) const {
    ATTNRT_CHECK(layer_id >= 0 && static_cast<size_t>(layer_id) < entries_.size(),
                 "KV cache: layer {} does not exist; the model has layers 0..{}", layer_id,
                 static_cast<int64_t>(entries_.size()) - 1);
    const Entry& e = entries_[layer_id];
    ATTNRT_CHECK(e.pool != nullptr, "KV cache: layer {} is a {} layer and has no KV cache",
                 layer_id, layer_kind_name(e.kind));
    return e;
  }

  DType dtype_;
  int page_size_;
  int64_t full_rows_;
  std::shared_ptr<const std::vector<int64_t>> map_;  // null: no SWA slot space
  std::vector<std::unique_ptr<TokenToKVPool>> pools_;
  std::vector<Entry> entries_;    // by layer id
  std::vector<int64_t> swa_loc_;  // [max_num_tokens], allocated once
  std::unique_ptr<IndexKeyPool> index_keys_;  // DSA layers' index keys; null without any
  const int64_t* step_loc_ = nullptr;
  int64_t step_tokens_ = -1;  // -1: no valid step
  StepSlotCheck check_;
};

void check_config(const KVCacheConfig& config) {
  ATTNRT_CHECK(config.page_size >= 1, "KV cache: page_size {} is invalid; it must be >= 1",
               config.page_size);
  ATTNRT_CHECK(is_float(config.dtype),
               "KV cache: {} is not a KV storage dtype; use bf16, fp16, fp32, fp8_e4m3 or "
               "fp8_e5m2",
               dtype_name(config.dtype));
  ATTNRT_CHECK(config.full_slots >= config.page_size,
               "KV cache: full_slots = {} holds no page of {} slots; give at least one page",
               config.full_slots, config.page_size);
}

}  // namespace

bool is_swa_hybrid(const ModelSpec& model) {
  bool swa = false, full = false;
  for (const LayerSpec& l : model.layers) {
    if (!l.uses_kv_cache()) continue;
    (is_swa_layer(l) ? swa : full) = true;
  }
  return swa && full;
}

std::unique_ptr<TokenAllocator> make_token_allocator(const ModelSpec& model,
                                                     const KVCacheConfig& config) {
  check_config(config);
  if (!is_swa_hybrid(model)) {
    return std::make_unique<PagedTokenAllocator>(config.full_slots, config.page_size);
  }
  int64_t swa_slots = config.swa_slots;
  if (swa_slots == 0) {
    ATTNRT_CHECK(config.swa_full_tokens_ratio > 0 && std::isfinite(config.swa_full_tokens_ratio),
                 "KV cache: swa_full_tokens_ratio = {} is invalid; it must be > 0 (or set "
                 "swa_slots)",
                 config.swa_full_tokens_ratio);
    swa_slots =
        static_cast<int64_t>(static_cast<double>(config.full_slots) * config.swa_full_tokens_ratio);
  }
  ATTNRT_CHECK(swa_slots >= config.page_size,
               "KV cache: the SWA pool gets {} slots (swa_slots = {}, swa_full_tokens_ratio = {} "
               "of {} full slots), less than one page of {}; give it more slots",
               swa_slots, config.swa_slots, config.swa_full_tokens_ratio, config.full_slots,
               config.page_size);
  return std::make_unique<SWATokenAllocator>(config.full_slots, swa_slots, config.page_size);
}

KVStorage make_host_kv_storage(const ModelSpec& model, const KVCacheConfig& config) {
  KVStorage out;
  out.allocator = make_token_allocator(model, config);
  if (auto* swa = dynamic_cast<SWATokenAllocator*>(out.allocator.get())) {
    out.cache = std::make_unique<HostKVCache>(model, config, swa->full().pool_rows(),
                                              swa->swa().pool_rows(), swa->full_to_swa());
  } else {
    const int64_t rows = static_cast<PagedTokenAllocator&>(*out.allocator).pages().pool_rows();
    out.cache = std::make_unique<HostKVCache>(model, config, rows, 0, nullptr);
  }
  return out;
}

std::unique_ptr<KVCache> make_host_kv_cache(const ModelSpec& model, const KVCacheConfig& config) {
  ATTNRT_CHECK(!is_swa_hybrid(model),
               "make_host_kv_cache: model '{}' mixes sliding-window and full-attention layers; "
               "its SWA pool is only usable with the allocator that keeps the full->SWA mapping, "
               "so build both with make_host_kv_storage",
               model.name);
  return make_host_kv_storage(model, config).cache;
}

void gather_latent_rows(const KVLayerView& kv, int layer_id, std::span<const int32_t> slots,
                        const TensorView& out) {
  ATTNRT_CHECK(kv.device.kind == DeviceKind::cpu,
               "gather_latent_rows: layer {} pool is on {}; latent rows are gathered from host "
               "pools only",
               layer_id, device_name(kv.device));
  ATTNRT_CHECK(kv.k != nullptr && kv.v == kv.k && kv.kv_heads == 1,
               "gather_latent_rows: layer {} is not an MLA latent pool (one kv head, V a view of "
               "the K row)",
               layer_id);
  const int64_t n = static_cast<int64_t>(slots.size());
  ATTNRT_CHECK(out.device.kind == DeviceKind::cpu && is_float(out.dtype) && !is_fp8(out.dtype) &&
                   out.ndim == 3 && out.shape[0] == n && out.shape[1] == 1 &&
                   out.shape[2] == kv.head_dim,
               "gather_latent_rows: out is {}; expected a float (fp32 / fp16 / bf16) [{}, 1, {}] "
               "on cpu (chunk tokens, 1, kv_lora_rank + qk_rope_head_dim)",
               out.describe(), n, kv.head_dim);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = kv.pool_slot(slots[i]);
    ATTNRT_CHECK(slots[i] >= 0 && s >= 0 && s < kv.num_rows,
                 "gather_latent_rows: slot {} (row {}) is outside layer {}'s pool rows [0, {})",
                 slots[i], i, layer_id, kv.num_rows);
  }
  for (int64_t i = 0; i < n; ++i) {
    const size_t row = static_cast<size_t>(kv.pool_slot(slots[i]) * kv.k_row_stride);
    for (int d = 0; d < kv.head_dim; ++d) {
      store_from_float(out.data, out.dtype,
                       static_cast<size_t>(i * out.strides[0] + d * out.strides[2]),
                       load_as_float(kv.k, kv.dtype, row + d) * kv.k_scale);
    }
  }
}

}  // namespace attnrt
