// Hybrid models end to end through AttentionRuntime: selection of the linear backends (auto, by
// option, split by phase), HybridLinearAttnBackend routing, and a run of EXTEND, DECODE,
// TARGET_VERIFY + commit, DECODE on a model with gdn, full, mamba2 and kda layers where every
// output and the committed states of the cpu runtime match a reference runtime fed the same
// inputs (fp32 against float64: 2e-4 + 2e-3 |x|). Plus the errors of misuse.
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <map>
#include <numeric>

#include "attnrt/backend/hybrid_attn_backend.h"
#include "attnrt/backend/hybrid_linear_attn_backend.h"
#include "attnrt/backend/selection.h"
#include "attnrt/runtime/attention_runtime.h"
#include "test_linear_util.h"

using namespace attnrt;
using namespace attnrt::testing_linear;

namespace {

ModelSpec hybrid_model() { return hybrid_linear_model("tiny-hybrid-linear", 256); }

CudaDeviceInfo no_gpu() {
  CudaDeviceInfo d;
  d.reason = "no CUDA device in this test";
  return d;
}

bool any_reason(const Selection& s, const std::string& text) {
  for (const std::string& r : s.reasons) {
    if (r.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(LinearSelection, CpuIsAutoSelectedForLinearLayersAndOptionsSplitByPhase) {
  const ModelSpec m = hybrid_model();
  Selection s = resolve_backends(Options{}, m, Registry::global(), no_gpu());
  EXPECT_EQ(s.linear_prefill, "cpu");
  EXPECT_EQ(s.linear_decode, "cpu");
  EXPECT_TRUE(any_reason(s, "linear prefill: cpu (auto)"))
      << fmt::format("{}", fmt::join(s.reasons, "\n"));

  Options o;
  o.linear_attn_backend = "cpu";
  o.linear_attn_decode_backend = "reference";
  o.speculative_num_steps = 2;
  o.speculative_attention_mode = "decode";
  s = resolve_backends(o, m, Registry::global(), no_gpu());
  EXPECT_EQ(s.linear_prefill, "cpu");
  EXPECT_EQ(s.linear_decode, "reference");
  EXPECT_TRUE(any_reason(s, "linear decode: reference — set by --linear-attn-decode-backend"));
  // --explain says which backend serves which layers.
  EXPECT_TRUE(any_reason(
      s,
      "layers: HybridLinearAttnBackend routes attention 1 of 4 layers: 1 to cpu (prefill and "
      "decode); gdn 1 of 4 layers: 0; mamba2 1 of 4 layers: 2; kda 1 of 4 layers: 3 to cpu "
      "(linear prefill) / reference (linear decode); TARGET_VERIFY and the state commit after it "
      "run on the linear decode backend"))
      << fmt::format("{}", fmt::join(s.reasons, "\n"));

  // The built object: HybridLinearAttnBackend around the full backend, with both linear sides.
  LinearStateConfig lc;
  lc.max_slots = lc.max_request_rows = 2;
  LinearStatePool pool(m, lc);
  BackendContext ctx;
  ctx.model = &m;
  ctx.options = &o;
  ctx.linear_state = &pool;
  auto backend = create_backend(s, ctx);
  auto* hybrid = dynamic_cast<HybridLinearAttnBackend*>(backend.get());
  ASSERT_NE(hybrid, nullptr);
  EXPECT_EQ(hybrid->full_backend().name(), "cpu");
  EXPECT_EQ(hybrid->linear_backend(ForwardMode::EXTEND).name(), "cpu");
  EXPECT_EQ(hybrid->linear_backend(ForwardMode::MIXED).name(), "cpu");
  EXPECT_EQ(hybrid->linear_backend(ForwardMode::DECODE).name(), "reference");
  // Verify follows --speculative-attention-mode, so the commit goes where the checkpoints are.
  EXPECT_EQ(hybrid->linear_backend(ForwardMode::TARGET_VERIFY).name(), "reference");
  EXPECT_TRUE(hybrid->is_full_layer(1));
  EXPECT_FALSE(hybrid->is_full_layer(0));

  // A linear option naming a backend without linear kernels is rejected with the alternatives.
  Registry r;
  BackendEntry plain = Registry::global().get("cpu");
  plain.name = "fullonly";
  plain.caps.linear_kinds.clear();
  plain.linear_factory = nullptr;
  r.add(Registry::global().get("reference"));
  r.add(Registry::global().get("cpu"));
  r.add(plain);
  Options bad;
  bad.linear_attn_prefill_backend = "fullonly";
  expect_error([&] { resolve_backends(bad, m, r, no_gpu()); },
               {"--linear-attn-prefill-backend fullonly: backend 'fullonly' does not serve gdn "
                "layers",
                "Use instead: --linear-attn-prefill-backend cpu or reference"});
}

// One runtime plus the per-layer parameters; every step's inputs come from the caller.
struct Engine {
  std::unique_ptr<AttentionRuntime> rt;
  std::vector<int> rows;
  std::vector<std::vector<int64_t>> slots;  // per request: KV slot of each token

  Engine(const ModelSpec& m, const std::string& backend, const Options& base) {
    Options o = base;
    o.attention_backend = backend;
    o.linear_attn_backend = backend;
    RuntimeConfig c;
    c.max_requests = 4;
    c.kv_slots = 1024;
    rt = std::make_unique<AttentionRuntime>(m, o, c);
  }

  void add_request() {
    const int row = rt->req_to_token().alloc();
    rt->linear_state().alloc_for(row);
    rows.push_back(row);
    slots.emplace_back();
  }

  // Allocates and maps `new_tokens[i]` slots after each request's first `keep[i]` tokens.
  std::vector<int64_t> map(const std::vector<int32_t>& keep,
                           const std::vector<int32_t>& new_tokens) {
    std::vector<int64_t> out;
    for (size_t i = 0; i < rows.size(); ++i) {
      slots[i].resize(static_cast<size_t>(keep[i]));
      const int32_t prefix[] = {keep[i]};
      const int32_t seq[] = {keep[i] + new_tokens[i]};
      const int64_t last[] = {keep[i] > 0 ? slots[i].back() : -1};
      std::vector<int64_t> got = rt->allocator().alloc_extend(prefix, seq, last);
      rt->req_to_token().write(rows[i], keep[i], got);
      slots[i].insert(slots[i].end(), got.begin(), got.end());
      out.insert(out.end(), got.begin(), got.end());
    }
    return out;
  }
};

TEST(LinearRuntime, CpuMatchesReferenceThroughExtendDecodeVerifyAndCommit) {
  const ModelSpec m = hybrid_model();
  Options spec;
  spec.speculative_num_steps = 2;  // chain of N = 3
  std::mt19937 rng(77);
  std::map<int, LayerData> data;
  for (const LayerSpec& l : m.layers) {
    if (is_linear_kind(l.kind)) data.emplace(l.layer_id, LayerData(l, rng));
  }
  Engine cpu(m, "cpu", spec), ref(m, "reference", spec);
  for (Engine* e : {&cpu, &ref}) {
    e->add_request();
    e->add_request();
  }
  EXPECT_EQ(cpu.rt->linear_state().config().num_draft_tokens, 3);

  auto run_step = [&](ForwardBatch batch, const std::vector<int32_t>& keep,
                      const std::vector<int32_t>& fresh, const std::string& what) {
    const int64_t T =
        batch.extend_seq_lens.empty()
            ? (batch.spec_info ? int64_t{batch.batch_size} * batch.spec_info->draft_token_num
                               : batch.batch_size)
            : std::accumulate(batch.extend_seq_lens.begin(), batch.extend_seq_lens.end(),
                              int64_t{0});
    std::vector<ForwardBatch> batches;
    for (Engine* e : {&cpu, &ref}) {
      ForwardBatch b = batch;
      b.req_pool_indices.assign(e->rows.begin(), e->rows.end());
      b.out_cache_loc = e->map(keep, fresh);
      batches.push_back(std::move(b));
    }
    for (size_t k = 0; k < 2; ++k) (k == 0 ? cpu : ref).rt->begin_step(batches[k]);
    for (const LayerSpec& l : m.layers) {
      std::vector<float> outs[2];
      if (is_linear_kind(l.kind)) {
        const Tokens in = random_tokens(data.at(l.layer_id), T, rng);
        for (size_t k = 0; k < 2; ++k) {
          outs[k].assign(static_cast<size_t>(T * data.at(l.layer_id).out_width()), std::nanf(""));
          Engine& e = k == 0 ? cpu : ref;
          std::vector<float> x = in.x, a = in.a, b = in.b;
          const LayerData& d = data.at(l.layer_id);
          LinearArgs args;
          args.mixed_qkv = TensorView(x.data(), DType::f32, {T, d.shape.conv_dim});
          args.conv_weight = TensorView(const_cast<float*>(d.conv_w.data()), DType::f32,
                                        {d.shape.conv_dim, l.linear.conv_kernel});
          args.conv_bias =
              TensorView(const_cast<float*>(d.conv_b.data()), DType::f32, {d.shape.conv_dim});
          args.A_log = TensorView(const_cast<float*>(d.A_log.data()), DType::f32, {d.shape.heads});
          if (l.kind == LayerKind::kda) {
            args.a = TensorView(a.data(), DType::f32, {T, d.shape.heads, l.linear.head_k_dim});
            args.dt_bias = TensorView(const_cast<float*>(d.dt_bias.data()), DType::f32,
                                      {d.shape.heads, l.linear.head_k_dim});
          } else {
            args.a = TensorView(a.data(), DType::f32, {T, d.shape.heads});
            args.dt_bias =
                TensorView(const_cast<float*>(d.dt_bias.data()), DType::f32, {d.shape.heads});
          }
          if (l.kind == LayerKind::mamba2) {
            args.D = TensorView(const_cast<float*>(d.D.data()), DType::f32, {d.shape.heads});
          } else {
            args.b = TensorView(b.data(), DType::f32, {T, d.shape.heads});
          }
          args.out = TensorView(outs[k].data(), DType::f32, {T, d.shape.heads, d.shape.rows});
          e.rt->forward_linear(l.layer_id, args);
        }
      } else {
        std::uniform_real_distribution<float> u(-1.f, 1.f);
        std::vector<float> q(static_cast<size_t>(T * 4 * 16)), kk(static_cast<size_t>(T * 2 * 16)),
            v(kk.size());
        for (auto* vec : {&q, &kk, &v}) {
          for (float& e : *vec) e = u(rng);
        }
        for (size_t k = 0; k < 2; ++k) {
          outs[k].assign(q.size(), std::nanf(""));
          AttnArgs args;
          args.q = TensorView(q.data(), DType::f32, {T, 4, 16});
          args.k = TensorView(kk.data(), DType::f32, {T, 2, 16});
          args.v = TensorView(v.data(), DType::f32, {T, 2, 16});
          args.out = TensorView(outs[k].data(), DType::f32, {T, 4, 16});
          (k == 0 ? cpu : ref).rt->forward(l.layer_id, args);
        }
      }
      const double w = worst(outs[0], outs[1], 2e-4, 2e-3);
      EXPECT_LE(w, 1.0) << what << ", layer " << l.layer_id << " (" << layer_kind_name(l.kind)
                        << "): worst error " << w << " x the tolerance";
    }
    for (Engine* e : {&cpu, &ref}) e->rt->end_step();
  };

  run_step(make_extend_batch({0, 1}, {0, 0}, {13, 6}), {0, 0}, {13, 6}, "EXTEND");
  run_step(make_decode_batch({0, 1}, {14, 7}), {13, 6}, {1, 1}, "DECODE");
  run_step(make_verify_batch({0, 1}, {14, 7}, SpecInfo::chain(2, 3)), {14, 7}, {3, 3},
           "TARGET_VERIFY");
  const std::vector<int32_t> accepted = {2, 0};
  for (Engine* e : {&cpu, &ref}) e->rt->update_state_after_verify(accepted);
  for (const LayerSpec& l : m.layers) {
    if (!is_linear_kind(l.kind)) continue;
    const LinearLayerState& a = cpu.rt->linear_state().layer(l.layer_id);
    const LinearLayerState& b = ref.rt->linear_state().layer(l.layer_id);
    for (int r = 0; r < 2; ++r) {
      const int slot = cpu.rt->linear_state().slot_of(cpu.rows[r]);
      std::vector<float> sa, sb;
      for (int64_t i = 0; i < a.shape.ssm_elems(); ++i) {
        sa.push_back(static_cast<float*>(a.ssm)[a.ssm_offset(slot) + i]);
        sb.push_back(static_cast<float*>(b.ssm)[b.ssm_offset(slot) + i]);
      }
      EXPECT_LE(worst(sa, sb, 2e-4, 2e-3), 1.0)
          << "committed state, layer " << l.layer_id << ", request " << r;
    }
  }
  // Decode on: request 0 kept 3 block tokens (14 + 3), request 1 one (7 + 1).
  run_step(make_decode_batch({0, 1}, {18, 9}), {17, 8}, {1, 1}, "DECODE after the commit");
}

TEST(LinearRuntime, RejectsMisuse) {
  const ModelSpec m = hybrid_model();
  Options o;
  o.attention_backend = "cpu";
  RuntimeConfig c;
  c.max_requests = 2;
  c.kv_slots = 256;
  AttentionRuntime rt(m, o, c);
  const int row = rt.req_to_token().alloc();
  rt.linear_state().alloc_for(row);
  std::vector<int64_t> slots = rt.allocator().alloc_extend(
      std::vector<int32_t>{0}, std::vector<int32_t>{3}, std::vector<int64_t>{-1});
  rt.req_to_token().write(row, 0, slots);
  ForwardBatch b = make_extend_batch({row}, {0}, {3});
  b.out_cache_loc = slots;
  rt.begin_step(b);
  expect_error([&] { rt.forward(0, AttnArgs{}); },
               {"layer 0 is a gdn layer", "call forward_linear"});
  expect_error([&] { rt.forward_linear(1, LinearArgs{}); },
               {"layer 1 is a full layer", "call forward(layer, AttnArgs)"});
  expect_error([&] { rt.forward_linear(9, LinearArgs{}); }, {"layer 9 is not a layer of model"});
  rt.end_step();
  expect_error([&] { rt.update_state_after_verify(std::vector<int32_t>{0}); },
               {"the last step was EXTEND", "once after a TARGET_VERIFY step"});
  // No speculative options: the pool keeps no checkpoints and a verify step says how to get them.
  std::vector<int64_t> drafts = rt.allocator().alloc_extend(
      std::vector<int32_t>{3}, std::vector<int32_t>{5}, std::vector<int64_t>{slots.back()});
  rt.req_to_token().write(row, 3, drafts);
  ForwardBatch v = make_verify_batch({row}, {3}, SpecInfo::chain(1, 2));
  v.out_cache_loc = drafts;
  expect_error([&] { rt.begin_step(v); },
               {"keeps no per-token checkpoints", "--speculative-num-steps"});

  const ModelSpec dense =
      test::make_model("dense", DType::f32, 64, {test::attention_layer(0, 4, 2, 16)});
  AttentionRuntime plain(dense, o, c);
  EXPECT_FALSE(plain.has_linear_layers());
  expect_error([&] { plain.linear_state(); }, {"model 'dense' has no linear-attention layers"});
}

}  // namespace
