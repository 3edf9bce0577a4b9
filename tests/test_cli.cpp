// The attnrt command-line tool end to end: the built binary (path in ATTNRT_CLI, set by CMake for
// ctest) is run in a shell and its exit status, stdout and stderr are checked.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/test_util.h"

namespace {

namespace fs = std::filesystem;

using Result = attnrt::test::CommandResult;
using attnrt::test::read_text;

class Cli : public attnrt::test::CliTest {
 protected:
  fs::path write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p;
  }
  // `attnrt bench ARGS --json FILE` succeeds and prints each of `parts`; returns the JSON.
  nlohmann::json bench_json(const std::string& args, std::initializer_list<const char*> parts) {
    const fs::path json = dir_ / "bench.json";
    const Result r = run(fmt::format("bench {} --json '{}'", args, json.string()));
    EXPECT_EQ(r.status, 0) << r.out << r.err;
    for (const char* part : parts) {
      EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from\n" << r.out;
    }
    return nlohmann::json::parse(read_text(json));
  }
  // `attnrt ARGS` is refused as a usage error (status 2) whose message contains `says`.
  void expect_refused(const std::string& args, const std::string& says) {
    const Result r = run(args);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_NE(r.err.find(says), std::string::npos) << args << ": " << r.err;
  }
};

constexpr const char* kTinyTrace =
    "{\"id\": \"a\", \"arrival_step\": 1, \"prompt_len\": 30, \"output_len\": 5}\n"
    "{\"id\": \"b\", \"arrival_step\": 1, \"prompt_len\": 50, \"output_len\": 4, "
    "\"shared_prefix\": "
    "\"sys\", \"shared_prefix_len\": 16}\n"
    "{\"id\": \"c\", \"arrival_step\": 2, \"prompt_len\": 24, \"output_len\": 6, "
    "\"shared_prefix\": "
    "\"sys\", \"shared_prefix_len\": 16}\n";

TEST_F(Cli, HelpListsSubcommandsAndRunOptions) {
  Result r = run("--help");
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* cmd : {"info", "check", "run", "replay", "bench"}) {
    EXPECT_NE(r.out.find(cmd), std::string::npos) << cmd;
  }
  r = run("run --help");
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* opt : {"--model", "--trace", "--check-every", "--seed", "--dump-step", "--json",
                          "--no-progress", "--attention-backend", "--speculative-num-steps",
                          "--chunked-prefill-size", "--max-running-requests"}) {
    EXPECT_NE(r.out.find(opt), std::string::npos) << opt;
  }
  r = run("check --help");
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* opt : {"--backend", "--cases", "--seed", "--feature"}) {
    EXPECT_NE(r.out.find(opt), std::string::npos) << opt;
  }
}

TEST_F(Cli, VersionPrintsTheVersionCommitAndCudaBuild) {
  const Result r = run("--version");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.rfind("attnrt " ATTNRT_TEST_VERSION " (commit ", 0), 0u) << r.out;
  EXPECT_TRUE(r.out.find("CUDA") != std::string::npos) << r.out;
  // A subcommand stays required otherwise.
  const Result none = run("");
  EXPECT_NE(none.status, 0);
  EXPECT_NE((none.out + none.err).find("subcommand"), std::string::npos) << none.err;
}

TEST_F(Cli, RunReplaysATinyTraceOnReference) {
  const fs::path trace = write("tiny.jsonl", kTinyTrace);
  const fs::path json = dir_ / "report.json";
  const Result r =
      run(fmt::format("run --trace '{}' --attention-backend reference --no-progress "
                      "--check-every 2 --chunked-prefill-size 32 --json '{}'",
                      trace.string(), json.string()));
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  for (const char* part : {"EXTEND", "DECODE", "MIXED", "IDLE", "total", "reference",
                           "pool check (target): ok", "3 requests"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from\n" << r.out;
  }
  EXPECT_EQ(r.err, "");  // --no-progress: nothing on stderr
  const nlohmann::json j = nlohmann::json::parse(read_text(json));
  EXPECT_TRUE(j["ok"].get<bool>());
  EXPECT_EQ(j["backends"]["prefill"], "reference");
  EXPECT_TRUE(j["pool_check"]["target"]["ok"].get<bool>());
  // 30 + 50 + 24 prompt tokens less 16 reused from the cache, plus 4 + 3 + 5 decoded tokens.
  EXPECT_EQ(j["total"]["tokens"].get<int64_t>(), 30 + 50 + 24 - 16 + 4 + 3 + 5);
  int64_t checked = 0;
  for (const auto& m : j["modes"]) checked += m["checked_steps"].get<int64_t>();
  EXPECT_GT(checked, 0);
}

TEST_F(Cli, RunWithSpeculationAndDumpStep) {
  const fs::path trace = write("tiny.jsonl", kTinyTrace);
  const fs::path cases = dir_ / "case";
  const Result r = run(fmt::format(
      "run --trace '{}' --attention-backend reference --no-progress --speculative-num-steps 2 "
      "--speculative-eagle-topk 2 --speculative-num-draft-tokens 4 --dump-step 3 '{}'",
      trace.string(), cases.string()));
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  for (const char* part : {"TARGET_VERIFY", "DRAFT_EXTEND (draft)", "pool check (draft): ok",
                           "step case written to"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from\n" << r.out;
  }
  EXPECT_TRUE(fs::exists(cases / "case.json"));
  const Result replay = run(fmt::format("replay '{}' --backend reference", cases.string()));
  EXPECT_EQ(replay.status, 0) << replay.out << replay.err;
}

TEST_F(Cli, PrintTraceWritesAReplayableTrace) {
  Result r = run("run --print-trace");
  ASSERT_EQ(r.status, 0) << r.err;
  const fs::path builtin = write("builtin.jsonl", r.out);
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 34);
  EXPECT_NE(r.out.find("\"shared_prefix\":\"sys-a\""), std::string::npos) << r.out;
  // Read back and printed again: the same text.
  r = run(fmt::format("run --trace '{}' --print-trace", builtin.string()));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, read_text(builtin));
}

TEST_F(Cli, BadInputExitsTwoWithAMessage) {
  const fs::path trace = write("tiny.jsonl", kTinyTrace);
  Result r = run(fmt::format("run --trace '{}' --attention-backend no-such-backend --no-progress",
                             trace.string()));
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("no-such-backend"), std::string::npos) << r.err;

  const fs::path bad =
      write("bad.jsonl", "{\"prompt_len\": 10, \"output_len\": 2}\n{\"prompt_len\": ten}\n");
  r = run(
      fmt::format("run --trace '{}' --attention-backend reference --no-progress", bad.string()));
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("line 2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("not valid JSON"), std::string::npos) << r.err;

  r = run(fmt::format("run --trace '{}' --no-progress", (dir_ / "missing.jsonl").string()));
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("cannot open"), std::string::npos) << r.err;

  r = run(fmt::format(
      "run --trace '{}' --attention-backend reference --no-progress --dump-step 500 '{}'",
      trace.string(), (dir_ / "case").string()));
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--dump-step 500"), std::string::npos) << r.err;

  r = run("run --model no-such-model --no-progress");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("no-such-model"), std::string::npos) << r.err;

  r = run("check --backend no-such-backend");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("no-such-backend"), std::string::npos) << r.err;

  r = run("check --backend reference --feature no-such-feature");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("no-such-feature"), std::string::npos) << r.err;
}

TEST_F(Cli, CheckReportsEveryRequestedFeature) {
  const Result r = run(
      "check --backend reference --cases 4 --feature decode --feature verify_tree --no-progress");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("decode"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("verify_tree"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("2 features passed, 0 failed"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("mixed"), std::string::npos) << r.out;
}

TEST_F(Cli, BenchLinearSuiteRunsOnCpuAtSmallSizeAndWritesJson) {
  const nlohmann::json j = bench_json(
      "--backend cpu --suite linear --scale 0.01 --repeats 1 --warmup 0 --threads 2 "
      "--no-reference --quiet",
      {"linear row", "gdn-decode-64*", "kda-extend-8x8192*", "GB/s", "TFLOP/s",
       "SCALED RUN (--scale 0.01)"});
  EXPECT_NE(j["command"].get<std::string>().find("--suite linear"), std::string::npos);
  ASSERT_EQ(j["rows"].size(), 8u);
  for (const auto& row : j["rows"]) {
    SCOPED_TRACE(row["name"].get<std::string>());
    EXPECT_EQ(row["suite"], "linear");
    EXPECT_EQ(row["status"], "ok");
    EXPECT_TRUE(row["check"]["passed"].get<bool>());
    EXPECT_GT(row["time_ms"]["median"].get<double>(), 0);
    EXPECT_TRUE(row["scaled"].get<bool>());
  }
  EXPECT_EQ(j["rows"][0]["standard"]["batch"], 64);
  EXPECT_EQ(j["rows"][0]["shape"]["batch"], 1);

  expect_refused("bench --backend cpu --suite linear --workload prefill",
                 "unknown linear workload 'prefill'");
  expect_refused("bench --backend cpu --suite sideways", "--suite");
}

// --page-size reruns attention rows over another page size: the row keeps its name, its shape and
// note say the page, the JSON records it; suites without a paged cache are told so. (With
// --no-step-costs, taken and recorded: on a CPU there are no GPU step costs to skip.)
TEST_F(Cli, BenchPageSizeRunsTheRowOverThatPageSize) {
  const nlohmann::json j = bench_json(
      "--backend cpu --workload prefill-1x1024 --scale 0.0625 --page-size 32 --repeats 1 "
      "--warmup 0 --threads 2 --no-reference --quiet --no-step-costs",
      {"prefill-1x1024*", "page 32", "page 32 instead of 16"});
  EXPECT_NE(j["command"].get<std::string>().find("--page-size 32"), std::string::npos);
  EXPECT_NE(j["command"].get<std::string>().find("--no-step-costs"), std::string::npos);
  ASSERT_EQ(j["rows"].size(), 1u);
  EXPECT_EQ(j["rows"][0]["status"], "ok");
  EXPECT_TRUE(j["rows"][0]["check"]["passed"].get<bool>());
  EXPECT_EQ(j["rows"][0]["shape"]["page_size"], 32);
  EXPECT_EQ(j["rows"][0]["standard"]["page_size"], 16);

  expect_refused("bench --backend cpu --suite linear --page-size 64",
                 "only the attention and MLA rows");
  expect_refused("bench --backend cpu --page-size 0", "--page-size");
}

// `attnrt run --dump-step` of a DSA model (the deepseek-v3.2 config with index_topk 8, so the
// selection is real) writes the indexer's part of the case, and `attnrt replay` runs it on cpu and
// reference and compares selections and outputs.
TEST_F(Cli, DsaStepCaseIsDumpedAndReplayedWithItsSelection) {
  nlohmann::json config = nlohmann::json::parse(
      read_text(fs::path(__FILE__).parent_path() / "data" / "deepseek_v32_config.json"));
  config["index_topk"] = 8;
  const fs::path model = write("v32.json", config.dump());
  const fs::path trace = write("trace.jsonl", kTinyTrace);
  const fs::path dir = dir_ / "dsa-case";
  const Result r = run(fmt::format(
      "run --model '{}' --trace '{}' --attention-backend cpu --layers 2 --threads 2 --no-progress "
      "--dump-step 4 '{}'",
      model.string(), trace.string(), dir.string()));
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  for (const char* f : {"index_q.npy", "index_k.npy", "index_weights.npy", "index_key_codes.npy",
                        "index_key_scales.npy", "expected_topk.npy"}) {
    EXPECT_TRUE(fs::exists(dir / f)) << f;
  }
  const nlohmann::json c = nlohmann::json::parse(read_text(dir / "case.json"));
  EXPECT_EQ(c["version"], 2);
  EXPECT_EQ(c["layer"]["index_topk"], 8);
  EXPECT_TRUE(c["has_expected_topk"].get<bool>());

  const Result cpu = run(fmt::format("replay '{}' --backend cpu --out '{}'", dir.string(),
                                     (dir_ / "out-cpu").string()));
  ASSERT_EQ(cpu.status, 0) << cpu.out << cpu.err;
  for (const char* part :
       {"and topk.npy", "DSA layer: index_topk 8", "vs recorded output (cpu): bit-exact",
        "selection vs recorded: identical", "selection vs reference: identical"}) {
    EXPECT_NE(cpu.out.find(part), std::string::npos) << part << " missing from\n" << cpu.out;
  }
  EXPECT_TRUE(fs::exists(dir_ / "out-cpu" / "topk.npy"));
  const Result ref = run(fmt::format("replay '{}' --backend reference --out '{}'", dir.string(),
                                     (dir_ / "out-ref").string()));
  ASSERT_EQ(ref.status, 0) << ref.out << ref.err;
  EXPECT_NE(ref.out.find("selection vs recorded: identical"), std::string::npos) << ref.out;

  // A DSA case without its index-key files cannot be replayed, and says which file is missing.
  fs::remove(dir / "index_key_codes.npy");
  expect_refused(fmt::format("replay '{}'", dir.string()), "index_key_codes.npy");
}

TEST_F(Cli, BenchDsaSuiteRunsOnCpuAtCpuSmallAndWritesJson) {
  const nlohmann::json j = bench_json(
      "--backend cpu --suite dsa --preset cpu-small --repeats 1 --warmup 0 --threads 2 --quiet",
      {"dsa row", "dsa-decode-64x32768*", "dsa-index-64x32768*", "dsa-sparse-64x32768*",
       "dsa-decode-16x131072*", "dsa-index-16x131072*", "dsa-sparse-16x131072*",
       "dsa-prefill-1x32768*", "dense = mla-decode-h128-", "dense = mla-prefill-",
       "SCALED RUN (--preset cpu-small)"});
  EXPECT_NE(j["command"].get<std::string>().find("--suite dsa"), std::string::npos);
  ASSERT_EQ(j["rows"].size(), 7u);
  for (const auto& row : j["rows"]) {
    SCOPED_TRACE(row["name"].get<std::string>());
    EXPECT_EQ(row["suite"], "dsa");
    EXPECT_EQ(row["status"], "ok");
    EXPECT_TRUE(row["scaled"].get<bool>());
    EXPECT_TRUE(row["check"]["passed"].get<bool>());
    EXPECT_LE(row["check"]["max_rel_err"].get<double>(), 2e-2);
    EXPECT_GT(row["selection"]["selected_checked"].get<int>(), 0);
    const auto& shape = row["shape"];
    // An index row is the step's time minus its sparse part's; with the blocked cpu indexer that
    // difference is a few ms, within one repetition's noise on a loaded machine. The row then
    // says so and gives no rate.
    if (shape["part"] == "index" && row["time_ms"]["median"].get<double>() <= 0) {
      EXPECT_EQ(row["rate"].get<double>(), 0);
      EXPECT_NE(row["notes"].dump().find("within the noise"), std::string::npos) << row.dump();
    } else {
      EXPECT_GT(row["time_ms"]["median"].get<double>(), 0);
      EXPECT_GT(row["rate"].get<double>(), 0);
      EXPECT_GT(row["figure"]["value"].get<double>(), 0);
    }
    EXPECT_GT(row["dense"]["time_ms"]["median"].get<double>(), 0);
    EXPECT_LT(shape["index_topk"].get<int>(), shape["kv_len"].get<int>()) << "a real selection";
    if (shape["part"] == "index") {
      EXPECT_EQ(row["counted"]["bytes"].get<double>(),
                132.0 * shape["batch"].get<int>() * shape["kv_len"].get<int>());
      EXPECT_EQ(row["metric"], "GB/s");
    }
  }
  EXPECT_EQ(j["rows"][0]["standard"]["batch"], 64);
  EXPECT_EQ(j["rows"][0]["standard"]["index_topk"], 2048);

  expect_refused("bench --backend cpu --suite dsa --workload dsa-verify",
                 "unknown workload 'dsa-verify'");
}

// The cuda backend serves DSA, and the DSA rows mirror their pools on the GPU; where no GPU is
// usable the bench says why (exit 2) instead of reporting rows. (On a GPU the suite runs in the
// GPU round: scripts/gpu_round.sh SUITES=dsa.)
TEST_F(Cli, BenchDsaSuiteOnCudaNeedsAUsableGpu) {
  const Result r = run("bench --backend cuda --suite dsa --preset cpu-small --repeats 1 --quiet");
  if (r.err.find("unknown attention backend 'cuda'") != std::string::npos) {
    GTEST_SKIP() << "this build has no cuda backend: " << r.err;
  }
  if (r.err.find("cannot run here") == std::string::npos) {
    GTEST_SKIP() << "a usable GPU is present: the GPU round runs the suite";
  }
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("--backend cuda: it cannot run here"), std::string::npos) << r.err;
}

TEST_F(Cli, BenchHelpNamesTheDsaSuite) {
  const Result r = run("bench --help");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("dsa (one DeepSeek-V3.2 DSA layer"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("dsa-index"), std::string::npos) << r.out;
}

}  // namespace
