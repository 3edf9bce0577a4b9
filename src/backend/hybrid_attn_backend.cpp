#include "attnrt/backend/hybrid_attn_backend.h"

#include "attnrt/backend/options.h"
#include "attnrt/core/error.h"

namespace attnrt {

namespace {

SpeculativeAttentionMode spec_mode(const BackendContext& ctx) {
  ATTNRT_CHECK(ctx.options != nullptr,
               "HybridAttnBackend needs the run's options (BackendContext::options is null): "
               "speculative_attention_mode decides where TARGET_VERIFY and DRAFT_EXTEND go");
  return parse_speculative_attention_mode(ctx.options->speculative_attention_mode);
}

}  // namespace

HybridAttnBackend::HybridAttnBackend(const BackendContext& ctx,
                                     std::unique_ptr<AttentionBackend> prefill,
                                     std::unique_ptr<AttentionBackend> decode)
    : AttentionBackend(ctx),
      prefill_(std::move(prefill)),
      decode_(std::move(decode)),
      spec_mode_(spec_mode(ctx)) {
  ATTNRT_CHECK(prefill_ != nullptr && decode_ != nullptr,
               "HybridAttnBackend needs both a prefill and a decode backend (got prefill {}, "
               "decode {})",
               prefill_ ? "set" : "null", decode_ ? "set" : "null");
}

AttentionBackend& HybridAttnBackend::select(ForwardMode mode) const {
  return phase_for(mode, spec_mode_) == Phase::decode ? *decode_ : *prefill_;
}

void HybridAttnBackend::init_forward_metadata(const ForwardBatch& batch) {
  mode_ = batch.mode;
  select(batch.mode).init_forward_metadata(batch);
}

MlaForm HybridAttnBackend::mla_form() const { return select(mode_).mla_form(); }

const PrefixChunkPlan& HybridAttnBackend::prefix_chunk_plan() const {
  return select(mode_).prefix_chunk_plan();
}

void HybridAttnBackend::forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                                        const ForwardBatch& batch) {
  select(batch.mode).forward_mla_mha(args, layer, batch);
}

void HybridAttnBackend::forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args,
                                                 const LayerSpec& layer,
                                                 const ForwardBatch& batch) {
  select(batch.mode).forward_mla_prefix_chunk(chunk, args, layer, batch);
}

void HybridAttnBackend::gather_prefix_chunk(int chunk, const KVLayerView& kv, int layer_id,
                                 const TensorView& latent) {
  select(mode_).gather_prefix_chunk(chunk, kv, layer_id, latent);
}

void HybridAttnBackend::forward(const AttnArgs& args, const LayerSpec& layer,
                                const ForwardBatch& batch) {
  select(batch.mode).forward(args, layer, batch);
}

void HybridAttnBackend::forward_decode(const AttnArgs& args, const LayerSpec& layer,
                                       const ForwardBatch& batch) {
  decode_->forward_decode(args, layer, batch);
}

void HybridAttnBackend::forward_extend(const AttnArgs& args, const LayerSpec& layer,
                                       const ForwardBatch& batch) {
  select(batch.mode).forward_extend(args, layer, batch);
}

// TARGET_VERIFY graphs run on the prefill backend in prefill mode, so it needs graph buffers too;
// otherwise only DECODE/IDLE (and verify in decode mode) are captured, all on the decode backend.
void HybridAttnBackend::init_cuda_graph_state(int max_bs, int max_num_tokens) {
  decode_->init_cuda_graph_state(max_bs, max_num_tokens);
  if (ctx_.options->speculative() &&
      phase_for(ForwardMode::TARGET_VERIFY, spec_mode_) == Phase::prefill) {
    prefill_->init_cuda_graph_state(max_bs, max_num_tokens);
  }
}

void HybridAttnBackend::init_forward_metadata_capture_cuda_graph(int bs, int num_tokens,
                                                                 const ForwardBatch& batch) {
  select(batch.mode).init_forward_metadata_capture_cuda_graph(bs, num_tokens, batch);
}

void HybridAttnBackend::init_forward_metadata_replay_cuda_graph(int bs, int raw_bs,
                                                                const ForwardBatch& batch) {
  select(batch.mode).init_forward_metadata_replay_cuda_graph(bs, raw_bs, batch);
}

int HybridAttnBackend::cuda_graph_seq_len_fill_value() const {
  return decode_->cuda_graph_seq_len_fill_value();
}

void HybridAttnBackend::set_stream(void* stream) {
  if (prefill_ != nullptr) prefill_->set_stream(stream);
  if (decode_ != nullptr) decode_->set_stream(stream);
}

}  // namespace attnrt
