// The reference backend: the correctness oracle every other backend is compared with
// (reference-semantics §8). Plain loops with float64 accumulation over per-token slots read through
// ReqToTokenPool rows; no performance work, every full-attention feature.
#pragma once

#include <string_view>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"

namespace attnrt {

class ReferenceBackend final : public AttentionBackend {
 public:
  explicit ReferenceBackend(const BackendContext& ctx);

  std::string_view name() const override { return "reference"; }
  void init_forward_metadata(const ForwardBatch& batch) override;
  void forward_decode(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;
  void forward_extend(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;

  // The plan of the current step (valid after init_forward_metadata).
  const StepLayout& layout() const { return layout_; }

 private:
  void run(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch);

  StepLayout layout_;
  const ForwardBatch* planned_ = nullptr;
};

// The registry entry "reference": cpu only, any page size, every KV dtype, never auto-selected.
BackendEntry reference_backend_entry();
void register_reference_backend(Registry& registry);

}  // namespace attnrt
