#include "backends/reference/reference_backend.h"

#include <memory>

#include "attnrt/core/error.h"

namespace attnrt {

ReferenceBackend::ReferenceBackend(const BackendContext& ctx) : AttentionBackend(ctx) {}

void ReferenceBackend::init_forward_metadata(const ForwardBatch& batch) {
  layout_ = make_step_layout(batch);
  planned_ = &batch;
}

void ReferenceBackend::forward_decode(const AttnArgs& args, const LayerSpec& layer,
                                      const ForwardBatch& batch) {
  run(args, layer, batch);
}

void ReferenceBackend::forward_extend(const AttnArgs& args, const LayerSpec& layer,
                                      const ForwardBatch& batch) {
  run(args, layer, batch);
}

void ReferenceBackend::run(const AttnArgs&, const LayerSpec&, const ForwardBatch&) {
  fail("reference backend: attention is being implemented in this revision");
}

BackendEntry reference_backend_entry() {
  BackendEntry e;
  e.name = "reference";
  e.summary = "float64 CPU oracle for every full-attention mode (slow; never auto-selected)";
  e.caps.devices = {DeviceKind::cpu};
  e.caps.kv_dtypes = {DType::f32, DType::f16, DType::bf16, DType::e4m3, DType::e5m2};
  e.caps.spec_topk1 = true;
  e.caps.spec_topk_gt1 = true;
  e.caps.sliding_window = true;
  e.caps.softcap = true;
  e.caps.sinks = true;
  e.caps.non_causal = true;
  e.caps.mla = false;
  e.caps.cuda_graphs = false;
  e.auto_selectable = false;
  e.unavailable_reason = [] { return std::string(); };
  e.factory = [](const BackendContext& ctx) -> std::unique_ptr<AttentionBackend> {
    return std::make_unique<ReferenceBackend>(ctx);
  };
  return e;
}

void register_reference_backend(Registry& registry) { registry.add(reference_backend_entry()); }

}  // namespace attnrt
