#include "bench/harness/workload.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "attnrt/core/error.h"
#include "bench/harness/scale.h"
#include "bench/harness/select.h"

namespace attnrt::bench {

namespace {

Workload decode(int batch, int kv_len, int page_size, DType dtype) {
  Workload w;
  w.kind = WorkloadKind::decode;
  w.batch = batch;
  w.prefix_len = kv_len - 1;
  w.new_tokens = 1;
  w.page_size = page_size;
  w.kv_dtype = dtype;
  w.name = fmt::format("decode-{}x{}", batch, kv_len);
  if (page_size != 16) w.name += fmt::format("-p{}", page_size);
  if (dtype == DType::e4m3) w.name += "-fp8";
  return w;
}

Workload prefill(int batch, int len, int head_dim) {
  Workload w;
  w.kind = WorkloadKind::prefill;
  w.batch = batch;
  w.prefix_len = 0;
  w.new_tokens = len;
  w.head_dim = head_dim;
  w.name = fmt::format("prefill-{}x{}", batch, len);
  if (head_dim != 128) w.name += fmt::format("-d{}", head_dim);
  return w;
}

Workload extend(int batch, int prefix, int ext) {
  Workload w;
  w.kind = WorkloadKind::extend;
  w.batch = batch;
  w.prefix_len = prefix;
  w.new_tokens = ext;
  w.name = fmt::format("extend-{}x{}+{}", batch, prefix, ext);
  return w;
}

Workload fp8_prefill(Workload w) {
  w.kv_dtype = DType::e4m3;
  w.fp8_prefill = true;
  w.name += "-fp8";
  return w;
}

Workload verify(int batch, int prefix, int drafts, int topk) {
  Workload w;
  w.kind = topk > 1 ? WorkloadKind::verify_tree : WorkloadKind::verify_chain;
  w.batch = batch;
  w.prefix_len = prefix;
  w.new_tokens = drafts;
  w.topk = topk;
  w.name = topk > 1 ? fmt::format("verify-tree-{}x{}+{}-topk{}", batch, prefix, drafts, topk)
                    : fmt::format("verify-chain-{}x{}+{}", batch, prefix, drafts);
  return w;
}

// DeepSeek-V3's latent attention: kv_lora_rank 512 + rope 64 = 576 columns per token, V = 512.
constexpr int kMlaLoraRank = 512;
constexpr int kMlaRopeDim = 64;
constexpr int kMlaPage = 64;

Workload as_mla(Workload w, int q_heads) {
  w.q_heads = q_heads;
  w.kv_heads = 1;
  w.kv_lora_rank = kMlaLoraRank;
  w.head_dim = kMlaLoraRank + kMlaRopeDim;
  return w;
}

std::string mla_suffix(int page_size, DType dtype) {
  std::string s;
  if (page_size != kMlaPage) s += fmt::format("-p{}", page_size);
  if (dtype == DType::e4m3) s += "-fp8";
  return s;
}

Workload mla_decode(int q_heads, int batch, int kv_len, int page_size, DType dtype) {
  Workload w = as_mla(decode(batch, kv_len, page_size, dtype), q_heads);
  w.name = fmt::format("mla-decode-h{}-{}x{}{}", q_heads, batch, kv_len, mla_suffix(page_size, dtype));
  return w;
}

Workload mla_verify(int q_heads, int batch, int prefix, int drafts, int topk) {
  Workload w = as_mla(verify(batch, prefix, drafts, topk), q_heads);
  w.page_size = kMlaPage;
  w.name = "mla-" + w.name;
  return w;
}

// DeepSeek-V3's MHA form: q / k heads of 128 nope + 64 rope columns, v heads of 128; the prefix of
// an extend row in 4 chunks.
constexpr int kMlaNopeDim = 128;
constexpr int kMlaMhaV = 128;
constexpr int kMlaExtendChunks = 4;

Workload mla_mha(Workload w, int q_heads, int chunks) {
  w = as_mla(w, q_heads);
  w.page_size = kMlaPage;
  w.qk_nope_head_dim = kMlaNopeDim;
  w.mha_v_head_dim = kMlaMhaV;
  w.prefix_chunks = w.prefix_len > 0 ? chunks : 0;
  w.name = "mla-" + w.name;
  return w;
}

// Number of (query, key) pairs a request's queries see: the prefix in full, plus the mask among the
// new tokens (causal triangle, or ancestors-or-self in a tree).
double visible_pairs_per_request(const Workload& w) {
  const double p = w.prefix_len, n = w.new_tokens;
  if (w.kind == WorkloadKind::verify_tree) {
    std::vector<int32_t> parent = verify_parents(w);
    double inner = 0;
    for (int t = 0; t < w.new_tokens; ++t) {
      for (int u = t; u >= 0; u = parent[u]) inner += 1;
    }
    return n * p + inner;
  }
  return n * p + n * (n + 1) / 2;
}

}  // namespace

std::string_view workload_kind_name(WorkloadKind k) {
  switch (k) {
    case WorkloadKind::decode: return "decode";
    case WorkloadKind::prefill: return "prefill";
    case WorkloadKind::extend: return "extend";
    case WorkloadKind::verify_chain: return "verify-chain";
    case WorkloadKind::verify_tree: return "verify-tree";
  }
  return "?";
}

bool is_verify(WorkloadKind k) {
  return k == WorkloadKind::verify_chain || k == WorkloadKind::verify_tree;
}

Bound Workload::bound() const {
  // MLA: every q head reads the one latent head, so 128 heads do ~240 FLOP per cached byte, above
  // a GPU's ridge point; 16 heads (~30 FLOP per byte) stay memory-bound.
  if (is_mla() && (kind == WorkloadKind::decode || is_verify(kind))) {
    return q_heads >= 64 ? Bound::compute : Bound::memory;
  }
  return (kind == WorkloadKind::prefill || kind == WorkloadKind::extend) ? Bound::compute
                                                                         : Bound::memory;
}

std::string Workload::shape() const {
  std::string s;
  switch (kind) {
    case WorkloadKind::decode: s = fmt::format("{}x{}", batch, kv_len()); break;
    case WorkloadKind::prefill: s = fmt::format("{}x{}", batch, new_tokens); break;
    case WorkloadKind::extend:
    case WorkloadKind::verify_chain:
      s = fmt::format("{}x({}+{})", batch, prefix_len, new_tokens);
      break;
    case WorkloadKind::verify_tree:
      s = fmt::format("{}x({}+{}, topk {})", batch, prefix_len, new_tokens, topk);
      break;
  }
  if (is_mla()) {
    s = fmt::format("h{} {}", q_heads, s);  // the dims are DeepSeek-V3's (576 / 512)
    if (is_mla_mha()) s += " mha";
    if (prefix_chunks > 0) s += fmt::format(" {} chunks", prefix_chunks);
  } else if (head_dim != 128) {
    s += fmt::format(" d{}", head_dim);
  }
  if (page_size != 16) s += fmt::format(" page {}", page_size);
  if (kv_dtype != DType::bf16) s += fmt::format(" {}", dtype_name(kv_dtype));
  if (fp8_prefill) s += " fp8-prefill";
  return s;
}

double counted_bytes(const Workload& w) {
  if (w.is_mla_mha()) {
    // Every tensor of the timed calls once: the extend tokens' bf16 q, k, v read, out written and
    // latent rows stored; per prefix token its latent row gathered (read from the pool, written
    // to the chunk buffer) and its decompressed bf16 k / v read. The running out / lse each merge
    // re-reads are not counted.
    const double tokens = static_cast<double>(w.num_tokens());
    const double per_token = w.q_heads * (2.0 * w.qk_head_dim() + 2.0 * w.v_head_dim()) * 2.0 +
                             w.head_dim * 2.0;
    const double prefix = static_cast<double>(w.batch) * w.prefix_len;
    const double per_prefix =
        2.0 * w.head_dim * 2.0 + w.q_heads * (w.qk_head_dim() + w.v_head_dim()) * 2.0;
    return tokens * per_token + prefix * per_prefix;
  }
  if (w.is_mla()) {
    // The latent cache read once per request (K and V are the same row; fp8 scales are one scalar
    // per layer, nothing per token), the bf16 queries read and the bf16 outputs written.
    const double cache = static_cast<double>(w.batch) * w.kv_len() * w.head_dim *
                         static_cast<double>(dtype_size(w.kv_dtype));
    const double tokens = static_cast<double>(w.num_tokens());
    return cache + tokens * w.q_heads * (w.head_dim + w.v_head_dim()) * 2.0;
  }
  return static_cast<double>(w.batch) * w.kv_len() * w.kv_heads * w.head_dim * 2.0 *
         static_cast<double>(dtype_size(w.kv_dtype));
}

double counted_flops(const Workload& w) {
  if (w.is_mla()) return attention_work(w);  // MLA rows count their exact visible pairs
  const double per_pair = 2.0 * w.q_heads * (w.head_dim + w.v_head_dim());
  const double s = w.new_tokens, p = w.prefix_len;
  switch (w.kind) {
    case WorkloadKind::prefill: return w.batch * per_pair * s * s / 2;
    case WorkloadKind::extend: return w.batch * per_pair * (s * p + s * s / 2);
    default: return attention_work(w);
  }
}

double attention_work(const Workload& w) {
  // 2 FLOPs per multiply-add of QK^T (head_dim) and of PV (v_head_dim): 4*Hq*D when they agree,
  // 2*Hq*(576 + 512) for an MLA row in the absorbed form, 2*Hq*(192 + 128) in the MHA form.
  return static_cast<double>(w.batch) * 2.0 * w.q_heads * (w.qk_head_dim() + w.v_head_dim()) *
         visible_pairs_per_request(w);
}

std::vector<int32_t> verify_parents(const Workload& w) {
  const int n = w.new_tokens;
  std::vector<int32_t> parent(n, -1);
  if (w.topk <= 1) {
    for (int t = 1; t < n; ++t) parent[t] = t - 1;
    return parent;
  }
  // Level 1 hangs off the root; each later level keeps `topk` tokens whose parents are drawn from
  // the level above, as an EAGLE draft does when it keeps the top-k expansions of every step.
  uint64_t state = 0x9e3779b97f4a7c15ull;
  int level_begin = 0, level_end = 1;  // [begin, end) of the level above
  for (int t = 1; t < n;) {
    int next_end = std::min(n, t + w.topk);
    for (int u = t; u < next_end; ++u) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      parent[u] = level_begin + static_cast<int>((state >> 33) % (level_end - level_begin));
    }
    std::sort(parent.begin() + t, parent.begin() + next_end);
    level_begin = t;
    level_end = next_end;
    t = next_end;
  }
  return parent;
}

Workload decode_companion(const Workload& v) {
  Workload d = decode(v.batch, v.prefix_len, v.page_size, v.kv_dtype);
  d.q_heads = v.q_heads;
  d.kv_heads = v.kv_heads;
  d.head_dim = v.head_dim;
  d.kv_lora_rank = v.kv_lora_rank;
  if (v.is_mla()) {
    d.name = fmt::format("mla-decode-h{}-{}x{}{}", v.q_heads, v.batch, v.prefix_len,
                         mla_suffix(v.page_size, v.kv_dtype));
  }
  d.scale_note = v.scale_note;
  return d;
}

std::vector<Workload> standard_workloads() {
  const std::pair<int, int> decode_set[] = {{1, 32768},  {16, 4096},  {64, 4096},
                                            {128, 8192}, {256, 2048}, {32, 32768}};
  std::vector<Workload> rows;
  for (auto [b, l] : decode_set) rows.push_back(decode(b, l, 16, DType::bf16));
  for (auto [b, l] : decode_set) rows.push_back(decode(b, l, 1, DType::bf16));
  for (auto [b, l] : decode_set) rows.push_back(decode(b, l, 16, DType::e4m3));
  rows.push_back(prefill(1, 1024, 128));
  rows.push_back(prefill(1, 4096, 128));
  rows.push_back(prefill(1, 16384, 128));
  rows.push_back(prefill(8, 2048, 128));
  rows.push_back(prefill(1, 8192, 64));
  rows.push_back(prefill(1, 8192, 256));
  rows.push_back(extend(8, 2048, 512));
  rows.push_back(verify(64, 4096, 8, 1));
  rows.push_back(verify(64, 4096, 16, 4));
  return rows;
}

// The same row over an e4m3 KV cache without the fp8 prefill kernel: what a backend does with an
// fp8 cache by default (on cuda, the mma.sync CTA converting K / V in shared memory).
Workload fp8_kv(Workload w) {
  w.kv_dtype = DType::e4m3;
  w.name += "-kvfp8";
  return w;
}

std::vector<Workload> fp8_prefill_workloads() {
  return {fp8_prefill(prefill(1, 4096, 128)), fp8_prefill(prefill(1, 16384, 128)),
          fp8_prefill(prefill(8, 2048, 128)), fp8_prefill(extend(8, 2048, 512)),
          fp8_kv(prefill(1, 16384, 128)),     fp8_kv(extend(8, 2048, 512)),
          fp8_kv(prefill(1, 8192, 64)),       fp8_kv(prefill(1, 8192, 256))};
}

std::vector<Workload> long_decode_workloads() {
  return {decode(1, 131072, 16, DType::bf16), decode(4, 131072, 16, DType::bf16)};
}

bool is_long_decode(const Workload& w) {
  return w.kind == WorkloadKind::decode && w.kv_len() >= kLongDecodeKeys;
}

std::vector<Workload> attention_workloads() {
  std::vector<Workload> rows = standard_workloads();
  for (Workload& w : fp8_prefill_workloads()) rows.push_back(std::move(w));
  for (Workload& w : long_decode_workloads()) rows.push_back(std::move(w));
  return rows;
}

std::vector<Workload> mla_workloads() {
  struct Shape { int heads, batch, len; };
  const Shape decode_set[] = {{16, 1, 32768}, {16, 64, 8192}, {128, 64, 4096}, {128, 128, 8192}};
  std::vector<Workload> rows;
  for (auto [h, b, l] : decode_set) rows.push_back(mla_decode(h, b, l, kMlaPage, DType::bf16));
  for (auto [h, b, l] : decode_set) rows.push_back(mla_decode(h, b, l, kMlaPage, DType::e4m3));
  for (auto [h, b, l] : decode_set) rows.push_back(mla_decode(h, b, l, 1, DType::bf16));
  rows.push_back(mla_verify(128, 64, 4096, 4, 1));
  rows.push_back(mla_verify(128, 64, 4096, 16, 4));
  rows.push_back(mla_mha(prefill(1, 16384, 128), 128, kMlaExtendChunks));
  rows.push_back(mla_mha(extend(8, 4096, 512), 128, kMlaExtendChunks));
  return rows;
}

std::vector<Workload> select_mla_workloads(std::string_view selector) {
  return select_rows(
      selector, mla_workloads(),
      [](const Workload& w, std::string_view item) {
        if (item.substr(0, 4) == "mla-") item.remove_prefix(4);
        return item == "all" || item == "mla" || item == w.name ||
               ("mla-" + std::string(item)) == w.name || item == workload_kind_name(w.kind) ||
               (item == "verify" && is_verify(w.kind));
      },
      "workload",
      "all, mla-decode, mla-verify, mla-verify-chain, mla-verify-tree, mla-prefill, mla-extend",
      "all, a kind, or a row name");
}

std::vector<Workload> select_workloads(std::string_view selector) {
  return select_rows(
      selector, attention_workloads(),
      [](const Workload& w, std::string_view item) {
        if (w.fp8_prefill || (w.kind != WorkloadKind::decode && w.kv_dtype == DType::e4m3))
          return item == w.name || item == "fp8-prefill";
        if (is_long_decode(w)) return item == w.name || item == "long-decode";
        return item == "all" || item == w.name || item == workload_kind_name(w.kind) ||
               (item == "verify" && is_verify(w.kind));
      },
      "workload", "all, decode, prefill, extend, verify, fp8-prefill, long-decode",
      "all, a kind, or a row name");
}

Workload scale_workload(const Workload& w, double factor) {
  return scale_row(w, factor, [&](Workload& s, double f) {
    switch (w.kind) {
      case WorkloadKind::decode:
        s.prefix_len = round_length(w.kv_len() * f) - 1;
        break;
      case WorkloadKind::prefill:
        s.new_tokens = round_length(w.new_tokens * f);
        break;
      case WorkloadKind::extend:
        s.prefix_len = round_length(w.prefix_len * f);
        s.new_tokens = round_length(w.new_tokens * f);
        break;
      case WorkloadKind::verify_chain:
      case WorkloadKind::verify_tree:
        s.prefix_len = round_length(w.prefix_len * f);
        break;
    }
  });
}

Workload with_page_size(const Workload& w, int page_size) {
  ATTNRT_CHECK(page_size >= 1 && page_size <= 4096,
               "page size {}: give 1 to 4096 slots a page (engines use 1, 16, 32, 64 or 128)",
               page_size);
  if (page_size == w.page_size) return w;
  Workload s = w;
  s.page_size = page_size;
  const std::string note = fmt::format("page {} instead of {}", page_size, w.page_size);
  s.scale_note = w.scale_note.empty() ? note : w.scale_note + "; " + note;
  return s;
}

Workload fit_workload(const Workload& w, double max_bytes, double max_work, std::string_view why) {
  auto fits = [&](const Workload& x) {
    return counted_bytes(x) <= max_bytes && attention_work(x) <= max_work;
  };
  if (fits(w)) return w;
  Workload s = w;
  while (!fits(s) && s.batch > 1) s.batch = (s.batch + 1) / 2;
  // Then the lengths: the new tokens of prefill/extend and the cached prefix of the others.
  while (!fits(s)) {
    Workload before = s;
    if (s.kind == WorkloadKind::prefill || s.kind == WorkloadKind::extend) {
      s.new_tokens = halve_length(s.new_tokens);
    }
    if (s.kind != WorkloadKind::prefill) {
      int kv = halve_length(s.kind == WorkloadKind::decode ? s.kv_len() : s.prefix_len);
      s.prefix_len = s.kind == WorkloadKind::decode ? kv - 1 : kv;
    }
    if (s == before) break;  // already at the smallest shape
  }
  s.scale_note = fmt::format("{} from {}", why, w.shape());
  return s;
}

std::vector<std::string> preset_names() { return {"cpu-small"}; }

std::vector<Workload> apply_preset(const std::vector<Workload>& rows, std::string_view preset) {
  if (preset != "cpu-small") {
    fail("unknown --preset '{}': the presets are {}", preset, fmt::join(preset_names(), ", "));
  }
  // Sized for a 2-core box: every decode/verify row reads at most 1.25 GiB of KV (so 16x4096,
  // 64x4096 and both verify rows stay at full size) and every compute-bound row does at most the
  // work of prefill-1x8192, so the whole set runs in minutes.
  constexpr double kMaxBytes = 1.25 * double(1ull << 30);
  constexpr double kMaxWork = 6e11;
  std::vector<Workload> out;
  for (const Workload& w : rows) out.push_back(fit_workload(w, kMaxBytes, kMaxWork, "shrunk by --preset cpu-small"));
  return out;
}

}  // namespace attnrt::bench
