#include "backends/cpu/dsa_select.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>

#include "attnrt/backend/dsa.h"
#include "backends/cpu/kernels/dsa_score.h"
#include "hwy/aligned_allocator.h"

namespace attnrt::cpu {

namespace {

// Consecutive query tokens of a chain request (prefill, extend, chain verify) scored together:
// token t's candidates are a prefix of token t + 1's, so one pass over the block's last candidate
// list serves all of them and each key block is dequantised once per block, not per token.
constexpr int kChainBlock = 4;
// Candidates per work item: a query block's keys are split into items of this many, so that one or
// two tokens with long candidate lists (decode at 32k-64k keys) still keep every thread busy.
constexpr int64_t kItemKeys = 1536;
// Scores and queries held at once: the query tokens of a step are scored in rounds of about this
// many bytes (a long prefill has tokens x keys scores).
constexpr int64_t kRoundBytes = int64_t{64} << 20;

// Query tokens [t0, t1) of request `req` scored over the same candidates, the first n of `slots`;
// candidate m is token index m of the request (chain), or (*cand)[m] (the one token of a tree
// block).
struct QueryBlock {
  int32_t req = 0;
  int32_t t0 = 0, t1 = 0;
  int64_t n = 0;
  const int32_t* slots = nullptr;
  const std::vector<int32_t>* cand = nullptr;
  int64_t token = 0;  // its first token in the round's queries
  int64_t score = 0;  // its first score in the round's scores (t1 - t0 rows of n)
};

// The candidate keys of tree draft t of request r (token indices, increasing): the prefix and the
// query's ancestors-or-self.
void tree_candidates(const DsaStep& step, const RequestInfo& r, int32_t t,
                     std::vector<int32_t>& out) {
  out.clear();
  for (int32_t j = 0; j < r.prefix; ++j) out.push_back(j);
  const uint64_t* bits = step.tree_mask + static_cast<size_t>(r.tree + t) * step.tree_words;
  for (int32_t u = 0; u < r.qlen; ++u) {
    if ((bits[u / 64] >> (u % 64)) & 1u) out.push_back(r.prefix + u);
  }
}

int64_t tree_count(const DsaStep& step, const RequestInfo& r, int32_t t) {
  const uint64_t* bits = step.tree_mask + static_cast<size_t>(r.tree + t) * step.tree_words;
  int64_t n = r.prefix;
  for (int w = 0; w < step.tree_words; ++w) n += std::popcount(bits[w]);
  return n;
}

// The topk candidates of one token that rank first (dsa_ranks_before), as increasing token
// indices. `index(m)` is candidate m's token index, increasing in m.
template <class Index>
void select_top(const double* scores, int64_t n, int topk, const Index& index,
                std::vector<int32_t>& order, std::vector<int32_t>& sel) {
  order.resize(static_cast<size_t>(n));
  for (int64_t m = 0; m < n; ++m) order[m] = static_cast<int32_t>(m);
  // Candidates are in increasing token index, so comparing positions applies the tie rule.
  std::nth_element(
      order.begin(), order.begin() + (topk - 1), order.end(),
      [&](int32_t a, int32_t b) { return dsa_ranks_before(scores[a], a, scores[b], b); });
  sel.resize(static_cast<size_t>(topk));
  for (int m = 0; m < topk; ++m) sel[m] = index(order[m]);
  std::sort(sel.begin(), sel.end());
}

}  // namespace

void select_dsa_keys(const DsaStep& step, const LayerSpec& layer, const IndexerArgs& indexer,
                     const IndexKeyView& keys, DsaSelection& out) {
  const std::vector<RequestInfo>& reqs = *step.reqs;
  const std::vector<int32_t>& slots = *step.slots;
  const IndexerSpec& ix = layer.indexer;
  const int di = ix.index_head_dim, hi = ix.index_n_heads, topk = ix.index_topk;
  const int hp = (hi + kDsaHeadAlign - 1) / kDsaHeadAlign * kDsaHeadAlign;
  int64_t tokens = 0;
  for (const RequestInfo& r : reqs) tokens = std::max(tokens, r.q_row + r.qlen);
  std::vector<std::vector<int32_t>> chosen(static_cast<size_t>(tokens));
  const double c = index_score_scale(layer);

  // Tokens with at most topk candidates select them all, unscored; the others form query blocks.
  std::vector<QueryBlock> blocks;
  std::vector<std::vector<int32_t>> tree_cand(static_cast<size_t>(tokens));
  std::vector<std::vector<int32_t>> tree_slots(static_cast<size_t>(tokens));
  for (size_t i = 0; i < reqs.size(); ++i) {
    const RequestInfo& r = reqs[i];
    const int32_t* rs = slots.data() + r.slot_offset;
    const auto req = static_cast<int32_t>(i);
    for (int32_t t = 0; t < r.qlen; ++t) {
      const auto row = static_cast<size_t>(r.q_row + t);
      if (r.tree < 0) {
        const int32_t n = r.prefix + t + 1;
        if (n <= topk) {
          chosen[row].resize(static_cast<size_t>(n));
          for (int32_t j = 0; j < n; ++j) chosen[row][j] = j;
        } else if (!blocks.empty() && blocks.back().req == req && blocks.back().cand == nullptr &&
                   blocks.back().t1 == t && blocks.back().t1 - blocks.back().t0 < kChainBlock) {
          blocks.back().t1 = t + 1;
          blocks.back().n = n;
        } else {
          blocks.push_back({.req = req, .t0 = t, .t1 = t + 1, .n = n, .slots = rs});
        }
        continue;
      }
      if (tree_count(step, r, t) <= topk) {
        tree_candidates(step, r, t, chosen[row]);
        continue;
      }
      std::vector<int32_t>& cand = tree_cand[row];
      std::vector<int32_t>& cs = tree_slots[row];
      tree_candidates(step, r, t, cand);
      cs.resize(cand.size());
      for (size_t m = 0; m < cand.size(); ++m) cs[m] = rs[cand[m]];
      blocks.push_back({.req = req,
                        .t0 = t,
                        .t1 = t + 1,
                        .n = static_cast<int64_t>(cand.size()),
                        .slots = cs.data(),
                        .cand = &cand});
    }
  }

  const TensorView& q = indexer.q;
  const TensorView& wt = indexer.weights;
  const size_t q_token = static_cast<size_t>(di) * hp;
  hwy::AlignedFreeUniquePtr<float[]> qbuf;
  std::vector<double> wbuf, scores;
  // (block, first candidate) of every work item of a round; the round's tokens as (block, token).
  std::vector<std::pair<int32_t, int64_t>> items;
  std::vector<std::pair<int32_t, int32_t>> round_tokens;
  for (size_t b0 = 0; b0 < blocks.size();) {
    // The round: blocks [b0, b1) within kRoundBytes (at least one).
    size_t b1 = b0;
    int64_t ntok = 0, nscore = 0, bytes = 0;
    items.clear();
    round_tokens.clear();
    while (b1 < blocks.size()) {
      QueryBlock& blk = blocks[b1];
      const int64_t bt = blk.t1 - blk.t0;
      const int64_t more = bt * (blk.n * 8 + static_cast<int64_t>(q_token) * 4 + hp * 8);
      if (b1 > b0 && bytes + more > kRoundBytes) break;
      bytes += more;
      blk.token = ntok;
      blk.score = nscore;
      for (int32_t t = blk.t0; t < blk.t1; ++t) {
        round_tokens.emplace_back(static_cast<int32_t>(b1), t);
      }
      for (int64_t m = 0; m < blk.n; m += kItemKeys)
        items.emplace_back(static_cast<int32_t>(b1), m);
      ntok += bt;
      nscore += bt * blk.n;
      ++b1;
    }
    qbuf = hwy::AllocateAligned<float>(static_cast<size_t>(ntok) * q_token);
    wbuf.assign(static_cast<size_t>(ntok) * hp, 0.0);
    scores.resize(static_cast<size_t>(nscore));

#pragma omp parallel num_threads(step.num_threads)
    {
      std::vector<float> qf;
      std::vector<int32_t> order;
      // The rounded queries, transposed to [dim][heads], and the weights.
#pragma omp for schedule(static)
      for (size_t n = 0; n < round_tokens.size(); ++n) {
        const QueryBlock& blk = blocks[round_tokens[n].first];
        const int64_t row = reqs[blk.req].q_row + round_tokens[n].second;
        float* qt = qbuf.get() + n * q_token;
        if (hp > hi) std::fill(qt, qt + q_token, 0.f);
        if (q.dtype == DType::f32 && q.strides[2] == 1) {
          dsa_round_queries(q.ptr<float>() + row * q.strides[0], q.strides[1], hi, di, qt, hp);
        } else {
          qf.resize(static_cast<size_t>(hi) * di);
          for (int h = 0; h < hi; ++h) {
            for (int d = 0; d < di; ++d) {
              qf[static_cast<size_t>(h) * di + d] = load_as_float(
                  q.data, q.dtype,
                  static_cast<size_t>(row * q.strides[0] + h * q.strides[1] + d * q.strides[2]));
            }
          }
          dsa_round_queries(qf.data(), di, hi, di, qt, hp);
        }
        for (int h = 0; h < hi; ++h) {
          wbuf[n * hp + h] = load_as_float(
              wt.data, wt.dtype, static_cast<size_t>(row * wt.strides[0] + h * wt.strides[1]));
        }
      }
      // The scores, block by block and kItemKeys candidates at a time.
#pragma omp for schedule(dynamic, 1)
      for (size_t n = 0; n < items.size(); ++n) {
        const QueryBlock& blk = blocks[items[n].first];
        const int64_t m0 = items[n].second;
        const DsaQueries dq{.q = qbuf.get() + blk.token * q_token,
                            .w = wbuf.data() + blk.token * hp,
                            .tokens = blk.t1 - blk.t0,
                            .heads = hp,
                            .dim = di};
        dsa_index_scores(dq, keys, blk.slots + m0, std::min(kItemKeys, blk.n - m0), c,
                         scores.data() + blk.score + m0, blk.n);
      }
      // The selection of each token: its own candidates are the first n of the block's.
#pragma omp for schedule(dynamic, 4)
      for (size_t n = 0; n < round_tokens.size(); ++n) {
        const QueryBlock& blk = blocks[round_tokens[n].first];
        const int32_t t = round_tokens[n].second;
        const RequestInfo& r = reqs[blk.req];
        const int64_t k = t - blk.t0;
        const double* s = scores.data() + blk.score + k * blk.n;
        std::vector<int32_t>& sel = chosen[static_cast<size_t>(r.q_row + t)];
        if (blk.cand == nullptr) {
          select_top(
              s, r.prefix + t + 1, topk, [](int32_t m) { return m; }, order, sel);
        } else {
          const std::vector<int32_t>& cand = *blk.cand;
          select_top(
              s, blk.n, topk, [&](int32_t m) { return cand[m]; }, order, sel);
        }
      }
    }
    b0 = b1;
  }

  out.reqs.assign(static_cast<size_t>(tokens), RequestInfo{});
  out.slots.clear();
  for (const RequestInfo& r : reqs) {
    for (int32_t t = 0; t < r.qlen; ++t) {
      const int64_t row = r.q_row + t;
      const std::vector<int32_t>& sel = chosen[static_cast<size_t>(row)];
      const auto n = static_cast<int32_t>(sel.size());
      out.reqs[row] = RequestInfo{.q_row = row,
                                  .slot_offset = static_cast<int64_t>(out.slots.size()),
                                  .prefix = n - 1,
                                  .qlen = 1,
                                  .kv_len = n};
      for (int32_t j : sel) out.slots.push_back((*step.slots)[r.slot_offset + j]);
      if (!indexer.topk.empty()) {
        const TensorView& o = indexer.topk;
        int32_t* dst = o.ptr<int32_t>() + row * o.strides[0];
        for (int32_t k = 0; k < topk; ++k) dst[k * o.strides[1]] = k < n ? sel[k] : -1;
      }
    }
  }
}

}  // namespace attnrt::cpu
