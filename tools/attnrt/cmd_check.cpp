// `attnrt check`: random conformance cases of one backend against `reference`, counted per feature.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"
#include "tests/conformance/conformance.h"
#include "tools/attnrt/cli_options.h"
#include "tools/attnrt/commands.h"
#include "tools/attnrt/progress.h"

namespace attnrt::cli {

namespace {

namespace conf = attnrt::conformance;

struct CheckArgs {
  std::string backend;
  int64_t cases = 200;
  int64_t first_case = 0;
  uint64_t seed = 0;
  bool seed_given = false;  // else the seed is drawn from the clock
  std::vector<std::string> features;
  int jobs = 1;
  bool no_progress = false;
};

// The seed of case k: each case gets its own stream, so case k is the same whatever N is.
uint64_t case_seed(uint64_t seed, int64_t k) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (1 + static_cast<uint64_t>(k));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::string fmt_err(double e) { return fmt::format("{:.2e}", e); }

struct Tally {
  int64_t cases = 0, failures = 0;
  double max_abs = 0, max_rel = 0;
  int64_t first_failing_case = -1;  // the lowest index, whatever order the jobs finish in
  std::string first_failure;

  void count(int64_t k, const conf::CaseResult& r, uint64_t seed) {
    ++cases;
    max_abs = std::max(max_abs, r.max_abs_err);
    max_rel = std::max(max_rel, r.max_rel_err);
    if (r.ok) return;
    ++failures;
    if (first_failing_case < 0 || k < first_failing_case) {
      first_failing_case = k;
      first_failure = fmt::format("case {} of seed {}: {}", k, seed, r.detail);
    }
  }
};

void check(const CheckArgs& a) {
  const Registry& registry = Registry::global();
  const BackendEntry& entry = registry.get(a.backend);
  const std::string unavailable = entry.unavailable_reason ? entry.unavailable_reason() : "";
  ATTNRT_CHECK(unavailable.empty(), "--backend {}: not usable on this machine: {}", a.backend,
               unavailable);
  const uint64_t seed =
      a.seed_given
          ? a.seed
          : static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());

  // --feature: every case is drawn around one of them in turn; else any mix the caps claim.
  std::vector<conf::Feature> focus;
  for (const std::string& name : a.features) {
    const conf::Feature f = conf::parse_feature(name);
    const std::string why = conf::unsupported_reason(entry.caps, f);
    ATTNRT_CHECK(why.empty(), "--feature {}: backend '{}' does not claim it: {}", name, a.backend,
                 why);
    if (std::find(focus.begin(), focus.end(), f) == focus.end()) focus.push_back(f);
  }
  const std::vector<conf::Feature> shown =
      focus.empty()
          ? std::vector<conf::Feature>(conf::all_features().begin(), conf::all_features().end())
          : focus;

  std::map<conf::Feature, Tally> tally;
  Tally all;
  ProgressBar bar("check", !a.no_progress);
  const auto t0 = std::chrono::steady_clock::now();
  std::mutex mu;
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  auto worker = [&] {
    // Each case on one thread (the reference's float64 loops included) and the cases spread over
    // the jobs: small cases would spend more on waking threads than on their arithmetic.
    omp_set_num_threads(1);
    for (int64_t i = next++; i < a.cases; i = next++) {
      const int64_t k = a.first_case + i;
      try {
        const std::optional<conf::Feature> f =
            focus.empty()
                ? std::nullopt
                : std::optional<conf::Feature>(focus[static_cast<size_t>(k) % focus.size()]);
        const conf::ConformanceCase c = conf::draw_case(case_seed(seed, k), entry.caps, f);
        const conf::CaseResult r = conf::run_case(entry, c, registry);
        const std::lock_guard<std::mutex> lock(mu);
        all.count(k, r, seed);
        for (conf::Feature x : c.features) tally[x].count(k, r, seed);
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        bar.update(all.cases, a.cases, "cases",
                   fmt::format("{} cases/s | {} failed",
                               human_count(secs > 0 ? all.cases / secs : 0), all.failures));
      } catch (...) {
        const std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
        next = a.cases;
      }
    }
  };
  std::vector<std::thread> jobs;
  for (int j = 1; j < a.jobs; ++j) jobs.emplace_back(worker);
  worker();
  for (std::thread& t : jobs) t.join();
  if (error) std::rethrow_exception(error);
  bar.finish();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::printf("conformance of '%s' against reference: %lld random cases%s%s, seed %llu (%s)\n\n",
              a.backend.c_str(), static_cast<long long>(a.cases),
              focus.empty() ? "" : " around the chosen features",
              a.first_case == 0
                  ? ""
                  : fmt::format(" ({} .. {})", a.first_case, a.first_case + a.cases - 1).c_str(),
              static_cast<unsigned long long>(seed),
              a.seed_given ? "--seed" : "drawn from the clock; pass --seed to repeat the run");
  const std::string head = fmt::format("{:<18} {:>9} {:>9} {:>10} {:>10}  {}\n", "feature", "cases",
                                       "failures", "max abs", "max rel", "result");
  std::fputs(head.c_str(), stdout);
  std::fputs((std::string(head.size() - 1, '-') + "\n").c_str(), stdout);
  int failed = 0, passed = 0, skipped = 0, unexercised = 0;
  for (conf::Feature f : shown) {
    const std::string why = conf::unsupported_reason(entry.caps, f);
    const Tally t = tally.count(f) ? tally.at(f) : Tally{};
    std::string result;
    if (!why.empty()) {
      result = "skipped: " + why;
      ++skipped;
    } else if (t.failures > 0) {
      result = "FAIL";
      ++failed;
    } else if (t.cases == 0) {
      result = "not drawn (run more cases)";
      ++unexercised;
    } else {
      result = "pass";
      ++passed;
    }
    const bool none = !why.empty() || t.cases == 0;
    const std::string line =
        fmt::format("{:<18} {:>9} {:>9} {:>10} {:>10}  {}\n", conf::feature_name(f), t.cases,
                    none ? std::string("-") : std::to_string(t.failures),
                    none ? std::string("-") : fmt_err(t.max_abs),
                    none ? std::string("-") : fmt_err(t.max_rel), result);
    std::fputs(line.c_str(), stdout);
  }
  std::printf("%s\n", std::string(head.size() - 1, '-').c_str());
  std::printf("%-18s %9lld %9lld %10s %10s  %.1f s, %.0f cases/s\n", "all cases",
              static_cast<long long>(all.cases), static_cast<long long>(all.failures),
              fmt_err(all.max_abs).c_str(), fmt_err(all.max_rel).c_str(), secs,
              secs > 0 ? all.cases / secs : 0.0);
  std::printf("\n%d features passed, %d failed, %d skipped", passed, failed, skipped);
  if (unexercised > 0) std::printf(", %d not drawn", unexercised);
  std::printf("\n");
  for (conf::Feature f : shown) {
    if (tally.count(f) && tally.at(f).failures > 0) {
      std::printf("\n%s: first failing case: %s\n", std::string(conf::feature_name(f)).c_str(),
                  tally.at(f).first_failure.c_str());
    }
  }
  std::fflush(stdout);
  if (all.failures > 0) throw ExitCode{1};
}

}  // namespace

void add_check_command(CLI::App& app) {
  auto args = std::make_shared<CheckArgs>();
  auto* cmd = app.add_subcommand(
      "check",
      "Conformance of a backend against `reference`: random cases, each a random combination of "
      "the features the backend claims (modes, page sizes, GQA / MQA ratios, windows, draft "
      "trees, sinks, soft-cap, KV dtypes, MLA, DSA, head dims, and GDN / Mamba2 / KDA linear "
      "layers), run on both over identical pools and compared element by element. Prints the "
      "cases and the worst error per feature. Exits 1 on any failure, 2 on bad input.");
  cmd->add_option("--backend", args->backend, "Backend to check (see `attnrt info`)")->required();
  cmd->add_option("--cases", args->cases,
                  "Random cases in all; each draws a random combination of the features the "
                  "backend claims (a case counts for every feature it exercises)")
      ->check(int_in(1, int64_t{1} << 40))
      ->capture_default_str();
  cmd->add_option("--seed", args->seed,
                  "Seed of the random cases; unset: drawn from the clock (printed, so a failing "
                  "run can be repeated)")
      ->check(seed_value());
  cmd->add_option("--first-case", args->first_case,
                  "Index of the first case: runs cases K .. K + N - 1 of the seed's sequence (a "
                  "failure names its case index; --first-case K --cases 1 runs it alone, and a "
                  "long run can be split into pieces)")
      ->check(int_in(0, int64_t{1} << 50))
      ->capture_default_str();
  std::string names;
  for (conf::Feature f : conf::all_features()) {
    names += (names.empty() ? "" : ", ") + std::string(conf::feature_name(f));
  }
  cmd->add_option("--feature", args->features,
                  "Draw every case around this feature (repeatable: in turn); one of: " + names);
  cmd->add_option("--jobs", args->jobs,
                  "Cases run at once, each on one thread (the reference included); the cpu "
                  "backend's own threads are part of the drawn case")
      ->check(int_in(1, max_threads_option()))
      ->capture_default_str();
  cmd->add_flag("--no-progress", args->no_progress, "No progress display on stderr");
  cmd->callback([args, cmd] {
    args->seed_given = cmd->get_option("--seed")->count() > 0;
    check(*args);
  });
}

}  // namespace attnrt::cli
