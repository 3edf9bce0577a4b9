// DSA (DeepSeek sparse attention, docs/dsa.md): the model and config loader, the index-key cache,
// the selection (tie rule, fewer than / exactly / one more than index_topk candidates, page
// boundaries), cpu against reference in every mode, DSA over every key against dense MLA, the
// options and routing, and the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/dsa.h"
#include "attnrt/backend/selection.h"
#include "attnrt/memory/index_key_cache.h"
#include "attnrt/runtime/attention_runtime.h"
#include "src/model/layer_builders.h"
#include "tests/dsa_steps.h"
#include "tests/test_util.h"

namespace attnrt {
namespace {

using test::expect_error;

constexpr int kHq = 4, kRank = 64, kRope = 16, kRow = kRank + kRope;
constexpr int kIndexHeads = 4, kIndexDim = 32;

LayerSpec dsa_layer(int id, int topk) {
  LayerSpec l = layer_builders::mla_layer(id, kHq, kRank, kRope);
  l.scaling = 0.125f;
  l.indexer = {.index_topk = topk, .index_n_heads = kIndexHeads, .index_head_dim = kIndexDim};
  return l;
}

ModelSpec dsa_model(int topk, bool indexer = true) {
  LayerSpec l = dsa_layer(0, topk);
  if (!indexer) l.indexer = {};
  return test::make_model("dsa-test", DType::f32, 2048, {l});
}

std::string data_file(const char* name) {
  return (std::filesystem::path(__FILE__).parent_path() / "data" / name).string();
}

using test::Kind;
using test::StepSpec;

// A runtime whose latent pool and index-key cache hold random values in every slot (the same for
// the same seed), so prefixes read fresh values, and one step of `spec` on it.
struct Step {
  std::unique_ptr<AttentionRuntime> rt;
  ForwardBatch batch;
};

Options options_for(const std::string& backend, int page) {
  Options o;
  o.attention_backend = backend;
  o.page_size = page;
  o.num_threads = 2;
  return o;
}

Step make_step(const ModelSpec& model, const Options& o, const StepSpec& spec, uint64_t seed) {
  const RuntimeConfig c{.max_requests = 8,
                        .kv_slots = 4096,
                        .max_num_tokens = 1024,
                        .max_context_len = 1024,
                        .cuda_graphs = false};
  Step s;
  s.rt = std::make_unique<AttentionRuntime>(model, o, c);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const KVLayerView kv = s.rt->kv_cache().layer(0);
  test::fill_normal(TensorView(kv.k, kv.dtype, {kv.num_rows, kv.k_row_stride}), rng);
  if (model.layers[0].has_indexer()) {
    IndexKeyView ik = s.rt->kv_cache().index_keys(0);
    std::normal_distribution<float> d(0.f, 1.f);
    std::vector<float> key(kIndexDim);
    for (int64_t slot = 0; slot < ik.num_rows; ++slot) {
      for (float& x : key) x = d(rng);
      const float scale = quantize_fp8_block(key.data(), kIndexDim, ik.codes(slot));
      std::memcpy(const_cast<uint8_t*>(ik.scale_ptr(slot)), &scale, 4);
    }
  }
  s.batch = test::dsa_step_batch(*s.rt, spec);
  return s;
}

// Fresh random inputs of one DSA call over T tokens.
struct Inputs {
  HostBuffer q, latent, iq, ik, w;
  Inputs(int64_t T, uint64_t seed)
      : q(DType::f32, {T, kHq, kRow}),
        latent(DType::f32, {T, 1, kRow}),
        iq(DType::f32, {T, kIndexHeads, kIndexDim}),
        ik(DType::f32, {T, kIndexDim}),
        w(DType::f32, {T, kIndexHeads}) {
    std::mt19937 rng(static_cast<uint32_t>(seed * 31 + 7));
    for (const HostBuffer* b : {&q, &latent, &iq, &ik, &w}) test::fill_normal(b->view(), rng);
  }
  AttnArgs args(const TensorView& out, const TensorView& topk) const {
    AttnArgs a{.q = q.view(), .k = latent.view(), .v = {}, .out = out};
    a.indexer = {.q = iq.view(), .k = ik.view(), .weights = w.view(), .topk = topk};
    return a;
  }
};

struct Result {
  HostBuffer out, topk;
};

Result run(const ModelSpec& model, const Options& o, const StepSpec& spec, uint64_t seed) {
  Step s = make_step(model, o, spec, seed);
  const int64_t T = s.batch.num_tokens();
  const Inputs in(T, seed);
  const int topk = std::max(1, model.layers[0].indexer.index_topk);
  Result r{HostBuffer(DType::f32, {T, kHq, kRank}), HostBuffer(DType::i32, {T, topk})};
  test::poison(r.out.view());
  std::fill_n(r.topk.ptr<int32_t>(), r.topk.numel(), -7);
  s.rt->begin_step(s.batch);
  AttnArgs a = in.args(r.out.view(), r.topk.view());
  if (!model.layers[0].has_indexer()) a.indexer = {};
  s.rt->forward(0, a);
  s.rt->end_step();
  return r;
}

std::vector<int32_t> row_of(const HostBuffer& topk, int64_t row) {
  const int64_t k = topk.view().shape[1];
  return std::vector<int32_t>(topk.ptr<int32_t>() + row * k, topk.ptr<int32_t>() + (row + 1) * k);
}

// ---------------------------------------------------------------------------------------------
// Model and config

TEST(DsaModel, PresetIsDeepSeekV3WithAnIndexerOnEveryLayer) {
  const ModelSpec v32 = model_preset("deepseek-v3.2");
  const ModelSpec v3 = model_preset("deepseek-v3");
  ASSERT_EQ(v32.layers.size(), v3.layers.size());
  EXPECT_TRUE(v32.has_indexer());
  EXPECT_FALSE(v3.has_indexer());
  for (const LayerSpec& l : v32.layers) {
    EXPECT_EQ(l.indexer.index_topk, 2048);
    EXPECT_EQ(l.indexer.index_n_heads, 64);
    EXPECT_EQ(l.indexer.index_head_dim, 128);
    EXPECT_EQ(l.head_dim, v3.layers[l.layer_id].head_dim);
    EXPECT_FLOAT_EQ(l.softmax_scale(), v3.layers[l.layer_id].softmax_scale());
    EXPECT_FALSE(l.has_mha_form());  // DSA layers run absorbed only
  }
  // The indexer is replicated on every rank: tensor parallelism splits the MLA heads only.
  const ModelSpec tp = apply_tensor_parallel(v32, 8);
  EXPECT_EQ(tp.layers[0].num_q_heads, 16);
  EXPECT_EQ(tp.layers[0].indexer.index_n_heads, 64);
}

TEST(DsaModel, HfConfigOfV32LoadsTheIndexerAndMatchesThePreset) {
  const ModelSpec m = load_hf_config(data_file("deepseek_v32_config.json"));
  const ModelSpec p = model_preset("deepseek-v3.2");
  ASSERT_EQ(m.layers.size(), p.layers.size());
  for (size_t i = 0; i < m.layers.size(); ++i) {
    EXPECT_EQ(m.layers[i].kind, LayerKind::mla);
    EXPECT_EQ(m.layers[i].indexer.index_topk, 2048);
    EXPECT_EQ(m.layers[i].indexer.index_n_heads, 64);
    EXPECT_EQ(m.layers[i].indexer.index_head_dim, 128);
    EXPECT_NEAR(m.layers[i].softmax_scale(), p.layers[i].softmax_scale(), 1e-6);
  }
  // V3 configs without index fields stay dense.
  EXPECT_FALSE(load_hf_config(data_file("deepseek_v3_config.json"))
                   .has_indexer());
}

TEST(DsaModel, IndexTopkWithoutItsHeadFieldsIsAnErrorNamingTheField) {
  const std::string text = R"({"model_type": "deepseek_v32", "num_hidden_layers": 2,
      "num_attention_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
      "qk_nope_head_dim": 128, "v_head_dim": 128, "index_topk": 2048, "index_n_heads": 64})";
  expect_error([&] { load_hf_config_text(text, "v32.json"); }, {"v32.json", "index_head_dim"});
}

TEST(DsaModel, ValidationRejectsAnIndexerOutsideMlaAndPartialIndexers) {
  ModelSpec m = test::make_model("bad", DType::bf16, 1024, {test::attention_layer(0, 4, 4, 64)});
  m.layers[0].indexer = {.index_topk = 8, .index_n_heads = 2, .index_head_dim = 16};
  expect_error([&] { m.validate(); }, {"layer 0", "index_topk = 8", "mla layer only"});
  ModelSpec p = dsa_model(8);
  p.layers[0].indexer.index_head_dim = 0;
  expect_error([&] { p.validate(); }, {"index_head_dim = 0", "all three > 0"});
}

// ---------------------------------------------------------------------------------------------
// The index-key cache

TEST(DsaIndexKeys, BlockQuantisationHasAPowerOfTwoScaleAndFp8Codes) {
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> x(128);
  for (float& v : x) v = d(rng);
  std::vector<uint8_t> codes(128);
  const float scale = quantize_fp8_block(x.data(), 128, codes.data());
  EXPECT_EQ(std::exp2(std::round(std::log2(scale))), scale);
  float amax = 0.f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  EXPECT_LE(amax / scale, kFp8E4m3Max);
  EXPECT_GT(amax / scale, kFp8E4m3Max / 2);
  for (int i = 0; i < 128; ++i) {
    EXPECT_NEAR(e4m3_to_float(codes[i]) * scale, x[i], std::fabs(x[i]) / 16 + 1e-6) << i;
  }
}

// The scale is 2^ceil(log2(amax / 448)) exactly, also where amax / 448 lies a few ulps above a
// power of two (log2f rounds those onto the power, which halved the scale) or on one.
TEST(DsaIndexKeys, ScaleIsTheExactPowerOfTwoAtAndJustAboveBoundaries) {
  for (int e = -20; e <= 6; ++e) {
    const float p = std::ldexp(kFp8E4m3Max, e);  // amax / 448 = 2^e exactly
    for (int ulps = 0; ulps < 40; ++ulps) {
      float amax = p;
      for (int u = 0; u < ulps; ++u) amax = std::nextafter(amax, 1e30f);
      std::vector<float> x(128, 0.f);
      x[7] = -amax;
      std::vector<uint8_t> codes(128);
      const float scale = quantize_fp8_block(x.data(), 128, codes.data());
      SCOPED_TRACE(testing::Message() << "amax 448 * 2^" << e << " + " << ulps << " ulps");
      EXPECT_EQ(scale, std::ldexp(1.f, ulps == 0 ? e : e + 1));
      EXPECT_LE(amax / scale, kFp8E4m3Max);
      EXPECT_NEAR(e4m3_to_float(codes[7]) * scale, -amax, amax / 16);
    }
  }
}

TEST(DsaIndexKeys, StoredAtOutCacheLocInTheDeepGemmPageLayout) {
  const int page = 16;
  const StepSpec spec{Kind::extend, {5}, {20}};  // the new tokens cross a page boundary
  Step s = make_step(dsa_model(8), options_for("cpu", page), spec, 11);
  const int64_t T = s.batch.num_tokens();
  const Inputs in(T, 11);
  HostBuffer out(DType::f32, {T, kHq, kRank});
  s.rt->begin_step(s.batch);
  s.rt->forward(0, in.args(out.view(), {}));
  s.rt->end_step();
  const IndexKeyView ik = s.rt->kv_cache().index_keys(0);
  ASSERT_EQ(ik.page_size, page);
  std::vector<uint8_t> codes(kIndexDim);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = s.batch.out_cache_loc[t];
    const float scale = quantize_fp8_block(in.ik.ptr<float>() + t * kIndexDim, kIndexDim, codes.data());
    const uint8_t* base = ik.data + (slot / page) * page * (kIndexDim + 4);
    EXPECT_EQ(std::memcmp(base + (slot % page) * kIndexDim, codes.data(), kIndexDim), 0) << t;
    float stored;
    std::memcpy(&stored, base + page * kIndexDim + (slot % page) * 4, 4);
    EXPECT_EQ(stored, scale) << t;
  }
}

// A host cache's index keys copied into another cache of the same shape: byte for byte (the
// bench's device mirror uses the same call on a GPU cache).
TEST(DsaIndexKeys, CopyFromHostMirrorsEveryByte) {
  const Step a = make_step(dsa_model(8), options_for("cpu", 16), {Kind::decode, {40}, {1}}, 3);
  const Step b = make_step(dsa_model(8), options_for("cpu", 16), {Kind::decode, {40}, {1}}, 4);
  const IndexKeyView src = a.rt->kv_cache().index_keys(0), dst = b.rt->kv_cache().index_keys(0);
  ASSERT_EQ(src.num_rows, dst.num_rows);
  const size_t bytes = static_cast<size_t>(src.num_rows) * (src.dim + 4);
  ASSERT_NE(std::memcmp(src.data, dst.data, bytes), 0);  // different seeds, different keys
  b.rt->kv_cache().copy_index_keys_from_host(0, src.data);
  EXPECT_EQ(std::memcmp(src.data, dst.data, bytes), 0);
}

// ---------------------------------------------------------------------------------------------
// Selection

TEST(DsaSelection, EqualScoresSelectTheLowerTokenIndices) {
  for (const std::string backend : {"reference", "cpu"}) {
    SCOPED_TRACE(backend);
    const int topk = 5;
    Step s = make_step(dsa_model(topk), options_for(backend, 1), {Kind::decode, {11}, {1}}, 4);
    // Every index key the same: every candidate scores the same.
    IndexKeyView ik = s.rt->kv_cache().index_keys(0);
    std::vector<float> key(kIndexDim, 0.5f);
    for (int64_t slot = 0; slot < ik.num_rows; ++slot) {
      const float scale = quantize_fp8_block(key.data(), kIndexDim, ik.codes(slot));
      std::memcpy(const_cast<uint8_t*>(ik.scale_ptr(slot)), &scale, 4);
    }
    Inputs in(1, 4);
    std::fill_n(in.ik.ptr<float>(), kIndexDim, 0.5f);  // the new token's key too
    HostBuffer out(DType::f32, {1, kHq, kRank}), sel(DType::i32, {1, topk});
    s.rt->begin_step(s.batch);
    s.rt->forward(0, in.args(out.view(), sel.view()));
    s.rt->end_step();
    EXPECT_EQ(row_of(sel, 0), (std::vector<int32_t>{0, 1, 2, 3, 4}));
  }
}

TEST(DsaSelection, FewerExactlyAndOneMoreThanTopkCandidates) {
  const int topk = 16;
  for (const std::string backend : {"reference", "cpu"}) {
    for (int seq : {topk - 1, topk, topk + 1}) {
      SCOPED_TRACE(backend + " seq " + std::to_string(seq));
      const Result r = run(dsa_model(topk), options_for(backend, 1), {Kind::decode, {seq - 1}, {1}}, 7);
      const std::vector<int32_t> sel = row_of(r.topk, 0);
      if (seq <= topk) {
        for (int k = 0; k < topk; ++k) EXPECT_EQ(sel[k], k < seq ? k : -1) << k;
      } else {
        int n = 0;
        for (int k = 0; k < topk; ++k) {
          EXPECT_GE(sel[k], 0);
          EXPECT_LT(sel[k], seq);
          if (k > 0) EXPECT_LT(sel[k - 1], sel[k]);
          n += sel[k] >= 0;
        }
        EXPECT_EQ(n, topk);
      }
      for (int64_t i = 0; i < r.out.numel(); ++i) ASSERT_TRUE(std::isfinite(r.out.ptr<float>()[i]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// cpu against reference in every mode

using test::kModes;
using test::ModeCase;

TEST(DsaConformance, CpuSelectsTheReferenceKeysAndMatchesItsOutputInEveryMode) {
  const int topk = 24;
  for (int page : {1, 16}) {
    for (const ModeCase& m : kModes) {
      SCOPED_TRACE(std::string(m.name) + " page " + std::to_string(page));
      const uint64_t seed = 100 + page;
      const Result ref = run(dsa_model(topk), options_for("reference", page), m.spec, seed);
      const Result cpu = run(dsa_model(topk), options_for("cpu", page), m.spec, seed);
      const int64_t T = ref.out.view().shape[0];
      int64_t differ = 0;
      for (int64_t t = 0; t < T; ++t) differ += row_of(ref.topk, t) != row_of(cpu.topk, t);
      EXPECT_EQ(differ, 0) << "tokens whose selection differs";
      test::expect_close(cpu.out.view(), ref.out.view(), 2e-4, "out");
    }
  }
}

TEST(DsaConformance, TopkOfEveryKeyEqualsDenseMla) {
  for (const ModeCase& m : kModes) {
    SCOPED_TRACE(m.name);
    // index_topk beyond every request's keys: every visible key is selected.
    const Result sparse = run(dsa_model(1024), options_for("reference", 1), m.spec, 9);
    const Result dense = run(dsa_model(1024, false), options_for("reference", 1), m.spec, 9);
    EXPECT_EQ(std::memcmp(sparse.out.data(), dense.out.data(), sparse.out.bytes()), 0)
        << "reference DSA over every key differs from dense MLA";
    const Result cpu_sparse = run(dsa_model(1024), options_for("cpu", 1), m.spec, 9);
    test::expect_close(cpu_sparse.out.view(), dense.out.view(), 2e-4, "cpu DSA vs dense");
  }
}

TEST(DsaConformance, IdleStepDoesNothing) {
  for (const std::string backend : {"reference", "cpu"}) {
    RuntimeConfig c;
    c.kv_slots = 256;
    c.cuda_graphs = false;
    AttentionRuntime rt(dsa_model(8), options_for(backend, 1), c);
    const ForwardBatch idle = make_idle_batch();
    rt.begin_step(idle);
    HostBuffer q(DType::f32, {0, kHq, kRow}), out(DType::f32, {0, kHq, kRank}),
        iq(DType::f32, {0, kIndexHeads, kIndexDim}), w(DType::f32, {0, kIndexHeads});
    AttnArgs a{.q = q.view(), .k = {}, .v = {}, .out = out.view()};
    a.indexer = {.q = iq.view(), .k = {}, .weights = w.view(), .topk = {}};
    rt.forward(0, a);
    rt.end_step();
  }
}

// ---------------------------------------------------------------------------------------------
// Errors: named values, pools untouched

TEST(DsaErrors, BadIndexerInputsNameTheValueAndLeaveThePoolsUntouched) {
  for (const std::string backend : {"reference", "cpu"}) {
    SCOPED_TRACE(backend);
    Step s = make_step(dsa_model(8), options_for(backend, 1), {Kind::extend, {10}, {6}}, 5);
    const int64_t T = s.batch.num_tokens();
    const Inputs in(T, 5);
    HostBuffer out(DType::f32, {T, kHq, kRank});
    const KVLayerView kv = s.rt->kv_cache().layer(0);
    const IndexKeyView ik = s.rt->kv_cache().index_keys(0);
    const size_t kv_bytes = static_cast<size_t>(kv.num_rows) * kv.k_row_stride * sizeof(float);
    const size_t ik_bytes = static_cast<size_t>(ik.num_rows) * (kIndexDim + 4);
    const std::vector<uint8_t> kv_before(static_cast<uint8_t*>(kv.k), static_cast<uint8_t*>(kv.k) + kv_bytes);
    const std::vector<uint8_t> ik_before(ik.data, ik.data + ik_bytes);
    s.rt->begin_step(s.batch);
    HostBuffer short_w(DType::f32, {T, kIndexHeads - 1});
    AttnArgs a = in.args(out.view(), {});
    a.indexer.weights = short_w.view();
    expect_error([&] { s.rt->forward(0, a); }, {backend, "indexer weights", "[" + std::to_string(T) + ", 4]"});
    a = in.args(out.view(), {});
    a.indexer.q = {};
    expect_error([&] { s.rt->forward(0, a); }, {"indexer q is empty", "index_n_heads"});
    a = in.args(out.view(), {});
    a.indexer.k = {};
    expect_error([&] { s.rt->forward(0, a); }, {"indexer k is empty"});
    HostBuffer bad_topk(DType::i32, {T, 7});
    a = in.args(out.view(), bad_topk.view());
    expect_error([&] { s.rt->forward(0, a); }, {"indexer topk", "int32[" + std::to_string(T) + ", 8]"});
    EXPECT_EQ(std::memcmp(kv.k, kv_before.data(), kv_bytes), 0) << "latent pool changed";
    EXPECT_EQ(std::memcmp(ik.data, ik_before.data(), ik_bytes), 0) << "index-key cache changed";
    s.rt->end_step();
  }
}

TEST(DsaErrors, IndexerInputsOnALayerWithoutAnIndexer) {
  Step s = make_step(dsa_model(8, false), options_for("cpu", 1), {Kind::decode, {4}, {1}}, 2);
  const Inputs in(1, 2);
  HostBuffer out(DType::f32, {1, kHq, kRank});
  s.rt->begin_step(s.batch);
  expect_error([&] { s.rt->forward(0, in.args(out.view(), {})); },
               {"layer 0 has no indexer", "AttnArgs.indexer is set"});
  expect_error([&] { s.rt->kv_cache().index_keys(0); }, {"layer 0 has no indexer"});
  s.rt->end_step();
}

// ---------------------------------------------------------------------------------------------
// Options and routing

CudaDeviceInfo no_gpu() {
  CudaDeviceInfo c;
  c.usable = false;
  c.reason = "no device in this test";
  return c;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

TEST(DsaOptions, AutoSelectionTurnsDsaOnForAModelWithAnIndexerAndSaysSo) {
  const Selection sel = resolve_backends(Options{}, dsa_model(8), Registry::global(), no_gpu());
  EXPECT_TRUE(sel.dsa);
  EXPECT_EQ(sel.prefill, "cpu");
  EXPECT_EQ(sel.decode, "cpu");
  test::expect_contains(joined(sel.reasons), {"dsa: on (auto", "indexer", "index_topk 8"});
  const Selection dense = resolve_backends(Options{}, dsa_model(8, false), Registry::global(), no_gpu());
  EXPECT_FALSE(dense.dsa);
}

TEST(DsaOptions, DsaRouterTakesThePhaseBackendsAndNsaWarns) {
  Options o;
  o.attention_backend = "dsa";
  o.dsa_decode_backend = "reference";
  const Selection sel = resolve_backends(o, dsa_model(8), Registry::global(), no_gpu());
  EXPECT_TRUE(sel.dsa);
  EXPECT_EQ(sel.prefill, "cpu");
  EXPECT_EQ(sel.decode, "reference");
  EXPECT_TRUE(sel.hybrid());
  EXPECT_TRUE(sel.warnings.empty());
  o.attention_backend = "nsa";
  const Selection nsa = resolve_backends(o, dsa_model(8), Registry::global(), no_gpu());
  ASSERT_EQ(nsa.warnings.size(), 1u);
  test::expect_contains(nsa.warnings[0], {"nsa is deprecated", "dsa"});
}

TEST(DsaOptions, ErrorsNameTheOptionAndWhatToUse) {
  Options o;
  o.attention_backend = "dsa";
  expect_error([&] { resolve_backends(o, dsa_model(8, false), Registry::global(), no_gpu()); },
               {"--attention-backend dsa", "has no indexer"});
  o.dsa_prefill_backend = "flashmla_sparse";
  expect_error([&] { resolve_backends(o, dsa_model(8), Registry::global(), no_gpu()); },
               {"--dsa-prefill-backend flashmla_sparse", "reference serving engine", "cpu"});
  o.dsa_prefill_backend = "";
  o.dsa_decode_backend = "flashmla_kv";
  expect_error([&] { resolve_backends(o, dsa_model(8), Registry::global(), no_gpu()); },
               {"--dsa-decode-backend flashmla_kv", "fp8 latent", "cuda on NVIDIA GPUs",
                "usable here: reference or cpu"});
  // The reference engine's DSA kernel name where a whole backend is named.
  Options whole;
  whole.attention_backend = "flashmla_sparse";
  expect_error([&] { resolve_backends(whole, dsa_model(8), Registry::global(), no_gpu()); },
               {"--attention-backend flashmla_sparse", "DSA kernel backend", "--dsa-prefill-backend"});
  Options named;
  named.attention_backend = "cpu";
  named.dsa_decode_backend = "reference";
  expect_error([&] { resolve_backends(named, dsa_model(8), Registry::global(), no_gpu()); },
               {"--dsa-decode-backend reference", "--attention-backend cpu"});
  Options phase;
  phase.prefill_attention_backend = "dsa";
  expect_error([&] { resolve_backends(phase, dsa_model(8), Registry::global(), no_gpu()); },
               {"--prefill-attention-backend dsa", "--attention-backend dsa"});
}

TEST(DsaOptions, ABackendWithoutDsaIsRejectedForADsaModel) {
  Registry r;
  register_builtin_backends(r);
  BackendEntry dense = r.get("cpu");
  dense.name = "dense-only";
  dense.caps.dsa = false;
  r.add(dense);
  Options o;
  o.attention_backend = "dense-only";
  expect_error([&] { resolve_backends(o, dsa_model(8), r, no_gpu()); },
               {"does not support DSA", "layers: 0", "cpu"});
}

}  // namespace
}  // namespace attnrt
