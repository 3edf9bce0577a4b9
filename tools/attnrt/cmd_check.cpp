// `attnrt check`: the conformance harness of one backend against `reference`, per feature.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"
#include "tests/conformance/conformance.h"
#include "tools/attnrt/commands.h"
#include "tools/attnrt/progress.h"

namespace attnrt::cli {

namespace {

namespace conf = attnrt::conformance;

struct CheckArgs {
  std::string backend;
  int cases = 8;
  uint64_t seed = 1;
  std::vector<std::string> features;
  bool no_progress = false;
};

// The seed of case k of a feature: each (feature, k) gets its own stream, so that the cases of a
// feature are the same whether it is checked alone (--feature) or with every other one.
uint64_t case_seed(uint64_t seed, conf::Feature f, int k) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull *
                          (1 + (static_cast<uint64_t>(f) << 20) + static_cast<uint64_t>(k));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::string fmt_err(double e) { return fmt::format("{:.2e}", e); }

void check(const CheckArgs& a) {
  const Registry& registry = Registry::global();
  const BackendEntry& entry = registry.get(a.backend);
  const std::string unavailable = entry.unavailable_reason ? entry.unavailable_reason() : "";
  ATTNRT_CHECK(unavailable.empty(), "--backend {}: not usable on this machine: {}", a.backend,
               unavailable);

  std::vector<conf::Feature> features;
  if (a.features.empty()) {
    features.assign(conf::all_features().begin(), conf::all_features().end());
  } else {
    for (const std::string& name : a.features) {
      const conf::Feature f = conf::parse_feature(name);
      const std::string why = conf::unsupported_reason(entry.caps, f);
      ATTNRT_CHECK(why.empty(), "--feature {}: backend '{}' does not claim it: {}", name, a.backend,
                   why);
      if (std::find(features.begin(), features.end(), f) == features.end()) features.push_back(f);
    }
  }
  int64_t total = 0;
  for (conf::Feature f : features) {
    if (conf::unsupported_reason(entry.caps, f).empty()) total += a.cases;
  }

  std::vector<conf::FeatureReport> reports;
  ProgressBar bar("check", !a.no_progress);
  int64_t done = 0;
  for (conf::Feature f : features) {
    conf::FeatureReport fr;
    fr.feature = f;
    fr.skip_reason = conf::unsupported_reason(entry.caps, f);
    fr.skipped = !fr.skip_reason.empty();
    for (int k = 0; !fr.skipped && k < a.cases; ++k) {
      const conf::ConformanceCase c = conf::generate_case(f, case_seed(a.seed, f, k), entry.caps);
      const conf::CaseResult r = conf::run_case(entry, c, registry);
      ++fr.cases;
      fr.max_abs_err = std::max(fr.max_abs_err, r.max_abs_err);
      fr.max_rel_err = std::max(fr.max_rel_err, r.max_rel_err);
      if (!r.ok && fr.failures++ == 0) fr.first_failure = r.detail;
      bar.update(++done, total, "cases",
                 fmt::format("{} case {}/{}", conf::feature_name(f), k + 1, a.cases));
    }
    reports.push_back(std::move(fr));
  }
  bar.finish();

  std::printf("conformance of '%s' against reference: %d cases per feature, seed %llu\n\n",
              a.backend.c_str(), a.cases, static_cast<unsigned long long>(a.seed));
  const std::string head = fmt::format("{:<18} {:>6} {:>9} {:>10} {:>10}  {}\n", "feature", "cases",
                                       "failures", "max abs", "max rel", "result");
  std::fputs(head.c_str(), stdout);
  std::fputs((std::string(head.size() - 1, '-') + "\n").c_str(), stdout);
  int failed = 0, passed = 0, skipped = 0;
  for (const conf::FeatureReport& fr : reports) {
    std::string result;
    if (fr.skipped) {
      result = "skipped: " + fr.skip_reason;
      ++skipped;
    } else if (fr.failures > 0) {
      result = "FAIL";
      ++failed;
    } else {
      result = "pass";
      ++passed;
    }
    const std::string line =
        fmt::format("{:<18} {:>6} {:>9} {:>10} {:>10}  {}\n", conf::feature_name(fr.feature),
                    fr.cases, fr.skipped ? std::string("-") : std::to_string(fr.failures),
                    fr.skipped ? std::string("-") : fmt_err(fr.max_abs_err),
                    fr.skipped ? std::string("-") : fmt_err(fr.max_rel_err), result);
    std::fputs(line.c_str(), stdout);
  }
  std::printf("\n%d features passed, %d failed, %d skipped\n", passed, failed, skipped);
  for (const conf::FeatureReport& fr : reports) {
    if (fr.failures > 0) {
      std::printf("\n%s: first failing case: %s\n",
                  std::string(conf::feature_name(fr.feature)).c_str(), fr.first_failure.c_str());
    }
  }
  std::fflush(stdout);
  if (failed > 0) throw ExitCode{1};
}

}  // namespace

void add_check_command(CLI::App& app) {
  auto args = std::make_shared<CheckArgs>();
  auto* cmd = app.add_subcommand(
      "check",
      "Conformance of a backend against `reference`: random cases per feature (modes, GQA/MQA, "
      "windows, soft-cap, sinks, page sizes, KV dtypes) run on both over identical pools and "
      "compared element by element. Features the backend does not claim are skipped. Exits 1 on "
      "any failure, 2 on bad input.");
  cmd->add_option("--backend", args->backend, "Backend to check (see `attnrt info`)")->required();
  cmd->add_option("--cases", args->cases, "Random cases per feature")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Seed of the random cases")->capture_default_str();
  std::string names;
  for (conf::Feature f : conf::all_features()) {
    names += (names.empty() ? "" : ", ") + std::string(conf::feature_name(f));
  }
  cmd->add_option("--feature", args->features,
                  "Check only this feature (repeatable); one of: " + names);
  cmd->add_flag("--no-progress", args->no_progress, "No progress display on stderr");
  cmd->callback([args] { check(*args); });
}

}  // namespace attnrt::cli
