// Defects a new user found (issue 21), each pinned down: bad option values and unknown options exit
// 2 naming the option, the value and what is allowed; a hybrid linear-attention model's dumped case
// replays as it is; a far arrival costs one IDLE step; the pool-too-small error names the pool; NaN
// and infinity propagate the same way on cpu as on reference; --threads is bounded and small steps
// stay on one thread; absurd model dimensions are rejected at load.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/backend/selection.h"
#include "attnrt/core/error.h"
#include "attnrt/model/model_spec.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/kernels/attention_kernels.h"
#include "tests/conformance/conformance.h"
#include "tests/non_finite_case.h"
#include "tests/test_util.h"

namespace attnrt {
namespace {

namespace fs = std::filesystem;
using test::CommandResult;

class CliReliability : public test::CliTest {
 protected:
  fs::path write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p;
  }
  // Expects exit status 2 and every part in stderr; no CLI11 range with hundreds of digits.
  void expect_rejected(const std::string& args, const std::vector<std::string>& parts) {
    SCOPED_TRACE(args);
    const CommandResult r = run(args);
    EXPECT_EQ(r.status, 2) << r.out << r.err;
    for (const std::string& p : parts) EXPECT_NE(r.err.find(p), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("1797"), std::string::npos) << r.err;
    EXPECT_LT(r.err.size(), 600u) << r.err;
  }
};

constexpr const char* kTinyTrace =
    "{\"id\": \"a\", \"arrival_step\": 1, \"prompt_len\": 30, \"output_len\": 5}\n"
    "{\"id\": \"b\", \"arrival_step\": 2, \"prompt_len\": 24, \"output_len\": 4}\n";

TEST_F(CliReliability, BadNumbersExitTwoNamingTheOptionTheValueAndTheRange) {
  const std::string limit = fmt::format("[1, {}]", kMaxPageSize);
  for (const char* cmd : {"run", "info"}) {
    expect_rejected(fmt::format("{} --page-size 0", cmd),
                    {"--page-size", "0 is not allowed", limit});
  }
  expect_rejected("run --page-size -1", {"--page-size", "-1 is not allowed", limit});
  expect_rejected("run --page-size abc", {"--page-size", "'abc' is not an integer", limit});
  expect_rejected("run --page-size 4096", {"--page-size", "4096 is not allowed", limit});
  expect_rejected("run --max-total-tokens 0", {"--max-total-tokens", "0 is not allowed"});
  expect_rejected("run --check-every -1", {"--check-every", "-1 is not allowed", "[0, "});
  expect_rejected("run --accept-prob 1.5", {"--accept-prob", "1.5 is not allowed", "[0, 1]"});
  expect_rejected("run --swa-full-tokens-ratio 0", {"--swa-full-tokens-ratio", "(0, "});
  expect_rejected("run --seed x1", {"--seed", "'x1'", "[0, 2^64 - 1]"});
  expect_rejected("run --speculative-attention-mode sideways",
                  {"--speculative-attention-mode", "'sideways'", "prefill, decode"});
  expect_rejected("check --backend cpu --cases 0", {"--cases", "0 is not allowed"});
  expect_rejected("bench --repeats 0", {"--repeats", "0 is not allowed"});
  expect_rejected("bench --scale 0", {"--scale", "0 is not allowed", "(0, 1]"});
  expect_rejected("bench --suite sideways", {"--suite", "'sideways'", "attention, mla"});
  expect_rejected("check", {"--backend is required"});
}

TEST_F(CliReliability, UnknownOptionExitsTwoAndSuggestsTheClosest) {
  expect_rejected("run --page-szie 16", {"'--page-szie'", "did you mean --page-size?"});
  expect_rejected("check --backend cpu --case 3", {"'--case'", "did you mean --cases?"});
  expect_rejected("info --frobnicate", {"'--frobnicate'", "attnrt info --help"});
  expect_rejected("rnu", {"'rnu'", "did you mean run?"});
  // CLI11 2.1 looped forever on an empty argument before an unknown option.
  expect_rejected("run '' -x", {"argument 2 is empty"});
  expect_rejected("info a '' -y", {"argument 3 is empty"});
}

TEST_F(CliReliability, ThreadsAboveFourPerHardwareThreadAreRejectedNamingTheLimit) {
  const std::string limit = std::to_string(max_num_threads());
  expect_rejected("run --threads 100000", {"--threads", "100000 is not allowed", limit});
  expect_rejected("bench --threads 100000", {"--threads", limit});
  Options o;
  o.num_threads = max_num_threads() + 1;
  test::expect_error([&] { cpu_num_threads(&o); }, {limit});
}

TEST_F(CliReliability, HybridLinearModelCaseRecordsItsAttentionBackendAndReplays) {
  const fs::path trace = write("tiny.jsonl", kTinyTrace);
  const fs::path dir = dir_ / "case";
  const CommandResult r =
      run(fmt::format("run --model kimi-linear-48b --trace '{}' --no-progress --check-every 0 "
                      "--attention-backend cpu --dump-step 2 '{}'",
                      trace.string(), dir.string()));
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  std::ifstream in(dir / "case.json");
  nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["backend"], "cpu");
  CommandResult replay = run(fmt::format("replay '{}'", dir.string()));
  EXPECT_EQ(replay.status, 0) << replay.out << replay.err;
  EXPECT_NE(replay.out.find("vs recorded output (cpu): bit-exact"), std::string::npos)
      << replay.out;
  // A case written before the fix, with the report's "cpu; linear cpu", still replays on cpu.
  j["backend"] = "cpu; linear cpu";
  std::ofstream(dir / "case.json") << j.dump(2);
  replay = run(fmt::format("replay '{}'", dir.string()));
  EXPECT_EQ(replay.status, 0) << replay.out << replay.err;
  EXPECT_NE(replay.out.find("cpu: wrote"), std::string::npos) << replay.out;
}

TEST_F(CliReliability, FarArrivalRunsItsIdleGapAsOneStep) {
  // 10^8 idle iterations one by one took hours; the gap is one IDLE step now (counted as the
  // iterations it stands for).
  const fs::path trace =
      write("far.jsonl",
            "{\"id\": \"a\", \"arrival_step\": 0, \"prompt_len\": 8, \"output_len\": 2}\n"
            "{\"id\": \"b\", \"arrival_step\": 100000000, \"prompt_len\": 8, \"output_len\": 2}\n");
  const fs::path json = dir_ / "report.json";
  const CommandResult r =
      run(fmt::format("run --trace '{}' --attention-backend reference --no-progress --json '{}'",
                      trace.string(), json.string()));
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  std::ifstream in(json);
  const nlohmann::json j = nlohmann::json::parse(in);
  int64_t idle = -1;
  for (const auto& m : j["modes"]) {
    if (m["mode"] == "IDLE") idle = m["steps"].get<int64_t>();
  }
  EXPECT_GT(idle, 99999990) << j.dump();
  EXPECT_GE(j["iterations"].get<int64_t>(), 100000000) << j.dump();
}

TEST_F(CliReliability, PoolTooSmallNamesTheSwaPoolAndHowItsSizeFollowsFromTheOptions) {
  const fs::path trace =
      write("long.jsonl",
            "{\"id\": \"a\", \"arrival_step\": 0, \"prompt_len\": 850, \"output_len\": 4}\n");
  expect_rejected(fmt::format("run --model gemma3-12b --trace '{}' --max-total-tokens 1000 "
                              "--no-progress",
                              trace.string()),
                  {"needs up to 853 KV slots", "SWA pool", "800", "1000 slots (--max-total-tokens)",
                   "--swa-full-tokens-ratio 0.8", "raise --max-total-tokens"});
  expect_rejected(
      fmt::format("run --model llama3-8b --trace '{}' --max-total-tokens 800 --no-progress",
                  trace.string()),
      {"KV pool has 800 free slots (--max-total-tokens)"});
}

// ---------------------------------------------------------------------------------------------
// NaN and infinity (docs/backends.md), cpu against reference (tests/non_finite_case.h; cuda:
// tests/test_cuda_nonfinite.cpp).
TEST(NonFinite, NanOrInfinityInQOrAnAttendedKeyMakesThoseRowsNanOnCpuAsOnReference) {
  test::check_non_finite("cpu", {DType::f32, DType::bf16}, /*infinities=*/true);
}

// ---------------------------------------------------------------------------------------------
// Threads: a layer runs on as many threads as its work keeps busy.

TEST(CpuThreads, SmallDecodeStepsRunOnOneThreadAndLongPrefillsOnMore) {
  Options options;
  options.num_threads = 4;
  auto threads_for = [&](std::vector<int32_t> prefix, std::vector<int32_t> query, ForwardMode m) {
    conformance::CaseSpec s;
    s.seed = 1;
    s.mode = m;
    s.prefix_lens = std::move(prefix);
    s.query_lens = std::move(query);
    s.layers = {test::attention_layer(0, 8, 2, 128)};
    const conformance::ConformanceCase c = conformance::make_case(s);
    auto inst = conformance::materialize(c);
    BackendContext ctx = inst->context(Device::cpu());
    ctx.options = &options;
    CpuBackend backend(ctx);
    backend.init_forward_metadata(inst->batch);
    return backend.work_summary(c.model.layers[0]).threads;
  };
  EXPECT_EQ(
      threads_for(std::vector<int32_t>(27, 20), std::vector<int32_t>(27, 1), ForwardMode::DECODE),
      1);
  EXPECT_EQ(threads_for({0}, {2048}, ForwardMode::EXTEND), 4);
}

// ---------------------------------------------------------------------------------------------
// Model dimensions

TEST(ModelLimits, AbsurdHeadCountsAndDimsAreRejectedAtLoadNamingTheLimit) {
  const std::string config = R"({"model_type": "llama", "num_hidden_layers": 2,
      "hidden_size": 4096, "num_attention_heads": 2147483647, "num_key_value_heads": 8,
      "head_dim": 128, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"})";
  test::expect_error([&] { load_hf_config_text(config, "heads.json"); },
                     {"num_q_heads = 2147483647; allowed: 1 to 1024"});
  std::string dims = config;
  dims.replace(dims.find("2147483647"), 10, "32");
  dims.replace(dims.find("\"head_dim\": 128"), 15, "\"head_dim\": 2147483647");
  test::expect_error([&] { load_hf_config_text(dims, "dims.json"); },
                     {"head_dim = 2147483647; allowed: 1 to 1024"});
  ModelSpec m = model_preset("llama3-8b");
  m.layers[0].num_kv_heads = 4096;
  test::expect_error([&] { m.validate(); }, {"num_kv_heads = 4096; allowed: 1 to 1024"});
  for (const std::string& name : preset_names()) {
    EXPECT_NO_THROW(model_preset(name).validate()) << name;
  }
}

// Every SIMD target this build has cpu kernels for and this CPU runs, not only the best one (an
// AVX2-only or older machine runs the narrower paths): the conformance suite on each, chosen with
// ATTNRT_CPU_SIMD, fresh seeds; and a name that is no target here is an error that lists them.
TEST_F(CliReliability, ConformanceHoldsOnEverySimdTarget) {
  const std::vector<std::string> targets = cpu::simd_target_names();
  ASSERT_FALSE(targets.empty());
  const uint64_t seed = std::random_device{}();
  for (size_t i = 1; i < targets.size(); ++i) {
    SCOPED_TRACE("ATTNRT_CPU_SIMD=" + targets[i] + ", seed " + std::to_string(seed));
    ::setenv("ATTNRT_CPU_SIMD", targets[i].c_str(), 1);
    std::string upper = targets[i];
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    const CommandResult info = run("info");
    EXPECT_NE(info.out.find("SIMD target " + upper), std::string::npos) << info.out;
    const CommandResult r = run(fmt::format(
        "check --backend cpu --cases 200 --seed {} --jobs 2 --no-progress", seed));
    EXPECT_EQ(r.status, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("0 failed"), std::string::npos) << r.out;
  }
  ::setenv("ATTNRT_CPU_SIMD", "avx9000", 1);
  const CommandResult bad = run("run --attention-backend cpu");
  ::unsetenv("ATTNRT_CPU_SIMD");
  EXPECT_EQ(bad.status, 2);
  for (const std::string& t : targets)
    EXPECT_NE(bad.err.find(t), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("ATTNRT_CPU_SIMD=avx9000 is not a SIMD target"), std::string::npos)
      << bad.err;
}

}  // namespace
}  // namespace attnrt
