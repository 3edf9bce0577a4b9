// KV caches: token-major per-layer K and V buffers (reference-semantics §4.3, §4.4) and the MLA
// latent rows (§4.5).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "attnrt/core/tensor.h"
#include "attnrt/memory/index_key_cache.h"
#include "attnrt/memory/layer_index.h"
#include "attnrt/memory/token_allocator.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

struct ForwardBatch;

// What a backend reads for one layer. Row `s` of K is at k + s * k_row_stride elements
// ([kv_heads, head_dim] contiguous), likewise V. MLA layers (one kv head) have no V storage: v == k,
// v_row_stride == k_row_stride, and V is the first v_head_dim columns of the K row; v_scale ==
// k_scale, since both read the same stored values.
struct KVLayerView {
  void* k = nullptr;
  void* v = nullptr;
  DType dtype = DType::bf16;  // storage dtype (fp8 stored as raw bytes)
  Device device;
  int64_t num_rows = 0;  // slots, including the reserved rows
  int kv_heads = 0, head_dim = 0, v_head_dim = 0;
  int64_t k_row_stride = 0, v_row_stride = 0;
  float k_scale = 1.f, v_scale = 1.f;
  // SWA layers: full-pool slot -> this pool's slot (0 = no slot; length full rows + 1, last = -1).
  // nullptr = identity (full-attention layers).
  const int64_t* slot_map = nullptr;
  int64_t slot_map_rows = 0;  // full-pool rows; slot_map[slot_map_rows] == -1
  // This step's write slots in this pool's slot space ([num_tokens]), translated once per step.
  const int64_t* step_write_loc = nullptr;
  // True when the layer lives in the SWA pool of an SWA-hybrid cache (slot_map is set). Whether a
  // layer attends over a window is the LayerSpec's business, not this flag's.
  bool is_swa = false;

  // A full-pool slot (as stored in req_to_token / out_cache_loc) in this pool's slot space; -1
  // stays -1. The caller guarantees -1 <= full_slot < slot_map_rows.
  int64_t pool_slot(int64_t full_slot) const {
    if (slot_map == nullptr) return full_slot;
    return slot_map[full_slot < 0 ? slot_map_rows : full_slot];
  }
};

class KVCache {
 public:
  virtual ~KVCache() = default;
  virtual KVLayerView layer(int layer_id) const = 0;
  // Per step, once, before any layer: translation of out_cache_loc for SWA layers (into a
  // preallocated buffer) and validation of the step's slots. Throws attnrt::Error on a bad slot.
  virtual void begin_step(const ForwardBatch& batch) = 0;
  // Stores k [T, Hkv, Dqk] and v [T, Hkv, Dv] (any float dtype; quantised with the layer's scale
  // for fp8) at the step's write slots of this layer. Checks shapes and slots before writing
  // anything. MLA layers store the k rows only; v is not read and may be empty (§4.5).
  virtual void store_step_kv(int layer_id, const TensorView& k, const TensorView& v) = 0;
  // fp8 (and any other dtype): stored = round(x / scale); readers multiply by the scale. 1 by
  // default. Scales must be finite and > 0. An MLA layer has one scale (V reads K's stored row):
  // v_scale must equal k_scale.
  virtual void set_kv_scales(int layer_id, float k_scale, float v_scale);
  // DSA layers (docs/dsa.md): the layer's index-key cache, and the store of this step's index keys
  // k [T, index_head_dim] (any float dtype; quantised per token) at the step's write slots, which
  // checks k and the slots before writing anything. The defaults throw: the cache keeps no index
  // keys (the host cache keeps them for every layer with an indexer).
  virtual IndexKeyView index_keys(int layer_id) const;
  virtual void store_step_index_k(int layer_id, const TensorView& k);
  // Fills layer `layer_id`'s index-key cache with the bytes of a host one laid out the same way
  // (index_keys(layer_id): num_rows slots, docs/dsa.md "The index-key cache"): a device mirror of
  // a host cache, for tests and tools. Complete on return; throws where index_keys does.
  void copy_index_keys_from_host(int layer_id, const void* src);
  virtual Device device() const = 0;
  virtual DType dtype() const = 0;
  virtual int page_size() const = 0;
  // An engine that owns its KV pools: layer `layer_id` reads and writes K at k and V at v from now
  // on, memory laid out as layer(layer_id) describes it (num_rows rows of k_row_stride / v_row_stride
  // elements of dtype(), on device()); the cache's own buffers of that layer are released. MLA
  // layers: v must equal k. The memory must outlive the cache and hold finite values in rows no step
  // wrote (padded rows read them). Throws attnrt::Error for a layer in an SWA slot space (the
  // engine's slots would not be this cache's). The caller checks shapes (AttentionRuntime does).
  virtual void bind_layer_storage(int layer_id, void* k, void* v);

  // The device side, for the layers above (the runtime, the tools) that do not know the device.
  // A device cache orders its work, and its backends', on a stream: stream_handle() (nullptr on
  // the host, and for the device's default stream); set_stream_handle moves it after what it has
  // queued. synchronize() waits for that stream; copy() moves `bytes` between host or device
  // buffers after it, complete on return.
  virtual void* stream_handle() const { return nullptr; }
  virtual void set_stream_handle(void* stream) { (void)stream; }
  virtual void synchronize() {}
  virtual void copy(void* dst, const void* src, size_t bytes);
  // Copies every K/V row of `moves` (full-pool slot from -> to) in `layers`; every source is read
  // before any destination is written. Throws attnrt::Error for a slot outside the pool, and where
  // can_copy_rows() is false (a device cache without a row copy).
  virtual bool can_copy_rows() const { return device().kind == DeviceKind::cpu; }
  virtual void copy_rows(std::span<const int> layers,
                         std::span<const std::pair<int64_t, int64_t>> moves);
  // Whole-layer upload of host memory laid out as layer(layer_id) (num_rows rows).
  virtual void copy_layer_from_host(int layer_id, const void* k, const void* v);
  // Copies the rows `slots` (full-pool slots) of one layer into host memory laid out as
  // layer(layer_id) in the full slot space (a host mirror of a device pool). Throws attnrt::Error
  // on the host, where the pool itself is host memory.
  virtual void download_rows(int layer_id, std::span<const int64_t> slots, void* k, void* v);
  // A DSA layer's whole index-key cache into host memory laid out as index_keys(layer_id) (the
  // host mirror of a device pool, docs/dsa.md). Throws attnrt::Error on the host.
  virtual void download_index_keys(int layer_id, void* dst);
};

// The per-layer storage of one slot space; the KV cache routes each layer to one of these.
class TokenToKVPool {
 public:
  virtual ~TokenToKVPool() = default;
  virtual bool holds(int layer_id) const = 0;
  virtual KVLayerView layer(int layer_id) const = 0;
  virtual void set_scales(int layer_id, float k_scale, float v_scale) = 0;
  // KVCache::bind_layer_storage for a layer of this pool.
  virtual void bind_storage(int layer_id, void* k, void* v) = 0;
  // Writes rows `loc` (slots in this pool); validates all slots and shapes first.
  virtual void set_kv_buffer(int layer_id, std::span<const int64_t> loc, const TensorView& k,
                             const TensorView& v) = 0;
  virtual int64_t rows() const = 0;
  virtual DType dtype() const = 0;
  virtual size_t bytes() const = 0;
};

// One pool for a set of full / sliding-window layers, each with its own [kv_heads, head_dim,
// v_head_dim]: separate K and V buffers per layer (reference-semantics §4.3).
class MHATokenToKVPool final : public TokenToKVPool {
 public:
  // rows = slots including the reserved page; layer_ids = the global ids this pool holds.
  MHATokenToKVPool(int64_t rows, DType dtype, const std::vector<LayerSpec>& layers);

  bool holds(int layer_id) const override;
  KVLayerView layer(int layer_id) const override;
  void set_scales(int layer_id, float k_scale, float v_scale) override;
  void bind_storage(int layer_id, void* k, void* v) override;
  void set_kv_buffer(int layer_id, std::span<const int64_t> loc, const TensorView& k,
                     const TensorView& v) override;
  int64_t rows() const override { return rows_; }
  DType dtype() const override { return dtype_; }
  size_t bytes() const override;

 private:
  struct Layer {
    int layer_id;
    int kv_heads, head_dim, v_head_dim;
    float k_scale = 1.f, v_scale = 1.f;
    HostBuffer k, v;        // empty once bound to an engine's memory
    void* kp = nullptr;     // where K / V are: the buffers above, or the engine's memory
    void* vp = nullptr;
  };
  const Layer& find(int layer_id) const;
  Layer& find(int layer_id) { return const_cast<Layer&>(std::as_const(*this).find(layer_id)); }
  int64_t rows_;
  DType dtype_;
  std::vector<Layer> layers_;
  LayerIndex index_;  // global layer id -> index in layers_
};

// The MLA latent pool (reference-semantics §4.5): per layer one row of kv_lora_rank +
// qk_rope_head_dim elements per slot (one kv head). K is the row; V is a view of its first
// kv_lora_rank columns (same pointer and row stride), so there is no V storage. set_kv_buffer
// stores the k rows (divided by the layer's scale, then cast: fp8 like MHA) and does not read v.
class MLATokenToKVPool final : public TokenToKVPool {
 public:
  MLATokenToKVPool(int64_t rows, DType dtype, const std::vector<LayerSpec>& layers);

  bool holds(int layer_id) const override;
  KVLayerView layer(int layer_id) const override;
  // One scale per layer: v_scale must equal k_scale (V is dequantised from K's stored values).
  void set_scales(int layer_id, float k_scale, float v_scale) override;
  void bind_storage(int layer_id, void* k, void* v) override;
  void set_kv_buffer(int layer_id, std::span<const int64_t> loc, const TensorView& k,
                     const TensorView& v) override;
  int64_t rows() const override { return rows_; }
  DType dtype() const override { return dtype_; }
  size_t bytes() const override;

 private:
  struct Layer {
    int layer_id;
    int row_dim, v_dim;  // kv_lora_rank + qk_rope_head_dim, kv_lora_rank
    float scale = 1.f;
    HostBuffer kv;        // empty once bound to an engine's memory
    void* kvp = nullptr;  // where the rows are: kv above, or the engine's memory
  };
  const Layer& find(int layer_id) const;
  int64_t rows_;
  DType dtype_;
  std::vector<Layer> layers_;
  LayerIndex index_;  // global layer id -> index in layers_
};

// The checks every KV cache makes on a step's out_cache_loc, and its translation into SWA-pool
// slots (reference-semantics §4.4): each slot lies in [0, full_rows), no slot but the dummy 0
// appears twice, and with a full->SWA map every slot but 0 has an SWA slot. The host and the device
// caches share it, so both reject the same steps with the same messages.
class StepSlotCheck {
 public:
  // `who` starts every message ("KV cache", "CUDA KV cache"). full_to_swa: null = one slot space.
  StepSlotCheck(const char* who, int64_t full_rows,
                std::shared_ptr<const std::vector<int64_t>> full_to_swa);
  // Throws attnrt::Error naming the first bad entry (index and value). With a map, writes the
  // SWA slot of every entry to swa[0 .. loc.size()), and only once every entry is valid.
  void operator()(std::span<const int64_t> loc, int64_t* swa);

 private:
  const char* who_;
  int64_t full_rows_;
  std::shared_ptr<const std::vector<int64_t>> map_;
  std::vector<uint32_t> seen_;  // [full rows]: epoch of the step that last wrote each slot
  uint32_t epoch_ = 0;
};

// The latent rows of an MLA layer's pool at `slots` (full-pool slots), dequantised (stored value
// times the layer's scale) into out [slots.size(), 1, row dim] of a float dtype (fp8 excluded), in
// host memory, row i from slots[i] (docs/mla.md: a prefix chunk for the model to decompress).
// Throws attnrt::Error, writing nothing, for a device pool, a layer with separate V storage, a
// bad shape or dtype, or a slot outside the pool.
void gather_latent_rows(const KVLayerView& kv, int layer_id, std::span<const int32_t> slots,
                        const TensorView& out);

// Builds the KV cache a model needs on the host: a single MHA pool, or a full pool plus a smaller
// SWA pool when the model mixes sliding-window and full layers.
struct KVCacheConfig {
  int64_t full_slots = 0;  // usable slots of the full pool
  int64_t swa_slots = 0;   // usable slots of the SWA pool (0 = derive: swa_full_tokens_ratio)
  double swa_full_tokens_ratio = 0.8;
  int page_size = 1;
  DType dtype = DType::bf16;
  int max_num_tokens = 8192;  // size of the per-step translated write-slot buffer
};
// SWA-hybrid models need the allocator that keeps the full->SWA mapping: use make_host_kv_storage
// for them (this throws and says so). Linear-attention layers have no KV (a hybrid linear model's
// cache holds its attention layers only, §4.6); MLA layers get an MLATokenToKVPool in the full slot
// space.
std::unique_ptr<KVCache> make_host_kv_cache(const ModelSpec& model, const KVCacheConfig& config);

// The allocator and the KV cache of a model, built together so that an SWA-hybrid cache and its
// SWATokenAllocator share the full->SWA mapping. Plain models get a PagedTokenAllocator over
// config.full_slots; the cache's pools have allocator rows (page 0 reserved).
struct KVStorage {
  std::unique_ptr<TokenAllocator> allocator;
  std::unique_ptr<KVCache> cache;
};
KVStorage make_host_kv_storage(const ModelSpec& model, const KVCacheConfig& config);

// The allocator of make_host_kv_storage, for a device cache built beside it: an SWATokenAllocator
// (full pool of config.full_slots, SWA pool of config.swa_slots or swa_full_tokens_ratio of it)
// for SWA-hybrid models, a PagedTokenAllocator over config.full_slots otherwise. Validates the
// config (page size, dtype, slot counts) with the messages of make_host_kv_storage.
std::unique_ptr<TokenAllocator> make_token_allocator(const ModelSpec& model,
                                                     const KVCacheConfig& config);

// True when the model has both sliding-window layers (LayerKind::swa or sliding_window >= 0) and
// full-attention layers with a KV cache, i.e. it needs the SWA-hybrid cache.
bool is_swa_hybrid(const ModelSpec& model);

}  // namespace attnrt
