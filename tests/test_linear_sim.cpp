// `attnrt run` on hybrid models: a small gdn / full / mamba2 / kda model replayed on the cpu
// backend, every checked step's linear outputs and states compared with reference, with and
// without speculative decoding (chain and tree), state slots freed with their requests; and the
// layer selection of the built-in hybrid presets.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "test_linear_util.h"
#include "tests/test_sim_util.h"
#include "tools/sim/driver.h"

using namespace attnrt;
using namespace attnrt::sim;
using namespace attnrt::testing_linear;

namespace {

ModelSpec tiny_hybrid() { return hybrid_linear_model("tiny-hybrid", 1024); }

Trace tiny_trace() { return test::four_request_trace("tiny"); }

RunConfig tiny_config() { return test::small_run_config(1024, 2, 5); }

const ModeStats* find_mode(const RunReport& r, ForwardMode mode) {
  return test::find_mode(r, ModelRole::target, mode);
}

TEST(LinearSim, HybridModelRunsOnCpuCheckedAgainstReference) {
  Options o;
  o.attention_backend = "cpu";
  const RunReport r = run_trace(tiny_hybrid(), o, tiny_trace(), tiny_config());
  EXPECT_TRUE(r.ok()) << format_report(r);
  EXPECT_EQ(r.linear_prefill_backend, "cpu");
  EXPECT_EQ(r.linear_decode_backend, "cpu");
  EXPECT_TRUE(r.linear_pool_ok) << r.linear_pool_detail;
  EXPECT_EQ(r.linear_slots, 4);
  for (ForwardMode m : {ForwardMode::EXTEND, ForwardMode::DECODE, ForwardMode::MIXED}) {
    const ModeStats* s = find_mode(r, m);
    ASSERT_NE(s, nullptr) << forward_mode_name(m);
    EXPECT_GT(s->checked_steps, 0) << forward_mode_name(m);
    EXPECT_EQ(s->backend, "cpu; linear cpu");
  }
  // The whole small model runs (its pattern has no second period to leave out); the shared
  // prefix is prefilled by every request itself, which the report says.
  const std::string text = format_report(r);
  EXPECT_NE(text.find("note: shared prefixes: not reused (2 requests prefill them themselves)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("linear state check (target): ok: all 4 state slots free again"),
            std::string::npos)
      << text;
  const nlohmann::json j = report_to_json(r);
  EXPECT_TRUE(j["pool_check"]["linear_state"]["ok"].get<bool>());
  EXPECT_EQ(j["backends"]["linear_decode"], "cpu");
  // Every prompt token is computed (no prefix reuse), every output token after the first decoded.
  const Trace t = tiny_trace();
  EXPECT_EQ(r.totals().tokens, t.total_prompt_tokens() + t.total_output_tokens() -
                                   static_cast<int64_t>(t.requests.size()));
}

TEST(LinearSim, SpeculativeChainAndTreeCommitVerifiedStates) {
  for (int topk : {1, 2}) {
    SCOPED_TRACE(fmt::format("topk {}", topk));
    const Options o = test::speculative_options("cpu", topk);
    RunConfig rc = tiny_config();
    rc.scheduler.spec.accept_prob = 0.6;
    const RunReport r = run_trace(tiny_hybrid(), o, tiny_trace(), rc);
    EXPECT_TRUE(r.ok()) << format_report(r);
    const ModeStats* v = find_mode(r, ForwardMode::TARGET_VERIFY);
    ASSERT_NE(v, nullptr);
    EXPECT_GT(v->checked_steps, 1);
    EXPECT_GT(r.accepted_drafts, 0);
    // Steps after a commit are checked too: their outputs depend on the committed state, and the
    // reference recomputes them from the same pool.
    EXPECT_GT(find_mode(r, ForwardMode::EXTEND)->checked_steps, 0);
  }
}

TEST(LinearSim, HybridPresetsRunOnePeriodOfTheirPatternByDefault) {
  Options o;
  o.attention_backend = "cpu";
  RunConfig rc = tiny_config();
  rc.check_every = 0;
  const Trace one = attnrt::test::one_request_trace();
  const RunReport next = run_trace(model_preset("qwen3-next-80b"), o, one, rc);
  EXPECT_TRUE(next.ok()) << format_report(next);
  ASSERT_FALSE(next.notes.empty());
  EXPECT_NE(next.notes[0].find("ran layers 0..3 of 48 (1 full, 3 gdn)"), std::string::npos)
      << next.notes[0];
  rc.layers = 2;
  const RunReport two = run_trace(model_preset("nemotron-h-8b"), o, one, rc);
  EXPECT_NE(two.notes[0].find("ran layers 0..1 of 28 (2 mamba2)"), std::string::npos)
      << two.notes[0];
  rc.layers = -1;
  // Kimi-Linear's full-attention layers are MLA: the cpu backend serves them, so they stay.
  rc.check_every = 1;
  const RunReport kimi = run_trace(model_preset("kimi-linear-48b"), o, one, rc);
  EXPECT_TRUE(kimi.ok()) << format_report(kimi);
  ASSERT_FALSE(kimi.notes.empty());
  EXPECT_NE(kimi.notes[0].find("ran layers 0..3 of 27 (3 kda, 1 mla)"), std::string::npos)
      << kimi.notes[0];
  for (const std::string& n : kimi.notes) EXPECT_EQ(n.find("left out"), std::string::npos) << n;
  rc.check_every = 0;
  rc.layers = -2;
  expect_error([&] { run_trace(model_preset("nemotron-h-8b"), o, one, rc); }, {"--layers = -2"});
}

}  // namespace
