#include "backends/cuda/cuda_kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

CudaKVCache::CudaKVCache(const ModelSpec& model, const KVCacheConfig& config, int64_t rows,
                         int64_t swa_rows, std::shared_ptr<const std::vector<int64_t>> full_to_swa)
    : dtype_(config.dtype),
      page_size_(config.page_size),
      rows_(rows),
      max_num_tokens_(config.max_num_tokens),
      map_(std::move(full_to_swa)),
      check_("CUDA KV cache", rows, map_) {
  const CudaDeviceInfo& info = query_cuda();
  ATTNRT_CHECK(info.usable, "CUDA KV cache: no usable CUDA device ({})", info.reason);
  ATTNRT_CHECK(dtype_ == DType::bf16 || dtype_ == DType::f16 || is_fp8(dtype_),
               "CUDA KV cache: dtype {} is not supported; use bf16, fp16, fp8_e4m3 or fp8_e5m2",
               dtype_name(dtype_));
  ATTNRT_CHECK(max_num_tokens_ > 0, "CUDA KV cache: max_num_tokens = {}; it must be > 0",
               max_num_tokens_);
  // The MLA CTAs' copies index pool rows in 32 bits (mla_tile.cuh: one wide multiply a row).
  ATTNRT_CHECK(rows_ <= INT32_MAX && swa_rows <= INT32_MAX,
               "CUDA KV cache: {} rows ({} SWA rows); the cuda kernels take at most 2^31 - 1; "
               "use fewer tokens (max_num_tokens) per pool",
               rows_, swa_rows);
  ATTNRT_CHECK(map_ == nullptr || (swa_rows > 0 && static_cast<int64_t>(map_->size()) == rows + 1),
               "CUDA KV cache: the full->SWA map has {} entries and the SWA pool {} rows; an "
               "SWA-hybrid cache needs {} entries (full rows + 1) and at least one SWA row",
               map_ == nullptr ? 0 : map_->size(), swa_rows, rows + 1);
  ATTNRT_CUDA_CHECK(cudaGetDevice(&device_));
  // The stream comes first: every initialisation below is enqueued on it. A plain cudaMemset or
  // cudaMemcpy would run on the legacy default stream, which this non-blocking stream does not
  // wait for, so a zeroing still queued there (behind other work on the GPU) could land after the
  // first steps stored their K/V.
  ATTNRT_CUDA_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
  stream_ = own_stream_;
  int max_id = -1;
  for (const LayerSpec& l : model.layers) max_id = std::max(max_id, l.layer_id);
  layers_.resize(static_cast<size_t>(max_id + 1));
  for (const LayerSpec& l : model.layers) {
    if (!l.uses_kv_cache()) continue;
    Layer& e = layers_[l.layer_id];
    e.present = true;
    e.latent = l.kind == LayerKind::mla;
    e.swa = map_ != nullptr && !e.latent &&
            (l.kind == LayerKind::swa || l.sliding_window >= 0);  // as the host cache routes
    e.rows = e.swa ? swa_rows : rows_;
    e.kv_heads = l.num_kv_heads;
    e.head_dim = l.head_dim;
    e.v_head_dim = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
    ATTNRT_CHECK(!e.latent || (e.kv_heads == 1 && e.v_head_dim <= e.head_dim),
                 "CUDA KV cache: mla layer {} has {} kv heads, head_dim {}, v_head_dim {}; the "
                 "latent pool holds one kv head whose first v_head_dim columns are V",
                 l.layer_id, e.kv_heads, e.head_dim, e.v_head_dim);
    e.k.reserve(k_bytes(e));
    // Unwritten rows are read by padded graph rows and masked keys: keep them finite.
    ATTNRT_CUDA_CHECK(cudaMemsetAsync(e.k.data(), 0, k_bytes(e), stream_));
    if (!e.latent) {
      e.v.reserve(v_bytes(e));
      ATTNRT_CUDA_CHECK(cudaMemsetAsync(e.v.data(), 0, v_bytes(e), stream_));
    }
    e.kp = e.k.data();
    e.vp = e.v.data();  // null for MLA layers: V is a view of K
  }
  index_keys_.resize(layers_.size());
  index_dim_.assign(layers_.size(), 0);
  for (const LayerSpec& l : model.layers) {
    if (!l.has_indexer()) continue;
    ATTNRT_CHECK(rows_ % page_size_ == 0 && l.indexer.index_head_dim > 0,
                 "CUDA KV cache: DSA layer {}: {} rows in pages of {} with index_head_dim {}; the "
                 "index-key cache needs whole pages and a positive index_head_dim",
                 l.layer_id, rows_, page_size_, l.indexer.index_head_dim);
    index_dim_[l.layer_id] = l.indexer.index_head_dim;
    const size_t bytes = static_cast<size_t>(rows_) * (l.indexer.index_head_dim + 4);
    index_keys_[l.layer_id].reserve(bytes);
    // Never-written slots read as key 0 with scale 0, as on the host.
    ATTNRT_CUDA_CHECK(cudaMemsetAsync(index_keys_[l.layer_id].data(), 0, bytes, stream_));
  }
  loc_.reserve(static_cast<size_t>(max_num_tokens_) * sizeof(int64_t) * (map_ ? 2 : 1));
  if (map_ != nullptr) {
    const size_t bytes = map_->size() * sizeof(int64_t);
    map_dev_.reserve(bytes);
    // map_ is pageable and lives as long as this cache: the copy has its bytes when it returns.
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(map_dev_.data(), map_->data(), bytes, cudaMemcpyHostToDevice, stream_));
  }
}

void CudaKVCache::bind_layer_storage(int layer_id, void* k, void* v) {
  Layer& e = const_cast<Layer&>(find(layer_id));
  ATTNRT_CHECK(!e.swa,
               "CUDA KV cache: layer {} lives in the sliding-window slot space of an SWA-hybrid "
               "cache, whose slots attnrt's allocator maps; an engine's own buffers can back "
               "full-slot-space layers only",
               layer_id);
  ATTNRT_CHECK(k != nullptr && (e.latent ? v == k : v != nullptr),
               "CUDA KV cache: layer {}: {}", layer_id,
               e.latent ? "v must be k (V is the first kv_lora_rank columns of the latent row)"
                        : "k and v must both point at the engine's buffers");
  // The zeroing of the own buffers may still be queued: free them in stream order.
  ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  e.k = DeviceBuffer();
  e.v = DeviceBuffer();
  e.kp = k;
  e.vp = e.latent ? nullptr : v;
}

void CudaKVCache::set_stream(cudaStream_t stream) {
  if (!stream_is_capturing(stream)) order_after(stream, stream_);  // see CudaBackend::set_stream
  stream_ = stream;
}

void CudaKVCache::synchronize() { ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void CudaKVCache::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  ATTNRT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

CudaKVCache::~CudaKVCache() {
  cudaStreamSynchronize(stream_);
  if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
}

size_t CudaKVCache::k_bytes(const Layer& l) const {
  return static_cast<size_t>(l.rows) * l.kv_heads * l.head_dim * dtype_size(dtype_);
}
size_t CudaKVCache::v_bytes(const Layer& l) const {
  if (l.latent) return 0;
  return static_cast<size_t>(l.rows) * l.kv_heads * l.v_head_dim * dtype_size(dtype_);
}

const CudaKVCache::Layer& CudaKVCache::find(int layer_id) const {
  ATTNRT_CHECK(layer_id >= 0 && static_cast<size_t>(layer_id) < layers_.size(),
               "CUDA KV cache: layer {} does not exist; the model has layers 0..{}", layer_id,
               static_cast<int64_t>(layers_.size()) - 1);
  const Layer& e = layers_[layer_id];
  ATTNRT_CHECK(e.present, "CUDA KV cache: layer {} has no KV cache (linear-attention layer)",
               layer_id);
  return e;
}

KVLayerView CudaKVCache::layer(int layer_id) const {
  const Layer& e = find(layer_id);
  KVLayerView v;
  v.k = e.kp;
  v.v = e.latent ? e.kp : e.vp;
  v.dtype = dtype_;
  v.device = device();
  v.num_rows = e.rows;
  v.kv_heads = e.kv_heads;
  v.head_dim = e.head_dim;
  v.v_head_dim = e.v_head_dim;
  v.k_row_stride = static_cast<int64_t>(e.kv_heads) * e.head_dim;
  v.v_row_stride = e.latent ? v.k_row_stride : static_cast<int64_t>(e.kv_heads) * e.v_head_dim;
  v.k_scale = e.k_scale;
  v.v_scale = e.latent ? e.k_scale : e.v_scale;
  v.step_write_loc = step_tokens_ >= 0 ? loc_.ptr<int64_t>() : nullptr;
  if (e.swa) {
    v.slot_map = map_dev_.ptr<int64_t>();
    v.slot_map_rows = rows_;
    v.is_swa = true;
    if (step_tokens_ >= 0) v.step_write_loc = swa_loc();
  }
  return v;
}

void CudaKVCache::begin_step(const ForwardBatch& batch) {
  step_tokens_ = -1;
  const int64_t tokens = batch.num_tokens();
  ATTNRT_CHECK(tokens <= max_num_tokens_,
               "CUDA KV cache: the step has {} tokens but the cache was built for at most "
               "max_num_tokens = {}; raise KVCacheConfig::max_num_tokens",
               tokens, max_num_tokens_);
  // Staged as [loc | SWA slots]: the check writes the translation next to the slots, and throws
  // before anything is enqueued. Stream order: the pinned slot is written only after the copy that
  // last read it ran (StagingRing::acquire); the copy into loc_ is enqueued on stream_ before the
  // step's store kernels (and the scatter into the device map), which read loc_ in stream order.
  const size_t bytes = static_cast<size_t>(tokens) * sizeof(int64_t);
  auto* host = static_cast<int64_t*>(staging_.acquire(bytes * (map_ ? 2 : 1), stream_));
  check_(batch.out_cache_loc, host + tokens);
  if (bytes > 0) std::memcpy(host, batch.out_cache_loc.data(), bytes);
  // A DCP rank's batch (docs/dcp.md): a query on the dummy slot 0 is no key of this rank; its K/V
  // are stored nowhere (slot -1: the store and scatter kernels skip it).
  if (batch.dcp_partial) {
    for (int64_t t = 0; t < tokens; ++t) {
      if (host[t] != 0) continue;
      host[t] = -1;
      if (map_ != nullptr) host[tokens + t] = -1;
    }
  }
  if (map_ == nullptr) {
    staging_.upload(loc_.data(), bytes, stream_);
  } else if (tokens > 0) {
    // One copy of both rows; then the device map learns the step's slots (see the header).
    staging_.upload_rows(loc_.data(), static_cast<size_t>(max_num_tokens_) * sizeof(int64_t), bytes,
                         2, stream_);
    ATTNRT_CUDA_CHECK(launch_scatter_slots(map_dev_.ptr<int64_t>(), loc_.ptr<int64_t>(), swa_loc(),
                                           tokens, stream_));
  }
  step_tokens_ = tokens;
}

namespace {

void check_step_tensor(const char* what, const TensorView& t, int64_t tokens, int heads, int dim,
                       int layer_id) {
  ATTNRT_CHECK(t.data != nullptr && t.ndim == 3 && t.shape[0] == tokens && t.shape[1] == heads &&
                   t.shape[2] == dim,
               "CUDA KV cache: store_step_kv(layer {}): {} is {}; expected [{}, {}, {}] (tokens, "
               "kv heads, dim)",
               layer_id, what, t.empty() ? std::string("empty") : t.describe(), tokens, heads, dim);
  ATTNRT_CHECK(t.dtype == DType::f32 || t.dtype == DType::f16 || t.dtype == DType::bf16,
               "CUDA KV cache: store_step_kv(layer {}): {} is {}; expected fp32, fp16 or bf16",
               layer_id, what, t.describe());
  ATTNRT_CHECK(t.strides[2] == 1,
               "CUDA KV cache: store_step_kv(layer {}): {} has stride {} in its last dim; the "
               "last dim must be contiguous",
               layer_id, what, t.strides[2]);
}

}  // namespace

void CudaKVCache::store_step_kv(int layer_id, const TensorView& k, const TensorView& v) {
  const Layer& e = find(layer_id);
  ATTNRT_CHECK(step_tokens_ >= 0,
               "CUDA KV cache: store_step_kv(layer {}): no step has begun; call begin_step(batch) "
               "first",
               layer_id);
  check_step_tensor("k", k, step_tokens_, e.kv_heads, e.head_dim, layer_id);
  // MLA: the latent k rows are K and V; v is not read (§4.5).
  if (!e.latent) check_step_tensor("v", v, step_tokens_, e.kv_heads, e.v_head_dim, layer_id);
  if (step_tokens_ == 0) return;
  auto device_view = [&](const TensorView& t, size_t offset) -> std::pair<const void*, TensorView> {
    if (t.device.kind == DeviceKind::cuda) return {t.data, t};
    ATTNRT_CHECK(t.is_contiguous(),
                 "CUDA KV cache: store_step_kv(layer {}): host tensor {} must be contiguous",
                 layer_id, t.describe());
    const size_t bytes = static_cast<size_t>(t.numel()) * dtype_size(t.dtype);
    char* dst = scratch_.ptr<char>() + offset;
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(dst, t.data, bytes, cudaMemcpyHostToDevice, stream_));
    return {dst, t};
  };
  const size_t kb = k.device.kind == DeviceKind::cuda
                        ? 0
                        : (static_cast<size_t>(k.numel()) * dtype_size(k.dtype) + 255) / 256 * 256;
  const size_t vb = e.latent || v.device.kind == DeviceKind::cuda
                        ? 0
                        : static_cast<size_t>(v.numel()) * dtype_size(v.dtype);
  // Stream order: host k / v are copied on stream_ into scratch_ before the store kernels that read
  // it (a later layer's copy into scratch_ comes after them), and the call returns only once the
  // copies ran (below), so the caller may reuse a pinned source.
  if (kb + vb > 0) scratch_.reserve(kb + vb);
  const auto [kp, kt] = device_view(k, 0);
  StoreParams p{};
  p.dst_dtype = static_cast<int32_t>(dtype_);
  p.loc = e.swa ? swa_loc() : loc_.ptr<int64_t>();
  p.num_tokens = step_tokens_;
  p.heads = e.kv_heads;
  // Rows of `src` (a device view of `t`) into the pool at `dst`, `dim` wide, divided by `scale`.
  auto set_rows = [&](const void* src, const TensorView& t, void* dst, int dim, float scale) {
    p.src = src;
    p.src_stride_tok = t.strides[0];
    p.src_stride_head = t.strides[1];
    p.src_dtype = static_cast<int32_t>(t.dtype);
    p.dst = dst;
    p.dst_row_stride = static_cast<int64_t>(e.kv_heads) * dim;
    p.dim = dim;
    p.scale = scale;
  };
  set_rows(kp, kt, e.kp, e.head_dim, e.k_scale);
  ATTNRT_CUDA_CHECK(launch_store_kv(p, stream_, /*dependent=*/false));
  // Host k / v are read by copies on the stream; a pinned source is read when the copy runs, so
  // the caller may reuse it only once they ran: the store returns after them.
  const bool host_source = kb + vb > 0;
  if (e.latent) {
    if (host_source) ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  // The V store overlaps the K store (launch_store_kv's `dependent`) unless a copy of host rows
  // comes between them.
  const bool v_on_device = v.device.kind == DeviceKind::cuda;
  const auto [vp, vt] = device_view(v, kb);
  set_rows(vp, vt, e.vp, e.v_head_dim, e.v_scale);
  ATTNRT_CUDA_CHECK(launch_store_kv(p, stream_, /*dependent=*/v_on_device));
  if (host_source) ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaKVCache::set_kv_scales(int layer_id, float k_scale, float v_scale) {
  const Layer& e = find(layer_id);
  ATTNRT_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
               "CUDA KV cache: layer {} scales k = {}, v = {}; scales must be finite and > 0",
               layer_id, k_scale, v_scale);
  ATTNRT_CHECK(!e.latent || v_scale == k_scale,
               "CUDA KV cache: layer {} scales k = {}, v = {}; an mla layer's V is a view of its "
               "stored K row, so it has one scale: pass v_scale = k_scale",
               layer_id, k_scale, v_scale);
  layers_[layer_id].k_scale = k_scale;
  layers_[layer_id].v_scale = v_scale;
}

IndexKeyView CudaKVCache::index_keys(int layer_id) const {
  find(layer_id);
  ATTNRT_CHECK(index_dim_[layer_id] > 0,
               "CUDA KV cache: layer {} has no index-key cache (only DSA layers, with an indexer, "
               "have one)",
               layer_id);
  IndexKeyView v;
  v.data = index_keys_[layer_id].ptr<uint8_t>();
  v.device = device();
  v.num_rows = rows_;
  v.page_size = page_size_;
  v.dim = index_dim_[layer_id];
  return v;
}

void CudaKVCache::store_step_index_k(int layer_id, const TensorView& k) {
  const IndexKeyView v = index_keys(layer_id);
  ATTNRT_CHECK(step_tokens_ >= 0,
               "CUDA KV cache: store_step_index_k(layer {}): no step has begun; call "
               "begin_step(batch) first",
               layer_id);
  ATTNRT_CHECK(k.data != nullptr && k.ndim == 2 && k.shape[0] == step_tokens_ &&
                   k.shape[1] == v.dim &&
                   (k.dtype == DType::f32 || k.dtype == DType::f16 || k.dtype == DType::bf16) &&
                   k.strides[1] == 1,
               "CUDA KV cache: store_step_index_k(layer {}): index k is {}; expected fp32, fp16 "
               "or bf16 [{}, {}] (tokens, index_head_dim) with a contiguous last dim",
               layer_id, k.empty() ? std::string("empty") : k.describe(), step_tokens_, v.dim);
  if (step_tokens_ == 0) return;
  const void* src = k.data;
  int64_t stride = k.strides[0];
  const bool host = k.device.kind != DeviceKind::cuda;
  if (host) {
    ATTNRT_CHECK(k.is_contiguous(),
                 "CUDA KV cache: store_step_index_k(layer {}): host tensor {} must be contiguous",
                 layer_id, k.describe());
    const size_t bytes = static_cast<size_t>(k.numel()) * dtype_size(k.dtype);
    index_scratch_.reserve_async(bytes, stream_);
    // Stream order: copied on stream_ before the store kernel reads it; the call returns after
    // both ran, so the caller may reuse the source.
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(index_scratch_.data(), k.data, bytes, cudaMemcpyHostToDevice, stream_));
    src = index_scratch_.data();
    stride = v.dim;
  }
  IndexKeyStoreParams p{};
  p.src = src;
  p.src_stride_tok = stride;
  p.src_dtype = static_cast<int32_t>(k.dtype);
  p.loc = loc_.ptr<int64_t>();
  p.num_tokens = step_tokens_;
  p.data = v.data;
  p.page_size = page_size_;
  p.dim = v.dim;
  ATTNRT_CUDA_CHECK(launch_store_index_keys(p, stream_));
  if (host) ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaKVCache::copy_index_keys_to_host(int layer_id, void* dst) const {
  const IndexKeyView v = index_keys(layer_id);
  ATTNRT_CUDA_CHECK(cudaMemcpyAsync(dst, v.data, static_cast<size_t>(rows_) * (v.dim + 4),
                                    cudaMemcpyDeviceToHost, stream_));
  ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaKVCache::copy_layer_from_host(int layer_id, const void* k, const void* v) {
  const Layer& e = find(layer_id);
  ATTNRT_CUDA_CHECK(cudaMemcpyAsync(e.kp, k, k_bytes(e), cudaMemcpyHostToDevice, stream_));
  if (!e.latent)
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(e.vp, v, v_bytes(e), cudaMemcpyHostToDevice, stream_));
  if (e.swa) {
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(map_dev_.data(), map_->data(), map_->size() * sizeof(int64_t),
                                      cudaMemcpyHostToDevice, stream_));
  }
  ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaKVCache::copy_layer_to_host(int layer_id, void* k, void* v) const {
  const Layer& e = find(layer_id);
  ATTNRT_CUDA_CHECK(cudaMemcpyAsync(k, e.kp, k_bytes(e), cudaMemcpyDeviceToHost, stream_));
  if (!e.latent)
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(v, e.vp, v_bytes(e), cudaMemcpyDeviceToHost, stream_));
  ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<int64_t> CudaKVCache::swa_rows_of(std::span<const int64_t> slots,
                                              const char* what) const {
  std::vector<int64_t> out(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    out[i] = (*map_)[static_cast<size_t>(slots[i])];
    ATTNRT_CHECK(out[i] > 0,
                 "CUDA KV cache: {}: full slot {} (entry {}) has no SWA slot (never allocated, or "
                 "released by free_swa), so the SWA layers hold no row for it",
                 what, slots[i], i);
  }
  return out;
}

void CudaKVCache::copy_rows(std::span<const int> layers,
                            std::span<const std::pair<int64_t, int64_t>> moves) {
  if (moves.empty() || layers.empty()) return;
  const size_t n = moves.size();
  for (size_t i = 0; i < n; ++i) {
    const auto [src, dst] = moves[i];
    ATTNRT_CHECK(src > 0 && src < rows_ && dst > 0 && dst < rows_,
                 "CUDA KV cache: row move {} is {} -> {}; slots must lie in [1, {}) (slot 0 is the "
                 "reserved dummy row)",
                 i, src, dst, rows_);
  }
  bool any_swa = false;
  for (int layer_id : layers) any_swa = find(layer_id).swa || any_swa;
  // Slot lists: [src | dst], then for SWA layers [SWA src | SWA dst] (all validated first).
  std::vector<int64_t> lists(2 * n);
  for (size_t i = 0; i < n; ++i) {
    lists[i] = moves[i].first;
    lists[n + i] = moves[i].second;
  }
  if (any_swa) {
    const std::vector<int64_t> swa = swa_rows_of(lists, "copy_rows (SWA layers)");
    lists.insert(lists.end(), swa.begin(), swa.end());
  }
  const size_t index_bytes = lists.size() * sizeof(int64_t);
  // Stream order: as begin_step's slots; the copy kernels below read row_index_ after it.
  void* host = staging_.acquire(index_bytes, stream_);
  std::memcpy(host, lists.data(), index_bytes);
  row_index_.reserve_async(index_bytes, stream_);
  staging_.upload(row_index_.data(), index_bytes, stream_);
  for (int layer_id : layers) {
    const Layer& e = find(layer_id);
    const int64_t* src_rows = row_index_.ptr<int64_t>() + (e.swa ? 2 * n : 0);
    const int64_t* dst_rows = src_rows + n;
    const std::pair<void*, int64_t> parts[] = {
        {e.kp, static_cast<int64_t>(k_bytes(e) / e.rows)},
        {e.vp, static_cast<int64_t>(v_bytes(e) / e.rows)}};
    for (const auto& [base, row_bytes] : parts) {
      if (row_bytes == 0) continue;  // an MLA layer's V (a view of K)
      row_scratch_.reserve_async(n * static_cast<size_t>(row_bytes), stream_);
      // Gather every source first, then scatter: a destination may be another move's source.
      CopyRowsParams p{};
      p.src = base;
      p.src_stride = row_bytes;
      p.src_rows = src_rows;
      p.dst = row_scratch_.data();
      p.dst_stride = row_bytes;
      p.count = static_cast<int64_t>(n);
      p.row_bytes = row_bytes;
      ATTNRT_CUDA_CHECK(launch_copy_rows(p, stream_));
      p.src = row_scratch_.data();
      p.src_rows = nullptr;
      p.dst = base;
      p.dst_rows = dst_rows;
      ATTNRT_CUDA_CHECK(launch_copy_rows(p, stream_));
    }
    if (index_dim_[layer_id] > 0) {
      const int dim = index_dim_[layer_id];
      index_scratch_.reserve_async(n * static_cast<size_t>(dim + 4), stream_);
      IndexKeyMoveParams m{};
      m.data = index_keys_[layer_id].ptr<uint8_t>();
      m.page_size = page_size_;
      m.dim = dim;
      m.src_rows = src_rows;
      m.dst_rows = dst_rows;
      m.count = static_cast<int64_t>(n);
      m.scratch = index_scratch_.ptr<uint8_t>();
      ATTNRT_CUDA_CHECK(launch_move_index_keys(m, stream_));
    }
  }
}

void CudaKVCache::download_rows(int layer_id, std::span<const int64_t> slots, void* k, void* v) {
  const Layer& e = find(layer_id);
  if (slots.empty()) return;
  for (size_t i = 0; i < slots.size(); ++i) {
    ATTNRT_CHECK(slots[i] >= 0 && slots[i] < rows_,
                 "CUDA KV cache: download_rows(layer {}): slot {} (entry {}) is outside the pool's "
                 "rows 0..{}",
                 layer_id, slots[i], i, rows_ - 1);
  }
  // SWA layers gather the rows of the slots that have an SWA slot; `dest` are the host rows.
  std::vector<int64_t> gather(slots.begin(), slots.end()), dest;
  if (e.swa) {
    gather.clear();
    for (int64_t s : slots) {
      const int64_t r = (*map_)[static_cast<size_t>(s)];
      if (r == 0) continue;
      gather.push_back(r);
      dest.push_back(s);
    }
    if (gather.empty()) return;
  }
  const std::span<const int64_t> host_rows = e.swa ? std::span<const int64_t>(dest) : slots;
  const size_t n = gather.size();
  const size_t index_bytes = n * sizeof(int64_t);
  // Stream order: as begin_step's slots; the rows come back through pinned row_host_, read on the
  // host only after the stream was synchronised.
  void* host = staging_.acquire(index_bytes, stream_);
  std::memcpy(host, gather.data(), index_bytes);
  row_index_.reserve_async(index_bytes, stream_);
  staging_.upload(row_index_.data(), index_bytes, stream_);
  const int64_t kb = static_cast<int64_t>(k_bytes(e) / e.rows);
  const int64_t vb = static_cast<int64_t>(v_bytes(e) / e.rows);
  const size_t total = n * static_cast<size_t>(kb + vb);
  row_scratch_.reserve_async(total, stream_);
  row_host_.reserve(total);
  CopyRowsParams p{};
  p.src = e.kp;
  p.src_stride = kb;
  p.src_rows = row_index_.ptr<int64_t>();
  p.dst = row_scratch_.data();
  p.dst_stride = kb;
  p.count = static_cast<int64_t>(n);
  p.row_bytes = kb;
  ATTNRT_CUDA_CHECK(launch_copy_rows(p, stream_));
  if (vb > 0) {
    p.src = e.vp;
    p.src_stride = vb;
    p.dst = row_scratch_.ptr<char>() + n * kb;
    p.dst_stride = vb;
    p.row_bytes = vb;
    ATTNRT_CUDA_CHECK(launch_copy_rows(p, stream_));
  }
  ATTNRT_CUDA_CHECK(cudaMemcpyAsync(row_host_.data(), row_scratch_.data(), total,
                                    cudaMemcpyDeviceToHost, stream_));
  ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const char* rows_k = static_cast<const char*>(row_host_.data());
  const char* rows_v = rows_k + n * kb;
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(static_cast<char*>(k) + host_rows[i] * kb, rows_k + i * kb, kb);
    if (vb > 0) std::memcpy(static_cast<char*>(v) + host_rows[i] * vb, rows_v + i * vb, vb);
  }
}

KVStorage make_cuda_kv_storage(const ModelSpec& model, const KVCacheConfig& config) {
  KVStorage out;
  out.allocator = make_token_allocator(model, config);
  if (auto* swa = dynamic_cast<SWATokenAllocator*>(out.allocator.get())) {
    out.cache = std::make_unique<CudaKVCache>(model, config, swa->full().pool_rows(),
                                              swa->swa().pool_rows(), swa->full_to_swa());
  } else {
    const int64_t rows = static_cast<PagedTokenAllocator&>(*out.allocator).pages().pool_rows();
    out.cache = std::make_unique<CudaKVCache>(model, config, rows);
  }
  return out;
}

}  // namespace attnrt::cuda
