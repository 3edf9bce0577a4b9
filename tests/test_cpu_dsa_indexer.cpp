// The cpu backend's DSA indexer (backends/cpu/dsa_select.cpp, kernels/dsa_score.cc): the blocked
// index scores against a float64 evaluation of the same math (docs/dsa.md "The index score") on
// fresh random inputs, and the selection of every query token against a full sort of those scores
// by the tie rule, for chain (decode, prefill over a prefix) and tree candidates.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/dsa.h"
#include "attnrt/memory/index_key_cache.h"
#include "backends/cpu/dsa_select.h"
#include "backends/cpu/kernels/dsa_score.h"

namespace attnrt {
namespace {

// An index-key cache of `rows` random keys (fresh values every run, never zero), paged.
struct Keys {
  std::vector<uint8_t> data;
  IndexKeyView view;

  Keys(int64_t rows, int dim, int page, std::mt19937& rng) {
    const int64_t pages = (rows + page - 1) / page;
    data.resize(static_cast<size_t>(pages * page * (dim + 4)));
    view = {.data = data.data(), .num_rows = pages * page, .page_size = page, .dim = dim};
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> mag(0.05f, 20.f);
    std::vector<float> x(dim);
    for (int64_t s = 0; s < view.num_rows; ++s) {
      const float m = mag(rng);
      for (float& v : x) v = nd(rng) * m;
      set(s, x.data());
    }
  }
  void set(int64_t slot, const float* x) {
    const float scale = quantize_fp8_block(x, view.dim, view.codes(slot));
    std::memcpy(const_cast<uint8_t*>(view.scale_ptr(slot)), &scale, sizeof scale);
  }
  void copy(int64_t from, int64_t to) {
    std::memcpy(view.codes(to), view.codes(from), static_cast<size_t>(view.dim));
    std::memcpy(const_cast<uint8_t*>(view.scale_ptr(to)), view.scale_ptr(from), 4);
  }
  double value(int64_t slot, int d) const {
    return static_cast<double>(e4m3_to_float(view.codes(slot)[d])) * view.scale(slot);
  }
};

// Random index queries [T, heads, dim] and weights [T, heads] (weights of both signs).
struct Queries {
  std::vector<float> q, w;
  Queries(int64_t tokens, int heads, int dim, std::mt19937& rng)
      : q(static_cast<size_t>(tokens * heads * dim)), w(static_cast<size_t>(tokens * heads)) {
    std::normal_distribution<float> nd;
    for (float& v : q) v = nd(rng) * 3.f;
    for (float& v : w) v = nd(rng);
  }
};

// The float64 scores of the same math: rounded queries, dequantised keys, relu, weighted sum.
// `bound` gets, per score, c * sum_h |w| * sum_d |q k|: what fp32 rounding in the dots scales with.
void float64_scores(const Queries& qs, int64_t t, int heads, int dim, const Keys& keys,
                    const std::vector<int32_t>& slots, double c, std::vector<double>& score,
                    std::vector<double>& bound) {
  std::vector<float> qr(static_cast<size_t>(heads) * dim);
  for (int h = 0; h < heads; ++h) {
    round_index_query(qs.q.data() + (t * heads + h) * dim, dim, qr.data() + h * dim);
  }
  score.assign(slots.size(), 0.0);
  bound.assign(slots.size(), 0.0);
  for (size_t m = 0; m < slots.size(); ++m) {
    for (int h = 0; h < heads; ++h) {
      double dot = 0.0, mag = 0.0;
      for (int d = 0; d < dim; ++d) {
        const double p = static_cast<double>(qr[h * dim + d]) * keys.value(slots[m], d);
        dot += p;
        mag += std::fabs(p);
      }
      const double w = qs.w[t * heads + h];
      score[m] += w * std::max(dot, 0.0);
      bound[m] += std::fabs(w) * mag;
    }
    score[m] *= c;
    bound[m] *= c;
  }
}

// The kernel's scores of token t over `slots`, through its own layout (padded, transposed).
std::vector<double> kernel_scores(const Queries& qs, int64_t t, int heads, int dim,
                                  const Keys& keys, const std::vector<int32_t>& slots, double c) {
  const int hp = (heads + cpu::kDsaHeadAlign - 1) / cpu::kDsaHeadAlign * cpu::kDsaHeadAlign;
  std::vector<float> qt(static_cast<size_t>(dim) * hp, 0.f), qr(dim);
  std::vector<double> w(hp, 0.0);
  for (int h = 0; h < heads; ++h) {
    round_index_query(qs.q.data() + (t * heads + h) * dim, dim, qr.data());
    for (int d = 0; d < dim; ++d) qt[d * hp + h] = qr[d];
    w[h] = qs.w[t * heads + h];
  }
  const cpu::DsaQueries dq{.q = qt.data(), .w = w.data(), .tokens = 1, .heads = hp, .dim = dim};
  std::vector<double> out(slots.size());
  cpu::dsa_index_scores(dq, keys.view, slots.data(), static_cast<int64_t>(slots.size()), c,
                        out.data(), 0);
  return out;
}

LayerSpec indexer_layer(int heads, int dim, int topk) {
  LayerSpec l;
  l.indexer = {.index_topk = topk, .index_n_heads = heads, .index_head_dim = dim};
  return l;
}

// dsa_round_queries against round_index_query, bit for bit, one head after another.
void expect_rounding_as_round_index_query(const std::vector<float>& x, int heads, int dim) {
  const int hp = (heads + cpu::kDsaHeadAlign - 1) / cpu::kDsaHeadAlign * cpu::kDsaHeadAlign;
  std::vector<float> qt(static_cast<size_t>(dim) * hp, 0.f), want(dim);
  cpu::dsa_round_queries(x.data(), dim, heads, dim, qt.data(), hp);
  for (int h = 0; h < heads; ++h) {
    round_index_query(x.data() + h * dim, dim, want.data());
    for (int d = 0; d < dim; ++d) {
      const float got = qt[static_cast<size_t>(d) * hp + h];
      ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want[d]))
          << "head " << h << " d " << d << ": " << x[h * dim + d] << " -> " << got << ", want "
          << want[d];
    }
  }
}

TEST(CpuDsaIndexScores, QueriesRoundAsRoundIndexQueryBitForBit) {
  std::mt19937 rng(std::random_device{}());
  // Random heads of every magnitude (scales from 2^-22 up), dims with and without a vector tail.
  for (int dim : {128, 64, 40, 7}) {
    const int heads = 21;
    std::vector<float> x(static_cast<size_t>(heads) * dim);
    std::normal_distribution<float> nd;
    std::uniform_int_distribution<int> ex(-40, 40);
    for (int h = 0; h < heads; ++h) {
      const float m = std::ldexp(1.f, ex(rng));
      for (int d = 0; d < dim; ++d) x[h * dim + d] = nd(rng) * m;
      x[h * dim + (h % dim)] = h % 3 == 0 ? -0.f : x[h * dim + (h % dim)];
    }
    expect_rounding_as_round_index_query(x, heads, dim);
  }
  // Scale 1 (448 in every head): every e4m3 value, the midpoints between neighbours (ties to
  // even), a value just either side of each midpoint, and the subnormal range.
  std::vector<float> grid;
  for (int c = 0; c < 0x7f; ++c) grid.push_back(e4m3_to_float(static_cast<uint8_t>(c)));
  std::vector<float> vals;
  for (size_t i = 0; i + 1 < grid.size(); ++i) {
    const float mid = (grid[i] + grid[i + 1]) / 2;  // exact: one more mantissa bit
    for (float v : {grid[i], mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)}) {
      vals.push_back(v);
      vals.push_back(-v);
    }
  }
  for (float v = 1e-6f; v < 448.f; v *= 1.0137f) vals.push_back(v);
  const int dim = 128;
  std::vector<float> x;
  for (size_t i = 0; i < vals.size();) {
    x.push_back(448.f);
    for (int d = 1; d < dim; ++d) x.push_back(i < vals.size() ? vals[i++] : 1.f);
  }
  expect_rounding_as_round_index_query(x, static_cast<int>(x.size() / dim), dim);
}

TEST(CpuDsaIndexScores, MatchAFloat64EvaluationOfTheSameMath) {
  std::mt19937 rng(std::random_device{}());
  struct Shape {
    int heads, dim;
  };
  for (const Shape sh : {Shape{64, 128}, Shape{16, 128}, Shape{64, 64}, Shape{16, 64}, Shape{5, 40},
                         Shape{48, 24}}) {
    SCOPED_TRACE("heads " + std::to_string(sh.heads) + " dim " + std::to_string(sh.dim));
    const double c = index_score_scale(indexer_layer(sh.heads, sh.dim, 1));
    const int64_t rows = 3000;
    Keys keys(rows, sh.dim, 16, rng);
    Queries qs(2, sh.heads, sh.dim, rng);
    // Counted over the shape: one key's score is 0 when every head's dot is negative (1 in 32 at
    // 5 heads), so a single key says nothing about the relu.
    int positive = 0;
    // Ragged counts (not multiples of any key block), keys in shuffled order.
    for (int64_t n : {1, 7, 13, 25, 1537}) {
      std::vector<int32_t> slots(static_cast<size_t>(rows));
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      slots.resize(static_cast<size_t>(n));
      for (int64_t t = 0; t < 2; ++t) {
        std::vector<double> want, bound;
        float64_scores(qs, t, sh.heads, sh.dim, keys, slots, c, want, bound);
        const std::vector<double> got = kernel_scores(qs, t, sh.heads, sh.dim, keys, slots, c);
        for (int64_t m = 0; m < n; ++m) {
          // fp32 dots of dim exact products: at most dim roundings of the magnitude sum.
          const double tol = (sh.dim + 2) * std::ldexp(1.0, -24) * bound[m] + 1e-300;
          ASSERT_NEAR(got[m], want[m], tol) << "n " << n << " token " << t << " key " << m;
          positive += want[m] != 0.0;
        }
      }
    }
    EXPECT_GT(positive, 0);
  }
}

// A step of requests on one key cache: r.prefix, r.qlen, r.kv_len and the tree (tree >= 0) set;
// slots shuffled.
struct StepData {
  std::vector<cpu::RequestInfo> reqs;
  std::vector<int32_t> slots;
  std::vector<uint64_t> tree_mask;
  int tree_words = 1;
};

// The candidate token indices of token t of request r (docs/dsa.md "The selection").
std::vector<int32_t> candidates_of(const StepData& s, const cpu::RequestInfo& r, int32_t t) {
  std::vector<int32_t> out;
  if (r.tree < 0) {
    for (int32_t j = 0; j <= r.prefix + t; ++j) out.push_back(j);
    return out;
  }
  for (int32_t j = 0; j < r.prefix; ++j) out.push_back(j);
  const uint64_t* bits = s.tree_mask.data() + static_cast<size_t>(r.tree + t) * s.tree_words;
  for (int32_t u = 0; u < r.qlen; ++u) {
    if ((bits[u / 64] >> (u % 64)) & 1u) out.push_back(r.prefix + u);
  }
  return out;
}

// Runs select_dsa_keys and checks every token's selection against a full sort of the kernel's
// scores by dsa_ranks_before (or every candidate, with at most topk of them).
void check_selection(const StepData& s, const Keys& keys, int heads, int dim, int topk, int threads,
                     std::mt19937& rng) {
  int64_t tokens = 0;
  for (const auto& r : s.reqs) tokens = std::max(tokens, r.q_row + r.qlen);
  Queries qs(tokens, heads, dim, rng);
  IndexerArgs ix;
  ix.q = TensorView(const_cast<float*>(qs.q.data()), DType::f32, {tokens, heads, dim});
  ix.weights = TensorView(const_cast<float*>(qs.w.data()), DType::f32, {tokens, heads});
  std::vector<int32_t> topk_out(static_cast<size_t>(tokens * topk), -7);
  ix.topk = TensorView(topk_out.data(), DType::i32, {tokens, topk});
  const LayerSpec layer = indexer_layer(heads, dim, topk);
  const cpu::DsaStep step{.reqs = &s.reqs,
                          .slots = &s.slots,
                          .tree_mask = s.tree_mask.data(),
                          .tree_words = s.tree_words,
                          .num_threads = threads};
  cpu::DsaSelection sel;
  cpu::select_dsa_keys(step, layer, ix, keys.view, sel);
  const double c = index_score_scale(layer);
  int scored = 0;
  for (const auto& r : s.reqs) {
    for (int32_t t = 0; t < r.qlen; ++t) {
      const int64_t row = r.q_row + t;
      SCOPED_TRACE("row " + std::to_string(row));
      const std::vector<int32_t> cand = candidates_of(s, r, t);
      std::vector<int32_t> want = cand;
      if (static_cast<int>(cand.size()) > topk) {
        ++scored;
        std::vector<int32_t> cs;
        for (int32_t j : cand) cs.push_back(s.slots[r.slot_offset + j]);
        const std::vector<double> sc = kernel_scores(qs, row, heads, dim, keys, cs, c);
        std::vector<size_t> order(cand.size());
        std::iota(order.begin(), order.end(), size_t{0});
        std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
          return dsa_ranks_before(sc[a], cand[a], sc[b], cand[b]);
        });
        want.clear();
        for (int k = 0; k < topk; ++k) want.push_back(cand[order[k]]);
        std::sort(want.begin(), want.end());
      }
      const cpu::RequestInfo& o = sel.reqs[row];
      ASSERT_EQ(o.kv_len, static_cast<int32_t>(want.size()));
      for (size_t k = 0; k < want.size(); ++k) {
        ASSERT_EQ(sel.slots[o.slot_offset + k], s.slots[r.slot_offset + want[k]]) << k;
      }
      for (int k = 0; k < topk; ++k) {
        ASSERT_EQ(topk_out[row * topk + k], k < static_cast<int>(want.size()) ? want[k] : -1);
      }
    }
  }
  EXPECT_GT(scored, 0);
}

// Requests laid out one after another in a pool of shuffled slots.
StepData make_requests(const std::vector<std::pair<int32_t, int32_t>>& prefix_qlen, int64_t rows,
                       std::mt19937& rng) {
  StepData s;
  std::vector<int32_t> pool(static_cast<size_t>(rows));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  int64_t q_row = 0;
  size_t next = 0;
  for (const auto& [prefix, qlen] : prefix_qlen) {
    const int32_t kv = prefix + qlen;
    s.reqs.push_back({.q_row = q_row,
                      .slot_offset = static_cast<int64_t>(s.slots.size()),
                      .prefix = prefix,
                      .qlen = qlen,
                      .kv_len = kv});
    for (int32_t j = 0; j < kv; ++j) s.slots.push_back(pool[next++]);
    q_row += qlen;
  }
  return s;
}

TEST(CpuDsaSelection, ChainCandidatesEqualAFullSortByTheTieRule) {
  std::mt19937 rng(std::random_device{}());
  struct Case {
    int heads, dim, topk, threads;
  };
  for (const Case k : {Case{64, 128, 100, 2}, Case{16, 64, 33, 1}, Case{16, 128, 2, 2}}) {
    SCOPED_TRACE("heads " + std::to_string(k.heads) + " dim " + std::to_string(k.dim) + " topk " +
                 std::to_string(k.topk));
    const int64_t rows = 8192;
    Keys keys(rows, k.dim, 64, rng);
    // Decodes (one query over a long list, another at exactly topk + 1 candidates, one under
    // topk), a prefill over a prefix whose first tokens have at most topk candidates, and a
    // prefill from nothing whose length is not a multiple of the query block.
    const StepData s = make_requests(
        {{3100, 1}, {k.topk, 1}, {k.topk - 2, 1}, {k.topk / 2, 23}, {0, 2 * k.topk + 7}}, rows,
        rng);
    check_selection(s, keys, k.heads, k.dim, k.topk, k.threads, rng);
  }
}

TEST(CpuDsaSelection, AStepOfManyTokensIsScoredInRoundsWithTheSameResult) {
  // 2100 decodes of 64 x 128 index heads hold more queries (32 KiB a token) than one round of
  // scoring takes (64 MiB), so the step is scored in two rounds.
  std::mt19937 rng(std::random_device{}());
  const int heads = 64, dim = 128, topk = 8;
  const std::vector<std::pair<int32_t, int32_t>> decodes(2100, {11, 1});
  const int64_t rows = 2100 * 12;
  Keys keys(rows, dim, 64, rng);
  check_selection(make_requests(decodes, rows, rng), keys, heads, dim, topk, 2, rng);
}

TEST(CpuDsaSelection, EqualScoresOfDuplicatedKeysRankTheLowerTokenIndexFirst) {
  std::mt19937 rng(std::random_device{}());
  const int heads = 64, dim = 128, topk = 40;
  const int64_t rows = 4096;
  Keys keys(rows, dim, 16, rng);
  StepData s = make_requests({{1500, 1}, {200, 9}}, rows, rng);
  // Every key of the requests copied from one of 30 keys: 30 distinct scores per query, each
  // shared by many tokens, so the cut at topk falls inside a run of equal scores.
  std::uniform_int_distribution<size_t> pick(0, 29);
  for (size_t i = 30; i < s.slots.size(); ++i) keys.copy(s.slots[pick(rng)], s.slots[i]);
  check_selection(s, keys, heads, dim, topk, 2, rng);
}

TEST(CpuDsaSelection, TreeCandidatesEqualAFullSortByTheTieRule) {
  std::mt19937 rng(std::random_device{}());
  const int heads = 16, dim = 128, topk = 64;
  const int64_t rows = 4096;
  Keys keys(rows, dim, 64, rng);
  // Two verify trees of 11 and 70 drafts over prefixes of 90 and 60: random parents, a draft's
  // bits are its ancestors-or-self; 70 drafts take two mask words.
  StepData s = make_requests({{90, 11}, {60, 70}}, rows, rng);
  s.tree_words = 2;
  int32_t tree = 0;
  for (auto& r : s.reqs) {
    r.tree = tree;
    std::vector<std::vector<uint64_t>> bits(r.qlen, std::vector<uint64_t>(2, 0));
    for (int32_t u = 0; u < r.qlen; ++u) {
      if (u > 0) bits[u] = bits[std::uniform_int_distribution<int32_t>(0, u - 1)(rng)];
      bits[u][u / 64] |= uint64_t{1} << (u % 64);
      s.tree_mask.insert(s.tree_mask.end(), bits[u].begin(), bits[u].end());
    }
    tree += r.qlen;
  }
  check_selection(s, keys, heads, dim, topk, 2, rng);
}

}  // namespace
}  // namespace attnrt
