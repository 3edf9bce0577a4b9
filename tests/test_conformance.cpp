// The conformance suite: every registered backend that is available here, for every feature its caps
// claim, against the reference backend on random cases; plus self-tests showing that the harness
// catches wrong backends.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "tests/conformance/conformance.h"

using namespace attnrt;
using namespace attnrt::conformance;

namespace {

struct SuiteParam {
  std::string backend;
  Feature feature;
};

void PrintTo(const SuiteParam& p, std::ostream* os) {
  *os << p.backend << "/" << feature_name(p.feature);
}

// Fresh inputs every run: the base seed comes from ATTNRT_TEST_SEED when set (to reproduce a failure),
// else from the random device; every failure message names it.
uint32_t base_seed() {
  static const uint32_t seed = [] {
    if (const char* env = std::getenv("ATTNRT_TEST_SEED")) {
      return static_cast<uint32_t>(std::strtoul(env, nullptr, 0));
    }
    return static_cast<uint32_t>(std::random_device{}());
  }();
  return seed;
}

std::vector<SuiteParam> suite_params() {
  std::vector<SuiteParam> out;
  for (const std::string& name : Registry::global().names()) {
    for (Feature f : all_features()) out.push_back({name, f});
  }
  return out;
}

class Conformance : public ::testing::TestWithParam<SuiteParam> {};

TEST_P(Conformance, MatchesReference) {
  const SuiteParam& p = GetParam();
  const BackendEntry& entry = Registry::global().get(p.backend);
  const std::string unavailable = entry.unavailable_reason ? entry.unavailable_reason() : "";
  if (!unavailable.empty()) GTEST_SKIP() << p.backend << " is unavailable: " << unavailable;
  const std::string unsupported = unsupported_reason(entry.caps, p.feature);
  if (!unsupported.empty()) GTEST_SKIP() << p.backend << ": " << unsupported;
  // The reference against itself only checks that the harness runs every feature end to end.
  const int cases = p.backend == "reference" ? 2 : 6;
  for (int k = 0; k < cases; ++k) {
    const uint32_t seed = base_seed() + static_cast<uint32_t>(k);
    const ConformanceCase c = generate_case(p.feature, seed, entry.caps);
    const CaseResult r = run_case(entry, c);
    EXPECT_TRUE(r.ok) << r.detail << " (case seed " << seed << "; rerun with ATTNRT_TEST_SEED="
                      << base_seed() << ")";
    if (p.backend == "reference") EXPECT_EQ(r.max_abs_err, 0.0) << r.detail;
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Conformance, ::testing::ValuesIn(suite_params()),
                         [](const ::testing::TestParamInfo<SuiteParam>& info) {
                           std::string name = info.param.backend + "_" +
                                              std::string(feature_name(info.param.feature));
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name;
                         });

// A deliberately wrong backend: causal attention that never sees the newest key of a request
// (unless it is the only one). It stores the step's K/V like a real backend.
class DropsLastKey final : public AttentionBackend {
 public:
  using AttentionBackend::AttentionBackend;
  std::string_view name() const override { return "drops-last-key"; }
  void init_forward_metadata(const ForwardBatch& batch) override { layout_ = make_step_layout(batch); }
  void forward_decode(const AttnArgs& a, const LayerSpec& l, const ForwardBatch& b) override {
    run(a, l, b);
  }
  void forward_extend(const AttnArgs& a, const LayerSpec& l, const ForwardBatch& b) override {
    run(a, l, b);
  }

 private:
  void run(const AttnArgs& a, const LayerSpec& l, const ForwardBatch& b) {
    ctx_.kv_cache->store_step_kv(l.layer_id, a.k, a.v);
    const KVLayerView kv = ctx_.kv_cache->layer(l.layer_id);
    const int group = l.num_q_heads / l.num_kv_heads, d = l.head_dim, dv = l.v_head_dim;
    const float scale = l.softmax_scale();
    for (int i = 0; i < b.batch_size; ++i) {
      const int32_t* row = ctx_.req_to_token->row_ptr(static_cast<int>(b.req_pool_indices[i]));
      const int32_t len = layout_.kv_len(i);
      for (int32_t t = 0; t < layout_.query_lens[i]; ++t) {
        const int64_t qrow = layout_.query_start[i] + t;
        const int32_t last = std::max(1, std::min(layout_.prefix_lens[i] + t + 1, len - 1));
        for (int h = 0; h < l.num_q_heads; ++h) {
          std::vector<float> s(last);
          float m = -INFINITY, den = 0;
          for (int32_t j = 0; j < last; ++j) {
            float dot = 0;
            for (int e = 0; e < d; ++e) {
              dot += load_as_float(a.q.data, a.q.dtype, (qrow * l.num_q_heads + h) * d + e) *
                     load_as_float(kv.k, kv.dtype, row[j] * kv.k_row_stride + (h / group) * d + e);
            }
            s[j] = dot * scale;
            m = std::max(m, s[j]);
          }
          for (float& x : s) den += (x = std::exp(x - m));
          for (int e = 0; e < dv; ++e) {
            float acc = 0;
            for (int32_t j = 0; j < last; ++j) {
              acc += s[j] * load_as_float(kv.v, kv.dtype,
                                          row[j] * kv.v_row_stride + (h / group) * dv + e);
            }
            store_from_float(a.out.data, a.out.dtype, (qrow * l.num_q_heads + h) * dv + e,
                             acc / den);
          }
        }
      }
    }
  }
  StepLayout layout_;
};

// Writes nothing at all: the NaN poison must show.
class WritesNothing final : public AttentionBackend {
 public:
  using AttentionBackend::AttentionBackend;
  std::string_view name() const override { return "writes-nothing"; }
  void init_forward_metadata(const ForwardBatch&) override {}
  void forward_decode(const AttnArgs&, const LayerSpec&, const ForwardBatch&) override {}
  void forward_extend(const AttnArgs&, const LayerSpec&, const ForwardBatch&) override {}
};

template <typename B>
BackendEntry test_entry(const std::string& name) {
  BackendEntry e = Registry::global().get("reference");
  e.name = name;
  e.factory = [](const BackendContext& ctx) -> std::unique_ptr<AttentionBackend> {
    return std::make_unique<B>(ctx);
  };
  return e;
}

}  // namespace

TEST(ConformanceHarness, DetectsABackendThatDropsTheLastKey) {
  const BackendEntry wrong = test_entry<DropsLastKey>("drops-last-key");
  int failures = 0, cases = 0;
  for (Feature f : {Feature::decode, Feature::extend_prefix}) {
    for (int k = 0; k < 6; ++k) {
      const ConformanceCase c = generate_case(f, 100 + k, wrong.caps);
      // A request whose only key is the new one has nothing to drop; make every request longer.
      bool droppable = false;
      for (size_t i = 0; i < c.spec.prefix_lens.size(); ++i) {
        droppable |= c.spec.prefix_lens[i] + c.spec.query_lens[i] > 1;
      }
      if (!droppable) continue;
      const CaseResult r = run_case(wrong, c);
      ++cases;
      if (!r.ok) {
        ++failures;
        EXPECT_NE(r.detail.find("but reference ="), std::string::npos) << r.detail;
        EXPECT_NE(r.detail.find("seed="), std::string::npos) << r.detail;
      }
    }
  }
  ASSERT_GT(cases, 6);
  EXPECT_EQ(failures, cases);
  // Control: the reference passes the same case, so the failures above come from the dropped key.
  const ConformanceCase c = generate_case(Feature::decode, 100, wrong.caps);
  EXPECT_TRUE(run_case(Registry::global().get("reference"), c).ok);
}

TEST(ConformanceHarness, UnwrittenOutputShowsAsNaN) {
  const BackendEntry wrong = test_entry<WritesNothing>("writes-nothing");
  const CaseResult r = run_case(wrong, generate_case(Feature::extend_prefix, 7, wrong.caps));
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.detail.find("never written"), std::string::npos) << r.detail;
}

TEST(ConformanceHarness, ABackendThatThrowsFailsWithItsMessage) {
  BackendEntry e = test_entry<WritesNothing>("throws");
  e.factory = [](const BackendContext&) -> std::unique_ptr<AttentionBackend> {
    fail("no kernel for this shape");
  };
  const CaseResult r = run_case(e, generate_case(Feature::decode, 3, e.caps));
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.detail.find("'throws' threw: no kernel for this shape"), std::string::npos)
      << r.detail;
}

TEST(ConformanceHarness, SkipsWhatTheCapsDoNotClaimAndSaysWhy) {
  BackendEntry e = test_entry<DropsLastKey>("limited");
  e.caps.sinks = false;
  e.caps.spec_topk_gt1 = false;
  e.caps.page_sizes = {16};
  e.caps.kv_dtypes = {DType::bf16};
  std::vector<std::string> seen;
  const ConformanceReport report = run_conformance(
      e, 1, 42, [&](const Progress& p) {
        if (p.result == nullptr) seen.push_back(std::string(feature_name(p.feature)));
      });
  auto skipped = [&](Feature f) {
    for (const FeatureReport& fr : report.features) {
      if (fr.feature == f) return fr.skipped ? fr.skip_reason : std::string();
    }
    return std::string("missing");
  };
  EXPECT_EQ(skipped(Feature::sinks), "caps do not claim sinks");
  EXPECT_EQ(skipped(Feature::verify_tree), "caps do not claim spec_topk_gt1");
  EXPECT_NE(skipped(Feature::page1).find("page size 1 is not among the native page sizes [16]"),
            std::string::npos);
  EXPECT_EQ(skipped(Feature::fp8_e4m3), "caps do not claim KV dtype fp8_e4m3");
  EXPECT_EQ(skipped(Feature::bf16), "");
  EXPECT_EQ(skipped(Feature::page16), "");
  EXPECT_NE(std::find(seen.begin(), seen.end(), "sinks"), seen.end());
  // The wrong backend fails every feature it was run on.
  EXPECT_FALSE(report.ok());
  for (const FeatureReport& fr : report.features) {
    if (!fr.skipped) EXPECT_EQ(fr.cases, 1) << feature_name(fr.feature);
  }

  BackendEntry gone = e;
  gone.unavailable_reason = [] { return std::string("no CUDA device found"); };
  const ConformanceReport none = run_conformance(gone, 1, 42);
  for (const FeatureReport& fr : none.features) {
    EXPECT_TRUE(fr.skipped);
    EXPECT_NE(fr.skip_reason.find("no CUDA device found"), std::string::npos);
  }
  EXPECT_TRUE(none.ok());
}

TEST(ConformanceHarness, GeneratedCasesFollowTheCaps) {
  BackendCaps caps = Registry::global().get("reference").caps;
  caps.page_sizes = {16};
  caps.kv_dtypes = {DType::bf16, DType::e4m3};
  caps.head_dims = {128};
  for (int k = 0; k < 10; ++k) {
    const ConformanceCase c = generate_case(Feature::softcap, k, caps);
    EXPECT_EQ(c.spec.page_size, 16);
    EXPECT_TRUE(c.spec.kv_dtype == DType::bf16 || c.spec.kv_dtype == DType::e4m3);
    EXPECT_EQ(c.spec.act_dtype, DType::bf16);
    EXPECT_EQ(c.spec.layers[0].head_dim, 128);
    EXPECT_GT(c.spec.layers[0].logit_cap, 0.f);
  }
  const ConformanceCase f8 = generate_case(Feature::fp8_e4m3, 1, caps);
  EXPECT_EQ(f8.spec.kv_dtype, DType::e4m3);
  EXPECT_EQ(f8.spec.act_dtype, DType::bf16);
  EXPECT_NE(f8.spec.k_scale, 1.f);
  EXPECT_THROW(parse_feature("paged"), Error);
  EXPECT_EQ(parse_feature("verify_tree"), Feature::verify_tree);
}

TEST(ConformanceHarness, MaterialisedPoolsAreIdenticalAndIndependent) {
  const BackendCaps& caps = Registry::global().get("reference").caps;
  const ConformanceCase c = generate_case(Feature::page16, 9, caps);
  auto a = materialize(c);
  auto b = materialize(c);
  ASSERT_EQ(a->token_slots, b->token_slots);
  ASSERT_EQ(a->batch.out_cache_loc, b->batch.out_cache_loc);
  // Request rows hold exactly the recorded slots.
  for (int i = 0; i < a->batch.batch_size; ++i) {
    const int row = static_cast<int>(a->batch.req_pool_indices[i]);
    for (size_t j = 0; j < a->token_slots[i].size(); ++j) {
      ASSERT_EQ(a->req_to_token->get(row, static_cast<int>(j)), a->token_slots[i][j]);
    }
  }
  // Running a backend on one instance stores the step's K/V there and nowhere else.
  const BackendEntry& ref = Registry::global().get("reference");
  run_backend(ref, c, *a);
  const KVLayerView ka = a->storage.cache->layer(0), kb = b->storage.cache->layer(0);
  const int64_t slot = a->batch.out_cache_loc.back();
  bool differs = false;
  for (int e = 0; e < ka.head_dim; ++e) {
    differs |= load_as_float(ka.k, ka.dtype, slot * ka.k_row_stride + e) !=
               load_as_float(kb.k, kb.dtype, slot * kb.k_row_stride + e);
  }
  EXPECT_TRUE(differs);
}
