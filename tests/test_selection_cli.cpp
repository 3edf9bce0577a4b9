// `attnrt info` end to end: the support matrix, the per-phase choice with its reasons, the JSON
// document, and invalid combinations exiting non-zero with the selection error. ctest passes the
// CLI's path in ATTNRT_CLI.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "attnrt/backend/registry.h"
#include "attnrt/core/dtype.h"
#include "tests/test_util.h"

namespace {

using Result = attnrt::test::CommandResult;
using attnrt::test::expect_contains;

using InfoCli = attnrt::test::CliTest;

bool has(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

}  // namespace

TEST_F(InfoCli, PrintsTheMachineAndEveryRegisteredBackend) {
  Result r = run("info");
  ASSERT_EQ(r.status, 0) << r.err;
  expect_contains(r.out, {"CPU:", "CUDA:", "Support matrix:"});
  for (const std::string& name : attnrt::Registry::global().names()) {
    EXPECT_TRUE(has(r.out, "  " + name)) << name << "\n" << r.out;
  }
  for (const char* row : {"page sizes", "KV dtypes", "spec topk=1", "spec topk>1", "sliding window",
                          "softcap", "sinks", "MLA", "non-causal", "CUDA graphs", "linear kinds"}) {
    EXPECT_TRUE(has(r.out, row)) << row;
  }
}

TEST_F(InfoCli, ExplainsTheChoicePerPhaseForAModel) {
  Result r = run("info --model demo --prefill-attention-backend reference --explain");
  ASSERT_EQ(r.status, 0) << r.err;
  expect_contains(r.out, {"Model demo", "prefill         reference",
                          "prefill: reference — set by --prefill-attention-backend",
                          "decode: ", "hybrid router   yes"});
}

// A DSA model's layer line names its indexer, and --explain says DSA is on and why.
TEST_F(InfoCli, ModelSummaryNamesTheDsaIndexer) {
  Result r = run("info --model deepseek-v3.2 --explain");
  ASSERT_EQ(r.status, 0) << r.err;
  expect_contains(r.out, {"61 layer(s) mla: 128 q / 1 kv heads",
                          "; DSA indexer 64 heads x 128, top 2048 keys per query token",
                          "dsa: on (auto"});
  // A model without an indexer says nothing of DSA on its layer line.
  Result v3 = run("info --model deepseek-v3");
  ASSERT_EQ(v3.status, 0) << v3.err;
  EXPECT_FALSE(has(v3.out, "DSA indexer")) << v3.out;
}

TEST_F(InfoCli, JsonCarriesTheSelectionAndEveryBackendsCaps) {
  std::mt19937 rng(std::random_device{}());
  const int steps = std::uniform_int_distribution<int>(1, 6)(rng);
  Result r =
      run(fmt::format("info --json --model demo --attention-backend reference "
                      "--kv-cache-dtype fp8_e4m3 --page-size 16 --speculative-num-steps {}",
                      steps));
  ASSERT_EQ(r.status, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["selection"]["prefill"], "reference");
  EXPECT_EQ(j["selection"]["decode"], "reference");
  EXPECT_EQ(j["selection"]["kv_dtype"], "fp8_e4m3");
  EXPECT_EQ(j["selection"]["page_size"], 16);
  EXPECT_EQ(j["selection"]["spec_topk"], 1);
  EXPECT_EQ(j["selection"]["spec_num_draft_tokens"], steps + 1);
  EXPECT_EQ(j["backends"].size(), attnrt::Registry::global().entries().size());
  for (const auto& b : j["backends"]) {
    const attnrt::BackendEntry& e = attnrt::Registry::global().get(b["name"]);
    EXPECT_EQ(b["auto_selectable"], e.auto_selectable);
    EXPECT_EQ(b["caps"]["spec_topk_gt1"], e.caps.spec_topk_gt1);
    EXPECT_EQ(b["caps"]["kv_dtypes"].size(), e.caps.kv_dtypes.size());
  }
}

TEST_F(InfoCli, InvalidCombinationsExitNonZeroWithTheSelectionError) {
  Result r = run("info --model demo --attention-backend flashinfer");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r.err,
                  "--attention-backend flashinfer: 'flashinfer' is a backend of the "
                  "reference serving engine"))
      << r.err;

  r =
      run("info --model demo --attention-backend reference --speculative-num-steps 3 "
          "--speculative-num-draft-tokens 6");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r.err, "--speculative-num-draft-tokens 6 does not fit a chain")) << r.err;

  // Backend options without --model are checked against the default model.
  r = run("info --attention-backend nosuch");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r.err, "--attention-backend nosuch: unknown attention backend")) << r.err;

  // CLI-level checks reject what can never be valid before any model is read.
  r = run("info --page-size 0");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.err, "--page-size")) << r.err;
  r = run("info --speculative-attention-mode verify");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.err, "--speculative-attention-mode")) << r.err;
}

// --fp8-prefill-attention needs an fp8_e4m3 KV cache and a prefill backend with the fp8 prefill
// kernel; anything else is refused with what was seen and what to change.
TEST_F(InfoCli, Fp8PrefillAttentionNamesWhatItNeeds) {
  Result r = run("info --model demo --attention-backend reference --fp8-prefill-attention");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r.err, "--fp8-prefill-attention: the KV cache dtype is bf16")) << r.err;
  EXPECT_TRUE(has(r.err, "add --kv-cache-dtype fp8_e4m3")) << r.err;

  r =
      run("info --model demo --attention-backend reference --kv-cache-dtype fp8_e5m2 "
          "--fp8-prefill-attention");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r.err, "the KV cache dtype is fp8_e5m2 (--kv-cache-dtype fp8_e5m2)")) << r.err;

  r =
      run("info --model demo --attention-backend reference --kv-cache-dtype fp8_e4m3 "
          "--fp8-prefill-attention");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r.err,
                  "--fp8-prefill-attention: prefill backend 'reference' has no fp8 prefill "
                  "kernel"))
      << r.err;

  EXPECT_TRUE(has(r.err, "--prefill-attention-backend cuda")) << r.err;

  // Off, the same selections are valid.
  r = run("info --model demo --attention-backend reference --kv-cache-dtype fp8_e4m3");
  EXPECT_EQ(r.status, 0) << r.err;
}
