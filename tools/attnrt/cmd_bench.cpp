// attnrt bench: the standard workloads of docs/workloads.md against the ceilings of this machine.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"
#include "bench/harness/chart.h"
#include "bench/harness/dcp_bench.h"
#include "bench/harness/dsa_workload.h"
#include "bench/harness/linear_workload.h"
#include "bench/harness/report.h"
#include "bench/harness/runner.h"
#include "bench/harness/workload.h"
#include "tools/attnrt/cli_options.h"
#include "tools/attnrt/commands.h"

namespace attnrt::cli {

namespace {

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    if (comma > start) items.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return items;
}

struct BenchArgs {
  std::string backend;
  std::string suite = "attention";
  std::string workload = "all";
  double scale = 1.0;
  std::string preset;
  int page_size = 0;  // 0: each row's own
  int repeats = 10;
  int warmup = 2;
  int threads = 0;
  std::string json;
  std::string plot;
  bool no_reference = false;
  bool deterministic = false;
  bool quiet = false;
  bool no_step_costs = false;
  int dcp_size = 1;
};

// --dcp-size N: the DCP decode rows alone (bench/harness/dcp_bench.h), on cuda ranks sharing the
// one GPU.
void run_dcp_bench_command(const BenchArgs& a) {
  bench::DcpBenchConfig c;
  c.ranks = a.dcp_size;
  c.scale = a.scale;
  c.repeats = a.repeats;
  c.warmup = a.warmup;
  if (a.workload != "all") c.rows = split_list(a.workload);
  const std::vector<bench::DcpBenchRow> rows = bench::run_dcp_bench(c);
  std::fputs(bench::format_dcp_report(c, rows).c_str(), stdout);
  std::fflush(stdout);
  for (const bench::DcpBenchRow& r : rows) {
    if (!r.error.empty()) throw ExitCode{1};
  }
}

std::string command_line(const BenchArgs& a, const std::string& backend) {
  std::string s = fmt::format("attnrt bench --backend {}", backend);
  if (a.suite != "attention") s += " --suite " + a.suite;
  s += " --workload " + a.workload;
  if (!a.preset.empty()) s += " --preset " + a.preset;
  if (a.scale != 1.0) s += fmt::format(" --scale {:g}", a.scale);
  if (a.page_size > 0) s += fmt::format(" --page-size {}", a.page_size);
  s += fmt::format(" --repeats {} --warmup {}", a.repeats, a.warmup);
  if (a.threads > 0) s += fmt::format(" --threads {}", a.threads);
  if (a.no_reference) s += " --no-reference";
  if (a.deterministic) s += " --deterministic";
  if (a.no_step_costs) s += " --no-step-costs";
  if (!a.json.empty()) s += " --json " + a.json;
  if (!a.plot.empty()) s += " --plot " + a.plot;
  return s;
}

void run_bench_command(const BenchArgs& a) {
  if (a.dcp_size > 1) return run_dcp_bench_command(a);
  ATTNRT_CHECK(a.preset.empty() || a.scale == 1.0,
               "--scale {:g} and --preset {} both shrink the workloads: give one of them", a.scale,
               a.preset);
  // Everything that can be rejected is rejected before minutes of measuring.
  if (!a.plot.empty()) bench::chart_format_for(a.plot);
  std::vector<bench::Workload> rows;
  std::vector<bench::LinearWorkload> linear;
  std::vector<bench::DsaWorkload> dsa;
  if (a.suite == "attention") {
    rows = bench::select_workloads(a.workload);
  } else if (a.suite == "mla") {
    rows = bench::select_mla_workloads(a.workload);
  } else if (a.suite == "linear") {
    linear = bench::select_linear_workloads(a.workload);
  } else if (a.suite == "dsa") {
    dsa = bench::select_dsa_workloads(a.workload);
  } else {
    // --suite all: each entry selects from every suite that has rows of that name.
    std::string attention_items, mla_items, linear_items, dsa_items;
    for (const std::string& item : split_list(a.workload)) {
      bool found = false;
      if (bench::is_linear_selector(item)) {
        linear_items += item + ",";
        found = true;
      }
      if (bench::is_dsa_selector(item)) {
        dsa_items += item + ",";
        found = true;
      }
      try {
        bench::select_workloads(item);
        attention_items += item + ",";
        found = true;
      } catch (const Error&) {
      }
      try {
        bench::select_mla_workloads(item);
        mla_items += item + ",";
        found = true;
      } catch (const Error&) {
      }
      ATTNRT_CHECK(found,
                   "unknown workload '{}' for --suite all: use all, a kind (decode, prefill, "
                   "extend, verify, mla-decode, mla-verify, mla-prefill, mla-extend, gdn, kda, "
                   "mamba2, dsa-decode, dsa-index, dsa-sparse, dsa-prefill) or a row name "
                   "(`attnrt bench --suite attention|mla|linear|dsa --workload x` list them)",
                   item);
    }
    if (!attention_items.empty()) rows = bench::select_workloads(attention_items);
    if (!mla_items.empty()) {
      for (const bench::Workload& w : bench::select_mla_workloads(mla_items)) rows.push_back(w);
    }
    if (!linear_items.empty()) linear = bench::select_linear_workloads(linear_items);
    if (!dsa_items.empty()) dsa = bench::select_dsa_workloads(dsa_items);
  }
  if (!a.preset.empty()) {
    rows = bench::apply_preset(rows, a.preset);
    linear = bench::apply_linear_preset(linear, a.preset);
    dsa = bench::apply_dsa_preset(dsa, a.preset);
  } else {
    for (bench::Workload& w : rows) w = bench::scale_workload(w, a.scale);
    for (bench::LinearWorkload& w : linear) w = bench::scale_linear_workload(w, a.scale);
    for (bench::DsaWorkload& w : dsa) w = bench::scale_dsa_workload(w, a.scale);
  }
  if (a.page_size > 0) {
    ATTNRT_CHECK(!rows.empty(),
                 "--page-size {}: only the attention and MLA rows have a paged KV cache (the "
                 "linear rows keep state slots, the DSA rows DeepSeek's 64-slot pages); give "
                 "--suite attention, mla or all",
                 a.page_size);
    for (bench::Workload& w : rows) w = bench::with_page_size(w, a.page_size);
  }

  bench::BenchConfig config;
  std::string reason;
  config.backend = a.backend.empty() ? bench::auto_bench_backend(&reason) : a.backend;
  config.workloads = rows;
  config.linear_workloads = linear;
  config.dsa_workloads = dsa;
  config.scale = a.scale;
  config.preset = a.preset;
  config.repeats = a.repeats;
  config.warmup = a.warmup;
  config.threads = a.threads;
  config.compare_reference = !a.no_reference && config.backend != "reference";
  config.deterministic = a.deterministic;
  config.gpu_step_costs = !a.no_step_costs;
  // A backend that runs only on GPUs is measured there: device pools, CUDA-event timing, GPU
  // ceilings.
  const std::vector<DeviceKind>& devices = Registry::global().get(config.backend).caps.devices;
  if (std::find(devices.begin(), devices.end(), DeviceKind::cpu) == devices.end() &&
      std::find(devices.begin(), devices.end(), DeviceKind::cuda) != devices.end()) {
    config.device = Device::cuda(0);
    const std::string why = Registry::global().get(config.backend).unavailable_reason
                                ? Registry::global().get(config.backend).unavailable_reason()
                                : std::string();
    // DSA rows of a backend that does not serve DSA are n/a wherever it runs: nothing is
    // measured, so the device need not be usable.
    const bool nothing_runs = rows.empty() && linear.empty() && !dsa.empty() &&
                              !bench::backend_serves_dsa(config, nullptr);
    ATTNRT_CHECK(why.empty() || nothing_runs, "--backend {}: it cannot run here: {}",
                 config.backend, why);
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
      "Run the standard attention workloads (docs/bench.md, docs/workloads.md), or with --suite "
      "linear the linear-attention layers, with --suite dsa a DeepSeek-V3.2 sparse-attention "
      "layer, and report time, GB/s or FLOP/s, % of this "
      "machine's measured ceilings and the speed-up over reference");
  cmd->add_option("--backend,--attention-backend", args->backend,
                  "Backend to measure (registry name). Unset: the one auto-selection picks for "
                  "decode on this machine");
  cmd->add_option(
         "--suite", args->suite,
         "Which rows: attention (the full-attention rows of docs/workloads.md), linear (one "
         "GDN, KDA or Mamba2 layer: gdn-decode-64/256, mamba2-decode-64/256, "
         "gdn-extend-8x8192, kda-extend-8x8192, mamba2-extend-8x8192/1x8192; "
         "docs/bench.md), mla (one DeepSeek-V3 latent-attention layer: mla-decode-*, "
         "mla-verify-* in the absorbed form, mla-prefill-1x16384 and "
         "mla-extend-8x4096+512 in the MHA form, n/a on backends without it; "
         "docs/workloads.md \"MLA rows\"), dsa (one DeepSeek-V3.2 DSA layer: dsa-decode-* "
         "steps, dsa-index-* and dsa-sparse-* parts of them, dsa-prefill-1x32768, each beside "
         "the dense MLA row of its shape; n/a on backends that do not serve DSA; "
         "docs/workloads.md \"DSA rows\") or all")
      ->check(one_of({"attention", "mla", "linear", "dsa", "all"}))
      ->capture_default_str();
  cmd->add_option(
         "--workload", args->workload,
         "Rows of the suite: all, a kind (decode, prefill, extend, verify; mla: "
         "mla-decode, mla-verify, mla-verify-chain, mla-verify-tree, mla-prefill, mla-extend; "
         "dsa: dsa-decode, dsa-index, dsa-sparse, dsa-prefill; linear: "
         "decode, extend, gdn, kda, mamba2), a row name such as decode-16x4096 or "
         "gdn-decode-64, or a comma-separated list. Outside \"all\" and the kinds, by name "
         "or group: fp8-prefill (prefill / extend over an fp8 KV cache with "
         "--fp8-prefill-attention: prefill-1x16384-fp8, ...), long-decode "
         "(decode-1x131072, decode-4x131072) and, with --suite linear, flashinfer-gdn "
         "(gdn-extend-1x65536-h2v8, the shape of FlashInfer's published GDN prefill figure)")
      ->capture_default_str();
  cmd->add_option("--scale", args->scale,
                  "Multiply every batch and length by this factor in (0, 1] (lengths stay whole "
                  "pages); the output marks scaled rows")
      ->check(real_in(0, 1, /*lo_open=*/true))
      ->capture_default_str();
  cmd->add_option("--preset", args->preset,
                  "Size the rows for a kind of machine instead of --scale: cpu-small (a 2-core "
                  "box: KV <= 1.25 GiB and <= 6e11 FLOPs per attention row; linear rows <= 1.25 "
                  "GiB moved and <= 5e10 FLOPs; dsa rows: the dense companion <= 2e10 FLOPs, "
                  "index_topk scaled with the lengths)");
  cmd->add_option("--page-size", args->page_size,
                  "Slots a page of every attention and MLA row's KV cache instead of the row's "
                  "own (16; 64 for MLA; 1 for the -p1 rows): compares a row across the page "
                  "sizes engines use (1, 16, 32, 64, 128); the output marks the changed rows")
      ->check(int_in(1, 4096));
  cmd->add_option("--repeats", args->repeats, "Timed repetitions per row (median reported)")
      ->check(int_in(1, 100000))
      ->capture_default_str();
  cmd->add_option("--warmup", args->warmup, "Untimed calls before timing")
      ->check(int_in(0, 100000))
      ->capture_default_str();
  cmd->add_option("--threads", args->threads,
                  "Threads of the backend and of the ceiling probes; 0 = $ATTNRT_NUM_THREADS, else "
                  "every core")
      ->check(int_in(0, max_threads_option()))
      ->capture_default_str();
  cmd->add_option("--json", args->json, "Write machine, commit, ceilings and rows as JSON");
  cmd->add_option(
      "--plot", args->plot,
      "Write a chart of achieved vs ceiling per row (attention, MLA, linear and DSA rows; "
      "DSA rows also show their figure and target): FILE.svg (or FILE.png "
      "when rsvg-convert is installed)");
  cmd->add_flag("--no-reference", args->no_reference,
                "Skip the reference backend (no speed-up column, no reference comparison; the "
                "float64 check of every row still runs)");
  cmd->add_flag("--deterministic", args->deterministic,
                "Run the backend under test in deterministic mode (split sizes from each "
                "request's own length, as `attnrt run --deterministic`), to measure what batch "
                "invariance costs against the default");
  cmd->add_flag("--quiet", args->quiet, "No progress lines on stderr");
  cmd->add_flag("--no-step-costs", args->no_step_costs,
                "On a GPU, skip what is measured after the rows (the host plan at batch 256 and "
                "a 32-layer decode step eager and as a CUDA graph): for A/B loops that time the "
                "same rows over and over");
  cmd->add_option("--dcp-size", args->dcp_size,
                  "Decode context parallelism (docs/dcp.md \"Benchmark\"): instead of the suite, "
                  "the DCP decode rows (dcp-decode-1x131072, -8x131072, -64x8192, or --workload "
                  "dcp-decode-BxL,...) on one cuda runtime and on N cuda ranks SIMULATED ON THIS "
                  "ONE GPU: each rank's partial, the exchange and the merge timed apart, and the "
                  "projection to N GPUs; 1 = off")
      ->check(int_in(1, 64))
      ->capture_default_str();
  cmd->callback([args] { run_bench_command(*args); });
}

}  // namespace attnrt::cli
