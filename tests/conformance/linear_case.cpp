#include "tests/conformance/linear_case.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/options.h"
#include "attnrt/core/error.h"
#include "attnrt/core/tensor.h"
#include "attnrt/memory/linear_state_pool.h"
#include "tests/conformance/conformance.h"

namespace attnrt::conformance {

namespace {

int pick(std::mt19937_64& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

std::vector<float> uniform(std::mt19937_64& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

// The parameters and per-token inputs of one case (fp32, as LinearArgs takes them), drawn from the
// case's seed, so that both backends get the same.
struct Values {
  LinearStateShape shape;
  std::vector<float> conv_w, conv_b, A_log, dt_bias, D, x, a, b;
  std::vector<std::vector<float>> states;  // per request: conv window then recurrent state

  Values(const LinearCase& c, int64_t tokens) : shape(linear_state_shape(c.layer)) {
    std::mt19937_64 rng(c.seed);
    const LinearSpec& s = c.layer.linear;
    const bool kda = c.layer.kind == LayerKind::kda;
    conv_w = uniform(rng, int64_t{shape.conv_dim} * s.conv_kernel, -0.6f, 0.6f);
    conv_b = uniform(rng, shape.conv_dim, -0.3f, 0.3f);
    A_log = uniform(rng, shape.heads, -1.5f, 0.5f);
    dt_bias = uniform(rng, int64_t{shape.heads} * (kda ? s.head_k_dim : 1), -1.f, 1.f);
    if (c.layer.kind == LayerKind::mamba2) D = uniform(rng, shape.heads, -1.f, 1.f);
    x = uniform(rng, tokens * shape.conv_dim, -1.f, 1.f);
    a = uniform(rng, tokens * a_width(c), -2.5f, 2.5f);
    b = uniform(rng, tokens * b_width(c), -2.5f, 2.5f);
    for (size_t i = 0; i < c.prefix_lens.size(); ++i) {
      states.push_back(uniform(rng, shape.conv_elems() + shape.ssm_elems(), -0.5f, 0.5f));
    }
  }
  int a_width(const LinearCase& c) const {
    return c.layer.kind == LayerKind::kda ? shape.heads * c.layer.linear.head_k_dim : shape.heads;
  }
  int b_width(const LinearCase& c) const {
    return c.layer.kind == LayerKind::mamba2 ? 0 : shape.heads;
  }
};

struct Output {
  std::vector<float> out;                  // [T, heads * rows]
  std::vector<std::vector<float>> states;  // per request after the step (and the verify commit)
};

Output run_on(const BackendEntry& entry, const LinearCase& c, const Values& v,
              const ForwardBatch& batch, int64_t tokens) {
  ATTNRT_CHECK(entry.linear_factory != nullptr,
               "conformance: backend '{}' has no linear side (caps.linear_kinds is empty)",
               entry.name);
  const int bs = static_cast<int>(c.prefix_lens.size());
  ModelSpec model;
  model.name = "conformance-linear";
  model.dtype = DType::f32;
  model.max_context_len = 4096;
  model.layers = {c.layer};
  model.layers[0].layer_id = 0;
  const bool verify = c.mode == ForwardMode::TARGET_VERIFY;
  const LinearStateConfig config{.max_slots = bs + 1,
                                 .max_request_rows = bs + 1,
                                 .ssm_dtype = DType::f32,
                                 .conv_dtype = DType::f32,
                                 .verify_rows = verify ? bs : 0,
                                 .num_draft_tokens = verify ? c.spec.draft_token_num : 0};
  LinearStatePool pool(model, config);
  const int64_t nc = v.shape.conv_elems();
  for (int i = 0; i < bs; ++i) {
    const int slot = pool.alloc_for(i);
    // A request with tokens before the step carries a state; a new one starts from zeros.
    if (c.prefix_lens[i] > 0) {
      pool.upload_slot(0, slot, v.states[i].data(), v.states[i].data() + nc);
    }
  }
  Options options;
  BackendContext ctx;
  ctx.model = &model;
  ctx.options = &options;
  ctx.linear_state = &pool;
  std::unique_ptr<AttentionBackend> backend = entry.linear_factory(ctx);

  const LinearSpec& s = c.layer.linear;
  std::vector<float> x = v.x, a = v.a, b = v.b;
  Output o;
  o.out.assign(static_cast<size_t>(tokens * v.shape.heads * v.shape.rows),
               std::numeric_limits<float>::quiet_NaN());
  LinearArgs args;
  auto view = [](std::vector<float>& data, std::initializer_list<int64_t> shape) {
    return TensorView(data.data(), DType::f32, shape);
  };
  std::vector<float> conv_w = v.conv_w, conv_b = v.conv_b, A_log = v.A_log, dt_bias = v.dt_bias,
                     D = v.D;
  args.mixed_qkv = view(x, {tokens, v.shape.conv_dim});
  args.conv_weight = view(conv_w, {v.shape.conv_dim, s.conv_kernel});
  args.conv_bias = view(conv_b, {v.shape.conv_dim});
  args.A_log = view(A_log, {v.shape.heads});
  if (c.layer.kind == LayerKind::kda) {
    args.a = view(a, {tokens, v.shape.heads, s.head_k_dim});
    args.dt_bias = view(dt_bias, {v.shape.heads, s.head_k_dim});
  } else {
    args.a = view(a, {tokens, v.shape.heads});
    args.dt_bias = view(dt_bias, {v.shape.heads});
  }
  if (c.layer.kind == LayerKind::mamba2) {
    args.D = view(D, {v.shape.heads});
  } else {
    args.b = view(b, {tokens, v.shape.heads});
  }
  args.out = view(o.out, {tokens, v.shape.heads, v.shape.rows});
  backend->init_forward_metadata(batch);
  backend->forward_linear(args, model.layers[0], batch);
  if (verify) backend->update_state_after_verify(c.accepted);

  std::vector<float> conv(static_cast<size_t>(nc)), ssm(static_cast<size_t>(v.shape.ssm_elems()));
  for (int i = 0; i < bs; ++i) {
    pool.download_slot(0, pool.slot_of(i), conv.data(), ssm.data());
    std::vector<float> st = conv;
    st.insert(st.end(), ssm.begin(), ssm.end());
    o.states.push_back(std::move(st));
  }
  return o;
}

}  // namespace

std::string LinearCase::describe() const {
  const LinearSpec& s = layer.linear;
  std::string reqs;
  for (size_t i = 0; i < prefix_lens.size(); ++i) {
    reqs += fmt::format("{}({}+{})", i ? " " : "", prefix_lens[i], query_lens[i]);
  }
  std::string tree;
  if (mode == ForwardMode::TARGET_VERIFY) {
    tree = fmt::format(" topk={} parents=[{}] accepted=[{}]", spec.topk,
                       fmt::join(spec.parents, ","), fmt::join(accepted, ","));
  }
  return fmt::format(
      "{} seed={:#x} mode={} requests(prefix+query)=[{}]{} layer: k_heads={} v_heads={} "
      "k_dim={} v_dim={} d_state={} groups={} conv={} chunk={}",
      layer_kind_name(layer.kind), seed, forward_mode_name(mode), reqs, tree, s.num_k_heads,
      s.num_v_heads, s.head_k_dim, s.head_v_dim, s.d_state, s.n_groups, s.conv_kernel,
      s.chunk_size);
}

LinearCase random_linear_case(std::mt19937_64& rng, LayerKind kind) {
  LinearCase c;
  c.seed = rng();
  c.layer.kind = kind;
  LinearSpec& s = c.layer.linear;
  s.conv_kernel = pick(rng, 2, 4);
  s.chunk_size = std::vector<int>{4, 8, 16, 64}[pick(rng, 0, 3)];
  const std::vector<int> dims = {8, 12, 16, 20, 32};
  switch (kind) {
    case LayerKind::gdn:
      s.num_k_heads = pick(rng, 1, 2);
      s.num_v_heads = s.num_k_heads * pick(rng, 1, 2);
      s.head_k_dim = dims[pick(rng, 0, 4)];
      s.head_v_dim = dims[pick(rng, 0, 4)];
      break;
    case LayerKind::kda:
      s.num_k_heads = s.num_v_heads = pick(rng, 1, 3);
      s.head_k_dim = dims[pick(rng, 0, 4)];
      s.head_v_dim = dims[pick(rng, 0, 4)];
      break;
    default:
      s.n_groups = pick(rng, 1, 2);
      s.num_v_heads = s.n_groups * pick(rng, 1, 2);
      s.head_v_dim = dims[pick(rng, 0, 4)];
      s.d_state = dims[pick(rng, 0, 4)];
      break;
  }
  const std::vector<ForwardMode> modes = {ForwardMode::EXTEND, ForwardMode::MIXED,
                                          ForwardMode::DECODE, ForwardMode::TARGET_VERIFY};
  c.mode = modes[static_cast<size_t>(pick(rng, 0, 3))];
  const int bs = pick(rng, 1, 4);
  const int n = pick(rng, 2, 5);
  const bool tree = c.mode == ForwardMode::TARGET_VERIFY && pick(rng, 0, 1) == 1;
  for (int i = 0; i < bs; ++i) {
    int32_t p = pick(rng, 1, 60), q = 1;
    switch (c.mode) {
      case ForwardMode::EXTEND:
        if (pick(rng, 0, 2) == 0) p = 0;
        q = pick(rng, 1, 40);
        break;
      case ForwardMode::MIXED:
        if (pick(rng, 0, 1) == 0) {
          if (pick(rng, 0, 2) == 0) p = 0;
          q = pick(rng, 1, 30);
        }
        break;
      case ForwardMode::TARGET_VERIFY:
        q = n;
        break;
      default:
        break;
    }
    c.prefix_lens.push_back(p);
    c.query_lens.push_back(q);
  }
  if (c.mode == ForwardMode::TARGET_VERIFY) {
    c.spec.draft_token_num = n;
    c.spec.topk = tree ? 2 : 1;
    for (int i = 0; i < bs; ++i) {
      std::vector<int32_t> children(n, 0);
      for (int t = 0; t < n; ++t) {
        int parent = t - 1;
        if (tree && t > 0) {
          do parent = pick(rng, 0, t - 1);
          while (children[parent] >= 2);
        }
        if (parent >= 0) ++children[parent];
        c.spec.parents.push_back(parent);
      }
      c.accepted.push_back(pick(rng, -1, n - 1));
    }
  }
  return c;
}

CaseResult run_linear_case(const BackendEntry& entry, const LinearCase& c,
                           const Registry& registry) {
  const int bs = static_cast<int>(c.prefix_lens.size());
  std::vector<int64_t> rows(bs);
  std::iota(rows.begin(), rows.end(), int64_t{0});
  std::vector<int32_t> seq(bs);
  for (int i = 0; i < bs; ++i) seq[i] = c.prefix_lens[i] + c.query_lens[i];
  ForwardBatch batch;
  switch (c.mode) {
    case ForwardMode::DECODE:
      batch = make_decode_batch(rows, seq);
      break;
    case ForwardMode::TARGET_VERIFY:
      batch = make_verify_batch(rows, c.prefix_lens, c.spec);
      break;
    default:
      batch = make_extend_batch(rows, c.prefix_lens, c.query_lens, c.mode);
      break;
  }
  const int64_t tokens = std::accumulate(c.query_lens.begin(), c.query_lens.end(), int64_t{0});
  // The linear layers do not read out_cache_loc; distinct dummy slots keep the batch well formed.
  batch.out_cache_loc.resize(static_cast<size_t>(tokens));
  std::iota(batch.out_cache_loc.begin(), batch.out_cache_loc.end(), int64_t{1});

  const Values values(c, tokens);
  CaseResult result;
  const Output want = run_on(registry.get("reference"), c, values, batch, tokens);
  Output got;
  try {
    got = run_on(entry, c, values, batch, tokens);
  } catch (const std::exception& e) {
    result.max_abs_err = result.max_rel_err = std::numeric_limits<double>::infinity();
    result.detail = fmt::format("{}: backend '{}' threw: {}", c.describe(), entry.name, e.what());
    return result;
  }
  // fp32 recurrences against float64 over a few dozen steps (the linear backend tests' bound).
  const Tolerance tol{2e-4, 2e-3};
  result.ok = true;
  auto compare = [&](const std::vector<float>& g, const std::vector<float>& w,
                     const std::string& what) {
    for (size_t i = 0; i < w.size(); ++i) {
      const double a = g[i], b = w[i];
      const double err = std::isfinite(a) && std::isfinite(b)
                             ? std::fabs(a - b)
                             : std::numeric_limits<double>::infinity();
      result.max_abs_err = std::max(result.max_abs_err, err);
      result.max_rel_err = std::max(result.max_rel_err, err / std::max(std::fabs(b), tol.abs));
      if (!(err <= tol.abs + tol.rel * std::fabs(b)) && result.ok) {
        result.ok = false;
        result.detail = fmt::format(
            "{}: {}[{}] = {} but reference = {} (|diff| {:.3g}, allowed {:.3g} + {:.3g} * "
            "|reference|){}",
            c.describe(), what, i, a, b, err, tol.abs, tol.rel,
            std::isnan(a) ? "; NaN: the element was never written" : "");
      }
    }
  };
  compare(got.out, want.out, "out");
  for (int i = 0; i < bs; ++i) compare(got.states[i], want.states[i], fmt::format("state {}", i));
  if (result.ok) result.detail = c.describe();
  return result;
}

}  // namespace attnrt::conformance
