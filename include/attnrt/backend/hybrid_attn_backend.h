// HybridAttnBackend: routes each step to the prefill or the decode backend (reference-semantics §6).
// Routing only, no math.
#pragma once

#include <memory>

#include "attnrt/backend/attention_backend.h"

namespace attnrt {

class HybridAttnBackend final : public AttentionBackend {
 public:
  HybridAttnBackend(const BackendContext& ctx, std::unique_ptr<AttentionBackend> prefill,
                    std::unique_ptr<AttentionBackend> decode);

  std::string_view name() const override { return "hybrid"; }
  void init_forward_metadata(const ForwardBatch& batch) override;
  void forward(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch) override;
  void forward_decode(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;
  void forward_extend(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;
  // The MHA form of MLA: on the backend that planned the step.
  MlaForm mla_form() const override;
  const PrefixChunkPlan& prefix_chunk_plan() const override;
  void forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                       const ForwardBatch& batch) override;
  void forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args, const LayerSpec& layer,
                                const ForwardBatch& batch) override;
  void gather_prefix_chunk(int chunk, const KVLayerView& kv, int layer_id,
                           const TensorView& latent) override;
  void init_cuda_graph_state(int max_bs, int max_num_tokens) override;
  void init_forward_metadata_capture_cuda_graph(int bs, int num_tokens,
                                                const ForwardBatch& batch) override;
  void init_forward_metadata_replay_cuda_graph(int bs, int raw_bs,
                                               const ForwardBatch& batch) override;
  int cuda_graph_seq_len_fill_value() const override;
  void set_stream(void* stream) override;

  // The backend that serves `mode` (DECODE/IDLE -> decode; TARGET_VERIFY/DRAFT_EXTEND by
  // speculative_attention_mode; everything else -> prefill).
  AttentionBackend& select(ForwardMode mode) const;
  AttentionBackend& prefill_backend() const { return *prefill_; }
  AttentionBackend& decode_backend() const { return *decode_; }

 private:
  std::unique_ptr<AttentionBackend> prefill_;
  std::unique_ptr<AttentionBackend> decode_;
  SpeculativeAttentionMode spec_mode_;
  ForwardMode mode_ = ForwardMode::IDLE;  // of the step planned last
};

}  // namespace attnrt
