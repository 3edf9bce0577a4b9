// Conformance cases of the linear-attention layers (Gated DeltaNet, Mamba2, KDA): one random step
// of one layer, run on a backend's linear side and on `reference`'s over pools of their own that
// start from the same random recurrent states; the outputs and the states after the step (after the
// verify commit for TARGET_VERIFY) are compared.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/model/model_spec.h"

namespace attnrt::conformance {

struct CaseResult;

struct LinearCase {
  uint64_t seed = 0;                             // the values: parameters, inputs, initial states
  LayerSpec layer;                               // gdn, mamba2 or kda, small ragged dims
  ForwardMode mode = ForwardMode::EXTEND;        // EXTEND, MIXED, DECODE or TARGET_VERIFY
  std::vector<int32_t> prefix_lens, query_lens;  // tokens before the step (0: no state yet), now
  SpecInfo spec;                                 // TARGET_VERIFY: the draft tree of every request
  std::vector<int32_t> accepted;                 // TARGET_VERIFY: last accepted block index, -1
  std::string describe() const;
};

// A random case of a layer of `kind` in a mode the linear backends serve.
LinearCase random_linear_case(std::mt19937_64& rng, LayerKind kind);

// Runs the case on `entry`'s linear side and on reference's; compares outputs and final states.
CaseResult run_linear_case(const BackendEntry& entry, const LinearCase& c,
                           const Registry& registry);

}  // namespace attnrt::conformance
