#include "attnrt/backend/host_attn_checks.h"

#include <algorithm>
#include <cstdint>

#include "attnrt/backend/dsa.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/req_to_token_pool.h"

namespace attnrt {

void check_host_tensor(std::string_view backend, const char* what, const TensorView& t,
                       int64_t d0, int64_t d1, int64_t d2, const char* dims) {
  ATTNRT_CHECK(t.data != nullptr, "{} backend: {} is empty; expected [{}] = [{}, {}, {}]", backend,
               what, dims, d0, d1, d2);
  ATTNRT_CHECK(t.device.kind == DeviceKind::cpu,
               "{} backend: {} is {}; the {} backend reads host memory only", backend, what,
               t.describe(), backend);
  ATTNRT_CHECK(is_float(t.dtype), "{} backend: {} is {}; expected a float dtype", backend, what,
               t.describe());
  ATTNRT_CHECK(t.ndim == 3 && t.shape[0] == d0 && t.shape[1] == d1 && t.shape[2] == d2,
               "{} backend: {} is {}; expected [{}] = [{}, {}, {}]", backend, what, t.describe(),
               dims, d0, d1, d2);
}

namespace {

void check_host_attn_args(std::string_view backend, const AttnArgs& args, const LayerSpec& layer,
                          int64_t num_tokens, const KVLayerView& kv) {
  ATTNRT_CHECK(layer.uses_kv_cache(),
               "{} backend: layer {} is {}; the {} backend serves full, swa and mla layers",
               backend, layer.layer_id, layer_kind_name(layer.kind), backend);
  const bool mla = layer.kind == LayerKind::mla;
  const int hq = layer.num_q_heads, hkv = layer.num_kv_heads;
  ATTNRT_CHECK(hq > 0 && hkv > 0 && hq % hkv == 0,
               "{} backend: layer {} has {} q heads and {} kv heads; q heads must be a positive "
               "multiple of kv heads",
               backend, layer.layer_id, hq, hkv);
  const int dqk = layer.head_dim, dv = layer.v_head_dim > 0 ? layer.v_head_dim : layer.head_dim;
  ATTNRT_CHECK(dqk > 0 && dv > 0,
               "{} backend: layer {} has head_dim {} / v_head_dim {}; both must be > 0", backend,
               layer.layer_id, dqk, dv);
  ATTNRT_CHECK(!mla || (hkv == 1 && dv <= dqk),
               "{} backend: mla layer {} has {} kv heads, head_dim {}, v_head_dim {}; MLA attends "
               "over one latent kv head, and V is the first v_head_dim columns of the K row",
               backend, layer.layer_id, hkv, dqk, dv);
  ATTNRT_CHECK(layer.causal() || layer.sliding_window < 0,
               "{} backend: layer {} is non-causal with sliding_window {}; a window is defined "
               "for causal layers only (use -1)",
               backend, layer.layer_id, layer.sliding_window);
  ATTNRT_CHECK(layer.logit_cap >= 0.f,
               "{} backend: layer {} has logit_cap {}; use a positive cap, or 0 for none", backend,
               layer.layer_id, layer.logit_cap);
  check_host_tensor(backend, "q", args.q, num_tokens, hq, dqk, "tokens, q heads, head_dim");
  check_host_tensor(backend, "out", args.out, num_tokens, hq, dv, "tokens, q heads, v_head_dim");
  // MLA stores the latent k rows only (V is a view of them), so v may be left empty there.
  ATTNRT_CHECK(mla ? !(args.k.empty() && !args.v.empty()) : args.k.empty() == args.v.empty(),
               "{} backend: k is {} but v is {}; pass both (store this step's K/V) or neither "
               "(already stored by another layer){}",
               backend, args.k.empty() ? "empty" : args.k.describe(),
               args.v.empty() ? "empty" : args.v.describe(),
               mla ? "; an mla layer takes k alone too" : "");
  if (!args.k.empty()) {
    check_host_tensor(backend, "k", args.k, num_tokens, hkv, dqk, "tokens, kv heads, head_dim");
  }
  if (!args.v.empty()) {
    check_host_tensor(backend, "v", args.v, num_tokens, hkv, dv, "tokens, kv heads, v_head_dim");
  }
  if (!args.lse.empty()) {
    ATTNRT_CHECK(args.lse.device.kind == DeviceKind::cpu && args.lse.dtype == DType::f32 &&
                     args.lse.ndim == 2 && args.lse.shape[0] == num_tokens &&
                     args.lse.shape[1] == hq,
                 "{} backend: lse is {}; expected fp32[{}, {}] (tokens, q heads) on cpu", backend,
                 args.lse.describe(), num_tokens, hq);
  }
  ATTNRT_CHECK(layer.has_sinks == (args.sinks != nullptr),
               "{} backend: layer {} {} sinks but AttnArgs.sinks is {}", backend, layer.layer_id,
               layer.has_sinks ? "has" : "has no", args.sinks ? "set" : "null");
  ATTNRT_CHECK(kv.k != nullptr && kv.v != nullptr,
               "{} backend: the KV cache returned no buffers for layer {}", backend,
               layer.layer_id);
  ATTNRT_CHECK(kv.device.kind == DeviceKind::cpu,
               "{} backend: layer {} KV cache is on {}; the {} backend reads host pools only",
               backend, layer.layer_id, device_name(kv.device), backend);
  ATTNRT_CHECK(kv.dtype == DType::f32 || kv.dtype == DType::f16 || kv.dtype == DType::bf16 ||
                   kv.dtype == DType::e4m3 || kv.dtype == DType::e5m2,
               "{} backend: layer {} KV cache stores {}; supported: fp32, fp16, bf16, fp8_e4m3, "
               "fp8_e5m2",
               backend, layer.layer_id, dtype_name(kv.dtype));
  ATTNRT_CHECK(!mla || (kv.v == kv.k && kv.v_row_stride == kv.k_row_stride),
               "{} backend: mla layer {} KV cache has separate V storage; an mla layer needs the "
               "latent pool, whose V is a view of the K row",
               backend, layer.layer_id);
  ATTNRT_CHECK(kv.kv_heads == hkv && kv.head_dim == dqk && kv.v_head_dim == dv,
               "{} backend: layer {} KV cache holds [{} heads, {} / {} dims]; the layer needs "
               "[{} heads, {} / {} dims]",
               backend, layer.layer_id, kv.kv_heads, kv.head_dim, kv.v_head_dim, hkv, dqk, dv);
  check_host_indexer_args(backend, args, layer, num_tokens);
}

}  // namespace

const int32_t* checked_request_row(std::string_view backend, const BackendContext& ctx,
                                   const ForwardBatch& batch, const StepLayout& layout, int i,
                                   int64_t max_keys) {
  ATTNRT_CHECK(ctx.req_to_token != nullptr,
               "{} backend: BackendContext.req_to_token is null; the backend reads key slots "
               "from the request rows",
               backend);
  const ReqToTokenPool& pool = *ctx.req_to_token;
  const int64_t row = batch.req_pool_indices[i];
  ATTNRT_CHECK(row >= 0 && row < pool.size(),
               "{} backend: req_pool_indices[{}] = {}; the request pool has rows [0, {})", backend,
               i, row, pool.size());
  const int32_t kv_len = layout.kv_len(i), prefix = layout.prefix_lens[i];
  const int64_t max_len = std::min<int64_t>(pool.max_context_len(), max_keys);
  ATTNRT_CHECK(kv_len <= max_len,
               "{} backend: request {} needs {} keys but a request row holds at most "
               "max_context_len = {}",
               backend, i, kv_len, max_len);
  const int32_t* slots = pool.row_ptr(static_cast<int>(row));
  for (int32_t t = 0; t < layout.query_lens[i]; ++t) {
    const int64_t q = layout.query_start[i] + t;
    if (batch.dcp_partial && batch.out_cache_loc[q] == 0) continue;  // a query that is no key here
    ATTNRT_CHECK(slots[prefix + t] == batch.out_cache_loc[q],
                 "{} backend: req_to_token[{}, {}] = {} but out_cache_loc[{}] = {} (request {}, "
                 "new token {}); write the step's slots into the request row before the forward",
                 backend, row, prefix + t, slots[prefix + t], q, batch.out_cache_loc[q], i, t);
  }
  return slots;
}

KVLayerView check_host_attn_call(std::string_view backend, const BackendContext& ctx, bool planned,
                                 const AttnArgs& args, const LayerSpec& layer,
                                 const ForwardBatch& batch) {
  ATTNRT_CHECK(ctx.kv_cache != nullptr,
               "{} backend: BackendContext.kv_cache is null; attention needs the KV pools",
               backend);
  const KVLayerView kv = ctx.kv_cache->layer(layer.layer_id);
  ATTNRT_CHECK(planned,
               "{} backend: forward for a {} batch of {} requests / {} tokens without a matching "
               "init_forward_metadata for this step",
               backend, forward_mode_name(batch.mode), batch.batch_size, batch.num_tokens());
  check_host_attn_args(backend, args, layer, batch.num_tokens(), kv);
  return kv;
}

}  // namespace attnrt
