#include "attnrt/backend/attention_backend.h"

#include "attnrt/core/error.h"

namespace attnrt {

void AttentionBackend::forward(const AttnArgs& args, const LayerSpec& layer,
                               const ForwardBatch& batch) {
  if (is_idle(batch.mode)) return;
  if (is_decode(batch.mode)) {
    forward_decode(args, layer, batch);
  } else {
    forward_extend(args, layer, batch);
  }
}

void AttentionBackend::init_cuda_graph_state(int, int) {
  fail("backend '{}' does not support CUDA graphs; choose a backend whose caps list cuda_graphs "
       "(see `attnrt info`)", name());
}

void AttentionBackend::init_forward_metadata_capture_cuda_graph(int, int, const ForwardBatch&) {
  fail("backend '{}' does not support CUDA graph capture", name());
}

void AttentionBackend::init_forward_metadata_replay_cuda_graph(int, int, const ForwardBatch&) {
  fail("backend '{}' does not support CUDA graph replay", name());
}

}  // namespace attnrt
