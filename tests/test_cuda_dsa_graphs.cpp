// CUDA graphs of DSA layers (docs/cuda_graphs.md "DSA layers"; ATTNRT_DSA_GRAPHS=1, set here with
// set_dsa_graphs): a two-layer DSA model (small MLA dims at index_topk 16, and DeepSeek-V3.2's
// dims at index_topk 64) whose DECODE and TARGET_VERIFY (chain and tree) steps are captured at one
// set of lengths and replayed at others, padded to their bucket or filling it, with a score budget
// of three tokens of max_context_len so that a step scores in several rounds. Every replay is
// compared with the same step run eagerly on the runtime (the selected token indices equal, the
// outputs within the bf16 tolerance) and with reference over a host copy of the pools (selections
// equal, outputs within tolerance); padded requests leave the real requests' rows and the pools'
// other slots unchanged; `attnrt run` on a DSA model with graphs checks every step against
// reference. Each test runs once with each indexer kernel (ATTNRT_DSA_INDEXER: cuda_core, mma). GPU
// tests: skipped with the reason elsewhere. Fresh random inputs every run (ATTNRT_TEST_SEED replays
// one); outputs and selections are poisoned before every run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/dsa.h"
#include "attnrt/backend/options.h"
#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/index_key_cache.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/runtime/attention_runtime.h"
#include "src/model/layer_builders.h"
#include "tests/conformance/conformance.h"
#include "tests/test_cuda_util.h"
#include "tests/test_sim_util.h"
#include "tests/test_util.h"
#include "tools/sim/driver.h"
#include "tools/sim/report.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/kernels/dsa.h"
#include "backends/reference/reference_backend.h"
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

// One DSA layer's dims: the generic kernel's (head dim 80) with index dims both indexer kernels
// take, and DeepSeek-V3.2's at 16 q heads (576 / 512 latent rows on the keys-on-M MLA CTA, 64 x
// 128 index heads), both at a small index_topk so that the selection is real.
struct Dims {
  int hq, rank, rope, index_heads, index_dim, topk;
  int row() const { return rank + rope; }
};
constexpr Dims kSmall{4, 64, 16, 16, 32, 16};
constexpr Dims kV32{16, 512, 64, 64, 128, 64};
constexpr int kContext = 4096;

LayerSpec dsa_layer(int id, const Dims& d) {
  LayerSpec l = layer_builders::mla_layer(id, d.hq, d.rank, d.rope);
  l.scaling = 1.f / std::sqrt(static_cast<float>(d.row()));
  l.indexer = {.index_topk = d.topk, .index_n_heads = d.index_heads, .index_head_dim = d.index_dim};
  return l;
}

// One layer's inputs of a step, drawn at random: latent q / rows, index q / k / weights.
struct LayerIn {
  HostBuffer q, latent, iq, ik, w;
};
LayerIn draw_inputs(const Dims& d, int64_t T, std::mt19937& rng) {
  LayerIn x{HostBuffer(DType::bf16, {T, d.hq, d.row()}), HostBuffer(DType::bf16, {T, 1, d.row()}),
            HostBuffer(DType::bf16, {T, d.index_heads, d.index_dim}),
            HostBuffer(DType::bf16, {T, d.index_dim}), HostBuffer(DType::bf16, {T, d.index_heads})};
  for (const HostBuffer* b : {&x.q, &x.latent, &x.iq, &x.ik, &x.w})
    test::fill_normal(b->view(), rng);
  return x;
}

// One layer's results: its output [T, Hq, rank] and its selection [T, topk].
struct LayerOut {
  HostBuffer out, topk;
  LayerOut(const Dims& d, int64_t T)
      : out(DType::bf16, {T, d.hq, d.rank}), topk(DType::i32, {T, d.topk}) {
    test::poison(out.view());
    std::fill_n(topk.ptr<int32_t>(), topk.numel(), -7);
  }
};

// The switch on (and the indexer kernel of the parameter) for the test, restored after it.
class CudaDsaGraphs : public testing::TestWithParam<cuda::DsaIndexer> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    graphs_before_ = dsa_graphs_enabled();
    indexer_before_ = cuda::dsa_indexer();
    set_dsa_graphs(true);
    cuda::set_dsa_indexer(GetParam());
    restore_ = true;
  }
  void TearDown() override {
    if (!restore_) return;
    set_dsa_graphs(graphs_before_);
    cuda::set_dsa_indexer(indexer_before_);
  }

  // A runtime of two DSA layers on GPU pools (page `page`; speculative with `draft_tokens` drafts
  // of EAGLE topk `topk` when spec_steps > 0), a score budget of three tokens of max_context_len,
  // four request rows of 3900 slots, and random latent rows and index keys in the pools.
  void build(int page, int spec_steps, int topk, int draft_tokens, const Dims& d = kSmall) {
    d_ = d;
    model_ = test::make_model("dsa-graph-gpu", DType::bf16, kContext,
                              {dsa_layer(0, d), dsa_layer(1, d)});
    Options o = test::cuda_graph_options(page, spec_steps, topk, draft_tokens);
    options_ = o;
    RuntimeConfig rc;
    rc.max_requests = 8;
    rc.kv_slots = 8 * kContext;
    rc.max_num_tokens = 256;
    ASSERT_EQ(setenv("ATTNRT_DSA_SCORE_BUDGET", std::to_string(3 * kContext).c_str(), 1), 0);
    rt_ = std::make_unique<AttentionRuntime>(model_, o, rc);
    unsetenv("ATTNRT_DSA_SCORE_BUDGET");
    ASSERT_TRUE(rt_->cuda_graphs_enabled()) << rt_->cuda_graphs_off_reason();
    EXPECT_EQ(rt_->cuda_graph_batch_sizes(), (std::vector<int>{1, 2, 4, 8}));
    cache_ = dynamic_cast<cuda::CudaKVCache*>(&rt_->kv_cache());
    ASSERT_NE(cache_, nullptr);
    rows_.clear();
    slots_.clear();
    for (int i = 0; i < 4; ++i) {
      const int row = rt_->req_to_token().alloc();
      const std::vector<int32_t> zero{0}, len{3900};
      const std::vector<int64_t> none{-1};
      slots_.push_back(rt_->allocator().alloc_extend(zero, len, none));
      rt_->req_to_token().write(row, 0, slots_.back());
      rows_.push_back(row);
    }
    std::normal_distribution<float> nd(0.f, 1.f);
    for (const LayerSpec& l : model_.layers) {
      const KVLayerView v = rt_->kv_cache().layer(l.layer_id);
      HostBuffer k(v.dtype, {v.num_rows * v.k_row_stride});
      test::fill_normal(k.view(), rng_);
      cache_->copy_layer_from_host(l.layer_id, k.data(), nullptr);
      const IndexKeyView ik = rt_->kv_cache().index_keys(l.layer_id);
      std::vector<uint8_t> bytes(static_cast<size_t>(ik.num_rows) * (ik.dim + 4), 0);
      IndexKeyView host = ik;
      host.data = bytes.data();
      std::vector<float> key(ik.dim);
      for (int64_t slot = 0; slot < ik.num_rows; ++slot) {
        for (float& x : key) x = nd(rng_);
        const float scale = quantize_fp8_block(key.data(), ik.dim, host.codes(slot));
        std::memcpy(const_cast<uint8_t*>(host.scale_ptr(slot)), &scale, 4);
      }
      ASSERT_EQ(cudaMemcpy(ik.data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
  }

  ForwardBatch decode(const std::vector<int32_t>& seq) const {
    return test::graph_decode_batch(rows_, slots_, seq);
  }
  ForwardBatch verify(const std::vector<int32_t>& seq, int n, int topk) {
    return test::graph_verify_batch(rows_, slots_, seq, n, topk, rng_);
  }

  // Writes `in` into the layers' static tensors, poisons their outputs and selections, runs the
  // step as a graph and returns every layer's output and selection (first T rows).
  std::vector<LayerOut> run_graph(const ForwardBatch& batch, const std::vector<LayerIn>& in) {
    const int64_t T = batch.num_tokens();
    EXPECT_GT(rt_->cuda_graph_bucket(batch), 0);
    for (size_t i = 0; i < in.size(); ++i) {
      const GraphLayerIO x = rt_->graph_io(model_.layers[i].layer_id, T);
      rt_->copy_tensor(x.q, in[i].q.view());
      rt_->copy_tensor(x.k, in[i].latent.view());
      rt_->copy_tensor(x.index_q, in[i].iq.view());
      rt_->copy_tensor(x.index_k, in[i].ik.view());
      rt_->copy_tensor(x.index_weights, in[i].w.view());
      const LayerOut poison(d_, T);
      rt_->copy_tensor(x.out, poison.out.view());
      rt_->copy_tensor(x.index_topk, poison.topk.view());
    }
    rt_->forward_step_graph(batch);
    rt_->synchronize();
    std::vector<LayerOut> got;
    for (const LayerSpec& l : model_.layers) {
      const GraphLayerIO x = rt_->graph_io(l.layer_id, T);
      LayerOut o(d_, T);
      rt_->copy_tensor(o.out.view(), x.out);
      rt_->copy_tensor(o.topk.view(), x.index_topk);
      got.push_back(std::move(o));
    }
    return got;
  }

  // The same step eagerly on the runtime, from device copies of `in` (it stores the same K/V and
  // index keys again).
  std::vector<LayerOut> run_eager(const ForwardBatch& batch, const std::vector<LayerIn>& in) {
    const int64_t T = batch.num_tokens();
    std::vector<LayerOut> got;
    rt_->begin_step(batch);
    for (size_t i = 0; i < in.size(); ++i) {
      LayerOut o(d_, T);
      test::DevTensor q(in[i].q.view()), lat(in[i].latent.view()), iq(in[i].iq.view()),
          ik(in[i].ik.view()), w(in[i].w.view()), out(o.out.view()), topk(o.topk.view());
      AttnArgs a{.q = q.view, .k = lat.view, .v = {}, .out = out.view};
      a.indexer = {.q = iq.view, .k = ik.view, .weights = w.view, .topk = topk.view};
      rt_->forward(model_.layers[i].layer_id, a);
      rt_->synchronize();
      out.download(o.out.view());
      topk.download(o.topk.view());
      got.push_back(std::move(o));
    }
    rt_->end_step();
    return got;
  }

  // The step on reference over a host copy of the pools as the GPU left them.
  std::vector<LayerOut> run_reference(const ForwardBatch& batch, const std::vector<LayerIn>& in) {
    const int64_t T = batch.num_tokens();
    const auto host = test::host_reference(model_, options_, *rt_, *cache_, 8 * kContext, batch,
                                           /*index_keys=*/true);
    ReferenceBackend& ref = *host->ref;
    std::vector<LayerOut> got;
    for (size_t i = 0; i < in.size(); ++i) {
      LayerOut o(d_, T);
      AttnArgs a{.q = in[i].q.view(), .k = in[i].latent.view(), .v = {}, .out = o.out.view()};
      a.indexer = {.q = in[i].iq.view(),
                   .k = in[i].ik.view(),
                   .weights = in[i].w.view(),
                   .topk = o.topk.view()};
      ref.forward(a, model_.layers[i], batch);
      got.push_back(std::move(o));
    }
    return got;
  }

  // A graph step of `batch` on fresh inputs against the same step eagerly and on reference.
  void check_step(const ForwardBatch& batch) {
    const int64_t T = batch.num_tokens();
    std::vector<LayerIn> in;
    for (size_t i = 0; i < model_.layers.size(); ++i) in.push_back(draw_inputs(d_, T, rng_));
    const std::vector<LayerOut> graph = run_graph(batch, in);
    const std::vector<LayerOut> ref = run_reference(batch, in);
    const std::vector<LayerOut> eager = run_eager(batch, in);
    for (size_t i = 0; i < model_.layers.size(); ++i) {
      SCOPED_TRACE(testing::Message() << "layer " << i);
      expect_same_selection(graph[i], eager[i], T, "eager");
      expect_same_selection(graph[i], ref[i], T, "reference");
      expect_close(graph[i], eager[i], "eager");
      expect_close(graph[i], ref[i], "reference");
    }
  }

  void expect_same_selection(const LayerOut& got, const LayerOut& want, int64_t T,
                             const char* what) const {
    const int K = d_.topk;
    int reported = 0;
    for (int64_t t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        const int32_t a = got.topk.ptr<int32_t>()[t * K + k];
        const int32_t b = want.topk.ptr<int32_t>()[t * K + k];
        if (a != b && reported++ < 8) {
          ADD_FAILURE() << "token " << t << ": selected key " << k << " is token index " << a
                        << " in the graph, " << b << " " << what;
          break;
        }
      }
    }
  }

  void expect_close(const LayerOut& got, const LayerOut& want, const char* what) const {
    const int hq = d_.hq, rank = d_.rank;
    const conformance::Tolerance tol = conformance::tolerance_for(DType::bf16);
    int bad = 0;
    for (int64_t i = 0; i < want.out.numel(); ++i) {
      const double x = load_as_float(got.out.data(), DType::bf16, i);
      const double y = load_as_float(want.out.data(), DType::bf16, i);
      if (!(std::fabs(x - y) <= tol.abs + tol.rel * std::fabs(y)) && bad++ < 8) {
        ADD_FAILURE() << "out[" << i / (hq * rank) << ", " << (i / rank) % hq << ", " << i % rank
                      << "] = " << x << " in the graph, " << y << " " << what;
      }
    }
    EXPECT_EQ(bad, 0) << "output elements past the tolerance against " << what;
  }

  Dims d_ = kSmall;
  ModelSpec model_;
  Options options_;
  std::unique_ptr<AttentionRuntime> rt_;
  cuda::CudaKVCache* cache_ = nullptr;
  std::vector<int64_t> rows_;
  std::vector<std::vector<int64_t>> slots_;
  std::mt19937 rng_{test::test_seed()};

 private:
  bool graphs_before_ = false, restore_ = false;
  cuda::DsaIndexer indexer_before_ = cuda::DsaIndexer::cuda_core;
};

std::string indexer_name(const testing::TestParamInfo<cuda::DsaIndexer>& i) {
  return i.param == cuda::DsaIndexer::mma ? "mma" : "cuda_core";
}

INSTANTIATE_TEST_SUITE_P(Kernels, CudaDsaGraphs,
                         testing::Values(cuda::DsaIndexer::cuda_core, cuda::DsaIndexer::mma),
                         indexer_name);

// Decode: captured at one set of lengths (3 requests padded to 4), replayed at others (selection
// at the top-k boundary: 16 and 17 keys; lengths past the three-token score rounds), filling the
// bucket, and a second bucket.
TEST_P(CudaDsaGraphs, DecodeCapturedOnceReplaysAtNewLengthsAndPadding) {
  for (int page : {16, 1}) {
    SCOPED_TRACE(testing::Message() << "page " << page << ", seed " << test::test_seed());
    build(page, 0, 0, 0);
    test::decode_graph_scenario([&](const std::vector<int32_t>& seq) { check_step(decode(seq)); },
                                [&] { return rt_->cuda_graphs_captured(); }, {2500, 17, 16});
  }
}

// TARGET_VERIFY chains of 4 drafts and trees of 6 (random parents): captured, then replayed at
// other lengths and batch sizes.
TEST_P(CudaDsaGraphs, VerifyChainAndTreeReplayAtNewLengths) {
  for (const auto& [topk, drafts] : {std::pair{1, 4}, std::pair{2, 6}}) {
    SCOPED_TRACE(testing::Message() << "eagle topk " << topk << ", seed " << test::test_seed());
    build(16, 3, topk, drafts);
    check_step(verify({1000, 300, 2000}, drafts, topk));
    check_step(verify({2900, 10, 13}, drafts, topk));
    check_step(verify({3800, 1, 1200, 777}, drafts, topk));
    check_step(verify({2222}, drafts, topk));
    EXPECT_EQ(rt_->cuda_graphs_captured(), 2);
  }
}

// A batch of 3 in bucket 4: the padded request changes nothing of the real ones. Their output rows
// and selections are those of the same 3 requests with a 4th real one (the same bucket, so the
// same launches), bit for bit; and the step leaves every pool slot but its own write slots and the
// dummy slot 0 as it was (latent rows and index keys).
TEST_P(CudaDsaGraphs, PaddedRequestsLeaveTheRealRowsUnchanged) {
  build(16, 0, 0, 0);
  const ForwardBatch three = decode({2100, 640, 3000});
  const ForwardBatch four = decode({2100, 640, 3000, 1500});
  std::vector<LayerIn> in4;
  for (size_t i = 0; i < model_.layers.size(); ++i) in4.push_back(draw_inputs(d_, 4, rng_));
  std::vector<LayerIn> in3;
  for (const LayerIn& x : in4) {
    LayerIn y = draw_inputs(d_, 3, rng_);
    for (const auto& [dst, src] :
         {std::pair{&y.q, &x.q}, std::pair{&y.latent, &x.latent}, std::pair{&y.iq, &x.iq},
          std::pair{&y.ik, &x.ik}, std::pair{&y.w, &x.w}})
      std::memcpy(dst->data(), src->data(), dst->bytes());
    in3.push_back(std::move(y));
  }
  // The pools before the padded step.
  const int layer = model_.layers[0].layer_id;
  const KVLayerView v = rt_->kv_cache().layer(layer);
  const IndexKeyView ik = rt_->kv_cache().index_keys(layer);
  const size_t row_bytes = static_cast<size_t>(v.k_row_stride) * dtype_size(v.dtype);
  const size_t key_bytes = static_cast<size_t>(ik.dim) + 4;
  std::vector<uint8_t> rows_before(static_cast<size_t>(v.num_rows) * row_bytes),
      rows_after(rows_before.size()), keys_before(static_cast<size_t>(ik.num_rows) * key_bytes),
      keys_after(keys_before.size());
  rt_->synchronize();
  cache_->copy_layer_to_host(layer, rows_before.data(), nullptr);
  rt_->kv_cache().download_index_keys(layer, keys_before.data());

  const std::vector<LayerOut> padded = run_graph(three, in3);
  cache_->copy_layer_to_host(layer, rows_after.data(), nullptr);
  rt_->kv_cache().download_index_keys(layer, keys_after.data());
  std::vector<bool> written(static_cast<size_t>(v.num_rows), false);
  written[0] = true;
  for (int64_t s : three.out_cache_loc) written[static_cast<size_t>(s)] = true;
  int64_t changed = 0;
  for (int64_t s = 0; s < v.num_rows; ++s) {
    if (written[static_cast<size_t>(s)]) continue;
    changed += std::memcmp(rows_before.data() + s * row_bytes, rows_after.data() + s * row_bytes,
                           row_bytes) != 0;
  }
  // Index keys live in pages: [page codes | page scales]; compare slot by slot.
  for (int64_t s = 0; s < ik.num_rows; ++s) {
    if (written[static_cast<size_t>(s)]) continue;
    IndexKeyView a = ik, b = ik;
    a.data = keys_before.data();
    b.data = keys_after.data();
    changed += std::memcmp(a.codes(s), b.codes(s), ik.dim) != 0 ||
               std::memcmp(a.scale_ptr(s), b.scale_ptr(s), 4) != 0;
  }
  EXPECT_EQ(changed, 0) << "pool slots other than the step's and the dummy slot 0 changed";

  const std::vector<LayerOut> full = run_graph(four, in4);
  EXPECT_EQ(rt_->cuda_graphs_captured(), 1);
  for (size_t i = 0; i < model_.layers.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "layer " << i);
    EXPECT_EQ(std::memcmp(padded[i].out.data(), full[i].out.data(), padded[i].out.bytes()), 0)
        << "the real requests' outputs differ with a padded 4th request";
    EXPECT_EQ(std::memcmp(padded[i].topk.data(), full[i].topk.data(), padded[i].topk.bytes()), 0)
        << "the real requests' selections differ with a padded 4th request";
  }
  // And the padded step itself was right.
  check_step(three);
}

// DeepSeek-V3.2's dims (the keys-on-M MLA CTA over the selected slots, 64 x 128 index heads) in
// decode and chain verify graphs, against eager and reference.
TEST_P(CudaDsaGraphs, DeepSeekV32ShapesOnTheMlaCtas) {
  SCOPED_TRACE(testing::Message() << "seed " << test::test_seed());
  build(16, 0, 0, 0, kV32);
  check_step(decode({1000, 300, 2000}));
  check_step(decode({3800, 64, 65, 777}));
  build(16, 3, 1, 4, kV32);
  check_step(verify({1000, 60, 2000}, 4, 1));
  check_step(verify({3800, 1, 1200, 777}, 4, 1));
}

// `attnrt run` on a DSA model (index_topk 16, so the selection is real) on cuda with graphs:
// DECODE steps (plain decoding) and TARGET_VERIFY steps (speculative chains and trees; a
// speculative target runs no DECODE) run as graphs, every step checked against reference on the
// host copy of the pools (latent rows and index keys downloaded).
TEST_P(CudaDsaGraphs, RunChecksEveryGraphStepAgainstReference) {
  const LayerSpec l = dsa_layer(0, kSmall);
  const ModelSpec model = test::make_model("cuda-dsa-graph-run", DType::bf16, 8192, {l});
  for (int topk : {0, 1, 3}) {
    SCOPED_TRACE(testing::Message() << "eagle topk " << topk << " (0: no speculation)");
    Options o = topk == 0 ? Options{.attention_backend = "cuda"}
                          : test::speculative_options("cuda", topk);
    o.page_size = 16;
    const sim::RunReport r = sim::run_trace(model, o, test::four_request_trace("dsa-graph-run"),
                                            test::small_run_config(2048, 1, 17));
    EXPECT_TRUE(r.ok()) << sim::format_report(r);
    for (const sim::ModeStats& m : r.modes) {
      SCOPED_TRACE(forward_mode_name(m.mode));
      EXPECT_EQ(m.backend, "cuda");
      // (IDLE steps have no tokens to check.)
      if (m.mode != ForwardMode::IDLE) EXPECT_EQ(m.checked_steps, m.steps);
    }
    const ForwardMode graphed = topk == 0 ? ForwardMode::DECODE : ForwardMode::TARGET_VERIFY;
    const sim::ModeStats* m = test::find_mode(r, sim::ModelRole::target, graphed);
    ASSERT_NE(m, nullptr) << sim::format_report(r);
    EXPECT_GT(m->graph_steps, 0) << forward_mode_name(graphed) << " ran no graph\n"
                                 << sim::format_report(r);
  }
}

#endif  // ATTNRT_HAS_CUDA

}  // namespace
}  // namespace attnrt
