// CudaKVCache: the MHA KV pools in GPU memory (reference-semantics §4.3, §4.4). Per layer K and V
// are token-major [rows, kv_heads, dim] device buffers (fp8 as raw bytes with per-layer scales);
// the step's write slots live in a device buffer at a fixed address (so captured graphs can read
// it), filled by one async copy per step; store_step_kv is a KV-write kernel that quantises to fp8.
// MLA layers hold one latent row per slot (reference-semantics §4.5): V is a view of the first
// v_head_dim columns of K (no V buffer), store_step_kv stores the k rows only, one scale.
//
// SWA-hybrid models (is_swa_hybrid): the sliding-window layers live in a smaller SWA pool of
// swa_rows rows, addressed through the allocator's full->SWA map, which stays the authoritative
// copy on the host. The kernels read SWA keys through a device copy of that map (fixed address,
// KVLayerView::slot_map) and store_step_kv writes SWA layers at the step's translated slots (a
// second fixed-address buffer, KVLayerView::step_write_loc). begin_step checks and translates
// out_cache_loc on the host (StepSlotCheck, as the host cache does), uploads the slots and their
// translations in one async copy, and scatters map_dev[loc[i]] = swa_loc[i] on the GPU; the map is
// never uploaded whole per step and begin_step never waits for the GPU.
//
// Why the device map may lag the host map and still give the kernels the right rows: a kernel
// only needs the map entries of keys it can see, i.e. keys inside some query's window, and every
// such key was written by a step whose begin_step scattered its current entry. The other ways the
// host map changes:
// - alloc_extend / alloc_decode map fresh slots; no kernel reads a slot before the step that
//   writes it, and that step's begin_step scatters the entry first (stream order).
// - free_swa zeroes entries of tokens that left every window; the device keeps the old SWA slot,
//   which may by now hold another token's row. Only masked keys (outside the window, by position)
//   read such an entry, and the row they read is an in-bounds, finite row of the SWA pool.
// - free zeroes whole pages, and a later alloc may give a full slot another SWA slot: as above,
//   the entry is scattered by the step that writes the slot again, before anything reads it.
// - copy_rows moves rows of accepted tree paths: the map does not change; moves are given as
//   full-pool slots and translated through the host map when the call is made, for SWA layers.
// - copy_layer_from_host fills a layer from rows written elsewhere (tests, tooling): for an SWA
//   layer it uploads the whole host map too, since no begin_step of this cache scattered them.
// Every entry the device map ever holds comes from the host map (an SWA slot or 0), so a stale
// entry still lies inside the SWA pool.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "attnrt/memory/kv_cache.h"
#include "backends/cuda/cuda_util.h"

namespace attnrt::cuda {

class CudaKVCache final : public KVCache {
 public:
  // rows = slots including the reserved page 0 (as PageAllocator::pool_rows()). SWA-hybrid models:
  // swa_rows = the SWA pool's rows and full_to_swa = the allocator's map (SWATokenAllocator);
  // without a map (swa_rows 0) every layer lives in the full slot space.
  CudaKVCache(const ModelSpec& model, const KVCacheConfig& config, int64_t rows,
              int64_t swa_rows = 0,
              std::shared_ptr<const std::vector<int64_t>> full_to_swa = nullptr);
  ~CudaKVCache() override;

  KVLayerView layer(int layer_id) const override;
  void begin_step(const ForwardBatch& batch) override;
  // k/v on the GPU are read in place; host tensors are staged through a device scratch first.
  void store_step_kv(int layer_id, const TensorView& k, const TensorView& v) override;
  void set_kv_scales(int layer_id, float k_scale, float v_scale) override;
  // DSA layers (docs/dsa.md): their index-key cache in GPU memory, in the host pool's paged layout
  // (IndexKeyView, device cuda), zeroed at creation; the store quantises a step's index keys on
  // the GPU at the step's write slots (k on the GPU in place, or host k staged), bit for bit as
  // the host pool does. copy_rows moves a DSA layer's index keys with its latent rows.
  IndexKeyView index_keys(int layer_id) const override;
  void store_step_index_k(int layer_id, const TensorView& k) override;
  // A DSA layer's whole index-key cache into host memory (rows * (index_head_dim + 4) bytes, the
  // host pool's layout): tests, tooling. Synchronises the stream.
  void copy_index_keys_to_host(int layer_id, void* dst) const;
  void download_index_keys(int layer_id, void* dst) override {
    copy_index_keys_to_host(layer_id, dst);
  }
  void bind_layer_storage(int layer_id, void* k, void* v) override;
  Device device() const override { return Device::cuda(device_); }
  DType dtype() const override { return dtype_; }
  int page_size() const override { return page_size_; }

  // Full-pool rows; rows(layer_id): the rows of that layer's buffers (swa rows for SWA layers).
  int64_t rows() const { return rows_; }
  int64_t rows(int layer_id) const { return find(layer_id).rows; }
  bool is_swa_hybrid() const { return map_ != nullptr; }
  cudaStream_t stream() const { return stream_; }
  // Moves every later launch and copy to `stream`, which first waits for what the current stream
  // has queued (the pools' zeroing among it).
  void set_stream(cudaStream_t stream);
  void* stream_handle() const override { return stream_; }
  void set_stream_handle(void* stream) override { set_stream(static_cast<cudaStream_t>(stream)); }
  void synchronize() override;
  // cudaMemcpyDefault on the stream, synchronised.
  void copy(void* dst, const void* src, size_t bytes) override;
  const int64_t* step_write_loc() const { return loc_.ptr<int64_t>(); }
  int64_t step_tokens() const { return step_tokens_; }

  // Whole-layer copies between this cache and host memory laid out like KVLayerView (tests,
  // tooling, mirroring a host cache): rows(layer_id) rows. For an SWA layer, copy_layer_from_host
  // also uploads the host full->SWA map (the rows copied are addressed through it). They
  // synchronise the stream.
  void copy_layer_from_host(int layer_id, const void* k, const void* v) override;
  void copy_layer_to_host(int layer_id, void* k, void* v) const;

  // Moves K/V rows inside the pools: in every listed layer, full-pool slot dst takes the row slot
  // src held before the call (every source is read before any destination is written, which is
  // what an in-order copy gives when no move reads a row an earlier move wrote, as for accepted
  // tree paths compacted towards lower positions). Slots must lie in [1, rows); SWA layers move
  // the SWA rows the host map gives both slots, which must have one. Stream-ordered, never
  // synchronises.
  bool can_copy_rows() const override { return true; }
  void copy_rows(std::span<const int> layers,
                 std::span<const std::pair<int64_t, int64_t>> moves) override;
  // Copies the rows `slots` (full-pool slots) of one layer into host memory: k and v point at row
  // 0 of host pools in the full slot space with this cache's row strides (a flat host copy of the
  // cache), and only the listed rows are written. SWA layers: row s receives the SWA row the host
  // map gives s; slots without an SWA slot (released by free_swa) are not written. Gathers on the
  // GPU, so the transfer is the rows' size; synchronises the stream.
  void download_rows(int layer_id, std::span<const int64_t> slots, void* k, void* v) override;

 private:
  struct Layer {
    bool present = false;
    bool latent = false;  // MLA: V is a view of K
    bool swa = false;     // in the SWA pool: rows = swa rows, addressed through the map
    int64_t rows = 0;
    int kv_heads = 0, head_dim = 0, v_head_dim = 0;
    float k_scale = 1.f, v_scale = 1.f;
    DeviceBuffer k, v;     // empty once bound to an engine's memory
    void* kp = nullptr;    // where K / V are: the buffers above, or the engine's memory
    void* vp = nullptr;    // null for MLA layers (V is a view of K)
  };
  const Layer& find(int layer_id) const;
  size_t k_bytes(const Layer& l) const;
  size_t v_bytes(const Layer& l) const;

  int device_ = 0;
  DType dtype_;
  int page_size_;
  int64_t rows_;
  int max_num_tokens_;
  // The SWA rows of full-pool slots (validated: every one has an SWA slot).
  std::vector<int64_t> swa_rows_of(std::span<const int64_t> slots, const char* what) const;
  int64_t* swa_loc() const { return loc_.ptr<int64_t>() + max_num_tokens_; }

  std::vector<Layer> layers_;  // by layer id
  // DSA layers' index keys, by layer id (index_dim_ 0: no indexer).
  std::vector<DeviceBuffer> index_keys_;
  std::vector<int> index_dim_;
  DeviceBuffer index_scratch_;  // staged host index keys; moved keys in copy_rows
  std::shared_ptr<const std::vector<int64_t>> map_;  // host full->SWA map; null: one slot space
  DeviceBuffer map_dev_;  // [rows + 1] int64, fixed address: the device copy of map_
  // [max_num_tokens] int64 write slots, fixed address; SWA-hybrid: then [max_num_tokens] of
  // their SWA slots (swa_loc()).
  DeviceBuffer loc_;
  StepSlotCheck check_;
  DeviceBuffer scratch_;       // host k/v staged for the store kernel
  DeviceBuffer row_index_;     // slot lists of copy_rows / download_rows
  DeviceBuffer row_scratch_;   // rows gathered by copy_rows / download_rows
  PinnedBuffer row_host_;      // download_rows' rows on their way to the host
  StagingRing staging_;
  int64_t step_tokens_ = -1;
  cudaStream_t stream_ = nullptr;
  cudaStream_t own_stream_ = nullptr;  // created here; destroyed here even after set_stream
};

// A CUDA KV cache and its allocator (make_token_allocator: a PagedTokenAllocator, or for
// SWA-hybrid models an SWATokenAllocator whose map the cache shares), the device counterpart of
// make_host_kv_storage. Throws attnrt::Error when no CUDA device is usable.
KVStorage make_cuda_kv_storage(const ModelSpec& model, const KVCacheConfig& config);

}  // namespace attnrt::cuda
