// Capture and replay of whole attention steps as CUDA graphs, for AttentionRuntime
// (docs/cuda_graphs.md). Private to the runtime.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attnrt/runtime/attention_runtime.h"

namespace attnrt {

class CudaGraphRunner {
 public:
  virtual ~CudaGraphRunner() = default;
  // The static tensors of an attention layer, first `tokens` rows.
  virtual GraphLayerIO io(const LayerSpec& layer, int64_t tokens) = 0;
  // One step of `batch` (already validated) padded to `bucket` requests: captures the graph of
  // (mode, bucket, chain / tree) when it is new, then plans and launches it.
  virtual void run(const ForwardBatch& batch, int bucket) = 0;
  virtual int captured() const = 0;
};

// `buckets` increasing; `verify_tokens` = N of TARGET_VERIFY steps (0: no verify graphs). The
// cache must be the GPU cache the backend reads. Only CUDA builds define it.
std::unique_ptr<CudaGraphRunner> make_cuda_graph_runner(const ModelSpec& model,
                                                        AttentionBackend& backend, KVCache& cache,
                                                        std::vector<int> buckets,
                                                        int verify_tokens);

}  // namespace attnrt
