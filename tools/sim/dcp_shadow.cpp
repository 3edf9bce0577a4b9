#include "tools/sim/dcp_shadow.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>

#include "attnrt/core/error.h"

namespace attnrt::sim {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

DcpShadow::DcpShadow(const ModelSpec& model, const Options& options, const RuntimeConfig& config,
                     Tolerance tolerance, FailureLog& failures)
    : tolerance_(tolerance), failures_(&failures) {
  ModelSpec sub = model;
  sub.layers.clear();
  for (const LayerSpec& l : model.layers) {
    if (!l.uses_kv_cache()) continue;
    ModelSpec one = model;
    one.layers = {l};
    try {
      validate_dcp(one, options);
      sub.layers.push_back(l);
      sub.layers.back().layer_id = static_cast<int>(split_.size());  // ids 0.. in order
      split_.push_back(l.layer_id);
    } catch (const Error& e) {
      left_.push_back(fmt::format("layer {}: {}", l.layer_id, e.what()));
    }
  }
  ATTNRT_CHECK(!sub.layers.empty(),
               "--dcp-size {}: no attention layer of model '{}' can be split by context ({}); "
               "use --dcp-size 1 or another model",
               options.dcp_size, model.name, fmt::join(left_, "; "));
  group_ = std::make_unique<DcpAttention>(std::move(sub), options, config);
  Options one = options;
  one.dcp_size = 1;
  gpu_ = kv_pool_device(resolve_backends(one, model)) == DeviceKind::cuda;
}

bool DcpShadow::splits(int layer_id) const { return group_id(layer_id) >= 0; }

int DcpShadow::group_id(int layer_id) const {
  const auto it = std::find(split_.begin(), split_.end(), layer_id);
  return it == split_.end() ? -1 : static_cast<int>(it - split_.begin());
}

void DcpShadow::begin_step(const ForwardBatch& batch) {
  const auto t0 = std::chrono::steady_clock::now();
  group_->begin_step(batch);
  seconds_ += seconds_since(t0);
}

void DcpShadow::forward(const LayerSite& site, const AttnArgs& args) {
  const TensorView& want = args.out;
  HostBuffer out(want.dtype, {want.shape[0], want.shape[1], want.shape[2]});
  poison(out.view());
  AttnArgs a = args;
  a.out = out.view();
  a.lse = TensorView();
  const auto t0 = std::chrono::steady_clock::now();
  group_->forward(group_id(site.layer->layer_id), a);
  seconds_ += seconds_since(t0);
  const Comparison c = compare(out.view(), want, tolerance_);
  ++compared_;
  max_abs_ = std::max(max_abs_, c.max_abs);
  if (c.bad > 0) {
    ++bad_;
    failures_->record(
        site, c,
        fmt::format("step {} {} layer {}: dcp ({} ranks) differs from the single runtime at "
                    "token {} head {} column {}: {} vs {} ({} elements beyond tolerance)",
                    site.step, forward_mode_name(site.mode), site.layer->layer_id, group_->size(),
                    c.token, c.head, c.column, c.got, c.expected, c.bad));
  }
}

void DcpShadow::store_latent(const LayerSite& site, const TensorView& latent) {
  const LayerSpec& l = *site.layer;
  const int64_t T = latent.shape[0];
  // The latent's dtype (cuda ranks take bf16 / fp16 activations only).
  HostBuffer q(latent.dtype, {T, l.num_q_heads, l.head_dim}),
      out(latent.dtype, {T, l.num_q_heads, l.v_head_dim});
  for (int64_t i = 0; i < q.view().numel(); ++i) store_from_float(q.view().data, q.view().dtype, i, 0.f);
  AttnArgs a;
  a.q = q.view();
  a.k = latent;
  a.out = out.view();
  const auto t0 = std::chrono::steady_clock::now();
  group_->forward(group_id(l.layer_id), a);
  seconds_ += seconds_since(t0);
  ++stored_only_;
}

void DcpShadow::end_step() { group_->end_step(); }

void DcpShadow::commit_verify(const ForwardBatch& batch,
                              const std::vector<std::vector<int>>& paths) {
  group_->commit_verify(batch, paths);
}

std::vector<std::string> DcpShadow::notes() const {
  std::vector<std::string> n;
  n.push_back(fmt::format(
      "dcp: {} simulated ranks ({}, docs/dcp.md) over layers {}: {} layer "
      "calls compared with the single runtime, {} beyond tolerance, largest difference {:.3g}; "
      "{:.3f} s on the ranks{}",
      group_->size(),
      gpu_ ? "cuda ranks sharing ONE GPU, each a runtime of its own; host activations staged "
             "per rank, in-process all-to-all: this checks correctness, the time is not DCP's "
             "speed"
           : "in-process all-to-all",
      fmt::join(split_, ", "), compared_, bad_, max_abs_, seconds_,
      stored_only_ > 0 ? fmt::format("; {} MLA calls in the MHA form only stored their latent "
                                     "rows on the ranks (DCP splits the absorbed form)",
                                     stored_only_)
                       : ""));
  for (const std::string& why : left_) n.push_back("dcp: not split, " + why);
  return n;
}

}  // namespace attnrt::sim
