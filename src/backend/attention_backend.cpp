#include "attnrt/backend/attention_backend.h"

#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"

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

void AttentionBackend::forward_linear(const LinearArgs&, const LayerSpec& layer,
                                      const ForwardBatch&) {
  fail("backend '{}' does not serve linear-attention layers (layer {} is {}); choose a linear "
       "backend with --linear-attn-backend (see `attnrt info`)",
       name(), layer.layer_id, layer_kind_name(layer.kind));
}

void AttentionBackend::update_state_after_verify(std::span<const int32_t>) {
  fail("backend '{}' holds no linear-attention state to commit after a verify; the linear "
       "backend that ran TARGET_VERIFY commits it",
       name());
}

void AttentionBackend::gather_prefix_chunk(int chunk, const KVLayerView& kv, int layer_id,
                                           const TensorView& latent) {
  gather_latent_rows(kv, layer_id, prefix_chunk_plan().chunks[chunk].slots, latent);
}

const PrefixChunkPlan& AttentionBackend::prefix_chunk_plan() const {
  static const PrefixChunkPlan none;
  return none;
}

void AttentionBackend::forward_mla_mha(const MlaMhaArgs&, const LayerSpec& layer,
                                       const ForwardBatch&) {
  fail("backend '{}' serves MLA in the absorbed form only (layer {}); its steps have mla_form() "
       "absorbed: pass q [T, Hq, kv_lora_rank + qk_rope] to forward (docs/mla.md)",
       name(), layer.layer_id);
}

void AttentionBackend::forward_mla_prefix_chunk(int chunk, const MlaChunkArgs&,
                                                const LayerSpec& layer, const ForwardBatch&) {
  fail("backend '{}' serves MLA in the absorbed form only (prefix chunk {} of layer {}); its "
       "steps have no prefix chunks (docs/mla.md)",
       name(), chunk, layer.layer_id);
}

void OnePathAttnBackend::forward_decode(const AttnArgs& args, const LayerSpec& layer,
                                        const ForwardBatch& batch) {
  ATTNRT_CHECK(is_decode(batch.mode), "{} backend: forward_decode called for a {} batch", name(),
               forward_mode_name(batch.mode));
  attend(args, layer, batch);
}

void OnePathAttnBackend::forward_extend(const AttnArgs& args, const LayerSpec& layer,
                                        const ForwardBatch& batch) {
  ATTNRT_CHECK(!is_decode_or_idle(batch.mode), "{} backend: forward_extend called for a {} batch",
               name(), forward_mode_name(batch.mode));
  attend(args, layer, batch);
}

}  // namespace attnrt
