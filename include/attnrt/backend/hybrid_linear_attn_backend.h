// HybridLinearAttnBackend: routes the layers of a hybrid model by layer id (reference-semantics
// §7): full-attention layers to the full backend (itself possibly a HybridAttnBackend),
// linear-attention layers to a linear backend. The linear side has its own prefill / decode
// split, routed by the table of §6.1, so the backend that ran TARGET_VERIFY is the one that
// commits the state after it. Routing only, no math.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "attnrt/backend/attention_backend.h"

namespace attnrt {

class HybridLinearAttnBackend final : public AttentionBackend {
 public:
  // `linear_decode` may be null: `linear_prefill` then serves every mode. The full-attention
  // layer ids come from ctx.model.
  HybridLinearAttnBackend(const BackendContext& ctx, std::unique_ptr<AttentionBackend> full,
                          std::unique_ptr<AttentionBackend> linear_prefill,
                          std::unique_ptr<AttentionBackend> linear_decode);

  std::string_view name() const override { return "hybrid_linear"; }
  // The full backend and the linear backend that serves the step's mode, full first.
  void init_forward_metadata(const ForwardBatch& batch) override;
  void forward(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch) override;
  void forward_decode(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;
  void forward_extend(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;
  // The MHA form of MLA: on the full backend.
  MlaForm mla_form() const override;
  const PrefixChunkPlan& prefix_chunk_plan() const override;
  void forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                       const ForwardBatch& batch) override;
  void forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args, const LayerSpec& layer,
                                const ForwardBatch& batch) override;
  void gather_prefix_chunk(int chunk, const KVLayerView& kv, int layer_id,
                           const TensorView& latent) override;
  void forward_linear(const LinearArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;
  // Goes to the linear backend that serves TARGET_VERIFY.
  void update_state_after_verify(std::span<const int32_t> last_accepted) override;
  void init_cuda_graph_state(int max_bs, int max_num_tokens) override;
  void init_forward_metadata_capture_cuda_graph(int bs, int num_tokens,
                                                const ForwardBatch& batch) override;
  void init_forward_metadata_replay_cuda_graph(int bs, int raw_bs,
                                               const ForwardBatch& batch) override;
  int cuda_graph_seq_len_fill_value() const override;
  void set_stream(void* stream) override;

  bool is_full_layer(int layer_id) const;
  AttentionBackend& full_backend() const { return *full_; }
  // The linear backend that serves `mode` (DECODE/IDLE -> decode; TARGET_VERIFY/DRAFT_EXTEND by
  // speculative_attention_mode; everything else -> prefill).
  AttentionBackend& linear_backend(ForwardMode mode) const;

 private:
  void check_full_layer(const LayerSpec& layer, const char* call) const;

  std::unique_ptr<AttentionBackend> full_;
  std::unique_ptr<AttentionBackend> linear_prefill_;
  std::unique_ptr<AttentionBackend> linear_decode_;  // null: linear_prefill_ serves every mode
  std::vector<uint8_t> is_full_;                     // by layer id
  SpeculativeAttentionMode spec_mode_ = SpeculativeAttentionMode::prefill;
};

}  // namespace attnrt
