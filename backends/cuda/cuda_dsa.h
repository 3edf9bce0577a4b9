// The host plan of the cuda backend's DSA layers (docs/dsa.md; kernels/dsa.h): per query token
// its candidate count and, for the sparse MLA, one single-query pseudo-request over its selected
// slots (kv_len = min(topk, |C(t)|), known from the batch lengths alone) with the split-KV counts
// and the work items of the MLA launch. Plain C++: nothing here reads the GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/dsa.h"

namespace attnrt::cuda {

// What the sparse MLA launch of a DSA layer is: its q heads (one latent KV head), dims, and the
// GPU figures of the split choice.
struct DsaShape {
  int topk = 0;
  int q_heads = 0;
  int head_dim = 0;
  int sm_count = 132;
  int occupancy = 1;  // resident CTAs per SM of the MLA CTA of this shape
  bool deterministic = false;
  // Most scores held at once: tokens are cut into rounds of consecutive rows whose scores fit
  // (a token with more candidates is a round of its own).
  int64_t score_budget = int64_t{1} << 26;
  // A CUDA-graph step (docs/cuda_graphs.md "DSA layers") when > 0: the rounds are cut every
  // graph_round_tokens rows whatever the lengths (the scores buffer holds that many tokens of
  // max_context_len candidates), a round's scored rows start at its first row, and every token
  // gets graph_items work items of the sparse MLA (its split count, or in deterministic mode its
  // own, the items past it empty), so that the captured launches fit every replay.
  int64_t graph_round_tokens = 0;
  int graph_items = 1;
};

// The fixed figures of a DSA graph step of `tokens` tokens (the bucket's), for a pool whose rows
// hold max_context_len keys: tokens per round, items per token of the sparse MLA, and the scores
// buffer's floats.
struct DsaGraphSizes {
  int64_t round_tokens = 0;
  int items = 1;
  int64_t scores = 0;
};
DsaGraphSizes dsa_graph_sizes(const DsaShape& shape, int64_t tokens, int64_t max_context_len);

// Consecutive tokens rows [row0, row1) scored and selected by one launch of launch_dsa_select;
// their scored rows are scored[scored0 .. scored1).
struct DsaRound {
  int64_t row0 = 0, row1 = 0;
  int32_t scored0 = 0, scored1 = 0;
  int32_t max_cand = 0;
  int64_t num_scores = 0;
};

struct DsaHostPlan {
  std::vector<DsaToken> tokens;  // [T]
  std::vector<int32_t> scored;   // rows of the tokens with more than topk candidates
  std::vector<DsaRound> rounds;
  std::vector<int32_t> round_scored;  // per round: its scored tokens (a graph step reads them)
  std::vector<ReqInfo> reqs;  // [T]: token t's pseudo-request (qo_start t, qlen 1)
  std::vector<WorkItem> work;
  int32_t max_cand = 0;    // most candidates of a scored token
  int64_t num_scores = 0;  // most scores of a round
  int64_t part_rows = 0;   // split-KV partial rows
  int max_splits = 1;
  TileShape shape = TileShape::decode;
  int item_rows = 16;
};

// The plan of `batch` (its layout `layout`; `tree`: a TARGET_VERIFY tree, whose candidates are the
// prefix and the ancestors-or-self of spec_info). Token t's pseudo-request reads its slots at
// page-table entries t * topk .. (page size 1). A graph step's layout may hold padded requests
// past batch.batch_size (chains: their token t is at depth t).
void plan_dsa(const ForwardBatch& batch, const StepLayout& layout, bool tree, const DsaShape& shape,
              DsaHostPlan& out);

}  // namespace attnrt::cuda
