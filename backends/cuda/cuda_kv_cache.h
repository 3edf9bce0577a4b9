// CudaKVCache: the MHA KV pools in GPU memory (reference-semantics §4.3). Per layer K and V are
// token-major [rows, kv_heads, dim] device buffers (fp8 as raw bytes with per-layer scales); the
// step's write slots live in a device buffer at a fixed address (so captured graphs can read it),
// filled by one async copy per step; store_step_kv is a KV-write kernel that quantises to fp8.
//
// Sliding-window layers share the full slot space (no separate SWA pool yet): correct, since the
// window is applied by the kernels on positions, but it spends full-pool memory on those layers.
// MLA layers hold one latent row per slot (reference-semantics §4.5): V is a view of the first
// v_head_dim columns of K (no V buffer), store_step_kv stores the k rows only, one scale.
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
  // rows = slots including the reserved page 0 (as PageAllocator::pool_rows()).
  CudaKVCache(const ModelSpec& model, const KVCacheConfig& config, int64_t rows);
  ~CudaKVCache() override;

  KVLayerView layer(int layer_id) const override;
  void begin_step(const ForwardBatch& batch) override;
  // k/v on the GPU are read in place; host tensors are staged through a device scratch first.
  void store_step_kv(int layer_id, const TensorView& k, const TensorView& v) override;
  void set_kv_scales(int layer_id, float k_scale, float v_scale) override;
  Device device() const override { return Device::cuda(device_); }
  DType dtype() const override { return dtype_; }
  int page_size() const override { return page_size_; }

  int64_t rows() const { return rows_; }
  cudaStream_t stream() const { return stream_; }
  void set_stream(cudaStream_t stream) { stream_ = stream; }
  const int64_t* step_write_loc() const { return loc_.ptr<int64_t>(); }
  int64_t step_tokens() const { return step_tokens_; }

  // Whole-layer copies between this cache and host memory laid out like KVLayerView (tests,
  // tooling, mirroring a host cache). They synchronise the stream.
  void copy_layer_from_host(int layer_id, const void* k, const void* v);
  void copy_layer_to_host(int layer_id, void* k, void* v) const;

  // Moves K/V rows inside the pools: in every listed layer, full-pool slot dst takes the row slot
  // src held before the call (every source is read before any destination is written, which is
  // what an in-order copy gives when no move reads a row an earlier move wrote, as for accepted
  // tree paths compacted towards lower positions). Slots must lie in [1, rows). Stream-ordered,
  // never synchronises.
  void copy_rows(std::span<const int> layers, std::span<const std::pair<int64_t, int64_t>> moves);
  // Copies the rows `slots` of one layer into host memory laid out like layer(layer_id): k and v
  // point at row 0 of host pools with this cache's row strides, and only the listed rows are
  // written. Gathers on the GPU, so the transfer is the rows' size; synchronises the stream.
  void download_rows(int layer_id, std::span<const int64_t> slots, void* k, void* v);

 private:
  struct Layer {
    bool present = false;
    bool latent = false;  // MLA: V is a view of K
    int kv_heads = 0, head_dim = 0, v_head_dim = 0;
    float k_scale = 1.f, v_scale = 1.f;
    DeviceBuffer k, v;
  };
  const Layer& find(int layer_id) const;
  size_t k_bytes(const Layer& l) const;
  size_t v_bytes(const Layer& l) const;

  int device_ = 0;
  DType dtype_;
  int page_size_;
  int64_t rows_;
  int max_num_tokens_;
  std::vector<Layer> layers_;  // by layer id
  DeviceBuffer loc_;           // [max_num_tokens] int64, fixed address
  DeviceBuffer scratch_;       // host k/v staged for the store kernel
  DeviceBuffer row_index_;     // slot lists of copy_rows / download_rows
  DeviceBuffer row_scratch_;   // rows gathered by copy_rows / download_rows
  PinnedBuffer row_host_;      // download_rows' rows on their way to the host
  StagingRing staging_;
  int64_t step_tokens_ = -1;
  cudaStream_t stream_ = nullptr;
  cudaStream_t own_stream_ = nullptr;  // created here; destroyed here even after set_stream
};

// A CUDA KV cache and its allocator (a PagedTokenAllocator over config.full_slots), the device
// counterpart of make_host_kv_storage. Throws attnrt::Error when no CUDA device is usable.
KVStorage make_cuda_kv_storage(const ModelSpec& model, const KVCacheConfig& config);

}  // namespace attnrt::cuda
