// The step kinds the DSA tests run (tests/test_dsa.cpp on the host backends, tests/test_cuda_dsa.cpp
// on cuda) and the batch of one: every request's slots allocated from the runtime at once (prefix
// and fresh tokens, the same slots for the same spec) and written to its row; out_cache_loc the
// fresh tokens' slots.
#pragma once

#include <cstdint>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/runtime/attention_runtime.h"

namespace attnrt::test {

enum class Kind { extend, mixed, decode, verify_chain, verify_tree, draft_extend };

struct StepSpec {
  Kind kind = Kind::extend;
  std::vector<int32_t> prefix;  // cached tokens before the step (decode: seq_len - 1)
  std::vector<int32_t> fresh;   // the step's tokens per request
};

// One step of every mode, with prefixes and lengths across pages and the top-k boundaries the
// tests use (both test files run each of them).
struct ModeCase {
  const char* name;
  StepSpec spec;
};

inline const ModeCase kModes[] = {
    {"extend_no_prefix", {Kind::extend, {0, 0}, {40, 23}}},
    {"extend_prefix", {Kind::extend, {37, 64, 3}, {9, 17, 30}}},
    {"chunked_prefill", {Kind::extend, {96}, {33}}},
    {"mixed", {Kind::mixed, {50, 20, 77}, {25, 1, 1}}},
    {"decode", {Kind::decode, {5, 63, 64, 100}, {1, 1, 1, 1}}},
    {"verify_chain", {Kind::verify_chain, {30, 61}, {4, 4}}},
    {"verify_tree", {Kind::verify_tree, {45, 12}, {6, 6}}},
    {"draft_extend", {Kind::draft_extend, {40, 70}, {3, 2}}},
};

// Verify trees: root 0; 1 and 2 its children; 3 child of 1, 4 child of 2; more: child of t - 2.
inline ForwardBatch dsa_step_batch(AttentionRuntime& rt, const StepSpec& spec) {
  const int bs = static_cast<int>(spec.prefix.size());
  std::vector<int64_t> rows, out_loc;
  std::vector<int32_t> lens;
  for (int i = 0; i < bs; ++i) {
    const int row = rt.req_to_token().alloc();
    const int32_t total = spec.prefix[i] + spec.fresh[i];
    const std::vector<int32_t> p{0}, n{total};
    const std::vector<int64_t> last{-1};
    const std::vector<int64_t> slots = rt.allocator().alloc_extend(p, n, last);
    rt.req_to_token().write(row, 0, slots);
    rows.push_back(row);
    out_loc.insert(out_loc.end(), slots.begin() + spec.prefix[i], slots.end());
    lens.push_back(total);
  }
  ForwardBatch b;
  switch (spec.kind) {
    case Kind::extend:
      b = make_extend_batch(rows, spec.prefix, spec.fresh);
      break;
    case Kind::mixed:
      b = make_extend_batch(rows, spec.prefix, spec.fresh, ForwardMode::MIXED);
      break;
    case Kind::decode:
      b = make_decode_batch(rows, lens);
      break;
    case Kind::verify_chain:
      b = make_verify_batch(rows, spec.prefix, SpecInfo::chain(bs, spec.fresh[0]));
      break;
    case Kind::verify_tree: {
      const int n = spec.fresh[0];
      SpecInfo info;
      info.draft_token_num = n;
      info.topk = 2;
      for (int i = 0; i < bs; ++i)
        for (int t = 0; t < n; ++t) info.parents.push_back(t == 0 ? -1 : t <= 2 ? 0 : t - 2);
      b = make_verify_batch(rows, spec.prefix, info);
      break;
    }
    case Kind::draft_extend: {
      std::vector<int32_t> accept;
      for (int32_t f : spec.fresh) accept.push_back(f - 1);
      b = make_draft_extend_batch(rows, lens, accept);
      break;
    }
  }
  b.out_cache_loc = out_loc;
  return b;
}

}  // namespace attnrt::test
