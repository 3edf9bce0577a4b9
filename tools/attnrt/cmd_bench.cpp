// attnrt bench: the standard workloads of WORKLOADS.md against the ceilings of this machine.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>

#include "attnrt/backend/registry.h"
#include "attnrt/bench/chart.h"
#include "attnrt/bench/report.h"
#include "attnrt/bench/runner.h"
#include "attnrt/bench/workload.h"
#include "attnrt/core/error.h"
#include "tools/attnrt/commands.h"

namespace attnrt::cli {

namespace {

struct BenchArgs {
  std::string backend;
  std::string workload = "all";
  double scale = 1.0;
  std::string preset;
  int repeats = 10;
  int warmup = 2;
  int threads = 0;
  std::string json;
  std::string plot;
  bool no_reference = false;
  bool quiet = false;
};

std::string command_line(const BenchArgs& a, const std::string& backend) {
  std::string s = fmt::format("attnrt bench --backend {} --workload {}", backend, a.workload);
  if (!a.preset.empty()) s += " --preset " + a.preset;
  if (a.scale != 1.0) s += fmt::format(" --scale {:g}", a.scale);
  s += fmt::format(" --repeats {} --warmup {}", a.repeats, a.warmup);
  if (a.threads > 0) s += fmt::format(" --threads {}", a.threads);
  if (a.no_reference) s += " --no-reference";
  if (!a.json.empty()) s += " --json " + a.json;
  if (!a.plot.empty()) s += " --plot " + a.plot;
  return s;
}

void run_bench_command(const BenchArgs& a) {
  ATTNRT_CHECK(a.preset.empty() || a.scale == 1.0,
               "--scale {:g} and --preset {} both shrink the workloads: give one of them", a.scale,
               a.preset);
  // Everything that can be rejected is rejected before minutes of measuring.
  if (!a.plot.empty()) bench::chart_format_for(a.plot);
  std::vector<bench::Workload> rows = bench::select_workloads(a.workload);
  if (!a.preset.empty()) {
    rows = bench::apply_preset(rows, a.preset);
  } else {
    for (bench::Workload& w : rows) w = bench::scale_workload(w, a.scale);
  }

  bench::BenchConfig config;
  std::string reason;
  config.backend = a.backend.empty() ? bench::auto_bench_backend(&reason) : a.backend;
  config.workloads = rows;
  config.scale = a.scale;
  config.preset = a.preset;
  config.repeats = a.repeats;
  config.warmup = a.warmup;
  config.threads = a.threads;
  config.compare_reference = !a.no_reference && config.backend != "reference";
  // A backend that runs only on GPUs is measured there: device pools, CUDA-event timing, GPU
  // ceilings.
  const std::vector<DeviceKind>& devices = Registry::global().get(config.backend).caps.devices;
  if (std::find(devices.begin(), devices.end(), DeviceKind::cpu) == devices.end() &&
      std::find(devices.begin(), devices.end(), DeviceKind::cuda) != devices.end()) {
    config.device = Device::cuda(0);
    const std::string why = Registry::global().get(config.backend).unavailable_reason
                                ? Registry::global().get(config.backend).unavailable_reason()
                                : std::string();
    ATTNRT_CHECK(why.empty(), "--backend {}: it cannot run here: {}", config.backend, why);
  }
  if (!a.quiet) {
    config.progress = [](const std::string& line) { std::fprintf(stderr, "bench: %s\n", line.c_str()); };
    if (!reason.empty()) std::fprintf(stderr, "bench: backend %s (%s)\n", config.backend.c_str(), reason.c_str());
  }

  bench::BenchResult result = bench::run_bench(config);
  bench::RunInfo info = bench::make_run_info(command_line(a, config.backend), a.scale, a.preset);
  std::fputs(bench::format_report(result, info).c_str(), stdout);
  std::fflush(stdout);
  if (!a.json.empty()) {
    bench::write_json(a.json, result, info);
    std::fprintf(stderr, "bench: wrote %s\n", a.json.c_str());
  }
  if (!a.plot.empty()) {
    bench::write_chart(a.plot, result, info);
    std::fprintf(stderr, "bench: wrote %s\n", a.plot.c_str());
  }
  if (!result.all_passed()) {
    std::fprintf(stderr, "bench: some rows failed their correctness check or could not run "
                         "(see the table)\n");
    throw ExitCode{1};
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  auto* cmd = app.add_subcommand(
      "bench",
      "Run the standard attention workloads (docs/bench.md, WORKLOADS.md) and report time, "
      "GB/s or GFLOP/s, % of this machine's measured ceilings and the speed-up over reference");
  cmd->add_option("--backend,--attention-backend", args->backend,
                  "Backend to measure (registry name). Unset: the one auto-selection picks for "
                  "decode on this machine");
  cmd->add_option("--workload", args->workload,
                  "all, a kind (decode, prefill, extend, verify), a row name such as "
                  "decode-16x4096 or prefill-1x8192-d64, or a comma-separated list")
      ->capture_default_str();
  cmd->add_option("--scale", args->scale,
                  "Multiply every batch and length by this factor in (0, 1] (lengths stay whole "
                  "pages); the output marks scaled rows")
      ->capture_default_str();
  cmd->add_option("--preset", args->preset,
                  "Size the rows for a kind of machine instead of --scale: cpu-small (a 2-core "
                  "box: KV <= 1.25 GiB and <= 6e11 FLOPs per row)");
  cmd->add_option("--repeats", args->repeats, "Timed repetitions per row (median reported)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--warmup", args->warmup, "Untimed calls before timing")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--threads", args->threads,
                  "Threads of the backend and of the ceiling probes; 0 = $ATTNRT_NUM_THREADS, else "
                  "every core")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--json", args->json, "Write machine, commit, ceilings and rows as JSON");
  cmd->add_option("--plot", args->plot,
                  "Write a chart of achieved vs ceiling per row: FILE.svg (or FILE.png when "
                  "rsvg-convert is installed)");
  cmd->add_flag("--no-reference", args->no_reference,
                "Skip the reference backend (no speed-up column, no reference comparison; the "
                "float64 check of every row still runs)");
  cmd->add_flag("--quiet", args->quiet, "No progress lines on stderr");
  cmd->callback([args] { run_bench_command(*args); });
}

}  // namespace attnrt::cli
