#include "tools/attnrt/cli_options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <thread>

#include "attnrt/backend/registry.h"
#include "attnrt/backend/selection.h"

namespace attnrt::cli {

namespace {

// Speculative decoding's shapes: draft depth, branches per step and tokens per verify block. The
// resolver checks how they fit together; these bound each one.
constexpr int kMaxSpeculativeSteps = 64;
constexpr int kMaxEagleTopk = 64;
constexpr int kMaxDraftTokens = 1024;

std::string range_text(int64_t lo, int64_t hi) {
  if (hi == std::numeric_limits<int64_t>::max()) return fmt::format(">= {}", lo);
  return fmt::format("in [{}, {}]", lo, hi);
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// Every long option name of `cmd` and of its option groups.
void option_names(const CLI::App& cmd, std::vector<std::string>& names) {
  for (const CLI::Option* opt : cmd.get_options()) {
    for (const std::string& n : opt->get_lnames()) names.push_back("--" + n);
  }
  for (const CLI::App* sub : cmd.get_subcommands({})) {
    if (sub->get_name().empty()) option_names(*sub, names);
  }
}

}  // namespace

CLI::Validator int_in(int64_t lo, int64_t hi) {
  const std::string allowed = "an integer " + range_text(lo, hi);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (ec == std::errc::result_out_of_range) {
          return fmt::format("{} is not allowed; use {}", text, allowed);
        }
        if (ec != std::errc() || end != text.data() + text.size()) {
          return fmt::format("'{}' is not an integer; use {}", text, allowed);
        }
        if (v < lo || v > hi) return fmt::format("{} is not allowed; use {}", text, allowed);
        return {};
      },
      range_text(lo, hi));
}

CLI::Validator real_in(double lo, double hi, bool lo_open) {
  const std::string range = fmt::format("in {}{:g}, {:g}]", lo_open ? "(" : "[", lo, hi);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double v = 0;
        std::istringstream in(text);
        in >> v;
        if (in.fail() || !in.eof()) {
          return fmt::format("'{}' is not a number; use a number {}", text, range);
        }
        if (!std::isfinite(v) || v > hi || v < lo || (lo_open && v == lo)) {
          return fmt::format("{} is not allowed; use a number {}", text, range);
        }
        return {};
      },
      range);
}

CLI::Validator one_of(std::vector<std::string> allowed) {
  const std::string desc = fmt::format("{}", fmt::join(allowed, "|"));
  return CLI::Validator(
      [allowed](std::string& text) -> std::string {
        if (std::find(allowed.begin(), allowed.end(), text) != allowed.end()) return {};
        return fmt::format("'{}' is not allowed; use one of {}", text, fmt::join(allowed, ", "));
      },
      desc);
}

CLI::Validator seed_value() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t v = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (ec != std::errc() || end != text.data() + text.size()) {
          return fmt::format("'{}' is not allowed; use an integer in [0, 2^64 - 1]", text);
        }
        return {};
      },
      "in [0, 2^64 - 1]");
}

int max_threads_option() { return max_num_threads(); }

void warn_if_machine_busy(const Options& options) {
  const char* env_threads = std::getenv("ATTNRT_NUM_THREADS");
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  // Only `reference` named for every phase: no cpu backend runs.
  const bool reference_only =
      options.attention_backend == "reference" &&
      (options.prefill_attention_backend.empty() ||
       options.prefill_attention_backend == "reference") &&
      (options.decode_attention_backend.empty() || options.decode_attention_backend == "reference");
  if (reference_only || options.num_threads > 0 ||
      (env_threads != nullptr && *env_threads != '\0') || wait_policy != nullptr) {
    return;
  }
  double load = 0;
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &load) != 1) load = 0;
    std::fclose(f);
  }
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (cores == 1 || load < cores) return;
  std::fprintf(stderr,
               "note: this machine is busy (load average %.1f on %d hardware threads); the cpu "
               "backends' idle OpenMP threads would spin between steps and slow everything "
               "down: pass --threads 1, or set OMP_WAIT_POLICY=passive\n",
               load, cores);
}

int report_parse_error(CLI::App& app, const CLI::ParseError& e) {
  if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
  // The subcommand being parsed, for its option names and its help line.
  CLI::App* cmd = &app;
  for (CLI::App* sub : app.get_subcommands()) cmd = sub;
  const std::string where =
      cmd == &app ? std::string("attnrt") : fmt::format("attnrt {}", cmd->get_name());
  // Arguments nobody took: unknown options (the values after them are not worth a line of their
  // own) or, with no subcommand, an unknown command.
  std::vector<std::string> unknown;
  for (const std::string& arg : app.remaining(true)) {
    if (arg.starts_with("-") || (cmd == &app && unknown.empty())) unknown.push_back(arg);
  }
  const bool extras = dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr;
  if (unknown.empty() && extras) unknown = app.remaining(true);
  if (!unknown.empty() && (extras || cmd == &app)) {
    std::vector<std::string> known;
    option_names(*cmd, known);
    if (cmd == &app) {
      for (const CLI::App* sub : app.get_subcommands({})) {
        if (!sub->get_name().empty()) known.push_back(sub->get_name());
      }
    }
    for (const std::string& arg : unknown) {
      std::string msg = fmt::format("error: `{}` does not take '{}'", where, arg);
      const std::string flag = arg.substr(0, arg.find('='));
      const auto best = std::min_element(known.begin(), known.end(),
                                         [&](const std::string& a, const std::string& b) {
                                           return edit_distance(flag, a) < edit_distance(flag, b);
                                         });
      if (best != known.end() &&
          edit_distance(flag, *best) <= std::max<size_t>(2, flag.size() / 3)) {
        msg += fmt::format("; did you mean {}?", *best);
      }
      std::fprintf(stderr, "%s\n", msg.c_str());
    }
  } else {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  std::fprintf(stderr, "run '%s --help' for the options and what they allow\n", where.c_str());
  return 2;
}

void add_backend_options(CLI::App& cmd, Options& options) {
  const std::string names = fmt::format("{}", fmt::join(Registry::global().names(), ", "));
  CLI::Option_group* g = cmd.add_option_group(
      kBackendOptionGroup,
      "Which attention backends serve each phase, and how the KV cache is laid "
      "out (see docs/backends.md)");
  g->add_option("--attention-backend", options.attention_backend,
                fmt::format("Backend for every phase: {}, or dsa (alias nsa, deprecated): the "
                            "DSA router of models with an indexer. Unset: auto-select (cuda on a "
                            "Hopper GPU, else cpu; never reference; dsa for a model with an "
                            "indexer)",
                            names));
  g->add_option("--prefill-attention-backend", options.prefill_attention_backend,
                "Backend for EXTEND and MIXED steps (and verify/draft extend with "
                "--speculative-attention-mode prefill). Unset: --attention-backend. Differing "
                "prefill and decode backends enable the hybrid router");
  g->add_option("--decode-attention-backend", options.decode_attention_backend,
                "Backend for DECODE and IDLE steps (and verify/draft extend with "
                "--speculative-attention-mode decode). Unset: --attention-backend");
  g->add_option("--speculative-attention-mode", options.speculative_attention_mode,
                "Which phase backend runs TARGET_VERIFY and DRAFT_EXTEND steps: prefill or decode")
      ->check(one_of({"prefill", "decode"}))
      ->capture_default_str();
  g->add_option("--page-size", options.page_size,
                "Tokens per KV-cache page; a cached prefix is reused in whole pages. 1 = token "
                "granularity. Must be a native page size of the chosen backends")
      ->check(int_in(1, kMaxPageSize))
      ->capture_default_str();
  g->add_option("--kv-cache-dtype", options.kv_cache_dtype,
                "KV cache element type: auto (the model's dtype), bf16, fp16, fp32, fp8_e4m3 or "
                "fp8_e5m2 (fp8 stores k/scale and v/scale with per-layer scales)")
      ->capture_default_str();
  g->add_option("--speculative-num-steps", options.speculative_num_steps,
                "Draft depth of speculative decoding (EAGLE-style); 0 = off")
      ->check(int_in(0, kMaxSpeculativeSteps))
      ->capture_default_str();
  g->add_option("--speculative-eagle-topk", options.speculative_eagle_topk,
                "Draft branches per step: 1 = chain verify, > 1 = tree verify. Unset (0) with "
                "--speculative-num-steps: 1")
      ->check(int_in(0, kMaxEagleTopk));
  g->add_option("--speculative-num-draft-tokens", options.speculative_num_draft_tokens,
                "Tokens per verify block, the root included. A chain needs exactly num_steps + 1 "
                "(the default when unset); a tree needs it set")
      ->check(int_in(0, kMaxDraftTokens));
  g->add_option("--dsa-prefill-backend", options.dsa_prefill_backend,
                "DSA models (an indexer, e.g. deepseek-v3.2): backend for the prefill phase of "
                "--attention-backend dsa (alias nsa, deprecated), which is on by default for "
                "them. Unset: --prefill-attention-backend, else auto among the DSA backends");
  g->add_option("--dsa-decode-backend", options.dsa_decode_backend,
                "DSA models: backend for the decode phase of --attention-backend dsa. Unset: "
                "--decode-attention-backend, else auto among the DSA backends");
  g->add_option("--linear-attn-backend", options.linear_attn_backend,
                "Backend for the linear-attention layers (GDN, Mamba2, KDA) of hybrid models. "
                "Unset: auto-select");
  g->add_option("--linear-attn-prefill-backend", options.linear_attn_prefill_backend,
                "Linear-attention backend for prefill steps. Unset: --linear-attn-backend");
  g->add_option("--linear-attn-decode-backend", options.linear_attn_decode_backend,
                "Linear-attention backend for decode steps. Unset: --linear-attn-backend");
  g->add_option("--threads", options.num_threads,
                fmt::format("Threads for the cpu backends, at most {} (4 per hardware thread); "
                            "0 = $ATTNRT_NUM_THREADS, else every core, each step using only as "
                            "many as its work keeps busy",
                            max_threads_option()))
      ->check(int_in(0, max_threads_option()))
      ->capture_default_str();
  g->add_flag("--deterministic", options.deterministic,
              "Fixed split sizes, so results do not depend on batch composition or thread count");
  g->add_flag("--fp8-prefill-attention", options.fp8_prefill_attention,
              "Prefill / extend tiles of attention layers on fp8 tensor cores: q and the softmax "
              "weights in e4m3 against the fp8 K / V (head dim 128; others run as before). Needs "
              "--kv-cache-dtype fp8_e4m3 and the cuda prefill backend; tolerance in "
              "docs/backends.md (H100: 1.04-1.12x the bf16 prefill rate; without the flag an fp8 "
              "cache runs prefill at 16-bit precision on the warp-specialised CTA)");
  g->add_flag("--disable-chunked-prefix-cache", options.disable_chunked_prefix_cache,
              "MLA models: EXTEND / MIXED steps with a cached prefix always run MLA absorbed (the "
              "MHA form only without prefixes); see docs/mla.md");
  g->add_option("--chunked-prefix-cache-threshold", options.chunked_prefix_cache_threshold,
                "MLA models: EXTEND / MIXED steps whose prefixes sum to at least this many tokens "
                "run the MHA form with the prefix in chunks (shorter ones: absorbed)")
      ->check(int_in(1, std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  g->add_option("--max-chunk-capacity", options.max_chunk_capacity,
                "MLA models, MHA form: prefix keys per chunk over all requests (each request gets "
                "capacity / requests positions of its prefix per chunk)")
      ->check(int_in(1, std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
}

bool backend_options_given(CLI::App& cmd) {
  CLI::App* group = cmd.get_option_group(kBackendOptionGroup);
  for (const CLI::Option* opt : group->get_options()) {
    if (opt->count() > 0) return true;
  }
  return false;
}

}  // namespace attnrt::cli
