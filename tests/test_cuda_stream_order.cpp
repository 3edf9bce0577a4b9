// The stream order of everything the host hands the GPU, under stress (docs/cuda_graphs.md, "What
// orders a host write before the GPU reads it"). A serving trace -- chunked prefill on cached
// shared prefixes, DECODE steps as CUDA graphs, TARGET_VERIFY chain and tree graphs whose accepted
// paths are moved inside the pools, linear-attention layers -- runs twice on the cuda backend:
//   ahead:  the host never waits for the GPU. Every step starts with a delay kernel on the
//           runtime's stream, so the GPU falls steps behind; inputs come from pinned host memory
//           (truly asynchronous copies) into device buffers and outputs stay on the GPU until the
//           end. The legacy default stream, which the runtime's non-blocking stream does not wait
//           for, is held back by a gate while the runtime is built and while the first graph step
//           gets its inputs, and released from the runtime's stream only after its K/V stores and
//           input copies: work that reached the legacy stream instead of the runtime's (a plain
//           cudaMemset of the pools or of the graphs' static tensors) then lands on data in use.
//   steady: the same trace eagerly, step by step, waiting for each step.
// Every layer's output of every step must agree (graph and eager steps split differently, so up
// to rounding). Cases: page sizes 1 to 128, bf16 / fp8 e4m3 / fp8 e5m2 KV, decode, chain and tree
// verify, a GDN hybrid (graphs off there: the linear state path runs eagerly ahead of the GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "attnrt/core/dtype.h"
#include "attnrt/memory/linear_state_pool.h"
#include "attnrt/runtime/attention_runtime.h"
#include "tools/sim/scheduler.h"
#include "tools/sim/trace.h"
#include "tools/sim/scheduler.h"
#include "tools/sim/trace.h"
#include "tests/test_cuda_util.h"
#include "tests/test_util.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/kernels/gpu_hold.h"
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

struct Case {
  const char* name;
  int page;
  const char* kv_dtype;
  int spec_steps = 0, topk = 0, draft_tokens = 0;
  bool hybrid = false;
};

std::string case_name(const testing::TestParamInfo<Case>& info) { return info.param.name; }

// The trace of the report that found the race (page 64: its first DECODE step, 17, is the first
// graph step): ragged prompts around page boundaries, a shared system prompt, a late arrival.
sim::Trace stress_trace(bool shared_prefixes) {
  const char* text = R"({"id": "a0", "arrival_step": 0, "prompt_len": 1, "output_len": 8}
{"id": "a1", "arrival_step": 0, "prompt_len": 2, "output_len": 4}
{"id": "a2", "arrival_step": 0, "prompt_len": 15, "output_len": 9}
{"id": "a3", "arrival_step": 1, "prompt_len": 16, "output_len": 5}
{"id": "a4", "arrival_step": 1, "prompt_len": 17, "output_len": 4}
{"id": "a5", "arrival_step": 1, "prompt_len": 63, "output_len": 9, "shared_prefix": "sysA", "shared_prefix_len": 33}
{"id": "a6", "arrival_step": 2, "prompt_len": 64, "output_len": 8}
{"id": "a7", "arrival_step": 2, "prompt_len": 65, "output_len": 8}
{"id": "a8", "arrival_step": 2, "prompt_len": 40, "output_len": 11}
{"id": "a9", "arrival_step": 3, "prompt_len": 130, "output_len": 5, "shared_prefix": "sysA", "shared_prefix_len": 33}
{"id": "a10", "arrival_step": 3, "prompt_len": 200, "output_len": 10}
{"id": "a11", "arrival_step": 3, "prompt_len": 9, "output_len": 5}
{"id": "late", "arrival_step": 14, "prompt_len": 70, "output_len": 6, "shared_prefix": "sysA", "shared_prefix_len": 33})";
  sim::Trace t = sim::parse_trace(text, "stress");
  if (!shared_prefixes) {
    // The linear state at a prefix's end is not snapshotted: hybrid runs prefill it themselves.
    for (sim::TraceRequest& r : t.requests) {
      r.shared_prefix.clear();
      r.shared_prefix_len = 0;
    }
  }
  return t;
}

using test::attention_layer;

// Qwen2.5-7B's attention shape (28 q / 4 kv heads of 128, as in the report) and a GQA-4 layer of
// 64; the hybrid puts a Gated DeltaNet layer first.
ModelSpec stress_model(bool hybrid) {
  ModelSpec m;
  m.name = hybrid ? "stress-hybrid" : "stress";
  m.dtype = DType::bf16;
  m.max_context_len = 1024;
  if (hybrid) {
    LayerSpec g;
    g.layer_id = 0;
    g.kind = LayerKind::gdn;
    g.linear = LinearSpec{.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 128,
                          .head_v_dim = 128, .conv_kernel = 4, .chunk_size = 64};
    m.layers = {g, attention_layer(1, 28, 4, 128)};
  } else {
    m.layers = {attention_layer(0, 28, 4, 128), attention_layer(1, 8, 2, 64)};
  }
  return m;
}

// Elements per token of a layer's inputs and output.
struct Widths {
  int64_t in[3] = {0, 0, 0};  // q, k, v | mixed_qkv, a, b
  int64_t out = 0;
  int64_t total() const { return in[0] + in[1] + in[2] + out; }
};

Widths widths(const LayerSpec& l) {
  Widths w;
  if (is_linear_kind(l.kind)) {
    const LinearStateShape sh = linear_state_shape(l);
    w.in[0] = sh.conv_dim;
    w.in[1] = sh.heads;
    w.in[2] = sh.heads;
    w.out = int64_t{sh.heads} * sh.rows;
  } else {
    w.in[0] = int64_t{l.num_q_heads} * l.head_dim;
    w.in[1] = int64_t{l.num_kv_heads} * l.head_dim;
    w.in[2] = int64_t{l.num_kv_heads} * l.v_head_dim;
    w.out = int64_t{l.num_q_heads} * l.v_head_dim;
  }
  return w;
}

// Random bf16 values of a step's inputs, drawn from (case, step, layer, part) alone, so that both
// runs read the same numbers whatever else they draw.
void fill_inputs(uint16_t* dst, int64_t n, uint64_t seed, float amp) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-amp, amp);
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(u(rng));
}

using test::PinnedMem;

// Fixed per-layer weights of a linear layer (fp32, on the GPU), as attnrt run draws them.
struct LinearWeights {
  std::vector<std::unique_ptr<test::DeviceMemory>> keep;
  TensorView conv_w, conv_b, A_log, dt_bias;
};

LinearWeights linear_weights(const LayerSpec& l, cudaStream_t stream) {
  const LinearStateShape sh = linear_state_shape(l);
  std::mt19937 rng(1234 + l.layer_id);
  LinearWeights w;
  auto make = [&](std::initializer_list<int64_t> shape, float center, float scale) {
    HostBuffer h(DType::f32, shape);
    std::uniform_real_distribution<float> u(-scale, scale);
    for (int64_t i = 0; i < h.numel(); ++i) h.ptr<float>()[i] = center + u(rng);
    w.keep.push_back(std::make_unique<test::DeviceMemory>(h.bytes()));
    EXPECT_EQ(cudaMemcpyAsync(w.keep.back()->ptr, h.data(), h.bytes(), cudaMemcpyHostToDevice,
                              stream),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    TensorView t = h.view();
    t.data = w.keep.back()->ptr;
    t.device = Device::cuda(0);
    return t;
  };
  w.conv_w = make({sh.conv_dim, l.linear.conv_kernel}, 0.f, 0.6f);
  w.conv_b = make({sh.conv_dim}, 0.f, 0.3f);
  w.A_log = make({sh.heads}, -0.5f, 1.f);
  w.dt_bias = make({sh.heads}, 0.f, 1.f);
  return w;
}

// What a run left: each target step's signature and every layer's output (bf16 bits, model order).
struct RunLog {
  struct Step {
    ForwardMode mode = ForwardMode::IDLE;
    bool graph = false;
    std::vector<int64_t> rows, slots;
    int64_t tokens = 0;
    std::vector<std::vector<uint16_t>> out;  // [layer][tokens x width]
  };
  std::vector<Step> steps;
  int graph_steps = 0;
  int32_t gates[2][2] = {{0, 0}, {0, 0}};  // ahead: the two holds' gate words
};

constexpr int kMaxSteps = 256;
constexpr int kPoolGateStep = 3;             // the pools' gate opens after this step's stores
constexpr uint64_t kStepDelayNs = 300'000;   // ahead: GPU delay at the start of every step
constexpr uint64_t kGraphDelayNs = 2'000'000;
constexpr uint64_t kHoldTimeoutNs = 4'000'000'000;

RunLog run_trace(const Case& c, bool ahead) {
  const ModelSpec model = stress_model(c.hybrid);
  const sim::Trace trace = stress_trace(!c.hybrid);
  const bool spec = c.spec_steps > 0;
  const int N = spec ? c.draft_tokens : 1;
  sim::SchedulerConfig sc;
  sc.max_running_requests = 16;
  sc.chunked_prefill_size = 48;
  sc.page_size = c.page;
  sc.seed = 456;
  sc.spec.num_steps = c.spec_steps;
  sc.spec.topk = std::max(c.topk, 1);
  sc.spec.num_draft_tokens = c.draft_tokens;
  const int max_tokens = std::max(sc.chunked_prefill_size, sc.max_running_requests * N);
  int context = 1;
  for (const sim::TraceRequest& r : trace.requests)
    context = std::max(context, r.prompt_len + r.output_len + N);

  Options o;
  o.attention_backend = "cuda";
  o.page_size = c.page;
  o.kv_cache_dtype = c.kv_dtype;
  o.speculative_num_steps = c.spec_steps;
  o.speculative_eagle_topk = c.topk;
  o.speculative_num_draft_tokens = c.draft_tokens;
  const RuntimeConfig rc{.max_requests = sc.max_running_requests,
                         .kv_slots = 16384,
                         .max_num_tokens = max_tokens,
                         .max_context_len = context,
                         .cuda_graphs = ahead};

  RunLog log;
  // Device buffers and pinned inputs of every step, allocated before anything is held (a
  // cudaFree or cudaFreeHost would wait for the whole device, the hold included).
  int64_t per_token = 0;
  for (const LayerSpec& l : model.layers) per_token += widths(l).total();
  const size_t step_bytes = static_cast<size_t>(max_tokens) * per_token * 2;
  const int arena_steps = ahead ? kMaxSteps : 1;
  test::DeviceMemory dev(step_bytes * arena_steps);
  PinnedMem pinned(ahead ? step_bytes * arena_steps : 16);
  std::vector<uint16_t> host_in(ahead ? 1 : step_bytes / 2);
  test::DeviceMemory gates(4 * sizeof(int32_t));

  // The legacy stream is held until step kPoolGateStep's stores were issued on the runtime's
  // stream: a pool initialisation queued there lands after them. Both holds' gate words are
  // cleared here, before anything is held: a clear queued later on the legacy stream would wait
  // behind this hold and could erase a signal already given (a verify trace's first graph step
  // can come before kPoolGateStep; its hold then waits behind this one and finds the gate open).
  if (ahead) {
    EXPECT_EQ(cudaMemset(gates.ptr, 0, 4 * sizeof(int32_t)), cudaSuccess);
    EXPECT_EQ(cuda::gate_hold(gates.as<int32_t>(), kHoldTimeoutNs, nullptr), cudaSuccess);
  }
  AttentionRuntime rt(model, o, rc);
  auto* cache = dynamic_cast<cuda::CudaKVCache*>(&rt.kv_cache());
  EXPECT_NE(cache, nullptr);
  if (cache == nullptr) return log;
  const cudaStream_t stream = cache->stream();
  if (ahead) {
    EXPECT_TRUE(rt.cuda_graphs_enabled() || c.hybrid) << rt.cuda_graphs_off_reason();
  }
  std::map<int, LinearWeights> lw;
  for (const LayerSpec& l : model.layers)
    if (is_linear_kind(l.kind)) lw.emplace(l.layer_id, linear_weights(l, stream));

  // The draft model's pools for the scheduler's bookkeeping (its steps are not run here).
  std::unique_ptr<AttentionRuntime> draft;
  if (spec) {
    ModelSpec dm;
    dm.name = "stress-draft";
    dm.dtype = model.dtype;
    dm.max_context_len = model.max_context_len;
    dm.layers = {attention_layer(0, 4, 4, 64)};
    Options od = o;
    od.attention_backend = "reference";
    od.kv_cache_dtype = "auto";
    RuntimeConfig dc = rc;
    dc.cuda_graphs = false;
    draft = std::make_unique<AttentionRuntime>(dm, od, dc);
  }
  std::vector<int> kv_layers;
  for (const LayerSpec& l : model.layers)
    if (l.uses_kv_cache()) kv_layers.push_back(l.layer_id);
  sim::Scheduler sched(
      trace, sc, sim::KvSpace{&rt.req_to_token(), &rt.allocator(), &rt.kv_cache(), kv_layers},
      draft ? std::optional<sim::KvSpace>(
                  sim::KvSpace{&draft->req_to_token(), &draft->allocator(), nullptr, {}})
            : std::nullopt);

  std::map<int, int> linear_rows;  // trace index -> request row holding a linear-state slot
  bool first_graph = true;
  int index = 0;
  while (!sched.done()) {
    const sim::ScheduledStep& s = sched.next();
    const ForwardBatch& b = s.batch;
    const int64_t T = b.num_tokens();
    if (s.role != sim::ModelRole::target || T == 0) {
      sched.complete();
      continue;
    }
    EXPECT_LT(index, kMaxSteps);
    if (index >= kMaxSteps) break;
    RunLog::Step rec;
    rec.mode = b.mode;
    rec.rows = b.req_pool_indices;
    rec.slots = b.out_cache_loc;
    rec.tokens = T;
    if (rt.has_linear_layers()) {
      LinearStatePool& states = rt.linear_state();
      for (size_t i = 0; i < s.requests.size(); ++i) {
        const int row = static_cast<int>(b.req_pool_indices[i]);
        if (states.slot_of(row) < 0) {
          states.alloc_for(row);
          linear_rows[s.requests[i]] = row;
        }
      }
    }
    if (ahead) EXPECT_EQ(cuda::launch_gpu_delay(kStepDelayNs, stream), cudaSuccess);

    // This step's inputs: drawn on the host, copied to device buffers on the runtime's stream
    // (pinned, so the copy reads the host memory when it runs: each step has its own).
    char* dev_step = dev.as<char>() + (ahead ? step_bytes * index : 0);
    uint16_t* host_step =
        ahead ? reinterpret_cast<uint16_t*>(static_cast<char*>(pinned.ptr) + step_bytes * index)
              : host_in.data();
    struct LayerIo {
      TensorView in[3], out;
    };
    std::vector<LayerIo> io;
    int64_t off = 0;
    for (size_t li = 0; li < model.layers.size(); ++li) {
      const LayerSpec& l = model.layers[li];
      const Widths w = widths(l);
      LayerIo x;
      for (int p = 0; p < 3; ++p) {
        const int64_t n = T * w.in[p];
        const uint64_t seed = (uint64_t{static_cast<uint32_t>(index)} << 24) ^ (li << 8) ^ p ^
                              (uint64_t{static_cast<uint32_t>(c.page)} << 40);
        fill_inputs(host_step + off, n, seed, p == 0 ? 2.f : (is_linear_kind(l.kind) ? 2.5f : 1.f));
        void* d = dev_step + off * 2;
        EXPECT_EQ(cudaMemcpyAsync(d, host_step + off, n * 2, cudaMemcpyHostToDevice, stream),
                  cudaSuccess);
        x.in[p] = TensorView(d, DType::bf16, {T, w.in[p]}, Device::cuda(0));
        off += n;
      }
      x.out = TensorView(dev_step + off * 2, DType::bf16, {T, w.out}, Device::cuda(0));
      EXPECT_EQ(cudaMemsetAsync(x.out.data, 0xff, T * w.out * 2, stream), cudaSuccess);  // NaN
      off += T * w.out;
      io.push_back(x);
    }
    if (!ahead) EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

    rec.graph = ahead && rt.cuda_graph_bucket(b) > 0;
    if (rec.graph) {
      ++log.graph_steps;
      if (first_graph) {
        // The legacy stream is held while the static tensors are made and filled: a zeroing of
        // them queued there lands on the inputs (or on the output) of this step.
        EXPECT_EQ(cuda::gate_hold(gates.as<int32_t>() + 2, kHoldTimeoutNs, nullptr), cudaSuccess);
      }
      for (size_t li = 0; li < model.layers.size(); ++li) {
        const LayerSpec& l = model.layers[li];
        const GraphLayerIO g = rt.graph_io(l.layer_id, T);
        for (int p = 0; p < 3; ++p) {
          const TensorView& dst = p == 0 ? g.q : (p == 1 ? g.k : g.v);
          EXPECT_EQ(cudaMemcpyAsync(dst.data, io[li].in[p].data, io[li].in[p].numel() * 2,
                                    cudaMemcpyDeviceToDevice, stream),
                    cudaSuccess);
        }
        EXPECT_EQ(cudaMemsetAsync(g.out.data, 0xff, io[li].out.numel() * 2, stream), cudaSuccess);
      }
      if (first_graph) {
        EXPECT_EQ(cuda::gate_signal(gates.as<int32_t>() + 2, stream), cudaSuccess);
        EXPECT_EQ(cuda::launch_gpu_delay(kGraphDelayNs, stream), cudaSuccess);
        first_graph = false;
      }
      rt.forward_step_graph(b);
      for (size_t li = 0; li < model.layers.size(); ++li) {
        const GraphLayerIO g = rt.graph_io(model.layers[li].layer_id, T);
        EXPECT_EQ(cudaMemcpyAsync(io[li].out.data, g.out.data, io[li].out.numel() * 2,
                                  cudaMemcpyDeviceToDevice, stream),
                  cudaSuccess);
      }
    } else {
      rt.begin_step(b);
      for (size_t li = 0; li < model.layers.size(); ++li) {
        const LayerSpec& l = model.layers[li];
        const LayerIo& x = io[li];
        if (is_linear_kind(l.kind)) {
          const LinearStateShape sh = linear_state_shape(l);
          const LinearWeights& w = lw.at(l.layer_id);
          LinearArgs a;
          a.mixed_qkv = x.in[0];
          a.a = x.in[1];
          a.b = x.in[2];
          a.conv_weight = w.conv_w;
          a.conv_bias = w.conv_b;
          a.A_log = w.A_log;
          a.dt_bias = w.dt_bias;
          a.out = TensorView(x.out.data, DType::bf16, {T, sh.heads, sh.rows}, Device::cuda(0));
          rt.forward_linear(l.layer_id, a);
        } else {
          AttnArgs a;
          a.q = TensorView(x.in[0].data, DType::bf16, {T, l.num_q_heads, l.head_dim},
                           Device::cuda(0));
          a.k = TensorView(x.in[1].data, DType::bf16, {T, l.num_kv_heads, l.head_dim},
                           Device::cuda(0));
          a.v = TensorView(x.in[2].data, DType::bf16, {T, l.num_kv_heads, l.v_head_dim},
                           Device::cuda(0));
          a.out = TensorView(x.out.data, DType::bf16, {T, l.num_q_heads, l.v_head_dim},
                             Device::cuda(0));
          rt.forward(l.layer_id, a);
        }
      }
      rt.end_step();
    }
    if (ahead && index == kPoolGateStep)
      EXPECT_EQ(cuda::gate_signal(gates.as<int32_t>(), stream), cudaSuccess);
    if (!ahead) {
      // Steady: wait for the step and keep its outputs.
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      for (const LayerIo& x : io) {
        std::vector<uint16_t> h(static_cast<size_t>(x.out.numel()));
        EXPECT_EQ(cudaMemcpy(h.data(), x.out.data, h.size() * 2, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        rec.out.push_back(std::move(h));
      }
    } else {
      for (const LayerIo& x : io) rec.out.emplace_back(static_cast<size_t>(x.out.numel()));
    }
    const bool verify_with_state = rt.has_linear_layers() && is_target_verify(b.mode);
    sched.complete();
    if (verify_with_state) {
      std::vector<int32_t> last;
      for (const std::vector<int>& path : sched.last_accepted_paths())
        last.push_back(path.empty() ? -1 : path.back());
      rt.update_state_after_verify(last);
    }
    for (auto it = linear_rows.begin(); it != linear_rows.end();) {
      if (sched.requests()[static_cast<size_t>(it->first)].phase ==
          sim::RequestState::Phase::finished) {
        rt.linear_state().free_for(it->second);
        it = linear_rows.erase(it);
      } else {
        ++it;
      }
    }
    log.steps.push_back(std::move(rec));
    ++index;
  }
  if (ahead) {
    // Only now does the host wait: every step's outputs are still where the step left them.
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t si = 0; si < log.steps.size(); ++si) {
      RunLog::Step& rec = log.steps[si];
      const char* dev_step = dev.as<char>() + step_bytes * si;
      int64_t off = 0;
      for (size_t li = 0; li < model.layers.size(); ++li) {
        const Widths w = widths(model.layers[li]);
        off += rec.tokens * (w.in[0] + w.in[1] + w.in[2]);
        EXPECT_EQ(cudaMemcpy(rec.out[li].data(), dev_step + off * 2, rec.out[li].size() * 2,
                             cudaMemcpyDeviceToHost),
                  cudaSuccess);
        off += rec.tokens * w.out;
      }
    }
    EXPECT_EQ(cudaMemcpy(log.gates, gates.ptr, sizeof(log.gates), cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return log;
}

class CudaStreamOrder : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaStreamOrder, HostAheadOfABusyGpuGivesTheOutputsOfSteadySteps) {
  const Case& c = GetParam();
  // The holds spin until a kernel of another stream opens them: load the gate kernels first, so
  // that no lazy module load has to wait for a spinning hold.
  {
    test::DeviceMemory warm(4 * sizeof(int32_t));
    ASSERT_EQ(cudaMemset(warm.ptr, 0, 4 * sizeof(int32_t)), cudaSuccess);
    ASSERT_EQ(cuda::gate_signal(warm.as<int32_t>(), nullptr), cudaSuccess);
    ASSERT_EQ(cuda::gate_hold(warm.as<int32_t>(), 1000, nullptr), cudaSuccess);
    ASSERT_EQ(cuda::launch_gpu_delay(1000, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // The steady run first: it also loads every kernel the run ahead launches while a hold waits.
  const RunLog steady = run_trace(c, false);
  const RunLog ahead = run_trace(c, true);
  ASSERT_EQ(steady.steps.size(), ahead.steps.size());
  ASSERT_GT(ahead.steps.size(), 10u);
  if (!c.hybrid) {
    EXPECT_GT(ahead.graph_steps, 0);
    EXPECT_EQ(ahead.gates[1][1], 1) << "the graphs' hold ended by its timeout, not its signal";
  }
  EXPECT_EQ(ahead.gates[0][1], 1) << "the pools' hold ended by its timeout, not its signal";
  int bad_steps = 0;
  for (size_t si = 0; si < steady.steps.size(); ++si) {
    const RunLog::Step& e = steady.steps[si];
    const RunLog::Step& g = ahead.steps[si];
    ASSERT_EQ(e.mode, g.mode) << "step " << si;
    ASSERT_EQ(e.rows, g.rows) << "step " << si;
    ASSERT_EQ(e.slots, g.slots) << "step " << si;
    for (size_t li = 0; li < e.out.size(); ++li) {
      double num = 0, den = 0, worst = 0;
      int64_t nonfinite = 0;
      for (size_t i = 0; i < e.out[li].size(); ++i) {
        const double a = bf16_to_float(g.out[li][i]), b = bf16_to_float(e.out[li][i]);
        if (!std::isfinite(a) || !std::isfinite(b)) {
          ++nonfinite;
          continue;
        }
        num += (a - b) * (a - b);
        den += b * b;
        worst = std::max(worst, std::abs(a - b));
      }
      const double rel = std::sqrt(num / std::max(den, 1e-30));
      const bool ok = nonfinite == 0 && rel < 1.2e-2 && worst < 0.05;
      if (!ok && ++bad_steps <= 8) {
        ADD_FAILURE() << "step " << si << " (" << forward_mode_name(e.mode)
                      << (g.graph ? ", graph" : ", eager") << ", " << e.tokens
                      << " tokens), layer " << li << ": relative error " << rel
                      << ", max abs " << worst << ", " << nonfinite << " non-finite";
      }
    }
  }
  EXPECT_EQ(bad_steps, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaStreamOrder,
    testing::Values(Case{"decode_p64_e5m2", 64, "fp8_e5m2"}, Case{"decode_p64_bf16", 64, "bf16"},
                    Case{"decode_p1_bf16", 1, "bf16"}, Case{"decode_p128_e4m3", 128, "fp8_e4m3"},
                    Case{"chain_p16_e4m3", 16, "fp8_e4m3", 3, 1, 4},
                    Case{"tree_p128_bf16", 128, "bf16", 3, 2, 6},
                    Case{"tree_p32_e5m2", 32, "fp8_e5m2", 2, 2, 4},
                    Case{"hybrid_p16_bf16", 16, "bf16", 0, 0, 0, true},
                    Case{"hybrid_chain_p64_bf16", 64, "bf16", 3, 1, 4, true}),
    case_name);

#else

TEST(CudaStreamOrder, NeedsACudaBuild) {
  GTEST_SKIP() << "attnrt was built without CUDA: " << query_cuda().reason;
}

#endif

}  // namespace
}  // namespace attnrt
