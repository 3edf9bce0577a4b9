#include "attnrt/backend/mla_mha.h"

#include <algorithm>

#include "attnrt/backend/host_attn_checks.h"
#include "attnrt/backend/host_mla_mha.h"
#include "attnrt/backend/options.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/req_to_token_pool.h"

namespace attnrt {

std::string_view mla_form_name(MlaForm form) {
  return form == MlaForm::mha ? "mha" : "absorbed";
}

MlaForm choose_mla_form(ForwardMode mode, const StepLayout& layout, const Options& options,
                        bool mha_served) {
  if (!mha_served || !is_extend_without_speculative(mode)) return MlaForm::absorbed;
  int64_t prefix_sum = 0;
  for (int32_t p : layout.prefix_lens) prefix_sum += p;
  const bool long_prefix = !options.disable_chunked_prefix_cache &&
                           prefix_sum >= options.chunked_prefix_cache_threshold;
  return prefix_sum == 0 || long_prefix ? MlaForm::mha : MlaForm::absorbed;
}

PrefixChunkPlan plan_prefix_chunks(const ForwardBatch& batch, const StepLayout& layout,
                                   const ReqToTokenPool& req_to_token, int64_t capacity) {
  ATTNRT_CHECK(capacity >= 1, "max_chunk_capacity = {}; the prefix keys of one chunk must be >= 1",
               capacity);
  PrefixChunkPlan plan;
  const int bs = static_cast<int>(layout.prefix_lens.size());
  int32_t max_prefix = 0;
  for (int32_t p : layout.prefix_lens) max_prefix = std::max(max_prefix, p);
  if (max_prefix == 0) return plan;
  ATTNRT_CHECK(capacity >= bs,
               "max_chunk_capacity = {} is below the step's {} requests; a chunk holds "
               "max_chunk_capacity / requests prefix keys of each request (at least 1)",
               capacity, bs);
  plan.chunk_len = capacity / bs;
  const int64_t n = (max_prefix + plan.chunk_len - 1) / plan.chunk_len;
  plan.chunks.resize(n);
  for (int64_t c = 0; c < n; ++c) {
    PrefixChunk& chunk = plan.chunks[c];
    chunk.starts.assign(bs, 0);
    chunk.lens.assign(bs, 0);
    chunk.cu_seqlens.assign(bs + 1, 0);
    for (int i = 0; i < bs; ++i) {
      const int64_t start = c * plan.chunk_len;
      const int64_t end = std::min<int64_t>(layout.prefix_lens[i], start + plan.chunk_len);
      chunk.starts[i] = static_cast<int32_t>(start);
      chunk.lens[i] = static_cast<int32_t>(std::max<int64_t>(0, end - start));
      chunk.cu_seqlens[i + 1] = chunk.cu_seqlens[i] + chunk.lens[i];
    }
    chunk.num_tokens = chunk.cu_seqlens[bs];
    chunk.slots.resize(chunk.num_tokens);
    for (int i = 0; i < bs; ++i) {
      if (chunk.lens[i] == 0) continue;
      const int64_t row = batch.req_pool_indices[i];
      ATTNRT_CHECK(row >= 0 && row < req_to_token.size(),
                   "req_pool_indices[{}] = {}; the request pool has rows [0, {})", i, row,
                   req_to_token.size());
      const int32_t* slots = req_to_token.row_ptr(static_cast<int>(row)) + chunk.starts[i];
      std::copy_n(slots, chunk.lens[i], chunk.slots.data() + chunk.cu_seqlens[i]);
    }
  }
  return plan;
}

MlaMhaDims mla_mha_dims(const LayerSpec& layer) {
  return {layer.qk_nope_head_dim + layer.qk_rope_head_dim, layer.mha_v_head_dim};
}

namespace {

void check_mha_layer(std::string_view backend, const LayerSpec& layer) {
  ATTNRT_CHECK(layer.has_mha_form() && !layer.has_sinks && layer.num_q_heads > 0,
               "{} backend: layer {} is a {} layer{}; the MHA form serves mla layers with "
               "qk_nope_head_dim and mha_v_head_dim set and no sinks",
               backend, layer.layer_id, layer_kind_name(layer.kind),
               layer.kind != LayerKind::mla ? ""
               : layer.has_sinks            ? " with sinks"
                                            : " without MHA-form dims");
}

void check_lse(std::string_view backend, bool device_ok, const TensorView& lse, int64_t T,
               int hq) {
  ATTNRT_CHECK((device_ok || lse.device.kind == DeviceKind::cpu) && lse.dtype == DType::f32 &&
                   lse.ndim == 2 && lse.shape[0] == T && lse.shape[1] == hq,
               "{} backend: lse is {}; expected fp32[{}, {}] (tokens, q heads){}", backend,
               lse.describe(), T, hq, device_ok ? "" : " on cpu");
}

// check_host_tensor, or where the backend reads GPU memory too the same checks of a tensor on
// either side.
void check_tensor(std::string_view backend, bool device_ok, const char* what, const TensorView& t,
                  int64_t d0, int64_t d1, int64_t d2, const char* dims) {
  if (!device_ok || t.device.kind == DeviceKind::cpu) {
    check_host_tensor(backend, what, t, d0, d1, d2, dims);
    return;
  }
  ATTNRT_CHECK(is_float(t.dtype) && t.ndim == 3 && t.shape[0] == d0 && t.shape[1] == d1 &&
                   t.shape[2] == d2,
               "{} backend: {} is {}; expected a float [{}] = [{}, {}, {}]", backend, what,
               t.describe(), dims, d0, d1, d2);
}

}  // namespace

void HostMlaMhaSteps::reset() {
  form_ = MlaForm::absorbed;
  chunks_ = {};
  layer_ = -1;
  done_.clear();
}

void HostMlaMhaSteps::plan(std::string_view backend, const BackendContext& ctx,
                           const ForwardBatch& batch, const StepLayout& layout) {
  form_ = MlaForm::absorbed;
  chunks_ = {};
  layer_ = -1;
  done_.clear();
  bool served = false;
  if (ctx.model != nullptr) {
    for (const LayerSpec& l : ctx.model->layers) served = served || l.has_mha_form();
  }
  if (ctx.options == nullptr) return;
  const MlaForm form = choose_mla_form(batch.mode, layout, *ctx.options, served);
  if (form == MlaForm::mha) {
    ATTNRT_CHECK(ctx.req_to_token != nullptr,
                 "{} backend: BackendContext.req_to_token is null; the prefix chunks read key "
                 "slots from the request rows",
                 backend);
    chunks_ = plan_prefix_chunks(batch, layout, *ctx.req_to_token,
                                 ctx.options->max_chunk_capacity);
  }
  form_ = form;
}

KVLayerView HostMlaMhaSteps::check_causal(std::string_view backend, const BackendContext& ctx,
                                          bool planned, const MlaMhaArgs& args,
                                          const LayerSpec& layer,
                                          const ForwardBatch& batch) const {
  ATTNRT_CHECK(ctx.kv_cache != nullptr,
               "{} backend: BackendContext.kv_cache is null; the MHA form stores the latent rows",
               backend);
  ATTNRT_CHECK(planned,
               "{} backend: MHA-form call for a {} batch of {} requests / {} tokens without a "
               "matching init_forward_metadata for this step",
               backend, forward_mode_name(batch.mode), batch.batch_size, batch.num_tokens());
  ATTNRT_CHECK(form_ == MlaForm::mha,
               "{} backend: layer {}: this {} step runs MLA in the absorbed form; the MHA form "
               "serves EXTEND / MIXED steps whose prefixes sum to 0 or to at least "
               "chunked_prefix_cache_threshold (docs/mla.md)",
               backend, layer.layer_id, forward_mode_name(batch.mode));
  check_mha_layer(backend, layer);
  const int64_t T = batch.num_tokens();
  const int hq = layer.num_q_heads;
  const MlaMhaDims d = mla_mha_dims(layer);
  check_tensor(backend, device_tensors_, "q", args.q, T, hq, d.qk, "tokens, q heads, qk_nope + qk_rope");
  check_tensor(backend, device_tensors_, "k", args.k, T, hq, d.qk, "tokens, q heads, qk_nope + qk_rope");
  check_tensor(backend, device_tensors_, "v", args.v, T, hq, d.v, "tokens, q heads, mha_v_head_dim");
  check_tensor(backend, device_tensors_, "out", args.out, T, hq, d.v, "tokens, q heads, mha_v_head_dim");
  if (chunks_.num_chunks() > 0 || !args.lse.empty()) {
    ATTNRT_CHECK(!args.lse.empty(),
                 "{} backend: lse is empty but this step has {} prefix chunks, which merge into "
                 "it; pass fp32[{}, {}]",
                 backend, chunks_.num_chunks(), T, hq);
    check_lse(backend, device_tensors_, args.lse, T, hq);
  }
  const KVLayerView kv = ctx.kv_cache->layer(layer.layer_id);
  if (args.save_kv) {
    check_tensor(backend, device_tensors_, "latent", args.latent, T, 1, layer.head_dim,
                      "tokens, 1, kv_lora_rank + qk_rope_head_dim");
  }
  return kv;
}

void HostMlaMhaSteps::causal_done(int layer_id) {
  layer_ = layer_id;
  done_.assign(chunks_.chunks.size(), 0);
}

void HostMlaMhaSteps::check_chunk(std::string_view backend, bool planned, int chunk,
                                  const MlaChunkArgs& args, const LayerSpec& layer,
                                  const ForwardBatch& batch) const {
  ATTNRT_CHECK(planned && form_ == MlaForm::mha,
               "{} backend: prefix chunk {} of layer {} for a {} step that {}", backend, chunk,
               layer.layer_id, forward_mode_name(batch.mode),
               planned ? "runs MLA in the absorbed form (no prefix chunks)"
                       : "has no matching init_forward_metadata");
  ATTNRT_CHECK(chunk >= 0 && chunk < chunks_.num_chunks(),
               "{} backend: prefix chunk {}; this step has chunks [0, {})", backend, chunk,
               chunks_.num_chunks());
  ATTNRT_CHECK(layer_ == layer.layer_id,
               "{} backend: prefix chunk {} of layer {} before the causal part of that layer "
               "(forward_mla_mha){}",
               backend, chunk, layer.layer_id,
               layer_ < 0 ? "" : fmt::format("; the last causal part was layer {}", layer_));
  ATTNRT_CHECK(!done_[chunk],
               "{} backend: prefix chunk {} of layer {} was already merged in this step", backend,
               chunk, layer.layer_id);
  check_mha_layer(backend, layer);
  const int64_t T = batch.num_tokens(), n = chunks_.chunks[chunk].num_tokens;
  const int hq = layer.num_q_heads;
  const MlaMhaDims d = mla_mha_dims(layer);
  check_tensor(backend, device_tensors_, "q", args.q, T, hq, d.qk, "tokens, q heads, qk_nope + qk_rope");
  check_tensor(backend, device_tensors_, "k", args.k, n, hq, d.qk,
                    "chunk tokens, q heads, qk_nope + qk_rope");
  check_tensor(backend, device_tensors_, "v", args.v, n, hq, d.v, "chunk tokens, q heads, mha_v_head_dim");
  check_tensor(backend, device_tensors_, "out", args.out, T, hq, d.v, "tokens, q heads, mha_v_head_dim");
  check_lse(backend, device_tensors_, args.lse, T, hq);
}

}  // namespace attnrt
