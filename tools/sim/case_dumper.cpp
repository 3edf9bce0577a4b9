#include "tools/sim/case_dumper.h"

#include <fmt/format.h>

#include "tools/io/case_file.h"

namespace attnrt::sim {

CaseDumper::CaseDumper(int step, std::string dir) : step_(step), dir_(std::move(dir)) {}

int CaseDumper::layer_of(const ModelSpec& m) {
  for (const LayerSpec& l : m.layers) {
    if (l.kind == LayerKind::full && l.sliding_window < 0) return l.layer_id;
  }
  for (const LayerSpec& l : m.layers) {
    if (l.uses_kv_cache()) return l.layer_id;
  }
  return -1;
}

bool CaseDumper::wants_step(int index, int64_t tokens) const {
  return step_ >= 0 && index == step_ && tokens > 0;
}

bool CaseDumper::wants_layer(int index, int64_t tokens, const ModelSpec& model,
                             int layer_id) const {
  return wants_step(index, tokens) && layer_id == layer_of(model);
}

void CaseDumper::write(int index, ModelRole role, const ModelSpec& model, int layer_id,
                       const Options& options, const ForwardBatch& batch,
                       const ReqToTokenPool& req_to_token, const KVCache& kv_cache,
                       const AttnArgs& args, const std::string& backend) {
  write_step_case(dir_, model, layer_id, options, batch, req_to_token, kv_cache, args, backend);
  written_ = fmt::format("{} (step {}, {} {}, layer {})", dir_, index, model_role_name(role),
                         forward_mode_name(batch.mode), layer_id);
}

std::string CaseDumper::error(int steps_planned) const {
  if (step_ < 0 || !written_.empty()) return {};
  if (step_ >= steps_planned) {
    return fmt::format("--dump-step {}: the run had only {} steps (0 .. {})", step_, steps_planned,
                       steps_planned - 1);
  }
  return fmt::format(
      "--dump-step {}: that step is IDLE (no tokens, nothing to replay); pick a step with tokens",
      step_);
}

}  // namespace attnrt::sim
