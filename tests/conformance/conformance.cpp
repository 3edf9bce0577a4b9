#include "tests/conformance/conformance.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <tuple>
#include <utility>

#include "attnrt/core/error.h"

namespace attnrt::conformance {

namespace {

constexpr std::array<std::pair<Feature, std::string_view>, 26> kFeatureNames{{
    {Feature::decode, "decode"},
    {Feature::extend_prefix, "extend_prefix"},
    {Feature::mixed, "mixed"},
    {Feature::verify_chain, "verify_chain"},
    {Feature::verify_tree, "verify_tree"},
    {Feature::draft_extend, "draft_extend"},
    {Feature::swa, "swa"},
    {Feature::softcap, "softcap"},
    {Feature::sinks, "sinks"},
    {Feature::non_causal, "non_causal"},
    {Feature::gqa, "gqa"},
    {Feature::mqa, "mqa"},
    {Feature::page1, "page1"},
    {Feature::page16, "page16"},
    {Feature::page64, "page64"},
    {Feature::fp8_e4m3, "fp8_e4m3"},
    {Feature::fp8_e5m2, "fp8_e5m2"},
    {Feature::fp16, "fp16"},
    {Feature::bf16, "bf16"},
    {Feature::mla, "mla"},
    {Feature::head_dim_other, "head_dim_other"},
    {Feature::v_head_dim_differs, "v_head_dim_differs"},
    {Feature::dsa, "dsa"},
    {Feature::gdn, "gdn"},
    {Feature::mamba2, "mamba2"},
    {Feature::kda, "kda"},
}};

std::optional<LayerKind> linear_kind(Feature f) {
  switch (f) {
    case Feature::gdn:
      return LayerKind::gdn;
    case Feature::mamba2:
      return LayerKind::mamba2;
    case Feature::kda:
      return LayerKind::kda;
    default:
      return std::nullopt;
  }
}

constexpr std::array<Feature, kFeatureNames.size()> kFeatures = [] {
  std::array<Feature, kFeatureNames.size()> a{};
  for (size_t i = 0; i < a.size(); ++i) a[i] = kFeatureNames[i].first;
  return a;
}();

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool contains(const auto& v, const auto& x) { return std::find(v.begin(), v.end(), x) != v.end(); }

float round_to(DType t, float x) {
  alignas(4) unsigned char buf[4];
  store_from_float(buf, t, 0, x);
  return load_as_float(buf, t, 0);
}

int pick(std::mt19937_64& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

bool chance(std::mt19937_64& rng, double p) { return std::bernoulli_distribution(p)(rng); }

template <typename T>
T pick_of(std::mt19937_64& rng, const std::vector<T>& v) {
  return v[static_cast<size_t>(pick(rng, 0, static_cast<int>(v.size()) - 1))];
}

// The KV/activation dtype of cases that do not test a dtype: the most exact one the backend takes.
DType base_dtype(const BackendCaps& caps) {
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    if (contains(caps.kv_dtypes, t)) return t;
  }
  return DType::f32;
}

std::vector<int> usable_page_sizes(const BackendCaps& caps) {
  if (caps.page_sizes.empty()) return {1, 16, 64};
  std::vector<int> out;
  for (int p : {1, 16, 64}) {
    if (contains(caps.page_sizes, p)) out.push_back(p);
  }
  return out.empty() ? caps.page_sizes : out;
}

// (head_dim, v_head_dim) of the cases of the dims features, filtered by the head dims the caps
// list (empty = any). MLA: (kv_lora_rank + qk_rope_head_dim, kv_lora_rank), DeepSeek's first.
std::vector<std::pair<int, int>> usable_dims(const BackendCaps& caps, Feature f) {
  std::vector<std::pair<int, int>> all;
  switch (f) {
    case Feature::mla: all = {{576, 512}, {192, 128}}; break;
    case Feature::head_dim_other: all = {{80, 80}, {96, 96}, {160, 160}, {192, 192}}; break;
    case Feature::v_head_dim_differs: all = {{192, 128}, {128, 64}, {64, 128}, {96, 160}}; break;
    default: break;
  }
  if (caps.head_dims.empty()) return all;
  std::vector<std::pair<int, int>> out;
  for (const auto& d : all) {
    if (contains(caps.head_dims, d.first) && contains(caps.head_dims, d.second)) out.push_back(d);
  }
  return out;
}

HostBuffer to_buffer(DType t, const std::vector<float>& values, int64_t rows, int64_t heads,
                     int64_t dim) {
  HostBuffer b(t, {rows, heads, dim});
  for (size_t i = 0; i < values.size(); ++i) store_from_float(b.data(), t, i, values[i]);
  return b;
}

void poison(const HostBuffer& b) {
  for (int64_t i = 0; i < b.numel(); ++i) {
    store_from_float(b.data(), b.dtype(), static_cast<size_t>(i),
                     std::numeric_limits<float>::quiet_NaN());
  }
}

// Parents of a random draft tree of n nodes, at most `topk` children per node, parents first.
std::vector<int32_t> random_tree(std::mt19937_64& rng, int n, int topk) {
  std::vector<int32_t> parents(n, -1), children(n, 0);
  for (int t = 1; t < n; ++t) {
    int p;
    do p = pick(rng, 0, t - 1);
    while (children[p] >= topk);
    parents[t] = p;
    ++children[p];
  }
  return parents;
}

}  // namespace

std::span<const Feature> all_features() { return kFeatures; }

std::string_view feature_name(Feature f) {
  for (const auto& [feature, name] : kFeatureNames) {
    if (feature == f) return name;
  }
  return "?";
}

Feature parse_feature(std::string_view name) {
  for (const auto& [feature, feature_str] : kFeatureNames) {
    if (feature_str == name) return feature;
  }
  std::vector<std::string_view> names;
  for (const auto& entry : kFeatureNames) names.push_back(entry.second);
  fail("unknown conformance feature '{}': use one of {}", name, fmt::join(names, ", "));
}

std::string unsupported_reason(const BackendCaps& caps, Feature f) {
  if (const std::optional<LayerKind> kind = linear_kind(f)) {
    if (!contains(caps.linear_kinds, *kind)) {
      return fmt::format("caps do not claim {} layers (linear_kinds)", layer_kind_name(*kind));
    }
    // The linear cases hand the backend host state pools and host inputs.
    return contains(caps.devices, DeviceKind::cpu)
               ? ""
               : "linear-layer cases run on host memory only; the GPU linear backends have "
                 "tests of their own (tests/test_cuda_linear*.cpp)";
  }
  if (!caps.full_attention) return "the backend does not serve full-attention layers";
  if (!contains(caps.kv_dtypes, DType::f32) && !contains(caps.kv_dtypes, DType::bf16) &&
      !contains(caps.kv_dtypes, DType::f16)) {
    return "the backend claims none of the fp32, bf16, fp16 KV dtypes the cases are built on";
  }
  auto needs = [](bool claimed, std::string_view cap) {
    return claimed ? std::string() : fmt::format("caps do not claim {}", cap);
  };
  auto page = [&](int p) {
    return caps.page_sizes.empty() || contains(caps.page_sizes, p)
               ? std::string()
               : fmt::format("page size {} is not among the native page sizes [{}]", p,
                             fmt::join(caps.page_sizes, ", "));
  };
  auto kv = [&](DType t) {
    return needs(contains(caps.kv_dtypes, t), fmt::format("KV dtype {}", dtype_name(t)));
  };
  switch (f) {
    case Feature::decode:
    case Feature::extend_prefix:
    case Feature::mixed:
    case Feature::gqa:
    case Feature::mqa:
    case Feature::gdn:  // answered above
    case Feature::mamba2:
    case Feature::kda:
      return "";
    case Feature::verify_chain:
    case Feature::draft_extend:
      return needs(caps.spec_topk1, "spec_topk1");
    case Feature::verify_tree:
      return needs(caps.spec_topk_gt1, "spec_topk_gt1");
    case Feature::swa:
      return needs(caps.sliding_window, "sliding_window");
    case Feature::softcap:
      return needs(caps.softcap, "softcap");
    case Feature::sinks:
      return needs(caps.sinks, "sinks");
    case Feature::non_causal:
      return needs(caps.non_causal, "non_causal");
    case Feature::page1:
      return page(1);
    case Feature::page16:
      return page(16);
    case Feature::page64:
      return page(64);
    case Feature::fp8_e4m3:
      return kv(DType::e4m3);
    case Feature::fp8_e5m2:
      return kv(DType::e5m2);
    case Feature::fp16:
      return kv(DType::f16);
    case Feature::bf16:
      return kv(DType::bf16);
    case Feature::dsa:
      if (!caps.dsa) return "caps do not claim dsa";
      [[fallthrough]];
    case Feature::mla:
      if (!caps.mla) return "caps do not claim mla";
      [[fallthrough]];
    case Feature::head_dim_other:
    case Feature::v_head_dim_differs:
      return usable_dims(caps, f == Feature::dsa ? Feature::mla : f).empty()
                 ? fmt::format(
                       "head dims [{}] hold none of the feature's (head_dim, v_head_dim) "
                       "pairs",
                       fmt::join(caps.head_dims, ", "))
                 : "";
  }
  return "unknown feature";
}

std::string CaseSpec::describe() const {
  std::string layer_text;
  for (const LayerSpec& l : layers) {
    layer_text += fmt::format(
        "{}[L{} {} Hq={} Hkv={} D={}/{} scale={} cap={} W={} sinks={} {}]",
        layer_text.empty() ? "" : " ", l.layer_id, layer_kind_name(l.kind), l.num_q_heads,
        l.num_kv_heads, l.head_dim, l.v_head_dim, l.scaling, l.logit_cap, l.sliding_window,
        l.has_sinks ? 1 : 0, l.causal() ? "causal" : "non-causal");
  }
  std::string reqs;
  for (size_t i = 0; i < prefix_lens.size(); ++i) {
    reqs += fmt::format("{}({}+{})", i ? " " : "", prefix_lens[i],
                        i < query_lens.size() ? query_lens[i] : -1);
  }
  std::string tree;
  if (mode == ForwardMode::TARGET_VERIFY) {
    tree = fmt::format(" topk={} parents=[{}]", spec.topk, fmt::join(spec.parents, ","));
  }
  return fmt::format(
      "{} seed={:#x} mode={} page={} kv={} act={} k_scale={} v_scale={} q_amp={} threads={} "
      "requests(prefix+query)=[{}]{} layers: {}",
      label, seed, forward_mode_name(mode), page_size, dtype_name(kv_dtype), dtype_name(act_dtype),
      k_scale, v_scale, q_amplitude, threads, reqs, tree, layer_text);
}

ConformanceCase make_case(CaseSpec spec) {
  const size_t bs = spec.prefix_lens.size();
  ATTNRT_CHECK(spec.query_lens.size() == bs,
               "conformance case: {} prefix lengths but {} query lengths; give one of each per "
               "request",
               bs, spec.query_lens.size());
  ATTNRT_CHECK(spec.page_size >= 1, "conformance case: page_size = {}; must be >= 1",
               spec.page_size);
  ATTNRT_CHECK(is_float(spec.kv_dtype) && !is_fp8(spec.act_dtype) && is_float(spec.act_dtype),
               "conformance case: kv dtype {} / activation dtype {}; KV takes any float dtype, "
               "activations fp32, fp16 or bf16",
               dtype_name(spec.kv_dtype), dtype_name(spec.act_dtype));
  for (size_t i = 0; i < bs; ++i) {
    ATTNRT_CHECK(spec.prefix_lens[i] >= 0 && spec.query_lens[i] >= 1,
                 "conformance case: request {} has prefix {} and {} query tokens; need prefix >= 0 "
                 "and >= 1 query token",
                 i, spec.prefix_lens[i], spec.query_lens[i]);
  }
  ConformanceCase c;
  c.model.name = "conformance-" + spec.label;
  c.model.dtype = spec.act_dtype;
  int32_t max_len = 1;
  for (size_t i = 0; i < bs; ++i) max_len = std::max(max_len, spec.prefix_lens[i] + spec.query_lens[i]);
  c.model.max_context_len = max_len;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    spec.layers[i].layer_id = static_cast<int>(i);
    if (spec.layers[i].v_head_dim == 0) spec.layers[i].v_head_dim = spec.layers[i].head_dim;
  }
  c.model.layers = spec.layers;
  c.model.validate();

  const int64_t prefix_tokens = std::accumulate(spec.prefix_lens.begin(), spec.prefix_lens.end(),
                                                int64_t{0});
  const int64_t step_tokens = std::accumulate(spec.query_lens.begin(), spec.query_lens.end(),
                                              int64_t{0});
  std::mt19937_64 rng(spec.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto draw = [&](int64_t n, float amplitude) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = round_to(spec.act_dtype, amplitude * normal(rng));
    return v;
  };
  for (const LayerSpec& l : spec.layers) {
    ATTNRT_CHECK(l.kind != LayerKind::mla || spec.k_scale == spec.v_scale,
                 "conformance case: k_scale {} and v_scale {} with mla layer {}; an mla layer's V "
                 "is a view of its K row, so it has one scale (set v_scale = k_scale)",
                 spec.k_scale, spec.v_scale, l.layer_id);
    LayerValues lv;
    lv.prefix_k = draw(prefix_tokens * l.num_kv_heads * l.head_dim, 1.f);
    lv.prefix_v = draw(prefix_tokens * l.num_kv_heads * l.v_head_dim, 1.f);
    lv.q = draw(step_tokens * l.num_q_heads * l.head_dim, spec.q_amplitude);
    lv.k = draw(step_tokens * l.num_kv_heads * l.head_dim, 1.f);
    lv.v = draw(step_tokens * l.num_kv_heads * l.v_head_dim, 1.f);
    if (l.kind == LayerKind::mla) {
      // The latent row is K, and its first kv_lora_rank columns are V (one kv head).
      auto latent_v = [&](const std::vector<float>& k, std::vector<float>& v) {
        for (size_t t = 0; t * l.v_head_dim < v.size(); ++t) {
          std::copy_n(k.begin() + static_cast<int64_t>(t * l.head_dim), l.v_head_dim,
                      v.begin() + static_cast<int64_t>(t * l.v_head_dim));
        }
      };
      latent_v(lv.prefix_k, lv.prefix_v);
      latent_v(lv.k, lv.v);
    }
    if (l.has_sinks) {
      lv.sinks.resize(l.num_q_heads);
      for (float& s : lv.sinks) s = 1.5f * normal(rng);
    }
    if (l.has_indexer()) {
      const int64_t hi = l.indexer.index_n_heads, di = l.indexer.index_head_dim;
      lv.index_q = draw(step_tokens * hi * di, 1.f);
      lv.index_k = draw(step_tokens * di, 1.f);
      lv.index_w = draw(step_tokens * hi, 1.f);
      lv.prefix_index_k = draw(prefix_tokens * di, 1.f);
    }
    c.values.push_back(std::move(lv));
  }
  c.spec = std::move(spec);
  return c;
}

namespace {

// Every feature an attention case exercises, from what it ended up with.
std::vector<Feature> features_of(const CaseSpec& s) {
  std::vector<Feature> out;
  switch (s.mode) {
    case ForwardMode::DECODE:
      out.push_back(Feature::decode);
      break;
    case ForwardMode::EXTEND:
      out.push_back(Feature::extend_prefix);
      break;
    case ForwardMode::MIXED:
      out.push_back(Feature::mixed);
      break;
    case ForwardMode::TARGET_VERIFY:
      out.push_back(s.spec.topk > 1 ? Feature::verify_tree : Feature::verify_chain);
      break;
    case ForwardMode::DRAFT_EXTEND:
    case ForwardMode::DRAFT_EXTEND_V2:
      out.push_back(Feature::draft_extend);
      break;
    case ForwardMode::IDLE:
      break;
  }
  if (s.page_size == 1) out.push_back(Feature::page1);
  if (s.page_size == 16) out.push_back(Feature::page16);
  if (s.page_size == 64) out.push_back(Feature::page64);
  switch (s.kv_dtype) {
    case DType::e4m3:
      out.push_back(Feature::fp8_e4m3);
      break;
    case DType::e5m2:
      out.push_back(Feature::fp8_e5m2);
      break;
    case DType::f16:
      out.push_back(Feature::fp16);
      break;
    case DType::bf16:
      out.push_back(Feature::bf16);
      break;
    default:
      break;
  }
  const LayerSpec& l = s.layers.back();
  auto add = [&](bool on, Feature f) {
    if (on && !contains(out, f)) out.push_back(f);
  };
  for (const LayerSpec& x : s.layers) add(x.kind == LayerKind::swa, Feature::swa);
  add(l.logit_cap > 0.f, Feature::softcap);
  add(l.has_sinks, Feature::sinks);
  add(!l.causal(), Feature::non_causal);
  const int group = l.num_q_heads / l.num_kv_heads;
  add(l.kind != LayerKind::mla && group > 1 && l.num_kv_heads > 1, Feature::gqa);
  add(l.kind != LayerKind::mla && group > 1 && l.num_kv_heads == 1, Feature::mqa);
  add(l.kind == LayerKind::mla, Feature::mla);
  add(l.has_indexer(), Feature::dsa);
  if (l.kind != LayerKind::mla) {
    add(l.head_dim == l.v_head_dim && l.head_dim != 64 && l.head_dim != 128 && l.head_dim != 256,
        Feature::head_dim_other);
    add(l.head_dim != l.v_head_dim, Feature::v_head_dim_differs);
  }
  return out;
}

}  // namespace

ConformanceCase draw_case(uint64_t seed, const BackendCaps& caps, std::optional<Feature> focus) {
  std::mt19937_64 rng(splitmix64(seed));
  auto claims = [&](Feature f) { return unsupported_reason(caps, f).empty(); };
  if (focus) {
    const std::string why = unsupported_reason(caps, *focus);
    ATTNRT_CHECK(why.empty(), "conformance: feature {} is not claimed by these caps: {}",
                 feature_name(*focus), why);
  }
  // Linear layers: a case of their own, about one case in six when the backend serves both.
  std::vector<Feature> linear;
  for (Feature f : {Feature::gdn, Feature::mamba2, Feature::kda}) {
    if (claims(f)) linear.push_back(f);
  }
  const bool attention = claims(Feature::decode);
  const bool draw_linear = focus ? linear_kind(*focus).has_value()
                                 : !linear.empty() && (!attention || chance(rng, 1.0 / 6));
  if (draw_linear) {
    const Feature f = focus ? *focus : pick_of(rng, linear);
    ConformanceCase c;
    c.linear = random_linear_case(rng, *linear_kind(f));
    c.features = {f};
    return c;
  }
  ATTNRT_CHECK(attention, "conformance: the caps claim no attention layers and no linear kinds");
  auto focused = [&](Feature f) { return focus && *focus == f; };
  // Any other feature is switched on with probability p when the caps claim it.
  auto maybe = [&](Feature f, double p) { return focused(f) || (claims(f) && chance(rng, p)); };

  CaseSpec s;
  s.label = focus ? std::string(feature_name(*focus)) : "random";
  s.seed = splitmix64(seed ^ 0x5eedull);

  // KV and activation dtypes: the most exact one the backend takes, or one of the dtype features.
  const DType base = base_dtype(caps);
  s.kv_dtype = s.act_dtype = base;
  const std::vector<std::pair<Feature, DType>> dtypes = {{Feature::fp8_e4m3, DType::e4m3},
                                                         {Feature::fp8_e5m2, DType::e5m2},
                                                         {Feature::fp16, DType::f16},
                                                         {Feature::bf16, DType::bf16}};
  std::optional<Feature> dtype_feature;
  for (const auto& [f, t] : dtypes) {
    if (focused(f)) dtype_feature = f;
  }
  if (!dtype_feature && chance(rng, 0.6)) {
    std::vector<Feature> claimed;
    for (const auto& [f, t] : dtypes) {
      if (claims(f) && t != base) claimed.push_back(f);
    }
    if (!claimed.empty()) dtype_feature = pick_of(rng, claimed);
  }
  if (dtype_feature) {
    for (const auto& [f, t] : dtypes) {
      if (f != *dtype_feature) continue;
      s.kv_dtype = t;
      if (!is_fp8(t)) s.act_dtype = t;
    }
    if (is_fp8(s.kv_dtype)) {
      s.k_scale = std::exp2(std::uniform_real_distribution<float>(-2.f, 2.f)(rng));
      s.v_scale = std::exp2(std::uniform_real_distribution<float>(-2.f, 2.f)(rng));
    }
  }
  if (focused(Feature::page1)) {
    s.page_size = 1;
  } else if (focused(Feature::page16)) {
    s.page_size = 16;
  } else if (focused(Feature::page64)) {
    s.page_size = 64;
  } else {
    s.page_size = pick_of(rng, usable_page_sizes(caps));
  }

  // Layer kind: MLA (with an indexer: DSA) about one case in eight, else MHA / GQA / MQA with a
  // random mix of window, soft-cap, sinks and non-causal attention.
  const bool mha_focus =
      focus &&
      contains(std::vector<Feature>{Feature::non_causal, Feature::softcap, Feature::sinks,
                                    Feature::swa, Feature::head_dim_other,
                                    Feature::v_head_dim_differs, Feature::gqa, Feature::mqa},
               *focus);
  const bool dsa = !mha_focus && maybe(Feature::dsa, 0.04);
  const bool mla = dsa || (!mha_focus && maybe(Feature::mla, 0.08));

  // Modes: the feature's own, or any mode the backend serves.
  std::vector<ForwardMode> modes = {ForwardMode::EXTEND, ForwardMode::DECODE, ForwardMode::MIXED};
  if (caps.spec_topk1 || caps.spec_topk_gt1) modes.push_back(ForwardMode::TARGET_VERIFY);
  if (caps.spec_topk1) modes.push_back(ForwardMode::DRAFT_EXTEND);
  bool tree = caps.spec_topk_gt1 && (!caps.spec_topk1 || chance(rng, 0.5));
  const bool non_causal = !mla && maybe(Feature::non_causal, 0.08);
  if (focused(Feature::decode)) {
    s.mode = ForwardMode::DECODE;
  } else if (focused(Feature::extend_prefix)) {
    s.mode = ForwardMode::EXTEND;
  } else if (focused(Feature::mixed)) {
    s.mode = ForwardMode::MIXED;
  } else if (focused(Feature::verify_chain)) {
    s.mode = ForwardMode::TARGET_VERIFY;
    tree = false;
  } else if (focused(Feature::verify_tree)) {
    s.mode = ForwardMode::TARGET_VERIFY;
    tree = true;
  } else if (focused(Feature::draft_extend)) {
    s.mode = chance(rng, 0.7) ? ForwardMode::DRAFT_EXTEND : ForwardMode::DRAFT_EXTEND_V2;
  } else if (non_causal) {
    s.mode = chance(rng, 0.5) ? ForwardMode::EXTEND : ForwardMode::MIXED;
  } else {
    s.mode = pick_of(rng, modes);
    if (s.mode == ForwardMode::DRAFT_EXTEND && chance(rng, 0.3)) {
      s.mode = ForwardMode::DRAFT_EXTEND_V2;
    }
  }

  // Lengths: ragged, some prefixes ending exactly on a page boundary, some length-1 requests; one
  // case in fifty is several times longer (and splits its keys over two threads).
  const int big = chance(rng, 0.02) ? 6 : 1;
  s.threads = big > 1 || chance(rng, 0.1) ? 2 : 1;
  const int bs = pick(rng, 1, 5);
  auto prefix_len = [&](int lo, int hi) {
    int p = pick(rng, lo, hi * big);
    if (s.page_size > 1 && chance(rng, 0.3)) p = std::max(lo, p / s.page_size * s.page_size);
    return p;
  };
  int n = 0;
  if (s.mode == ForwardMode::TARGET_VERIFY) {
    n = tree ? pick(rng, 3, 10) : pick(rng, 2, 6);
    s.spec.draft_token_num = n;
    s.spec.topk = tree ? pick(rng, 2, 4) : 1;
  } else if (is_draft_extend(s.mode, true)) {
    n = pick(rng, 2, 5);
  }
  for (int i = 0; i < bs; ++i) {
    int32_t p = 0, q = 1;
    switch (s.mode) {
      case ForwardMode::EXTEND:
        p = chance(rng, 0.3) ? 0 : prefix_len(1, 90);
        q = chance(rng, 0.2) ? 1 : pick(rng, 1, 24 * big);
        break;
      case ForwardMode::MIXED:
        if (chance(rng, 0.5)) {
          p = prefix_len(1, 100);
        } else {
          p = chance(rng, 0.4) ? 0 : prefix_len(1, 60);
          q = pick(rng, 1, 20 * big);
        }
        break;
      case ForwardMode::DECODE:
        p = chance(rng, 0.1) ? 0 : prefix_len(1, 120);
        break;
      case ForwardMode::TARGET_VERIFY:
        p = prefix_len(1, 90);
        q = n;
        break;
      case ForwardMode::DRAFT_EXTEND:
        p = prefix_len(1, 90);
        q = pick(rng, 1, n);
        break;
      case ForwardMode::DRAFT_EXTEND_V2:
        p = prefix_len(1, 90);
        q = n;
        break;
      case ForwardMode::IDLE:
        break;
    }
    s.prefix_lens.push_back(p);
    s.query_lens.push_back(q);
  }
  if (s.mode == ForwardMode::TARGET_VERIFY) {
    for (int i = 0; i < bs; ++i) {
      std::vector<int32_t> p(n);
      if (tree) {
        p = random_tree(rng, n, s.spec.topk);
      } else {
        std::iota(p.begin(), p.end(), -1);
      }
      s.spec.parents.insert(s.spec.parents.end(), p.begin(), p.end());
    }
  }

  // Heads and dims.
  int hkv = pick_of(rng, std::vector<int>{1, 2, 4});
  int group = pick(rng, 1, 2);
  if (focused(Feature::gqa) || (!focused(Feature::mqa) && chance(rng, 0.3))) {
    hkv = pick(rng, 2, 3);
    group = pick_of(rng, std::vector<int>{4, 8});
  } else if (focused(Feature::mqa) || chance(rng, 0.15)) {
    hkv = 1;
    group = pick_of(rng, std::vector<int>{4, 8});
  }
  // A backend that takes any head dim is drawn at the production dims here (its fast kernels),
  // mostly the small ones; the dims features cover the others.
  const int head_dim = caps.head_dims.empty()
                           ? pick_of(rng, std::vector<int>{64, 64, 64, 128, 128, 256})
                           : pick_of(rng, caps.head_dims);
  LayerSpec layer;
  layer.num_q_heads = hkv * group;
  layer.num_kv_heads = hkv;
  layer.head_dim = layer.v_head_dim = head_dim;
  std::optional<Feature> dims_feature;
  if (mla) {
    dims_feature = Feature::mla;
  } else if (maybe(Feature::head_dim_other, 0.1)) {
    dims_feature = Feature::head_dim_other;
  } else if (maybe(Feature::v_head_dim_differs, 0.1)) {
    dims_feature = Feature::v_head_dim_differs;
  }
  if (dims_feature) {
    std::tie(layer.head_dim, layer.v_head_dim) = pick_of(rng, usable_dims(caps, *dims_feature));
  }
  if (mla) {
    layer.kind = LayerKind::mla;
    layer.num_kv_heads = 1;
    // DeepSeek's 128 q heads in one MLA case in ten (they cost the float64 reference most).
    layer.num_q_heads = chance(rng, 0.1) ? 128 : pick_of(rng, std::vector<int>{1, 4, 8, 16});
    layer.kv_lora_rank = layer.v_head_dim;
    layer.qk_rope_head_dim = layer.head_dim - layer.v_head_dim;
    // KV dtype: any the backend takes, fp8 with one scale (V reads K's stored row).
    if (!dtype_feature) {
      std::vector<DType> kv_dtypes;
      for (DType t : {base, DType::e4m3, DType::e5m2}) {
        if (contains(caps.kv_dtypes, t)) kv_dtypes.push_back(t);
      }
      s.kv_dtype = pick_of(rng, kv_dtypes);
    }
    if (is_fp8(s.kv_dtype)) {
      s.k_scale = s.v_scale = std::exp2(std::uniform_real_distribution<float>(-2.f, 2.f)(rng));
    }
    if (dsa) {
      layer.indexer.index_topk = pick(rng, 1, 64);
      layer.indexer.index_n_heads = pick_of(rng, std::vector<int>{1, 4, 8});
      layer.indexer.index_head_dim = pick_of(rng, std::vector<int>{16, 32, 64});
    }
  }
  if (chance(rng, 0.5)) layer.scaling = std::uniform_real_distribution<float>(0.05f, 0.3f)(rng);
  if (!mla && maybe(Feature::softcap, 0.15)) {
    layer.logit_cap = std::uniform_real_distribution<float>(2.f, 15.f)(rng);
    s.q_amplitude = 3.f;
  }
  layer.has_sinks = !mla && maybe(Feature::sinks, 0.15);
  if (non_causal) layer.attn_type = AttnType::decoder_bidirectional;
  // Two layers, so that per-layer pool addressing is exercised; a window makes the first a
  // windowed layer, which puts it in the SWA pool of a hybrid cache.
  s.layers = {layer, layer};
  if (!mla && !non_causal && maybe(Feature::swa, 0.2)) {
    s.layers[0].kind = LayerKind::swa;
    s.layers[0].sliding_window = pick(rng, 0, 24 * big);
  }
  ConformanceCase c = make_case(std::move(s));
  c.features = features_of(c.spec);
  return c;
}

ConformanceCase generate_case(Feature feature, uint64_t seed, const BackendCaps& caps) {
  return draw_case(seed, caps, feature);
}

BackendContext CaseInstance::context(Device device) const {
  BackendContext ctx;
  ctx.model = &model;
  ctx.options = &options;
  ctx.kv_cache = storage.cache.get();
  ctx.req_to_token = req_to_token.get();
  ctx.device = device;
  return ctx;
}

std::unique_ptr<CaseInstance> materialize(const ConformanceCase& c) {
  const CaseSpec& s = c.spec;
  const int bs = static_cast<int>(s.prefix_lens.size());
  const int p = s.page_size;
  auto inst = std::make_unique<CaseInstance>();
  inst->model = c.model;
  inst->options.page_size = p;
  inst->options.num_threads = s.threads;
  inst->options.kv_cache_dtype = std::string(dtype_name(s.kv_dtype));

  int64_t pages = 2 * s.scatter_pages + 2, prefix_tokens = 0, step_tokens = 0;
  int32_t max_len = 1;
  for (int i = 0; i < bs; ++i) {
    const int32_t len = s.prefix_lens[i] + s.query_lens[i];
    pages += (len + p - 1) / p + 1;
    prefix_tokens += s.prefix_lens[i];
    step_tokens += s.query_lens[i];
    max_len = std::max(max_len, len);
  }
  KVCacheConfig cfg;
  cfg.full_slots = pages * p;
  cfg.swa_slots = pages * p;
  cfg.page_size = p;
  cfg.dtype = s.kv_dtype;
  cfg.max_num_tokens = static_cast<int>(std::max(prefix_tokens, step_tokens) + 1);
  inst->storage = make_host_kv_storage(inst->model, cfg);
  KVCache& cache = *inst->storage.cache;
  TokenAllocator& alloc = *inst->storage.allocator;
  if (s.k_scale != 1.f || s.v_scale != 1.f) {
    for (const LayerSpec& l : inst->model.layers) cache.set_kv_scales(l.layer_id, s.k_scale, s.v_scale);
  }

  // Rows in a non-trivial order: one spare row is taken first and released at the end.
  inst->req_to_token = std::make_unique<ReqToTokenPool>(bs + 2, max_len);
  const int spare = inst->req_to_token->alloc();
  std::vector<int64_t> rows(bs);
  for (int i = 0; i < bs; ++i) rows[bs - 1 - i] = inst->req_to_token->alloc();
  inst->req_to_token->free(spare);

  // Take single pages and give back a random half, so requests get scattered pages.
  std::mt19937_64 rng(splitmix64(s.seed ^ 0xa110cull));
  const int32_t zero = 0, one_page = p;
  const int64_t none = -1;
  for (int k = 0; k < 2 * s.scatter_pages; ++k) {
    auto slots = alloc.alloc_extend({&zero, 1}, {&one_page, 1}, {&none, 1});
    if (chance(rng, 0.5)) alloc.free(slots);
  }

  inst->token_slots.resize(bs);
  std::vector<int64_t> prefix_rows;
  std::vector<int32_t> prefix_idx, prefix_lens, zeros;
  for (int i = 0; i < bs; ++i) {
    if (s.prefix_lens[i] == 0) continue;
    prefix_rows.push_back(rows[i]);
    prefix_idx.push_back(i);
    prefix_lens.push_back(s.prefix_lens[i]);
    zeros.push_back(0);
  }
  if (!prefix_rows.empty()) {
    std::vector<int64_t> no_last(prefix_rows.size(), -1);
    std::vector<int64_t> slots = alloc.alloc_extend(zeros, prefix_lens, no_last);
    size_t off = 0;
    for (size_t r = 0; r < prefix_rows.size(); ++r) {
      std::span<const int64_t> mine(slots.data() + off, static_cast<size_t>(prefix_lens[r]));
      inst->req_to_token->write(static_cast<int>(prefix_rows[r]), 0, mine);
      inst->token_slots[prefix_idx[r]].assign(mine.begin(), mine.end());
      off += prefix_lens[r];
    }
    // The prefix KV goes in through the pool like an earlier step's.
    ForwardBatch pre = make_extend_batch(prefix_rows, zeros, prefix_lens);
    pre.out_cache_loc = slots;
    cache.begin_step(pre);
    for (size_t li = 0; li < inst->model.layers.size(); ++li) {
      const LayerSpec& l = inst->model.layers[li];
      HostBuffer k = to_buffer(s.act_dtype, c.values[li].prefix_k, prefix_tokens, l.num_kv_heads,
                               l.head_dim);
      HostBuffer v = to_buffer(s.act_dtype, c.values[li].prefix_v, prefix_tokens, l.num_kv_heads,
                               l.v_head_dim);
      cache.store_step_kv(l.layer_id, k.view(), v.view());
      if (l.has_indexer()) {
        HostBuffer ik = to_buffer(s.act_dtype, c.values[li].prefix_index_k, prefix_tokens, 1,
                                  l.indexer.index_head_dim);
        cache.store_step_index_k(l.layer_id, TensorView(ik.data(), s.act_dtype,
                                                        {prefix_tokens, l.indexer.index_head_dim}));
      }
    }
  }

  std::vector<int32_t> seq_lens(bs);
  std::vector<int64_t> last_locs(bs);
  for (int i = 0; i < bs; ++i) {
    seq_lens[i] = s.prefix_lens[i] + s.query_lens[i];
    last_locs[i] = s.prefix_lens[i] > 0 ? inst->token_slots[i].back() : -1;
  }
  std::vector<int64_t> new_slots = s.mode == ForwardMode::DECODE
                                       ? alloc.alloc_decode(seq_lens, last_locs)
                                       : alloc.alloc_extend(s.prefix_lens, seq_lens, last_locs);
  size_t off = 0;
  for (int i = 0; i < bs; ++i) {
    std::span<const int64_t> mine(new_slots.data() + off, static_cast<size_t>(s.query_lens[i]));
    inst->req_to_token->write(static_cast<int>(rows[i]), s.prefix_lens[i], mine);
    inst->token_slots[i].insert(inst->token_slots[i].end(), mine.begin(), mine.end());
    off += s.query_lens[i];
  }

  switch (s.mode) {
    case ForwardMode::EXTEND:
    case ForwardMode::MIXED:
      inst->batch = make_extend_batch(rows, s.prefix_lens, s.query_lens, s.mode);
      break;
    case ForwardMode::DECODE:
      inst->batch = make_decode_batch(rows, seq_lens);
      break;
    case ForwardMode::TARGET_VERIFY:
      inst->batch = make_verify_batch(rows, s.prefix_lens, s.spec);
      break;
    case ForwardMode::DRAFT_EXTEND: {
      std::vector<int32_t> accept(bs);
      for (int i = 0; i < bs; ++i) accept[i] = s.query_lens[i] - 1;
      inst->batch = make_draft_extend_batch(rows, seq_lens, accept);
      break;
    }
    case ForwardMode::DRAFT_EXTEND_V2:
      inst->batch = make_draft_extend_v2_batch(rows, seq_lens, bs > 0 ? s.query_lens[0] : 1);
      break;
    case ForwardMode::IDLE:
      inst->batch = make_idle_batch();
      break;
  }
  inst->batch.out_cache_loc = std::move(new_slots);
  make_step_layout(inst->batch);
  return inst;
}

RunOutput run_backend(const BackendEntry& entry, const ConformanceCase& c, CaseInstance& instance) {
  const CaseSpec& s = c.spec;
  const Device device =
      contains(entry.caps.devices, DeviceKind::cpu) ? Device::cpu() : Device::cuda(0);
  std::unique_ptr<AttentionBackend> backend = entry.factory(instance.context(device));
  const ForwardBatch& batch = instance.batch;
  const int64_t t = batch.num_tokens();
  instance.storage.cache->begin_step(batch);
  backend->init_forward_metadata(batch);
  RunOutput out;
  for (size_t li = 0; li < instance.model.layers.size(); ++li) {
    const LayerSpec& l = instance.model.layers[li];
    const LayerValues& lv = c.values[li];
    HostBuffer q = to_buffer(s.act_dtype, lv.q, t, l.num_q_heads, l.head_dim);
    HostBuffer k = to_buffer(s.act_dtype, lv.k, t, l.num_kv_heads, l.head_dim);
    HostBuffer v = to_buffer(s.act_dtype, lv.v, t, l.num_kv_heads, l.v_head_dim);
    HostBuffer o(s.act_dtype, {t, l.num_q_heads, l.v_head_dim});
    poison(o);
    AttnArgs args;
    args.q = q.view();
    args.k = k.view();
    args.v = v.view();
    args.out = o.view();
    args.sinks = l.has_sinks ? lv.sinks.data() : nullptr;
    HostBuffer iq, ik, iw;
    if (l.has_indexer()) {
      const int64_t hi = l.indexer.index_n_heads, di = l.indexer.index_head_dim;
      iq = to_buffer(s.act_dtype, lv.index_q, t, hi, di);
      ik = to_buffer(s.act_dtype, lv.index_k, t, 1, di);
      iw = to_buffer(s.act_dtype, lv.index_w, t, 1, hi);
      args.indexer.q = iq.view();
      args.indexer.k = TensorView(ik.data(), s.act_dtype, {t, di});
      args.indexer.weights = TensorView(iw.data(), s.act_dtype, {t, hi});
    }
    if (s.want_lse) {
      HostBuffer lse(DType::f32, {t, l.num_q_heads});
      poison(lse);
      args.lse = lse.view();
      out.lse.push_back(std::move(lse));
    }
    backend->forward(args, l, batch);
    out.out.push_back(std::move(o));
  }
  return out;
}

Tolerance tolerance_for(DType out_dtype) {
  switch (out_dtype) {
    case DType::bf16: return {2e-2, 2e-2};
    case DType::f16: return {5e-3, 5e-3};
    default: return {1e-4, 1e-4};
  }
}

namespace {

struct Comparison {
  double max_abs = 0, max_rel = 0;
  bool ok = true;
  std::string first_bad;
};

void compare(const HostBuffer& got, const HostBuffer& want, Tolerance tol, std::string_view what,
             Comparison& cmp) {
  const TensorView g = got.view();
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double a = load_as_float(got.data(), got.dtype(), static_cast<size_t>(i));
    const double b = load_as_float(want.data(), want.dtype(), static_cast<size_t>(i));
    const bool bad_value = !std::isfinite(a) || !std::isfinite(b);
    const double err = bad_value ? std::numeric_limits<double>::infinity() : std::fabs(a - b);
    const double rel = err / std::max(std::fabs(b), tol.abs);
    cmp.max_abs = std::max(cmp.max_abs, err);
    cmp.max_rel = std::max(cmp.max_rel, rel);
    if (!(err <= tol.abs + tol.rel * std::fabs(b)) && cmp.ok) {
      cmp.ok = false;
      // Decompose the flat index into [token, head, dim] (or [token, head] for lse).
      std::string where;
      int64_t rest = i;
      for (int d = g.ndim - 1; d >= 0; --d) {
        where = fmt::format("{}{}", rest % g.shape[d], where.empty() ? "" : ", " + where);
        rest /= g.shape[d];
      }
      cmp.first_bad = fmt::format("{}[{}] = {} but reference = {} (|diff| {:.3g}, allowed {:.3g} + "
                                  "{:.3g} * |reference|){}",
                                  what, where, a, b, err, tol.abs, tol.rel,
                                  std::isnan(a) ? "; NaN: the element was never written" : "");
    }
  }
}

}  // namespace

CaseResult run_case(const BackendEntry& entry, const ConformanceCase& c, const Registry& registry) {
  if (c.linear) return run_linear_case(entry, *c.linear, registry);
  const BackendEntry& ref = registry.get("reference");
  CaseResult result;
  auto ref_inst = materialize(c);
  auto dut_inst = materialize(c);
  // Both pools come from the same deterministic recipe; a difference is a harness defect.
  ATTNRT_CHECK(ref_inst->token_slots == dut_inst->token_slots &&
                   ref_inst->batch.out_cache_loc == dut_inst->batch.out_cache_loc,
               "conformance harness: two materialisations of one case differ ({})",
               c.spec.describe());
  const RunOutput want = run_backend(ref, c, *ref_inst);
  RunOutput got;
  try {
    got = run_backend(entry, c, *dut_inst);
  } catch (const std::exception& e) {
    result.ok = false;
    result.max_abs_err = result.max_rel_err = std::numeric_limits<double>::infinity();
    result.detail = fmt::format("{}: backend '{}' threw: {}", c.spec.describe(), entry.name,
                                e.what());
    return result;
  }
  Comparison cmp;
  const Tolerance tol = tolerance_for(c.spec.act_dtype);
  for (size_t li = 0; li < want.out.size(); ++li) {
    compare(got.out[li], want.out[li], tol, fmt::format("layer {} out", li), cmp);
    if (c.spec.want_lse) {
      compare(got.lse[li], want.lse[li], Tolerance{2e-3, 1e-3}, fmt::format("layer {} lse", li),
              cmp);
    }
  }
  result.ok = cmp.ok;
  result.max_abs_err = cmp.max_abs;
  result.max_rel_err = cmp.max_rel;
  result.detail = cmp.ok ? c.spec.describe()
                         : fmt::format("{}: {}", c.spec.describe(), cmp.first_bad);
  return result;
}

CaseResult run_case(const std::string& backend_name, const ConformanceCase& c,
                    const Registry& registry) {
  return run_case(registry.get(backend_name), c, registry);
}

bool ConformanceReport::ok() const {
  return std::all_of(features.begin(), features.end(),
                     [](const FeatureReport& f) { return f.failures == 0; });
}

ConformanceReport run_conformance(const BackendEntry& entry, int cases_per_feature, uint64_t seed,
                                  const ProgressFn& progress, const Registry& registry) {
  ATTNRT_CHECK(cases_per_feature >= 1,
               "conformance: cases_per_feature = {}; run at least 1 case per feature",
               cases_per_feature);
  ConformanceReport report;
  report.backend = entry.name;
  const std::string unavailable = entry.unavailable_reason ? entry.unavailable_reason() : "";
  for (Feature f : all_features()) {
    FeatureReport fr;
    fr.feature = f;
    fr.skip_reason = unavailable.empty()
                         ? unsupported_reason(entry.caps, f)
                         : fmt::format("backend '{}' is unavailable: {}", entry.name, unavailable);
    fr.skipped = !fr.skip_reason.empty();
    if (fr.skipped) {
      if (progress) progress(Progress{f, 0, 0, nullptr, fr.skip_reason});
      report.features.push_back(std::move(fr));
      continue;
    }
    for (int k = 0; k < cases_per_feature; ++k) {
      const uint64_t case_seed =
          splitmix64(seed ^ splitmix64((static_cast<uint64_t>(f) << 32) | static_cast<uint32_t>(k)));
      const ConformanceCase c = generate_case(f, case_seed, entry.caps);
      const CaseResult r = run_case(entry, c, registry);
      ++fr.cases;
      fr.max_abs_err = std::max(fr.max_abs_err, r.max_abs_err);
      fr.max_rel_err = std::max(fr.max_rel_err, r.max_rel_err);
      if (!r.ok) {
        if (fr.failures == 0) fr.first_failure = r.detail;
        ++fr.failures;
      }
      if (progress) progress(Progress{f, k, cases_per_feature, &r, {}});
    }
    report.features.push_back(std::move(fr));
  }
  return report;
}

ConformanceReport run_conformance(const std::string& backend_name, int cases_per_feature,
                                  uint64_t seed, const ProgressFn& progress,
                                  const Registry& registry) {
  return run_conformance(registry.get(backend_name), cases_per_feature, seed, progress, registry);
}

}  // namespace attnrt::conformance
