// ForwardBatch and SpecInfo: the per-step batch description an engine hands to attnrt
// (reference-semantics §2). Host-side vectors; a GPU backend uploads what it needs in its plan.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attnrt/batch/forward_mode.h"

namespace attnrt {

// Speculative payload for TARGET_VERIFY (and the accepted lengths for DRAFT_EXTEND).
struct SpecInfo {
  int draft_token_num = 0;  // N: tokens per request in a verify block, the root included
  int topk = 1;             // 1 = chain, > 1 = tree
  // Verify: parent of every block token inside its block, request-major [bs * N]; the root (index 0)
  // has parent -1, a parent always precedes its children. A chain has parent[t] = t - 1.
  std::vector<int32_t> parents;
  // DRAFT_EXTEND: accepted drafts per request (excluding root/bonus): ext = accept_length + 1.
  std::vector<int32_t> accept_length;

  static SpecInfo chain(int batch_size, int num_draft_tokens);
  // From the first-child / next-sibling form the draft stage produces ([bs, N] each, -1 = none).
  static SpecInfo from_retrive(int batch_size, int num_draft_tokens, int topk,
                               const std::vector<int32_t>& next_token,
                               const std::vector<int32_t>& next_sibling);

  bool is_chain() const { return topk <= 1; }
  // Depth of block token t of request r (root = 0).
  int depth(int request, int t) const;
  // True when draft u is t itself or an ancestor of t (same request).
  bool visible(int request, int t, int u) const;
  // FULL mask encoding (§8.4.3): per request row-major [N, seq_len + N], prefix columns true.
  std::vector<uint8_t> full_mask(const std::vector<int32_t>& seq_lens) const;
};

struct ForwardBatch {
  ForwardMode mode = ForwardMode::IDLE;
  int batch_size = 0;
  std::vector<int64_t> req_pool_indices;   // [bs] rows in ReqToTokenPool
  std::vector<int32_t> seq_lens;           // [bs] mode-dependent meaning (§2.2)
  std::vector<int32_t> extend_prefix_lens; // [bs] extend-like modes
  std::vector<int32_t> extend_seq_lens;    // [bs] extend-like modes (DECODE: empty or all 1)
  std::vector<int32_t> extend_start_loc;   // [bs] exclusive prefix sum of extend_seq_lens
  std::vector<int64_t> out_cache_loc;      // [T] full-pool slot of each query token's K/V
  std::vector<int64_t> positions;          // [T]
  std::optional<SpecInfo> spec_info;
  // A rank's batch under decode context parallelism (docs/dcp.md; DECODE): a row whose
  // out_cache_loc is the dummy slot 0 is a query that is not a key of this rank; it attends
  // req_to_token[row, 0 : seq_len) as written, without its own token. Every other row still has
  // its own slot as the last key of its row.
  bool dcp_partial = false;

  int64_t num_tokens() const { return static_cast<int64_t>(out_cache_loc.size()); }
  int64_t seq_lens_sum() const;
};

// The mode-independent layout every backend works from: for request i, `prefix_lens[i]` keys are
// already in the cache, `query_lens[i]` new tokens are this step's queries (rows
// query_start[i] .. query_start[i+1]), and the keys a query can see lie in
// req_to_token[row, 0 : prefix + query_len).
struct StepLayout {
  std::vector<int32_t> prefix_lens;
  std::vector<int32_t> query_lens;
  std::vector<int64_t> query_start;  // [bs + 1]
  int64_t num_tokens = 0;
  int32_t max_query_len = 0;
  int32_t max_kv_len = 0;
  int32_t kv_len(int i) const { return prefix_lens[i] + query_lens[i]; }
};

// Derives the layout from the mode's conventions (§2.2). Throws attnrt::Error when the batch is
// inconsistent (sizes, negative lengths, start offsets, positions vs. mode, verify without spec_info).
StepLayout make_step_layout(const ForwardBatch& batch);
// The same into an existing layout, whose vectors keep their capacity (no allocation per step).
void make_step_layout(const ForwardBatch& batch, StepLayout& layout);

// Convenience builders used by engines, tests and the CLI. They fill every field consistently;
// out_cache_loc is left for the caller (it comes from the allocator).
ForwardBatch make_extend_batch(const std::vector<int64_t>& req_rows,
                               const std::vector<int32_t>& prefix_lens,
                               const std::vector<int32_t>& extend_lens,
                               ForwardMode mode = ForwardMode::EXTEND);
ForwardBatch make_decode_batch(const std::vector<int64_t>& req_rows,
                               const std::vector<int32_t>& seq_lens_including_new);
ForwardBatch make_verify_batch(const std::vector<int64_t>& req_rows,
                               const std::vector<int32_t>& seq_lens_before_drafts, SpecInfo spec);
ForwardBatch make_draft_extend_batch(const std::vector<int64_t>& req_rows,
                                     const std::vector<int32_t>& seq_lens_after_accept,
                                     const std::vector<int32_t>& accept_lengths);
// DRAFT_EXTEND_V2: every request padded to `width` re-run tokens; seq_lens include them.
ForwardBatch make_draft_extend_v2_batch(const std::vector<int64_t>& req_rows,
                                        const std::vector<int32_t>& seq_lens, int width);
ForwardBatch make_idle_batch();

}  // namespace attnrt
