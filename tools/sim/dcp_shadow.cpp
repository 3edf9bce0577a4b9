#include "tools/sim/dcp_shadow.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>

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
  const Selection selection = resolve_backends(one, model);
  gpu_ = kv_pool_device(selection) == DeviceKind::cuda;
  if (!gpu_) return;
  if (!group_->cuda_graphs_enabled()) {
    graphs_off_ = group_->cuda_graphs_off_reason();
    return;
  }
  // Graph steps: DECODE (a row per request) and TARGET_VERIFY (the block of every request).
  const int per_request = std::max(options.speculative_num_draft_tokens, 1);
  max_rows_ = std::min(config.max_num_tokens, config.max_requests * per_request);
  const DeviceServices& device = kv_pool_services(selection);
  capture_ = device.make_stream_capture();
  group_->set_stream(capture_->stream());
  group_->init_cuda_graph_state(max_rows_);
  tensors_ = device.make_tensors(group_->rank(0).runtime().kv_cache());
  const int64_t rows = max_rows_;
  const DType dt = model.dtype;
  for (const LayerSpec& l : group_->model().layers) {
    const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
    const size_t act = dtype_size(dt);
    auto make = [&](int64_t heads, int64_t dim) {
      return tensors_->allocate(static_cast<size_t>(rows * heads * dim) * act,
                                TensorView(nullptr, dt, {rows, heads, dim}));
    };
    Static& st = static_[l.layer_id];
    st.q = make(l.num_q_heads, l.head_dim);
    st.k = make(l.num_kv_heads, l.head_dim);
    if (l.kind != LayerKind::mla) st.v = make(l.num_kv_heads, dv);
    st.out = make(l.num_q_heads, dv);
    if (l.has_sinks) {
      st.sinks = tensors_->allocate(l.num_q_heads * sizeof(float),
                                    TensorView(nullptr, DType::f32, {l.num_q_heads}));
    }
  }
}

bool DcpShadow::splits(int layer_id) const { return group_id(layer_id) >= 0; }

int DcpShadow::group_id(int layer_id) const {
  const auto it = std::find(split_.begin(), split_.end(), layer_id);
  return it == split_.end() ? -1 : static_cast<int>(it - split_.begin());
}

void DcpShadow::begin_step(const ForwardBatch& batch) {
  step_rows_ = 0;
  const int64_t T = batch.num_tokens();
  if (max_rows_ > 0 && (is_decode(batch.mode) || is_target_verify(batch.mode)) && T >= 1 &&
      T <= max_rows_) {
    // A graph of the next power of two rows (the largest holds max_rows_), replayed at end_step.
    int64_t rows = 1;
    while (rows < T) rows *= 2;
    step_rows_ = std::min<int64_t>(rows, max_rows_);
    step_tokens_ = T;
    step_batch_ = &batch;
    pending_.clear();
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  group_->begin_step(batch);
  seconds_ += seconds_since(t0);
}

namespace {

// The first `rows` rows of a static tensor.
TensorView first_rows(TensorView t, int64_t rows) {
  t.shape[0] = rows;
  return t;
}

}  // namespace

void DcpShadow::forward(const LayerSite& site, const AttnArgs& args) {
  const TensorView& want = args.out;
  if (step_rows_ > 0) {
    // A graph step: the layer's inputs into its static tensors (on the group's stream); the
    // output is compared after the replay.
    const int id = group_id(site.layer->layer_id);
    Static& st = static_.at(id);
    AttentionRuntime& copier = group_->rank(0).runtime();
    copier.copy_tensor(first_rows(st.q, step_tokens_), args.q);
    copier.copy_tensor(first_rows(st.k, step_tokens_), args.k);
    if (!st.v.empty()) copier.copy_tensor(first_rows(st.v, step_tokens_), args.v);
    if (!st.sinks.empty() && !st.sinks_written) {
      // A weight: the same every step.
      copier.copy_tensor(st.sinks, TensorView(const_cast<float*>(args.sinks), DType::f32,
                                              {site.layer->num_q_heads}));
      st.sinks_written = true;
    }
    Pending p{site, id, HostBuffer(want.dtype, {want.shape[0], want.shape[1], want.shape[2]})};
    std::memcpy(p.want.view().data, want.data,
                static_cast<size_t>(want.numel()) * dtype_size(want.dtype));
    pending_.push_back(std::move(p));
    return;
  }
  HostBuffer out(want.dtype, {want.shape[0], want.shape[1], want.shape[2]});
  poison(out.view());
  AttnArgs a = args;
  a.out = out.view();
  a.lse = TensorView();
  const auto t0 = std::chrono::steady_clock::now();
  group_->forward(group_id(site.layer->layer_id), a);
  seconds_ += seconds_since(t0);
  check(site, out.view(), want);
}

void DcpShadow::check(const LayerSite& site, const TensorView& got, const TensorView& want) {
  const Comparison c = compare(got, want, tolerance_);
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
  ATTNRT_CHECK(step_rows_ == 0,
               "attnrt run --dcp-size: an MLA layer in the MHA form in a {} step, which the "
               "ranks replay from a CUDA graph (only EXTEND-like steps take the MHA form)",
               forward_mode_name(site.mode));
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

void DcpShadow::end_step() {
  if (step_rows_ > 0) {
    replay();
    step_rows_ = 0;
    return;
  }
  group_->end_step();
}

// Captures a step of `rows` rows over the static tensors, as an engine captures its own.
void DcpShadow::capture(int rows) {
  group_->begin_capture_step(rows);
  capture_->begin();
  try {
    for (auto& [id, st] : static_) {
      AttnArgs a;
      a.q = first_rows(st.q, rows);
      a.k = first_rows(st.k, rows);
      if (!st.v.empty()) a.v = first_rows(st.v, rows);
      a.out = first_rows(st.out, rows);
      a.sinks = st.sinks.empty() ? nullptr : st.sinks.ptr<const float>();
      group_->forward(id, a);
    }
  } catch (...) {
    capture_->abort();
    group_->end_step();
    throw;
  }
  graphs_[rows] = capture_->end();
  group_->end_step();
}

// The graph step in progress: captured if its row count is new, then the step written into the
// graph's buffers, one launch, and each layer's output compared.
void DcpShadow::replay() {
  const auto t0 = std::chrono::steady_clock::now();
  const int rows = static_cast<int>(step_rows_);
  if (graphs_.find(rows) == graphs_.end()) capture(rows);
  AttentionRuntime& copier = group_->rank(0).runtime();
  for (auto& [id, st] : static_) {
    HostBuffer nan(st.out.dtype, {rows, st.out.shape[1], st.out.shape[2]});
    poison(nan.view());
    copier.copy_tensor(first_rows(st.out, rows), nan.view());
  }
  group_->begin_replay_step(*step_batch_, rows);
  capture_->launch(graphs_.at(rows));
  capture_->synchronize();
  group_->end_step();
  seconds_ += seconds_since(t0);
  ++graph_steps_;
  for (Pending& p : pending_) {
    const TensorView& want = p.want.view();
    HostBuffer got(want.dtype, {want.shape[0], want.shape[1], want.shape[2]});
    copier.copy_tensor(got.view(), first_rows(static_.at(p.group_layer).out, step_tokens_));
    check(p.site, got.view(), want);
  }
  pending_.clear();
}

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
  if (max_rows_ > 0) {
    std::vector<int> rows;
    for (const auto& [r, g] : graphs_) rows.push_back(r);
    n.push_back(fmt::format(
        "dcp: CUDA graphs: {} DECODE / TARGET_VERIFY steps of up to {} tokens replayed from "
        "graphs the group captured as an engine would (docs/dcp.md \"CUDA graphs\"), at {} rows; "
        "other steps eager",
        graph_steps_, max_rows_, rows.empty() ? std::string("no") : fmt::format("{}", fmt::join(rows, ", "))));
  } else if (!graphs_off_.empty()) {
    n.push_back("dcp: CUDA graphs off, every step eager: " + graphs_off_);
  }
  for (const std::string& why : left_) n.push_back("dcp: not split, " + why);
  return n;
}

}  // namespace attnrt::sim
