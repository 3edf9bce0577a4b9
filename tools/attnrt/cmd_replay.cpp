// attnrt replay CASE_DIR: runs a saved step (attnrt run --dump-step) again on a backend, writes its
// output, and compares it with the recorded output and with the reference backend.
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>

#include "attnrt/core/error.h"
#include "tools/attnrt/commands.h"
#include "tools/io/case_file.h"

namespace attnrt::cli {

namespace {

struct ReplayArgs {
  std::string case_dir;
  std::string backend;
  std::string out_dir;
  bool lse = false;
};

struct Diff {
  double max_abs = 0;
  int64_t at = -1;  // flat index of the largest difference
  int64_t differing = 0;
  bool nan_mismatch = false;
};

// Compares an output (any float dtype) with float32 values element by element.
Diff compare(const HostBuffer& got, const float* want) {
  Diff d;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float a = load_as_float(got.data(), got.dtype(), static_cast<size_t>(i));
    const float b = want[i];
    if (std::isnan(a) && std::isnan(b)) continue;
    if (a == b) continue;
    ++d.differing;
    const bool nan = std::isnan(a) || std::isnan(b);
    d.nan_mismatch = d.nan_mismatch || nan;
    const double e = nan ? INFINITY : std::fabs(static_cast<double>(a) - b);
    if (d.at < 0 || e > d.max_abs) {
      d.max_abs = e;
      d.at = i;
    }
  }
  return d;
}

std::string describe(const Diff& d, const Case& c) {
  if (d.differing == 0) return "bit-exact";
  const int64_t hq = c.layer.num_q_heads, dv = c.layer.v_head_dim;
  const int64_t token = d.at / (hq * dv), head = d.at / dv % hq;
  return fmt::format("{} of {} values differ; largest error {:.3g} at token {}, head {}{}",
                     d.differing, c.num_tokens() * hq * dv, d.max_abs, token, head,
                     d.nan_mismatch ? " (NaN in one output only)" : "");
}

// Two selections of a DSA layer ([T, index_topk] int32 token indices, -1 after the last): how many
// tokens selected other keys, and how many keys differ in all.
std::string describe_selection(const int32_t* got, const int32_t* want, const Case& c) {
  const int64_t t = c.num_tokens(), k = c.layer.indexer.index_topk;
  int64_t tokens = 0, keys = 0, first = -1;
  for (int64_t i = 0; i < t; ++i) {
    int64_t differ = 0;
    for (int64_t e = 0; e < k; ++e) differ += got[i * k + e] != want[i * k + e];
    if (differ == 0) continue;
    ++tokens;
    keys += differ;
    if (first < 0) first = i;
  }
  if (tokens == 0) return fmt::format("identical ({} token(s), index_topk {})", t, k);
  return fmt::format("{} of {} token(s) select other keys ({} entries differ; first at token {})",
                     tokens, t, keys, first);
}

std::vector<float> widen(const HostBuffer& b) {
  std::vector<float> v(static_cast<size_t>(b.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = load_as_float(b.data(), b.dtype(), i);
  return v;
}

void run_replay(const ReplayArgs& args) {
  Case c = read_case(args.case_dir);
  // Cases of hybrid linear-attention models written before the dumper recorded the attention
  // backend alone hold the report's "cpu; linear cpu"; the dumped layer is an attention layer.
  if (const size_t linear = c.backend.find("; linear "); linear != std::string::npos) {
    c.backend.resize(linear);
  }
  const LayerSpec& l = c.layer;
  const std::string backend =
      !args.backend.empty() ? args.backend : (!c.backend.empty() ? c.backend : "reference");
  const std::string out_dir = args.out_dir.empty() ? args.case_dir : args.out_dir;

  fmt::print(
      "case {}: model '{}' layer {} ({}, {} q / {} kv heads, head_dim {}/{}{}), {}, {} "
      "request(s), {} token(s), KV {} page {}\n",
      args.case_dir, c.model_name, l.layer_id, layer_kind_name(l.kind), l.num_q_heads,
      l.num_kv_heads, l.head_dim, l.v_head_dim,
      l.sliding_window >= 0 ? fmt::format(", window {}", l.sliding_window) : "",
      forward_mode_name(c.batch.mode), c.batch.batch_size, c.num_tokens(), dtype_name(c.kv_dtype),
      c.options.page_size);

  const ReplayResult r = replay_case(c, backend, args.lse);
  write_replay_result(out_dir, r);
  fmt::print("{}: wrote {}{}{}\n", backend, (std::filesystem::path(out_dir) / "out.npy").string(),
             args.lse ? " and lse.npy" : "", c.indexer ? " and topk.npy" : "");
  if (c.indexer) {
    fmt::print("  DSA layer: index_topk {}, {} index heads x {}, {} index keys in the case\n",
               l.indexer.index_topk, l.indexer.index_n_heads, l.indexer.index_head_dim,
               c.kv_slots.size());
  }

  if (c.expected_out) {
    fmt::print("  vs recorded output ({}): {}\n", c.backend.empty() ? "backend unknown" : c.backend,
               describe(compare(r.out, c.expected_out->as<float>()), c));
  }
  if (c.indexer && c.indexer->expected_topk) {
    fmt::print(
        "  selection vs recorded: {}\n",
        describe_selection(r.topk.ptr<int32_t>(), c.indexer->expected_topk->as<int32_t>(), c));
  }
  if (backend != "reference") {
    const ReplayResult ref = replay_case(c, "reference", false);
    const std::vector<float> want = widen(ref.out);
    fmt::print("  vs reference: {}\n", describe(compare(r.out, want.data()), c));
    if (c.indexer) {
      fmt::print("  selection vs reference: {}\n",
                 describe_selection(r.topk.ptr<int32_t>(), ref.topk.ptr<int32_t>(), c));
    }
  }
}

}  // namespace

void add_replay_command(CLI::App& app) {
  auto args = std::make_shared<ReplayArgs>();
  auto* cmd = app.add_subcommand(
      "replay",
      "Run one saved step again (a case directory written by `attnrt run --dump-step N DIR`): "
      "rebuilds the request table and the KV rows the step reads, runs the layer on a backend, "
      "writes out.npy (float32, [tokens, q heads, v_head_dim]; DSA layers also topk.npy, the "
      "selection), and compares it with the recorded output and with the reference backend. "
      "docs/replay.md describes the format.");
  cmd->add_option("CASE_DIR", args->case_dir, "Case directory (holds case.json and the .npy files)")
      ->required();
  cmd->add_option("--backend", args->backend,
                  "Backend to run (default: the one that recorded the case, else reference)");
  cmd->add_flag(
      "--lse", args->lse,
      "Also write lse.npy: the natural-log sum-exp of each row, float32 [tokens, q heads]");
  cmd->add_option("--out", args->out_dir,
                  "Directory for out.npy / lse.npy (default: CASE_DIR; created if missing)");
  cmd->callback([args] { run_replay(*args); });
}

}  // namespace attnrt::cli
