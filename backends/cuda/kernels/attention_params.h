// Plain-old-data shared by the host plan (g++) and the kernels (nvcc): the per-step metadata layout
// and the per-launch parameters. No CUDA types, so host code can fill and log it.
#pragma once

#include <cstdint>

namespace attnrt::cuda {

// CTA shapes of the attention kernel. `decode`: 16 query rows, warps split every K/V tile (one or a
// few query tokens per request); `decode32`: 32 rows as two decode row groups sharing each K/V
// tile (a chain verify block or short extend); `verify`: 64 query rows (a tree verify block or
// short extend); `prefill`: 128 query rows, one 16-row slice per warp. `decode32` and `verify` hold
// every row of a request and KV head in one CTA, so the K/V is read once.
enum class TileShape : int32_t { decode = 0, prefill = 1, verify = 2, decode32 = 3 };
constexpr int kNumTileShapes = 4;
constexpr int tile_rows(TileShape shape) {
  return shape == TileShape::decode     ? 16
         : shape == TileShape::decode32 ? 32
         : shape == TileShape::verify   ? 64
                                        : 128;
}

// One request of the step, in the layout every kernel reads (reference-semantics §2.2 reduced to
// "prefix keys already cached, query tokens appended after them").
struct ReqInfo {
  int32_t qo_start;    // first query row of the request in q/out
  int32_t qlen;        // query tokens of the request this step
  int32_t prefix;      // keys cached before this step's tokens
  int32_t kv_len;      // keys visible to the last query: prefix + qlen
  int32_t pt_start;    // offset of the request's page table in the step's page-table array
  int32_t num_splits;  // split-KV count (1 = the attention kernel writes the output itself)
  int32_t part_start;  // first partial row: rows part_start + s * qlen + t hold split s of token t
  int32_t tree_start;  // offset of the request's tree mask / depths (tree verify), -1 otherwise
  // Incremental page tables. Page ids of committed tokens (pages wholly below the prefix) live in a
  // persistent per-row table on the device; a step uploads only the others. Page `j` of the request
  // is row_table[pt_row + j] for j < pt_known, else page_table[pt_start + j - pt_known]. The
  // attention kernel stores pages [pt_known, pt_commit) back into the row table (they become
  // committed with this step). pt_known = pt_commit = 0: the whole page table is in the step's
  // array, as kernels that ignore these fields expect.
  int32_t pt_row;
  int32_t pt_known;
  int32_t pt_commit;
  int32_t pad;
};

// One CTA's work: `rows` flattened (token, head-in-group) rows starting at f0 of request `req`,
// keys of split `split` (the key range of a split is derived on the device from the lengths, so a
// captured graph stays valid when the lengths change). `kvh`: the item's KV head where the launch
// has one unit per item (AttnParams::item_heads), else unused (every item runs on every KV head).
struct WorkItem {
  int32_t req;
  int32_t f0;
  int32_t split;
  int32_t kvh;
};

enum class KvKind : int32_t { same_as_q = 0, e4m3 = 1, e5m2 = 2 };

struct AttnParams {
  // Activations: q [T, Hq, D], out [T, Hq, Dv]; element strides of the token and head dims.
  const void* q;
  void* out;
  int64_t q_stride_tok, q_stride_head;
  int64_t o_stride_tok, o_stride_head;
  float* lse_out;  // optional [T, Hq] (natural log), stride lse_stride_tok
  int64_t lse_stride_tok;

  // Paged KV of the layer: row `slot` of K at k + slot * k_row_stride (elements of the storage
  // type), kv heads adjacent inside a row.
  const void* k;
  const void* v;
  int64_t k_row_stride, v_row_stride;
  KvKind kv_kind;
  int32_t page_shift;  // log2(page_size)
  // Full-pool slot -> this pool's slot (SWA pools); nullptr = identity.
  const int64_t* slot_map;
  // Rows (slots) of the K and V storage: the extent of the tensor maps of the prefill CTA's TMA
  // producer; 0 = not known (that producer is not used).
  int64_t kv_rows;

  // Step metadata (device).
  const ReqInfo* reqs;
  const int32_t* page_table;    // page ids uploaded this step (see ReqInfo)
  int32_t* row_table;           // persistent per-row page ids (see ReqInfo), nullptr = none
  const WorkItem* work;
  const uint64_t* tree_mask;    // per tree query token: bit u = draft u visible
  const int32_t* tree_depth;    // per tree query token: depth in its tree (root 0)

  // Split-KV partials: [rows, Hq, Dv] fp32 and [rows, Hq] lse (log2 domain).
  float* part_o;
  float* part_lse;

  int32_t num_q_heads, num_kv_heads, group;  // group = Hq / Hkv
  float scale_log2;     // softmax scale * k_scale * log2(e)
  float softcap;        // 0 = off; applied to the scaled logit in natural units
  float softmax_scale;  // softmax scale * k_scale (natural units, used with softcap)
  float v_scale;
  int32_t window;       // -1 = off; key j visible to query i iff 0 <= i - j <= window
  int32_t causal;       // 0 = every key of the request is visible
  int32_t tree;         // 1 = TARGET_VERIFY tree: drafts visible through tree_mask
  // Most (token, head-in-group) rows a work item holds (max query length x group, at most the
  // shape's rows): the decode shape takes a narrower CTA when they fit in 8.
  int32_t item_rows;
  const float* sinks;   // [Hq] sink logits (natural), nullptr = none
  // Two zeroed words for kernels that hand out work dynamically (the warp-specialised prefill):
  // the next ticket and the CTAs done; the last CTA to finish zeroes both again.
  int32_t* sched;
  // The warp-specialised prefill CTA: 1 = each work item names its KV head (WorkItem::kvh) and the
  // launch has one unit per item, so that the plan orders (item, head) units itself (the MHA form
  // groups the heads whose K/V fit in the L2); 0 = every item on every KV head.
  int32_t item_heads;
  // The warp-specialised prefill CTA: 1 = key j of a request is row pt_start + j of K / V (the
  // MHA form's contiguous tensors; no page table read), page_shift = log2 of the tile's keys.
  int32_t kv_ragged;
  // The 128-row prefill CTAs' epilogue: 1 = out / lse_out (natural log, required) hold a running
  // result that this launch's rows are merged into by log-sum-exp (the MHA form's prefix chunks);
  // a row without keys leaves it as it was.
  int32_t merge_out;
  // Rows of the q tensor (the extent of the warp-specialised prefill CTA's Q tensor map, whose
  // boxes read zeros past it); 0 = not known (Q comes by cp.async).
  int64_t q_rows;
};

struct MergeParams {
  const ReqInfo* reqs;
  int32_t num_reqs;
  const float* part_o;
  const float* part_lse;
  void* out;
  int64_t o_stride_tok, o_stride_head;
  float* lse_out;
  int64_t lse_stride_tok;
  int32_t num_q_heads, head_dim;
  float v_scale;
  const float* sinks;
  // The most splits of any request (launch_merge slices the head dims so that no thread walks more
  // than kMergeWalk of them).
  int32_t max_splits;
};

}  // namespace attnrt::cuda
