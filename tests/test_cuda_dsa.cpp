// DSA layers on the cuda backend (backends/cuda/cuda_dsa.cpp, kernels/dsa.cu) against the reference
// backend: the selected keys of every query token (AttnArgs::indexer.topk) identical, the outputs
// within the MLA tolerance, in every mode (extend with and without prefix, chunked prefill, mixed,
// decode, chain and tree verify, draft extend), across page edges and the top-k boundary (fewer
// than, exactly, one more than and many more than index_topk candidates), at the small dims of the
// generic kernel and DeepSeek-V3.2's (576 / 512 latent rows on the MLA CTAs, 64 x 128 index heads,
// bf16 and fp8 latent pools), with GPU tensors and host tensors (the conformance harness's host
// pools), prefills scored in several rounds of a small score budget, an IDLE step; the errors of
// bad indexer inputs leave the pools as they were; graphs are off for a DSA model with
// ATTNRT_DSA_GRAPHS=0 (graph steps: tests/test_cuda_dsa_graphs.cpp); `attnrt run` on
// a DSA model checks every step against reference. The tests that score run once with each
// indexer kernel (ATTNRT_DSA_INDEXER: cuda_core, mma; the mma runs take index dims the tensor-core
// kernel serves, 16 x 32 at the small dims). The host plan (plan_dsa) and the explain line are
// checked without a GPU. Fresh random inputs every run (ATTNRT_TEST_SEED replays one).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/dsa.h"
#include "attnrt/backend/registry.h"
#include "attnrt/memory/index_key_cache.h"
#include "attnrt/runtime/attention_runtime.h"
#include "src/model/layer_builders.h"
#include "tests/conformance/conformance.h"
#include "tests/dsa_steps.h"
#include "tests/test_cuda_util.h"
#include "tests/test_sim_util.h"
#include "tests/test_util.h"
#include "tools/sim/driver.h"
#include "tools/sim/report.h"

#ifdef ATTNRT_HAS_CUDA
#include "attnrt/backend/options.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_dsa.h"
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

using test::expect_error;

// One DSA layer's dims.
struct Dims {
  int hq, rank, rope, index_heads, index_dim, topk;
  int row() const { return rank + rope; }
};
// The generic kernel's dims (head dim 80), and DeepSeek-V3.2's at 16 and 64 q heads (the
// keys-on-M and the 64-row MLA CTA).
constexpr Dims kSmall{4, 64, 16, 4, 32, 24};
constexpr Dims kSmallMma{4, 64, 16, 16, 32, 24};  // index heads a multiple of 16: the mma kernel
constexpr Dims kV32Heads16{16, 512, 64, 64, 128, 64};
constexpr Dims kV32Heads64{64, 512, 64, 64, 128, 64};

ModelSpec dsa_model(const Dims& d) {
  LayerSpec l = layer_builders::mla_layer(0, d.hq, d.rank, d.rope);
  l.scaling = 1.f / std::sqrt(static_cast<float>(d.row()));
  l.indexer = {.index_topk = d.topk, .index_n_heads = d.index_heads, .index_head_dim = d.index_dim};
  return test::make_model("cuda-dsa-test", DType::bf16, 8192, {l});
}

Options options_for(const std::string& backend, int page, const std::string& kv_dtype) {
  Options o;
  o.attention_backend = backend;
  o.page_size = page;
  o.num_threads = 2;
  o.kv_cache_dtype = kv_dtype;
  return o;
}

using test::Kind;
using test::StepSpec;

// The pools' contents, drawn once per case and written into both runtimes' pools (the latent rows
// as floats, rounded by each pool's dtype alike; the index keys as the cache's bytes).
struct PoolValues {
  std::vector<float> latent;  // [rows, row]
  std::vector<uint8_t> keys;  // rows * (index_dim + 4), the paged layout
};

PoolValues draw_pools(const KVLayerView& kv, const IndexKeyView& ik, std::mt19937& rng) {
  PoolValues v;
  std::normal_distribution<float> nd(0.f, 1.f);
  v.latent.resize(static_cast<size_t>(kv.num_rows) * kv.head_dim);
  for (float& x : v.latent) x = nd(rng);
  v.keys.assign(static_cast<size_t>(ik.num_rows) * (ik.dim + 4), 0);
  IndexKeyView host = ik;
  host.data = v.keys.data();
  std::vector<float> key(ik.dim);
  for (int64_t slot = 0; slot < ik.num_rows; ++slot) {
    for (float& x : key) x = nd(rng);
    const float scale = quantize_fp8_block(key.data(), ik.dim, host.codes(slot));
    std::memcpy(const_cast<uint8_t*>(host.scale_ptr(slot)), &scale, 4);
  }
  return v;
}

void write_pools(AttentionRuntime& rt, const PoolValues& v) {
  const KVLayerView kv = rt.kv_cache().layer(0);
  const IndexKeyView ik = rt.kv_cache().index_keys(0);
  HostBuffer rows(kv.dtype, {kv.num_rows, kv.k_row_stride});
  std::memset(rows.data(), 0, rows.bytes());
  for (int64_t r = 0; r < kv.num_rows; ++r)
    for (int c = 0; c < kv.head_dim; ++c)
      store_from_float(rows.data(), kv.dtype, r * kv.k_row_stride + c,
                       v.latent[static_cast<size_t>(r) * kv.head_dim + c]);
  ASSERT_EQ(v.latent.size(), static_cast<size_t>(kv.num_rows) * kv.head_dim);
  ASSERT_EQ(v.keys.size(), static_cast<size_t>(ik.num_rows) * (ik.dim + 4));
  if (rt.kv_cache().device().kind == DeviceKind::cuda) {
    ASSERT_EQ(cudaMemcpy(kv.k, rows.data(), rows.bytes(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(ik.data, v.keys.data(), v.keys.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
  } else {
    std::memcpy(kv.k, rows.data(), rows.bytes());
    std::memcpy(ik.data, v.keys.data(), v.keys.size());
  }
}

// A runtime and one step of `spec` on it (the same slots for the same spec: allocation is
// deterministic).
struct Step {
  std::unique_ptr<AttentionRuntime> rt;
  ForwardBatch batch;
};

Step make_step(const ModelSpec& model, const Options& o, const StepSpec& spec) {
  const RuntimeConfig c{.max_requests = 8,
                        .kv_slots = 8192,
                        .max_num_tokens = 4096,
                        .max_context_len = 4096,
                        .cuda_graphs = false};
  Step s;
  s.rt = std::make_unique<AttentionRuntime>(model, o, c);
  s.batch = test::dsa_step_batch(*s.rt, spec);
  return s;
}

// Fresh random inputs of one DSA call over T tokens (bf16 q / latent rows, fp32 indexer inputs).
struct Inputs {
  HostBuffer q, latent, iq, ik, w;
  Inputs(const Dims& d, int64_t T, std::mt19937& rng)
      : q(DType::bf16, {T, d.hq, d.row()}),
        latent(DType::bf16, {T, 1, d.row()}),
        iq(DType::f32, {T, d.index_heads, d.index_dim}),
        ik(DType::f32, {T, d.index_dim}),
        w(DType::f32, {T, d.index_heads}) {
    for (const HostBuffer* b : {&q, &latent, &iq, &ik, &w}) test::fill_normal(b->view(), rng);
  }
};

struct Result {
  HostBuffer out, topk;
};

// One step of `spec` on `backend`: pools from `pools`, inputs `in`; GPU tensors when on_gpu.
Result run(const Dims& d, const Options& o, const StepSpec& spec, const PoolValues* pools,
           const Inputs& in, bool on_gpu, PoolValues* drawn = nullptr, uint32_t seed = 0) {
  Step s = make_step(dsa_model(d), o, spec);
  if (pools == nullptr) {
    std::mt19937 rng(seed + 1);
    *drawn = draw_pools(s.rt->kv_cache().layer(0), s.rt->kv_cache().index_keys(0), rng);
    pools = drawn;
  }
  write_pools(*s.rt, *pools);
  const int64_t T = s.batch.num_tokens();
  Result r{HostBuffer(DType::bf16, {T, d.hq, d.rank}), HostBuffer(DType::i32, {T, d.topk})};
  test::poison(r.out.view());
  std::fill_n(r.topk.ptr<int32_t>(), r.topk.numel(), -7);
  s.rt->begin_step(s.batch);
  if (on_gpu) {
    test::DevTensor q(in.q.view()), lat(in.latent.view()), iq(in.iq.view()), ik(in.ik.view()),
        w(in.w.view()), out(r.out.view()), topk(r.topk.view());
    AttnArgs a{.q = q.view, .k = lat.view, .v = {}, .out = out.view};
    a.indexer = {.q = iq.view, .k = ik.view, .weights = w.view, .topk = topk.view};
    s.rt->forward(0, a);
    out.download(r.out.view());
    topk.download(r.topk.view());
  } else {
    AttnArgs a{.q = in.q.view(), .k = in.latent.view(), .v = {}, .out = r.out.view()};
    a.indexer = {
        .q = in.iq.view(), .k = in.ik.view(), .weights = in.w.view(), .topk = r.topk.view()};
    s.rt->forward(0, a);
  }
  s.rt->end_step();
  return r;
}

// Selections equal token by token (named: token, position, both values), outputs within the
// bf16 MLA tolerance (named: token, head, column, both values).
void expect_same(const Result& got, const Result& want, const Dims& d) {
  const int64_t T = want.topk.view().shape[0];
  int reported = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* a = got.topk.ptr<int32_t>() + t * d.topk;
    const int32_t* b = want.topk.ptr<int32_t>() + t * d.topk;
    for (int k = 0; k < d.topk; ++k) {
      if (a[k] != b[k] && reported++ < 8) {
        ADD_FAILURE() << "token " << t << ": selected key " << k << " is token index " << a[k]
                      << " on cuda, " << b[k] << " on reference";
        break;
      }
    }
  }
  const conformance::Tolerance tol = conformance::tolerance_for(DType::bf16);
  int bad = 0;
  const int64_t n = want.out.numel();
  for (int64_t i = 0; i < n; ++i) {
    const double x = load_as_float(got.out.data(), DType::bf16, i);
    const double y = load_as_float(want.out.data(), DType::bf16, i);
    if (!(std::fabs(x - y) <= tol.abs + tol.rel * std::fabs(y)) && bad++ < 8) {
      const int64_t col = i % d.rank, head = (i / d.rank) % d.hq,
                    tok = i / (int64_t{d.rank} * d.hq);
      ADD_FAILURE() << "out[token " << tok << ", head " << head << ", column " << col << "] = " << x
                    << " on cuda, " << y << " on reference";
    }
  }
  EXPECT_EQ(bad, 0) << "output elements past the tolerance (abs " << tol.abs << ", rel " << tol.rel
                    << ")";
}

// cuda (GPU or host tensors) against reference on the same pools and inputs.
void expect_matches_reference(const Dims& d, int page, const std::string& kv_dtype,
                              const StepSpec& spec, bool on_gpu = true) {
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "page " << page << " kv " << kv_dtype << " hq " << d.hq
                                  << " topk " << d.topk << (on_gpu ? " GPU" : " host")
                                  << " tensors, seed " << seed);
  PoolValues pools;
  int64_t T = 0;
  for (int32_t f : spec.fresh) T += f;
  std::mt19937 rng(seed);
  const Inputs in(d, T, rng);
  const Result want =
      run(d, options_for("reference", page, kv_dtype), spec, nullptr, in, false, &pools, seed);
  const Result got = run(d, options_for("cuda", page, kv_dtype), spec, &pools, in, on_gpu);
  expect_same(got, want, d);
}

using test::kModes;
using test::ModeCase;

// The tests that score, once with each indexer kernel (the choice restored after each test).
class CudaDsaIndexer : public testing::TestWithParam<cuda::DsaIndexer> {
 protected:
  void SetUp() override {
    before_ = cuda::dsa_indexer();
    cuda::set_dsa_indexer(GetParam());
  }
  void TearDown() override { cuda::set_dsa_indexer(before_); }
  // The small dims the kernel under test serves.
  static Dims small() { return GetParam() == cuda::DsaIndexer::mma ? kSmallMma : kSmall; }

 private:
  cuda::DsaIndexer before_ = cuda::DsaIndexer::cuda_core;
};

std::string indexer_name(const testing::TestParamInfo<cuda::DsaIndexer>& i) {
  return i.param == cuda::DsaIndexer::mma ? "mma" : "cuda_core";
}

INSTANTIATE_TEST_SUITE_P(Kernels, CudaDsaIndexer,
                         testing::Values(cuda::DsaIndexer::cuda_core, cuda::DsaIndexer::mma),
                         indexer_name);

TEST_P(CudaDsaIndexer, SelectsTheReferenceKeysAndMatchesItsOutputInEveryMode) {
  SKIP_WITHOUT_GPU();
  for (int page : {1, 16, 64}) {
    for (const ModeCase& m : kModes) {
      SCOPED_TRACE(m.name);
      expect_matches_reference(small(), page, "auto", m.spec);
    }
  }
}

TEST_P(CudaDsaIndexer, HostTensorsAndFp8LatentPoolMatchTheReference) {
  SKIP_WITHOUT_GPU();
  for (const ModeCase& m : kModes) {
    SCOPED_TRACE(m.name);
    expect_matches_reference(small(), 16, "auto", m.spec, /*on_gpu=*/false);
    expect_matches_reference(small(), 16, "fp8_e4m3", m.spec);
  }
}

// Candidates around index_topk (16): fewer, exactly, one more, many more; lengths across page
// edges (page 16: 15, 16, 17, 33, 700 keys).
TEST_P(CudaDsaIndexer, TopkBoundaryAndPageEdges) {
  SKIP_WITHOUT_GPU();
  Dims d = small();
  d.topk = 16;
  for (int page : {1, 16}) {
    for (int seq : {1, 15, 16, 17, 33, 700}) {
      SCOPED_TRACE(testing::Message() << "decode of " << seq << " keys");
      expect_matches_reference(d, page, "auto", {Kind::decode, {seq - 1}, {1}});
    }
    // One prefill whose tokens cross the boundary one after the other.
    expect_matches_reference(d, page, "auto", {Kind::extend, {0}, {40}});
    expect_matches_reference(d, page, "auto", {Kind::extend, {14}, {5}});
  }
}

// DeepSeek-V3.2's shapes on the MLA CTAs: bf16 and fp8 latent pools, selections real (64 of up to
// ~1000 keys) and with index_topk 2048 over longer contexts (split-KV over the selected keys).
TEST_P(CudaDsaIndexer, DeepSeekV32ShapesOnTheMlaCtas) {
  SKIP_WITHOUT_GPU();
  for (const Dims& d : {kV32Heads16, kV32Heads64}) {
    for (const char* kv : {"auto", "fp8_e4m3"}) {
      expect_matches_reference(d, 64, kv, {Kind::decode, {5, 63, 64, 900}, {1, 1, 1, 1}});
      expect_matches_reference(d, 64, kv, {Kind::extend, {100, 0}, {30, 70}});
      expect_matches_reference(d, 64, kv, {Kind::verify_chain, {300, 61}, {4, 4}});
    }
  }
  Dims big = kV32Heads16;
  big.topk = 2048;
  expect_matches_reference(big, 64, "auto", {Kind::decode, {2047, 2048, 3500}, {1, 1, 1}});
  expect_matches_reference(big, 64, "fp8_e4m3", {Kind::decode, {3000}, {1}});
}

// A prefill whose scores exceed the score budget (ATTNRT_DSA_SCORE_BUDGET, read at construction):
// scored and selected in several rounds, the same selection.
TEST_P(CudaDsaIndexer, PrefillInScoreRoundsSelectsTheSameKeys) {
  SKIP_WITHOUT_GPU();
  ASSERT_EQ(setenv("ATTNRT_DSA_SCORE_BUDGET", "300", 1), 0);
  Dims d = small();
  d.topk = 16;
  expect_matches_reference(d, 16, "auto", {Kind::extend, {50, 0}, {60, 90}});
  unsetenv("ATTNRT_DSA_SCORE_BUDGET");
}

// The conformance harness's random DSA cases (its host pools, host tensors, any mode). Its index
// dims (1, 4 or 8 heads) are outside the mma kernel's, so the CUDA-core kernel scores them either
// way.
TEST(CudaDsa, ConformanceCasesMatchTheReference) {
  SKIP_WITHOUT_GPU();
  const BackendEntry* entry = Registry::global().find("cuda");
  ASSERT_NE(entry, nullptr);
  ASSERT_TRUE(entry->caps.dsa);
  const uint32_t seed = test::test_seed();
  for (int i = 0; i < 24; ++i) {
    const conformance::ConformanceCase c =
        conformance::generate_case(conformance::Feature::dsa, seed + i, entry->caps);
    const conformance::CaseResult r = conformance::run_case(*entry, c);
    EXPECT_TRUE(r.ok) << r.detail;
  }
}

TEST(CudaDsa, BadIndexerInputsNameTheTensorAndLeaveThePoolsUntouched) {
  SKIP_WITHOUT_GPU();
  const Dims d = kSmall;
  Step s = make_step(dsa_model(d), options_for("cuda", 16, "auto"), {Kind::extend, {10}, {6}});
  std::mt19937 rng(3);
  const PoolValues pools =
      draw_pools(s.rt->kv_cache().layer(0), s.rt->kv_cache().index_keys(0), rng);
  write_pools(*s.rt, pools);
  const int64_t T = s.batch.num_tokens();
  const Inputs in(d, T, rng);
  const KVLayerView kv = s.rt->kv_cache().layer(0);
  const IndexKeyView ik = s.rt->kv_cache().index_keys(0);
  auto download = [&] {
    const size_t kb = static_cast<size_t>(kv.num_rows) * kv.k_row_stride * dtype_size(kv.dtype);
    const size_t ib = static_cast<size_t>(ik.num_rows) * (ik.dim + 4);
    std::vector<uint8_t> b(kb + ib);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(b.data(), kv.k, kb, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(b.data() + kb, ik.data, ib, cudaMemcpyDeviceToHost), cudaSuccess);
    return b;
  };
  const std::vector<uint8_t> before = download();
  test::DevTensor q(in.q.view()), lat(in.latent.view()), iq(in.iq.view()), ik_in(in.ik.view()),
      w(in.w.view());
  HostBuffer out_h(DType::bf16, {T, d.hq, d.rank});
  test::DevTensor out(out_h.view());
  HostBuffer short_w_h(DType::f32, {T, d.index_heads - 1}), bad_topk_h(DType::i32, {T, 7});
  test::DevTensor short_w(short_w_h.view()), bad_topk(bad_topk_h.view());
  auto args = [&] {
    AttnArgs a{.q = q.view, .k = lat.view, .v = {}, .out = out.view};
    a.indexer = {.q = iq.view, .k = ik_in.view, .weights = w.view, .topk = {}};
    return a;
  };
  s.rt->begin_step(s.batch);
  AttnArgs a = args();
  a.indexer.weights = short_w.view;
  expect_error([&] { s.rt->forward(0, a); },
               {"cuda backend", "indexer weights", "[" + std::to_string(T) + ", 4]"});
  a = args();
  a.indexer.q = {};
  expect_error([&] { s.rt->forward(0, a); }, {"indexer q is empty", "index_n_heads"});
  a = args();
  a.indexer.k = {};
  expect_error([&] { s.rt->forward(0, a); }, {"indexer k is empty"});
  a = args();
  a.indexer.q = in.iq.view();  // host memory while q is on the GPU
  expect_error([&] { s.rt->forward(0, a); }, {"indexer q", "in GPU memory"});
  a = args();
  a.indexer.topk = bad_topk.view;
  expect_error([&] { s.rt->forward(0, a); },
               {"indexer topk", "int32[" + std::to_string(T) + ", 24]"});
  EXPECT_TRUE(download() == before) << "a rejected call changed the latent pool or index keys";
  s.rt->end_step();
}

TEST(CudaDsa, IdleStepDoesNothing) {
  SKIP_WITHOUT_GPU();
  const Dims d = kSmall;
  RuntimeConfig c;
  c.kv_slots = 256;
  c.cuda_graphs = false;
  AttentionRuntime rt(dsa_model(d), options_for("cuda", 16, "auto"), c);
  const ForwardBatch idle = make_idle_batch();
  rt.begin_step(idle);
  HostBuffer q(DType::bf16, {0, d.hq, d.row()}), out(DType::bf16, {0, d.hq, d.rank}),
      iq(DType::f32, {0, d.index_heads, d.index_dim}), w(DType::f32, {0, d.index_heads});
  AttnArgs a{.q = q.view(), .k = {}, .v = {}, .out = out.view()};
  a.indexer = {.q = iq.view(), .k = {}, .weights = w.view(), .topk = {}};
  rt.forward(0, a);
  rt.end_step();
}

// With ATTNRT_DSA_GRAPHS=0 (set_dsa_graphs(false)) a DSA model's steps stay eager and the reason
// names the switch; by default the model's steps are captured (tests/test_cuda_dsa_graphs.cpp).
TEST(CudaDsa, GraphsAreOffForADsaModelWithTheReason) {
  SKIP_WITHOUT_GPU();
  RuntimeConfig c;
  c.kv_slots = 1024;
  c.cuda_graphs = true;
  const bool before = dsa_graphs_enabled();
  set_dsa_graphs(false);
  {
    AttentionRuntime rt(dsa_model(kSmall), options_for("cuda", 16, "auto"), c);
    EXPECT_FALSE(rt.cuda_graphs_enabled());
    EXPECT_NE(rt.cuda_graphs_off_reason().find("DSA"), std::string::npos)
        << rt.cuda_graphs_off_reason();
    EXPECT_NE(rt.cuda_graphs_off_reason().find("ATTNRT_DSA_GRAPHS=0"), std::string::npos)
        << rt.cuda_graphs_off_reason();
  }
  set_dsa_graphs(true);
  {
    AttentionRuntime rt(dsa_model(kSmall), options_for("cuda", 16, "auto"), c);
    EXPECT_TRUE(rt.cuda_graphs_enabled()) << rt.cuda_graphs_off_reason();
    EXPECT_TRUE(rt.cuda_graphs_off_reason().empty()) << rt.cuda_graphs_off_reason();
  }
  set_dsa_graphs(before);
}

// `attnrt run`'s driver on a DSA model on cuda (GPU pools): every step of every mode, chain and
// tree verify and draft extends included, checked against reference on the host copy of the pools
// (latent rows and index keys downloaded), eager (DSA graphs turned off here; the graph run is in
// tests/test_cuda_dsa_graphs.cpp).
class CudaDsaRun : public CudaDsaIndexer {
 protected:
  void SetUp() override {
    CudaDsaIndexer::SetUp();
    graphs_before_ = dsa_graphs_enabled();
    set_dsa_graphs(false);
  }
  void TearDown() override {
    set_dsa_graphs(graphs_before_);
    CudaDsaIndexer::TearDown();
  }

 private:
  bool graphs_before_ = true;
};
INSTANTIATE_TEST_SUITE_P(Kernels, CudaDsaRun,
                         testing::Values(cuda::DsaIndexer::cuda_core, cuda::DsaIndexer::mma),
                         indexer_name);

TEST_P(CudaDsaRun, EveryStepMatchesReferenceOnTheHostCopyOfTheGpuPools) {
  SKIP_WITHOUT_GPU();
  Dims d = small();
  d.topk = 16;
  for (int topk : {1, 3}) {
    SCOPED_TRACE(testing::Message() << "eagle topk " << topk);
    Options o = test::speculative_options("cuda", topk);
    o.page_size = 16;
    const sim::RunReport r = sim::run_trace(dsa_model(d), o, test::four_request_trace("dsa-run"),
                                            test::small_run_config(2048, 1, 17));
    EXPECT_TRUE(r.ok()) << sim::format_report(r);
    for (const sim::ModeStats& m : r.modes) {
      SCOPED_TRACE(forward_mode_name(m.mode));
      EXPECT_EQ(m.backend, "cuda");
      // (IDLE steps have no tokens to check.)
      if (m.mode != ForwardMode::IDLE) EXPECT_EQ(m.checked_steps, m.steps);
      EXPECT_EQ(m.graph_steps, 0);
    }
    EXPECT_NE(test::find_mode(r, sim::ModelRole::target, ForwardMode::TARGET_VERIFY), nullptr);
  }
}

// A TARGET_VERIFY tree of one request on 20 cached tokens: 0 the root, 1 and 2 its children, 3 a
// child of 1 (write slots all 1: the planner does not read them).
ForwardBatch tree_verify_of_four() {
  SpecInfo info;
  info.draft_token_num = 4;
  info.topk = 2;
  info.parents = {-1, 0, 0, 1};
  ForwardBatch v = make_verify_batch({0}, {20}, info);
  v.out_cache_loc.assign(4, 1);
  return v;
}

// Appends the graph planner's padding request (a prefix of `prefix` keys, `qlen` query tokens) to
// a step layout, as a padded bucket has it.
void pad_request(StepLayout& lay, int32_t prefix, int32_t qlen) {
  lay.prefix_lens.push_back(prefix);
  lay.query_lens.push_back(qlen);
  lay.query_start.push_back(lay.query_start.back() + qlen);
  lay.num_tokens += qlen;
}

// Round r of a DSA plan: its rows [row0, row1) and scored rows [scored0, scored1) (-1: not
// checked).
void expect_round(const cuda::DsaHostPlan& p, size_t r, std::array<int64_t, 4> want) {
  ASSERT_LT(r, p.rounds.size());
  const auto& got = p.rounds[r];
  EXPECT_EQ(got.row0, want[0]) << "round " << r;
  EXPECT_EQ(got.row1, want[1]) << "round " << r;
  EXPECT_EQ(got.scored0, want[2]) << "round " << r;
  if (want[3] >= 0) EXPECT_EQ(got.scored1, want[3]) << "round " << r;
}

// Host only: `attnrt info --explain` gives a DSA layer one line for every mode (one-query requests
// over the selected keys), on the CTA the sparse MLA launches take.
TEST(CudaDsaPlan, ExplainNamesTheIndexerAndTheOneQueryCta) {
  Options o;
  o.speculative_num_steps = 3;
  const ModelSpec m = apply_tensor_parallel(model_preset("deepseek-v3.2"), 8);
  const std::vector<std::string> lines = cuda::explain_cuda_kernels(m, o, DType::bf16);
  ASSERT_EQ(lines.size(), 2u) << ::testing::PrintToString(lines);
  EXPECT_NE(lines[1].find("dsa     every mode: the indexer"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("radix top-2048"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("keys-on-M"), std::string::npos) << lines[1];
  // The indexer kernel the switch picks (V3.2's 64 x 128 index dims: the tensor-core one).
  const cuda::DsaIndexer before = cuda::dsa_indexer();
  cuda::set_dsa_indexer(cuda::DsaIndexer::cuda_core);
  EXPECT_NE(cuda::explain_cuda_kernels(m, o, DType::bf16)[1].find(
                "scores on CUDA cores [ATTNRT_DSA_INDEXER=cuda_core]"),
            std::string::npos);
  cuda::set_dsa_indexer(cuda::DsaIndexer::mma);
  EXPECT_NE(cuda::explain_cuda_kernels(m, o, DType::bf16)[1].find(
                "scores on tensor cores, a radix"),
            std::string::npos);
  cuda::set_dsa_indexer(before);
}

// Host only: the plan of a step. Candidates per mode (tree: prefix + depth + 1), scores only past
// index_topk, every token a one-query request over min(topk, |C(t)|) keys at page-table row t.
TEST(CudaDsaPlan, CandidatesScoresAndPseudoRequests) {
  ForwardBatch b = make_extend_batch({0, 1}, {3, 10}, {4, 2});
  b.out_cache_loc.assign(6, 1);
  const StepLayout lay = make_step_layout(b);
  const cuda::DsaShape shape{.topk = 8, .q_heads = 16, .head_dim = 576, .sm_count = 132};
  cuda::DsaHostPlan p;
  cuda::plan_dsa(b, lay, false, shape, p);
  const std::vector<int32_t> cand{4, 5, 6, 7, 11, 12};
  ASSERT_EQ(p.tokens.size(), cand.size());
  int64_t off = 0;
  for (size_t t = 0; t < cand.size(); ++t) {
    SCOPED_TRACE(t);
    EXPECT_EQ(p.tokens[t].num_cand, cand[t]);
    EXPECT_EQ(p.tokens[t].score_off, cand[t] > 8 ? off : -1);
    if (cand[t] > 8) off += cand[t];
    EXPECT_EQ(p.reqs[t].qo_start, static_cast<int32_t>(t));
    EXPECT_EQ(p.reqs[t].qlen, 1);
    EXPECT_EQ(p.reqs[t].kv_len, std::min(cand[t], 8));
    EXPECT_EQ(p.reqs[t].prefix, p.reqs[t].kv_len - 1);
    EXPECT_EQ(p.reqs[t].pt_start, static_cast<int32_t>(t * 8));
  }
  EXPECT_EQ(p.num_scores, off);
  EXPECT_EQ(p.scored, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(p.max_cand, 12);
  ASSERT_EQ(p.rounds.size(), 1u);
  EXPECT_EQ(p.rounds[0].row0, 0);
  EXPECT_EQ(p.rounds[0].row1, 6);
  // A budget of 20 scores: the two scored tokens (11 and 12 candidates) in rounds of their own,
  // each round's offsets from its own start.
  cuda::DsaShape tight = shape;
  tight.score_budget = 20;
  cuda::plan_dsa(b, lay, false, tight, p);
  ASSERT_EQ(p.rounds.size(), 2u);
  expect_round(p, 0, {0, 5, 0, 1});
  expect_round(p, 1, {5, 6, 1, 2});
  EXPECT_EQ(p.rounds[1].max_cand, 12);
  EXPECT_EQ(p.tokens[4].score_off, 0);
  EXPECT_EQ(p.tokens[5].score_off, 0);
  EXPECT_EQ(p.num_scores, 12);
  // A tree: 0 root, 1 and 2 its children, 3 child of 1: candidates prefix + depth + 1.
  ForwardBatch v = tree_verify_of_four();
  cuda::plan_dsa(v, make_step_layout(v), true, shape, p);
  const std::vector<int32_t> tree_cand{21, 22, 22, 23};
  for (size_t t = 0; t < tree_cand.size(); ++t) EXPECT_EQ(p.tokens[t].num_cand, tree_cand[t]) << t;
  // Few items: the selected keys are split; splits and partial rows consistent with the items.
  ForwardBatch dec = make_decode_batch({0}, {5000});
  dec.out_cache_loc.assign(1, 1);
  cuda::DsaShape wide = shape;
  wide.topk = 2048;
  cuda::plan_dsa(dec, make_step_layout(dec), false, wide, p);
  EXPECT_EQ(p.reqs[0].kv_len, 2048);
  EXPECT_GT(p.reqs[0].num_splits, 1);
  EXPECT_EQ(p.part_rows, p.reqs[0].num_splits);
  EXPECT_EQ(p.work.size(), static_cast<size_t>(p.reqs[0].num_splits));
}

// Host only: a graph step's plan (docs/cuda_graphs.md "DSA layers"). Rounds cut every
// graph_round_tokens rows whatever the lengths, each round's scored rows from its first row on and
// its count in round_scored, every token graph_items work items (its split count); padded
// requests (past batch_size) are chains of their own prefix.
TEST(CudaDsaPlan, GraphPlansHaveFixedRoundsAndItems) {
  ForwardBatch b = make_decode_batch({0, 1, 2}, {30, 5, 50});
  b.out_cache_loc.assign(3, 1);
  StepLayout lay = make_step_layout(b);
  pad_request(lay, 0, 1);  // the planner's padded decode request: one key
  cuda::DsaShape shape{.topk = 8, .q_heads = 16, .head_dim = 576, .sm_count = 132};
  shape.graph_round_tokens = 2;
  shape.graph_items = 3;
  cuda::DsaHostPlan p;
  cuda::plan_dsa(b, lay, false, shape, p);
  ASSERT_EQ(p.rounds.size(), 2u);
  expect_round(p, 0, {0, 2, 0, -1});
  expect_round(p, 1, {2, 4, 2, -1});
  EXPECT_EQ(p.round_scored, (std::vector<int32_t>{1, 1}));
  ASSERT_EQ(p.scored.size(), 4u);
  EXPECT_EQ(p.scored[0], 0);
  EXPECT_EQ(p.scored[2], 2);
  EXPECT_EQ(p.tokens[0].score_off, 0);
  EXPECT_EQ(p.tokens[1].score_off, -1);
  EXPECT_EQ(p.tokens[2].score_off, 0);
  EXPECT_EQ(p.tokens[3].num_cand, 1);
  EXPECT_EQ(p.max_splits, 3);
  EXPECT_EQ(p.part_rows, 12);
  ASSERT_EQ(p.work.size() % 12, 0u);
  for (int t = 0; t < 4; ++t) {
    SCOPED_TRACE(t);
    EXPECT_EQ(p.reqs[t].num_splits, 3);
    EXPECT_EQ(p.reqs[t].part_start, 3 * t);
    EXPECT_EQ(p.reqs[t].kv_len, std::min(p.tokens[t].num_cand, 8));
  }
  // No scored token: the rounds are still the bucket's, with zero counts.
  ForwardBatch few = make_decode_batch({0, 1, 2}, {3, 5, 8});
  few.out_cache_loc.assign(3, 1);
  StepLayout few_lay = make_step_layout(few);
  pad_request(few_lay, 0, 1);
  cuda::plan_dsa(few, few_lay, false, shape, p);
  EXPECT_EQ(p.rounds.size(), 2u);
  EXPECT_EQ(p.round_scored, (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(p.work.size() % 12, 0u);
  // Deterministic: each token's own split count, graph_items items each (the rest empty).
  cuda::DsaShape det = shape;
  det.deterministic = true;
  det.topk = 2048;
  det.graph_items = cuda::deterministic_splits(2048);
  ForwardBatch longer = make_decode_batch({0}, {900});
  longer.out_cache_loc.assign(1, 1);
  StepLayout one = make_step_layout(longer);
  cuda::plan_dsa(longer, one, false, det, p);
  EXPECT_EQ(p.reqs[0].num_splits, cuda::deterministic_splits(900));
  EXPECT_LT(p.reqs[0].num_splits, det.graph_items);
  EXPECT_EQ(p.part_rows, det.graph_items);
  // A tree verify of one request padded by a second: the padded drafts are a chain on a prefix of
  // one key (the planner's fill request), the real ones follow their parents.
  ForwardBatch v = tree_verify_of_four();
  StepLayout vl = make_step_layout(v);
  pad_request(vl, 1, 4);
  cuda::DsaShape vs = shape;
  vs.graph_round_tokens = 8;
  cuda::plan_dsa(v, vl, true, vs, p);
  const std::vector<int32_t> cand{21, 22, 22, 23, 2, 3, 4, 5};
  for (size_t t = 0; t < cand.size(); ++t) EXPECT_EQ(p.tokens[t].num_cand, cand[t]) << t;
}

// Host only: the graph buffers' sizes for DeepSeek-V3.2 (index_topk 2048, 128 q heads of 576,
// 163840 tokens of context): the scores of a decode bucket of 256 in one round (160 MiB), a verify
// bucket of 256 x 4 tokens capped by the 2^26-score budget (409 tokens a round, 255.6 MiB); no
// scores where no request can pass index_topk.
TEST(CudaDsaPlan, GraphScoresBufferIsBoundedByTheScoreBudget) {
  const cuda::DsaShape v32{.topk = 2048, .q_heads = 128, .head_dim = 576, .sm_count = 132};
  const cuda::DsaGraphSizes decode = cuda::dsa_graph_sizes(v32, 256, 163840);
  EXPECT_EQ(decode.round_tokens, 256);
  EXPECT_EQ(decode.scores * 4, int64_t{160} << 20);
  EXPECT_EQ(decode.items, 1);
  const cuda::DsaGraphSizes verify = cuda::dsa_graph_sizes(v32, 1024, 163840);
  EXPECT_EQ(verify.round_tokens, 409);
  EXPECT_EQ(verify.scores, int64_t{409} * 163840);
  EXPECT_LE(verify.scores, v32.score_budget);
  const cuda::DsaGraphSizes one = cuda::dsa_graph_sizes(v32, 1, 163840);
  EXPECT_EQ(one.round_tokens, 1);
  EXPECT_GT(one.items, 1);
  EXPECT_LE(one.items, 8);  // never below 256 keys a split
  EXPECT_EQ(cuda::dsa_graph_sizes(v32, 256, 2048).scores, 0);
}

#endif  // ATTNRT_HAS_CUDA

}  // namespace
}  // namespace attnrt
