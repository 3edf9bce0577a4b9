// The reference backend against a second, independent dense formulation: per request a full score
// matrix over all of its keys with an explicit boolean mask built from positions, a float64 softmax,
// and a product with V. The dense side gathers K/V from the slots the allocator handed out (not from
// the request rows the backend reads) and dequantises the stored bytes itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "backends/reference/reference_backend.h"
#include "tests/conformance/conformance.h"
#include "tests/test_util.h"

using namespace attnrt;
using namespace attnrt::conformance;

namespace {

// mask(request, query index in the step's new tokens, key index in the request) -> visible.
using MaskFn = std::function<bool(int, int, int)>;

struct Dense {
  std::vector<double> out;  // [T, Hq, Dv]
  std::vector<double> lse;  // [T, Hq]
};

// Positions of every key of request i: prefix tokens 0..p-1, new tokens p + t, or for a verify
// block p + (number of ancestors of t), counted here by walking the parents.
std::vector<int64_t> key_positions(const CaseSpec& s, int i) {
  const int p = s.prefix_lens[i], q = s.query_lens[i];
  std::vector<int64_t> pos(p + q);
  for (int j = 0; j < p + q; ++j) pos[j] = j;
  if (s.mode == ForwardMode::TARGET_VERIFY) {
    const int32_t* par = s.spec.parents.data() + static_cast<size_t>(i) * q;
    for (int t = 0; t < q; ++t) {
      int depth = 0;
      for (int a = par[t]; a >= 0; a = par[a]) ++depth;
      pos[p + t] = p + depth;
    }
  }
  return pos;
}

bool ancestor_or_self(const CaseSpec& s, int i, int t, int u) {
  const int32_t* par = s.spec.parents.data() + static_cast<size_t>(i) * s.query_lens[i];
  for (int a = t; a >= 0; a = par[a]) {
    if (a == u) return true;
  }
  return false;
}

// The visibility rules of reference-semantics §8.2-§8.5 for one layer.
MaskFn rule_mask(const CaseSpec& s, const LayerSpec& l) {
  return [&s, &l](int i, int t, int j) {
    const int p = s.prefix_lens[i];
    bool vis;
    if (!l.causal()) {
      vis = true;
    } else if (s.mode == ForwardMode::TARGET_VERIFY) {
      vis = j < p || ancestor_or_self(s, i, t, j - p);
    } else {
      vis = j <= p + t;
    }
    if (l.sliding_window >= 0) {
      const std::vector<int64_t> pos = key_positions(s, i);
      const int64_t d = pos[p + t] - pos[j];
      vis = vis && d >= 0 && d <= l.sliding_window;
    }
    return vis;
  };
}

Dense dense_attention(const ConformanceCase& c, const CaseInstance& inst, int layer_id,
                      const MaskFn& mask) {
  const CaseSpec& s = c.spec;
  const LayerSpec& l = c.model.layers[layer_id];
  const LayerValues& lv = c.values[layer_id];
  const KVLayerView kv = inst.storage.cache->layer(layer_id);
  const int hq = l.num_q_heads, g = hq / l.num_kv_heads, dqk = l.head_dim, dv = l.v_head_dim;
  const double scale = l.scaling > 0 ? l.scaling : 1.0 / std::sqrt(static_cast<double>(dqk));
  int64_t total = 0;
  for (int q : s.query_lens) total += q;
  Dense d;
  d.out.assign(static_cast<size_t>(total) * hq * dv, 0.0);
  d.lse.assign(static_cast<size_t>(total) * hq, 0.0);
  int64_t row0 = 0;
  for (size_t i = 0; i < s.prefix_lens.size(); ++i) {
    const int nk = s.prefix_lens[i] + s.query_lens[i], nq = s.query_lens[i];
    // Dequantised K and V of every key of the request: [nk, Hkv, D].
    std::vector<double> K(static_cast<size_t>(nk) * l.num_kv_heads * dqk);
    std::vector<double> V(static_cast<size_t>(nk) * l.num_kv_heads * dv);
    for (int j = 0; j < nk; ++j) {
      const int64_t full = inst.token_slots[i][j];
      const int64_t slot = kv.slot_map ? kv.slot_map[full] : full;
      for (int e = 0; e < l.num_kv_heads * dqk; ++e) {
        K[static_cast<size_t>(j) * l.num_kv_heads * dqk + e] =
            double{load_as_float(kv.k, kv.dtype, slot * kv.k_row_stride + e)} * kv.k_scale;
      }
      for (int e = 0; e < l.num_kv_heads * dv; ++e) {
        // MLA (§8.1): V is the first kv_lora_rank columns of the latent K row (one kv head),
        // taken here from K itself rather than through the pool's V view.
        V[static_cast<size_t>(j) * l.num_kv_heads * dv + e] =
            l.kind == LayerKind::mla
                ? K[static_cast<size_t>(j) * dqk + e]
                : double{load_as_float(kv.v, kv.dtype, slot * kv.v_row_stride + e)} * kv.v_scale;
      }
    }
    for (int h = 0; h < hq; ++h) {
      const int kh = h / g;
      // Score matrix [nq, nk] with -inf where masked.
      std::vector<double> S(static_cast<size_t>(nq) * nk);
      for (int t = 0; t < nq; ++t) {
        for (int j = 0; j < nk; ++j) {
          double dot = 0;
          for (int e = 0; e < dqk; ++e) {
            dot += double{lv.q[((row0 + t) * hq + h) * dqk + e]} *
                   K[(static_cast<size_t>(j) * l.num_kv_heads + kh) * dqk + e];
          }
          double sc = scale * dot;
          if (l.logit_cap > 0) sc = l.logit_cap * std::tanh(sc / l.logit_cap);
          S[static_cast<size_t>(t) * nk + j] =
              mask(static_cast<int>(i), t, j) ? sc : -std::numeric_limits<double>::infinity();
        }
      }
      for (int t = 0; t < nq; ++t) {
        const double* srow = &S[static_cast<size_t>(t) * nk];
        double m = l.has_sinks ? double{lv.sinks[h]} : -std::numeric_limits<double>::infinity();
        for (int j = 0; j < nk; ++j) m = std::max(m, srow[j]);
        double den = l.has_sinks ? std::exp(lv.sinks[h] - m) : 0.0;
        for (int j = 0; j < nk; ++j) den += std::exp(srow[j] - m);
        double* o = &d.out[((row0 + t) * hq + h) * dv];
        for (int j = 0; j < nk; ++j) {
          const double pj = std::exp(srow[j] - m) / den;
          for (int e = 0; e < dv; ++e) o[e] += pj * V[(static_cast<size_t>(j) * l.num_kv_heads + kh) * dv + e];
        }
        d.lse[(row0 + t) * hq + h] = m + std::log(den);
      }
    }
    row0 += nq;
  }
  return d;
}

struct Checked {
  double max_err = 0;
  RunOutput got;
  std::unique_ptr<CaseInstance> inst;
  ConformanceCase c;
};

// Runs the reference on the case and compares every layer's output and lse with the dense
// formulation (mask: the rules, unless `mask_for_layer` overrides them).
Checked check_case(CaseSpec spec, std::function<MaskFn(const CaseSpec&, const LayerSpec&)>
                                      mask_for_layer = rule_mask) {
  spec.want_lse = true;
  Checked r;
  r.c = make_case(std::move(spec));
  r.inst = materialize(r.c);
  r.got = run_backend(Registry::global().get("reference"), r.c, *r.inst);
  const double tol = r.c.spec.act_dtype == DType::f32   ? 2e-6
                     : r.c.spec.act_dtype == DType::f16 ? 1e-3
                                                        : 8e-3;
  for (size_t li = 0; li < r.c.model.layers.size(); ++li) {
    const LayerSpec& l = r.c.model.layers[li];
    const Dense want = dense_attention(r.c, *r.inst, static_cast<int>(li),
                                       mask_for_layer(r.c.spec, l));
    const HostBuffer& out = r.got.out[li];
    for (int64_t e = 0; e < out.numel(); ++e) {
      const double a = load_as_float(out.data(), out.dtype(), static_cast<size_t>(e));
      const double b = want.out[e];
      const double err = std::fabs(a - b);
      r.max_err = std::max(r.max_err, err);
      if (!(err <= tol * (1 + std::fabs(b)))) {
        ADD_FAILURE() << "layer " << li << " out element " << e << ": reference " << a
                      << " dense " << b << " in case " << r.c.spec.describe();
        return r;
      }
    }
    const HostBuffer& lse = r.got.lse[li];
    for (int64_t e = 0; e < lse.numel(); ++e) {
      const double a = lse.ptr<float>()[e], b = want.lse[e];
      if (!(std::fabs(a - b) <= 1e-5 * (1 + std::fabs(b)))) {
        ADD_FAILURE() << "layer " << li << " lse element " << e << ": reference " << a
                      << " dense " << b << " in case " << r.c.spec.describe();
        return r;
      }
    }
  }
  return r;
}

LayerSpec layer(int hq, int hkv, int d, int dv = 0) {
  return test::attention_layer(0, hq, hkv, d, dv);
}

CaseSpec base_spec(ForwardMode mode, std::vector<int32_t> prefix, std::vector<int32_t> query,
                   uint64_t seed) {
  CaseSpec s;
  s.seed = seed;
  s.mode = mode;
  s.prefix_lens = std::move(prefix);
  s.query_lens = std::move(query);
  s.layers = {layer(4, 2, 64)};
  s.page_size = 4;
  return s;
}

std::vector<int32_t> chain_parents(int bs, int n) {
  return SpecInfo::chain(bs, n).parents;
}

}  // namespace

TEST(ReferenceBackend, ExtendAcrossPageSizesAndPrefixBoundaries) {
  uint64_t seed = 1;
  for (int page : {1, 4, 16}) {
    // Prefixes: empty, ending on a page boundary, one past it, one short of it, several pages.
    CaseSpec s = base_spec(ForwardMode::EXTEND, {0, page, page + 1, 2 * page - 1, 33},
                           {5, 1, 12, 3, 7}, seed++);
    s.page_size = page;
    s.layers = {layer(4, 2, 64), layer(4, 1, 64)};
    SCOPED_TRACE(page);
    check_case(s);
  }
}

TEST(ReferenceBackend, DecodeWithGqaMqaAndHeadDims) {
  struct Shape { int hq, hkv, d, dv; };
  const Shape shapes[] = {{8, 8, 64, 64}, {8, 2, 96, 64}, {16, 2, 128, 96}, {8, 1, 64, 128},
                          {32, 4, 128, 128}};
  uint64_t seed = 20;
  for (const Shape& sh : shapes) {
    CaseSpec s = base_spec(ForwardMode::DECODE, {0, 15, 16, 40}, {1, 1, 1, 1}, seed++);
    s.layers = {layer(sh.hq, sh.hkv, sh.d, sh.dv)};
    s.page_size = 16;
    SCOPED_TRACE(s.describe());
    check_case(s);
  }
}

TEST(ReferenceBackend, MixedChunksAndDecodeRows) {
  CaseSpec s = base_spec(ForwardMode::MIXED, {0, 31, 7, 64}, {9, 1, 1, 4}, 30);
  s.page_size = 16;
  check_case(s);
}

TEST(ReferenceBackend, VerifyChainIsCausalOverPrefixAndDrafts) {
  CaseSpec s = base_spec(ForwardMode::TARGET_VERIFY, {5, 16, 1}, {4, 4, 4}, 40);
  s.spec = SpecInfo::chain(3, 4);
  check_case(s);
}

TEST(ReferenceBackend, VerifyTreeHidesSiblingsAndCousins) {
  // Root 0 -> children 1, 2 (siblings); 1 -> 3; 2 -> 4, 5 (siblings).
  const std::vector<int32_t> next_token = {1, 3, 4, -1, -1, -1};
  const std::vector<int32_t> next_sibling = {-1, 2, -1, -1, 5, -1};
  std::vector<int32_t> nt, ns;
  for (int r = 0; r < 2; ++r) {
    nt.insert(nt.end(), next_token.begin(), next_token.end());
    ns.insert(ns.end(), next_sibling.begin(), next_sibling.end());
  }
  CaseSpec s = base_spec(ForwardMode::TARGET_VERIFY, {9, 20}, {6, 6}, 41);
  s.spec = SpecInfo::from_retrive(2, 6, 2, nt, ns);
  Checked r = check_case(s);

  // Row of node 2 in request 0 (query row 2) must not see its sibling 1: the same dense computation
  // with node 1 made visible gives a different answer.
  auto with_sibling = [](const CaseSpec& cs, const LayerSpec& l) -> MaskFn {
    MaskFn rules = rule_mask(cs, l);
    return [&cs, rules](int i, int t, int j) {
      return rules(i, t, j) || (i == 0 && t == 2 && j == cs.prefix_lens[0] + 1);
    };
  };
  const Dense leaky = dense_attention(r.c, *r.inst, 0, with_sibling(r.c.spec, r.c.model.layers[0]));
  const Dense right = dense_attention(r.c, *r.inst, 0, rule_mask(r.c.spec, r.c.model.layers[0]));
  const int hq = r.c.model.layers[0].num_q_heads, dv = r.c.model.layers[0].v_head_dim;
  double diff = 0;
  for (int e = 0; e < hq * dv; ++e) {
    diff = std::max(diff, std::fabs(leaky.out[2 * hq * dv + e] - right.out[2 * hq * dv + e]));
    const double got = load_as_float(r.got.out[0].data(), DType::f32, 2 * hq * dv + e);
    EXPECT_NEAR(got, right.out[2 * hq * dv + e], 1e-5);
  }
  EXPECT_GT(diff, 1e-3);
}

TEST(ReferenceBackend, RandomTreesWithWindowOnPositions) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 4; ++trial) {
    const int n = 8, bs = 3;
    CaseSpec s = base_spec(ForwardMode::TARGET_VERIFY, {3, 12, 30}, {n, n, n}, 50 + trial);
    s.spec.draft_token_num = n;
    s.spec.topk = 3;
    for (int r = 0; r < bs; ++r) {
      s.spec.parents.push_back(-1);
      for (int t = 1; t < n; ++t) s.spec.parents.push_back(std::uniform_int_distribution<int>(0, t - 1)(rng));
    }
    LayerSpec w = layer(4, 2, 64);
    w.kind = LayerKind::swa;
    w.sliding_window = trial;  // 0 .. 3: the window cuts inside the draft block too
    s.layers = {w, layer(4, 2, 64)};
    SCOPED_TRACE(s.describe());
    check_case(s);
  }
}

TEST(ReferenceBackend, DraftExtendAndFixedWidthV2) {
  CaseSpec s = base_spec(ForwardMode::DRAFT_EXTEND, {6, 17, 1}, {3, 1, 4}, 60);
  check_case(s);
  CaseSpec v2 = base_spec(ForwardMode::DRAFT_EXTEND_V2, {6, 17, 1}, {3, 3, 3}, 61);
  check_case(v2);
}

TEST(ReferenceBackend, SlidingWindowEdgesAreInclusive) {
  for (int w : {0, 1, 5, 16}) {
    for (ForwardMode mode : {ForwardMode::EXTEND, ForwardMode::DECODE}) {
      const bool dec = mode == ForwardMode::DECODE;
      CaseSpec s = base_spec(mode, {0, 7, 23}, dec ? std::vector<int32_t>{1, 1, 1}
                                                   : std::vector<int32_t>{12, 6, 9},
                             70 + w);
      LayerSpec l = layer(4, 2, 64);
      l.kind = LayerKind::swa;
      l.sliding_window = w;
      s.layers = {l, layer(4, 2, 64)};
      SCOPED_TRACE(s.describe());
      check_case(s);
    }
  }
  // Decode at position 9 with W = 3 sees exactly the keys at positions 6, 7, 8, 9: a handwritten
  // mask, independent of the rule code above.
  CaseSpec s = base_spec(ForwardMode::DECODE, {9}, {1}, 80);
  LayerSpec l = layer(2, 1, 64);
  l.kind = LayerKind::swa;
  l.sliding_window = 3;
  s.layers = {l, layer(2, 1, 64)};
  check_case(s, [](const CaseSpec&, const LayerSpec& ly) -> MaskFn {
    if (ly.sliding_window < 0) return [](int, int, int) { return true; };
    return [](int, int, int j) { return j >= 6; };
  });
  // Off by one in either direction is caught by the same comparison.
  Checked r = check_case(s);
  for (int lo : {5, 7}) {
    const Dense wrong = dense_attention(r.c, *r.inst, 0, [lo](int, int, int j) { return j >= lo; });
    double diff = 0;
    for (size_t e = 0; e < wrong.out.size(); ++e) {
      diff = std::max(diff, std::fabs(wrong.out[e] -
                                      load_as_float(r.got.out[0].data(), DType::f32, e)));
    }
    EXPECT_GT(diff, 1e-3) << "window starting at key " << lo;
  }
}

TEST(ReferenceBackend, SoftcapSinksAndCustomScaling) {
  CaseSpec s = base_spec(ForwardMode::EXTEND, {10, 0}, {6, 9}, 90);
  LayerSpec capped = layer(4, 2, 64);
  capped.logit_cap = 2.5f;
  LayerSpec sinks = layer(4, 4, 96);
  sinks.has_sinks = true;
  LayerSpec scaled = layer(8, 2, 64);
  scaled.scaling = 0.31f;
  s.layers = {capped, sinks, scaled};
  s.q_amplitude = 4.f;
  Checked r = check_case(s);
  // The soft-cap bends logits of this size: without it the answer differs.
  LayerSpec plain = capped;
  plain.logit_cap = 0.f;
  ConformanceCase uncapped = r.c;
  uncapped.model.layers[0] = plain;
  const Dense d = dense_attention(uncapped, *r.inst, 0, rule_mask(r.c.spec, plain));
  double diff = 0;
  for (size_t e = 0; e < d.out.size(); ++e) {
    diff = std::max(diff, std::fabs(d.out[e] - load_as_float(r.got.out[0].data(), DType::f32, e)));
  }
  EXPECT_GT(diff, 1e-3);
}

TEST(ReferenceBackend, NonCausalSeesTheWholeRequest) {
  CaseSpec s = base_spec(ForwardMode::EXTEND, {0, 13}, {7, 5}, 100);
  LayerSpec l = layer(4, 2, 64);
  l.attn_type = AttnType::decoder_bidirectional;
  LayerSpec enc = l;
  enc.attn_type = AttnType::encoder_only;
  s.layers = {l, enc};
  check_case(s);
}

TEST(ReferenceBackend, Fp8KvWithNonUnitScales) {
  for (DType t : {DType::e4m3, DType::e5m2}) {
    CaseSpec s = base_spec(ForwardMode::EXTEND, {0, 17, 5}, {4, 3, 8}, 110);
    s.kv_dtype = t;
    s.act_dtype = DType::bf16;
    s.k_scale = 0.37f;
    s.v_scale = 2.5f;
    s.page_size = 16;
    s.layers = {layer(8, 2, 128), layer(4, 4, 64)};
    Checked r = check_case(s);
    const KVLayerView kv = r.inst->storage.cache->layer(0);
    EXPECT_EQ(kv.dtype, t);
    EXPECT_EQ(kv.k_scale, 0.37f);
    EXPECT_EQ(kv.v_scale, 2.5f);
  }
}

LayerSpec mla_layer(int hq, int rank, int rope) {
  LayerSpec l = layer(hq, 1, rank + rope, rank);
  l.kind = LayerKind::mla;
  l.kv_lora_rank = rank;
  l.qk_rope_head_dim = rope;
  l.scaling = 1.f / std::sqrt(192.f);
  return l;
}

// MLA (§8.1, §4.5): scores over all 576 latent dims, values from the first 512, one kv head
// shared by every q head; every mode, page sizes and fp8 with its one scale.
TEST(ReferenceBackend, MlaAttendsOverTheLatentRowInEveryMode) {
  struct Mode {
    ForwardMode mode;
    std::vector<int32_t> prefix, query;
  };
  const Mode modes[] = {
      {ForwardMode::EXTEND, {0, 17, 4}, {6, 3, 9}},
      {ForwardMode::DECODE, {0, 15, 40}, {1, 1, 1}},
      {ForwardMode::MIXED, {12, 30, 7}, {5, 1, 1}},
      {ForwardMode::TARGET_VERIFY, {9, 20}, {5, 5}},
      {ForwardMode::DRAFT_EXTEND, {9, 20}, {3, 2}},
  };
  uint64_t seed = 300;
  for (const Mode& m : modes) {
    for (DType kv : {DType::f32, DType::bf16, DType::e4m3}) {
      CaseSpec s = base_spec(m.mode, m.prefix, m.query, seed++);
      s.layers = {mla_layer(8, 512, 64), mla_layer(4, 128, 64)};
      s.kv_dtype = kv;
      s.act_dtype = kv == DType::f32 ? DType::f32 : DType::bf16;
      if (is_fp8(kv)) s.k_scale = s.v_scale = 0.3f;
      s.page_size = kv == DType::bf16 ? 16 : 1;
      if (m.mode == ForwardMode::TARGET_VERIFY) {
        s.spec.draft_token_num = 5;
        s.spec.topk = 2;
        s.spec.parents = {-1, 0, 0, 1, 2, -1, 0, 1, 1, 0};
      }
      SCOPED_TRACE(s.describe());
      Checked r = check_case(s);
      const KVLayerView v = r.inst->storage.cache->layer(0);
      EXPECT_EQ(v.v, v.k);
      EXPECT_EQ(v.v_scale, v.k_scale);
    }
  }
}

TEST(ReferenceBackend, HalfPrecisionActivationsAndKv) {
  for (DType t : {DType::f16, DType::bf16}) {
    CaseSpec s = base_spec(ForwardMode::DECODE, {3, 50}, {1, 1}, 120);
    s.kv_dtype = s.act_dtype = t;
    check_case(s);
  }
}

// The reference backend's threads follow the options, then ATTNRT_NUM_THREADS, as the cpu
// backend's: with --threads 1, `attnrt run`'s sampled checks fork no OpenMP team (two such runs on
// a 2-core machine each slowed ~13x while their checks' teams spun on the other's core).
TEST(ReferenceBackend, ThreadCountComesFromOptionsThenEnvironment) {
  CaseSpec s = base_spec(ForwardMode::EXTEND, {4, 0}, {3, 5}, 131);
  ConformanceCase c = make_case(s);
  auto inst = materialize(c);
  BackendContext ctx = inst->context(Device::cpu());
  Options o;
  o.num_threads = 1;
  ctx.options = &o;
  EXPECT_EQ(ReferenceBackend(ctx).num_threads(), 1);
  o.num_threads = 3;
  EXPECT_EQ(ReferenceBackend(ctx).num_threads(), 3);
  o.num_threads = 0;
  const char* saved = std::getenv("ATTNRT_NUM_THREADS");
  const std::string saved_value = saved ? saved : "";
  setenv("ATTNRT_NUM_THREADS", "2", 1);
  EXPECT_EQ(ReferenceBackend(ctx).num_threads(), 2);
  setenv("ATTNRT_NUM_THREADS", "x", 1);
  test::expect_error([&] { ReferenceBackend r(ctx); }, {"ATTNRT_NUM_THREADS = 'x'"});
  if (saved) {
    setenv("ATTNRT_NUM_THREADS", saved_value.c_str(), 1);
  } else {
    unsetenv("ATTNRT_NUM_THREADS");
  }
  o.num_threads = -1;
  test::expect_error([&] { ReferenceBackend r(ctx); }, {"reference backend: num_threads = -1"});
}

TEST(ReferenceBackend, ReadsStoredKvWhenTheStepKvIsShared) {
  // A second forward of the same layer with k/v empty (another layer stored them) reads the step's
  // K/V back from the pool and gives the same output.
  CaseSpec s = base_spec(ForwardMode::EXTEND, {4, 0}, {3, 5}, 130);
  ConformanceCase c = make_case(s);
  auto inst = materialize(c);
  const RunOutput first = run_backend(Registry::global().get("reference"), c, *inst);
  ReferenceBackend be(inst->context(Device::cpu()));
  be.init_forward_metadata(inst->batch);
  const LayerSpec& l = c.model.layers[0];
  const int64_t t = inst->batch.num_tokens();
  HostBuffer q(DType::f32, {t, l.num_q_heads, l.head_dim});
  for (size_t e = 0; e < c.values[0].q.size(); ++e) q.ptr<float>()[e] = c.values[0].q[e];
  HostBuffer out(DType::f32, {t, l.num_q_heads, l.v_head_dim});
  AttnArgs args;
  args.q = q.view();
  args.out = out.view();
  args.save_kv = false;
  be.forward(args, l, inst->batch);
  for (int64_t e = 0; e < out.numel(); ++e) {
    EXPECT_EQ(out.ptr<float>()[e], first.out[0].ptr<float>()[e]);
  }
}

TEST(ReferenceBackend, IdleStepTouchesNothing) {
  CaseSpec s = base_spec(ForwardMode::EXTEND, {2}, {2}, 140);
  ConformanceCase c = make_case(s);
  auto inst = materialize(c);
  ReferenceBackend be(inst->context(Device::cpu()));
  const ForwardBatch idle = make_idle_batch();
  be.init_forward_metadata(idle);
  EXPECT_EQ(be.layout().num_tokens, 0);
  HostBuffer out(DType::f32, {0, 4, 64});
  AttnArgs args;
  args.out = out.view();
  be.forward(args, c.model.layers[0], idle);
}

TEST(ReferenceBackend, RejectsBadArgumentsBeforeStoringAnything) {
  CaseSpec s = base_spec(ForwardMode::EXTEND, {3, 0}, {2, 4}, 150);
  LayerSpec sinks = layer(4, 2, 64);
  sinks.has_sinks = true;
  s.layers = {layer(4, 2, 64), sinks};
  ConformanceCase c = make_case(s);
  auto inst = materialize(c);
  const LayerSpec& l = c.model.layers[0];
  const int64_t t = inst->batch.num_tokens();
  HostBuffer q(DType::f32, {t, 4, 64}), k(DType::f32, {t, 2, 64}), v(DType::f32, {t, 2, 64}),
      out(DType::f32, {t, 4, 64});
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (HostBuffer* b : {&q, &k, &v}) {
    for (int64_t e = 0; e < b->numel(); ++e) b->ptr<float>()[e] = nd(rng);
  }
  ReferenceBackend be(inst->context(Device::cpu()));
  auto args = [&] {
    AttnArgs a;
    a.q = q.view();
    a.k = k.view();
    a.v = v.view();
    a.out = out.view();
    return a;
  };
  auto expect_error = [&](const std::function<void()>& fn, const std::vector<std::string>& parts) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected " << parts.front();
    } catch (const Error& e) {
      for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  };
  expect_error([&] { be.forward(args(), l, inst->batch); }, {"without a matching init_forward_metadata"});
  inst->storage.cache->begin_step(inst->batch);
  be.init_forward_metadata(inst->batch);
  const KVLayerView kv = inst->storage.cache->layer(0);
  const int64_t slot = inst->batch.out_cache_loc[0];
  const float before = load_as_float(kv.k, kv.dtype, slot * kv.k_row_stride);

  HostBuffer q_bad(DType::f32, {t, 4, 32});
  expect_error([&] { auto a = args(); a.q = q_bad.view(); be.forward(a, l, inst->batch); },
               {"q is fp32[6, 4, 32]", "[6, 4, 64]"});
  HostBuffer out_int(DType::i32, {t, 4, 64});
  expect_error([&] { auto a = args(); a.out = out_int.view(); be.forward(a, l, inst->batch); },
               {"out is int32[6, 4, 64]", "float dtype"});
  expect_error([&] { auto a = args(); a.v = TensorView(); be.forward(a, l, inst->batch); },
               {"k is fp32[6, 2, 64] on cpu but v is empty"});
  HostBuffer lse_bad(DType::f32, {t, 3});
  expect_error([&] { auto a = args(); a.lse = lse_bad.view(); be.forward(a, l, inst->batch); },
               {"lse is fp32[6, 3]", "fp32[6, 4]"});
  expect_error([&] { be.forward(args(), c.model.layers[1], inst->batch); },
               {"layer 1 has sinks but AttnArgs.sinks is null"});
  EXPECT_EQ(load_as_float(kv.k, kv.dtype, slot * kv.k_row_stride), before);

  // A request row that does not hold the step's slots is caught by the plan.
  ForwardBatch bad = inst->batch;
  std::swap(bad.out_cache_loc[0], bad.out_cache_loc[1]);
  expect_error([&] { be.init_forward_metadata(bad); }, {"req_to_token[", "out_cache_loc[0]",
                                                       "write the step's slots"});
  // A batch the validator rejects never reaches the pools.
  ForwardBatch short_batch = inst->batch;
  short_batch.out_cache_loc.pop_back();
  expect_error([&] { be.init_forward_metadata(short_batch); }, {"out_cache_loc has 5 entries"});
  expect_error([&] { be.forward_decode(args(), l, inst->batch); },
               {"forward_decode called for a EXTEND batch"});
}

TEST(ReferenceBackend, RegistryEntryClaimsEveryFullAttentionFeature) {
  const BackendEntry& e = Registry::global().get("reference");
  EXPECT_FALSE(e.auto_selectable);
  EXPECT_EQ(e.unavailable_reason(), "");
  EXPECT_TRUE(e.caps.page_sizes.empty());
  EXPECT_EQ(e.caps.devices, std::vector<DeviceKind>{DeviceKind::cpu});
  for (DType t : {DType::f32, DType::f16, DType::bf16, DType::e4m3, DType::e5m2}) {
    EXPECT_NE(std::find(e.caps.kv_dtypes.begin(), e.caps.kv_dtypes.end(), t), e.caps.kv_dtypes.end());
  }
  EXPECT_TRUE(e.caps.spec_topk1 && e.caps.spec_topk_gt1 && e.caps.sliding_window && e.caps.softcap &&
              e.caps.sinks && e.caps.non_causal);
  EXPECT_TRUE(e.caps.mla);
  EXPECT_FALSE(e.caps.cuda_graphs);
}
