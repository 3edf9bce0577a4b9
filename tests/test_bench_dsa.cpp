// The DSA rows of `attnrt bench --suite dsa` (docs/workloads.md "DSA rows"): their names, counting
// and shrinking, a tiny run of every part on the cpu backend (checked against the reference
// backend, the sparse part against the step's output), and n/a rows on a backend without DSA.
// Nothing here asserts how fast anything ran.
#include <gtest/gtest.h>

#include <string>

#include "backends/reference/reference_backend.h"
#include "bench/harness/dsa_workload.h"
#include "bench/harness/report.h"
#include "bench/harness/runner.h"
#include "tests/test_bench_util.h"
#include "tests/test_util.h"

using namespace attnrt;
using namespace attnrt::bench;

namespace {

const DsaWorkload& named(const std::vector<DsaWorkload>& rows, const std::string& name) {
  for (const DsaWorkload& w : rows) {
    if (w.name == name) return w;
  }
  throw std::runtime_error("no row " + name);
}

// A DSA layer small enough for a test, selecting a real share of its keys.
DsaWorkload tiny(DsaPart part, bool prefill, int batch, int kv_len) {
  DsaWorkload w;
  w.part = part;
  w.prefill = prefill;
  w.batch = batch;
  w.kv_len = kv_len;
  w.q_heads = 4;
  w.kv_lora_rank = 64;
  w.rope_dim = 16;
  w.index_heads = 4;
  w.index_head_dim = 32;
  w.index_topk = 24;
  w.page_size = 16;
  w.name = "tiny-dsa-" + std::string(prefill ? "prefill" : dsa_part_name(part));
  return w;
}

TEST(BenchDsa, RowsAreTheIssuesTableInOrder) {
  std::vector<std::string> names;
  for (const DsaWorkload& w : dsa_workloads()) names.push_back(w.name);
  EXPECT_EQ(names, (std::vector<std::string>{"dsa-decode-64x32768", "dsa-index-64x32768",
                                             "dsa-sparse-64x32768", "dsa-decode-16x131072",
                                             "dsa-index-16x131072", "dsa-sparse-16x131072",
                                             "dsa-prefill-1x32768"}));
  const DsaWorkload& d = named(dsa_workloads(), "dsa-decode-64x32768");
  EXPECT_EQ(d.q_heads, 128);
  EXPECT_EQ(d.latent_dim(), 576);
  EXPECT_EQ(d.index_heads, 64);
  EXPECT_EQ(d.index_head_dim, 128);
  EXPECT_EQ(d.index_topk, 2048);
  EXPECT_EQ(select_dsa_workloads("index").size(), 2u);
  EXPECT_EQ(select_dsa_workloads("dsa-sparse,dsa-prefill-1x32768").size(), 3u);
  test::expect_error([] { select_dsa_workloads("dsa-verify"); },
                     {"unknown workload 'dsa-verify': use all, dsa-decode, dsa-index"});
}

TEST(BenchDsa, CountsIndexKeysAndSelectedRows) {
  const DsaWorkload& index = named(dsa_workloads(), "dsa-index-64x32768");
  EXPECT_DOUBLE_EQ(dsa_counted_bytes(index), 64.0 * 32768 * 132);
  EXPECT_DOUBLE_EQ(dsa_counted_flops(index), 64.0 * 32768 * 2 * 64 * 128);
  EXPECT_EQ(index.bound(), Bound::memory);
  const DsaWorkload& sparse = named(dsa_workloads(), "dsa-sparse-16x131072");
  EXPECT_DOUBLE_EQ(dsa_selected_pairs(sparse), 16.0 * 2048);
  EXPECT_DOUBLE_EQ(dsa_counted_flops(sparse), 16.0 * 2048 * 2 * 128 * (576 + 512));
  EXPECT_DOUBLE_EQ(dsa_counted_bytes(sparse), 16.0 * 2048 * 576 * 2 + 16.0 * 128 * (576 + 512) * 2);
  // Prefill: query t sees t + 1 keys, min(t + 1, K) of them selected.
  DsaWorkload p = tiny(DsaPart::step, true, 1, 40);
  p.index_topk = 10;
  EXPECT_DOUBLE_EQ(dsa_candidate_pairs(p), 40.0 * 41 / 2);
  double selected = 0;
  for (int t = 0; t < 40; ++t) selected += std::min(t + 1, 10);
  EXPECT_DOUBLE_EQ(dsa_selected_pairs(p), selected);
  const Workload dense = dsa_dense_companion(named(dsa_workloads(), "dsa-prefill-1x32768"));
  EXPECT_TRUE(dense.is_mla_mha());
  EXPECT_EQ(dense.new_tokens, 32768);
  EXPECT_EQ(dsa_dense_companion(index).name, "mla-decode-h128-64x32768");
  EXPECT_TRUE(dsa_target(named(dsa_workloads(), "dsa-decode-16x131072")).at_most);
  EXPECT_DOUBLE_EQ(dsa_target(named(dsa_workloads(), "dsa-decode-16x131072")).value, 0.15);
  EXPECT_DOUBLE_EQ(dsa_target(named(dsa_workloads(), "dsa-decode-64x32768")).value, 0.35);
}

TEST(BenchDsa, ShrinkingScalesTheSelectionWithTheLengths) {
  const std::vector<DsaWorkload> small = apply_dsa_preset(dsa_workloads(), "cpu-small");
  for (const DsaWorkload& w : small) {
    SCOPED_TRACE(w.name);
    EXPECT_FALSE(w.scale_note.empty());
    EXPECT_LE(attention_work(dsa_dense_companion(w)), 2e10);
    const DsaWorkload& s = named(dsa_workloads(), w.name);
    EXPECT_EQ(static_cast<double>(w.index_topk) / w.kv_len,
              static_cast<double>(s.index_topk) / s.kv_len);
    EXPECT_LT(w.index_topk, w.kv_len) << "the selection stays real";
  }
  const DsaWorkload half = scale_dsa_workload(named(dsa_workloads(), "dsa-decode-64x32768"), 0.5);
  EXPECT_EQ(half.batch, 32);
  EXPECT_EQ(half.kv_len, 16384);
  EXPECT_EQ(half.index_topk, 1024);
  EXPECT_NE(half.scale_note.find("scaled x0.5"), std::string::npos);
  test::expect_error([] { apply_dsa_preset(dsa_workloads(), "gpu-huge"); },
                     {"unknown --preset 'gpu-huge'"});
}

TEST(BenchDsa, EveryPartRunsOnCpuCheckedAgainstReference) {
  BenchConfig config = test::tiny_bench_config("cpu");
  config.dsa_workloads = {tiny(DsaPart::step, false, 3, 200), tiny(DsaPart::index, false, 3, 200),
                          tiny(DsaPart::sparse, false, 3, 200), tiny(DsaPart::step, true, 1, 96)};
  const BenchResult r = run_bench(config);
  ASSERT_EQ(r.dsa_rows.size(), 4u);
  for (const DsaRowResult& row : r.dsa_rows) {
    SCOPED_TRACE(row.workload.name);
    ASSERT_EQ(row.status, "ok") << row.error;
    EXPECT_TRUE(row.check.passed) << row.check.method;
    EXPECT_GT(row.selected_checked, 0);
    EXPECT_EQ(row.selection_mismatches, 0) << row.check.method;
    EXPECT_EQ(row.time.repeats, 2);
    ASSERT_TRUE(row.dense_workload.has_value());
    EXPECT_GT(row.dense_time.median, 0);
    EXPECT_GT(row.figure, 0);
    EXPECT_FALSE(row.figure_name.empty());
  }
  EXPECT_EQ(r.dsa_rows[0].figure, r.dsa_rows[0].time.median / r.dsa_rows[0].dense_time.median);
  EXPECT_EQ(r.dsa_rows[1].bound, Bound::memory);
  EXPECT_EQ(r.dsa_rows[2].check.rows_checked, 2) << "the first and the last request";
  EXPECT_EQ(r.dsa_rows[3].check.rows_checked, 16) << "the last 16 tokens of the prefill";
  EXPECT_TRUE(r.dsa_rows[3].dense_workload->is_mla_mha());
  EXPECT_TRUE(r.all_passed());
  const RunInfo info = make_run_info("test", 1.0, "");
  const nlohmann::json j = to_json(r, info);
  ASSERT_EQ(j["rows"].size(), 4u);
  EXPECT_EQ(j["rows"][1]["suite"], "dsa");
  EXPECT_EQ(j["rows"][1]["shape"]["part"], "index");
  EXPECT_EQ(j["rows"][1]["counted"]["bytes"].get<double>(), 3.0 * 200 * (32 + 4));
  EXPECT_GT(j["rows"][2]["dense"]["time_ms"]["median"].get<double>(), 0);
  const std::string text = format_report(r, info);
  EXPECT_NE(text.find("dsa row"), std::string::npos) << text;
  EXPECT_NE(text.find("tiny-dsa-sparse"), std::string::npos) << text;
}

// A backend without DSA caps (the cuda backend until it serves DSA) gets n/a rows, and with only
// such rows nothing is measured: the run passes.
TEST(BenchDsa, RowsAreNotApplicableOnABackendWithoutDsa) {
  BackendEntry e = reference_backend_entry();
  e.name = "no-dsa";
  e.auto_selectable = false;
  e.caps.dsa = false;
  Registry registry;
  registry.add(std::move(e));
  BenchConfig config = test::tiny_bench_config("no-dsa");
  config.registry = &registry;
  config.dsa_workloads = {tiny(DsaPart::step, false, 2, 100), tiny(DsaPart::step, true, 1, 64)};
  const BenchResult r = run_bench(config);
  ASSERT_EQ(r.dsa_rows.size(), 2u);
  for (const DsaRowResult& row : r.dsa_rows) {
    EXPECT_EQ(row.status, "n/a");
    EXPECT_EQ(row.error,
              "no-dsa does not serve DSA layers (no DSA caps; docs/dsa.md \"Backends\")");
    EXPECT_EQ(row.time.repeats, 0);
  }
  EXPECT_TRUE(r.all_passed());
  EXPECT_FALSE(r.ceilings.memory.available());
  const RunInfo info = make_run_info("test", 1.0, "");
  EXPECT_NE(format_report(r, info).find("n/a: no-dsa does not serve DSA layers"),
            std::string::npos);
  EXPECT_EQ(to_json(r, info)["rows"][0]["status"], "n/a");
}

}  // namespace
