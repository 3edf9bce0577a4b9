#include "bench/harness/dsa_workload.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "attnrt/core/error.h"
#include "bench/harness/scale.h"
#include "bench/harness/select.h"

namespace attnrt::bench {

namespace {

DsaWorkload dsa_row(DsaPart part, bool prefill, int batch, int kv_len) {
  DsaWorkload w;
  w.part = part;
  w.prefill = prefill;
  w.batch = batch;
  w.kv_len = kv_len;
  w.name = fmt::format("dsa-{}-{}x{}", prefill ? "prefill" : dsa_part_name(part), batch, kv_len);
  return w;
}

// index_topk of a row whose lengths went from `from` to `to` keys: the same share, at least 16.
int scaled_topk(const DsaWorkload& standard, int to) {
  const double share = static_cast<double>(to) / standard.kv_len;
  return std::clamp(static_cast<int>(std::lround(standard.index_topk * share)), 16,
                    standard.index_topk);
}

// The q and out of every query token (bf16), read and written once.
double query_bytes(const DsaWorkload& w) {
  return static_cast<double>(w.num_tokens()) * w.q_heads * (w.latent_dim() + w.kv_lora_rank) * 2.0;
}

}  // namespace

std::string_view dsa_part_name(DsaPart p) {
  switch (p) {
    case DsaPart::step:
      return "decode";
    case DsaPart::index:
      return "index";
    case DsaPart::sparse:
      return "sparse";
  }
  return "?";
}

Bound DsaWorkload::bound() const { return part == DsaPart::index ? Bound::memory : Bound::compute; }

std::string DsaWorkload::shape() const {
  return fmt::format("h{} {}x{}{} top{} page {}", q_heads, batch, kv_len, prefill ? " causal" : "",
                     index_topk, page_size);
}

double dsa_candidate_pairs(const DsaWorkload& w) {
  const double l = w.kv_len;
  return w.batch * (w.prefill ? l * (l + 1) / 2 : l);
}

double dsa_selected_pairs(const DsaWorkload& w) {
  if (!w.prefill) return static_cast<double>(w.batch) * std::min(w.kv_len, w.index_topk);
  // Query t has t + 1 candidates: all of them up to index_topk, then index_topk.
  const double k = std::min(w.kv_len, w.index_topk), l = w.kv_len;
  return w.batch * (k * (k + 1) / 2 + (l - k) * k);
}

double dsa_index_bytes(const DsaWorkload& w) {
  return static_cast<double>(w.batch) * w.kv_len * (w.index_head_dim + 4);
}

double dsa_index_flops(const DsaWorkload& w) {
  return dsa_candidate_pairs(w) * 2.0 * w.index_heads * w.index_head_dim;
}

double dsa_sparse_bytes(const DsaWorkload& w) {
  return dsa_selected_pairs(w) * w.latent_dim() * 2.0 + query_bytes(w);
}

double dsa_sparse_flops(const DsaWorkload& w) {
  return dsa_selected_pairs(w) * 2.0 * w.q_heads * (w.latent_dim() + w.kv_lora_rank);
}

double dsa_counted_bytes(const DsaWorkload& w) {
  switch (w.part) {
    case DsaPart::index:
      return dsa_index_bytes(w);
    case DsaPart::sparse:
      return dsa_sparse_bytes(w);
    case DsaPart::step:
      break;
  }
  const double index_inputs =
      static_cast<double>(w.num_tokens()) * w.index_heads * (w.index_head_dim + 1) * 2.0;
  return dsa_index_bytes(w) + dsa_sparse_bytes(w) + index_inputs;
}

double dsa_counted_flops(const DsaWorkload& w) {
  switch (w.part) {
    case DsaPart::index:
      return dsa_index_flops(w);
    case DsaPart::sparse:
      return dsa_sparse_flops(w);
    case DsaPart::step:
      break;
  }
  return dsa_index_flops(w) + dsa_sparse_flops(w);
}

Workload dsa_dense_companion(const DsaWorkload& w, bool dense_absorbed) {
  Workload d;
  d.batch = w.batch;
  d.q_heads = w.q_heads;
  d.kv_heads = 1;
  d.kv_lora_rank = w.kv_lora_rank;
  d.head_dim = w.latent_dim();
  d.page_size = w.page_size;
  if (w.prefill) {
    d.kind = WorkloadKind::prefill;
    d.new_tokens = w.kv_len;
    if (!dense_absorbed) {
      // DeepSeek's MHA form, as the mla suite's mla-prefill rows: q / k of 128 + 64, v of 128.
      d.qk_nope_head_dim = 128;
      d.mha_v_head_dim = 128;
    }
    d.name =
        fmt::format("mla-prefill-{}x{}{}", w.batch, w.kv_len, dense_absorbed ? "-absorbed" : "");
  } else {
    d.kind = WorkloadKind::decode;
    d.prefix_len = w.kv_len - 1;
    d.name = fmt::format("mla-decode-h{}-{}x{}", w.q_heads, w.batch, w.kv_len);
  }
  d.scale_note = w.scale_note;
  return d;
}

DsaTarget dsa_target(const DsaWorkload& w) {
  if (w.prefill) return {2.0, false};
  switch (w.part) {
    case DsaPart::step:
      return {w.kv_len > 32768 ? 0.15 : 0.35, true};
    case DsaPart::index:
      return {80.0, false};
    case DsaPart::sparse:
      return {80.0, false};
  }
  return {};
}

std::vector<DsaWorkload> dsa_workloads() {
  std::vector<DsaWorkload> rows;
  for (auto [b, l] : {std::pair{64, 32768}, std::pair{16, 131072}}) {
    for (DsaPart p : {DsaPart::step, DsaPart::index, DsaPart::sparse}) {
      rows.push_back(dsa_row(p, false, b, l));
    }
  }
  rows.push_back(dsa_row(DsaPart::step, true, 1, 32768));
  return rows;
}

bool is_dsa_selector(std::string_view item) {
  try {
    select_dsa_workloads(item);
    return true;
  } catch (const Error&) {
    return false;
  }
}

std::vector<DsaWorkload> select_dsa_workloads(std::string_view selector) {
  return select_rows(
      selector, dsa_workloads(),
      [](const DsaWorkload& w, std::string_view item) {
        if (item.substr(0, 4) == "dsa-") item.remove_prefix(4);
        const std::string_view kind = w.prefill ? "prefill" : dsa_part_name(w.part);
        return item == "all" || item == "dsa" || item == kind ||
               "dsa-" + std::string(item) == w.name;
      },
      "workload", "all, dsa-decode, dsa-index, dsa-sparse, dsa-prefill",
      "all, a part, or a row name");
}

DsaWorkload scale_dsa_workload(const DsaWorkload& w, double factor) {
  return scale_row(w, factor, [&](DsaWorkload& s, double f) {
    s.kv_len = round_length(w.kv_len * f);
    s.index_topk = scaled_topk(w, s.kv_len);
  });
}

std::vector<DsaWorkload> apply_dsa_preset(const std::vector<DsaWorkload>& rows,
                                          std::string_view preset) {
  if (preset != "cpu-small") {
    fail("unknown --preset '{}': the presets are {}", preset, fmt::join(preset_names(), ", "));
  }
  // Sized by the dense companion, the costlier half of every row's measurements (and of its
  // float64 check): a few seconds on a 2-core box.
  constexpr double kMaxBytes = 1.25 * double(1ull << 30);
  constexpr double kMaxWork = 2e10;
  auto fits = [&](const DsaWorkload& x) {
    const Workload d = dsa_dense_companion(x);
    return counted_bytes(d) <= kMaxBytes && attention_work(d) <= kMaxWork;
  };
  std::vector<DsaWorkload> out;
  for (const DsaWorkload& w : rows) {
    DsaWorkload s = w;
    while (!fits(s) && s.batch > 1) s.batch = (s.batch + 1) / 2;
    while (!fits(s) && s.kv_len > kLengthQuantum) {
      s.kv_len = halve_length(s.kv_len);
      s.index_topk = scaled_topk(w, s.kv_len);
    }
    if (!(s == w)) s.scale_note = fmt::format("shrunk by --preset cpu-small from {}", w.shape());
    out.push_back(s);
  }
  return out;
}

}  // namespace attnrt::bench
