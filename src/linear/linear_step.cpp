#include "attnrt/linear/linear_step.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <initializer_list>
#include <string>

#include "attnrt/core/error.h"

namespace attnrt::linear {

StepPlan make_step_plan(const ForwardBatch& batch, const LinearStatePool& pool,
                        std::string_view backend) {
  StepPlan plan;
  plan.mode = batch.mode;
  if (is_idle(batch.mode)) return plan;
  const StepLayout layout = make_step_layout(batch);
  const int bs = batch.batch_size;
  plan.num_tokens = layout.num_tokens;
  plan.verify = is_target_verify(batch.mode);
  if (plan.verify) {
    const SpecInfo& spec = *batch.spec_info;
    plan.draft_tokens = spec.draft_token_num;
    ATTNRT_CHECK(pool.has_checkpoints(),
                 "{} linear backend: TARGET_VERIFY step, but the linear state pool keeps no "
                 "per-token checkpoints; build the runtime with speculative decoding enabled "
                 "(--speculative-num-steps) so that the pool has verify rows",
                 backend);
    ATTNRT_CHECK(spec.draft_token_num == pool.num_draft_tokens(),
                 "{} linear backend: TARGET_VERIFY step with {} tokens per request, but the linear "
                 "state pool keeps checkpoints for {} (--speculative-num-draft-tokens)",
                 backend, spec.draft_token_num, pool.num_draft_tokens());
    ATTNRT_CHECK(bs <= pool.verify_rows(),
                 "{} linear backend: TARGET_VERIFY step of {} requests, but the linear state pool "
                 "keeps checkpoints for {} requests",
                 backend, bs, pool.verify_rows());
    plan.parents = spec.parents;
  }
  plan.reqs.resize(bs);
  plan.slots.resize(bs);
  for (int i = 0; i < bs; ++i) {
    const int64_t row = batch.req_pool_indices[i];
    const int slot = pool.slot_of(static_cast<int>(row));
    ATTNRT_CHECK(slot >= 0,
                 "{} linear backend: request {} (request row {}) has no linear state slot; give "
                 "every request a slot when it starts (LinearStatePool::alloc_for)",
                 backend, i, row);
    RequestWork& w = plan.reqs[i];
    w.slot = slot;
    w.token_start = layout.query_start[i];
    w.tokens = layout.query_lens[i];
    w.has_initial_state = layout.prefix_lens[i] > 0;
    plan.slots[i] = slot;
    plan.max_tokens = std::max<int64_t>(plan.max_tokens, w.tokens);
  }
  return plan;
}

namespace {

std::string dims_text(std::initializer_list<int64_t> dims) {
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

void check_common(std::string_view backend, const char* what, const TensorView& t,
                  std::initializer_list<int64_t> dims, const char* meaning, bool device_ok) {
  ATTNRT_CHECK(!t.empty(), "{} linear backend: {} is empty; expected {} = {}", backend, what,
               meaning, dims_text(dims));
  ATTNRT_CHECK(t.device.kind == DeviceKind::cpu || (device_ok && t.device.kind == DeviceKind::cuda),
               "{} linear backend: {} is {}; this backend reads {}", backend, what, t.describe(),
               device_ok ? "host or CUDA memory" : "host memory only");
  ATTNRT_CHECK(is_float(t.dtype) && !is_fp8(t.dtype),
               "{} linear backend: {} is {}; expected fp32, bf16 or fp16", backend, what,
               t.describe());
  bool ok = t.ndim == static_cast<int>(dims.size());
  int d = 0;
  for (int64_t want : dims) ok = ok && t.shape[d++] == want;
  ATTNRT_CHECK(ok, "{} linear backend: {} is {}; expected {} = {}", backend, what, t.describe(),
               meaning, dims_text(dims));
}

// Per-token tensors: any stride between tokens, the rest contiguous.
void check_tokens(std::string_view backend, const char* what, const TensorView& t,
                  std::initializer_list<int64_t> dims, const char* meaning, bool device_ok) {
  check_common(backend, what, t, dims, meaning, device_ok);
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 1; --d) {
    ATTNRT_CHECK(
        t.shape[d] == 1 || t.strides[d] == stride,
        "{} linear backend: {} is {} with strides ({}); only the token dimension may be "
        "strided",
        backend, what, t.describe(),
        fmt::join(std::vector<int64_t>(t.strides.begin(), t.strides.begin() + t.ndim), ", "));
    stride *= t.shape[d];
  }
  ATTNRT_CHECK(t.shape[0] <= 1 || t.strides[0] >= stride,
               "{} linear backend: {} has token stride {}, less than a token's {} elements",
               backend, what, t.strides[0], stride);
}

void check_param(std::string_view backend, const char* what, const TensorView& t,
                 std::initializer_list<int64_t> dims, const char* meaning, bool device_ok) {
  check_common(backend, what, t, dims, meaning, device_ok);
  ATTNRT_CHECK(t.dtype == DType::f32, "{} linear backend: {} is {}; layer parameters are fp32",
               backend, what, t.describe());
  ATTNRT_CHECK(t.is_contiguous(), "{} linear backend: {} is {} and not contiguous", backend, what,
               t.describe());
}

}  // namespace

void check_linear_args(const LinearArgs& args, const LayerSpec& layer, int64_t num_tokens,
                       std::string_view backend, bool device_tensors) {
  ATTNRT_CHECK(is_linear_kind(layer.kind),
               "{} linear backend: layer {} is a {} layer; forward_linear serves gdn, kda and "
               "mamba2 layers",
               backend, layer.layer_id, layer_kind_name(layer.kind));
  const LinearStateShape sh = linear_state_shape(layer);
  const LinearSpec& s = layer.linear;
  const int64_t T = num_tokens;
  const int64_t heads = sh.heads;
  check_tokens(backend, "mixed_qkv", args.mixed_qkv, {T, sh.conv_dim}, "[tokens, conv_dim]",
               device_tensors);
  check_param(backend, "conv_weight", args.conv_weight, {sh.conv_dim, s.conv_kernel},
              "[conv_dim, conv_kernel]", device_tensors);
  if (!args.conv_bias.empty()) {
    check_param(backend, "conv_bias", args.conv_bias, {sh.conv_dim}, "[conv_dim]", device_tensors);
  }
  check_param(backend, "A_log", args.A_log, {heads}, "[heads]", device_tensors);
  check_tokens(backend, "out", args.out, {T, heads, sh.rows},
               layer.kind == LayerKind::mamba2 ? "[tokens, heads, head_dim]"
                                               : "[tokens, value heads, head_v_dim]",
               device_tensors);
  switch (layer.kind) {
    case LayerKind::gdn:
      check_tokens(backend, "a", args.a, {T, heads}, "[tokens, value heads]", device_tensors);
      check_tokens(backend, "b", args.b, {T, heads}, "[tokens, value heads]", device_tensors);
      check_param(backend, "dt_bias", args.dt_bias, {heads}, "[value heads]", device_tensors);
      break;
    case LayerKind::kda:
      check_tokens(backend, "a", args.a, {T, heads, s.head_k_dim}, "[tokens, heads, head_k_dim]",
                   device_tensors);
      check_tokens(backend, "b", args.b, {T, heads}, "[tokens, heads]", device_tensors);
      check_param(backend, "dt_bias", args.dt_bias, {heads, s.head_k_dim}, "[heads, head_k_dim]",
                  device_tensors);
      break;
    case LayerKind::mamba2:
      check_tokens(backend, "a (dt)", args.a, {T, heads}, "[tokens, heads]", device_tensors);
      check_param(backend, "dt_bias", args.dt_bias, {heads}, "[heads]", device_tensors);
      check_param(backend, "D", args.D, {heads}, "[heads]", device_tensors);
      ATTNRT_CHECK(args.b.empty(),
                   "{} linear backend: layer {} is mamba2, which takes no b (beta) input, but b "
                   "is {}",
                   backend, layer.layer_id, args.b.describe());
      break;
    default:
      break;
  }
}

}  // namespace attnrt::linear
