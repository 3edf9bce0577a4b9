// Capture and replay of whole attention steps as CUDA graphs (docs/cuda_graphs.md): the cuda
// device's StepGraphRunner.
#include <cuda_runtime_api.h>

#include <map>
#include <tuple>
#include <utility>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/runtime/attention_runtime.h"
#include "backends/cuda/cuda_device.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/cuda_util.h"

namespace attnrt::cuda {

namespace {

class Runner final : public StepGraphRunner {
 public:
  Runner(const ModelSpec& model, AttentionBackend& backend, CudaKVCache& cache,
         std::vector<int> buckets, int verify_tokens)
      : model_(model),
        backend_(backend),
        cache_(cache),
        buckets_(std::move(buckets)),
        verify_tokens_(verify_tokens) {
    ATTNRT_CHECK(!buckets_.empty(), "CUDA graphs: no batch size to capture");
    max_tokens_ = int64_t{buckets_.back()} * std::max(1, verify_tokens_);
    for (const LayerSpec& l : model_.layers) {
      if (l.uses_kv_cache() && !is_linear_kind(l.kind)) layers_.push_back(&l);
    }
  }

  ~Runner() override {
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  }

  GraphLayerIO io(const LayerSpec& l, int64_t tokens) override {
    ATTNRT_CHECK(tokens >= 0 && tokens <= max_tokens_,
                 "graph_io(layer {}): {} tokens; the static tensors hold {} (largest bucket {} x "
                 "{} tokens per request)",
                 l.layer_id, tokens, max_tokens_, buckets_.back(), std::max(1, verify_tokens_));
    ensure_state();
    const Buffers& b = buffers_.at(l.layer_id);
    const Device gpu = cache_.device();
    const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
    GraphLayerIO x;
    x.q = TensorView(b.q.data(), model_.dtype, {tokens, l.num_q_heads, l.head_dim}, gpu);
    x.k = TensorView(b.k.data(), model_.dtype, {tokens, l.num_kv_heads, l.head_dim}, gpu);
    x.v = TensorView(b.v.data(), model_.dtype, {tokens, l.num_kv_heads, dv}, gpu);
    x.out = TensorView(b.out.data(), model_.dtype, {tokens, l.num_q_heads, dv}, gpu);
    if (l.has_sinks) x.sinks = TensorView(b.sinks.data(), DType::f32, {l.num_q_heads}, gpu);
    if (l.has_indexer()) {
      const IndexerSpec& ix = l.indexer;
      x.index_q = TensorView(b.index_q.data(), model_.dtype,
                             {tokens, ix.index_n_heads, ix.index_head_dim}, gpu);
      x.index_k = TensorView(b.index_k.data(), model_.dtype, {tokens, ix.index_head_dim}, gpu);
      x.index_weights = TensorView(b.index_w.data(), model_.dtype, {tokens, ix.index_n_heads}, gpu);
      x.index_topk = TensorView(b.index_topk.data(), DType::i32, {tokens, ix.index_topk}, gpu);
    }
    return x;
  }

  void run(const ForwardBatch& batch, int bucket) override {
    ensure_state();
    const bool verify = is_target_verify(batch.mode);
    const bool tree = verify && !batch.spec_info->is_chain();
    const Key key{static_cast<int>(batch.mode), bucket, tree};
    auto it = graphs_.find(key);
    if (it == graphs_.end()) it = graphs_.emplace(key, capture(batch.mode, bucket, tree)).first;
    set_write_slots(batch.out_cache_loc, padded_tokens(batch.mode, bucket));
    cache_.begin_step(write_);
    backend_.init_forward_metadata_replay_cuda_graph(bucket, batch.batch_size, batch);
    ATTNRT_CUDA_CHECK(cudaGraphLaunch(it->second, cache_.stream()));
  }

  int captured() const override { return static_cast<int>(graphs_.size()); }

 private:
  struct Buffers {
    DeviceBuffer q, k, v, out, sinks;
    DeviceBuffer index_q, index_k, index_w, index_topk;  // DSA layers
  };
  using Key = std::tuple<int, int, bool>;  // mode, bucket, tree

  int64_t padded_tokens(ForwardMode mode, int bucket) const {
    return int64_t{bucket} * (is_target_verify(mode) ? verify_tokens_ : 1);
  }

  // Once, at the first graph call: the backend's graph buffers and the layers' static tensors
  // (zeroed, so that padded rows read finite values until real steps have written them). The
  // zeroing is enqueued on the cache's stream, the one the caller's writes into the tensors, the
  // captures and the replays go to: a plain cudaMemset would run on the legacy default stream,
  // which that non-blocking stream does not wait for, and where the GPU was busy it landed after
  // the caller's first inputs (or the first replay's output) and zeroed them.
  void ensure_state() {
    if (ready_) return;
    backend_.init_cuda_graph_state(buckets_.back(), static_cast<int>(max_tokens_));
    const size_t act = dtype_size(model_.dtype);
    for (const LayerSpec* l : layers_) {
      Buffers& b = buffers_[l->layer_id];
      const int dv = l->v_head_dim > 0 ? l->v_head_dim : l->head_dim;
      const auto rows = static_cast<size_t>(max_tokens_);
      const IndexerSpec ix = l->has_indexer() ? l->indexer : IndexerSpec{};
      const std::pair<DeviceBuffer*, size_t> parts[] = {
          {&b.q, rows * l->num_q_heads * l->head_dim * act},
          {&b.k, rows * l->num_kv_heads * l->head_dim * act},
          {&b.v, rows * l->num_kv_heads * dv * act},
          {&b.out, rows * l->num_q_heads * dv * act},
          {&b.sinks, l->has_sinks ? l->num_q_heads * sizeof(float) : 0},
          {&b.index_q, rows * ix.index_n_heads * ix.index_head_dim * act},
          {&b.index_k, rows * ix.index_head_dim * act},
          {&b.index_w, rows * ix.index_n_heads * act},
          {&b.index_topk, rows * ix.index_topk * sizeof(int32_t)}};
      for (const auto& [buf, bytes] : parts) {
        if (bytes == 0) continue;
        buf->reserve(bytes);
        ATTNRT_CUDA_CHECK(cudaMemsetAsync(buf->data(), 0, bytes, cache_.stream()));
      }
    }
    ready_ = true;
  }

  // The KV cache's write slots of a step padded to `padded` tokens: the real ones, then the
  // dummy slot 0 (reference-semantics §3.3).
  void set_write_slots(const std::vector<int64_t>& real, int64_t padded) {
    write_.out_cache_loc.assign(real.begin(), real.end());
    write_.out_cache_loc.resize(static_cast<size_t>(padded), 0);
  }

  // Records every attention layer of a step of `bucket` padded requests (DSA layers with their
  // indexer: docs/cuda_graphs.md "DSA layers"). The plan runs before the
  // capture (its upload is not part of the graph); the kernels recorded read only the backend's
  // graph buffers, the cache's write-slot buffers and (SWA-hybrid) its device full->SWA map, and
  // the static tensors, so a replay sees what the replay plan, begin_step and the caller wrote
  // there.
  cudaGraphExec_t capture(ForwardMode mode, int bucket, bool tree) {
    ForwardBatch cap;
    cap.mode = mode;
    cap.batch_size = 0;
    if (is_target_verify(mode)) {
      SpecInfo spec;
      spec.draft_token_num = verify_tokens_;
      spec.topk = tree ? 2 : 1;
      cap.spec_info = std::move(spec);
    }
    const int64_t padded = padded_tokens(mode, bucket);
    set_write_slots({}, padded);
    cache_.begin_step(write_);
    backend_.init_forward_metadata_capture_cuda_graph(bucket, static_cast<int>(padded), cap);
    const cudaStream_t stream = cache_.stream();
    ATTNRT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      for (const LayerSpec* l : layers_) {
        const GraphLayerIO x = io(*l, padded);
        AttnArgs a;
        a.q = x.q;
        a.k = x.k;
        a.v = x.v;
        a.out = x.out;
        a.sinks = l->has_sinks ? x.sinks.ptr<const float>() : nullptr;
        if (l->has_indexer()) {
          a.indexer = {
              .q = x.index_q, .k = x.index_k, .weights = x.index_weights, .topk = x.index_topk};
        }
        backend_.forward(a, *l, cap);
      }
    } catch (...) {
      abandon_capture(stream);
      throw;
    }
    return end_capture_and_instantiate(stream);
  }

  const ModelSpec& model_;
  AttentionBackend& backend_;
  CudaKVCache& cache_;
  std::vector<int> buckets_;
  int verify_tokens_;
  int64_t max_tokens_ = 0;
  std::vector<const LayerSpec*> layers_;  // attention layers, in model order
  std::map<int, Buffers> buffers_;        // by layer id
  std::map<Key, cudaGraphExec_t> graphs_;
  ForwardBatch write_;  // write slots handed to the cache (only out_cache_loc is used)
  bool ready_ = false;
};

}  // namespace

std::unique_ptr<StepGraphRunner> make_cuda_graph_runner(const ModelSpec& model,
                                                        AttentionBackend& backend, KVCache& cache,
                                                        std::vector<int> buckets,
                                                        int verify_tokens) {
  auto* device_cache = dynamic_cast<CudaKVCache*>(&cache);
  ATTNRT_CHECK(device_cache != nullptr,
               "CUDA graphs need the KV cache on the GPU; this runtime's cache is on {}",
               device_name(cache.device()));
  return std::make_unique<Runner>(model, backend, *device_cache, std::move(buckets), verify_tokens);
}

}  // namespace attnrt::cuda
