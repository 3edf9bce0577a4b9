// What a CUDA graph saves on a whole decode step: a 32-layer model's step issued layer by layer
// (the plan, then a KV store, an attention kernel and possibly a merge per layer) against the same
// step replayed as one graph. Measured through AttentionRuntime, as an engine would run it.
#include <fmt/format.h>

#include <chrono>
#include <random>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/runtime/attention_runtime.h"
#include "bench/harness/runner.h"

namespace attnrt::bench {

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

GraphOverhead measure_graph_overhead(const BenchConfig& config) {
  constexpr int kLayers = 32, kBatch = 64, kLen = 1024, kPage = 16;
  GraphOverhead g;
  g.layers = kLayers;
  g.shape = fmt::format("decode {}x{}, {} layers (32 q / 8 KV heads, d128, page {})", kBatch, kLen,
                        kLayers, kPage);
  try {
    ModelSpec model;
    model.name = "bench-32-layers";
    model.dtype = DType::bf16;
    model.max_context_len = kLen;
    for (int i = 0; i < kLayers; ++i) {
      LayerSpec l;
      l.layer_id = i;
      l.num_q_heads = 32;
      l.num_kv_heads = 8;
      l.head_dim = l.v_head_dim = 128;
      model.layers.push_back(l);
    }
    Options options;
    options.attention_backend = config.backend;
    options.page_size = kPage;
    options.deterministic = config.deterministic;
    RuntimeConfig rc;
    rc.max_requests = kBatch;
    rc.kv_slots = int64_t{kBatch} * kLen;
    rc.max_num_tokens = kBatch;
    rc.cuda_graph_batch_sizes = {kBatch};
    AttentionRuntime rt(model, options, rc);
    ATTNRT_CHECK(rt.cuda_graphs_enabled(), "CUDA graphs are off: {}", rt.cuda_graphs_off_reason());

    std::vector<int64_t> rows;
    std::vector<int64_t> write;
    for (int i = 0; i < kBatch; ++i) {
      const int row = rt.req_to_token().alloc();
      const std::vector<int32_t> zero{0}, len{kLen};
      const std::vector<int64_t> none{-1};
      const std::vector<int64_t> slots = rt.allocator().alloc_extend(zero, len, none);
      rt.req_to_token().write(row, 0, slots);
      rows.push_back(row);
      write.push_back(slots.back());
    }
    ForwardBatch batch = make_decode_batch(rows, std::vector<int32_t>(kBatch, kLen));
    batch.out_cache_loc = write;

    // Random activations in the static tensors (the pools stay zero: the kernels' time does not
    // depend on the values).
    std::mt19937 rng(static_cast<uint32_t>(config.seed));
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<AttnArgs> args;
    for (const LayerSpec& l : model.layers) {
      const GraphLayerIO io = rt.graph_io(l.layer_id, kBatch);
      for (const TensorView* t : {&io.q, &io.k, &io.v}) {
        HostBuffer h(t->dtype, {t->numel()});
        for (int64_t i = 0; i < h.numel(); ++i) h.ptr<uint16_t>()[i] = float_to_bf16(u(rng));
        rt.copy_tensor(*t, TensorView(h.data(), t->dtype, {t->shape[0], t->shape[1], t->shape[2]}));
      }
      AttnArgs a;
      a.q = io.q;
      a.k = io.k;
      a.v = io.v;
      a.out = io.out;
      args.push_back(a);
    }

    const int repeats = std::max(config.repeats, 30);
    std::vector<double> eager_issue, eager_step, graph_issue, graph_step;
    for (int i = 0; i < repeats + 3; ++i) {
      rt.synchronize();
      double t0 = now();
      rt.begin_step(batch);
      for (const LayerSpec& l : model.layers) rt.forward(l.layer_id, args[l.layer_id]);
      rt.end_step();
      double t1 = now();
      rt.synchronize();
      double t2 = now();
      if (i >= 3) {
        eager_issue.push_back(t1 - t0);
        eager_step.push_back(t2 - t0);
      }
      rt.synchronize();
      t0 = now();
      rt.forward_step_graph(batch);  // the first one captures
      t1 = now();
      rt.synchronize();
      t2 = now();
      if (i >= 3) {
        graph_issue.push_back(t1 - t0);
        graph_step.push_back(t2 - t0);
      }
    }
    g.eager_issue = TimingStats::from_samples(eager_issue);
    g.eager_step = TimingStats::from_samples(eager_step);
    g.graph_issue = TimingStats::from_samples(graph_issue);
    g.graph_step = TimingStats::from_samples(graph_step);
  } catch (const Error& e) {
    g.error = e.what();
  }
  return g;
}

}  // namespace attnrt::bench
