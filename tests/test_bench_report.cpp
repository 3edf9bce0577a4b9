// Bench reporting: timing statistics, the JSON schema, the SVG chart, and the CPU ceiling probes'
// error paths. No assertion here depends on how fast anything ran.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "bench/harness/ceilings.h"
#include "bench/harness/chart.h"
#include "bench/harness/dsa_workload.h"
#include "bench/harness/linear_workload.h"
#include "bench/harness/report.h"
#include "bench/harness/row_figures.h"
#include "bench/harness/timing.h"
#include "tests/test_util.h"

using namespace attnrt;
using namespace attnrt::bench;

namespace {

using attnrt::test::error_or;
using attnrt::test::expect_error;

const Workload& by_name(const std::string& name) {
  static const std::vector<Workload> rows = standard_workloads();
  return attnrt::test::by_name(rows, name);
}

// Without a usable GPU, fn (which asks for the cuda device) fails: the device is not usable or,
// without CUDA in the build, with `without_cuda`.
void expect_cuda_refused(const std::function<void()>& fn, const std::string& without_cuda) {
  if (query_cuda().usable) return;
  expect_error(fn, {built_with_cuda() ? "no usable CUDA device" : without_cuda});
}

TimingStats stats(double median_seconds) {
  return TimingStats::from_samples({median_seconds * 0.9, median_seconds, median_seconds * 1.2});
}

// A row run in `seconds` (planned in `plan_seconds`) over `amount` bytes or FLOPs, against a
// ceiling of `ceiling` G/s.
void set_timing(RowResult& row, double seconds, double plan_seconds, double amount,
                double ceiling) {
  row.time = stats(seconds);
  row.plan = stats(plan_seconds);
  row.rate = amount / seconds / 1e9;
  row.pct_of_ceiling = 100 * row.rate / ceiling;
}

// A result as run_bench would produce it, with one row of each kind of outcome.
BenchResult synthetic_result() {
  BenchResult r;
  r.backend = "cpu";
  r.threads = 2;
  r.repeats = 3;
  r.warmup = 1;
  r.timer_method = "steady_clock";
  r.ceilings.threads = 2;
  r.ceilings.simd_target = "AVX3";
  r.ceilings.memory = {20.0, "streaming read", ""};
  r.ceilings.fp32 = {100.0, "fma", ""};
  r.ceilings.bf16 = {0.0, "", "n/a: no AVX512-BF16"};

  RowResult decode;
  decode.standard = by_name("decode-16x4096");
  decode.workload = scale_workload(decode.standard, 0.5);
  decode.check = {"float64", 16, 1e-3, 2e-2, true};
  decode.bytes = counted_bytes(decode.workload);
  set_timing(decode, 0.010, 2e-6, decode.bytes, 20.0);
  ReferenceResult ref;
  ref.workload = fit_workload(decode.workload, 1e6, 1e30, "reference measured scaled down");
  ref.time = stats(0.5);
  ref.speedup = 42.0;
  ref.check = {"vs reference", 4, 2e-3, 2e-2, true};
  ref.note = "scaled";
  decode.reference = ref;

  RowResult prefill;
  prefill.standard = prefill.workload = by_name("prefill-1x4096");
  prefill.bound = Bound::compute;
  prefill.check = {"float64", 64, 3e-3, 2e-2, true};
  prefill.flops = counted_flops(prefill.workload);
  set_timing(prefill, 2.0, 1e-6, prefill.flops, 100.0);

  RowResult verify;
  verify.standard = verify.workload = by_name("verify-tree-64x4096+16-topk4");
  verify.check = {"float64", 8, 1e-3, 2e-2, true};
  verify.time = stats(0.2);
  verify.plan = stats(5e-6);
  verify.rate = 5;
  verify.pct_of_ceiling = 25;
  verify.decode_workload = decode_companion(verify.workload);
  verify.decode_time = stats(0.1);
  verify.decode_ratio = 2.0;

  RowResult broken;
  broken.standard = broken.workload = by_name("decode-16x4096-fp8");
  broken.status = "error";
  broken.error = "backend 'cpu' does not support <fp8> & friends";

  r.rows = {decode, prefill, verify, broken};
  return r;
}

RunInfo synthetic_info() {
  RunInfo info;
  info.command = "attnrt bench --scale 0.5";
  info.scale = 0.5;
  info.created = "2026-01-01T00:00:00Z";
  info.commit = "abc1234";
  info.machine.cpu_model = "Test CPU <model>";
  return info;
}

// Minimal XML well-formedness check: every tag closes in order, attributes are quoted, text holds
// no raw '<' or unescaped '&'.
std::string xml_problem(const std::string& xml) {
  std::vector<std::string> open;
  size_t i = 0;
  while (i < xml.size()) {
    if (xml[i] == '&') {
      size_t semi = xml.find(';', i);
      std::string ent = xml.substr(i, semi == std::string::npos ? 8 : semi - i + 1);
      if (ent != "&amp;" && ent != "&lt;" && ent != "&gt;" && ent != "&quot;") {
        return "bad entity at " + std::to_string(i) + ": " + ent;
      }
      i = semi + 1;
      continue;
    }
    if (xml[i] != '<') {
      ++i;
      continue;
    }
    size_t close = i + 1;
    bool in_quote = false;
    for (; close < xml.size(); ++close) {
      if (xml[close] == '"') in_quote = !in_quote;
      if (xml[close] == '<' && !in_quote) return "'<' inside a tag at " + std::to_string(close);
      if (xml[close] == '>' && !in_quote) break;
    }
    if (close >= xml.size()) return "unterminated tag at " + std::to_string(i);
    std::string tag = xml.substr(i + 1, close - i - 1);
    if (in_quote) return "unbalanced quote in <" + tag + ">";
    if (tag[0] == '/') {
      std::string name = tag.substr(1);
      if (open.empty() || open.back() != name) return "</" + name + "> closes nothing open";
      open.pop_back();
    } else if (tag.back() != '/') {
      open.push_back(tag.substr(0, tag.find_first_of(" \n")));
    }
    i = close + 1;
  }
  if (!open.empty()) return "<" + open.back() + "> never closed";
  return "";
}

}  // namespace

TEST(BenchTiming, StatisticsOfSamples) {
  std::mt19937 rng(7);
  std::vector<double> samples;
  for (int i = 0; i < 11; ++i) samples.push_back(std::uniform_real_distribution<double>(1, 2)(rng));
  TimingStats s = TimingStats::from_samples(samples);
  std::sort(samples.begin(), samples.end());
  EXPECT_EQ(s.repeats, 11);
  EXPECT_DOUBLE_EQ(s.median, samples[5]);
  EXPECT_DOUBLE_EQ(s.min, samples.front());
  EXPECT_DOUBLE_EQ(s.max, samples.back());
  EXPECT_DOUBLE_EQ(s.p10, samples[1]);  // 0.1 * 10 lands exactly on the second sample
  EXPECT_DOUBLE_EQ(s.p90, samples[9]);
  TimingStats even = TimingStats::from_samples({4, 1, 3, 2});
  EXPECT_DOUBLE_EQ(even.median, 2.5);
  expect_error([] { TimingStats::from_samples({}); }, {"no timing samples"});
}

TEST(BenchTiming, RepeatedTimingCallsTheBodyWarmupPlusRepeats) {
  auto timer = make_device_timer(Device::cpu());
  int calls = 0;
  TimingStats s = time_repeated(*timer, [&] { ++calls; }, 3, 5);
  EXPECT_EQ(calls, 8);
  EXPECT_EQ(s.repeats, 5);
  EXPECT_LE(s.min, s.median);
  EXPECT_LE(s.median, s.max);
  expect_error(
      [&] {
        time_repeated(
            *timer, [] {}, 0, 0);
      },
      {"--repeats 0"});
  // Where a GPU is usable the CUDA backend's timer works (tests/test_cuda_graphs.cpp).
  expect_cuda_refused([] { make_device_timer(Device::cuda(0)); }, "no timer for cuda");
}

TEST(BenchTiming, GpuFlushModeFromEnvironmentIsWriteOrClean) {
  const char* name = "ATTNRT_BENCH_FLUSH";
  const char* before = std::getenv(name);
  const std::string saved = before != nullptr ? before : "";
  unsetenv(name);
  EXPECT_EQ(gpu_flush_from_env(), GpuFlush::write);
  setenv(name, "", 1);
  EXPECT_EQ(gpu_flush_from_env(), GpuFlush::write);
  setenv(name, "write", 1);
  EXPECT_EQ(gpu_flush_from_env(), GpuFlush::write);
  setenv(name, "clean", 1);
  EXPECT_EQ(gpu_flush_from_env(), GpuFlush::clean);
  EXPECT_STREQ(gpu_flush_name(GpuFlush::write), "write");
  EXPECT_STREQ(gpu_flush_name(GpuFlush::clean), "clean");
  for (const char* bad : {"read", "Clean", "clean ", "1", "memset"}) {
    setenv(name, bad, 1);
    EXPECT_EQ(error_or([] { gpu_flush_from_env(); }, ""),
              std::string("bench: ATTNRT_BENCH_FLUSH=") + bad + " is invalid; use write or clean");
  }
  if (before != nullptr) {
    setenv(name, saved.c_str(), 1);
  } else {
    unsetenv(name);
  }
}

TEST(BenchCeilings, CpuProbesMeasureSomethingAndGpuNeedsAProbe) {
  EXPECT_GT(cpu_stream_read_gbps(size_t{8} << 20, 1, 1), 0);
  EXPECT_GT(cpu_fma_gflops(1, 0.005, 1), 0);
  std::string why;
  double bf16 = cpu_bf16_dot_gflops(1, 0.005, 1, &why);
  EXPECT_TRUE(bf16 > 0 ? why.empty() : why.find("n/a") == 0) << why;
  EXPECT_FALSE(cpu_simd_target().empty());
  expect_cuda_refused([] { measure_ceilings(Device::cuda(0)); }, "no ceiling probe for cuda");
}

TEST(BenchCeilings, ComputeCeilingIsTheHigherMeasuredPeak) {
  Ceilings c;
  c.fp32 = {100.0, "fma", ""};
  c.bf16 = {0.0, "", "n/a: no AVX512-BF16"};
  EXPECT_EQ(c.compute_name(), "fp32");
  EXPECT_DOUBLE_EQ(c.compute().value, 100.0);
  c.bf16 = {250.0, "dot", ""};
  EXPECT_EQ(c.compute_name(), "bf16");
  EXPECT_DOUBLE_EQ(c.compute().value, 250.0);
  c.bf16.value = 60.0;  // a CPU that issues the bf16 dot on fewer ports than FMA
  EXPECT_EQ(c.compute_name(), "fp32");
}

TEST(BenchCeilings, ThreadCountFromFlagThenEnvironment) {
  EXPECT_EQ(resolve_threads(3), 3);
  const char* saved = std::getenv("ATTNRT_NUM_THREADS");
  std::string keep = saved ? saved : "";
  setenv("ATTNRT_NUM_THREADS", "5", 1);
  EXPECT_EQ(resolve_threads(0), 5);
  EXPECT_EQ(resolve_threads(2), 2);
  setenv("ATTNRT_NUM_THREADS", "five", 1);
  expect_error([] { resolve_threads(0); }, {"ATTNRT_NUM_THREADS='five'"});
  if (saved) {
    setenv("ATTNRT_NUM_THREADS", keep.c_str(), 1);
  } else {
    unsetenv("ATTNRT_NUM_THREADS");
  }
  expect_error([] { resolve_threads(-1); }, {"--threads -1"});
}

// The page-1 gather probe's two ceilings (GPU runs): printed with the others when measured,
// absent from the text when not (CPU runs), in the JSON either way.
TEST(BenchReport, GatherCeilingsArePrintedWhenMeasured) {
  BenchResult r = synthetic_result();
  r.ceilings.gather_random.unavailable = "GPU only";
  r.ceilings.gather_ordered.unavailable = "GPU only";
  std::string text = format_report(r, synthetic_info());
  EXPECT_EQ(text.find("  gather "), std::string::npos) << text;
  nlohmann::json j = to_json(r, synthetic_info());
  EXPECT_EQ(j["ceilings"]["gather_random"]["available"], false);
  EXPECT_EQ(j["ceilings"]["gather_random"]["reason"], "GPU only");

  r.ceilings.gather_random = {2400.0, "at a random permutation of the slots (80% ...)", ""};
  r.ceilings.gather_ordered = {3000.0, "in slot order: ...", ""};
  text = format_report(r, synthetic_info());
  EXPECT_NE(text.find("  gather     2400.0 GB/s"), std::string::npos) << text;
  EXPECT_NE(text.find("  ordered    3000.0 GB/s"), std::string::npos) << text;
  j = to_json(r, synthetic_info());
  EXPECT_DOUBLE_EQ(j["ceilings"]["gather_random"]["value"].get<double>(), 2400.0);
  EXPECT_DOUBLE_EQ(j["ceilings"]["gather_ordered"]["value"].get<double>(), 3000.0);
  EXPECT_EQ(j["ceilings"]["gather_ordered"]["unit"], "GB/s");
}

TEST(BenchReport, JsonCarriesMachineCommitCeilingsAndRows) {
  BenchResult r = synthetic_result();
  nlohmann::json j = to_json(r, synthetic_info());
  EXPECT_EQ(j["schema"], "attnrt-bench/1");
  EXPECT_EQ(j["commit"], "abc1234");
  EXPECT_EQ(j["backend"], "cpu");
  EXPECT_EQ(j["threads"], 2);
  EXPECT_EQ(j["repeats"], 3);
  for (const char* key : {"cpu_model", "logical_cpus", "physical_cores", "memory_gib",
                          "simd_target", "cuda"}) {
    EXPECT_TRUE(j["machine"].contains(key)) << key;
  }
  EXPECT_DOUBLE_EQ(j["ceilings"]["memory"]["value"].get<double>(), 20.0);
  EXPECT_EQ(j["ceilings"]["bf16"]["available"], false);
  EXPECT_EQ(j["ceilings"]["bf16"]["reason"], "n/a: no AVX512-BF16");
  EXPECT_EQ(j["ceilings"]["compute"], "fp32");
  EXPECT_DOUBLE_EQ(j["scale"]["factor"].get<double>(), 0.5);

  const auto& rows = j["rows"];
  ASSERT_EQ(rows.size(), 4u);
  const auto& d = rows[0];
  EXPECT_EQ(d["name"], "decode-16x4096");
  EXPECT_EQ(d["scaled"], true);
  EXPECT_EQ(d["standard"]["batch"], 16);
  EXPECT_EQ(d["shape"]["batch"], 8);
  EXPECT_EQ(d["shape"]["kv_len"], 2048);
  EXPECT_EQ(d["shape"]["kv_dtype"], "bf16");
  EXPECT_DOUBLE_EQ(d["time_ms"]["median"].get<double>(), 10.0);
  for (const char* key : {"min", "max", "p10", "p90", "repeats"}) {
    EXPECT_TRUE(d["time_ms"].contains(key)) << key;
  }
  EXPECT_DOUBLE_EQ(d["plan_us"]["median"].get<double>(), 2.0);
  EXPECT_EQ(d["metric"], "GB/s");
  EXPECT_EQ(d["ceiling"], "memory");
  EXPECT_DOUBLE_EQ(d["pct_of_ceiling"].get<double>(), r.rows[0].pct_of_ceiling);
  EXPECT_DOUBLE_EQ(d["counted"]["bytes"].get<double>(), counted_bytes(r.rows[0].workload));
  EXPECT_DOUBLE_EQ(d["reference"]["speedup"].get<double>(), 42.0);
  EXPECT_EQ(d["reference"]["scaled"], true);
  EXPECT_EQ(d["check"]["passed"], true);

  EXPECT_EQ(rows[1]["metric"], "GFLOP/s");
  EXPECT_EQ(rows[1]["ceiling"], "fp32");
  EXPECT_FALSE(rows[1].contains("reference"));

  const auto& v = rows[2];
  EXPECT_DOUBLE_EQ(v["decode"]["ratio"].get<double>(), 2.0);
  EXPECT_EQ(v["decode"]["shape"]["kind"], "decode");
  EXPECT_EQ(v["shape"]["tree_parents"].size(), 16u);
  EXPECT_EQ(v["shape"]["topk"], 4);

  EXPECT_EQ(rows[3]["status"], "error");
  EXPECT_EQ(rows[3]["error"], r.rows[3].error);
  EXPECT_FALSE(rows[3].contains("time_ms"));
}

TEST(BenchReport, TableNamesEveryRowAndMarksScaledOnes) {
  std::string table = format_report(synthetic_result(), synthetic_info());
  EXPECT_NE(table.find("decode-16x4096*"), std::string::npos) << table;
  EXPECT_NE(table.find("SCALED RUN (--scale 0.5)"), std::string::npos);
  EXPECT_NE(table.find("scaled x0.5 from 16x4096"), std::string::npos);
  EXPECT_NE(table.find("verify / decode = 2.00x"), std::string::npos) << table;
  EXPECT_NE(table.find("64x4096"), std::string::npos);
  EXPECT_NE(table.find("ERROR: backend 'cpu' does not support"), std::string::npos);
  EXPECT_NE(table.find("42.0x"), std::string::npos);
  EXPECT_NE(table.find("n/a: no AVX512-BF16"), std::string::npos);
  EXPECT_NE(table.find("median of 3 repeats after 1 warm-up calls (fewer than the 10"),
            std::string::npos);
}

// An fp8 row and the 16-bit row of its shape in one run: the report gives their time ratio (the
// tokens/s ratio; their GB/s count different bytes). An fp8 row without its 16-bit row, and an
// untimed one, get no line.
TEST(BenchReport, Fp8RowsAreComparedWithTheir16BitRowInTime) {
  BenchResult r = synthetic_result();
  static const std::vector<Workload> mla = mla_workloads();
  auto row_of = [](const std::string& name, double seconds) {
    RowResult row;
    row.standard = row.workload = attnrt::test::by_name(mla, name);
    row.check = {"float64", 8, 1e-3, 2e-2, true};
    row.bytes = counted_bytes(row.workload);
    set_timing(row, seconds, 1e-6, row.bytes, 20.0);
    return row;
  };
  r.rows.push_back(row_of("mla-decode-h16-64x8192", 2.229e-4));
  r.rows.push_back(row_of("mla-decode-h16-64x8192-fp8", 1.294e-4));
  r.rows.push_back(row_of("mla-decode-h16-1x32768-fp8", 2.53e-5));
  const std::string table = format_report(r, synthetic_info());
  EXPECT_NE(table.find("fp8 KV rows against the 16-bit row of the same shape"), std::string::npos)
      << table;
  EXPECT_NE(table.find("mla-decode-h16-64x8192-fp8           1.72x mla-decode-h16-64x8192"),
            std::string::npos)
      << table;
  EXPECT_EQ(table.find("mla-decode-h16-1x32768-fp8 "), table.rfind("mla-decode-h16-1x32768-fp8 "))
      << "one line, the row's own: no 16-bit row of its shape ran\n"
      << table;
  // decode-16x4096-fp8 failed in synthetic_result and decode-16x4096 ran scaled: no line.
  EXPECT_EQ(table.find("x decode-16x4096"), std::string::npos) << table;
  // Without an fp8 row beside its 16-bit one, no section.
  EXPECT_EQ(format_report(synthetic_result(), synthetic_info()).find("fp8 KV rows against"),
            std::string::npos);
}

TEST(BenchReport, PlanRowsCarryTheirPhasesWhenTimed) {
  BenchResult r = synthetic_result();
  r.host_sync = "spin";
  PlanTiming decode;
  decode.workload = by_name("decode-64x4096");
  decode.workload.name = "plan-decode-256x2048";
  decode.time = stats(9e-6);
  decode.parts = PlanParts{stats(0.1e-6), stats(0.2e-6), stats(3e-6), stats(2e-6), stats(4e-6)};
  decode.stream = "own";
  PlanTiming extend = decode;
  extend.workload.name = "plan-extend-256x(2048+16)";
  extend.parts.reset();
  r.plans = {decode, extend};

  const nlohmann::json j = to_json(r, synthetic_info());
  EXPECT_EQ(j["host_sync"], "spin");
  const auto& plans = j["plan_bs256"];
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_DOUBLE_EQ(plans[0]["plan_us"]["median"].get<double>(), 9.0);
  EXPECT_DOUBLE_EQ(plans[0]["parts_us"]["capture"]["median"].get<double>(), 0.1);
  EXPECT_DOUBLE_EQ(plans[0]["parts_us"]["staging"]["median"].get<double>(), 0.2);
  EXPECT_DOUBLE_EQ(plans[0]["parts_us"]["prepare"]["median"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(plans[0]["parts_us"]["write"]["median"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(plans[0]["parts_us"]["copy"]["median"].get<double>(), 4.0);
  EXPECT_FALSE(plans[1].contains("parts_us"));
  EXPECT_EQ(plans[0]["stream"], "own");

  const std::string table = format_report(r, synthetic_info());
  EXPECT_NE(table.find("the host waits: spin; on the KV cache's own stream"), std::string::npos)
      << table;
  EXPECT_NE(table.find("plan-decode-256x2048 parts: capture 0.10 us, staging 0.20, prepare 3.00, "
                       "write 2.00, copy 4.00"),
            std::string::npos)
      << table;
  EXPECT_EQ(table.find("plan-extend-256x(2048+16) parts"), std::string::npos) << table;
}

// A row counted by its bytes that does more FLOPs per byte than the machine's balance (compute
// ceiling / memory ceiling) gets a note with its share of the compute ceiling; one below it does
// not, and neither does a compute row.
TEST(BenchRates, MemoryRowsAboveTheMachineBalanceSayTheyAreComputeBound) {
  Ceilings c;
  c.memory = {20.0, "read", ""};
  c.fp32 = {400.0, "fma", ""};  // balance 20 FLOP per byte
  RowResult row;
  row.bound = Bound::memory;
  row.time = stats(1.0);
  row.bytes = 10e9;
  row.flops = 300e9;  // 30 FLOP per byte
  set_rate(row, c);
  EXPECT_DOUBLE_EQ(row.rate, 10.0);
  EXPECT_DOUBLE_EQ(row.pct_of_ceiling, 50.0);
  ASSERT_EQ(row.notes.size(), 1u);
  EXPECT_NE(row.notes[0].find("compute-bound on this machine: 30.0 FLOP per byte, above its "
                              "balance of 20.0 (fp32 ceiling / memory ceiling): 300.0 GFLOP/s, "
                              "75% of the fp32 ceiling"),
            std::string::npos)
      << row.notes[0];
  RowResult light = row;
  light.notes.clear();
  light.flops = 100e9;  // 10 FLOP per byte
  set_rate(light, c);
  EXPECT_TRUE(light.notes.empty());
  RowResult compute = row;
  compute.notes.clear();
  compute.bound = Bound::compute;
  set_rate(compute, c);
  EXPECT_TRUE(compute.notes.empty());
  EXPECT_DOUBLE_EQ(compute.pct_of_ceiling, 75.0);
}

TEST(BenchChart, SvgIsWellFormedAndLabelsEveryRow) {
  BenchResult r = synthetic_result();
  std::string svg = render_svg(r, synthetic_info());
  EXPECT_EQ(xml_problem(svg), "") << svg;
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  for (const RowResult& row : r.rows) EXPECT_NE(svg.find(row.workload.name), std::string::npos);
  EXPECT_NE(svg.find(">100%<"), std::string::npos) << "the ceiling line is labelled";
  EXPECT_NE(svg.find("Test CPU &lt;model&gt;"), std::string::npos) << "text is escaped";
  EXPECT_NE(svg.find("&lt;fp8&gt; &amp; friends"), std::string::npos);
  EXPECT_NE(svg.find("2.00x the decode time"), std::string::npos);
  EXPECT_NE(svg.find("% of fp32 FMA peak"), std::string::npos);
  // A bar whose value exceeds the axis still produces a well-formed chart.
  r.rows[0].pct_of_ceiling = 1e6;
  EXPECT_EQ(xml_problem(render_svg(r, synthetic_info())), "");
  // The checker itself rejects broken markup.
  EXPECT_NE(xml_problem("<svg><text>a & b</text></svg>"), "");
  EXPECT_NE(xml_problem("<svg><g></svg>"), "");
}

// --suite linear, dsa and all: their rows are drawn too, each in its own group, a DSA row's label
// with its figure against the dense MLA row and the target; a row that did not run says why.
TEST(BenchChart, LinearAndDsaRowsAreDrawn) {
  BenchResult r = synthetic_result();
  r.rows.clear();
  LinearRowResult gdn;
  gdn.standard = gdn.workload = select_linear_workloads("gdn-decode-64").at(0);
  gdn.time = stats(1e-3);
  gdn.rate = 12.5;
  gdn.pct_of_ceiling = 62.5;
  gdn.tokens_per_second = 64e3;
  LinearRowResult kda;
  kda.standard = kda.workload = select_linear_workloads("kda-extend-8x8192").at(0);
  kda.bound = Bound::compute;
  kda.time = stats(0.5);
  kda.rate = 40;
  kda.pct_of_ceiling = 40;
  DsaRowResult step;
  step.standard = step.workload = select_dsa_workloads("dsa-decode-64x32768").at(0);
  step.time = stats(8e-4);
  step.rate = 87.5;
  step.pct_of_ceiling = 11;
  step.figure_name = "dsa / dense time";
  step.figure = 0.553;
  step.target = {0.35, true};
  step.target_met = false;
  DsaRowResult index;
  index.standard = index.workload = select_dsa_workloads("dsa-index-64x32768").at(0);
  index.status = "n/a";
  index.error = "backend 'x' does not serve DSA";
  r.linear_rows = {gdn, kda};
  r.dsa_rows = {step, index};

  const std::string svg = render_svg(r, synthetic_info());
  EXPECT_EQ(xml_problem(svg), "") << svg;
  for (const char* text :
       {"gdn-decode-64", "62%: 12.5 GB/s, 6.4e+04 tokens/s", "linear layers, decode",
        "kda-extend-8x8192", "linear layers, extend", "dsa-decode-64x32768",
        "11%: 87.5 GFLOP/s; dsa / dense time 0.553 (target &lt;= 0.35: MISS)", "DSA layer",
        "dsa-index-64x32768", "n/a: backend 'x' does not serve DSA"}) {
    EXPECT_NE(svg.find(text), std::string::npos) << text << "\n" << svg;
  }
  // Four bars (the n/a row has none), no attention groups.
  size_t bars = 0;
  for (size_t at = svg.find("<rect x=\"260\""); at != std::string::npos;
       at = svg.find("<rect x=\"260\"", at + 1))
    ++bars;
  EXPECT_EQ(bars, 3u) << svg;
  EXPECT_EQ(svg.find(">decode: % of streaming-read"), std::string::npos) << svg;
}

TEST(BenchChart, FormatComesFromTheExtension) {
  EXPECT_EQ(chart_format_for("out/chart.SVG"), ChartFormat::svg);
  expect_error([] { chart_format_for("chart.pdf"); }, {"--plot chart.pdf", ".svg"});
  std::string png = error_or([] { chart_format_for("chart.png"); }, "");
  if (!png.empty()) EXPECT_NE(png.find("rsvg-convert"), std::string::npos) << png;
  expect_error(
      [] { write_chart("/nonexistent-dir/chart.svg", synthetic_result(), synthetic_info()); },
      {"/nonexistent-dir/chart.svg"});
}
