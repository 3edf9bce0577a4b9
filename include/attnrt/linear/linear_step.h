// What every linear-attention backend derives from a step and checks for a layer: which state slot
// each request reads and writes, its query rows, whether it continues a cached prefix, and for
// TARGET_VERIFY the tree (reference-semantics §4.7.3, §8.9.4). Built once per step; shared by every
// linear layer.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/linear_state_pool.h"

namespace attnrt::linear {

struct RequestWork {
  int64_t slot = 0;         // state slot of the request (its request row's binding)
  int64_t token_start = 0;  // first query row of the request in the step
  int32_t tokens = 0;
  // prefix > 0: the recurrence starts from the slot's state and the conv from its window; else
  // from zeros (a fresh request, whatever the slot holds).
  bool has_initial_state = false;
};

struct StepPlan {
  ForwardMode mode = ForwardMode::IDLE;
  int64_t num_tokens = 0;
  int64_t max_tokens = 0;  // longest request of the step
  bool verify = false;     // TARGET_VERIFY: per-token checkpoints, the slots are left unchanged
  int draft_tokens = 0;    // verify: N
  std::vector<RequestWork> reqs;
  std::vector<int32_t> parents;  // verify: [bs * N], parent inside the block, -1 for the root
  std::vector<int64_t> slots;    // [bs] (what the post-verify commit writes)
};

// Throws attnrt::Error (prefixed with `backend`) when a request row has no state slot, or a verify
// step does not fit the pool's checkpoints (no speculative decoding configured, a different N,
// more requests than checkpoint rows).
StepPlan make_step_plan(const ForwardBatch& batch, const LinearStatePool& pool,
                        std::string_view backend);

// Checks one layer's call against the layer's dimensions and the step: every tensor on the host
// (or, with device_tensors, on the host or a CUDA device), of a float dtype, of the documented
// shape (attention_backend.h, LinearArgs). The per-token tensors may be strided in their first
// dimension; the rest must be contiguous.
void check_linear_args(const LinearArgs& args, const LayerSpec& layer, int64_t num_tokens,
                       std::string_view backend, bool device_tensors = false);

}  // namespace attnrt::linear
