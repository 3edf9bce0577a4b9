#include "bench/harness/linear_workload.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "attnrt/core/error.h"
#include "attnrt/memory/linear_state_pool.h"
#include "bench/harness/scale.h"
#include "bench/harness/select.h"

namespace attnrt::bench {

namespace {

// Decode rows build their state from this many tokens first (an untimed EXTEND).
constexpr int kDecodePrefix = 16;

// The `kind` layer of model preset `model`: the rows measure the layers the presets serve.
LinearSpec preset_linear_spec(const std::string& model, LayerKind kind) {
  for (const LayerSpec& l : model_preset(model).layers) {
    if (l.kind == kind) return l.linear;
  }
  fail("model preset {} has no {} layer", model, layer_kind_name(kind));
}

LinearWorkload row(LayerKind kind, LinearMode mode, int batch, int tokens) {
  LinearWorkload w;
  w.kind = kind;
  w.mode = mode;
  w.batch = batch;
  w.new_tokens = mode == LinearMode::decode ? 1 : tokens;
  w.prefix_len = mode == LinearMode::decode ? kDecodePrefix : 0;
  switch (kind) {
    case LayerKind::gdn:
      w.model = "qwen3-next-80b";
      break;
    case LayerKind::kda:
      w.model = "kimi-linear-48b";
      break;
    default:
      w.model = "nemotron-h-8b";
      break;
  }
  w.spec = preset_linear_spec(w.model, kind);
  w.name = mode == LinearMode::decode
               ? fmt::format("{}-decode-{}", layer_kind_name(kind), batch)
               : fmt::format("{}-extend-{}x{}", layer_kind_name(kind), batch, tokens);
  return w;
}

// FLOPs of one chunk of c tokens (see linear_counted_flops).
double chunk_flops(const LinearWorkload& w, double c) {
  const LinearSpec& s = w.spec;
  if (w.kind == LayerKind::mamba2) {
    const double p = s.head_v_dim, n = s.d_state;
    return s.num_v_heads * (2 * c * c * p + 4 * c * n * p + 2 * n * p) +
           s.n_groups * (2 * c * c * n);
  }
  const double dk = s.head_k_dim, dv = s.head_v_dim;
  return s.num_k_heads * (4 * c * c * dk) +
         s.num_v_heads * (2 * c * c * dk + 4 * c * c * dv + 6 * c * dk * dv + c * c * c / 3);
}

}  // namespace

std::string_view linear_mode_name(LinearMode m) {
  return m == LinearMode::decode ? "decode" : "extend";
}

std::string LinearWorkload::shape() const {
  if (mode == LinearMode::decode) {
    return fmt::format("{} x 1 (state after {})", batch, prefix_len);
  }
  return prefix_len > 0 ? fmt::format("{} x ({}+{})", batch, prefix_len, new_tokens)
                        : fmt::format("{} x {}", batch, new_tokens);
}

bool LinearWorkload::operator==(const LinearWorkload& o) const {
  auto dims = [](const LinearSpec& s) {
    return std::tie(s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim, s.d_state, s.n_groups,
                    s.conv_kernel, s.chunk_size);
  };
  return std::tie(name, model, kind, mode, batch, prefix_len, new_tokens, act_dtype, state_dtype,
                  scale_note) == std::tie(o.name, o.model, o.kind, o.mode, o.batch, o.prefix_len,
                                          o.new_tokens, o.act_dtype, o.state_dtype, o.scale_note) &&
         dims(spec) == dims(o.spec);
}

LayerSpec LinearWorkload::layer() const {
  LayerSpec l;
  l.layer_id = 0;
  l.kind = kind;
  l.linear = spec;
  return l;
}

LinearWidths linear_widths(const LinearWorkload& w) {
  const LayerSpec l = w.layer();
  const LinearStateShape sh = linear_state_shape(l);
  LinearWidths x;
  x.conv_dim = sh.conv_dim;
  x.heads = sh.heads;
  x.out = sh.heads * sh.rows;
  x.state_elems = sh.ssm_elems();
  x.conv_elems = sh.conv_elems();
  const int K = w.spec.conv_kernel;
  switch (w.kind) {
    case LayerKind::gdn:
      x.a = x.b = sh.heads;
      x.param_elems = int64_t{sh.conv_dim} * K + 2 * sh.heads;  // conv weight, A_log, dt_bias
      break;
    case LayerKind::kda:
      x.a = sh.heads * w.spec.head_k_dim;
      x.b = sh.heads;
      x.param_elems = int64_t{sh.conv_dim} * K + sh.heads + x.a;  // conv weight, A_log, dt_bias
      break;
    default:  // mamba2: conv weight and bias, A_log, dt_bias, D
      x.a = sh.heads;
      x.b = 0;
      x.param_elems = int64_t{sh.conv_dim} * (K + 1) + 3 * sh.heads;
      break;
  }
  return x;
}

double linear_counted_bytes(const LinearWorkload& w) {
  const LinearWidths x = linear_widths(w);
  const double state = dtype_size(w.state_dtype) * double(x.state_elems + x.conv_elems);
  const double per_request = state * (w.prefix_len > 0 ? 2 : 1);  // read (continuing) + write
  const double act = dtype_size(w.act_dtype);
  const double per_token = act * (x.conv_dim + x.a + x.b + x.out);
  return w.batch * per_request + double(w.num_tokens()) * per_token + 4.0 * x.param_elems;
}

double linear_counted_flops(const LinearWorkload& w) {
  const int chunk = std::max(1, w.spec.chunk_size);
  const int full = w.new_tokens / chunk, tail = w.new_tokens % chunk;
  double per_request = full * chunk_flops(w, chunk);
  if (tail > 0) per_request += chunk_flops(w, tail);
  return w.batch * per_request;
}

double linear_flashinfer_flops(const LinearWorkload& w) {
  if (w.kind == LayerKind::mamba2 || w.mode != LinearMode::extend) return 0;
  return 4.0 * double(w.num_tokens()) * w.spec.num_v_heads * w.spec.head_k_dim *
         w.spec.head_v_dim;
}

std::optional<FlashInferFigure> flashinfer_published(const LinearWorkload& w) {
  if (w.kind != LayerKind::gdn || w.mode != LinearMode::extend || w.prefix_len != 0 ||
      w.spec.head_k_dim != 128 || w.spec.head_v_dim != 128)
    return std::nullopt;
  const auto shape = [&](int batch, int64_t tokens, int hk, int hv) {
    return w.batch == batch && w.new_tokens == tokens && w.spec.num_k_heads == hk &&
           w.spec.num_v_heads == hv;
  };
  if (shape(1, 65536, 2, 8)) return FlashInferFigure{0.399, "flashinfer pull request 3866"};
  if (shape(8, 8192, 16, 32)) return FlashInferFigure{0.820, "flashinfer pull request 3788"};
  return std::nullopt;
}

std::vector<LinearWorkload> linear_comparison_workloads() {
  LinearWorkload w = row(LayerKind::gdn, LinearMode::extend, 1, 65536);
  w.spec.num_k_heads = 2;
  w.spec.num_v_heads = 8;
  w.name = "gdn-extend-1x65536-h2v8";
  return {w};
}

std::vector<LinearWorkload> all_linear_workloads() {
  std::vector<LinearWorkload> rows = linear_standard_workloads();
  for (LinearWorkload& w : linear_comparison_workloads()) rows.push_back(std::move(w));
  return rows;
}

std::vector<LinearWorkload> linear_standard_workloads() {
  return {
      row(LayerKind::gdn, LinearMode::decode, 64, 1),
      row(LayerKind::gdn, LinearMode::decode, 256, 1),
      row(LayerKind::mamba2, LinearMode::decode, 64, 1),
      row(LayerKind::mamba2, LinearMode::decode, 256, 1),
      row(LayerKind::gdn, LinearMode::extend, 8, 8192),
      row(LayerKind::kda, LinearMode::extend, 8, 8192),
      row(LayerKind::mamba2, LinearMode::extend, 8, 8192),
      row(LayerKind::mamba2, LinearMode::extend, 1, 8192),
  };
}

namespace {

bool matches(const LinearWorkload& w, std::string_view item) {
  return item == "all" || item == w.name || item == linear_mode_name(w.mode) ||
         item == layer_kind_name(w.kind);
}

constexpr std::string_view kComparisonGroup = "flashinfer-gdn";

// The comparison rows match their name or group only.
bool matches_any(const LinearWorkload& w, std::string_view item) {
  for (const LinearWorkload& c : linear_comparison_workloads()) {
    if (c.name == w.name) return item == w.name || item == kComparisonGroup;
  }
  return matches(w, item);
}

}  // namespace

bool is_linear_selector(std::string_view item) {
  for (const LinearWorkload& w : all_linear_workloads()) {
    if (matches_any(w, item)) return true;
  }
  return false;
}

std::vector<LinearWorkload> select_linear_workloads(std::string_view selector) {
  return select_rows(selector, all_linear_workloads(), matches_any, "linear workload",
                     "all, decode, extend, gdn, kda, mamba2, flashinfer-gdn",
                     "all, a mode, a layer kind, a row name or flashinfer-gdn");
}

LinearWorkload scale_linear_workload(const LinearWorkload& w, double factor) {
  return scale_row(w, factor, [&](LinearWorkload& s, double f) {
    if (w.mode == LinearMode::extend) s.new_tokens = round_length(w.new_tokens * f);
  });
}

std::vector<LinearWorkload> apply_linear_preset(const std::vector<LinearWorkload>& rows,
                                                std::string_view preset) {
  if (preset != "cpu-small") {
    fail("unknown --preset '{}': the presets are {}", preset, fmt::join(preset_names(), ", "));
  }
  constexpr double kMaxBytes = 1.25 * double(1ull << 30);
  constexpr double kMaxFlops = 5e10;
  std::vector<LinearWorkload> out;
  for (const LinearWorkload& w : rows) {
    auto fits = [](const LinearWorkload& x) {
      return linear_counted_bytes(x) <= kMaxBytes && linear_counted_flops(x) <= kMaxFlops;
    };
    LinearWorkload s = w;
    while (!fits(s) && s.batch > 1) s.batch = (s.batch + 1) / 2;
    while (!fits(s) && s.new_tokens > kLengthQuantum) s.new_tokens = halve_length(s.new_tokens);
    if (!(s == w)) s.scale_note = fmt::format("shrunk by --preset cpu-small from {}", w.shape());
    out.push_back(s);
  }
  return out;
}

}  // namespace attnrt::bench
