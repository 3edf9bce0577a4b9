// DCP steps inside CUDA graphs (docs/dcp.md "CUDA graphs"): a group of 2 or 3 `cuda` ranks on one
// GPU (the device_in_process communicator) and one rank over NCCL capture a step the way an
// engine captures its own (init_cuda_graph_state, begin_capture_step, every layer's forward on the
// capturing stream over static tensors), then replay it with new steps written in place
// (begin_replay_step, one launch). Every replay gets fresh random q / k / v, its outputs are
// poisoned first, and it is compared with the same step run eagerly by another group and with one
// `reference` runtime holding every token; rows past the step's tokens come out as 0 with lse
// -inf. Decode graphs over growing lengths, chain-verify graphs over random acceptances, one graph
// serving every mode (EXTEND with a rank that holds no key of a row, chain and tree verify,
// decodes), at pages of 1 and 16; and what cannot be captured, refused with the reason. Fresh
// inputs every run (ATTNRT_TEST_SEED replays one); skips, with the reason, without a usable GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/runtime/attention_runtime.h"
#include "attnrt/runtime/communicator.h"
#include "attnrt/runtime/dcp.h"
#include "tests/cuda_dcp_models.h"
#include "tests/dcp_steps.h"
#include "tests/test_cuda_util.h"
#include "tests/test_sim_util.h"
#include "tests/test_util.h"
#include "tools/sim/driver.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

// bf16 partials before the fp32 merge (the tolerance of tests/test_cuda_dcp.cpp).
constexpr double kOutTol = 2e-2, kLseTol = 1e-2;

using test::Stream;

struct Graph {
  cudaGraphExec_t exec = nullptr;
  int rows = 0;
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
};

// What a test drives: a DcpAttention, or one DcpRank (forward then merge).
struct Group {
  std::function<void(const ForwardBatch&)> begin;
  std::function<void(int)> begin_capture;
  std::function<void(const ForwardBatch&, int)> begin_replay;
  std::function<void(int, const AttnArgs&)> forward;
  std::function<void()> end;
};

Group group_of(DcpAttention& g) {
  return {[&g](const ForwardBatch& b) { g.begin_step(b); },
          [&g](int rows) { g.begin_capture_step(rows); },
          [&g](const ForwardBatch& b, int rows) { g.begin_replay_step(b, rows); },
          [&g](int layer, const AttnArgs& a) { g.forward(layer, a); }, [&g] { g.end_step(); }};
}

Group group_of(DcpRank& r) {
  return {[&r](const ForwardBatch& b) { r.begin_step(b); },
          [&r](int rows) { r.begin_capture_step(rows); },
          [&r](const ForwardBatch& b, int rows) { r.begin_replay_step(b, rows); },
          [&r](int layer, const AttnArgs& a) {
            r.forward(layer, a);
            r.merge(layer, a);
          },
          [&r] { r.end_step(); }};
}

// A layer's static tensors (the engine's: [rows, H, D] on the GPU) and its sink logits, a weight
// uploaded once.
struct LayerIo {
  std::unique_ptr<test::DeviceMemory> q, k, v, out, lse, sinks;
  std::vector<float> host_sinks;
  AttnArgs args(const LayerSpec& l, int64_t rows, bool with_sinks = true) const {
    const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
    const Device gpu = Device::cuda(0);
    AttnArgs a;
    a.q = TensorView(q->ptr, DType::bf16, {rows, l.num_q_heads, l.head_dim}, gpu);
    a.k = TensorView(k->ptr, DType::bf16, {rows, l.num_kv_heads, l.head_dim}, gpu);
    if (l.kind != LayerKind::mla)
      a.v = TensorView(v->ptr, DType::bf16, {rows, l.num_kv_heads, dv}, gpu);
    a.out = TensorView(out->ptr, DType::bf16, {rows, l.num_q_heads, dv}, gpu);
    a.lse = TensorView(lse->ptr, DType::f32, {rows, l.num_q_heads}, gpu);
    if (l.has_sinks) a.sinks = with_sinks ? sinks->as<float>() : host_sinks.data();
    return a;
  }
};

// One `reference` runtime (the oracle, which hands out the global batch's slots), a group run
// eagerly and a group run from graphs (`graphed`), fed the same batches and q / k / v. The groups
// run on one non-blocking stream (a capture needs one); the graphed one's static tensors hold
// max_rows rows.
class GraphHarness {
 public:
  GraphHarness(ModelSpec model, Options group, Group eager, Group graphed, cudaStream_t stream,
               int max_rows, uint32_t seed)
      : model_(std::move(model)),
        eager_(std::move(eager)),
        graphed_(std::move(graphed)),
        stream_(stream),
        rng_(seed) {
    Options one;
    one.attention_backend = "reference";
    one.page_size = 1;
    one_ = std::make_unique<AttentionRuntime>(model_, one, test::host_config(8, 8192, 256));
    name_ = model_.name + " (page_size " + std::to_string(group.page_size) + ", " +
            std::to_string(group.dcp_size) + " ranks)";
    for (const LayerSpec& l : model_.layers) {
      const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
      const auto rows = static_cast<size_t>(max_rows);
      LayerIo io;
      io.q = std::make_unique<test::DeviceMemory>(rows * l.num_q_heads * l.head_dim * 2);
      io.k = std::make_unique<test::DeviceMemory>(rows * l.num_kv_heads * l.head_dim * 2);
      io.v = std::make_unique<test::DeviceMemory>(rows * l.num_kv_heads * dv * 2);
      io.out = std::make_unique<test::DeviceMemory>(rows * l.num_q_heads * dv * 2);
      io.lse = std::make_unique<test::DeviceMemory>(rows * l.num_q_heads * sizeof(float));
      io.host_sinks.resize(l.num_q_heads);
      for (float& s : io.host_sinks) s = std::normal_distribution<float>(0.f, 1.f)(rng_);
      io.sinks = std::make_unique<test::DeviceMemory>(l.num_q_heads * sizeof(float));
      io.sinks->upload(io.host_sinks.data());
      io_.push_back(std::move(io));
    }
  }

  int rand_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  AttentionRuntime& oracle() { return *one_; }
  const std::vector<LayerIo>& io() const { return io_; }
  const ModelSpec& model() const { return model_; }

  std::vector<int64_t> alloc_requests(int n) {
    std::vector<int64_t> rows;
    for (int i = 0; i < n; ++i) rows.push_back(one_->req_to_token().alloc());
    return rows;
  }

  // Captures a step of `rows` rows: begin_capture_step outside the capture, every layer's forward
  // over the static tensors inside it (cudaStreamCaptureModeGlobal, torch.cuda.graph's default).
  void capture(Graph& g, int rows) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    graphed_.begin_capture(rows);
    ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
    try {
      for (size_t i = 0; i < model_.layers.size(); ++i) {
        graphed_.forward(model_.layers[i].layer_id, io_[i].args(model_.layers[i], rows));
      }
    } catch (...) {
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(stream_, &broken);
      if (broken != nullptr) cudaGraphDestroy(broken);
      throw;
    }
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&g.exec, graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
    graphed_.end();
    g.rows = rows;
  }

  // The step on the oracle, the eager group and (replayed from `g`, or eagerly when null) the
  // graphed group; every layer with fresh q / k / v. Compares rows [0, T) of the graphed group's
  // out and lse with the oracle's and the eager group's, and checks its rows past T are 0 / -inf.
  ForwardBatch run(ForwardBatch b, const Graph* g, const std::string& step) {
    test::place_on(*one_, b);
    const int64_t T = b.num_tokens();
    const int64_t rows = g != nullptr ? g->rows : T;
    const std::string what =
        name_ + ", " + step +
        (g != nullptr ? " (graph of " + std::to_string(rows) + " rows)" : " (eager)");
    SCOPED_TRACE(what);
    one_->begin_step(b);
    eager_.begin(b);
    if (g != nullptr) {
      graphed_.begin_replay(b, g->rows);
    } else {
      graphed_.begin(b);
    }
    struct Layer {
      HostBuffer q, k, v, out1, lse1, oute, lsee, outg, lseg;
    };
    std::vector<Layer> layers;
    for (size_t i = 0; i < model_.layers.size(); ++i) {
      const LayerSpec& l = model_.layers[i];
      const int hq = l.num_q_heads, hkv = l.num_kv_heads;
      const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
      const bool mla = l.kind == LayerKind::mla;
      // The graphed group reads `rows` rows: the step's, then leftovers of the last step (here
      // random) that nothing may read.
      Layer x{test::random_buffer(DType::bf16, {rows, hq, l.head_dim}, rng_),
              test::random_buffer(DType::bf16, {rows, hkv, l.head_dim}, rng_),
              test::random_buffer(DType::bf16, {rows, hkv, dv}, rng_),
              HostBuffer(DType::bf16, {T, hq, dv}),
              HostBuffer(DType::f32, {T, hq}),
              HostBuffer(DType::bf16, {T, hq, dv}),
              HostBuffer(DType::f32, {T, hq}),
              HostBuffer(DType::bf16, {rows, hq, dv}),
              HostBuffer(DType::f32, {rows, hq})};
      for (const HostBuffer* p : {&x.out1, &x.lse1, &x.oute, &x.lsee, &x.outg, &x.lseg})
        test::poison(p->view());
      // The oracle and the eager group: the step's T rows.
      auto first = [&](const HostBuffer& h) {
        TensorView v = h.view();
        v.shape[0] = T;
        return v;
      };
      AttnArgs a;
      a.q = first(x.q);
      a.k = first(x.k);
      if (!mla) a.v = first(x.v);
      a.sinks = l.has_sinks ? io_[i].host_sinks.data() : nullptr;
      a.out = x.out1.view();
      a.lse = x.lse1.view();
      one_->forward(l.layer_id, a);
      test::DevTensor dq(a.q), dk(a.k), dv_(mla ? a.k : a.v), dout(x.oute.view()),
          dlse(x.lsee.view());
      AttnArgs e = a;
      e.q = dq.view;
      e.k = dk.view;
      e.v = mla ? TensorView() : dv_.view;
      e.out = dout.view;
      e.lse = dlse.view;
      if (l.has_sinks) e.sinks = io_[i].sinks->as<float>();
      eager_.forward(l.layer_id, e);
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      dout.download(x.oute.view());
      dlse.download(x.lsee.view());
      layers.push_back(std::move(x));
    }
    if (g != nullptr) {
      // The engine's part: the inputs into the static tensors, the outputs poisoned, on the
      // graph's stream; one launch.
      for (size_t i = 0; i < model_.layers.size(); ++i) {
        const LayerIo& io = io_[i];
        const Layer& x = layers[i];
        for (const auto& [dst, src] : {std::pair{io.q.get(), &x.q}, std::pair{io.k.get(), &x.k},
                                       std::pair{io.v.get(), &x.v}}) {
          const size_t bytes = static_cast<size_t>(src->view().numel()) * 2;
          EXPECT_EQ(
              cudaMemcpyAsync(dst->ptr, src->view().data, bytes, cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
        }
        EXPECT_EQ(cudaMemsetAsync(io.out->ptr, 0xFF, io.out->bytes, stream_), cudaSuccess);
        EXPECT_EQ(cudaMemsetAsync(io.lse->ptr, 0xFF, io.lse->bytes, stream_), cudaSuccess);
      }
      EXPECT_EQ(cudaGraphLaunch(g->exec, stream_), cudaSuccess);
    } else {
      for (size_t i = 0; i < model_.layers.size(); ++i) {
        const Layer& x = layers[i];
        test::DevTensor dq(x.q.view()), dk(x.k.view()), dv_(x.v.view()), dout(x.outg.view()),
            dlse(x.lseg.view());
        const LayerSpec& l = model_.layers[i];
        AttnArgs a;
        a.q = dq.view;
        a.k = dk.view;
        if (l.kind != LayerKind::mla) a.v = dv_.view;
        a.out = dout.view;
        a.lse = dlse.view;
        if (l.has_sinks) a.sinks = io_[i].sinks->as<float>();
        graphed_.forward(l.layer_id, a);
        EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        dout.download(x.outg.view());
        dlse.download(x.lseg.view());
      }
    }
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    for (size_t i = 0; i < model_.layers.size(); ++i) {
      Layer& x = layers[i];
      const LayerSpec& l = model_.layers[i];
      if (g != nullptr) {
        EXPECT_EQ(
            cudaMemcpy(x.outg.view().data, io_[i].out->ptr,
                       static_cast<size_t>(x.outg.view().numel()) * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
        EXPECT_EQ(cudaMemcpy(x.lseg.view().data, io_[i].lse->ptr,
                             static_cast<size_t>(x.lseg.view().numel()) * sizeof(float),
                             cudaMemcpyDeviceToHost),
                  cudaSuccess);
      }
      TensorView out = x.outg.view(), lse = x.lseg.view();
      out.shape[0] = T;
      lse.shape[0] = T;
      const std::string layer = what + ", layer " + std::to_string(l.layer_id);
      test::expect_close(out, x.out1.view(), kOutTol, layer + ": graphed group vs reference out");
      test::expect_close(lse, x.lse1.view(), kLseTol, layer + ": graphed group vs reference lse");
      test::expect_close(out, x.oute.view(), kOutTol, layer + ": graphed vs eager group out");
      test::expect_close(lse, x.lsee.view(), kLseTol, layer + ": graphed vs eager group lse");
      test::expect_close(x.oute.view(), x.out1.view(), kOutTol, layer + ": eager group out");
      // Rows past the step's tokens: no entry on any rank, merged to 0 with lse -inf (the
      // sink's logit, on a layer with sinks: the merge of nothing but the sink).
      const int hq = l.num_q_heads, dv = static_cast<int>(x.outg.view().shape[2]);
      int64_t bad = 0, first_bad = -1;
      for (int64_t t = T; t < rows; ++t) {
        for (int h = 0; h < hq; ++h) {
          const float want_lse =
              l.has_sinks ? io_[i].host_sinks[h] : -std::numeric_limits<float>::infinity();
          bool ok = x.lseg.view().ptr<float>()[t * hq + h] == want_lse;
          for (int j = 0; j < dv; ++j) {
            ok = ok && load_as_float(x.outg.view().data, DType::bf16,
                                     static_cast<size_t>((t * hq + h) * dv + j)) == 0.f;
          }
          if (!ok && bad++ == 0) first_bad = t;
        }
      }
      EXPECT_EQ(bad, 0) << layer << ": " << bad << " (row, head) pairs past the step's " << T
                        << " tokens are not 0 with lse -inf (or the sink), the first in row "
                        << first_bad;
    }
    one_->end_step();
    eager_.end();
    graphed_.end();
    return b;
  }

  // Both groups and the oracle keep a tree verify's accepted paths.
  void commit(DcpAttention& eager, DcpAttention& graphed, const ForwardBatch& verify,
              const std::vector<std::vector<int32_t>>& paths) {
    test::commit_accepted(*one_, eager, model_, verify, paths);
    graphed.commit_verify(verify, paths);
  }

 private:
  ModelSpec model_;
  Group eager_, graphed_;
  cudaStream_t stream_;
  std::mt19937 rng_;
  std::unique_ptr<AttentionRuntime> one_;
  std::vector<LayerIo> io_;
  std::string name_;
};

struct Case {
  int ranks;
  int page;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return "n" + std::to_string(info.param.ranks) + "_page" + std::to_string(info.param.page);
}

Options group_options(int ranks, int page, bool tree = false) {
  Options o;
  o.attention_backend = "cuda";
  o.dcp_size = ranks;
  o.page_size = page;
  if (tree) {
    o.speculative_num_steps = 3;
    o.speculative_eagle_topk = 2;
    o.speculative_num_draft_tokens = 6;
  }
  return o;
}

RuntimeConfig group_config(bool graphs) {
  RuntimeConfig c = test::host_config(8, 8192, 256);
  c.cuda_graphs = graphs;
  return c;
}

// Two groups of the case on one stream (the eager one and the graphed one, whose graph state
// holds steps of up to `max_rows` rows) and their harness.
struct Groups {
  Stream stream;
  std::unique_ptr<DcpAttention> eager, graphed;
  std::unique_ptr<GraphHarness> h;
  Groups(const ModelSpec& model, const Options& o, int max_rows, uint32_t seed) {
    eager = std::make_unique<DcpAttention>(model, o, group_config(false));
    graphed = std::make_unique<DcpAttention>(model, o, group_config(true));
    EXPECT_TRUE(graphed->cuda_graphs_enabled()) << graphed->cuda_graphs_off_reason();
    EXPECT_FALSE(eager->cuda_graphs_enabled());
    eager->set_stream(stream.s);
    graphed->set_stream(stream.s);
    graphed->init_cuda_graph_state(max_rows);
    h = std::make_unique<GraphHarness>(model, o, group_of(*eager), group_of(*graphed), stream.s,
                                       max_rows, seed);
  }
};

class CudaDcpGraphs : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    seed_ = test::test_seed();
    trace_.emplace(__FILE__, __LINE__, "ATTNRT_TEST_SEED=" + std::to_string(seed_));
  }
  std::vector<ModelSpec> models() const {
    return {GetParam().page == 1 ? test::dcp_gqa_model() : test::dcp_full_model(), test::dcp_mla_model()};
  }
  uint32_t seed_ = 0;
  std::optional<testing::ScopedTrace> trace_;
};

// A decode graph of 4 rows captured once, replayed for 3 requests over seven growing lengths (a
// padded row), then, after a fourth request's eager prefill, for all 4 (no padding).
TEST_P(CudaDcpGraphs, DecodeGraphReplaysGrowingDecodes) {
  const Case c = GetParam();
  for (const ModelSpec& model : models()) {
    Groups gs(model, group_options(c.ranks, c.page), 16, seed_);
    GraphHarness& h = *gs.h;
    const auto rows = h.alloc_requests(4);
    std::vector<int32_t> len;
    for (int i = 0; i < 3; ++i) len.push_back(h.rand_int(1, 70));
    h.run(make_extend_batch({rows[0], rows[1], rows[2]}, {0, 0, 0}, len), nullptr, "prompts");
    Graph g;
    h.capture(g, 4);
    const std::vector<int64_t> three = {rows[0], rows[1], rows[2]};
    for (int step = 0; step < 7; ++step) {
      for (int32_t& l : len) ++l;
      h.run(make_decode_batch(three, len), &g, "decode " + std::to_string(step));
    }
    len.push_back(h.rand_int(1, 40));
    h.run(make_extend_batch({rows[3]}, {0}, {len[3]}), nullptr, "a fourth prompt");
    for (int step = 0; step < 3; ++step) {
      for (int32_t& l : len) ++l;
      h.run(make_decode_batch(rows, len), &g, "decode of 4, " + std::to_string(step));
    }
  }
}

// A chain-verify graph of 3 requests x 4 drafts (12 rows) replayed over three verifies, each
// after a random acceptance of the last, then a decode through the same graph.
TEST_P(CudaDcpGraphs, ChainVerifyGraphReplaysVerifies) {
  const Case c = GetParam();
  const int n = 4;
  for (const ModelSpec& model : models()) {
    Groups gs(model, group_options(c.ranks, c.page), 16, seed_);
    GraphHarness& h = *gs.h;
    const auto rows = h.alloc_requests(3);
    std::vector<int32_t> len;
    for (int i = 0; i < 3; ++i) len.push_back(h.rand_int(1, 70));
    h.run(make_extend_batch(rows, {0, 0, 0}, len), nullptr, "prompts");
    Graph g;
    h.capture(g, 3 * n);
    for (int step = 0; step < 3; ++step) {
      h.run(make_verify_batch(rows, len, SpecInfo::chain(3, n)), &g,
            "chain verify " + std::to_string(step));
      for (int32_t& l : len) l += h.rand_int(1, n);  // the accepted tokens
    }
    for (int32_t& l : len) ++l;
    h.run(make_decode_batch(rows, len), &g, "decode after the verifies");
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CudaDcpGraphs,
                         testing::Values(Case{2, 1}, Case{3, 1}, Case{2, 16}, Case{3, 16}),
                         case_name);

// One graph of 16 rows serves every mode: a rank's batch is decode-shaped rows whatever the step.
// An EXTEND over prefixes with a new one-token prompt (a rank that holds no key of that row, and
// none at all of the first step's), decodes, a chain verify, a tree verify with its accepted
// paths committed, the decode after it; 2 and 3 ranks, page 1, the window model.
TEST(CudaDcpGraphsModes, OneGraphServesEveryMode) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE("ATTNRT_TEST_SEED=" + std::to_string(seed));
  for (const int ranks : {2, 3}) {
    Groups gs(test::dcp_gqa_model(), group_options(ranks, 1, /*tree=*/true), 16, seed + ranks);
    GraphHarness& h = *gs.h;
    const auto rows = h.alloc_requests(4);
    Graph g;
    h.capture(g, 16);
    // A first prompt of one token: only rank 0 holds a key, the other ranks have no entry.
    h.run(make_extend_batch({rows[0]}, {0}, {1}), &g, "a one-token prompt");
    std::vector<int32_t> len = {1, h.rand_int(2, 40), h.rand_int(2, 40)};
    h.run(make_extend_batch({rows[1], rows[2]}, {0, 0}, {len[1], len[2]}), nullptr, "prompts");
    const std::vector<int64_t> three = {rows[0], rows[1], rows[2]};
    const std::vector<int32_t> ext = {h.rand_int(1, 5), h.rand_int(1, 5), h.rand_int(1, 5)};
    h.run(make_extend_batch({rows[0], rows[1], rows[2], rows[3]}, {len[0], len[1], len[2], 0},
                            {ext[0], ext[1], ext[2], 1}),
          &g, "an extend over prefixes and a new one-token prompt");
    for (int i = 0; i < 3; ++i) len[i] += ext[i];
    len.push_back(1);
    for (int32_t& l : len) ++l;
    h.run(make_decode_batch(rows, len), &g, "decode");
    h.run(make_verify_batch(three, {len[0], len[1], len[2]}, SpecInfo::chain(3, 4)), &g,
          "chain verify");
    for (int i = 0; i < 3; ++i) len[i] += h.rand_int(1, 4) + 1;
    ++len[3];
    h.run(make_decode_batch(rows, len), &g, "decode after the chain");
    SpecInfo spec;
    spec.draft_token_num = 6;
    spec.topk = 2;
    for (int i = 0; i < 2; ++i) {
      for (int32_t p : {-1, 0, 0, 1, 2, 1}) spec.parents.push_back(p);
    }
    const std::vector<int64_t> two = {rows[1], rows[2]};
    const ForwardBatch v = h.run(make_verify_batch(two, {len[1], len[2]}, spec), &g, "tree verify");
    std::vector<std::vector<int32_t>> paths;
    for (int i = 0; i < 2; ++i) {
      std::mt19937 rng(seed + i);
      paths.push_back(test::random_path(spec.parents.data() + i * 6, 6, rng));
    }
    h.commit(*gs.eager, *gs.graphed, v, paths);
    len[1] += static_cast<int32_t>(paths[0].size()) + 1;
    len[2] += static_cast<int32_t>(paths[1].size()) + 1;
    ++len[0];
    ++len[3];
    h.run(make_decode_batch(rows, len), &g, "decode after the tree commit");
  }
}

// ---- what cannot be captured (docs/dcp.md "CUDA graphs") --------------------------------------

// A step that needs more rows than init_cuda_graph_state sized, a capture before it, a second
// init, a step begun with begin_step and then captured, host sinks or host tensors in a graph
// step, a replayed step of more tokens than the graph's rows: each refused with what to do, and
// the group goes on (a capture, replays) with the right outputs.
TEST(CudaDcpGraphErrors, WhatCannotBeCapturedIsRefused) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE("ATTNRT_TEST_SEED=" + std::to_string(seed));
  const ModelSpec model = test::dcp_full_model();
  const Options o = group_options(2, 1);
  {
    DcpAttention off(model, o, group_config(false));
    EXPECT_FALSE(off.cuda_graphs_enabled());
    test::expect_error([&] { off.init_cuda_graph_state(8); },
                       {"CUDA graphs are off", "RuntimeConfig::cuda_graphs is false"});
  }
  Stream s;
  DcpAttention eager(model, o, group_config(false)), g(model, o, group_config(true));
  eager.set_stream(s.s);
  g.set_stream(s.s);
  test::expect_error([&] { g.begin_capture_step(4); },
                     {"begin_capture_step", "call init_cuda_graph_state(max_num_tokens) first"});
  g.init_cuda_graph_state(8);
  test::expect_error([&] { g.begin_capture_step(9); },
                     {"begin_capture_step(9 tokens)", "steps of 1..8 tokens", "cannot grow them",
                      "max_num_tokens >= 9"});
  test::expect_error([&] { g.init_cuda_graph_state(16); },
                     {"init_cuda_graph_state(16)", "called with 8 already"});
  g.init_cuda_graph_state(8);  // the same size again: nothing to do
  GraphHarness h(model, o, group_of(eager), group_of(g), s.s, 8, seed);
  const auto rows = h.alloc_requests(2);
  std::vector<int32_t> len = {h.rand_int(3, 50), h.rand_int(3, 50)};
  h.run(make_extend_batch(rows, {0, 0}, len), nullptr, "prompts");

  // A step begun with begin_step whose forward is captured: refused before anything is enqueued.
  for (int32_t& l : len) ++l;
  ForwardBatch d = make_decode_batch(rows, len);
  test::place_on(h.oracle(), d);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  g.begin_step(d);
  const LayerSpec& l0 = model.layers[0];
  const LayerSpec& l1 = model.layers[1];  // with sinks
  auto captured = [&](const std::function<void()>& body) {
    ASSERT_EQ(cudaStreamBeginCapture(s.s, cudaStreamCaptureModeGlobal), cudaSuccess);
    try {
      body();
    } catch (...) {
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(s.s, &broken);
      if (broken != nullptr) cudaGraphDestroy(broken);
      cudaGetLastError();
      throw;
    }
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(s.s, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    FAIL() << "the capture was not refused";
  };
  test::expect_error([&] { captured([&] { g.forward(0, h.io()[0].args(l0, 2)); }); },
                     {"being captured into a CUDA graph", "begun with begin_step",
                      "begin_capture_step(tokens)", "init_cuda_graph_state"});
  g.end_step();
  // Host sinks and host tensors in a graph step: refused before any work is recorded.
  g.begin_capture_step(4);
  test::expect_error(
      [&] { captured([&] { g.forward(1, h.io()[1].args(l1, 4, /*with_sinks=*/false)); }); },
      {"layer 1's sinks are host memory in a CUDA-graph step", "GPU tensor"});
  HostBuffer hq(DType::bf16, {4, l0.num_q_heads, l0.head_dim});
  AttnArgs host = h.io()[0].args(l0, 4);
  host.q = hq.view();
  host.k = TensorView();
  host.v = TensorView();
  host.out = hq.view();
  host.lse = TensorView();
  test::expect_error([&] { g.forward(0, host); },
                     {"q is bf16[4, 8, 128]", "a CUDA-graph step", "takes GPU tensors"});
  g.end_step();
  // A replay of more tokens than the graph's rows changes nothing.
  Graph graph;
  h.capture(graph, 2);
  ForwardBatch ext = make_extend_batch(rows, {len[0] - 1, len[1] - 1}, {2, 1});
  ext.out_cache_loc.assign(3, 0);
  const size_t held = g.rank(1).local_row(static_cast<int>(rows[0])).size();
  test::expect_error([&] { g.begin_replay_step(ext, 2); },
                     {"the step has 3 tokens, more than the 2 rows of the graph", "at least 3 rows",
                      "begin_step"});
  EXPECT_EQ(g.rank(1).local_row(static_cast<int>(rows[0])).size(), held)
      << "the refused replay stored something";
  // The group goes on: the refused decode, then two more, replayed.
  h.run(d, &graph, "the decode a capture refused, replayed");
  for (int step = 0; step < 2; ++step) {
    for (int32_t& l : len) ++l;
    h.run(make_decode_batch(rows, len), &graph, "decode " + std::to_string(step));
  }
}

// Ranks on streams of their own cannot share a capture of the in-process exchange (the other
// ranks' work would be outside the graph): refused at the exchange, naming the ranks; and a
// barrier (a host wait) inside a capture is refused.
TEST(CudaDcpGraphErrors, ACapturedExchangeNeedsOneStream) {
  SKIP_WITHOUT_GPU();
  const ModelSpec model = test::dcp_full_model();
  Stream s0, s1;
  void* streams[] = {s0.s, s1.s};
  std::unique_ptr<Communicator> comm = make_device_in_process_communicator(2, streams);
  const Options o = group_options(2, 1);
  DcpRank r0(0, model, o, group_config(true), *comm), r1(1, model, o, group_config(true), *comm);
  r0.init_cuda_graph_state(4);
  r1.init_cuda_graph_state(4);
  r0.begin_capture_step(2);
  r1.begin_capture_step(2);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  test::DeviceMemory q(2 * 8 * 128 * 2), k(2 * 2 * 128 * 2), out(2 * 8 * 128 * 2);
  const Device gpu = Device::cuda(0);
  AttnArgs a;
  a.q = TensorView(q.ptr, DType::bf16, {2, 8, 128}, gpu);
  a.k = TensorView(k.ptr, DType::bf16, {2, 2, 128}, gpu);
  a.v = a.k;
  a.out = TensorView(out.ptr, DType::bf16, {2, 8, 128}, gpu);
  ASSERT_EQ(cudaStreamBeginCapture(s0.s, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string error;
  try {
    r0.forward(0, a);
  } catch (const Error& e) {
    error = e.what();
  }
  try {
    comm->barrier(0);
  } catch (const Error& e) {
    error += std::string(" | ") + e.what();
  }
  cudaGraph_t broken = nullptr;
  cudaStreamEndCapture(s0.s, &broken);
  if (broken != nullptr) cudaGraphDestroy(broken);
  cudaGetLastError();
  for (const char* want :
       {"rank 0's stream captures a CUDA graph but rank 1 runs on another stream",
        "every rank of the group on the capturing stream", "barrier of rank 0 while its stream",
        "captures a CUDA graph"}) {
    EXPECT_NE(error.find(want), std::string::npos) << "missing '" << want << "' in: " << error;
  }
  r0.end_step();
  r1.end_step();
}

// One rank over NCCL (a group of this GPU): its all-to-all (ncclSend / ncclRecv to itself) is
// captured on the rank's stream with the rest of the step; a decode graph replayed over growing
// lengths against the same rank run eagerly and `reference`. Skips where NCCL cannot be loaded.
TEST(CudaDcpNcclGraphs, OneRankGraphReplaysDecodes) {
  SKIP_WITHOUT_GPU();
  if (const std::string why = nccl_unavailable_reason(); !why.empty()) {
    GTEST_SKIP() << "NCCL: " << why;
  }
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE("ATTNRT_TEST_SEED=" + std::to_string(seed));
  const std::vector<int> devices = {0};
  Stream s;
  void* streams[] = {s.s};
  std::vector<std::unique_ptr<Communicator>> eager_comm = make_nccl_group(devices, streams);
  std::vector<std::unique_ptr<Communicator>> graph_comm = make_nccl_group(devices, streams);
  const ModelSpec model = test::dcp_full_model();
  const Options o = group_options(1, 16);
  DcpRank eager(0, model, o, group_config(false), *eager_comm[0]);
  DcpRank graphed(0, model, o, group_config(true), *graph_comm[0]);
  EXPECT_EQ(graphed.stream(), s.s);
  ASSERT_TRUE(graphed.cuda_graphs_enabled()) << graphed.cuda_graphs_off_reason();
  graphed.init_cuda_graph_state(8);
  GraphHarness h(model, o, group_of(eager), group_of(graphed), s.s, 8, seed);
  const auto rows = h.alloc_requests(3);
  std::vector<int32_t> len = {h.rand_int(1, 70), h.rand_int(1, 70), h.rand_int(1, 70)};
  h.run(make_extend_batch(rows, {0, 0, 0}, len), nullptr, "prompts");
  Graph g;
  h.capture(g, 4);
  for (int step = 0; step < 4; ++step) {
    for (int32_t& l : len) ++l;
    h.run(make_decode_batch(rows, len), &g, "decode " + std::to_string(step));
  }
}

// `attnrt run --dcp-size 2 --attention-backend cuda`: the ranks replay their DECODE and
// TARGET_VERIFY steps from graphs they capture (chains at page 16, trees at page 1; the demo
// model's window layer at page 1), every layer compared with the single runtime; the notes say how
// many steps replayed graphs.
TEST(CudaDcpRun, CudaRanksReplayDecodeAndVerifyGraphs) {
  SKIP_WITHOUT_GPU();
  for (const int topk : {1, 2}) {
    SCOPED_TRACE(testing::Message() << "topk " << topk);
    Options o = test::speculative_options("cuda", topk);
    o.page_size = topk == 1 ? 16 : 1;
    o.dcp_size = 2;
    sim::RunConfig rc = test::small_run_config(4096, 2, 17 + topk);
    rc.scheduler.spec.accept_prob = 0.7;
    ModelSpec model = model_preset("demo");
    if (o.page_size > 1) {  // a window's key lists need page size 1 on cuda ranks
      std::erase_if(model.layers, [](const LayerSpec& l) { return l.sliding_window >= 0; });
      for (size_t i = 0; i < model.layers.size(); ++i)
        model.layers[i].layer_id = static_cast<int>(i);
    }
    const sim::RunReport r = sim::run_trace(model, o, test::four_request_trace("dcp-run"), rc);
    EXPECT_TRUE(r.ok()) << sim::format_report(r);
    std::string note;
    for (const std::string& n : r.notes) {
      if (n.rfind("dcp: CUDA graphs: ", 0) == 0) note = n;
    }
    ASSERT_FALSE(note.empty()) << sim::format_report(r);
    EXPECT_GT(std::atoi(note.c_str() + std::strlen("dcp: CUDA graphs: ")), 0) << note;
    bool compared = false;
    for (const std::string& n : r.notes) {
      compared = compared || (n.rfind("dcp: 2 simulated ranks", 0) == 0 &&
                              n.find(" 0 beyond tolerance") != std::string::npos);
    }
    EXPECT_TRUE(compared) << sim::format_report(r);
  }
}

#endif  // ATTNRT_HAS_CUDA

}  // namespace
}  // namespace attnrt
