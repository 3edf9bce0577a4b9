#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/batch/forward_mode.h"
#include "attnrt/core/error.h"
#include "src/batch/step_layout_checked.h"
#include "tests/test_util.h"

using namespace attnrt;

namespace {

using attnrt::test::expect_error;

// Gives every token of the step its own slot.
void fill_slots(ForwardBatch& b) {
  const int64_t t = static_cast<int64_t>(b.positions.size());
  b.out_cache_loc.resize(t);
  std::iota(b.out_cache_loc.begin(), b.out_cache_loc.end(), int64_t{1});
}

// `b` after `change` is refused with a message that holds every fragment.
void expect_refused(ForwardBatch b, const std::function<void(ForwardBatch&)>& change,
                    const std::vector<std::string>& fragments) {
  change(b);
  expect_error([&] { make_step_layout(b); }, fragments);
}

std::vector<int64_t> rows(int n) {
  std::vector<int64_t> r(n);
  for (int i = 0; i < n; ++i) r[i] = 3 * i + 1;
  return r;
}

// Parents of a random tree of n nodes in which every parent precedes its children.
std::vector<int32_t> random_tree(std::mt19937& rng, int n) {
  std::vector<int32_t> p(n, -1);
  for (int t = 1; t < n; ++t) p[t] = std::uniform_int_distribution<int>(0, t - 1)(rng);
  return p;
}

// First-child / next-sibling links of a parents array (children in increasing index order).
void to_retrive(const std::vector<int32_t>& parents, std::vector<int32_t>& next_token,
                std::vector<int32_t>& next_sibling) {
  const int n = static_cast<int>(parents.size());
  next_token.assign(n, -1);
  next_sibling.assign(n, -1);
  std::vector<int32_t> last_child(n, -1);
  for (int t = 1; t < n; ++t) {
    const int p = parents[t];
    if (last_child[p] < 0) next_token[p] = t;
    else next_sibling[last_child[p]] = t;
    last_child[p] = t;
  }
}

}  // namespace

// §1.2, one row per mode: is_extend, is_extend(v2), is_decode, is_mixed, is_idle,
// is_decode_or_idle, is_target_verify, is_draft_extend, is_draft_extend(v2), is_draft_extend_v2,
// is_extend_or_draft_extend_or_mixed, (v2), is_extend_without_speculative, is_cuda_graph.
TEST(ForwardMode, PredicatesMatchTheReferenceTable) {
  struct Row {
    ForwardMode m;
    bool ext, ext_v2, dec, mixed, idle, dec_idle, verify, dext, dext_v2, v2, edm, edm_v2, ews, graph;
  };
  const Row table[] = {
      {ForwardMode::EXTEND, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0},
      {ForwardMode::DECODE, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1},
      {ForwardMode::MIXED, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0},
      {ForwardMode::IDLE, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1},
      {ForwardMode::TARGET_VERIFY, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1},
      {ForwardMode::DRAFT_EXTEND, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0},
      {ForwardMode::DRAFT_EXTEND_V2, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 0, 0},
  };
  for (const Row& r : table) {
    SCOPED_TRACE(std::string(forward_mode_name(r.m)));
    EXPECT_EQ(is_extend(r.m), r.ext);
    EXPECT_EQ(is_extend(r.m, true), r.ext_v2);
    EXPECT_EQ(is_prefill(r.m), r.ext);
    EXPECT_EQ(is_prefill(r.m, true), r.ext_v2);
    EXPECT_EQ(is_decode(r.m), r.dec);
    EXPECT_EQ(is_mixed(r.m), r.mixed);
    EXPECT_EQ(is_idle(r.m), r.idle);
    EXPECT_EQ(is_decode_or_idle(r.m), r.dec_idle);
    EXPECT_EQ(is_target_verify(r.m), r.verify);
    EXPECT_EQ(is_draft_extend(r.m), r.dext);
    EXPECT_EQ(is_draft_extend(r.m, true), r.dext_v2);
    EXPECT_EQ(is_draft_extend_v2(r.m), r.v2);
    EXPECT_EQ(is_extend_or_draft_extend_or_mixed(r.m), r.edm);
    EXPECT_EQ(is_extend_or_draft_extend_or_mixed(r.m, true), r.edm_v2);
    EXPECT_EQ(is_extend_without_speculative(r.m), r.ews);
    EXPECT_EQ(is_cuda_graph(r.m), r.graph);
  }
}

TEST(ForwardMode, NamesRoundTripAndUnknownNamesAreListed) {
  for (ForwardMode m : {ForwardMode::EXTEND, ForwardMode::DECODE, ForwardMode::MIXED,
                        ForwardMode::IDLE, ForwardMode::TARGET_VERIFY, ForwardMode::DRAFT_EXTEND,
                        ForwardMode::DRAFT_EXTEND_V2}) {
    EXPECT_EQ(parse_forward_mode(forward_mode_name(m)), m);
  }
  EXPECT_EQ(parse_forward_mode("target_verify"), ForwardMode::TARGET_VERIFY);
  EXPECT_EQ(forward_mode_name(ForwardMode::DRAFT_EXTEND_V2), "DRAFT_EXTEND_V2");
  expect_error([] { parse_forward_mode("PREFILL"); }, {"'PREFILL'", "EXTEND", "DRAFT_EXTEND_V2"});
}

TEST(StepLayout, ExtendWithPrefixesIsRaggedAndOffsetsArePrefixSums) {
  std::mt19937 rng(11);
  for (ForwardMode mode : {ForwardMode::EXTEND, ForwardMode::MIXED}) {
    const int bs = 5;
    std::vector<int32_t> prefix(bs), ext(bs);
    for (int i = 0; i < bs; ++i) {
      prefix[i] = std::uniform_int_distribution<int>(0, 40)(rng);
      ext[i] = std::uniform_int_distribution<int>(1, 9)(rng);
    }
    ForwardBatch b = make_extend_batch(rows(bs), prefix, ext, mode);
    EXPECT_EQ(b.mode, mode);
    EXPECT_TRUE(b.out_cache_loc.empty());
    fill_slots(b);
    StepLayout l = make_step_layout(b);
    int64_t start = 0, pos_row = 0, sum = 0;
    for (int i = 0; i < bs; ++i) {
      EXPECT_EQ(l.prefix_lens[i], prefix[i]);
      EXPECT_EQ(l.query_lens[i], ext[i]);
      EXPECT_EQ(l.query_start[i], start);
      EXPECT_EQ(b.extend_start_loc[i], start);
      EXPECT_EQ(b.seq_lens[i], prefix[i] + ext[i]);
      EXPECT_EQ(l.kv_len(i), prefix[i] + ext[i]);
      for (int t = 0; t < ext[i]; ++t) EXPECT_EQ(b.positions[pos_row++], prefix[i] + t);
      start += ext[i];
      sum += prefix[i] + ext[i];
    }
    EXPECT_EQ(l.query_start[bs], start);
    EXPECT_EQ(l.num_tokens, start);
    EXPECT_EQ(l.max_query_len, *std::max_element(ext.begin(), ext.end()));
    EXPECT_EQ(b.seq_lens_sum(), sum);
  }
}

TEST(StepLayout, DecodeHasOneQueryAtTheLastPosition) {
  ForwardBatch b = make_decode_batch(rows(3), {1, 17, 5});
  fill_slots(b);
  StepLayout l = make_step_layout(b);
  EXPECT_EQ(l.prefix_lens, (std::vector<int32_t>{0, 16, 4}));
  EXPECT_EQ(l.query_lens, (std::vector<int32_t>{1, 1, 1}));
  EXPECT_EQ(b.positions, (std::vector<int64_t>{0, 16, 4}));
  EXPECT_EQ(l.max_kv_len, 17);
  EXPECT_EQ(b.seq_lens_sum(), 23);
  // Engines may leave the extend fields of a decode batch empty.
  b.extend_seq_lens.clear();
  b.extend_prefix_lens.clear();
  b.extend_start_loc.clear();
  EXPECT_EQ(make_step_layout(b).num_tokens, 3);
}

TEST(StepLayout, VerifyChainAndTreePositionsFollowDepth) {
  ForwardBatch chain = make_verify_batch(rows(2), {7, 3}, SpecInfo::chain(2, 4));
  fill_slots(chain);
  StepLayout l = make_step_layout(chain);
  EXPECT_EQ(l.prefix_lens, (std::vector<int32_t>{7, 3}));
  EXPECT_EQ(l.query_lens, (std::vector<int32_t>{4, 4}));
  EXPECT_EQ(chain.positions, (std::vector<int64_t>{7, 8, 9, 10, 3, 4, 5, 6}));
  EXPECT_EQ(l.kv_len(0), 11);

  // Root 0 with children 1, 2; node 3 under 1; node 4 under 2; node 5 under 3.
  SpecInfo tree;
  tree.draft_token_num = 6;
  tree.topk = 2;
  tree.parents = {-1, 0, 0, 1, 2, 3};
  ForwardBatch b = make_verify_batch(rows(1), {10}, tree);
  fill_slots(b);
  make_step_layout(b);
  EXPECT_EQ(b.positions, (std::vector<int64_t>{10, 11, 11, 12, 12, 13}));
}

TEST(StepLayout, DraftExtendRerunsAcceptedTokensAtTheEnd) {
  ForwardBatch b = make_draft_extend_batch(rows(3), {12, 5, 9}, {2, 0, 3});
  fill_slots(b);
  StepLayout l = make_step_layout(b);
  EXPECT_EQ(l.query_lens, (std::vector<int32_t>{3, 1, 4}));
  EXPECT_EQ(l.prefix_lens, (std::vector<int32_t>{9, 4, 5}));
  EXPECT_EQ(b.positions, (std::vector<int64_t>{9, 10, 11, 4, 5, 6, 7, 8}));
  EXPECT_EQ(l.kv_len(2), 9);

  ForwardBatch v2 = make_draft_extend_v2_batch(rows(2), {6, 9}, 3);
  fill_slots(v2);
  StepLayout l2 = make_step_layout(v2);
  EXPECT_EQ(l2.query_lens, (std::vector<int32_t>{3, 3}));
  EXPECT_EQ(l2.prefix_lens, (std::vector<int32_t>{3, 6}));
  EXPECT_EQ(v2.positions, (std::vector<int64_t>{3, 4, 5, 6, 7, 8}));
}

TEST(StepLayout, IdleHasNoTokens) {
  ForwardBatch b = make_idle_batch();
  StepLayout l = make_step_layout(b);
  EXPECT_EQ(l.num_tokens, 0);
  EXPECT_EQ(l.query_start, (std::vector<int64_t>{0}));
  b.batch_size = 1;
  b.req_pool_indices = {0};
  b.seq_lens = {1};
  expect_error([&] { make_step_layout(b); }, {"IDLE", "batch_size = 1"});
}

TEST(StepLayout, RejectsInconsistentExtendBatches) {
  auto good = [] {
    ForwardBatch b = make_extend_batch({4, 9, 2}, {3, 0, 8}, {2, 5, 1});
    fill_slots(b);
    return b;
  };
  ASSERT_NO_THROW(make_step_layout(good()));
  expect_refused(good(), [](auto& b) { b.seq_lens.pop_back(); },
                 {"seq_lens has 2 entries", "expected 3"});
  expect_refused(good(), [](auto& b) { b.req_pool_indices.push_back(7); },
                 {"req_pool_indices has 4 entries", "expected 3"});
  expect_refused(good(),
                 [](auto& b) {
                   b.extend_prefix_lens = {3, 0};
                 },
                 {"extend_prefix_lens has 2 entries"});
  expect_refused(good(), [](auto& b) { b.extend_prefix_lens[1] = -1; },
                 {"extend_prefix_lens[1] = -1", ">= 0"});
  expect_refused(good(), [](auto& b) { b.extend_seq_lens[2] = 0; },
                 {"extend_seq_lens[2] = 0", ">= 1"});
  expect_refused(good(), [](auto& b) { b.seq_lens[0] = 6; }, {"seq_lens[0] = 6", "3 + 2 = 5"});
  expect_refused(good(), [](auto& b) { b.out_cache_loc.pop_back(); },
                 {"out_cache_loc has 7 entries", "(8)"});
  expect_refused(good(), [](auto& b) { b.positions.push_back(0); },
                 {"positions has 9 entries", "(8)"});
  // Request 1 (no prefix), query 1 sits at position 1.
  expect_refused(good(), [](auto& b) { b.positions[3] = 4; },
                 {"positions[3] = 4", "request 1, query 1", "expected 1", "prefix length"});
  expect_refused(good(), [](auto& b) { b.extend_start_loc[2] = 6; },
                 {"extend_start_loc[2] = 6", "exclusive prefix sum", "(7)"});
  expect_refused(good(), [](auto& b) { b.extend_start_loc.clear(); },
                 {"extend_start_loc has 0 entries"});
  expect_refused(good(), [](auto& b) { b.req_pool_indices[2] = 4; },
                 {"req_pool_indices[2] = 4 duplicates req_pool_indices[0]"});
  expect_refused(good(), [](auto& b) { b.req_pool_indices[1] = -2; }, {"req_pool_indices[1] = -2"});
  expect_refused(good(), [](auto& b) { b.batch_size = -1; }, {"batch_size = -1"});
  expect_error([] { make_extend_batch({1}, {0}, {1}, ForwardMode::DECODE); },
               {"make_extend_batch", "DECODE", "EXTEND, MIXED"});
  expect_error([] { make_extend_batch({1, 2}, {0}, {1, 1}); },
               {"prefix_lens has 1 entries but req_rows has 2"});
}

TEST(StepLayout, RejectsInconsistentDecodeBatches) {
  auto good = [] {
    ForwardBatch b = make_decode_batch({0, 5}, {4, 9});
    fill_slots(b);
    return b;
  };
  expect_refused(good(),
                 [](auto& b) {
                   b.seq_lens[1] = 0;
                   b.positions[1] = -1;
                 },
                 {"DECODE", "seq_lens[1] = 0", ">= 1"});
  expect_refused(good(), [](auto& b) { b.extend_seq_lens[0] = 2; },
                 {"extend_seq_lens[0] = 2", "exactly 1"});
  expect_refused(good(), [](auto& b) { b.extend_prefix_lens[1] = 9; },
                 {"extend_prefix_lens[1] = 9", "seq_lens - 1 = 8"});
  expect_refused(good(), [](auto& b) { b.positions[1] = 9; },
                 {"DECODE", "positions[1] = 9", "expected 8"});
  expect_refused(good(),
                 [](auto& b) {
                   b.extend_start_loc = {0, 2};
                 },
                 {"extend_start_loc[1] = 2", "(1)"});
}

TEST(StepLayout, RejectsInconsistentVerifyBatches) {
  SpecInfo tree;
  tree.draft_token_num = 4;
  tree.topk = 2;
  tree.parents = {-1, 0, 0, 1, -1, 0, 1, 1};
  auto good = [&] {
    ForwardBatch b = make_verify_batch({2, 6}, {5, 8}, tree);
    fill_slots(b);
    return b;
  };
  ASSERT_NO_THROW(make_step_layout(good()));
  expect_refused(good(), [](auto& b) { b.spec_info.reset(); },
                 {"TARGET_VERIFY", "spec_info is missing"});
  expect_refused(good(), [](auto& b) { b.spec_info->parents.pop_back(); },
                 {"spec_info.parents has 7 entries", "expected 8"});
  expect_refused(good(), [](auto& b) { b.spec_info->parents[4] = 0; },
                 {"parents[4] = 0", "request 1, token 0", "-1"});
  // Request 1 token 2: its parent must precede it.
  expect_refused(good(), [](auto& b) { b.spec_info->parents[6] = 3; },
                 {"parents[6] = 3", "request 1, token 2", "earlier block token"});
  expect_refused(good(), [](auto& b) { b.spec_info->topk = 1; }, {"topk = 1 means a chain"});
  // Request 0 token 3 has depth 2: 5 + 2.
  expect_refused(good(), [](auto& b) { b.positions[3] = 8; },
                 {"positions[3] = 8", "expected 7", "seq_len + depth"});
  expect_refused(good(), [](auto& b) { b.extend_seq_lens[1] = 3; },
                 {"extend_seq_lens[1] = 3", "draft_token_num = 4"});
  expect_refused(good(), [](auto& b) { b.out_cache_loc.resize(6); },
                 {"out_cache_loc has 6 entries", "(8)"});
  expect_refused(good(), [](auto& b) { b.spec_info->draft_token_num = 0; },
                 {"draft_token_num = 0"});
}

TEST(StepLayout, RejectsInconsistentDraftExtendBatches) {
  auto good = [] {
    ForwardBatch b = make_draft_extend_batch({1, 2}, {6, 4}, {1, 3});
    fill_slots(b);
    return b;
  };
  ASSERT_NO_THROW(make_step_layout(good()));
  expect_refused(good(), [](auto& b) { b.extend_seq_lens[0] = 3; },
                 {"extend_seq_lens[0] = 3", "accept_length[0] = 1", "accept_length + 1"});
  expect_refused(good(), [](auto& b) { b.seq_lens[1] = 3; },
                 {"seq_lens[1] = 3 < extend_seq_lens[1] = 4"});
  expect_refused(good(), [](auto& b) { b.positions[0] = 0; },
                 {"DRAFT_EXTEND", "positions[0] = 0", "expected 4"});
  expect_error([] { make_draft_extend_batch({1}, {5}, {-1}); }, {"accept_lengths[0] = -1"});
  {
    ForwardBatch b = make_draft_extend_v2_batch({1, 2}, {6, 4}, 2);
    fill_slots(b);
    b.extend_seq_lens[1] = 1;
    expect_error([&] { make_step_layout(b); },
                 {"DRAFT_EXTEND_V2", "extend_seq_lens[1] = 1", "fixed width"});
  }
}

TEST(SpecInfo, ChainHasConsecutiveParentsAndDepths) {
  SpecInfo s = SpecInfo::chain(2, 5);
  EXPECT_TRUE(s.is_chain());
  EXPECT_EQ(s.parents, (std::vector<int32_t>{-1, 0, 1, 2, 3, -1, 0, 1, 2, 3}));
  for (int t = 0; t < 5; ++t) {
    EXPECT_EQ(s.depth(1, t), t);
    for (int u = 0; u < 5; ++u) EXPECT_EQ(s.visible(1, t, u), u <= t);
  }
  expect_error([] { SpecInfo::chain(1, 0); }, {"num_draft_tokens = 0"});
}

TEST(SpecInfo, ParentsFromFirstChildNextSiblingWithSiblings) {
  // Root 0 -> children 1, 2, 3 (siblings); 1 -> 4, 5; 3 -> 6; 5 -> 7.
  const std::vector<int32_t> next_token = {1, 4, -1, 6, -1, 7, -1, -1};
  const std::vector<int32_t> next_sibling = {-1, 2, 3, -1, 5, -1, -1, -1};
  SpecInfo s = SpecInfo::from_retrive(1, 8, 3, next_token, next_sibling);
  EXPECT_EQ(s.parents, (std::vector<int32_t>{-1, 0, 0, 0, 1, 1, 3, 5}));
  EXPECT_FALSE(s.is_chain());
  EXPECT_EQ(s.depth(0, 7), 3);
  EXPECT_TRUE(s.visible(0, 7, 5));
  EXPECT_TRUE(s.visible(0, 7, 1));
  EXPECT_TRUE(s.visible(0, 7, 0));
  EXPECT_TRUE(s.visible(0, 7, 7));
  EXPECT_FALSE(s.visible(0, 7, 4));  // sibling of its parent
  EXPECT_FALSE(s.visible(0, 2, 1));  // sibling
  EXPECT_FALSE(s.visible(0, 1, 2));
  EXPECT_FALSE(s.visible(0, 0, 1));  // a child is never visible to its parent
}

TEST(SpecInfo, FromRetriveInvertsRandomTrees) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    const int bs = std::uniform_int_distribution<int>(1, 4)(rng);
    const int n = std::uniform_int_distribution<int>(1, 12)(rng);
    std::vector<int32_t> parents, next_token, next_sibling;
    for (int r = 0; r < bs; ++r) {
      std::vector<int32_t> p = random_tree(rng, n), nt, ns;
      to_retrive(p, nt, ns);
      parents.insert(parents.end(), p.begin(), p.end());
      next_token.insert(next_token.end(), nt.begin(), nt.end());
      next_sibling.insert(next_sibling.end(), ns.begin(), ns.end());
    }
    SpecInfo s = SpecInfo::from_retrive(bs, n, 4, next_token, next_sibling);
    ASSERT_EQ(s.parents, parents);
    for (int r = 0; r < bs; ++r) {
      for (int t = 0; t < n; ++t) {
        int depth = 0;
        std::vector<bool> anc(n, false);
        for (int a = t; a >= 0; a = parents[r * n + a]) {
          anc[a] = true;
          if (a != t) ++depth;
        }
        EXPECT_EQ(s.depth(r, t), depth);
        for (int u = 0; u < n; ++u) EXPECT_EQ(s.visible(r, t, u), anc[u]);
      }
    }
  }
}

TEST(SpecInfo, FromRetriveRejectsLinksThatAreNotATree) {
  expect_error([] { SpecInfo::from_retrive(1, 3, 2, {1, -1}, {-1, -1, -1}); },
               {"next_token has 2 entries", "1 * 3 = 3"});
  expect_error([] { SpecInfo::from_retrive(1, 3, 2, {1, 5, -1}, {-1, -1, -1}); },
               {"next_token[0, 1] = 5", "[0, 3)"});
  expect_error([] { SpecInfo::from_retrive(1, 3, 2, {1, -1, -1}, {-1, -1, -1}); },
               {"node 2 is not reachable"});
  expect_error([] { SpecInfo::from_retrive(1, 3, 2, {1, 2, -1}, {-1, 2, -1}); },
               {"node 2 is reached twice"});
  expect_error([] { SpecInfo::from_retrive(1, 3, 2, {1, -1, -1}, {-1, 2, 1}); },
               {"next_sibling[0, 2] = 1", "must come after"});
  expect_error([] { SpecInfo::from_retrive(1, 2, 2, {-1, -1}, {1, -1}); },
               {"the root has no siblings"});
}

TEST(SpecInfo, FullMaskHasPrefixColumnsAndAncestorOrSelf) {
  std::mt19937 rng(9);
  const int n = 6;
  SpecInfo s;
  s.draft_token_num = n;
  s.topk = 3;
  for (int r = 0; r < 3; ++r) {
    auto p = random_tree(rng, n);
    s.parents.insert(s.parents.end(), p.begin(), p.end());
  }
  const std::vector<int32_t> seq_lens = {4, 0, 7};
  const std::vector<uint8_t> mask = s.full_mask(seq_lens);
  size_t off = 0;
  for (int r = 0; r < 3; ++r) {
    const int cols = seq_lens[r] + n;
    for (int t = 0; t < n; ++t) {
      for (int c = 0; c < cols; ++c) {
        bool want = c < seq_lens[r];
        if (!want) {
          for (int a = t; a >= 0; a = s.parents[r * n + a]) want |= (a == c - seq_lens[r]);
        }
        EXPECT_EQ(mask[off + static_cast<size_t>(t) * cols + c], want) << r << " " << t << " " << c;
      }
    }
    off += static_cast<size_t>(n) * cols;
  }
  EXPECT_EQ(mask.size(), off);
  expect_error([&] { s.full_mask({1, 2}); }, {"2 seq_lens", "3 requests"});
}

// Many requests whose rows share their low bits (and one repeat far from its first use): every
// repeat is found and named with the request that used the row first.
TEST(StepLayout, FindsRepeatedRowsAmongManyRequests) {
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < 300; ++i) rows.push_back((i << 32) + 7);
  ForwardBatch b = make_decode_batch(rows, std::vector<int32_t>(rows.size(), 5));
  b.out_cache_loc.assign(rows.size(), 0);
  ASSERT_NO_THROW(make_step_layout(b));
  b.req_pool_indices[299] = (int64_t{17} << 32) + 7;
  test::expect_error([&] { make_step_layout(b); },
                     {"req_pool_indices[299] = 73014444039 duplicates req_pool_indices[17]"});
}

// Issue 21 (fuzz_batch, UBSan): row INT64_MAX overflowed the duplicate check's `row + 1` key.
// Rows up to INT64_MAX are told apart (the runtime then refuses them as unallocated).
TEST(StepLayout, LargestRowsAreComparedWithoutOverflow) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  ForwardBatch b = make_decode_batch({max, max - 1}, {5, 5});
  b.out_cache_loc.assign(2, 0);
  ASSERT_NO_THROW(make_step_layout(b));
  b.req_pool_indices[1] = max;
  test::expect_error([&] { make_step_layout(b); },
                     {"req_pool_indices[1] = 9223372036854775807 duplicates req_pool_indices[0]"});
}

// Issue 21 (ASan/UBSan build, FusedPathAcceptsAndRejectsExactlyAsTheCheckedPath): a verify block
// on top of seq_lens near INT32_MAX overflowed the int32 kv length (undefined behaviour in the
// checked path; the fused path wrapped it and accepted the batch). Both refuse it.
TEST(StepLayout, VerifyKeysBeyondInt32AreRefused) {
  ForwardBatch b =
      make_verify_batch({1}, {std::numeric_limits<int32_t>::max() - 4}, SpecInfo::chain(1, 4));
  b.out_cache_loc.assign(4, 0);
  StepLayout l;
  ASSERT_NO_THROW(make_step_layout(b));
  b.seq_lens[0] += 1;
  b.extend_prefix_lens.clear();
  for (int64_t& p : b.positions) p += 1;
  const std::vector<std::string> expect = {"seq_lens[0] = 2147483644 plus draft_token_num = 4",
                                           "at most 2^31 - 1"};
  test::expect_error([&] { make_step_layout(b); }, expect);
  test::expect_error([&] { make_step_layout_checked(b, l); }, expect);
}

// Issue 21 (fuzz_batch, UBSan): spec_info.accept_length = INT32_MAX overflowed `+ 1` in the
// draft-extend check, and in make_draft_extend_batch.
TEST(StepLayout, AcceptLengthAtInt32MaxIsRefusedWithoutOverflow) {
  ForwardBatch b = make_draft_extend_batch({1}, {9}, {2});
  b.out_cache_loc.assign(3, 0);
  ASSERT_NO_THROW(make_step_layout(b));
  b.spec_info->accept_length[0] = std::numeric_limits<int32_t>::max();
  test::expect_error([&] { make_step_layout(b); },
                     {"spec_info.accept_length[0] = 2147483647", "accept_length + 1"});
  test::expect_error(
      [] { make_draft_extend_batch({1}, {9}, {std::numeric_limits<int32_t>::max()}); },
      {"accept_lengths[0] = 2147483647", "[0, 2^31 - 2]"});
}

// Issue 21 (fuzz_batch, out of memory): an empty TARGET_VERIFY step (batch_size 0) with a tree
// of draft_token_num = 2^30 passed every size check and the fused path sized its depth scratch by
// draft_token_num: 4 GiB allocated to validate nothing. It is accepted without that allocation.
TEST(StepLayout, EmptyVerifyStepAllocatesNothingForItsTree) {
  ForwardBatch b;
  b.mode = ForwardMode::TARGET_VERIFY;
  SpecInfo s;
  s.draft_token_num = 1 << 30;
  s.topk = 4;
  b.spec_info = s;
  const StepLayout l = make_step_layout(b);
  EXPECT_EQ(l.num_tokens, 0);
}

namespace {

// A valid batch of a random mode and size, its rows small or far apart, then 0-3 random edits
// (a value nudged or set to an extreme, a field grown, shrunk or emptied, a row repeated, the mode
// or the tree changed), so most batches break one check or several.
ForwardBatch random_batch(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int bs = pick(0, 6);
  std::vector<int64_t> req(bs);
  const bool far = pick(0, 3) == 0;
  for (int i = 0; i < bs; ++i) req[i] = far ? (int64_t{i + 1} << 33) + 5 : 2 * i + pick(0, 1);
  std::shuffle(req.begin(), req.end(), rng);
  std::vector<int32_t> prefix(bs), ext(bs), seq(bs);
  for (int i = 0; i < bs; ++i) {
    prefix[i] = pick(0, 9);
    ext[i] = pick(1, 4);
    seq[i] = prefix[i] + ext[i];
  }
  ForwardBatch b;
  switch (pick(0, 5)) {
    case 0:
      b = make_decode_batch(req, seq);
      break;
    case 1:
      b = make_extend_batch(req, prefix, ext);
      break;
    case 2:
      b = make_extend_batch(req, prefix, ext, ForwardMode::MIXED);
      break;
    case 3:
      b = make_verify_batch(req, prefix, SpecInfo::chain(bs, pick(1, 4)));
      break;
    case 4: {
      const int n = pick(1, 5);
      SpecInfo s;
      s.draft_token_num = n;
      s.topk = 2;
      for (int i = 0; i < bs; ++i) {
        const std::vector<int32_t> p = random_tree(rng, n);
        s.parents.insert(s.parents.end(), p.begin(), p.end());
      }
      b = make_verify_batch(req, prefix, std::move(s));
      break;
    }
    default: {
      std::vector<int32_t> accept(bs);
      for (int i = 0; i < bs; ++i) accept[i] = ext[i] - 1;
      b = make_draft_extend_batch(req, seq, accept);
    }
  }
  fill_slots(b);
  if (pick(0, 2) == 0) {  // the optional fields of decode and verify left out
    if (pick(0, 1) == 0) b.extend_seq_lens.clear();
    if (pick(0, 1) == 0) b.extend_prefix_lens.clear();
    if (pick(0, 1) == 0) b.extend_start_loc.clear();
  }
  const int edits = pick(0, 3);
  for (int e = 0; e < edits; ++e) {
    const int what = pick(0, 12);
    auto edit32 = [&](std::vector<int32_t>& v) {
      if (v.empty()) return;
      int32_t& x = v[pick(0, static_cast<int>(v.size()) - 1)];
      switch (pick(0, 4)) {
        case 0:
          x = std::numeric_limits<int32_t>::min();
          break;
        case 1:
          x = std::numeric_limits<int32_t>::max();
          break;
        case 2:
          x = -1;
          break;
        default:
          // Nudged in int64 and kept in range: an extreme set by an earlier edit must not
          // overflow here (undefined behaviour the sanitizer build stops on).
          x = static_cast<int32_t>(std::clamp<int64_t>(int64_t{x} + (pick(0, 1) ? 1 : -1),
                                                       std::numeric_limits<int32_t>::min(),
                                                       std::numeric_limits<int32_t>::max()));
      }
    };
    auto edit64 = [&](std::vector<int64_t>& v) {
      if (v.empty()) return;
      int64_t& x = v[pick(0, static_cast<int>(v.size()) - 1)];
      switch (pick(0, 3)) {
        case 0:
          x = -1;
          break;
        case 1:
          x = v[pick(0, static_cast<int>(v.size()) - 1)];
          break;
        default:
          x += pick(0, 1) ? 1 : -1;
      }
    };
    auto resize = [&](auto& v) {
      switch (pick(0, 2)) {
        case 0:
          v.clear();
          break;
        case 1:
          v.resize(v.size() + 1);
          break;
        default:
          if (!v.empty()) v.pop_back();
      }
    };
    std::vector<int32_t>* const fields32[] = {&b.seq_lens, &b.extend_prefix_lens,
                                              &b.extend_seq_lens, &b.extend_start_loc};
    std::vector<int64_t>* const fields64[] = {&b.req_pool_indices, &b.positions, &b.out_cache_loc};
    switch (what) {
      case 0:
      case 1:
        edit64(*fields64[pick(0, 1)]);
        break;
      case 2:
      case 3:
      case 4:
        edit32(*fields32[pick(0, 3)]);
        break;
      case 5:
        resize(*fields32[pick(0, 3)]);
        break;
      case 6:
        resize(*fields64[pick(0, 2)]);
        break;
      case 7:
        if (b.spec_info) edit32(b.spec_info->parents);
        break;
      case 8:
        if (b.spec_info) b.spec_info->topk = pick(0, 2);
        break;
      case 9:
        if (b.spec_info) b.spec_info->draft_token_num += pick(0, 1) ? 1 : -1;
        break;
      case 10:
        b.spec_info.reset();
        break;
      case 11:
        b.batch_size += pick(0, 1) ? 1 : -1;
        break;
      default:
        b.mode = static_cast<ForwardMode>(pick(0, 6));
    }
  }
  return b;
}

// What make_step_layout makes of a batch: the layout's fields, or the error message.
template <typename Fn>
std::string outcome(Fn&& fn, const ForwardBatch& b, StepLayout& l) {
  try {
    fn(b, l);
  } catch (const Error& e) {
    return std::string("error: ") + e.what();
  }
  std::string s =
      fmt::format("tokens {} max_q {} max_kv {} |", l.num_tokens, l.max_query_len, l.max_kv_len);
  for (size_t i = 0; i < l.prefix_lens.size(); ++i) {
    s += fmt::format(" {}+{}@{}", l.prefix_lens[i], l.query_lens[i], l.query_start[i]);
  }
  return s + fmt::format(" end {} of {}", l.query_start.back(), l.query_start.size());
}

}  // namespace

// make_step_layout's fused pass only decides how fast a good batch goes: on random good and bad
// batches of every mode it gives the layout or the first error that the one-check-at-a-time path
// gives, into fresh layouts and into one reused across steps.
TEST(StepLayout, FusedPathAcceptsAndRejectsExactlyAsTheCheckedPath) {
  std::mt19937 rng(2024);
  StepLayout fused_reused, checked_reused;
  int rejected = 0;
  for (int iter = 0; iter < 40000; ++iter) {
    const ForwardBatch b = random_batch(rng);
    StepLayout fresh_fused, fresh_checked;
    const auto fused = [](const ForwardBatch& x, StepLayout& l) { make_step_layout(x, l); };
    const std::string want = outcome(make_step_layout_checked, b, fresh_checked);
    ASSERT_EQ(outcome(fused, b, fresh_fused), want) << "iteration " << iter;
    ASSERT_EQ(outcome(fused, b, fused_reused), outcome(make_step_layout_checked, b, checked_reused))
        << "iteration " << iter;
    rejected += want.starts_with("error");
  }
  // Both kinds are well represented.
  EXPECT_GT(rejected, 10000);
  EXPECT_LT(rejected, 36000);
}
