#include "attnrt/backend/hybrid_linear_attn_backend.h"

#include "attnrt/backend/options.h"
#include "attnrt/core/error.h"

namespace attnrt {

HybridLinearAttnBackend::HybridLinearAttnBackend(const BackendContext& ctx,
                                                 std::unique_ptr<AttentionBackend> full,
                                                 std::unique_ptr<AttentionBackend> linear_prefill,
                                                 std::unique_ptr<AttentionBackend> linear_decode)
    : AttentionBackend(ctx),
      full_(std::move(full)),
      linear_prefill_(std::move(linear_prefill)),
      linear_decode_(std::move(linear_decode)) {
  ATTNRT_CHECK(full_ != nullptr && linear_prefill_ != nullptr,
               "HybridLinearAttnBackend needs a full-attention and a linear backend (got full {}, "
               "linear {})",
               full_ ? "set" : "null", linear_prefill_ ? "set" : "null");
  ATTNRT_CHECK(ctx.model != nullptr && ctx.options != nullptr,
               "HybridLinearAttnBackend needs the model (which layers are full attention) and "
               "the options (speculative_attention_mode) in its BackendContext");
  for (int id : ctx.model->full_attention_layer_ids()) {
    if (static_cast<size_t>(id) >= is_full_.size()) is_full_.resize(id + 1, 0);
    is_full_[id] = 1;
  }
  spec_mode_ = parse_speculative_attention_mode(ctx.options->speculative_attention_mode);
}

bool HybridLinearAttnBackend::is_full_layer(int layer_id) const {
  return layer_id >= 0 && static_cast<size_t>(layer_id) < is_full_.size() && is_full_[layer_id];
}

AttentionBackend& HybridLinearAttnBackend::linear_backend(ForwardMode mode) const {
  if (!linear_decode_) return *linear_prefill_;
  return phase_for(mode, spec_mode_) == Phase::decode ? *linear_decode_ : *linear_prefill_;
}

void HybridLinearAttnBackend::check_full_layer(const LayerSpec& layer, const char* call) const {
  ATTNRT_CHECK(is_full_layer(layer.layer_id),
               "HybridLinearAttnBackend::{}: layer {} ({}) is not a full-attention layer of "
               "model '{}'; linear-attention layers go through forward_linear",
               call, layer.layer_id, layer_kind_name(layer.kind), ctx_.model->name);
}

void HybridLinearAttnBackend::init_forward_metadata(const ForwardBatch& batch) {
  full_->init_forward_metadata(batch);
  linear_backend(batch.mode).init_forward_metadata(batch);
}

void HybridLinearAttnBackend::forward(const AttnArgs& args, const LayerSpec& layer,
                                      const ForwardBatch& batch) {
  check_full_layer(layer, "forward");
  full_->forward(args, layer, batch);
}

void HybridLinearAttnBackend::forward_decode(const AttnArgs& args, const LayerSpec& layer,
                                             const ForwardBatch& batch) {
  check_full_layer(layer, "forward_decode");
  full_->forward_decode(args, layer, batch);
}

void HybridLinearAttnBackend::forward_extend(const AttnArgs& args, const LayerSpec& layer,
                                             const ForwardBatch& batch) {
  check_full_layer(layer, "forward_extend");
  full_->forward_extend(args, layer, batch);
}

MlaForm HybridLinearAttnBackend::mla_form() const { return full_->mla_form(); }

const PrefixChunkPlan& HybridLinearAttnBackend::prefix_chunk_plan() const {
  return full_->prefix_chunk_plan();
}

void HybridLinearAttnBackend::forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                                              const ForwardBatch& batch) {
  check_full_layer(layer, "forward_mla_mha");
  full_->forward_mla_mha(args, layer, batch);
}

void HybridLinearAttnBackend::forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args,
                                                       const LayerSpec& layer,
                                                       const ForwardBatch& batch) {
  check_full_layer(layer, "forward_mla_prefix_chunk");
  full_->forward_mla_prefix_chunk(chunk, args, layer, batch);
}

void HybridLinearAttnBackend::gather_prefix_chunk(int chunk, const KVLayerView& kv, int layer_id,
                                 const TensorView& latent) {
  (*full_).gather_prefix_chunk(chunk, kv, layer_id, latent);
}

void HybridLinearAttnBackend::forward_linear(const LinearArgs& args, const LayerSpec& layer,
                                             const ForwardBatch& batch) {
  ATTNRT_CHECK(!is_full_layer(layer.layer_id) && is_linear_kind(layer.kind),
               "HybridLinearAttnBackend::forward_linear: layer {} ({}) is not a linear-attention "
               "layer of model '{}'; attention layers go through forward",
               layer.layer_id, layer_kind_name(layer.kind), ctx_.model->name);
  linear_backend(batch.mode).forward_linear(args, layer, batch);
}

void HybridLinearAttnBackend::update_state_after_verify(std::span<const int32_t> last_accepted) {
  linear_backend(ForwardMode::TARGET_VERIFY).update_state_after_verify(last_accepted);
}

// As HybridAttnBackend: graphs capture DECODE/IDLE (and verify), which the decode side serves,
// plus the prefill side when verify runs there.
void HybridLinearAttnBackend::init_cuda_graph_state(int max_bs, int max_num_tokens) {
  full_->init_cuda_graph_state(max_bs, max_num_tokens);
  linear_backend(ForwardMode::DECODE).init_cuda_graph_state(max_bs, max_num_tokens);
  if (linear_decode_ && ctx_.options->speculative() &&
      phase_for(ForwardMode::TARGET_VERIFY, spec_mode_) == Phase::prefill) {
    linear_prefill_->init_cuda_graph_state(max_bs, max_num_tokens);
  }
}

void HybridLinearAttnBackend::init_forward_metadata_capture_cuda_graph(int bs, int num_tokens,
                                                                       const ForwardBatch& batch) {
  full_->init_forward_metadata_capture_cuda_graph(bs, num_tokens, batch);
  linear_backend(batch.mode).init_forward_metadata_capture_cuda_graph(bs, num_tokens, batch);
}

void HybridLinearAttnBackend::init_forward_metadata_replay_cuda_graph(int bs, int raw_bs,
                                                                      const ForwardBatch& batch) {
  full_->init_forward_metadata_replay_cuda_graph(bs, raw_bs, batch);
  linear_backend(batch.mode).init_forward_metadata_replay_cuda_graph(bs, raw_bs, batch);
}

int HybridLinearAttnBackend::cuda_graph_seq_len_fill_value() const {
  return full_->cuda_graph_seq_len_fill_value();
}

void HybridLinearAttnBackend::set_stream(void* stream) {
  if (full_ != nullptr) full_->set_stream(stream);
  if (linear_prefill_ != nullptr) linear_prefill_->set_stream(stream);
  if (linear_decode_ != nullptr) linear_decode_->set_stream(stream);
}

}  // namespace attnrt
