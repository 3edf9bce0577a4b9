// What the DCP tests (tests/test_dcp.cpp on host ranks, tests/test_cuda_dcp.cpp on cuda ranks) do
// around a step: the single runtime (the oracle) gives the step's new tokens its slots, keeps a tree
// verify's accepted paths as an engine does, and random accepted paths are drawn.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/runtime/attention_runtime.h"
#include "attnrt/runtime/dcp.h"

namespace attnrt::test {

// Gives `one`'s slots to the step's new tokens (columns prefix .. prefix + query of each row).
inline void place_on(AttentionRuntime& one, ForwardBatch& b) {
  b.out_cache_loc.assign(b.positions.size(), 0);  // the layout checks its length; slots below
  const StepLayout l = make_step_layout(b);
  std::vector<int64_t> last;
  std::vector<int32_t> seq;
  for (int i = 0; i < b.batch_size; ++i) {
    const int32_t p = l.prefix_lens[i];
    last.push_back(p > 0 ? one.req_to_token().get(static_cast<int>(b.req_pool_indices[i]), p - 1)
                         : -1);
    seq.push_back(p + l.query_lens[i]);
  }
  b.out_cache_loc = one.allocator().alloc_extend(l.prefix_lens, seq, last);
  size_t at = 0;
  for (int i = 0; i < b.batch_size; ++i) {
    const auto q = static_cast<size_t>(l.query_lens[i]);
    one.req_to_token().write(static_cast<int>(b.req_pool_indices[i]), l.prefix_lens[i],
                             std::span<const int64_t>(b.out_cache_loc.data() + at, q));
    at += q;
  }
}

// After a tree verify step: both keep the accepted paths (`one` as an engine does: the accepted
// nodes' K/V copied down to columns seq_len + k; the group by commit_verify).
inline void commit_accepted(AttentionRuntime& one, DcpAttention& dcp, const ModelSpec& model,
                            const ForwardBatch& verify,
                            const std::vector<std::vector<int32_t>>& paths) {
  std::vector<std::pair<int64_t, int64_t>> moves;
  for (int i = 0; i < verify.batch_size; ++i) {
    const int row = static_cast<int>(verify.req_pool_indices[i]);
    const int32_t s = verify.seq_lens[i];
    for (size_t k = 1; k < paths[i].size(); ++k) {
      moves.emplace_back(one.req_to_token().get(row, s + paths[i][k]),
                         one.req_to_token().get(row, s + static_cast<int32_t>(k)));
    }
  }
  std::vector<int> layers;
  for (const LayerSpec& l : model.layers) layers.push_back(l.layer_id);
  one.kv_cache().copy_rows(layers, moves);
  dcp.commit_verify(verify, paths);
}

// A random path from the root down `parents` (block indices, root first): each step down stops
// with probability 1/4.
inline std::vector<int32_t> random_path(const int32_t* parents, int n, std::mt19937& rng) {
  std::vector<int32_t> path = {0};
  for (;;) {
    std::vector<int32_t> kids;
    for (int t = 1; t < n; ++t) {
      if (parents[t] == path.back()) kids.push_back(t);
    }
    if (kids.empty() || std::uniform_int_distribution<int>(0, 3)(rng) == 0) return path;
    path.push_back(
        kids[std::uniform_int_distribution<int>(0, static_cast<int>(kids.size()) - 1)(rng)]);
  }
}

}  // namespace attnrt::test
