// The output checks of `attnrt run` on their own: the element comparison, the NaN poison, the
// failure log, and the reference checker over a runtime's pools (an attention layer and a
// linear-attention layer with its states), each fed random inputs.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/linear_state_pool.h"
#include "attnrt/runtime/attention_runtime.h"
#include "tests/test_linear_util.h"
#include "tools/sim/checker.h"
#include "tools/sim/step_inputs.h"

using namespace attnrt;
using namespace attnrt::sim;

namespace {

using test::random_buffer;

HostBuffer copy_of(const HostBuffer& b) {
  HostBuffer c(b.dtype(), {b.numel()});
  std::memcpy(c.data(), b.data(), b.bytes());
  return c;
}

TensorView as_3d(const HostBuffer& b, int64_t rows, int64_t d1, int64_t d2) {
  return TensorView(b.data(), b.dtype(), {rows, d1, d2});
}

TEST(SimCompare, FindsTheWorstElementAndCountsEveryOneBeyondTolerance) {
  std::mt19937 rng(11);
  const Tolerance tol{1e-3, 1e-2};
  const HostBuffer expected = random_buffer(DType::f32, {5 * 3 * 8}, rng);
  HostBuffer got = copy_of(expected);
  std::uniform_real_distribution<float> small(-1e-4f, 1e-4f);
  for (int64_t i = 0; i < got.numel(); ++i) got.ptr<float>()[i] += small(rng);
  const Comparison within = compare(as_3d(got, 5, 3, 8), as_3d(expected, 5, 3, 8), tol);
  EXPECT_EQ(within.bad, 0);
  EXPECT_GT(within.max_abs, 0);
  EXPECT_LE(within.max_abs, 1.1e-4);

  // Three elements beyond tolerance; the worst at token 3, head 2, column 6.
  const int64_t worst = (3 * 3 + 2) * 8 + 6;
  got.ptr<float>()[7] = expected.ptr<float>()[7] + 0.5f;
  got.ptr<float>()[worst] = expected.ptr<float>()[worst] - 4.f;
  got.ptr<float>()[100] = expected.ptr<float>()[100] + 1.f;
  const Comparison c = compare(as_3d(got, 5, 3, 8), as_3d(expected, 5, 3, 8), tol);
  EXPECT_EQ(c.bad, 3);
  EXPECT_EQ(c.token, 3);
  EXPECT_EQ(c.head, 2);
  EXPECT_EQ(c.column, 6);
  EXPECT_FLOAT_EQ(static_cast<float>(c.got), got.ptr<float>()[worst]);
  EXPECT_FLOAT_EQ(static_cast<float>(c.expected), expected.ptr<float>()[worst]);
  EXPECT_NEAR(c.max_abs, 4.0, 1e-5);

  // An unwritten element is worse than any finite error and makes the maxima infinite.
  got.ptr<float>()[50] = std::numeric_limits<float>::quiet_NaN();
  const Comparison n = compare(as_3d(got, 5, 3, 8), as_3d(expected, 5, 3, 8), tol);
  EXPECT_EQ(n.bad, 4);
  EXPECT_EQ(n.token * 24 + n.head * 8 + n.column, 50);
  EXPECT_TRUE(std::isnan(n.got));
  EXPECT_TRUE(std::isinf(n.max_abs));
}

TEST(SimCompare, PoisonIsFoundAtTheFirstUnwrittenElementOfEveryOutputDtype) {
  std::mt19937 rng(12);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    HostBuffer b = random_buffer(dtype, {4, 2, 16}, rng);
    EXPECT_EQ(first_nan(b.view()), -1);
    poison(b.view());
    EXPECT_EQ(first_nan(b.view()), 0);
    for (int64_t i = 0; i < b.numel(); ++i) EXPECT_TRUE(std::isnan(load_as_float(b.data(), dtype, i)));
    b = random_buffer(dtype, {4, 2, 16}, rng);
    store_from_float(b.data(), dtype, 77, std::numeric_limits<float>::quiet_NaN());
    store_from_float(b.data(), dtype, 90, std::numeric_limits<float>::quiet_NaN());
    EXPECT_EQ(first_nan(b.view()), 77);
    // Infinity is a value, not the poison.
    b = random_buffer(dtype, {4, 2, 16}, rng);
    store_from_float(b.data(), dtype, 3, std::numeric_limits<float>::infinity());
    EXPECT_EQ(first_nan(b.view()), -1);
  }
}

TEST(SimFailureLog, CountsEveryFailureAndListsTheFirstFewOfEachModelAndMode) {
  std::mt19937 rng(13);
  std::uniform_real_distribution<double> u(-3, 3);
  LayerSpec layer;
  layer.layer_id = 5;
  FailureLog log;
  auto site = [&](int step, ModelRole role, ForwardMode mode) {
    return LayerSite{step, role, mode, &layer, "cpu"};
  };
  std::vector<Comparison> decode;
  for (int i = 0; i < 5; ++i) {
    Comparison c;
    c.token = i;
    c.head = i + 1;
    c.column = i + 2;
    c.got = u(rng);
    c.expected = u(rng);
    decode.push_back(c);
    log.record(site(10 + i, ModelRole::target, ForwardMode::DECODE), c, fmt::format("d{}", i));
  }
  log.record(site(20, ModelRole::target, ForwardMode::EXTEND), decode[0], "e0");
  log.record(site(21, ModelRole::draft, ForwardMode::DECODE), decode[1], "draft d0");
  EXPECT_EQ(log.count(), 7);
  ASSERT_EQ(log.listed().size(), size_t{FailureLog::kMaxListedPerMode} + 2);
  const std::vector<std::string> texts = {"d0", "d1", "d2", "e0", "draft d0"};
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(log.listed()[i].what, texts[i]);
  const CheckFailure& f = log.listed()[1];
  EXPECT_EQ(f.step, 11);
  EXPECT_EQ(f.layer, 5);
  EXPECT_EQ(f.token, 1);
  EXPECT_EQ(f.head, 2);
  EXPECT_EQ(f.column, 3);
  EXPECT_DOUBLE_EQ(f.abs_err, std::abs(decode[1].got - decode[1].expected));
  EXPECT_EQ(log.listed()[4].role, ModelRole::draft);
}

// Every request keeps its last row and each multi-row request its first; the rest is drawn by the
// seed (the same seed, the same rows), up to the limit.
TEST(SimRowSample, EveryRequestsFirstAndLastRowThenSeededRowsUpToTheLimit) {
  const std::vector<int32_t> lens{1, 40, 1, 7, 1, 80};
  ForwardBatch batch =
      make_extend_batch({0, 1, 2, 3, 4, 5}, {9, 0, 30, 5, 12, 100}, lens, ForwardMode::MIXED);
  batch.out_cache_loc.resize(130);
  std::iota(batch.out_cache_loc.begin(), batch.out_cache_loc.end(), 1000);
  const std::vector<int64_t> rows = sample_tokens(batch, 16, 3);
  EXPECT_EQ(rows.size(), 16u);
  EXPECT_TRUE(std::is_sorted(rows.begin(), rows.end()));
  int64_t start = 0;
  for (int32_t len : lens) {
    EXPECT_TRUE(std::binary_search(rows.begin(), rows.end(), start + len - 1)) << start;
    EXPECT_TRUE(std::binary_search(rows.begin(), rows.end(), start)) << start;
    start += len;
  }
  EXPECT_EQ(sample_tokens(batch, 16, 3), rows);
  EXPECT_NE(sample_tokens(batch, 16, 4), rows);
  // More requests than the limit: still one row each at least.
  EXPECT_EQ(sample_tokens(batch, 4, 3).size(), 9u);
  // No limit, or a step no larger than it: every row.
  EXPECT_EQ(sample_tokens(batch, 0, 3).size(), static_cast<size_t>(start));
  EXPECT_EQ(sample_tokens(batch, 1000, 3).size(), static_cast<size_t>(start));
}

// Successive rounds start elsewhere, so that ceil(Hq / max) rounds cover every head.
TEST(SimRowSample, HeadsAreSpreadAndRoundsCoverEveryHead) {
  for (const auto [heads, most] : {std::pair{128, 16}, {16, 16}, {40, 16}, {8, 3}, {6, 0}}) {
    std::vector<int> seen(heads, 0);
    const int rounds = most > 0 ? (heads + most - 1) / most : 1;
    for (int round = 0; round < rounds; ++round) {
      const std::vector<int> h = sample_heads(heads, most, 5 + round);
      if (most > 0) EXPECT_LE(static_cast<int>(h.size()), most);
      EXPECT_TRUE(std::is_sorted(h.begin(), h.end()));
      for (int x : h) ++seen[x];
    }
    for (int x = 0; x < heads; ++x) EXPECT_EQ(seen[x], 1) << heads << " heads, head " << x;
  }
}

// What the checker fixtures share: a runtime over `model_` (two request rows, 256 KV slots), the
// step it ran, the failure log, and the context of a backend over the runtime's own pools.
class SimCheckTest : public ::testing::Test {
 protected:
  void start_runtime(const Options& options) {
    RuntimeConfig rc;
    rc.max_requests = 2;
    rc.kv_slots = 256;
    rt_ = std::make_unique<AttentionRuntime>(model_, options, rc);
  }

  // The linear state pool is in the context only when the model has linear layers.
  BackendContext pools_context() const {
    BackendContext ctx;
    ctx.model = &rt_->model();
    ctx.options = &rt_->options();
    ctx.kv_cache = &rt_->kv_cache();
    ctx.req_to_token = &rt_->req_to_token();
    if (model_.has_linear_layers()) ctx.linear_state = &rt_->linear_state();
    ctx.device = Device::cpu();
    return ctx;
  }

  // Layer 0 in target EXTEND step `step` on the cpu backend.
  LayerSite extend_site(int step) const {
    return {step, ModelRole::target, ForwardMode::EXTEND, &model_.layers[0], "cpu"};
  }

  ModelSpec model_;
  std::unique_ptr<AttentionRuntime> rt_;
  ForwardBatch batch_;
  FailureLog log_;
};

// A model of one attention layer on the cpu backend with one request prefilled in a single EXTEND
// step of random q/k/v; the reference over the runtime's own pools.
class SimAttentionCheck : public SimCheckTest {
 protected:
  static constexpr int64_t kTokens = 13;

  void SetUp() override {
    model_ =
        test::make_model("checker-test", DType::f32, 256, {test::attention_layer(0, 4, 2, 16)});
    Options options;
    options.attention_backend = "cpu";
    options.page_size = 4;
    start_runtime(options);
    const int row = rt_->req_to_token().alloc();
    const std::vector<int32_t> prefix{0}, seq{static_cast<int32_t>(kTokens)};
    const std::vector<int64_t> last{-1};
    const std::vector<int64_t> loc = rt_->allocator().alloc_extend(prefix, seq, last);
    rt_->req_to_token().write(row, 0, loc);
    batch_ = make_extend_batch({row}, prefix, {static_cast<int32_t>(kTokens)});
    batch_.out_cache_loc = loc;
    std::mt19937 rng(21);
    q_ = random_buffer(DType::f32, {kTokens, 4, 16}, rng);
    k_ = random_buffer(DType::f32, {kTokens, 2, 16}, rng);
    v_ = random_buffer(DType::f32, {kTokens, 2, 16}, rng);
    out_ = HostBuffer(DType::f32, {kTokens, 4, 16});
    poison(out_.view());
    args_.q = q_.view();
    args_.k = k_.view();
    args_.v = v_.view();
    args_.out = out_.view();
    rt_->begin_step(batch_);
    rt_->forward(0, args_);
    rt_->end_step();
  }

  std::unique_ptr<ReferenceChecker> checker(bool with_reference) {
    std::unique_ptr<AttentionBackend> reference;
    if (with_reference) reference = Registry::global().get("reference").factory(pools_context());
    auto c = std::make_unique<ReferenceChecker>(std::move(reference), nullptr, nullptr, nullptr,
                                                output_tolerance(DType::f32), log_);
    if (with_reference) c->begin_step(batch_);
    return c;
  }

  LayerSite site() const { return extend_site(4); }

  HostBuffer q_, k_, v_, out_;
  AttnArgs args_;
};

TEST_F(SimAttentionCheck, TheBackendsOutputPassesAndItsErrorsFoldIntoTheModeStats) {
  auto c = checker(true);
  ModeStats ms;
  c->check_attention(site(), batch_, args_, true, {}, ms);
  EXPECT_EQ(log_.count(), 0);
  EXPECT_TRUE(std::isfinite(ms.max_abs_err));
  EXPECT_TRUE(std::isfinite(ms.max_rel_err));
  // The output the backend wrote is left as it was.
  EXPECT_EQ(first_nan(out_.view()), -1);
}

TEST_F(SimAttentionCheck, AMismatchNamesStepLayerAndTheWorstElement) {
  auto c = checker(true);
  const int64_t at = (7 * 4 + 3) * 16 + 5;  // token 7, head 3, column 5
  out_.ptr<float>()[at] += 2.f;
  ModeStats ms;
  c->check_attention(site(), batch_, args_, true, {}, ms);
  ASSERT_EQ(log_.count(), 1);
  const CheckFailure& f = log_.listed()[0];
  EXPECT_EQ(f.step, 4);
  EXPECT_EQ(f.mode, ForwardMode::EXTEND);
  EXPECT_EQ(f.token, 7);
  EXPECT_EQ(f.head, 3);
  EXPECT_EQ(f.column, 5);
  EXPECT_NEAR(f.abs_err, 2.0, 1e-3);
  EXPECT_NEAR(ms.max_abs_err, 2.0, 1e-3);
  const Tolerance tol = output_tolerance(DType::f32);
  const std::string head = fmt::format(
      "step 4 (target EXTEND), layer 0: 1 of {} outputs beyond tolerance; worst at token 7, head "
      "3, column 5: got ",
      kTokens * 4 * 16);
  EXPECT_EQ(f.what.rfind(head, 0), 0u) << f.what;
  EXPECT_NE(f.what.find(fmt::format("(|error| 2.00e+00; allowed {:g} + {:g}*|reference|)",
                                    tol.atol, tol.rtol)),
            std::string::npos)
      << f.what;
}

// A sampled check recomputes only its rows on reference, but those rows are really compared: an
// error in a row the seed drew (neither end of the extend) and a sampled head is caught; one
// outside the sample is not looked at.
TEST_F(SimAttentionCheck, ASampledCheckCatchesAnErrorInADrawnRowAndComparesNothingElse) {
  const RowSample sample{sample_tokens(batch_, 4, 7), sample_heads(4, 2, 1)};
  ASSERT_EQ(sample.tokens.size(), 4u);
  EXPECT_EQ(sample.tokens.front(), 0);
  EXPECT_EQ(sample.tokens.back(), kTokens - 1);
  EXPECT_EQ(sample.heads, (std::vector<int>{1, 3}));
  const int64_t drawn = sample.tokens[1];
  int64_t skipped = 1;
  while (std::binary_search(sample.tokens.begin(), sample.tokens.end(), skipped)) ++skipped;

  auto c = checker(true);
  ModeStats ms;
  out_.ptr<float>()[(skipped * 4 + 3) * 16 + 2] += 2.f;  // outside the sample: not compared
  c->check_attention(site(), batch_, args_, true, sample, ms);
  EXPECT_EQ(log_.count(), 0);
  EXPECT_EQ(ms.checked_rows, 4 * 2);
  EXPECT_EQ(ms.checkable_rows, kTokens * 4);

  out_.ptr<float>()[(drawn * 4 + 3) * 16 + 5] += 2.f;
  c->check_attention(site(), batch_, args_, true, sample, ms);
  ASSERT_EQ(log_.count(), 1);
  const CheckFailure& f = log_.listed()[0];
  EXPECT_EQ(f.token, drawn);
  EXPECT_EQ(f.head, 3);
  EXPECT_EQ(f.column, 5);
  EXPECT_NEAR(f.abs_err, 2.0, 1e-3);
  EXPECT_EQ(f.what.rfind("step 4 (target EXTEND), layer 0: 1 of ", 0), 0u) << f.what;
}

TEST_F(SimAttentionCheck, AnUnwrittenElementIsFoundWithoutAReference) {
  auto c = checker(false);
  EXPECT_FALSE(c->has_reference());
  ModeStats ms;
  c->check_attention(site(), batch_, args_, false, {}, ms);
  EXPECT_EQ(log_.count(), 0);
  EXPECT_EQ(ms.max_abs_err, 0);

  out_.ptr<float>()[(2 * 4 + 1) * 16 + 9] = std::numeric_limits<float>::quiet_NaN();
  c->check_attention(site(), batch_, args_, false, {}, ms);
  ASSERT_EQ(log_.count(), 1);
  EXPECT_EQ(log_.listed()[0].what,
            "step 4 (target EXTEND), layer 0: output not written by backend 'cpu' at token 2, "
            "head 1, column 9 (still the NaN poison)");
  EXPECT_TRUE(std::isinf(ms.max_abs_err));
  EXPECT_TRUE(std::isinf(ms.max_rel_err));
}

// A gdn layer on the cpu backend: two requests prefilled in one EXTEND step, the reference's
// linear side over the same state pool.
class SimLinearCheck : public SimCheckTest {
 protected:
  void SetUp() override {
    model_ = test::make_model("checker-linear-test", DType::f32, 256,
                              {testing_linear::small_layer(LayerKind::gdn, 0)});
    Options options;
    options.attention_backend = "cpu";
    options.linear_attn_backend = "cpu";
    start_runtime(options);
    const std::vector<int32_t> lens{9, 14};
    std::vector<int64_t> rows;
    std::vector<int64_t> loc;
    for (int32_t len : lens) {
      rows.push_back(rt_->req_to_token().alloc());
      region_.slots.push_back(rt_->linear_state().alloc_for(static_cast<int>(rows.back())));
      const std::vector<int32_t> prefix{0}, seq{len};
      const std::vector<int64_t> got =
          rt_->allocator().alloc_extend(prefix, seq, std::vector<int64_t>{-1});
      rt_->req_to_token().write(static_cast<int>(rows.back()), 0, got);
      loc.insert(loc.end(), got.begin(), got.end());
    }
    batch_ = make_extend_batch(rows, {0, 0}, lens);
    batch_.out_cache_loc = loc;
    const int64_t T = 9 + 14;
    FastRng rng(31);
    weights_ = make_linear_weights(model_.layers[0], rng);
    const LinearWidths w = linear_widths(model_.layers[0]);
    buf_.mixed = HostBuffer(DType::f32, {T, w.mixed});
    buf_.gate_a = HostBuffer(DType::f32, {T, w.a});
    buf_.gate_b = HostBuffer(DType::f32, {T, w.b});
    buf_.out = HostBuffer(DType::f32, {T, w.out});
    args_ = linear_args(model_.layers[0], weights_, buf_, T, DType::f32);
    fill_random(args_.mixed_qkv, rng, 1.f);
    fill_random(args_.a, rng, 2.5f);
    fill_random(args_.b, rng, 2.5f);
    poison(args_.out);
    rt_->begin_step(batch_);
    before_ = save_state(rt_->linear_state(), 0, region_);
    rt_->forward_linear(0, args_);
    rt_->end_step();
  }

  std::unique_ptr<ReferenceChecker> checker() {
    const BackendContext ctx = pools_context();
    const BackendEntry& ref = Registry::global().get("reference");
    auto c = std::make_unique<ReferenceChecker>(ref.factory(ctx), ref.linear_factory(ctx),
                                                &rt_->linear_state(), &rt_->linear_state(),
                                                output_tolerance(DType::f32), log_);
    c->begin_step(batch_);
    return c;
  }

  LayerSite site() const { return extend_site(2); }

  StateRegion region_;
  LinearWeights weights_;
  LayerBuffers buf_;
  LinearArgs args_;
  StateCopy before_;
};

TEST_F(SimLinearCheck, OutputAndStatesOfTheBackendPassAndTheRuntimesStateStays) {
  const StateCopy after = save_state(rt_->linear_state(), 0, region_);
  ASSERT_NE(after.ssm, before_.ssm);  // the step changed the states
  auto c = checker();
  ModeStats ms;
  c->check_linear(site(), batch_, args_, true, region_, before_, ms);
  EXPECT_EQ(log_.count(), 0) << log_.listed()[0].what;
  EXPECT_TRUE(std::isfinite(ms.max_abs_err));
  // The reference ran in the same pool: the runtime's states are put back afterwards.
  const StateCopy now = save_state(rt_->linear_state(), 0, region_);
  EXPECT_EQ(now.ssm, after.ssm);
  EXPECT_EQ(now.conv, after.conv);
}

TEST_F(SimLinearCheck, AWrongStateNamesTheRequestAndIsStillWhatTheRunGoesOnWith) {
  // The backend under test left a wrong recurrent state for request 1.
  StateCopy wrong = save_state(rt_->linear_state(), 0, region_);
  const size_t per_slot = wrong.ssm.size() / 2;
  float* state1 = reinterpret_cast<float*>(&wrong.ssm[per_slot]);
  state1[17] += 3.f;
  restore_state(rt_->linear_state(), 0, region_, wrong);
  auto c = checker();
  ModeStats ms;
  c->check_linear(site(), batch_, args_, true, region_, before_, ms);
  ASSERT_EQ(log_.count(), 1);
  const std::string& what = log_.listed()[0].what;
  EXPECT_EQ(what.rfind("step 2 (target EXTEND), layer 0 (gdn): 1 of ", 0), 0u) << what;
  EXPECT_NE(what.find("recurrent state values beyond tolerance; worst in request 1, "),
            std::string::npos)
      << what;
  EXPECT_EQ(save_state(rt_->linear_state(), 0, region_).ssm, wrong.ssm);
}

TEST_F(SimLinearCheck, AnUnwrittenOutputRowIsFoundWithoutAReference) {
  ReferenceChecker c(nullptr, nullptr, &rt_->linear_state(), &rt_->linear_state(),
                     output_tolerance(DType::f32), log_);
  ModeStats ms;
  c.check_linear(site(), batch_, args_, false, region_, {}, ms);
  EXPECT_EQ(log_.count(), 0);
  const int64_t row_width = args_.out.shape[1] * args_.out.shape[2];
  args_.out.ptr<float>()[11 * row_width + 4] = std::numeric_limits<float>::quiet_NaN();
  c.check_linear(site(), batch_, args_, false, region_, {}, ms);
  ASSERT_EQ(log_.count(), 1);
  EXPECT_EQ(log_.listed()[0].what,
            "step 2 (target EXTEND), layer 0 (gdn): output not written by backend 'cpu' at token "
            "11 (still the NaN poison)");
  EXPECT_TRUE(std::isinf(ms.max_abs_err));
}

}  // namespace
