// AttentionRuntime's CUDA graphs (docs/cuda_graphs.md): whole multi-layer DECODE and TARGET_VERIFY
// (chain and tree) steps captured at one set of lengths and replayed at others, padded to their
// bucket or filling it, compared with eager steps on the same runtime and with the reference
// backend over a host copy of the pools; which graphs exist after which steps; misuse errors. The
// GPU tests skip (with the reason) where no CUDA device is usable; the tests of why graphs are off
// run everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/runtime/attention_runtime.h"
#include "backends/reference/reference_backend.h"
#include "bench/harness/runner.h"
#include "bench/harness/workload.h"
#include "tools/io/case_file.h"
#include "tools/sim/driver.h"
#include "tools/sim/scheduler.h"
#include "tools/sim/trace.h"
#include "tests/test_cuda_util.h"
#include "tests/test_sim_util.h"
#include "tests/test_util.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/kernels/l2_evict.h"
#include "bench/harness/cuda_bench.h"
#endif

namespace attnrt {
namespace {

using test::attention_layer;

ModelSpec small_model(DType dtype) {
  return test::make_model("graph-test", dtype, 512,
                          {attention_layer(0, 4, 2, 16), attention_layer(1, 4, 2, 16)});
}

ForwardBatch one_decode(AttentionRuntime& rt) {
  const int row = rt.req_to_token().alloc();
  const std::vector<int32_t> zero{0}, len{5};
  const std::vector<int64_t> none{-1};
  const std::vector<int64_t> slots = rt.allocator().alloc_extend(zero, len, none);
  rt.req_to_token().write(row, 0, slots);
  ForwardBatch b = make_decode_batch({row}, {5});
  b.out_cache_loc = {slots.back()};
  return b;
}

// Host backends keep graphs off and say why; a graph step is then refused before anything runs.
TEST(CudaGraphsOff, HostBackendsSayWhyAndRefuseGraphSteps) {
  Options o;
  o.attention_backend = "reference";
  RuntimeConfig c{.max_requests = 2, .kv_slots = 64};
  AttentionRuntime rt(small_model(DType::f32), o, c);
  EXPECT_FALSE(rt.cuda_graphs_enabled());
  EXPECT_NE(rt.cuda_graphs_off_reason().find(built_with_cuda() ? "KV cache is on the host"
                                                               : "this build has no CUDA support"),
            std::string::npos)
      << rt.cuda_graphs_off_reason();
  EXPECT_TRUE(rt.cuda_graph_batch_sizes().empty());
  const ForwardBatch b = one_decode(rt);
  EXPECT_EQ(rt.cuda_graph_bucket(b), 0);
  test::expect_error([&] { rt.forward_step_graph(b); },
               {"cannot run as a CUDA graph", "CUDA graphs are off", "begin_step"});
  test::expect_error([&] { rt.graph_io(0, 1); }, {"graph_io(layer 0)", "CUDA graphs are off"});
  EXPECT_EQ(rt.cuda_graphs_captured(), 0);
  rt.synchronize();  // nothing to wait for on the host

  c.cuda_graphs = false;
  AttentionRuntime off(small_model(DType::f32), o, c);
  EXPECT_NE(off.cuda_graphs_off_reason().find("cuda_graphs is false"), std::string::npos)
      << off.cuda_graphs_off_reason();
}

TEST(CudaGraphsOff, BadGraphConfigIsRejected) {
  Options o;
  o.attention_backend = "reference";
  RuntimeConfig c{.max_requests = 8, .kv_slots = 64};
  c.cuda_graph_batch_sizes = {4, 2};
  test::expect_error([&] { AttentionRuntime rt(small_model(DType::f32), o, c); },
               {"cuda_graph_batch_sizes[1] = 2", "must increase"});
  c.cuda_graph_batch_sizes = {1, 16};
  test::expect_error([&] { AttentionRuntime rt(small_model(DType::f32), o, c); },
               {"cuda_graph_batch_sizes[1] = 16", "max_requests = 8"});
  c.cuda_graph_batch_sizes.clear();
  c.cuda_graph_max_bs = 0;
  test::expect_error([&] { AttentionRuntime rt(small_model(DType::f32), o, c); },
               {"cuda_graph_max_bs = 0", ">= 1"});
}

TEST(CudaGraphsOff, CopyTensorOnTheHost) {
  Options o;
  o.attention_backend = "reference";
  const RuntimeConfig c{.max_requests = 1, .kv_slots = 16};
  AttentionRuntime rt(small_model(DType::f32), o, c);
  std::mt19937 rng(4);
  std::vector<float> src(24), dst(24, 0.f);
  for (float& x : src) x = std::uniform_real_distribution<float>(-3.f, 3.f)(rng);
  rt.copy_tensor(TensorView(dst.data(), DType::f32, {2, 3, 4}),
                 TensorView(src.data(), DType::f32, {2, 3, 4}));
  EXPECT_EQ(dst, src);
  test::expect_error(
      [&] {
        rt.copy_tensor(TensorView(dst.data(), DType::f32, {2, 3, 3}),
                       TensorView(src.data(), DType::f32, {2, 3, 4}));
      },
      {"copy_tensor", "same dtype and element count"});
}

#ifdef ATTNRT_HAS_CUDA

using test::Compare;
using test::compare;
using test::fill_random;

// Three attention layers of different GQA groups and head dims, one with a softcap and one with
// sinks, on the cuda backend with its pools on the GPU. Every request row holds the slots of its
// longest length from the start; the pools hold random K/V.
class CudaGraphRuntime : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    ASSERT_TRUE(Registry::global().get("cuda").caps.deterministic_graphs);
  }

  void build(int page, int spec_steps, int topk, int draft_tokens, bool deterministic = false) {
    model_.name = "graph-gpu";
    model_.dtype = DType::bf16;
    model_.max_context_len = 4096;
    LayerSpec a = attention_layer(0, 32, 8, 128);
    a.logit_cap = 30.f;
    LayerSpec b = attention_layer(1, 8, 8, 64);
    b.has_sinks = true;
    LayerSpec c = attention_layer(2, 16, 2, 128);
    model_.layers = {a, b, c};
    Options o = test::cuda_graph_options(page, spec_steps, topk, draft_tokens);
    o.deterministic = deterministic;
    options_ = o;
    RuntimeConfig rc;
    rc.max_requests = 8;
    rc.kv_slots = 8 * 4096;
    rc.max_num_tokens = 256;
    rt_ = std::make_unique<AttentionRuntime>(model_, o, rc);
    ASSERT_TRUE(rt_->cuda_graphs_enabled()) << rt_->cuda_graphs_off_reason();
    EXPECT_EQ(rt_->cuda_graph_batch_sizes(), (std::vector<int>{1, 2, 4, 8}));
    cache_ = dynamic_cast<cuda::CudaKVCache*>(&rt_->kv_cache());
    ASSERT_NE(cache_, nullptr);

    for (int i = 0; i < 4; ++i) {
      const int row = rt_->req_to_token().alloc();
      const std::vector<int32_t> zero{0}, len{3900};
      const std::vector<int64_t> none{-1};
      slots_.push_back(rt_->allocator().alloc_extend(zero, len, none));
      rt_->req_to_token().write(row, 0, slots_.back());
      rows_.push_back(row);
    }
    for (const LayerSpec& l : model_.layers) {
      const KVLayerView v = rt_->kv_cache().layer(l.layer_id);
      HostBuffer k(v.dtype, {v.num_rows * v.k_row_stride}),
          vv(v.dtype, {v.num_rows * v.v_row_stride});
      fill_random(k.view(), rng_, 2.f);
      fill_random(vv.view(), rng_, 2.f);
      cache_->copy_layer_from_host(l.layer_id, k.data(), vv.data());
    }
    sinks_.resize(b.num_q_heads);
    for (float& s : sinks_) s = std::uniform_real_distribution<float>(-1.f, 3.f)(rng_);
    HostBuffer sinks(DType::f32, {b.num_q_heads});
    std::memcpy(sinks.data(), sinks_.data(), sinks_.size() * sizeof(float));
    rt_->copy_tensor(rt_->graph_io(1, 0).sinks, sinks.view());
  }

  ForwardBatch decode(const std::vector<int32_t>& seq) const {
    return test::graph_decode_batch(rows_, slots_, seq);
  }
  ForwardBatch verify(const std::vector<int32_t>& seq, int n, int topk) {
    return test::graph_verify_batch(rows_, slots_, seq, n, topk, rng_);
  }

  // One graph step, then the same step eagerly (it stores the same K/V again) and on reference
  // over a host copy of the pools; every layer's output is compared with both.
  void check_step(const ForwardBatch& batch) {
    const int64_t T = batch.num_tokens();
    ASSERT_GT(rt_->cuda_graph_bucket(batch), 0);
    struct Io : test::Qkv {
      HostBuffer graph_out, eager_out, ref_out;
    };
    std::vector<Io> io;
    for (const LayerSpec& l : model_.layers) {
      const GraphLayerIO x = rt_->graph_io(l.layer_id, T);
      Io h{test::random_qkv(model_.dtype, l, T, rng_),
           HostBuffer(model_.dtype, {T, l.num_q_heads, l.head_dim}),
           HostBuffer(model_.dtype, {T, l.num_q_heads, l.head_dim}),
           HostBuffer(model_.dtype, {T, l.num_q_heads, l.head_dim})};
      rt_->copy_tensor(x.q, h.q.view());
      rt_->copy_tensor(x.k, h.k.view());
      rt_->copy_tensor(x.v, h.v.view());
      std::memset(h.graph_out.data(), 0xff, h.graph_out.bytes());  // NaN: every row must be written
      rt_->copy_tensor(x.out, h.graph_out.view());
      io.push_back(std::move(h));
    }
    rt_->forward_step_graph(batch);
    rt_->synchronize();
    for (size_t i = 0; i < io.size(); ++i)
      rt_->copy_tensor(io[i].graph_out.view(), rt_->graph_io(model_.layers[i].layer_id, T).out);

    // Eager, from the same static inputs into a separate output.
    rt_->begin_step(batch);
    for (size_t i = 0; i < io.size(); ++i) {
      const LayerSpec& l = model_.layers[i];
      const GraphLayerIO x = rt_->graph_io(l.layer_id, T);
      test::DeviceMemory out(io[i].eager_out.bytes());
      AttnArgs a;
      a.q = x.q;
      a.k = x.k;
      a.v = x.v;
      a.out = x.out;
      a.out.data = out.ptr;
      a.sinks = l.has_sinks ? x.sinks.ptr<const float>() : nullptr;
      rt_->forward(l.layer_id, a);
      rt_->copy_tensor(io[i].eager_out.view(), a.out);
    }
    rt_->end_step();

    // Reference over a host copy of the pools (rows as the GPU step left them).
    const auto host = test::host_reference(model_, options_, *rt_, *cache_, 8 * 4096, batch,
                                           /*index_keys=*/false);
    ReferenceBackend& ref = *host->ref;
    for (size_t i = 0; i < io.size(); ++i) {
      const LayerSpec& l = model_.layers[i];
      ref.forward({.q = io[i].q.view(),
                   .k = io[i].k.view(),
                   .v = io[i].v.view(),
                   .out = io[i].ref_out.view(),
                   .sinks = l.has_sinks ? sinks_.data() : nullptr},
                  l, batch);
      SCOPED_TRACE(testing::Message() << "layer " << l.layer_id);
      const Compare vs_ref = compare(io[i].graph_out.view(), io[i].ref_out.view(), T);
      EXPECT_LT(vs_ref.rel, 1.2e-2) << "graph vs reference, max abs " << vs_ref.max_abs;
      EXPECT_LT(vs_ref.max_abs, 0.08);
      const Compare vs_eager = compare(io[i].graph_out.view(), io[i].eager_out.view(), T);
      EXPECT_LT(vs_eager.rel, 1.2e-2) << "graph vs eager, max abs " << vs_eager.max_abs;
    }
  }

  // Runs `batch` (graph or eager) with token 0's q / k / v of every layer taken from `first` and
  // the other tokens' drawn at random; returns every layer's output row of token 0, as bytes.
  std::vector<std::vector<unsigned char>> first_rows(const ForwardBatch& batch,
                                                     const std::vector<test::Qkv>& first,
                                                     bool graph) {
    const int64_t T = batch.num_tokens();
    std::vector<test::Qkv> in;
    for (size_t i = 0; i < model_.layers.size(); ++i) {
      const LayerSpec& l = model_.layers[i];
      test::Qkv x = test::random_qkv(model_.dtype, l, T, rng_);
      std::memcpy(x.q.data(), first[i].q.data(), first[i].q.bytes());
      std::memcpy(x.k.data(), first[i].k.data(), first[i].k.bytes());
      std::memcpy(x.v.data(), first[i].v.data(), first[i].v.bytes());
      const GraphLayerIO io = rt_->graph_io(l.layer_id, T);
      rt_->copy_tensor(io.q, x.q.view());
      rt_->copy_tensor(io.k, x.k.view());
      rt_->copy_tensor(io.v, x.v.view());
      in.push_back(std::move(x));
    }
    std::vector<std::vector<unsigned char>> rows;
    if (graph) {
      EXPECT_GT(rt_->cuda_graph_bucket(batch), 0);
      rt_->forward_step_graph(batch);
      rt_->synchronize();
    } else {
      rt_->begin_step(batch);
      for (const LayerSpec& l : model_.layers) {
        const GraphLayerIO x = rt_->graph_io(l.layer_id, T);
        AttnArgs a;
        a.q = x.q;
        a.k = x.k;
        a.v = x.v;
        a.out = x.out;
        a.sinks = l.has_sinks ? x.sinks.ptr<const float>() : nullptr;
        rt_->forward(l.layer_id, a);
      }
      rt_->end_step();
      rt_->synchronize();
    }
    for (const LayerSpec& l : model_.layers) {
      HostBuffer out(model_.dtype, {T, l.num_q_heads, l.head_dim});
      rt_->copy_tensor(out.view(), rt_->graph_io(l.layer_id, T).out);
      const auto* p = static_cast<const unsigned char*>(out.data());
      rows.emplace_back(p, p + out.bytes() / T);
    }
    return rows;
  }

  ModelSpec model_;
  Options options_;
  std::unique_ptr<AttentionRuntime> rt_;
  cuda::CudaKVCache* cache_ = nullptr;
  std::vector<int> rows_;
  std::vector<std::vector<int64_t>> slots_;
  std::vector<float> sinks_;
  std::mt19937 rng_{20260501};
};

TEST_F(CudaGraphRuntime, DecodeCapturedOnceReplaysAtNewLengthsAndPadding) {
  for (int page : {16, 1}) {
    SCOPED_TRACE(testing::Message() << "page " << page);
    slots_.clear();
    rows_.clear();
    build(page, 0, 0, 0);
    test::decode_graph_scenario([&](const std::vector<int32_t>& seq) { check_step(decode(seq)); },
                                [&] { return rt_->cuda_graphs_captured(); }, {2500, 650, 17});
  }
}

// --deterministic with graphs (GraphLayout::det_splits): a request's output does not depend on the
// batch it is in, the graph bucket that runs it, or whether it runs captured or eagerly, bit for
// bit. Request 0 at 3000 keys (3 splits of 1024) with the same inputs in batches of 1, 3 and 4
// (buckets 1, 4, 4: padded and not), beside requests of 1 to 4 splits and of one key.
TEST_F(CudaGraphRuntime, DeterministicGraphsAreBatchInvariant) {
  build(16, 0, 0, 0, /*deterministic=*/true);
  std::vector<test::Qkv> first;
  for (const LayerSpec& l : model_.layers) first.push_back(test::random_qkv(model_.dtype, l, 1, rng_));
  const auto alone = first_rows(decode({3000}), first, /*graph=*/true);
  const auto eager = first_rows(decode({3000}), first, /*graph=*/false);
  const auto three = first_rows(decode({3000, 1500, 3900}), first, true);
  const auto four = first_rows(decode({3000, 1, 700, 2049}), first, true);
  const auto four_eager = first_rows(decode({3000, 1, 700, 2049}), first, false);
  EXPECT_EQ(rt_->cuda_graphs_captured(), 2);
  for (size_t i = 0; i < model_.layers.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "layer " << i);
    EXPECT_EQ(alone[i], eager[i]) << "graph vs eager, batch of 1";
    EXPECT_EQ(alone[i], three[i]) << "batch of 1 vs batch of 3 (padded to 4)";
    EXPECT_EQ(alone[i], four[i]) << "batch of 1 vs batch of 4";
    EXPECT_EQ(alone[i], four_eager[i]) << "batch of 1 vs eager batch of 4";
  }
  // And the steps are right: graph against eager and reference at other lengths.
  check_step(decode({3900, 2, 1025, 3899}));
  check_step(decode({17, 2500}));
}

// The same for TARGET_VERIFY chains of 4 drafts (verify tiles, split by length as decode's).
TEST_F(CudaGraphRuntime, DeterministicVerifyGraphsAreBatchInvariant) {
  build(16, 3, 1, 4, /*deterministic=*/true);
  std::vector<test::Qkv> first;
  for (const LayerSpec& l : model_.layers) first.push_back(test::random_qkv(model_.dtype, l, 1, rng_));
  const auto alone = first_rows(verify({2800}, 4, 1), first, /*graph=*/true);
  const auto eager = first_rows(verify({2800}, 4, 1), first, /*graph=*/false);
  const auto three = first_rows(verify({2800, 100, 3500}, 4, 1), first, true);
  for (size_t i = 0; i < model_.layers.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "layer " << i);
    EXPECT_EQ(alone[i], eager[i]) << "graph vs eager, batch of 1";
    EXPECT_EQ(alone[i], three[i]) << "batch of 1 vs batch of 3 (padded to 4)";
  }
  check_step(verify({3000, 1025, 5}, 4, 1));
}

TEST_F(CudaGraphRuntime, VerifyChainAndTreeGraphs) {
  build(16, 3, 1, 4);
  check_step(verify({1200, 40, 3000}, 4, 1));
  check_step(verify({2000, 900}, 4, 1));
  check_step(verify({17, 3100, 64, 700}, 4, 1));
  EXPECT_EQ(rt_->cuda_graphs_captured(), 2);  // buckets 4 and 2

  slots_.clear();
  rows_.clear();
  build(16, 3, 2, 6);
  check_step(verify({1200, 40, 3000}, 6, 2));
  check_step(verify({100, 2600, 31, 800}, 6, 2));
  EXPECT_EQ(rt_->cuda_graphs_captured(), 1);
  // A chain in a tree run has its own graph (chains take the causal path, trees the masks).
  check_step(verify({500, 501, 502}, 6, 1));
  EXPECT_EQ(rt_->cuda_graphs_captured(), 2);
}

TEST_F(CudaGraphRuntime, BucketsAndMisuse) {
  build(16, 0, 0, 0);
  EXPECT_EQ(rt_->cuda_graph_bucket(decode({10, 20, 30})), 4);
  EXPECT_EQ(rt_->cuda_graph_bucket(decode({10, 20, 30, 40})), 4);
  EXPECT_EQ(rt_->cuda_graph_bucket(decode({10})), 1);
  ForwardBatch extend = make_extend_batch({rows_[0]}, {10}, {5});
  extend.out_cache_loc.assign(slots_[0].begin() + 10, slots_[0].begin() + 15);
  EXPECT_EQ(rt_->cuda_graph_bucket(extend), 0);
  test::expect_error([&] { rt_->forward_step_graph(extend); },
               {"EXTEND step cannot run as a CUDA graph", "DECODE and TARGET_VERIFY"});
  test::expect_error([&] { rt_->graph_io(0, 9); }, {"graph_io(layer 0): 9 tokens", "hold 8"});
  ForwardBatch bad = decode({10, 20});
  bad.req_pool_indices[1] = 7;  // never allocated
  test::expect_error([&] { rt_->forward_step_graph(bad); }, {"req_pool_indices[1] = 7"});
  EXPECT_EQ(rt_->cuda_graphs_captured(), 0);
}

// The row moves of accepted tree paths and the row downloads of `attnrt run`'s reference checks,
// against the same operations on a host pool with the same contents.
TEST(CudaKVCacheRows, MovesAndDownloadsMatchTheHostPool) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::bf16, DType::e4m3}) {
    SCOPED_TRACE(dtype_name(dtype));
    const ModelSpec m = small_model(DType::bf16);
    KVCacheConfig kc;
    kc.full_slots = 256;
    kc.page_size = 16;
    kc.dtype = dtype;
    kc.max_num_tokens = 16;
    KVStorage host = make_host_kv_storage(m, kc), gpu_storage = cuda::make_cuda_kv_storage(m, kc);
    auto& gpu = dynamic_cast<cuda::CudaKVCache&>(*gpu_storage.cache);
    std::mt19937 rng(static_cast<uint32_t>(dtype) + 9);
    const std::vector<int> layers = {0, 1};
    for (int l : layers) {
      const KVLayerView v = host.cache->layer(l);
      fill_random(TensorView(v.k, v.dtype, {v.num_rows * v.k_row_stride}), rng, 2.f);
      fill_random(TensorView(v.v, v.dtype, {v.num_rows * v.v_row_stride}), rng, 2.f);
      gpu.copy_layer_from_host(l, v.k, v.v);
    }
    // Two accepted tree paths compacted towards their roots: block 0 2 5 6 at slot 40 and block
    // 0 1 3 at slot 100; slot 42 is written by one move and read by another.
    const std::vector<std::pair<int64_t, int64_t>> moves = {
        {42, 41}, {45, 42}, {46, 43}, {103, 102}};
    sim::copy_kv_rows(*host.cache, layers, moves);
    sim::copy_kv_rows(gpu, layers, moves);
    for (int l : layers) {
      const KVLayerView v = host.cache->layer(l);
      const size_t kb = v.num_rows * v.k_row_stride * dtype_size(v.dtype);
      std::vector<char> k(kb), vv(kb);
      gpu.copy_layer_to_host(l, k.data(), vv.data());
      EXPECT_EQ(std::memcmp(k.data(), v.k, kb), 0) << "K of layer " << l;
      EXPECT_EQ(std::memcmp(vv.data(), v.v, kb), 0) << "V of layer " << l;

      // Only the listed rows arrive; the others keep what the destination held.
      const std::vector<int64_t> rows = {0, 41, 42, 43, 102, 255};
      std::vector<char> dk(kb, 0x5a), dv(kb, 0x5a);
      gpu.download_rows(l, rows, dk.data(), dv.data());
      const size_t row_bytes = v.k_row_stride * dtype_size(v.dtype);
      for (int64_t r = 0; r < v.num_rows; ++r) {
        const bool listed = std::find(rows.begin(), rows.end(), r) != rows.end();
        const char* want = listed ? static_cast<const char*>(v.k) + r * row_bytes : nullptr;
        if (listed) {
          EXPECT_EQ(std::memcmp(dk.data() + r * row_bytes, want, row_bytes), 0) << "row " << r;
          EXPECT_EQ(std::memcmp(dv.data() + r * row_bytes,
                                static_cast<const char*>(v.v) + r * row_bytes, row_bytes),
                    0)
              << "row " << r;
        } else {
          EXPECT_EQ(dk[r * row_bytes], 0x5a) << "row " << r << " was written";
        }
      }
    }
    test::expect_error(
        [&] {
          gpu.copy_rows(layers, std::vector<std::pair<int64_t, int64_t>>{{0, 5}});
        },
        {"row move 0 is 0 -> 5", "dummy row"});
    test::expect_error(
        [&] {
          gpu.download_rows(0, std::vector<int64_t>{3, 4096}, nullptr, nullptr);
        },
        {"slot 4096 (entry 1)", "outside the pool's rows"});
  }
}

using test::find_mode;

sim::Trace run_trace_text() { return test::four_request_trace("gpu-run"); }

sim::RunConfig run_config() { return test::small_run_config(2048, 1, 11); }

// `attnrt run`'s driver on the cuda backend: every step of every mode checked against reference on
// the host copy of the GPU pools, DECODE steps as CUDA graphs, a step case dumped from GPU pools.
TEST(CudaRun, EveryModeMatchesReferenceWithDecodeGraphs) {
  SKIP_WITHOUT_GPU();
  Options o;
  o.attention_backend = "cuda";
  o.page_size = 16;
  sim::RunConfig rc = run_config();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("attnrt_gpu_run_" + std::to_string(std::random_device{}()));
  rc.dump_step = 12;
  rc.dump_dir = dir.string();
  const sim::RunReport r = sim::run_trace(model_preset("demo"), o, run_trace_text(), rc);
  EXPECT_TRUE(r.ok()) << sim::format_report(r);
  for (ForwardMode m : {ForwardMode::EXTEND, ForwardMode::DECODE, ForwardMode::MIXED}) {
    const sim::ModeStats* s = find_mode(r, sim::ModelRole::target, m);
    if (s == nullptr) continue;  // the scheduler decides which modes a trace produces
    SCOPED_TRACE(forward_mode_name(m));
    EXPECT_EQ(s->backend, "cuda");
    EXPECT_EQ(s->checked_steps, s->steps);
    EXPECT_EQ(s->graph_steps, m == ForwardMode::DECODE ? s->steps : 0);
  }
  ASSERT_NE(find_mode(r, sim::ModelRole::target, ForwardMode::DECODE), nullptr);
  ASSERT_FALSE(r.dump_written.empty()) << r.dump_error;
  // The dumped case holds the GPU pool's rows: replaying it on reference gives the step's output.
  const Case c = read_case(dir.string());
  const ReplayResult replay = replay_case(c, "reference");
  ASSERT_TRUE(c.expected_out.has_value());
  double worst = 0;
  for (int64_t i = 0; i < replay.out.numel(); ++i) {
    worst =
        std::max(worst, std::abs(double{load_as_float(replay.out.data(), replay.out.dtype(), i)} -
                                 c.expected_out->as<float>()[i]));
  }
  EXPECT_LT(worst, 0.05);
  std::filesystem::remove_all(dir);
}

// Speculative runs on the GPU: chain and tree verify as graphs, tree paths moved inside the GPU
// pools with pages of 16 tokens, draft extends eager; everything checked against reference.
TEST(CudaRun, SpeculativeChainAndTreeOnPagedGpuPools) {
  SKIP_WITHOUT_GPU();
  for (int topk : {1, 3}) {
    SCOPED_TRACE(testing::Message() << "topk " << topk);
    Options o;
    o.attention_backend = "cuda";
    o.page_size = 16;
    o.speculative_num_steps = 3;
    o.speculative_eagle_topk = topk;
    o.speculative_num_draft_tokens = topk == 1 ? 4 : 7;
    sim::RunConfig rc = run_config();
    rc.scheduler.spec.accept_prob = 0.8;
    const sim::RunReport r = sim::run_trace(model_preset("demo"), o, run_trace_text(), rc);
    EXPECT_TRUE(r.ok()) << sim::format_report(r);
    const sim::ModeStats* v = find_mode(r, sim::ModelRole::target, ForwardMode::TARGET_VERIFY);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(v->graph_steps, v->steps);
    EXPECT_EQ(v->checked_steps, v->steps);
    const sim::ModeStats* d = find_mode(r, sim::ModelRole::draft, ForwardMode::DRAFT_EXTEND);
    ASSERT_NE(d, nullptr);
    EXPECT_GT(d->checked_steps, 0);
    EXPECT_GT(r.accepted_drafts, 0);
  }
}

// `attnrt bench --backend cuda`: the GPU ceilings, the event timer, rows on device pools checked
// against the float64 recomputation and the reference backend, the step costs. No timing is held
// to a figure; every measured value must be a real measurement.
TEST(CudaBench, CeilingsTimerRowsAndStepCosts) {
  SKIP_WITHOUT_GPU();
  const bench::Ceilings c = cuda::measure_gpu_ceilings(Device::cuda(0), {});
  EXPECT_TRUE(c.memory.available()) << c.memory.unavailable;
  EXPECT_NE(c.memory.method.find("bytes read + written"), std::string::npos) << c.memory.method;
  EXPECT_TRUE(c.bf16.available() || !c.bf16.unavailable.empty());
  EXPECT_EQ(c.compute_name(), c.bf16.available() ? "bf16" : "fp32");

  auto timer = bench::make_device_timer(Device::cuda(0));
  EXPECT_NE(timer->method().find("CUDA events"), std::string::npos);

  bench::BenchConfig config;
  config.backend = "cuda";
  config.device = Device::cuda(0);
  config.repeats = 3;
  config.warmup = 1;
  for (const char* name :
       {"decode-16x4096", "decode-64x4096-fp8", "prefill-1x4096", "verify-tree-64x4096+16-topk4"}) {
    SCOPED_TRACE(name);
    const bench::Workload w = bench::scale_workload(bench::select_workloads(name).front(), 0.25);
    const bench::RowResult row = bench::run_row(config, w, c);
    EXPECT_EQ(row.status, "ok") << row.error;
    EXPECT_TRUE(row.check.passed) << row.check.max_rel_err;
    EXPECT_EQ(row.time.repeats, 3);
    EXPECT_GT(row.time.median, 0);
    EXPECT_GE(row.plan.repeats, 20);
    ASSERT_TRUE(row.reference.has_value());
    EXPECT_TRUE(row.reference->check.passed) << row.reference->check.max_rel_err;
    if (bench::is_verify(w.kind)) EXPECT_GT(row.decode_ratio, 0);
  }

  const bench::GraphOverhead g = bench::measure_graph_overhead(config);
  EXPECT_TRUE(g.error.empty()) << g.error;
  EXPECT_EQ(g.layers, 32);
  EXPECT_GT(g.graph_step.median, 0);
  EXPECT_GT(g.eager_issue.median, 0);
}

// The page-1 gather probe of the ceilings: reads rows at given slots (a permutation, the last
// row of the pool included) and writes nothing, neither the pool nor its sink; rejects a misaligned
// pool or row size; and the GPU ceilings carry both gather figures, the random one at most a little
// above the ordered one.
TEST(CudaBench, GatherProbeReadsRowsWithoutWriting) {
  SKIP_WITHOUT_GPU();
  constexpr int kRow = 1152;
  constexpr int64_t kRows = 4099;  // not a multiple of the warps of the grid
  cuda::DeviceBuffer pool(kRows * kRow), slots(kRows * 4), sink(sizeof(uint32_t));
  ATTNRT_CUDA_CHECK(cudaMemset(pool.data(), 0x3c, pool.bytes()));
  ATTNRT_CUDA_CHECK(cudaMemset(sink.data(), 0xa5, sizeof(uint32_t)));
  std::vector<int32_t> order(kRows);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(5));
  ATTNRT_CUDA_CHECK(cudaMemcpy(slots.data(), order.data(), slots.bytes(), cudaMemcpyHostToDevice));
  ASSERT_EQ(cuda::gather_rows_by_reading(pool.data(), slots.ptr<int32_t>(), kRows, kRow,
                                         sink.ptr<uint32_t>(), nullptr),
            cudaSuccess);
  ATTNRT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<unsigned char> host(pool.bytes());
  ATTNRT_CUDA_CHECK(cudaMemcpy(host.data(), pool.data(), host.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::count(host.begin(), host.end(), 0x3c), static_cast<ptrdiff_t>(host.size()));
  uint32_t word = 0;
  ATTNRT_CUDA_CHECK(cudaMemcpy(&word, sink.data(), sizeof(word), cudaMemcpyDeviceToHost));
  EXPECT_EQ(word, 0xa5a5a5a5u);
  EXPECT_EQ(cuda::gather_rows_by_reading(static_cast<char*>(pool.data()) + 8,
                                         slots.ptr<int32_t>(), 8, kRow, sink.ptr<uint32_t>(),
                                         nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::gather_rows_by_reading(pool.data(), slots.ptr<int32_t>(), 8, 1000,
                                         sink.ptr<uint32_t>(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::gather_rows_by_reading(pool.data(), slots.ptr<int32_t>(), 0, kRow,
                                         sink.ptr<uint32_t>(), nullptr),
            cudaSuccess);

  const bench::Ceilings c = cuda::measure_gpu_ceilings(Device::cuda(0), bench::CeilingOptions{});
  ASSERT_TRUE(c.gather_random.available()) << c.gather_random.unavailable;
  ASSERT_TRUE(c.gather_ordered.available()) << c.gather_ordered.unavailable;
  // Rates only, no order between them (the H100 reads the random permutation 8-16% faster than
  // the same rows in order: a timing, not a property to assert).
  EXPECT_GT(c.gather_random.value, 0.0);
  EXPECT_GT(c.gather_ordered.value, 0.0);
  EXPECT_NE(c.gather_random.method.find("random permutation"), std::string::npos);
}

// ATTNRT_BENCH_FLUSH=clean: the sweep reads the whole buffer and writes nothing (neither the buffer
// nor its sink), rejects a misaligned buffer, and the timer built with it says so and times calls.
TEST(CudaBench, CleanFlushReadsWithoutWriting) {
  SKIP_WITHOUT_GPU();
  const size_t bytes = size_t{64} << 20;
  cuda::DeviceBuffer buf(bytes), sink(sizeof(uint32_t));
  ATTNRT_CUDA_CHECK(cudaMemset(buf.data(), 0x5a, bytes));
  ATTNRT_CUDA_CHECK(cudaMemset(sink.data(), 0xa5, sizeof(uint32_t)));
  ASSERT_EQ(cuda::evict_l2_by_reading(buf.data(), bytes, sink.ptr<uint32_t>(), nullptr),
            cudaSuccess);
  ATTNRT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<unsigned char> host(bytes);
  ATTNRT_CUDA_CHECK(cudaMemcpy(host.data(), buf.data(), bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::count(host.begin(), host.end(), 0x5a), static_cast<ptrdiff_t>(bytes));
  uint32_t word = 0;
  ATTNRT_CUDA_CHECK(cudaMemcpy(&word, sink.data(), sizeof(word), cudaMemcpyDeviceToHost));
  EXPECT_EQ(word, 0xa5a5a5a5u);
  EXPECT_EQ(cuda::evict_l2_by_reading(static_cast<char*>(buf.data()) + 4, 1024,
                                      sink.ptr<uint32_t>(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::evict_l2_by_reading(buf.data(), 1000, sink.ptr<uint32_t>(), nullptr),
            cudaErrorInvalidValue);

  const char* before = std::getenv("ATTNRT_BENCH_FLUSH");
  const std::string saved = before != nullptr ? before : "";
  setenv("ATTNRT_BENCH_FLUSH", "clean", 1);
  {
    auto timer = bench::make_device_timer(Device::cuda(0));
    EXPECT_NE(timer->method().find("read to evict the L2 (ATTNRT_BENCH_FLUSH=clean)"),
              std::string::npos)
        << timer->method();
    const bench::TimingStats t = bench::time_repeated(
        *timer, [&] { ATTNRT_CUDA_CHECK(cudaMemsetAsync(buf.data(), 1, 1 << 20, nullptr)); }, 1, 3);
    EXPECT_EQ(t.repeats, 3);
    EXPECT_GT(t.median, 0);
  }
  setenv("ATTNRT_BENCH_FLUSH", "read", 1);
  try {
    bench::make_device_timer(Device::cuda(0));
    ADD_FAILURE() << "ATTNRT_BENCH_FLUSH=read was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use write or clean"), std::string::npos) << e.what();
  }
  if (before != nullptr) {
    setenv("ATTNRT_BENCH_FLUSH", saved.c_str(), 1);
  } else {
    unsetenv("ATTNRT_BENCH_FLUSH");
  }
}

#else

TEST(CudaGraphRuntime, SkippedWithoutCuda) {
  GTEST_SKIP() << "attnrt was built without CUDA: " << query_cuda().reason;
}

#endif

}  // namespace
}  // namespace attnrt
