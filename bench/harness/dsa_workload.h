// The DSA rows of `attnrt bench --suite dsa` (docs/workloads.md "DSA rows"): one DeepSeek-V3.2
// sparse-attention layer (MLA in the absorbed form with an indexer, docs/dsa.md), its decode step,
// the indexer and the sparse attention of that step measured apart, and its prefill; each beside
// the dense MLA layer of the same shape. Shapes, names, counting rules and shrinking.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "bench/harness/workload.h"

namespace attnrt::bench {

// What a DSA row times.
//   step:   one forward of the DSA layer (index keys stored, index scores, top-k, sparse MLA)
//   index:  the indexer's part of that step: the step's time minus the sparse attention over
//           the same selection, repetition by repetition
//   sparse: the sparse MLA attention alone over a fixed selection (the step's own)
enum class DsaPart : uint8_t { step, index, sparse };
std::string_view dsa_part_name(
    DsaPart p);  // "decode" (a decode step), "prefill", "index", "sparse"

struct DsaWorkload {
  std::string name;  // e.g. "dsa-decode-64x32768"; kept when scaled
  DsaPart part = DsaPart::step;
  bool prefill = false;  // EXTEND of kv_len new tokens, no prefix; else DECODE
  int batch = 1;
  int kv_len = 1;  // keys of each request after the step (decode: the new token included)
  int q_heads = 128;
  int kv_lora_rank = 512;
  int rope_dim = 64;
  int index_heads = 64;
  int index_head_dim = 128;
  int index_topk = 2048;
  int page_size = 64;
  std::string scale_note;

  int new_tokens() const { return prefill ? kv_len : 1; }
  int prefix_len() const { return prefill ? 0 : kv_len - 1; }
  int64_t num_tokens() const { return static_cast<int64_t>(batch) * new_tokens(); }
  int latent_dim() const { return kv_lora_rank + rope_dim; }  // 576 columns per cached token
  // index: memory (bytes of index keys); step and sparse: compute (128 heads, as the MLA rows).
  Bound bound() const;
  // "h128 64x32768 top2048 page 64", prefill "h128 1x32768 causal top2048 page 64".
  std::string shape() const;
  bool operator==(const DsaWorkload&) const = default;
};

// Candidates and selected keys summed over the step's query tokens: decode kv_len per request;
// prefill t + 1 for query t. selected_pairs = sum of min(candidates, index_topk).
double dsa_candidate_pairs(const DsaWorkload& w);
double dsa_selected_pairs(const DsaWorkload& w);
// Bytes of the index-key cache the step reads: (index_head_dim + 4) per candidate key of a
// request, once (132 B per cached token for V3.2).
double dsa_index_bytes(const DsaWorkload& w);
// 2 * index_heads * index_head_dim per (query, candidate) pair.
double dsa_index_flops(const DsaWorkload& w);
// The selected latent rows (576 bf16 columns) once per (query, selected key) pair, plus the bf16
// q (576 per head) read and out (512 per head) written.
double dsa_sparse_bytes(const DsaWorkload& w);
// 2 * q_heads * (576 + 512) per (query, selected key) pair.
double dsa_sparse_flops(const DsaWorkload& w);
// The counted figures of a row: index rows the index part, sparse rows the sparse part, step rows
// both plus the index q (bf16) and weights read.
double dsa_counted_bytes(const DsaWorkload& w);
double dsa_counted_flops(const DsaWorkload& w);

// The dense MLA row of the same shape the DSA row is compared with, in the mla suite's terms:
// decode: mla-decode-h128-BxL (absorbed, page 64, bf16); prefill: the MHA form
// mla-prefill-BxS (dense_absorbed: the absorbed-form prefill of the same shape instead).
Workload dsa_dense_companion(const DsaWorkload& w, bool dense_absorbed = false);

// The target of the row (docs/workloads.md "DSA rows"), for the report: step decode rows their
// time over the dense decode's (<= 0.35 up to 32768 keys, <= 0.15 beyond), index rows % of the
// memory ceiling (>= 80), sparse rows their per-token rate over the dense decode's in % (>= 80),
// prefill rows the dense prefill's time over theirs (>= 2).
struct DsaTarget {
  double value = 0;
  bool at_most = false;  // the figure must be <= value (else >= value)
};
DsaTarget dsa_target(const DsaWorkload& w);

// dsa-decode-64x32768, dsa-index-64x32768, dsa-sparse-64x32768, the same for 16x131072, then
// dsa-prefill-1x32768 (DeepSeek-V3.2: 128 q heads, latent 512 + 64, index 64 heads x 128,
// index_topk 2048, page 64).
std::vector<DsaWorkload> dsa_workloads();
// "all", a row name, a part with or without the "dsa-" prefix (decode, index, sparse, prefill),
// or a comma-separated list. Throws attnrt::Error naming the unknown entry and the valid names.
std::vector<DsaWorkload> select_dsa_workloads(std::string_view selector);
bool is_dsa_selector(std::string_view item);

// Batch and lengths times `factor` in (0, 1]; index_topk scales with the lengths (at least 16),
// so a scaled row still selects the same share of its keys.
DsaWorkload scale_dsa_workload(const DsaWorkload& w, double factor);
// "cpu-small": the batch halved, then the lengths (and index_topk with them), until the dense
// companion does <= 2e10 FLOPs (absorbed decode; MHA-form prefill) and reads <= 1.25 GiB.
std::vector<DsaWorkload> apply_dsa_preset(const std::vector<DsaWorkload>& rows,
                                          std::string_view preset);

}  // namespace attnrt::bench
