// LinearAttnBackend: the base of a backend's linear-attention side, the object
// BackendEntry::linear_factory creates to serve the gdn / kda / mamba2 layers (forward_linear) and
// commit their state after a verify. What every such side does alike lives here: the step plan
// over BackendContext::linear_state, the refusal of full-attention calls, the checks at the start
// of forward_linear and of the commit, and the commit into a host pool. Every message starts with
// "<name()> linear backend:".
#pragma once

#include <cstdint>
#include <span>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/linear/linear_step.h"

namespace attnrt {

class LinearStatePool;

class LinearAttnBackend : public AttentionBackend {
 public:
  using AttentionBackend::AttentionBackend;

  // plan_ = linear::make_step_plan over the pool.
  void init_forward_metadata(const ForwardBatch& batch) override;
  // Both throw: this object serves only the linear layers.
  void forward_decode(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) final;
  void forward_extend(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) final;
  // check_commit, then LinearStatePool::commit_verify (a pool in host memory).
  void update_state_after_verify(std::span<const int32_t> last_accepted) override;

 protected:
  // BackendContext::linear_state; throws when it is null.
  LinearStatePool& pool() const;
  // The start of forward_linear: throws unless plan_ was made for this batch, then checks `args`
  // against the layer (linear::check_linear_args, device_tensors as there). False when the step
  // has nothing to run (IDLE, or no tokens).
  bool begin_layer(const LinearArgs& args, const LayerSpec& layer, const ForwardBatch& batch,
                   bool device_tensors = false) const;
  // The checks of update_state_after_verify: plan_ is a TARGET_VERIFY step's and last_accepted
  // has one index per request of it.
  void check_commit(std::span<const int32_t> last_accepted) const;

  linear::StepPlan plan_;
  bool planned_ = false;
};

}  // namespace attnrt
