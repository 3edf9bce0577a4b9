// The indexer of DSA layers on the cpu backend (docs/dsa.md): index scores of every query token
// over its candidate keys, and the top-k selection, as per-token key lists the MLA kernels run on.
#pragma once

#include <cstdint>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/memory/index_key_cache.h"
#include "attnrt/model/model_spec.h"
#include "backends/cpu/kernels/attention_plan.h"

namespace attnrt::cpu {

// The step's requests as the cpu plan holds them (keys of request r are slots[r.slot_offset + j],
// j < r.kv_len; verify trees: tree_mask, tree_words as in KernelPlan).
struct DsaStep {
  const std::vector<RequestInfo>* reqs = nullptr;
  const std::vector<int32_t>* slots = nullptr;
  const uint64_t* tree_mask = nullptr;
  int tree_words = 0;
  int num_threads = 1;
};

// The selection of every query token of the step, as one single-query request per token whose
// keys are its selected keys in increasing token index: reqs[row] = {q_row row, qlen 1, kv_len n,
// prefix n - 1} over slots[reqs[row].slot_offset ...]. Writes indexer.topk when given.
struct DsaSelection {
  std::vector<RequestInfo> reqs;
  std::vector<int32_t> slots;
};
void select_dsa_keys(const DsaStep& step, const LayerSpec& layer, const IndexerArgs& indexer,
                     const IndexKeyView& keys, DsaSelection& out);

}  // namespace attnrt::cpu
