// The cuda backend's linear-attention side (gdn, kda, mamba2) against the reference backend on the
// same inputs and the same starting states: EXTEND from zeros and from a cached prefix state,
// DECODE, MIXED, TARGET_VERIFY (chain and tree) with the commit after it, DRAFT_EXTEND; fp32 and
// bf16 state; small ragged layers (the generic kernels) and the real head dims of 128 (the vector
// kernels). Outputs are NaN-poisoned before every step (Harness::run_layer), so an unwritten
// element fails. Inputs are fresh random numbers each run; the seed is printed (ATTNRT_TEST_SEED
// replays one).
// Also: verify + commit of k accepted tokens equals sequential decoding of them on the GPU (every
// k of a chain, every node of a tree); one-token steps of 300 requests; device tensors with bf16 activations and padded token
// strides; a bad call throws attnrt::Error and leaves the pool unchanged. A timing test prints
// the decode kernels' bandwidth at the Qwen3-Next and Nemotron-H shapes (never asserts on time).
// Tolerances: fp32 state, fp32 kernels vs float64: 2e-4 + 2e-3 |x| (outputs and states); bf16
// state (rounded after every decode / verify token, by both): 3e-2 + 3e-2 |x|. Steps with extend
// requests longer than a chunk (64 tokens) at the 128-wide shapes take the chunked kernels (bf16
// tensor-core products): 2e-2 max |reference| over each compared tensor, as their own tests.
// Skips (with the reason) where no CUDA device is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/linear_state_pool.h"
#include "tests/test_cuda_util.h"
#include "tests/test_linear_util.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/cuda_linear_backend.h"
#include "backends/cuda/cuda_linear_state.h"
#endif

namespace attnrt {
namespace {

using namespace attnrt::testing_linear;

#ifdef ATTNRT_HAS_CUDA

using test::test_seed;

// The real models' head dims: Qwen3-Next (GDN) and Kimi-Linear (KDA) Dk = Dv = 128, Nemotron-H
// (Mamba2) head_dim 64, d_state 128; fewer heads, to keep the float64 reference quick.
LayerSpec real_layer(LayerKind kind) {
  LayerSpec l = small_layer(kind);  // the head and group counts, but KDA's
  LinearSpec& s = l.linear;
  s.chunk_size = 64;
  switch (kind) {
    case LayerKind::gdn:
      s.head_k_dim = s.head_v_dim = 128;
      break;
    case LayerKind::kda:
      s.num_k_heads = s.num_v_heads = 2;
      s.head_k_dim = s.head_v_dim = 128;
      break;
    default:
      s.head_v_dim = 64;
      s.d_state = 128;
      break;
  }
  return l;
}

struct Case {
  LayerKind kind;
  DType state;
  bool real_dims;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return kind_label(info.param.kind) + "_" + std::string(dtype_name(info.param.state)) +
         (info.param.real_dims ? "_dims128" : "_small");
}

struct Tol {
  double atol, rtol;
};

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::abs(x)));
  return m;
}

// The chunked kernels' bound: 2e-2 of the largest reference value (plus `rtol`).
void expect_chunked_close(const std::vector<float>& got, const std::vector<float>& want,
                          double rtol, const std::string& what) {
  const double atol = 2e-2 * std::max(max_abs(want), 1e-3);
  const double w = worst(got, want, atol, rtol);
  EXPECT_LE(w, 1.0) << what << ": worst error " << w << " x the tolerance (atol " << atol
                    << " = 2e-2 max |reference|, rtol " << rtol << ")";
}

class CudaLinear : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    seed_ = test_seed();
    std::printf("[ seed     ] ATTNRT_TEST_SEED=%u\n", seed_);
    rng_.seed(seed_);
    const Case& c = GetParam();
    data_ =
        std::make_unique<LayerData>(c.real_dims ? real_layer(c.kind) : small_layer(c.kind), rng_);
    tol_ = c.state == DType::f32 ? Tol{2e-4, 2e-3} : Tol{3e-2, 3e-2};
  }

  std::unique_ptr<Harness> gpu(int slots, int verify_rows = 0, int n = 0) {
    return std::make_unique<Harness>(*data_, "cuda", slots, verify_rows, n, GetParam().state,
                                     cuda::make_cuda_linear_state_memory(nullptr));
  }
  std::unique_ptr<Harness> ref(int slots, int verify_rows = 0, int n = 0) {
    return std::make_unique<Harness>(*data_, "reference", slots, verify_rows, n, GetParam().state);
  }

  // The same random conv window and state in `slot` of both pools.
  void random_state(Harness& a, Harness& b, int slot) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<float> v(static_cast<size_t>(data_->shape.conv_elems() + data_->shape.ssm_elems()));
    for (float& e : v) e = u(rng_) * 0.5f;
    a.set_state(slot, v);
    b.set_state(slot, v);
  }

  void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                    const std::string& what) {
    const double w = worst(got, want, tol_.atol, tol_.rtol);
    EXPECT_LE(w, 1.0) << what << ": worst error " << w << " x the tolerance (atol " << tol_.atol
                      << ", rtol " << tol_.rtol << "), seed " << seed_;
  }

  // One step on both; outputs compared (`chunked`: the step takes the chunked kernels).
  void both(Harness& g, Harness& r, const ForwardBatch& b, const Tokens& in,
            const std::string& what, bool chunked = false) {
    const std::vector<float> got = g.run(b, in), want = r.run(b, in);
    if (chunked) {
      expect_chunked_close(got, want, 0.0, what + ": outputs (chunked)");
    } else {
      expect_close(got, want, what + ": outputs");
    }
  }

  void same_slots(Harness& g, Harness& r, const std::vector<int>& slots, const std::string& what,
                  bool chunked = false) {
    for (int s : slots) {
      const std::string label = what + ": state of slot " + std::to_string(s);
      if (chunked) {
        expect_chunked_close(g.state(s), r.state(s), 0.0, label + " (chunked)");
      } else {
        expect_close(g.state(s), r.state(s), label);
      }
    }
  }

  unsigned seed_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<LayerData> data_;
  Tol tol_{};
};

TEST_P(CudaLinear, ExtendFromZerosAndFromAPrefixStateMatchesReference) {
  auto g = gpu(6);
  auto r = ref(6);
  for (int i = 0; i < 4; ++i) {
    g->pool().alloc_for(i);
    r->pool().alloc_for(i);
  }
  // Requests 2 and 3 continue a cached prefix: their slots hold a state.
  random_state(*g, *r, g->pool().slot_of(2));
  random_state(*g, *r, g->pool().slot_of(3));
  // Lengths across the conv kernel's 64-token chunks: 1, 70, 5, 130. At the 128-wide shapes the
  // two long requests take the chunked kernels, the short ones the recurrent one.
  const bool chunked = GetParam().real_dims;
  const std::vector<int32_t> lens = {1, 70, 5, 130};
  Tokens in;
  for (int32_t n : lens) append(in, random_tokens(*data_, n, rng_));
  both(*g, *r, with_slots(make_extend_batch({0, 1, 2, 3}, {0, 0, 7, 30}, lens)), in, "EXTEND",
       chunked);
  same_slots(*g, *r, {1, 2, 3, 4}, "EXTEND", chunked);
  // Decode from there: the states the two forms left continue the same way.
  both(*g, *r, with_slots(make_decode_batch({0, 1, 2, 3}, {2, 71, 13, 161})),
       random_tokens(*data_, 4, rng_), "DECODE after EXTEND", chunked);
}

TEST_P(CudaLinear, DecodeAndMixedStepsMatchReference) {
  auto g = gpu(6);
  auto r = ref(6);
  std::vector<int64_t> rows;
  for (int i = 0; i < 5; ++i) {
    g->pool().alloc_for(i);
    r->pool().alloc_for(i);
    random_state(*g, *r, g->pool().slot_of(i));
    rows.push_back(i);
  }
  std::vector<int32_t> seq = {4, 9, 17, 3, 40};
  for (int step = 0; step < 3; ++step) {
    for (int32_t& s : seq) ++s;
    both(*g, *r, with_slots(make_decode_batch(rows, seq)), random_tokens(*data_, 5, rng_),
         "DECODE step " + std::to_string(step));
  }
  same_slots(*g, *r, {1, 2, 3, 4, 5}, "DECODE");
  const std::vector<int32_t> lens = {1, 9, 1, 20, 1};
  both(*g, *r, with_slots(make_extend_batch(rows, seq, lens, ForwardMode::MIXED)),
       random_tokens(*data_, 32, rng_), "MIXED");
  same_slots(*g, *r, {1, 2, 3, 4, 5}, "MIXED");
  // DRAFT_EXTEND: accept lengths + 1 tokens per request.
  for (int i = 0; i < 5; ++i) seq[i] += lens[i];
  std::vector<int32_t> accept = {0, 2, 1, 3, 0};
  std::vector<int32_t> after(5);
  int64_t tokens = 0;
  for (int i = 0; i < 5; ++i) {
    after[i] = seq[i] + accept[i] + 1;
    tokens += accept[i] + 1;
  }
  both(*g, *r, with_slots(make_draft_extend_batch(rows, after, accept)),
       random_tokens(*data_, tokens, rng_), "DRAFT_EXTEND");
  same_slots(*g, *r, {1, 2, 3, 4, 5}, "DRAFT_EXTEND");
}

// One-token steps over more requests than the persistent decode grid has CTAs (264 at the
// 128-wide shapes on an H200), so that its CTAs take several items of several requests: a
// one-token EXTEND of a third of them from zeros, then two DECODE steps of all; outputs and every
// slot's window and state.
TEST_P(CudaLinear, OneTokenStepsOverManyRequestsMatchReference) {
  const int bs = 300;
  auto g = gpu(bs + 1);
  auto r = ref(bs + 1);
  std::vector<int64_t> rows, fresh;
  std::vector<int32_t> seq;
  for (int i = 0; i < bs; ++i) {
    g->pool().alloc_for(i);
    r->pool().alloc_for(i);
    rows.push_back(i);
    if (i % 3 == 0) {
      fresh.push_back(i);
      seq.push_back(1);
    } else {
      random_state(*g, *r, g->pool().slot_of(i));
      seq.push_back(10 + i);
    }
  }
  const auto n_fresh = static_cast<int64_t>(fresh.size());
  both(*g, *r,
       with_slots(make_extend_batch(fresh, std::vector<int32_t>(fresh.size(), 0),
                                    std::vector<int32_t>(fresh.size(), 1))),
       random_tokens(*data_, n_fresh, rng_), "one-token EXTEND from zeros");
  for (int step = 0; step < 2; ++step) {
    for (int32_t& n : seq) ++n;
    both(*g, *r, with_slots(make_decode_batch(rows, seq)), random_tokens(*data_, bs, rng_),
         "DECODE step " + std::to_string(step) + " of " + std::to_string(bs) + " requests");
  }
  std::vector<int> slots;
  for (int i = 0; i < bs; ++i) slots.push_back(g->pool().slot_of(i));
  same_slots(*g, *r, slots, "one-token steps");
}

// Verify of a chain and of a tree against reference: outputs, every checkpoint, slots left alone;
// then the commit.
TEST_P(CudaLinear, VerifyChainAndTreeCheckpointsAndCommitMatchReference) {
  const std::vector<std::vector<int32_t>> shapes = {{-1, 0, 1, 2, 3}, {-1, 0, 0, 1, 1, 2, 4}};
  for (const std::vector<int32_t>& parents : shapes) {
    const int n = static_cast<int>(parents.size());
    const bool tree = n == 7;
    SCOPED_TRACE(tree ? "tree" : "chain");
    auto g = gpu(4, 3, n);
    auto r = ref(4, 3, n);
    for (int i = 0; i < 3; ++i) {
      g->pool().alloc_for(i);
      r->pool().alloc_for(i);
    }
    // Requests 0 and 2 continue a state; request 1 starts from zeros (no prefix).
    random_state(*g, *r, 1);
    random_state(*g, *r, 3);
    const std::vector<float> slot_before = g->state(1);
    SpecInfo spec;
    spec.draft_token_num = n;
    spec.topk = tree ? 2 : 1;
    for (int i = 0; i < 3; ++i)
      spec.parents.insert(spec.parents.end(), parents.begin(), parents.end());
    both(*g, *r, with_slots(make_verify_batch({0, 1, 2}, {12, 0, 33}, spec)),
         random_tokens(*data_, 3 * n, rng_), tree ? "TARGET_VERIFY tree" : "TARGET_VERIFY chain");
    for (int i = 0; i < 3; ++i) {
      for (int t = 0; t < n; ++t) {
        expect_close(g->checkpoint(i, t), r->checkpoint(i, t),
                     "checkpoint of request " + std::to_string(i) + ", token " + std::to_string(t));
      }
    }
    EXPECT_EQ(g->state(1), slot_before) << "verify changed a committed state";
    const std::vector<int32_t> accepted = {n - 1, -1, 2};
    g->backend().update_state_after_verify(accepted);
    r->backend().update_state_after_verify(accepted);
    same_slots(*g, *r, {1, 2, 3}, "commit");
    EXPECT_EQ(g->state(1), g->checkpoint(0, n - 1)) << "the commit copies the checkpoint";
  }
}

// Exactness on the GPU: verify + commit of block token s leaves the slot in the state that
// sequential decoding of the path root -> s gives.
TEST_P(CudaLinear, VerifyCommitEqualsSequentialDecodeOfTheAcceptedPath) {
  const Tol tight{1e-5, 1e-4};
  for (const std::vector<int32_t>& parents :
       std::vector<std::vector<int32_t>>{{-1, 0, 1, 2}, {-1, 0, 0, 1, 2, 2}}) {
    const int n = static_cast<int>(parents.size());
    const int bs = n + 1;  // request i accepts token i; the last accepts nothing
    auto g = gpu(bs + 1, bs, n);
    auto seq = gpu(bs + 1);
    const int32_t prefix = 6;
    const Tokens pre = random_tokens(*data_, prefix, rng_);
    const Tokens block = random_tokens(*data_, n, rng_);
    std::vector<int64_t> rows;
    Tokens pres, blocks;
    SpecInfo spec;
    spec.draft_token_num = n;
    spec.topk = 2;
    for (int i = 0; i < bs; ++i) {
      g->pool().alloc_for(i);
      rows.push_back(i);
      append(pres, pre);
      append(blocks, block);
      spec.parents.insert(spec.parents.end(), parents.begin(), parents.end());
    }
    g->run(with_slots(make_extend_batch(rows, std::vector<int32_t>(bs, 0),
                                        std::vector<int32_t>(bs, prefix))),
           pres);
    const std::vector<float> at_prefix = g->state(g->pool().slot_of(0));
    g->run(with_slots(make_verify_batch(rows, std::vector<int32_t>(bs, prefix), spec)), blocks);
    std::vector<int32_t> accepted(bs);
    std::iota(accepted.begin(), accepted.end(), 0);
    accepted[n] = -1;
    g->backend().update_state_after_verify(accepted);
    for (int s = 0; s < n; ++s) {
      std::vector<int> path;
      for (int u = s; u >= 0; u = parents[u]) path.insert(path.begin(), u);
      seq->pool().alloc_for(s);
      seq->run(with_slots(make_extend_batch({s}, {0}, {prefix})), pre);
      int32_t len = prefix;
      for (int u : path) {
        seq->run(with_slots(make_decode_batch({s}, {++len})), slice(block, *data_, u, u + 1));
      }
      const double w = worst(g->state(g->pool().slot_of(s)), seq->state(seq->pool().slot_of(s)),
                             tight.atol, tight.rtol);
      EXPECT_LE(w, 1.0) << "block token " << s << " (path of " << path.size()
                        << " tokens): committed state vs sequential decode, worst error " << w
                        << " x the tolerance; seed " << seed_;
    }
    EXPECT_EQ(g->state(g->pool().slot_of(n)), at_prefix) << "last_accepted -1 must keep the state";
  }
}

// DECODE steps whose recurrence is launched as the conv's dependent (kernels/dependent_launch.cuh:
// it loads its first state rows while the conv runs and reads y only after its wait) give the bits
// of plain launches, step after step: a recurrence that read y early would see the previous step's
// y, or the one before it.
TEST_P(CudaLinear, DependentDecodeLaunchesGiveTheBitsOfPlainLaunches) {
  if (!GetParam().real_dims) GTEST_SKIP() << "the persistent decode kernel takes 128-column states";
  const int bs = 24, steps = 6;
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<std::vector<float>> states(bs);
  for (std::vector<float>& v : states) {
    v.resize(static_cast<size_t>(data_->shape.conv_elems() + data_->shape.ssm_elems()));
    for (float& e : v) e = u(rng_) * 0.5f;
  }
  std::vector<Tokens> inputs;
  for (int s = 0; s < steps; ++s) inputs.push_back(random_tokens(*data_, bs, rng_));
  // Every step's outputs, then every slot's final state.
  auto run = [&](bool dependent) {
    test::DependentLaunches mode(dependent);
    auto g = gpu(bs + 1);
    std::vector<int64_t> rows;
    for (int i = 0; i < bs; ++i) {
      g->pool().alloc_for(i);
      g->set_state(g->pool().slot_of(i), states[i]);
      rows.push_back(i);
    }
    std::vector<int32_t> seq(bs);
    for (int i = 0; i < bs; ++i) seq[i] = 3 + i;
    std::vector<float> all;
    for (int s = 0; s < steps; ++s) {
      for (int32_t& n : seq) ++n;
      const std::vector<float> out = g->run(with_slots(make_decode_batch(rows, seq)), inputs[s]);
      all.insert(all.end(), out.begin(), out.end());
    }
    for (int i = 0; i < bs; ++i) {
      const std::vector<float> st = g->state(g->pool().slot_of(i));
      all.insert(all.end(), st.begin(), st.end());
    }
    return all;
  };
  const std::vector<float> plain = run(false);
  for (int round = 0; round < 3; ++round) {
    const std::vector<float> dependent = run(true);
    ASSERT_EQ(dependent.size(), plain.size());
    size_t differ = 0;
    for (size_t i = 0; i < plain.size(); ++i)
      differ += std::memcmp(&dependent[i], &plain[i], sizeof(float)) != 0;
    EXPECT_EQ(differ, 0u) << "round " << round << ": " << differ << " of " << plain.size()
                          << " outputs / state elements differ from plain launches; seed "
                          << seed_;
  }
}

TEST_P(CudaLinear, BadCallThrowsAndLeavesThePoolUnchanged) {
  auto g = gpu(3, 2, 3);
  g->pool().alloc_for(0);
  auto r = ref(3);
  r->pool().alloc_for(0);
  random_state(*g, *r, 1);
  const std::vector<float> before = g->state(1);
  const Tokens in = random_tokens(*data_, 3, rng_);
  const ForwardBatch ext = with_slots(make_extend_batch({0}, {5}, {3}));
  g->backend().init_forward_metadata(ext);
  std::vector<float> out(static_cast<size_t>(3 * data_->out_width()));
  LinearArgs bad = g->args(in, out);
  bad.mixed_qkv.shape[1] += 1;
  test::expect_error([&] { g->backend().forward_linear(bad, data_->layer, ext); },
                     {"cuda linear backend: mixed_qkv is fp32[3, ",
                      "[tokens, conv_dim] = [3, " + std::to_string(data_->shape.conv_dim) + "]"});
  bad = g->args(in, out);
  std::vector<uint16_t> half_bias(data_->dt_bias.size());
  bad.dt_bias = TensorView(half_bias.data(), DType::bf16, {bad.dt_bias.shape[0]});
  if (data_->layer.kind == LayerKind::kda) bad.dt_bias.ndim = 1;
  test::expect_error([&] { g->backend().forward_linear(bad, data_->layer, ext); }, {"dt_bias"});
  EXPECT_EQ(g->state(1), before) << "a rejected call changed the state";
  // A bad commit: index out of range, nothing copied.
  g->run(with_slots(make_verify_batch({0}, {5}, SpecInfo::chain(1, 3))), in);
  test::expect_error([&] { g->backend().update_state_after_verify(std::vector<int32_t>{3}); },
                     {"last accepted index 3 of request 0 is out of range -1..2"});
  EXPECT_EQ(g->state(1), before) << "a rejected commit changed the state";
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (bool real : {false, true}) {
    for (LayerKind k : {LayerKind::gdn, LayerKind::kda, LayerKind::mamba2}) {
      for (DType t : {DType::f32, DType::bf16}) v.push_back({k, t, real});
    }
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Kinds, CudaLinear, testing::ValuesIn(all_cases()), case_name);

// Production placement: every tensor on the GPU, bf16 activations with padded token strides.
TEST(CudaLinearDevice, DeviceTensorsWithBf16ActivationsAndPaddedStridesMatchReference) {
  SKIP_WITHOUT_GPU();
  const unsigned seed = test_seed();
  std::printf("[ seed     ] ATTNRT_TEST_SEED=%u\n", seed);
  for (LayerKind kind : {LayerKind::gdn, LayerKind::kda, LayerKind::mamba2}) {
    SCOPED_TRACE(kind_label(kind));
    std::mt19937 rng(seed);
    const LayerData d(real_layer(kind), rng);
    Harness g(d, "cuda", 4, 0, 0, DType::f32, cuda::make_cuda_linear_state_memory(nullptr));
    Harness r(d, "reference", 4);
    for (int i = 0; i < 3; ++i) {
      g.pool().alloc_for(i);
      r.pool().alloc_for(i);
    }
    auto run_step = [&](const ForwardBatch& b, const Tokens& in, const std::string& what,
                        bool chunked) {
      const int64_t T = in.n;
      const int64_t cw = d.shape.conv_dim, aw = d.a_width, bw = d.b_width, ow = d.out_width();
      const int64_t pad = 8;
      // bf16 host copies (the reference reads them too) with padded rows.
      auto to_bf16 = [&](const std::vector<float>& v, int64_t w) {
        std::vector<uint16_t> h(static_cast<size_t>(T * (w + pad)), 0);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = 0; c < w; ++c) h[t * (w + pad) + c] = float_to_bf16(v[t * w + c]);
        return h;
      };
      const std::vector<uint16_t> hx = to_bf16(in.x, cw), ha = to_bf16(in.a, aw),
                                  hb = to_bf16(in.b, bw);
      std::vector<float> out_ref(static_cast<size_t>(T * ow), std::nanf(""));
      LinearArgs ra = r.args(in, out_ref);
      auto strided = [&](const void* p, Device dev, int64_t w, const TensorView& like) {
        TensorView t = like;
        t.data = const_cast<void*>(p);
        t.device = dev;
        t.dtype = DType::bf16;
        t.strides[0] = w + pad;
        return t;
      };
      ra.mixed_qkv = strided(hx.data(), Device::cpu(), cw, ra.mixed_qkv);
      ra.a = strided(ha.data(), Device::cpu(), aw, ra.a);
      if (bw > 0) ra.b = strided(hb.data(), Device::cpu(), bw, ra.b);
      r.backend().init_forward_metadata(b);
      r.backend().forward_linear(ra, d.layer, b);

      test::DeviceMemory dx(hx.size() * 2), da(ha.size() * 2),
          db(std::max<size_t>(hb.size(), 1) * 2), dout(static_cast<size_t>(T * (ow + pad)) * 2);
      ASSERT_EQ(cudaMemcpy(dx.ptr, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(da.ptr, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      if (bw > 0)
        ASSERT_EQ(cudaMemcpy(db.ptr, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice),
                  cudaSuccess);
      ASSERT_EQ(cudaMemset(dout.ptr, 0xff, static_cast<size_t>(T * (ow + pad)) * 2), cudaSuccess);
      // The legacy-stream copies and poison land before the backend's non-blocking stream runs.
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      // Parameters on the device too.
      auto upload = [&](const TensorView& host,
                        std::vector<std::unique_ptr<test::DeviceMemory>>& keep) {
        if (host.empty()) return host;
        const size_t bytes = static_cast<size_t>(host.numel()) * 4;
        keep.push_back(std::make_unique<test::DeviceMemory>(bytes));
        EXPECT_EQ(cudaMemcpy(keep.back()->ptr, host.data, bytes, cudaMemcpyHostToDevice),
                  cudaSuccess);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before the backend's stream reads it
        TensorView t = host;
        t.data = keep.back()->ptr;
        t.device = Device::cuda();
        return t;
      };
      std::vector<std::unique_ptr<test::DeviceMemory>> keep;
      std::vector<float> unused(static_cast<size_t>(T * ow));
      LinearArgs ga = g.args(in, unused);
      ga.mixed_qkv = strided(dx.ptr, Device::cuda(), cw, ga.mixed_qkv);
      ga.a = strided(da.ptr, Device::cuda(), aw, ga.a);
      if (bw > 0) ga.b = strided(db.ptr, Device::cuda(), bw, ga.b);
      ga.out = strided(dout.ptr, Device::cuda(), ow, ga.out);
      ga.conv_weight = upload(ga.conv_weight, keep);
      ga.conv_bias = upload(ga.conv_bias, keep);
      ga.A_log = upload(ga.A_log, keep);
      ga.dt_bias = upload(ga.dt_bias, keep);
      ga.D = upload(ga.D, keep);
      g.backend().init_forward_metadata(b);
      g.backend().forward_linear(ga, d.layer, b);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<uint16_t> hout(static_cast<size_t>(T * (ow + pad)));
      ASSERT_EQ(cudaMemcpy(hout.data(), dout.ptr, hout.size() * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
      std::vector<float> got(static_cast<size_t>(T * ow));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < ow; ++c) got[t * ow + c] = bf16_to_float(hout[t * (ow + pad) + c]);
      // bf16 outputs: one rounding of values of order 1; the 67-token request of the EXTEND step
      // takes the chunked kernels.
      if (chunked) {
        expect_chunked_close(got, out_ref, 1e-2, what + ": outputs");
      } else {
        EXPECT_LE(worst(got, out_ref, 2e-2, 1e-2), 1.0) << what << ": outputs; seed " << seed;
      }
      for (int s = 1; s <= 3; ++s) {
        if (chunked) {
          expect_chunked_close(g.state(s), r.state(s), 0.0, what + ": state " + std::to_string(s));
        } else {
          EXPECT_LE(worst(g.state(s), r.state(s), 2e-4, 2e-3), 1.0) << what << ": state " << s;
        }
      }
    };
    run_step(with_slots(make_extend_batch({0, 1, 2}, {0, 0, 0}, {3, 67, 1})),
             random_tokens(d, 71, rng), "EXTEND", true);
    run_step(with_slots(make_decode_batch({0, 1, 2}, {4, 68, 2})), random_tokens(d, 3, rng),
             "DECODE", true);
  }
}

// Decode time of one layer at the real models' shapes, against the device copy bandwidth. Prints
// only: the benchmark rows are `attnrt bench`'s.
TEST(CudaLinearTiming, DecodeBandwidthAtModelShapes) {
  SKIP_WITHOUT_GPU();
  // Device copy ceiling: 1 GiB read + written.
  const size_t copy_bytes = size_t{1} << 30;
  test::DeviceMemory src(copy_bytes), dst(copy_bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaMemcpy(dst.ptr, src.ptr, copy_bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e0);
  for (int i = 0; i < 5; ++i)
    cudaMemcpyAsync(dst.ptr, src.ptr, copy_bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float copy_ms = 0;
  cudaEventElapsedTime(&copy_ms, e0, e1);
  const double copy_bw = 2.0 * copy_bytes * 5 / (copy_ms * 1e-3);
  std::printf("[ timing   ] device copy: %.0f GB/s (read + write)\n", copy_bw / 1e9);

  struct Shape {
    const char* name;
    LayerSpec layer;
  };
  LayerSpec gdn;
  gdn.kind = LayerKind::gdn;
  gdn.linear.conv_kernel = 4;
  gdn.linear.num_k_heads = 16;
  gdn.linear.num_v_heads = 32;
  gdn.linear.head_k_dim = gdn.linear.head_v_dim = 128;
  LayerSpec mamba;
  mamba.kind = LayerKind::mamba2;
  mamba.linear.conv_kernel = 4;
  mamba.linear.num_v_heads = 128;
  mamba.linear.head_v_dim = 64;
  mamba.linear.d_state = 128;
  mamba.linear.n_groups = 8;
  for (const Shape& shape :
       {Shape{"GDN (Qwen3-Next: 32 v-heads, 16 k-heads, 128 x 128)", gdn},
        Shape{"Mamba2 (Nemotron-H-8B: 128 heads, P 64, N 128, 8 groups)", mamba}}) {
    for (int bs : {64, 256}) {
      std::mt19937 rng(7);
      const LayerData d(shape.layer, rng);
      Harness g(d, "cuda", bs, 0, 0, DType::f32, cuda::make_cuda_linear_state_memory(nullptr));
      std::vector<int64_t> rows;
      std::vector<int32_t> seq;
      for (int i = 0; i < bs; ++i) {
        g.pool().alloc_for(i);
        rows.push_back(i);
        seq.push_back(100);
      }
      const ForwardBatch b = with_slots(make_decode_batch(rows, seq));
      const Tokens in = random_tokens(d, bs, rng);
      std::vector<float> out(static_cast<size_t>(bs * d.out_width()));
      LinearArgs host = g.args(in, out);
      std::vector<std::unique_ptr<test::DeviceMemory>> keep;
      auto dev = [&](const TensorView& h) {
        if (h.empty()) return h;
        const size_t bytes = static_cast<size_t>(h.numel()) * dtype_size(h.dtype);
        keep.push_back(std::make_unique<test::DeviceMemory>(bytes));
        cudaMemcpy(keep.back()->ptr, h.data, bytes, cudaMemcpyHostToDevice);
        cudaDeviceSynchronize();  // before the backend's non-blocking stream reads it
        TensorView t = h;
        t.data = keep.back()->ptr;
        t.device = Device::cuda();
        return t;
      };
      LinearArgs a;
      a.mixed_qkv = dev(host.mixed_qkv);
      a.conv_weight = dev(host.conv_weight);
      a.conv_bias = dev(host.conv_bias);
      a.a = dev(host.a);
      a.b = dev(host.b);
      a.A_log = dev(host.A_log);
      a.dt_bias = dev(host.dt_bias);
      a.D = dev(host.D);
      a.out = dev(host.out);
      auto& backend = dynamic_cast<cuda::CudaLinearBackend&>(g.backend());
      backend.init_forward_metadata(b);
      backend.forward_linear(a, d.layer, b);  // warm-up
      const int iters = 20;
      cudaStreamSynchronize(backend.stream());
      cudaEventRecord(e0, backend.stream());
      for (int it = 0; it < iters; ++it) backend.forward_linear(a, d.layer, b);
      cudaEventRecord(e1, backend.stream());
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      const double us = ms * 1e3 / iters;
      const LinearStateShape& sh = d.shape;
      const double state = double(bs) * sh.ssm_elems() * 4 * 2;
      const double conv = double(bs) * sh.conv_elems() * 4 * 2;
      const double inputs = double(bs) * (sh.conv_dim + d.a_width + d.b_width + d.out_width()) * 4;
      const double bytes = state + conv + inputs;
      std::printf(
          "[ timing   ] %s decode bs %d: %.1f us per layer (conv + recurrence), %.0f MB moved, "
          "%.0f GB/s = %.0f%% of the device copy\n",
          shape.name, bs, us, bytes / 1e6, bytes / (us * 1e-6) / 1e9,
          100.0 * bytes / (us * 1e-6) / copy_bw);
      EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

#else

TEST(CudaLinear, NeedsACudaBuild) {
  GTEST_SKIP() << "attnrt was built without CUDA: " << query_cuda().reason;
}

#endif

}  // namespace
}  // namespace attnrt
