#include "tools/sim/checker.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attnrt/core/error.h"
#include "attnrt/memory/linear_state_pool.h"
#include "backends/reference/reference_backend.h"
#include "tests/conformance/conformance.h"
#include "tools/sim/step_inputs.h"

namespace attnrt::sim {

namespace {

std::string where_text(const LayerSite& s) {
  return fmt::format("step {} ({} {}), layer {}", s.step, model_role_name(s.role),
                     forward_mode_name(s.mode), s.layer->layer_id);
}

// Conv window and recurrent state bytes per slot of one linear layer.
std::pair<size_t, size_t> state_bytes(const LinearLayerState& st) {
  return {static_cast<size_t>(st.shape.conv_elems()) * dtype_size(st.conv_dtype),
          static_cast<size_t>(st.shape.ssm_elems()) * dtype_size(st.ssm_dtype)};
}

// Calls slot(slot, at) for each slot of `r`, then (verify) checkpoint(request, token, at) for each
// checkpoint: `at` is the entry's place in a StateCopy, slots first.
template <class Slot, class Checkpoint>
void for_each_state(const StateRegion& r, Slot&& slot, Checkpoint&& checkpoint) {
  size_t at = 0;
  for (int64_t s : r.slots) slot(static_cast<int>(s), at++);
  for (int64_t k = 0; r.verify && k < r.checkpoints; ++k, ++at) {
    checkpoint(static_cast<int>(k / r.draft_tokens), static_cast<int>(k % r.draft_tokens), at);
  }
}

}  // namespace

Tolerance output_tolerance(DType out_dtype) {
  ATTNRT_CHECK(is_float(out_dtype) && !is_fp8(out_dtype),
               "no output tolerance for dtype {}; outputs are fp32, fp16 or bf16",
               dtype_name(out_dtype));
  const conformance::Tolerance t = conformance::tolerance_for(out_dtype);
  return {t.abs, t.rel};
}

namespace {

// Folds the elements [first, first + n) of the flat [rows, d1, d2] tensors into `c`.
void compare_span(const TensorView& got, const TensorView& expected, const Tolerance& tol,
                  int64_t first, int64_t n, Comparison& c) {
  const int heads = static_cast<int>(got.shape[1]), dim = static_cast<int>(got.shape[2]);
  for (int64_t i = first; i < first + n; ++i) {
    const double g = load_as_float(got.data, got.dtype, static_cast<size_t>(i));
    const double r = load_as_float(expected.data, expected.dtype, static_cast<size_t>(i));
    const double d = std::abs(g - r);
    const double allowed = tol.atol + tol.rtol * std::abs(r);
    // NaN (an unwritten, poisoned element) fails every comparison.
    const bool ok = d <= allowed;
    const double excess =
        ok ? 0 : (std::isnan(d) ? std::numeric_limits<double>::infinity() : d - allowed);
    if (!std::isnan(d)) {
      c.max_abs = std::max(c.max_abs, d);
      c.max_rel = std::max(c.max_rel, d / std::max(std::abs(r), tol.atol));
    } else {
      c.max_abs = c.max_rel = std::numeric_limits<double>::infinity();
    }
    if (!ok) {
      ++c.bad;
      if (excess > c.worst_excess) {
        c.worst_excess = excess;
        c.token = i / (heads * dim);
        c.head = static_cast<int>(i / dim % heads);
        c.column = static_cast<int>(i % dim);
        c.got = g;
        c.expected = r;
      }
    }
  }
}

}  // namespace

Comparison compare(const TensorView& got, const TensorView& expected, const Tolerance& tol) {
  Comparison c;
  compare_span(got, expected, tol, 0, got.numel(), c);
  return c;
}

Comparison compare(const TensorView& got, const TensorView& expected, const Tolerance& tol,
                   const RowSample& sample) {
  const int64_t rows = got.shape[0], heads = got.shape[1], dim = got.shape[2];
  Comparison c;
  for (int64_t r = 0; r < rows; ++r) {
    if (!sample.tokens.empty() &&
        !std::binary_search(sample.tokens.begin(), sample.tokens.end(), r)) {
      continue;
    }
    if (sample.heads.empty()) {
      compare_span(got, expected, tol, r * heads * dim, heads * dim, c);
      continue;
    }
    for (int h : sample.heads) compare_span(got, expected, tol, (r * heads + h) * dim, dim, c);
  }
  return c;
}

std::vector<int64_t> sample_tokens(const ForwardBatch& batch, int max_tokens, uint64_t seed) {
  const StepLayout layout = make_step_layout(batch);
  const int64_t T = layout.num_tokens;
  std::vector<int64_t> rows;
  if (max_tokens <= 0 || T <= max_tokens) {
    rows.resize(T);
    for (int64_t t = 0; t < T; ++t) rows[t] = t;
    return rows;
  }
  std::vector<uint8_t> taken(T, 0);
  for (size_t i = 0; i < layout.query_lens.size(); ++i) {
    const int64_t len = layout.query_lens[i];
    if (len == 0) continue;
    taken[layout.query_start[i] + len - 1] = 1;
    taken[layout.query_start[i]] = 1;
  }
  int64_t count = std::count(taken.begin(), taken.end(), uint8_t{1});
  // The rest at random among the rows not taken (a partial Fisher-Yates shuffle).
  std::vector<int64_t> rest;
  for (int64_t t = 0; t < T; ++t) {
    if (!taken[t]) rest.push_back(t);
  }
  FastRng rng(seed);
  for (size_t k = 0; k < rest.size() && count < max_tokens; ++k, ++count) {
    const size_t pick = k + rng.next() % (rest.size() - k);
    std::swap(rest[k], rest[pick]);
    taken[rest[k]] = 1;
  }
  for (int64_t t = 0; t < T; ++t) {
    if (taken[t]) rows.push_back(t);
  }
  return rows;
}

std::vector<int> sample_heads(int num_q_heads, int max_heads, int64_t round) {
  const int stride = max_heads <= 0 ? 1 : (num_q_heads + max_heads - 1) / max_heads;
  std::vector<int> heads;
  for (int h = static_cast<int>(round % stride); h < num_q_heads; h += stride) heads.push_back(h);
  return heads;
}

// Typed fills: this runs for every layer of every step.
void poison(const TensorView& t) {
  const int64_t n = t.numel();
  switch (t.dtype) {
    case DType::f32:
      std::fill_n(t.ptr<float>(), n, std::numeric_limits<float>::quiet_NaN());
      return;
    case DType::bf16:
      std::fill_n(t.ptr<uint16_t>(), n, uint16_t{0x7fc0});
      return;
    case DType::f16:
      std::fill_n(t.ptr<uint16_t>(), n, uint16_t{0x7e00});
      return;
    default:
      for (int64_t i = 0; i < n; ++i) {
        store_from_float(t.data, t.dtype, static_cast<size_t>(i),
                         std::numeric_limits<float>::quiet_NaN());
      }
  }
}

// NaN tests on the raw bits for the 16-bit dtypes: this runs for every layer of every step.
int64_t first_nan(const TensorView& t) {
  const int64_t n = t.numel();
  auto first_nan_bits = [n](const uint16_t* p, uint16_t inf_bits) -> int64_t {
    for (int64_t i = 0; i < n; ++i) {
      if ((p[i] & 0x7fff) > inf_bits) return i;
    }
    return -1;
  };
  switch (t.dtype) {
    case DType::bf16:
      return first_nan_bits(t.ptr<uint16_t>(), 0x7f80);
    case DType::f16:
      return first_nan_bits(t.ptr<uint16_t>(), 0x7c00);
    default:
      for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(load_as_float(t.data, t.dtype, static_cast<size_t>(i)))) return i;
      }
      return -1;
  }
}

void FailureLog::record(const LayerSite& site, const Comparison& c, std::string what) {
  ++count_;
  int& listed = listed_per_mode_[{static_cast<int>(site.role), static_cast<int>(site.mode)}];
  if (listed >= kMaxListedPerMode) return;
  ++listed;
  CheckFailure f;
  f.step = site.step;
  f.role = site.role;
  f.mode = site.mode;
  f.layer = site.layer->layer_id;
  f.token = c.token;
  f.head = c.head;
  f.column = c.column;
  f.got = c.got;
  f.expected = c.expected;
  f.abs_err = std::abs(c.got - c.expected);
  f.what = std::move(what);
  listed_.push_back(std::move(f));
}

StateCopy save_state(const LinearStatePool& pool, int layer_id, const StateRegion& r) {
  // Plain variables: lambdas capture no structured bindings before clang 16 (sanitize/fuzz build).
  const std::pair<size_t, size_t> bytes = state_bytes(pool.layer(layer_id));
  const size_t cb = bytes.first, sb = bytes.second;
  StateCopy c;
  c.count = static_cast<int64_t>(r.slots.size()) + (r.verify ? r.checkpoints : 0);
  c.conv.resize(cb * static_cast<size_t>(c.count));
  c.ssm.resize(sb * static_cast<size_t>(c.count));
  for_each_state(
      r,
      [&](int slot, size_t at) {
        pool.download_slot(layer_id, slot, &c.conv[cb * at], &c.ssm[sb * at]);
      },
      [&](int request, int token, size_t at) {
        pool.download_checkpoint(layer_id, request, token, &c.conv[cb * at], &c.ssm[sb * at]);
      });
  return c;
}

void restore_state(LinearStatePool& pool, int layer_id, const StateRegion& r, const StateCopy& c) {
  const std::pair<size_t, size_t> bytes = state_bytes(pool.layer(layer_id));
  const size_t cb = bytes.first, sb = bytes.second;
  for_each_state(
      r,
      [&](int slot, size_t at) {
        pool.upload_slot(layer_id, slot, &c.conv[cb * at], &c.ssm[sb * at]);
      },
      [&](int request, int token, size_t at) {
        pool.upload_checkpoint(layer_id, request, token, &c.conv[cb * at], &c.ssm[sb * at]);
      });
}

ReferenceChecker::ReferenceChecker(std::unique_ptr<AttentionBackend> reference,
                                   std::unique_ptr<AttentionBackend> reference_linear,
                                   LinearStatePool* runtime_states,
                                   LinearStatePool* reference_states, Tolerance tolerance,
                                   FailureLog& log)
    : reference_(std::move(reference)),
      reference_linear_(std::move(reference_linear)),
      runtime_states_(runtime_states),
      reference_states_(reference_states),
      tolerance_(tolerance),
      log_(&log) {}

void ReferenceChecker::begin_step(const ForwardBatch& batch) {
  reference_->init_forward_metadata(batch);
  if (reference_linear_) reference_linear_->init_forward_metadata(batch);
}

TensorView ReferenceChecker::reference_out(const TensorView& like) {
  if (scratch_.numel() < like.numel() || scratch_.dtype() != like.dtype) {
    scratch_ = HostBuffer(like.dtype, {like.numel()});
  }
  const TensorView out(scratch_.data(), like.dtype, {like.shape[0], like.shape[1], like.shape[2]});
  poison(out);
  return out;
}

void ReferenceChecker::check_attention(const LayerSite& site, const ForwardBatch& batch,
                                       const AttnArgs& args, bool check, const RowSample& sample,
                                       ModeStats& stats) {
  const int64_t unwritten = first_nan(args.out);
  if (unwritten < 0 && !check) return;
  TensorView expected;
  if (check) {
    AttnArgs ref = args;
    ref.out = expected = reference_out(args.out);
    reference_forward(ref, *site.layer, batch, sample);
  }
  record_output(site, args.out, expected, unwritten, sample, stats);
}

void ReferenceChecker::reference_forward(const AttnArgs& args, const LayerSpec& layer,
                                         const ForwardBatch& batch, const RowSample& sample) {
  // The reference computes the sampled rows only (another oracle computes them all).
  auto* sampled = dynamic_cast<ReferenceBackend*>(reference_.get());
  if (sampled != nullptr) sampled->set_sample(sample.tokens, sample.heads);
  reference_->forward(args, layer, batch);
  if (sampled != nullptr) sampled->set_sample({}, {});
}

void ReferenceChecker::check_mla_mha(const LayerSite& site, const ForwardBatch& batch,
                                     const TensorView& q, const TensorView& out,
                                     const MlaWeights& weights, bool check,
                                     const RowSample& sample, ModeStats& stats) {
  const int64_t unwritten = first_nan(out);
  if (unwritten < 0 && !check) return;
  TensorView expected;
  if (check) {
    const LayerSpec& layer = *site.layer;
    const int64_t T = q.shape[0];
    const int Hq = layer.num_q_heads;
    HostBuffer q_lat(DType::f32, {T, Hq, layer.head_dim});
    HostBuffer out_lat(DType::f32, {T, Hq, layer.v_head_dim});
    weights.absorb_q(q, q_lat.view());
    AttnArgs ref;
    ref.q = q_lat.view();
    ref.out = out_lat.view();
    ref.save_kv = false;
    reference_forward(ref, layer, batch, sample);
    expected = reference_out(out);
    weights.project_out(out_lat.view(), expected);
  }
  record_output(site, out, expected, unwritten, sample, stats);
}

void ReferenceChecker::record_output(const LayerSite& site, const TensorView& got,
                                     const TensorView& expected, int64_t unwritten,
                                     const RowSample& sample, ModeStats& stats) {
  const bool check = !expected.empty();
  const int Hq = static_cast<int>(got.shape[1]), dv = static_cast<int>(got.shape[2]);
  Comparison c;
  if (check) {
    c = compare(got, expected, tolerance_, sample);
    const int64_t T = got.shape[0];
    stats.checked_rows += (sample.tokens.empty() ? T : static_cast<int64_t>(sample.tokens.size())) *
                          (sample.heads.empty() ? Hq : static_cast<int64_t>(sample.heads.size()));
    stats.checkable_rows += T * Hq;
    stats.max_abs_err = std::max(stats.max_abs_err, c.max_abs);
    stats.max_rel_err = std::max(stats.max_rel_err, c.max_rel);
  } else {
    c.bad = 1;
    c.token = unwritten / (Hq * dv);
    c.head = static_cast<int>(unwritten / dv % Hq);
    c.column = static_cast<int>(unwritten % dv);
    c.got = c.expected = std::numeric_limits<double>::quiet_NaN();
    c.max_abs = std::numeric_limits<double>::infinity();
    stats.max_abs_err = stats.max_rel_err = std::numeric_limits<double>::infinity();
  }
  if (c.bad == 0) return;
  log_->record(
      site, c,
      check ? fmt::format("{}: {} of {} outputs beyond tolerance; worst at token {}, head {}, "
                          "column {}: got {:.6g}, reference {:.6g} (|error| {}; allowed {:g} + "
                          "{:g}*|reference|)",
                          where_text(site), c.bad, got.numel(), c.token, c.head, c.column,
                          c.got, c.expected, error_text(std::abs(c.got - c.expected)),
                          tolerance_.atol, tolerance_.rtol)
            : fmt::format("{}: output not written by backend '{}' at token {}, head {}, column {} "
                          "(still the NaN poison)",
                          where_text(site), site.backend, c.token, c.head, c.column));
}

void ReferenceChecker::check_linear(const LayerSite& site, const ForwardBatch& batch,
                                    const LinearArgs& args, bool check, const StateRegion& region,
                                    const StateCopy& before, ModeStats& stats) {
  const LayerSpec& layer = *site.layer;
  const int64_t unwritten = first_nan(args.out);
  const std::string where =
      fmt::format("{} ({})", where_text(site), layer_kind_name(layer.kind));
  if (!check) {
    if (unwritten < 0) return;
    Comparison c;
    c.token = unwritten / (args.out.shape[1] * args.out.shape[2]);
    log_->record(site, c,
                 fmt::format("{}: output not written by backend '{}' at token {} (still the NaN "
                             "poison)",
                             where, site.backend, c.token));
    stats.max_abs_err = stats.max_rel_err = std::numeric_limits<double>::infinity();
    return;
  }
  // The reference runs from the state the runtime started from (in the host copy of a GPU pool, or
  // in the same pool, where the runtime's result is put back afterwards).
  LinearStatePool& states = *runtime_states_;
  LinearStatePool& ref_states = *reference_states_;
  const StateCopy after = save_state(states, layer.layer_id, region);
  restore_state(ref_states, layer.layer_id, region, before);
  LinearArgs ref = args;
  ref.out = reference_out(args.out);
  reference_linear_->forward_linear(ref, layer, batch);
  const StateCopy expected = save_state(ref_states, layer.layer_id, region);
  if (&ref_states == &states) restore_state(states, layer.layer_id, region, after);
  const Comparison c = compare(args.out, ref.out, tolerance_);
  stats.max_abs_err = std::max(stats.max_abs_err, c.max_abs);
  stats.max_rel_err = std::max(stats.max_rel_err, c.max_rel);
  if (c.bad > 0) {
    log_->record(site, c,
                 fmt::format("{}: {} of {} outputs beyond tolerance; worst at token {}, head {}, "
                             "column {}: got {:.6g}, reference {:.6g} (allowed {:g} + "
                             "{:g}*|reference|)",
                             where, c.bad, args.out.numel(), c.token, c.head, c.column, c.got,
                             c.expected, tolerance_.atol, tolerance_.rtol));
  }
  compare_states(site, where, region, after, expected);
}

// The state each request (and verify checkpoint) ends with: recurrent state and conv window.
void ReferenceChecker::compare_states(const LayerSite& site, const std::string& where,
                                      const StateRegion& region, const StateCopy& got,
                                      const StateCopy& expected) {
  const LinearLayerState& st = runtime_states_->layer(site.layer->layer_id);
  const LinearStateShape& sh = st.shape;
  auto where_in = [&](int64_t k) {
    const auto n = static_cast<int64_t>(region.slots.size());
    if (k < n) return fmt::format("request {}", k);
    return fmt::format("checkpoint (request {}, block token {})", (k - n) / region.draft_tokens,
                       (k - n) % region.draft_tokens);
  };
  const struct {
    const char* what;
    DType dtype;
    const std::vector<uint8_t>& got;
    const std::vector<uint8_t>& want;
    int64_t d1, d2;
  } parts[] = {
      {"recurrent state", st.ssm_dtype, got.ssm, expected.ssm, sh.heads,
       int64_t{sh.rows} * sh.cols},
      {"conv window", st.conv_dtype, got.conv, expected.conv, sh.conv_width, sh.conv_dim}};
  for (const auto& part : parts) {
    if (part.d1 == 0 || got.count == 0) continue;
    const TensorView g(const_cast<uint8_t*>(part.got.data()), part.dtype,
                       {got.count, part.d1, part.d2});
    const TensorView w(const_cast<uint8_t*>(part.want.data()), part.dtype,
                       {got.count, part.d1, part.d2});
    const Comparison c = compare(g, w, tolerance_);
    if (c.bad > 0) {
      log_->record(site, c,
                   fmt::format("{}: {} of {} {} values beyond tolerance; worst in {}, [{}, {}]: "
                               "got {:.6g}, reference {:.6g}",
                               where, c.bad, g.numel(), part.what, where_in(c.token), c.head,
                               c.column, c.got, c.expected));
    }
  }
}

}  // namespace attnrt::sim
