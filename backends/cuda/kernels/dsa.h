// DSA's indexer on the GPU (kernels/dsa.cu; docs/dsa.md): the index scores of every query token
// over its candidate keys, read from the paged fp8 index-key cache, and the top-k selection,
// written as the slot list of each token that the sparse MLA launch reads as a page table of page
// size 1. Plain-old-data: the host plan (cuda_dsa.cpp) fills it without CUDA types.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backends/cuda/kernels/attention_params.h"

namespace attnrt::cuda {

// Limits of the index dims the kernels take (V3.2: 64 heads of 128).
inline constexpr int kDsaMaxIndexDim = 128;
inline constexpr int kDsaMaxIndexHeads = 64;

// One query token of the step.
struct DsaToken {
  int32_t req;       // its request in DsaParams::reqs (prefix, page table, tree mask)
  int32_t t;         // its index among the request's query tokens
  int32_t num_cand;  // |C(t)|: candidates, in increasing token index (docs/dsa.md "Modes")
  int32_t pad;
  int64_t score_off;  // its first score in DsaParams::scores (from its round's start); -1 = not
                      // scored (|C(t)| <= topk)
};

struct DsaParams {
  // The step plan's requests, page ids (ReqInfo's incremental tables) and tree masks.
  const ReqInfo* reqs;
  const int32_t* page_table;
  const int32_t* row_table;
  const uint64_t* tree_mask;  // per query row: bit u = draft u is the row or an ancestor
  int32_t page_shift;
  int32_t tree;  // 1 = a TARGET_VERIFY tree: candidates are the prefix and the ancestors-or-self

  // The launch's tokens: rows row0 .. row0 + num_tokens - 1 of `tokens` (one round of the plan,
  // whose scores fit the scores buffer together).
  const DsaToken* tokens;
  int64_t row0, num_tokens;
  const int32_t* scored;  // rows of the round's tokens with more than topk candidates
  int32_t num_scored;
  int32_t max_cand;  // most candidates of a scored token of the round
  // A CUDA-graph step (docs/cuda_graphs.md "DSA layers"): the round's scored-token count on the
  // device, rewritten by each replay's plan. num_scored and max_cand are then the bucket's bounds
  // (the round's tokens, max_context_len), which fix the grids: score CTAs past the count, or past
  // a token's candidates, return at once. Null in an eager step.
  const int32_t* num_scored_dev;
  // A graph step's plan counts its commits as stored (cuda_plan.h, incremental page tables): the
  // select CTA of each request's first query token stores the request's pages [pt_known,
  // pt_commit) into this row table (the one row_table reads; nothing in the step reads those
  // entries there). Null: no write-back (eager steps, whose plans do not count DSA launches).
  int32_t* row_table_out;

  // Indexer inputs (dtype codes of convert.cuh: f32, f16, bf16; element strides).
  const void* q;  // [T, heads, dim]
  int32_t q_dtype;
  int64_t q_s0, q_s1, q_s2;
  const void* w;  // [T, heads]
  int32_t w_dtype;
  int64_t w_s0, w_s1;
  int32_t heads, dim;
  double score_scale;  // index_n_heads^-1/2 * index_head_dim^-1/2

  // The index-key cache: pages of key_page slots, [key_page * dim codes | key_page fp32 scales].
  const uint8_t* keys;
  int32_t key_page;

  float* scores;  // per scored token: its candidates' scores from DsaToken::score_off
  int32_t topk;
  int32_t* sel_slots;  // [num_tokens, topk]: the selected slots, increasing token index
  int32_t* topk_out;   // optional int32 [num_tokens, topk]: token indices, -1 after the last
  int64_t topk_s0, topk_s1;
};

// Which kernel scores the candidates: the CUDA-core kernel (the default) or the tensor-core one
// (bf16 m16n8k16 MMAs on the fp8 codes, fp32 accumulation, the power-of-two scales applied after
// the dot: the same products, only the fp32 summation order differs). ATTNRT_DSA_INDEXER=mma or
// =cuda_core in the environment, read once at the first launch unless set_dsa_indexer chose
// first. The tensor-core kernel takes index heads and head dims that are multiples of 16
// (dsa_mma_takes); other shapes run on CUDA cores whatever the choice.
enum class DsaIndexer { cuda_core, mma };
DsaIndexer dsa_indexer();
void set_dsa_indexer(DsaIndexer k);
bool dsa_mma_takes(int heads, int dim);

// Scores the round's scored tokens' candidates, then selects for each of its tokens (every
// candidate when at most topk), and writes sel_slots (and topk_out). Both kernels on `stream`.
// The grids depend on num_tokens, num_scored and max_cand only; with num_scored_dev set they are
// capped (a score CTA then loops over every gridDim.y-th group of candidate tiles), so a graph's
// launch is fixed by the bucket.
cudaError_t launch_dsa_select(const DsaParams& p, cudaStream_t stream);

}  // namespace attnrt::cuda
