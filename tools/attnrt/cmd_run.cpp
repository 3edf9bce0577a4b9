// `attnrt run`: replays a serving trace through the scheduler and the chosen backends, checks a
// sample of steps against `reference`, and prints a table per ForwardMode (docs/run.md).
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "attnrt/core/error.h"
#include "attnrt/model/model_spec.h"
#include "tools/attnrt/cli_options.h"
#include "tools/attnrt/commands.h"
#include "tools/attnrt/progress.h"
#include "tools/sim/driver.h"
#include "tools/sim/trace.h"

namespace attnrt::cli {

namespace {

struct RunArgs {
  std::string model = "demo";
  std::string trace;
  Options options;
  sim::RunConfig config;
  std::vector<std::string> dump_step;
  std::string check_rows = "64x16";
  std::string json_path;
  bool no_progress = false;
  bool print_trace = false;
  bool no_mixed_chunk = false;
  double accept_prob = 0.7;
  int soak_steps = 0;
};

// Requests of a soak trace with an abort_step: one in kSoakAbortEvery.
constexpr int kSoakAbortEvery = 8;
// Pool invariants of a soak run are checked this often unless --check-invariants says otherwise.
constexpr int kSoakCheckInvariantsEvery = 1000;

// --check-rows: "all", or TxH (at most T query rows x H heads per checked layer; 0 = no limit).
sim::CheckRows parse_check_rows(const std::string& text) {
  if (text == "all") return {0, 0};
  sim::CheckRows rows;
  const size_t x = text.find('x');
  bool ok = x != std::string::npos && x > 0 && x + 1 < text.size() &&
            text.find_first_not_of("0123456789x") == std::string::npos &&
            text.find('x', x + 1) == std::string::npos && x < 8 && text.size() - x - 1 < 8;
  if (ok) {
    rows.max_tokens = std::stoi(text.substr(0, x));
    rows.max_heads = std::stoi(text.substr(x + 1));
  }
  ATTNRT_CHECK(ok,
               "--check-rows '{}': use all, or TxH such as 64x16 (at most T query rows x H heads "
               "per checked layer; 0 = no limit)",
               text);
  return rows;
}

void run(const RunArgs& a) {
  const ModelSpec model = resolve_model(a.model);
  sim::RunConfig config = a.config;
  sim::Trace trace;
  if (a.soak_steps > 0) {
    ATTNRT_CHECK(a.trace.empty(),
                 "--soak-steps {} generates its own trace; drop --trace {} (or --soak-steps)",
                 a.soak_steps, a.trace);
    trace = sim::soak_trace(a.soak_steps, config.scheduler.max_running_requests,
                            config.scheduler.chunked_prefill_size, kSoakAbortEvery, config.seed);
    config.scheduler.retract = true;
    if (config.check_invariants_every == 0)
      config.check_invariants_every = kSoakCheckInvariantsEvery;
  } else {
    trace = a.trace.empty() ? sim::builtin_trace() : sim::load_trace(a.trace);
  }
  if (a.print_trace) {
    std::fputs(sim::to_jsonl(trace).c_str(), stdout);
    return;
  }
  config.check_rows = parse_check_rows(a.check_rows);
  config.scheduler.mixed_chunk = !a.no_mixed_chunk;
  config.scheduler.spec.accept_prob = a.accept_prob;
  if (!a.dump_step.empty()) {
    const std::string& n = a.dump_step[0];
    size_t used = 0;
    int step = -1;
    try {
      step = std::stoi(n, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    ATTNRT_CHECK(used == n.size() && step >= 0,
                 "--dump-step: the step '{}' must be a step index >= 0 (usage: --dump-step N DIR)",
                 n);
    config.dump_step = step;
    config.dump_dir = a.dump_step[1];
  }
  // Fail on an unwritable --json path before the run, not after it.
  std::unique_ptr<std::ofstream> json_out;
  if (!a.json_path.empty()) {
    json_out = std::make_unique<std::ofstream>(a.json_path);
    ATTNRT_CHECK(json_out->good(), "--json {}: cannot open the file for writing", a.json_path);
  }

  warn_if_machine_busy(a.options);
  ProgressBar bar("run", !a.no_progress);
  bar.set_long_run_hint(
      "to shorten it: --layers N (fewer layers per step), --check-every N (a larger N checks fewer "
      "steps on `reference`; 0 checks none) or a shorter --trace",
      std::chrono::minutes(2));
  const sim::RunReport report =
      sim::run_trace(model, a.options, trace, config, [&](const sim::Progress& p) {
        const double rate = p.wall_seconds > 0 ? p.tokens / p.wall_seconds : 0;
        bar.update(p.steps_done, p.steps_estimate, "steps",
                   fmt::format("{} tok/s | {}{}", human_count(rate), forward_mode_name(p.mode),
                               p.role == sim::ModelRole::draft ? " (draft)" : ""));
      });
  bar.finish();
  std::fputs(sim::format_report(report).c_str(), stdout);
  std::fflush(stdout);
  if (json_out) {
    *json_out << sim::report_to_json(report).dump(2) << "\n";
    ATTNRT_CHECK(json_out->good(), "--json {}: writing the report failed", a.json_path);
  }
  const bool mismatch_or_leak = report.failure_count > 0 || !report.target_pool.ok ||
                                (report.draft_pool && !report.draft_pool->ok) ||
                                !report.linear_pool_ok;
  if (!mismatch_or_leak && !report.dump_error.empty()) {
    std::fprintf(stderr, "error: %s\n", report.dump_error.c_str());
    throw ExitCode{2};
  }
  if (mismatch_or_leak) {
    if (report.failure_count > 0) {
      std::fprintf(stderr, "error: %s\n", report.failures.front().what.c_str());
    }
    if (!report.target_pool.ok) {
      std::fprintf(stderr, "error: the target KV pool leaked: %s\n",
                   report.target_pool.detail.c_str());
    }
    if (report.draft_pool && !report.draft_pool->ok) {
      std::fprintf(stderr, "error: the draft KV pool leaked: %s\n",
                   report.draft_pool->detail.c_str());
    }
    if (!report.linear_pool_ok) {
      std::fprintf(stderr, "error: the linear state pool leaked: %s\n",
                   report.linear_pool_detail.c_str());
    }
    throw ExitCode{1};
  }
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto args = std::make_shared<RunArgs>();
  auto* cmd = app.add_subcommand(
      "run",
      "Replay a serving trace as an engine would: admission, chunked prefill (EXTEND with cached "
      "prefixes), DECODE, MIXED and IDLE steps, shared system prompts reused from the cache, and "
      "with "
      "--speculative-num-steps TARGET_VERIFY + DRAFT_EXTEND rounds. Every layer of every step runs "
      "on "
      "the chosen backends with random q/k/v; every Nth step is recomputed on `reference`. Prints "
      "a "
      "table per forward mode (steps, tokens, time, tokens/s, largest error, backend) and checks "
      "that the KV pool is leak-free at the end. Exits 1 on a mismatch or a leak, 2 on bad input.");
  cmd->add_option("--model", args->model,
                  "Model preset name or path to a HuggingFace config.json (see `attnrt info`)")
      ->capture_default_str();
  cmd->add_option("--trace", args->trace,
                  "JSON-lines trace, one request per line (docs/trace.md); default: the built-in "
                  "trace of 34 requests");
  add_backend_options(*cmd, args->options);
  cmd->add_option("--dcp-size", args->options.dcp_size,
                  "Decode context parallelism (docs/dcp.md): the target's attention layers also "
                  "run on N simulated ranks, each holding every N-th token, and are compared with "
                  "the single runtime; 1 = off. Host backends: N ranks in this process. "
                  "--attention-backend cuda: N cuda runtimes sharing this ONE GPU (target steps "
                  "eager; the ranks' DECODE / TARGET_VERIFY steps replayed from CUDA graphs they "
                  "capture as an engine would): a correctness check, not a speed measurement")
      ->capture_default_str();
  auto* sched = "Scheduler";
  cmd->add_option("--max-running-requests", args->config.scheduler.max_running_requests,
                  "Requests admitted at once (request rows)")
      ->check(int_in(1, 1 << 16))
      ->capture_default_str()
      ->group(sched);
  cmd->add_option("--chunked-prefill-size", args->config.scheduler.chunked_prefill_size,
                  "Prefill tokens per step; longer prompts are prefilled in chunks (in MIXED steps "
                  "the decodes count against it)")
      ->check(int_in(1, 1 << 20))
      ->capture_default_str()
      ->group(sched);
  cmd->add_option(
         "--max-total-tokens", args->config.max_total_tokens,
         "KV slots of the pool (the draft model gets as many); requests wait for admission "
         "until their whole life fits")
      ->check(int_in(1, std::numeric_limits<int32_t>::max()))
      ->capture_default_str()
      ->group(sched);
  cmd->add_option(
         "--swa-full-tokens-ratio", args->config.swa_full_tokens_ratio,
         "SWA-hybrid models (sliding-window and full layers, e.g. gemma3-12b): slots of the "
         "sliding-window layers' pool per full-pool slot; admission waits for room in both pools. "
         "Ignored for other models")
      ->check(real_in(0, 64, /*lo_open=*/true))
      ->capture_default_str()
      ->group(sched);
  cmd->add_flag("--no-mixed-chunk", args->no_mixed_chunk,
                "Never merge decodes into prefill steps (no MIXED steps); prefill and decode steps "
                "alternate instead. Speculative runs never mix.")
      ->group(sched);
  cmd->add_option(
         "--accept-prob", args->accept_prob,
         "Speculative decoding: chance that the draft on the accepted path is right at each "
         "depth (accepted lengths are random)")
      ->check(real_in(0, 1))
      ->capture_default_str()
      ->group(sched);
  cmd->add_flag("--retract", args->config.scheduler.retract,
                "Admit a request when its prompt fits (not its whole life) and, when a decode "
                "round does not fit, retract running requests as the reference engine does "
                "(newest first, never the oldest): free their KV and linear state and queue them "
                "again to be prefilled from their prompt. The report counts retractions")
      ->group(sched);
  cmd->add_option(
         "--soak-steps", args->soak_steps,
         "Soak run (docs/run.md): replace the trace by a random one (from --seed) whose requests "
         "arrive over N iterations, about --max-running-requests at a time, prompts up to 4 x "
         "--chunked-prefill-size, one in 8 with an abort_step; turns on --retract and checks the "
         "pool invariants every 1000 steps (--check-invariants) and after every abort or "
         "retraction. Reports the target tokens/s of the first and the last tenth of the steps")
      ->check(int_in(1, 1 << 30))
      ->group(sched);
  cmd->add_option("--check-invariants", args->config.check_invariants_every,
                  "Check the pool invariants (no slot, request row or linear-state slot leaked, "
                  "shared or listed free twice) every N steps and after every step that aborted "
                  "or retracted a request; 0 = only at the end of the run, which is always done. "
                  "A broken invariant stops the run with an error naming the step, the pool and "
                  "the slot or row")
      ->check(int_in(0, 1 << 30))
      ->capture_default_str();
  cmd->add_option("--check-every", args->config.check_every,
                  "Recompute every Nth step of each forward mode (its first step included) on "
                  "`reference` over the same pools and compare; 0 = no checking")
      ->check(int_in(0, 1 << 30))
      ->capture_default_str();
  cmd->add_option("--check-rows", args->check_rows,
                  "Rows of a checked step's attention layers recomputed on `reference`: TxH = at "
                  "most T query rows (each request's first and last always, the rest drawn by the "
                  "seed) x H heads (evenly spread, starting elsewhere on each check so every head "
                  "gets covered), 0 = no limit; `all` = every row. Every output is still scanned "
                  "for unwritten elements; linear-attention layers are checked whole")
      ->capture_default_str();
  cmd->add_option("--layers", args->config.layers,
                  "Run the first N layers of the model (0 = all). Unset: all, except for hybrid "
                  "linear-attention models, which run one period of their layer pattern (up to "
                  "the first attention layer), and, with every backend on the CPU, models whose "
                  "attention layers do more than 600k multiply-adds per query token and key in "
                  "all (q heads x (qk dim + v dim) summed over layers): the first layers within "
                  "that, at least 2 (DeepSeek-V3: 4 of 61); the report says which layers ran")
      ->check(int_in(0, 1 << 20));
  cmd->add_option("--seed", args->config.seed, "Seed of q/k/v data, acceptance and draft trees")
      ->check(seed_value())
      ->capture_default_str();
  cmd->add_option("--dump-step", args->dump_step,
                  "Write step N's first full-attention layer as a replay case into DIR (see "
                  "`attnrt replay`)")
      ->expected(2)
      ->type_name("N DIR");
  cmd->add_option("--json", args->json_path, "Also write the report as JSON to this file");
  cmd->add_flag("--print-trace", args->print_trace,
                "Print the trace (the built-in one without --trace) as JSON lines and exit without "
                "running it");
  cmd->add_flag(
      "--no-progress", args->no_progress,
      "No progress display on stderr (it is a bar on a terminal, a line every few seconds "
      "otherwise, with the time elapsed and an estimate of the time left; when that exceeds 2 "
      "minutes, a one-time hint names the options that shorten the run)");
  cmd->callback([args] { run(*args); });
}

}  // namespace attnrt::cli
