#include "attnrt/backend/linear_attn_backend.h"

#include "attnrt/core/error.h"
#include "attnrt/memory/linear_state_pool.h"

namespace attnrt {

void LinearAttnBackend::init_forward_metadata(const ForwardBatch& batch) {
  planned_ = false;
  plan_ = linear::make_step_plan(batch, pool(), name());
  planned_ = true;
}

void LinearAttnBackend::forward_decode(const AttnArgs&, const LayerSpec& layer,
                                       const ForwardBatch&) {
  fail(
      "{} linear backend: layer {} ({}) is not a linear-attention layer; this object serves "
      "only the linear layers (forward_linear)",
      name(), layer.layer_id, layer_kind_name(layer.kind));
}

void LinearAttnBackend::forward_extend(const AttnArgs& args, const LayerSpec& layer,
                                       const ForwardBatch& batch) {
  forward_decode(args, layer, batch);
}

void LinearAttnBackend::update_state_after_verify(std::span<const int32_t> last_accepted) {
  check_commit(last_accepted);
  pool().commit_verify(plan_.slots, last_accepted);
}

LinearStatePool& LinearAttnBackend::pool() const {
  ATTNRT_CHECK(ctx_.linear_state != nullptr,
               "{} linear backend: BackendContext.linear_state is null; the linear layers keep "
               "their state in a LinearStatePool",
               name());
  return *ctx_.linear_state;
}

bool LinearAttnBackend::begin_layer(const LinearArgs& args, const LayerSpec& layer,
                                    const ForwardBatch& batch, bool device_tensors) const {
  ATTNRT_CHECK(planned_ && plan_.mode == batch.mode &&
                   static_cast<int>(plan_.reqs.size()) == batch.batch_size &&
                   (is_idle(batch.mode) || plan_.num_tokens == batch.num_tokens()),
               "{} linear backend: forward_linear for a {} batch of {} requests / {} tokens "
               "without a matching init_forward_metadata for this step",
               name(), forward_mode_name(batch.mode), batch.batch_size, batch.num_tokens());
  if (is_idle(batch.mode) || plan_.num_tokens == 0) return false;
  linear::check_linear_args(args, layer, plan_.num_tokens, name(), device_tensors);
  return true;
}

void LinearAttnBackend::check_commit(std::span<const int32_t> last_accepted) const {
  ATTNRT_CHECK(planned_ && plan_.verify,
               "{} linear backend: update_state_after_verify after a {} step; it commits the "
               "checkpoints of the TARGET_VERIFY step that just ran",
               name(), forward_mode_name(plan_.mode));
  ATTNRT_CHECK(last_accepted.size() == plan_.slots.size(),
               "{} linear backend: update_state_after_verify with {} accepted indices for a "
               "verify step of {} requests",
               name(), last_accepted.size(), plan_.slots.size());
}

}  // namespace attnrt
