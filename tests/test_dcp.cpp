// Decode context parallelism (docs/dcp.md): n simulated ranks over `reference` and `cpu` give the
// output and lse of one `reference` runtime holding every token, in every mode, with ragged
// lengths across page boundaries, GQA, sinks, soft-cap and MLA; plus the merge math, the
// communicator and the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/runtime/attention_runtime.h"
#include "attnrt/runtime/communicator.h"
#include "attnrt/runtime/dcp.h"
#include "tests/dcp_steps.h"
#include "tests/test_util.h"

using namespace attnrt;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t fresh_seed() { return std::random_device{}(); }

// GQA with uneven head splits (6 q heads over 4 ranks), soft-cap, a layer with sinks and a
// sliding-window layer.
ModelSpec gqa_model() {
  LayerSpec a = test::attention_layer(0, 6, 2, 16);
  a.logit_cap = 5.f;
  LayerSpec b = test::attention_layer(1, 4, 4, 8, 12);
  b.has_sinks = true;
  LayerSpec w = test::attention_layer(2, 4, 2, 16);  // a sliding window on global positions
  w.kind = LayerKind::swa;
  w.sliding_window = 9;
  return test::make_model("dcp-gqa", DType::f32, 512, {a, b, w});
}

ModelSpec mla_model() {
  LayerSpec l = test::attention_layer(0, 5, 1, 40, 32);
  l.kind = LayerKind::mla;
  l.kv_lora_rank = 32;
  l.qk_rope_head_dim = 8;
  l.scaling = 0.2f;
  return test::make_model("dcp-mla", DType::f32, 512, {l});
}

struct DcpCase {
  std::string backend;
  int ranks;
  int page_size;
};

std::string case_name(const testing::TestParamInfo<DcpCase>& info) {
  return info.param.backend + "_n" + std::to_string(info.param.ranks) + "_page" +
         std::to_string(info.param.page_size);
}

// Tokens of one step in the harness (its RuntimeConfig::max_num_tokens).
inline constexpr int kStepTokens = 256;

// One `reference` runtime (the oracle, which also hands out the global batch's slots) and a DCP
// group fed the same batches and the same q/k/v.
class DcpHarness {
 public:
  // twin: a second group fed the same steps reads every key list from a key-list row
  // (set_direct_rows(false)); its outputs must be the first group's bits.
  DcpHarness(ModelSpec model, const DcpCase& c, uint32_t seed, bool tree = false,
             bool deterministic = false, const std::string& kv_dtype = "fp32", bool twin = false)
      : model_(std::move(model)), rng_(seed) {
    Options one;
    one.attention_backend = "reference";
    one.page_size = c.page_size;
    one.kv_cache_dtype = kv_dtype;
    Options group = one;
    group.attention_backend = c.backend;
    group.dcp_size = c.ranks;
    group.deterministic = deterministic;
    if (tree) {
      group.speculative_num_steps = 3;
      group.speculative_eagle_topk = 2;
      group.speculative_num_draft_tokens = 6;
    }
    const RuntimeConfig cfg = test::host_config(6, 4096, kStepTokens);
    one_ = std::make_unique<AttentionRuntime>(model_, one, cfg);
    dcp_ = std::make_unique<DcpAttention>(model_, group, cfg);
    if (twin) {
      twin_ = std::make_unique<DcpAttention>(model_, group, cfg);
      twin_->set_direct_rows(false);
    }
  }

  DcpAttention& dcp() { return *dcp_; }
  DcpAttention& twin() { return *twin_; }
  AttentionRuntime& one() { return *one_; }
  // The request row freed on the group(s) (the oracle's row is reused as it is).
  void free_request(int64_t row) {
    dcp_->free_request(static_cast<int>(row));
    if (twin_) twin_->free_request(static_cast<int>(row));
  }
  // After each begin_step (before the layers), e.g. to inspect the ranks.
  std::function<void(const ForwardBatch&)> on_begin;

  void set_kv_scales(int layer_id, float k_scale, float v_scale) {
    one_->kv_cache().set_kv_scales(layer_id, k_scale, v_scale);
    dcp_->set_kv_scales(layer_id, k_scale, v_scale);
  }

  std::vector<int64_t> alloc_requests(int n) {
    std::vector<int64_t> rows;
    for (int i = 0; i < n; ++i) {
      rows.push_back(one_->req_to_token().alloc());
    }
    return rows;
  }

  // Gives the oracle's slots to the step's new tokens (columns prefix .. prefix + query).
  void place(ForwardBatch& b) { test::place_on(*one_, b); }

  // Runs the step on both, every layer with fresh q/k/v, and compares out and lse.
  ForwardBatch run_and_compare(ForwardBatch b, const std::string& what, double tol = 2e-4) {
    place(b);
    const int64_t T = b.num_tokens();
    one_->begin_step(b);
    dcp_->begin_step(b);
    if (twin_) twin_->begin_step(b);
    if (on_begin) on_begin(b);
    for (const LayerSpec& l : model_.layers) {
      const int hq = l.num_q_heads, hkv = l.num_kv_heads, dqk = l.head_dim;
      const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
      const bool mla = l.kind == LayerKind::mla;
      HostBuffer q = test::random_buffer(DType::f32, {T, hq, dqk}, rng_);
      HostBuffer k = test::random_buffer(DType::f32, {T, hkv, dqk}, rng_);
      HostBuffer v = test::random_buffer(DType::f32, {T, hkv, dv}, rng_);
      std::vector<float> sinks(hq);
      for (float& s : sinks) s = std::normal_distribution<float>(0.f, 1.f)(rng_);
      HostBuffer out1(DType::f32, {T, hq, dv}), outn(DType::f32, {T, hq, dv});
      HostBuffer lse1(DType::f32, {T, hq}), lsen(DType::f32, {T, hq});
      for (const HostBuffer* p : {&out1, &outn, &lse1, &lsen}) test::poison(p->view());
      AttnArgs a;
      a.q = q.view();
      a.k = k.view();
      if (!mla) a.v = v.view();
      a.sinks = l.has_sinks ? sinks.data() : nullptr;
      a.out = out1.view();
      a.lse = lse1.view();
      one_->forward(l.layer_id, a);
      a.out = outn.view();
      a.lse = lsen.view();
      dcp_->forward(l.layer_id, a);
      const std::string name = what + " layer " + std::to_string(l.layer_id);
      test::expect_close(outn.view(), out1.view(), tol, name + " out");
      test::expect_close(lsen.view(), lse1.view(), tol, name + " lse");
      if (twin_) {
        HostBuffer outt(DType::f32, {T, hq, dv}), lset(DType::f32, {T, hq});
        test::poison(outt.view());
        test::poison(lset.view());
        a.out = outt.view();
        a.lse = lset.view();
        twin_->forward(l.layer_id, a);
        EXPECT_EQ(std::memcmp(outt.data(), outn.data(), outn.view().numel() * sizeof(float)), 0)
            << name << " out: request rows and key-list rows differ";
        EXPECT_EQ(std::memcmp(lset.data(), lsen.data(), lsen.view().numel() * sizeof(float)), 0)
            << name << " lse: request rows and key-list rows differ";
      }
    }
    one_->end_step();
    dcp_->end_step();
    if (twin_) twin_->end_step();
    return b;
  }

  // After a tree verify step: both keep the accepted paths (the oracle as an engine does: the
  // accepted nodes' K/V copied down to columns seq_len + k; the group by commit_verify).
  void commit(const ForwardBatch& verify, const std::vector<std::vector<int32_t>>& paths) {
    test::commit_accepted(*one_, *dcp_, model_, verify, paths);
  }

  // A random path from the root down `parents` (block indices, root first).
  std::vector<int32_t> random_path(const int32_t* parents, int n) {
    return test::random_path(parents, n, rng_);
  }

  int rand_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  // Requests with cached prefixes of random (ragged) lengths in [0, max_prefix], stored by an
  // EXTEND step from 0 (itself compared); returns the prefix lengths.
  // Prefills each request with a random prefix of at most max_prefix tokens (the first at least
  // one), in one EXTEND step: the bound is cut so the step fits max_num_tokens (4 requests x 70
  // could draw 280 > 256).
  std::vector<int32_t> fill(const std::vector<int64_t>& rows, int max_prefix) {
    max_prefix = std::min(max_prefix, kStepTokens / static_cast<int>(rows.size()));
    std::vector<int32_t> prefix;
    std::vector<int64_t> fill_rows;
    std::vector<int32_t> fill_lens;
    for (size_t i = 0; i < rows.size(); ++i) {
      prefix.push_back(rand_int(i == 0 ? 1 : 0, max_prefix));
      if (prefix.back() > 0) {
        fill_rows.push_back(rows[i]);
        fill_lens.push_back(prefix.back());
      }
    }
    run_and_compare(
        make_extend_batch(fill_rows, std::vector<int32_t>(fill_rows.size(), 0), fill_lens),
        "prefill");
    return prefix;
  }

  // A random tree of n tokens (parents precede children), not a chain.
  std::vector<int32_t> random_tree(int n) {
    std::vector<int32_t> p(n, -1);
    for (int t = 1; t < n; ++t) p[t] = rand_int(0, t - 1);
    if (n >= 3) p[2] = 0;  // a sibling of token 1
    return p;
  }

 private:
  ModelSpec model_;
  std::mt19937 rng_;
  std::unique_ptr<AttentionRuntime> one_;
  std::unique_ptr<DcpAttention> dcp_;
  std::unique_ptr<DcpAttention> twin_;
};

class DcpMatchesOneRuntime : public testing::TestWithParam<DcpCase> {
 protected:
  void SetUp() override {
    seed_ = fresh_seed();
    trace_.emplace(__FILE__, __LINE__, "seed " + std::to_string(seed_));
  }
  uint32_t seed_ = 0;
  std::optional<testing::ScopedTrace> trace_;
};

TEST_P(DcpMatchesOneRuntime, ExtendOverAPrefixThenDecode) {
  for (const ModelSpec& model : {gqa_model(), mla_model()}) {
    DcpHarness h(model, GetParam(), seed_);
    const auto rows = h.alloc_requests(h.rand_int(1, 4));
    std::vector<int32_t> prefix = h.fill(rows, 70);
    std::vector<int32_t> ext, seq;
    for (size_t i = 0; i < rows.size(); ++i) ext.push_back(h.rand_int(1, 19));
    h.run_and_compare(make_extend_batch(rows, prefix, ext), model.name + " extend");
    for (size_t i = 0; i < rows.size(); ++i) seq.push_back(prefix[i] + ext[i] + 1);
    h.run_and_compare(make_decode_batch(rows, seq), model.name + " decode");
    for (int32_t& s : seq) ++s;
    h.run_and_compare(make_decode_batch(rows, seq), model.name + " decode 2");
  }
}

TEST_P(DcpMatchesOneRuntime, MixedChunkedPrefillAndDecodes) {
  DcpHarness h(gqa_model(), GetParam(), seed_);
  const auto rows = h.alloc_requests(4);
  std::vector<int32_t> prefix = h.fill(rows, 35);
  std::vector<int32_t> ext;
  for (size_t i = 0; i < rows.size(); ++i) ext.push_back(i % 2 == 0 ? h.rand_int(2, 17) : 1);
  h.run_and_compare(make_extend_batch(rows, prefix, ext, ForwardMode::MIXED), "mixed");
}

TEST_P(DcpMatchesOneRuntime, ChainVerifyThenDecodeAfterAcceptance) {
  for (const ModelSpec& model : {gqa_model(), mla_model()}) {
    DcpHarness h(model, GetParam(), seed_);
    const auto rows = h.alloc_requests(h.rand_int(1, 4));
    std::vector<int32_t> prefix = h.fill(rows, 70);
    const int n = 5;
    h.run_and_compare(
        make_verify_batch(rows, prefix, SpecInfo::chain(static_cast<int>(rows.size()), n)),
        model.name + " chain verify");
    // Accept a random number of drafts: the next decode's prefix ends inside the old block and the
    // group releases what lies beyond it.
    std::vector<int32_t> seq;
    for (int32_t p : prefix) seq.push_back(p + h.rand_int(0, n - 1) + 2);
    h.run_and_compare(make_decode_batch(rows, seq), model.name + " decode after verify");
  }
}

TEST_P(DcpMatchesOneRuntime, TreeVerifyThenDecodeAfterCommit) {
  for (const ModelSpec& model : {gqa_model(), mla_model()}) {
    DcpHarness h(model, GetParam(), seed_, /*tree=*/true);
    const auto rows = h.alloc_requests(h.rand_int(1, 4));
    std::vector<int32_t> prefix = h.fill(rows, 70);
    const int n = 6;
    SpecInfo spec;
    spec.draft_token_num = n;
    spec.topk = 2;
    for (size_t i = 0; i < rows.size(); ++i) {
      for (int32_t p : h.random_tree(n)) spec.parents.push_back(p);
    }
    const ForwardBatch v =
        h.run_and_compare(make_verify_batch(rows, prefix, spec), model.name + " tree verify");
    // Keep a random path of each tree; the next decode sees exactly the accepted tokens.
    std::vector<std::vector<int32_t>> paths;
    std::vector<int32_t> seq;
    for (size_t i = 0; i < rows.size(); ++i) {
      paths.push_back(h.random_path(spec.parents.data() + i * n, n));
      seq.push_back(prefix[i] + static_cast<int32_t>(paths.back().size()) + 1);
    }
    std::vector<std::vector<int32_t>> bad = paths;
    bad[0] = {1};
    test::expect_error([&] { h.dcp().commit_verify(v, bad); }, {"accepted[0] = [1] is not a path"});
    h.commit(v, paths);
    h.run_and_compare(make_decode_batch(rows, seq), model.name + " decode after tree commit");
  }
}

TEST_P(DcpMatchesOneRuntime, Fp8KvWithScales) {
  for (const ModelSpec& model : {gqa_model(), mla_model()}) {
    DcpHarness h(model, GetParam(), seed_, false, false, "fp8_e4m3");
    for (const LayerSpec& l : model.layers) {
      h.set_kv_scales(l.layer_id, 0.37f, l.kind == LayerKind::mla ? 0.37f : 1.7f);
    }
    const auto rows = h.alloc_requests(3);
    std::vector<int32_t> prefix = h.fill(rows, 30);
    std::vector<int32_t> seq;
    for (int32_t p : prefix) seq.push_back(p + 1);
    h.run_and_compare(make_decode_batch(rows, seq), model.name + " fp8 decode", 2e-3);
  }
}

TEST_P(DcpMatchesOneRuntime, DraftExtend) {
  DcpHarness h(gqa_model(), GetParam(), seed_);
  const auto rows = h.alloc_requests(3);
  std::vector<int32_t> prefix = h.fill(rows, 30);
  std::vector<int32_t> accept, seq;
  for (int32_t p : prefix) {
    accept.push_back(h.rand_int(0, 3));
    seq.push_back(p + accept.back() + 1);
  }
  h.run_and_compare(make_draft_extend_batch(rows, seq, accept), "draft extend");
}

INSTANTIATE_TEST_SUITE_P(Ranks, DcpMatchesOneRuntime,
                         testing::Values(DcpCase{"reference", 1, 1}, DcpCase{"reference", 2, 16},
                                         DcpCase{"reference", 3, 1}, DcpCase{"reference", 4, 16},
                                         DcpCase{"cpu", 1, 16}, DcpCase{"cpu", 2, 1},
                                         DcpCase{"cpu", 3, 16}, DcpCase{"cpu", 4, 1}),
                         case_name);

// Full attention only (GQA with soft-cap, a layer with sinks): every part is the full one, so a
// rank's step counts are those of the request rows.
ModelSpec full_model() {
  ModelSpec m = gqa_model();
  m.layers.pop_back();
  m.name = "dcp-full";
  return m;
}

// Direct request rows (docs/dcp.md "Each rank's batch"): a DECODE entry reads its request's own
// row, written incrementally, and gives the bits of the same entry read from a key-list copy
// (the twin group, set_direct_rows(false)); both match the oracle. Steps with growing lengths
// around page edges, a chain verify whose rejected drafts are dropped, a request freed and its row
// reused, a row reused from prefix 0 without free_request; MLA and a sliding-window model too.
class DcpDirectRows : public DcpMatchesOneRuntime {};

// On every rank, after begin_step of `b`: a DECODE step reads request rows only (one entry per
// request that sees a key there), each row's columns [0, count) are the request's local columns,
// and a step copies no more slot ids than the columns its rows did not hold yet.
void expect_direct_decode(DcpAttention& g, const ForwardBatch& b, bool first_use) {
  const int n = g.size();
  for (int r = 0; r < n; ++r) {
    DcpRank& rank = g.rank(r);
    const DcpRank::StepCounts& c = rank.step_counts();
    int64_t entries = 0, owned = 0;
    for (int i = 0; i < b.batch_size; ++i) {
      const int row = static_cast<int>(b.req_pool_indices[i]);
      const int32_t count = dcp_local_count(b.seq_lens[i], r, n);
      if (count == 0) continue;
      ++entries;
      owned += (b.seq_lens[i] - 1) % n == r;
      const std::vector<int32_t>& local = rank.local_row(row);
      ASSERT_GE(local.size(), static_cast<size_t>(count)) << "rank " << r << " row " << row;
      const ReqToTokenPool& pool = rank.runtime().req_to_token();
      const int32_t* slots = pool.row_ptr(rank.request_row(row));
      for (int32_t j = 0; j < count; ++j) {
        ASSERT_EQ(slots[j], local[j]) << "rank " << r << " row " << row << " column " << j;
      }
    }
    EXPECT_EQ(c.listed, 0) << "rank " << r << ": a DECODE entry read a key-list row";
    EXPECT_EQ(c.direct, entries) << "rank " << r;
    if (!first_use) EXPECT_LE(c.copied, owned) << "rank " << r << ": more than the new columns";
  }
}

// The twin group (set_direct_rows(false)) reads key-list rows only.
void expect_key_lists_only(DcpAttention& twin) {
  for (int r = 0; r < twin.size(); ++r) EXPECT_EQ(twin.rank(r).step_counts().direct, 0);
}

TEST_P(DcpDirectRows, DecodeReadsRequestRowsWithTheBitsOfKeyLists) {
  const int page = GetParam().page_size, n = GetParam().ranks;
  DcpHarness h(full_model(), GetParam(), seed_, false, /*deterministic=*/true, "fp32",
               /*twin=*/true);
  const auto rows = h.alloc_requests(3);
  // Lengths whose local counts end around page edges (a page of `page` local columns is
  // n * page global tokens).
  std::vector<int32_t> len;
  for (size_t i = 0; i < rows.size(); ++i) {
    len.push_back(page == 1 ? h.rand_int(1, 40)
                            : std::max(1, n * page + h.rand_int(-2 * n, 2 * n)));
  }
  // Prefills in chunks of at most 100 tokens (a step holds max_num_tokens = 256).
  auto prefill = [&](const std::vector<int64_t>& rs, const std::vector<int32_t>& lens) {
    for (size_t i = 0; i < rs.size(); ++i) {
      for (int32_t done = 0; done < lens[i]; done += 100) {
        h.run_and_compare(make_extend_batch({rs[i]}, {done}, {std::min(100, lens[i] - done)}),
                          "prefill " + std::to_string(i) + " from " + std::to_string(done));
      }
    }
  };
  prefill(rows, len);
  // Decodes, growing; the first writes the request rows, the next ones one column per token.
  std::vector<int32_t> seq = len;
  bool first = true;
  h.on_begin = [&](const ForwardBatch& b) {
    expect_direct_decode(h.dcp(), b, first);
    expect_key_lists_only(h.twin());
  };
  for (int step = 0; step < 2 * n + 2; ++step) {
    for (int32_t& s : seq) ++s;
    h.run_and_compare(make_decode_batch(rows, seq), "decode " + std::to_string(step));
    first = false;
  }
  // A chain verify (key lists: several entries per request), then a decode after a random
  // acceptance: the drafts beyond it are dropped on the ranks.
  h.on_begin = nullptr;
  const int nd = 5;
  h.run_and_compare(make_verify_batch(rows, seq, SpecInfo::chain(3, nd)), "chain verify");
  for (int32_t& s : seq) s += h.rand_int(0, nd - 1) + 1;
  h.on_begin = [&](const ForwardBatch& b) {
    expect_direct_decode(h.dcp(), b, true);
    expect_key_lists_only(h.twin());
  };
  for (int step = 0; step < 2; ++step) {
    for (int32_t& s : seq) ++s;
    h.run_and_compare(make_decode_batch(rows, seq), "decode after verify " + std::to_string(step));
  }
  // Request 0 ends and its row is reused by a new request; request 1's row is reused from prefix
  // 0 without free_request (the step releases it).
  h.on_begin = nullptr;
  h.free_request(rows[0]);
  seq[0] = page == 1 ? h.rand_int(1, 30) : n * page + h.rand_int(-n, n);
  seq[1] = page == 1 ? h.rand_int(1, 30) : 2 * n * page + h.rand_int(-n, n);
  prefill({rows[0], rows[1]}, {seq[0], seq[1]});
  h.on_begin = [&](const ForwardBatch& b) {
    expect_direct_decode(h.dcp(), b, true);
    expect_key_lists_only(h.twin());
  };
  for (int step = 0; step < n + 1; ++step) {
    for (int32_t& s : seq) ++s;
    h.run_and_compare(make_decode_batch(rows, seq), "decode of reused rows " + std::to_string(step));
  }
}

// Mixed steps (chunked prefill and decodes), MLA and a sliding-window model: the decodes of a
// MIXED step read request rows, the rest key lists; the bits of the twin everywhere.
TEST_P(DcpDirectRows, MixedStepsMlaAndWindowsGiveTheBitsOfKeyLists) {
  for (const ModelSpec& model : {gqa_model(), mla_model()}) {
    DcpHarness h(model, GetParam(), seed_, false, /*deterministic=*/true, "fp32", /*twin=*/true);
    const auto rows = h.alloc_requests(4);
    std::vector<int32_t> prefix = h.fill(rows, 60);
    std::vector<int32_t> ext;
    for (size_t i = 0; i < rows.size(); ++i) ext.push_back(i % 2 == 0 ? h.rand_int(2, 17) : 1);
    h.run_and_compare(make_extend_batch(rows, prefix, ext, ForwardMode::MIXED), "mixed");
    for (size_t i = 0; i < rows.size(); ++i) prefix[i] += ext[i];
    for (int step = 0; step < 3; ++step) {
      std::vector<int32_t> seq;
      for (int32_t& p : prefix) seq.push_back(++p);
      h.run_and_compare(make_decode_batch(rows, seq), model.name + " decode " + std::to_string(step));
    }
  }
}

// A tree verify (key lists), its accepted paths committed (KV rows copied down on the ranks; the
// columns keep their slots), then decodes on request rows: the bits of the twin.
TEST_P(DcpDirectRows, TreeCommitThenDecodesGiveTheBitsOfKeyLists) {
  DcpHarness h(full_model(), GetParam(), seed_, /*tree=*/true, /*deterministic=*/true, "fp32",
               /*twin=*/true);
  const auto rows = h.alloc_requests(3);
  std::vector<int32_t> prefix = h.fill(rows, 70);
  const int nd = 6;
  SpecInfo spec;
  spec.draft_token_num = nd;
  spec.topk = 2;
  for (size_t i = 0; i < rows.size(); ++i) {
    for (int32_t p : h.random_tree(nd)) spec.parents.push_back(p);
  }
  const ForwardBatch v = h.run_and_compare(make_verify_batch(rows, prefix, spec), "tree verify");
  std::vector<std::vector<int32_t>> paths;
  std::vector<int32_t> seq;
  for (size_t i = 0; i < rows.size(); ++i) {
    paths.push_back(h.random_path(spec.parents.data() + i * nd, nd));
    seq.push_back(prefix[i] + static_cast<int32_t>(paths.back().size()) + 1);
  }
  test::commit_accepted(h.one(), h.dcp(), full_model(), v, paths);
  h.twin().commit_verify(v, paths);
  h.on_begin = [&](const ForwardBatch& b) {
    expect_direct_decode(h.dcp(), b, true);
    expect_key_lists_only(h.twin());
  };
  for (int step = 0; step < 3; ++step) {
    h.run_and_compare(make_decode_batch(rows, seq), "decode after commit " + std::to_string(step));
    for (int32_t& s : seq) ++s;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, DcpDirectRows,
                         testing::Values(DcpCase{"reference", 2, 1}, DcpCase{"reference", 3, 16},
                                         DcpCase{"reference", 2, 64}, DcpCase{"cpu", 2, 16},
                                         DcpCase{"cpu", 3, 1}, DcpCase{"cpu", 3, 64},
                                         DcpCase{"cpu", 4, 16}),
                         case_name);

// The same step merged twice gives bit-identical outputs: the merge order is the rank order.
TEST(Dcp, MergeOrderIsFixed) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    Options o;
    o.attention_backend = "cpu";
    o.dcp_size = 3;
    o.deterministic = true;
    o.kv_cache_dtype = "fp32";
    const RuntimeConfig cfg = test::host_config(2, 1024, 64);
    DcpAttention g(gqa_model(), o, cfg);
    std::mt19937 rng(seed);
    ForwardBatch b = make_extend_batch({1}, {0}, {37});
    b.out_cache_loc.assign(37, 0);
    g.begin_step(b);
    const LayerSpec& l = g.model().layers[0];
    HostBuffer q = test::random_buffer(DType::f32, {37, l.num_q_heads, l.head_dim}, rng);
    HostBuffer k = test::random_buffer(DType::f32, {37, l.num_kv_heads, l.head_dim}, rng);
    HostBuffer v = test::random_buffer(DType::f32, {37, l.num_kv_heads, l.head_dim}, rng);
    HostBuffer out(DType::f32, {37, l.num_q_heads, l.head_dim});
    test::poison(out.view());
    g.forward(0, AttnArgs{.q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()});
    g.end_step();
    const float* p = out.view().ptr<float>();
    std::vector<float> got(p, p + out.view().numel());
    if (run == 0) {
      first = got;
    } else {
      EXPECT_EQ(std::memcmp(first.data(), got.data(), got.size() * sizeof(float)), 0);
    }
  }
}

// Packed partial [o | lse] of one (row, head).
std::vector<float> part(std::vector<float> o, float lse) {
  o.push_back(lse);
  return o;
}

TEST(DcpMerge, EqualsOneSoftmaxOverTheUnion) {
  // Keys with scores s and values x, split over three ranks (the second gets none).
  const std::vector<double> s = {0.3, -1.2, 2.0, 0.7, -0.1};
  const std::vector<double> x = {1.0, -2.0, 0.5, 3.0, -1.0};
  const std::vector<std::vector<int>> split = {{0, 3}, {}, {1, 2, 4}};
  auto partial = [&](const std::vector<int>& keys) {
    if (keys.empty()) return part({0.f}, -kInf);
    double m = -1e300, den = 0.0, acc = 0.0;
    for (int j : keys) m = std::max(m, s[j]);
    for (int j : keys) {
      den += std::exp(s[j] - m);
      acc += std::exp(s[j] - m) * x[j];
    }
    return part({static_cast<float>(acc / den)}, static_cast<float>(m + std::log(den)));
  };
  std::vector<std::vector<float>> parts;
  for (const auto& keys : split) parts.push_back(partial(keys));
  const std::vector<const float*> ptrs = {parts[0].data(), parts[1].data(), parts[2].data()};
  const std::vector<float> whole = partial({0, 1, 2, 3, 4});
  float o = 0.f;
  const float lse = dcp_merge(ptrs, 1, std::nullopt, &o);
  EXPECT_NEAR(o, whole[0], 1e-6);
  EXPECT_NEAR(lse, whole[1], 1e-6);
  // A sink only enlarges the denominator.
  const float sink = 0.4f;
  const float lse_s = dcp_merge(ptrs, 1, sink, &o);
  const double den = std::exp(double{whole[1]}) + std::exp(double{sink});
  EXPECT_NEAR(o, whole[0] * std::exp(double{whole[1]}) / den, 1e-6);
  EXPECT_NEAR(lse_s, std::log(den), 1e-6);
}

TEST(DcpMerge, RanksWithoutKeysContributeNothing) {
  const std::vector<float> a = part({1.5f, -2.f}, 0.25f), empty = part({7.f, 7.f}, -kInf);
  const std::vector<const float*> ptrs = {empty.data(), a.data(), empty.data()};
  float o[2];
  EXPECT_EQ(dcp_merge(ptrs, 2, std::nullopt, o), 0.25f);
  EXPECT_EQ(o[0], 1.5f);
  EXPECT_EQ(o[1], -2.f);
}

TEST(DcpMerge, EveryRankEmptyGivesZeroAndMinusInfinity) {
  const std::vector<float> empty = part({3.f}, -kInf);
  const std::vector<const float*> ptrs = {empty.data(), empty.data()};
  float o = 1.f;
  EXPECT_EQ(dcp_merge(ptrs, 1, std::nullopt, &o), -kInf);
  EXPECT_EQ(o, 0.f);
  // With a sink and no keys: output 0, lse = the sink.
  EXPECT_EQ(dcp_merge(ptrs, 1, 1.5f, &o), 1.5f);
  EXPECT_EQ(o, 0.f);
}

TEST(DcpLayout, TokensInterleaveOverRanks) {
  for (int n = 1; n <= 5; ++n) {
    for (int x = 0; x < 23; ++x) {
      int total = 0;
      for (int r = 0; r < n; ++r) {
        int want = 0;
        for (int g = 0; g < x; ++g) want += g % n == r;
        EXPECT_EQ(dcp_local_count(x, r, n), want) << "x " << x << " r " << r << " n " << n;
        total += want;
      }
      EXPECT_EQ(total, x);
    }
  }
  EXPECT_EQ(dcp_head_begin(0, 6, 4), 0);
  EXPECT_EQ(dcp_head_begin(4, 6, 4), 6);
}

TEST(InProcessCommunicator, AllToAllAndAllGatherMoveBlocksInRankOrder) {
  InProcessCommunicator c(3);
  // Rank s sends (10 s + d) repeated d + 1 times to rank d.
  std::vector<std::vector<float>> send(3), recv(3);
  std::vector<std::vector<int64_t>> sc(3), rc(3);
  for (int s = 0; s < 3; ++s) {
    for (int d = 0; d < 3; ++d) {
      sc[s].push_back(d + 1);
      rc[s].push_back(s + 1);
      for (int i = 0; i <= d; ++i) send[s].push_back(static_cast<float>(10 * s + d));
    }
    recv[s].assign(3 * (s + 1), -1.f);
  }
  for (int r : {2, 0, 1}) c.all_to_all(r, send[r], sc[r], recv[r], rc[r]);
  for (int d = 0; d < 3; ++d) {
    for (int s = 0; s < 3; ++s) {
      for (int i = 0; i <= d; ++i) EXPECT_EQ(recv[d][s * (d + 1) + i], 10.f * s + d);
    }
  }
  std::vector<std::vector<float>> g(3, std::vector<float>(6));
  const std::vector<std::vector<float>> mine = {{1, 2}, {3, 4}, {5, 6}};
  for (int r = 0; r < 3; ++r) c.all_gather(r, mine[r], g[r]);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(g[r], (std::vector<float>{1, 2, 3, 4, 5, 6}));
  for (int r = 0; r < 3; ++r) c.barrier(r);
}

TEST(InProcessCommunicator, MismatchedCallsAreErrors) {
  InProcessCommunicator c(2);
  std::vector<float> a(2), b(4);
  c.all_gather(0, a, b);
  test::expect_error([&] { c.barrier(1); }, {"rank 1 called barrier while all_gather is pending"});
  test::expect_error([&] { c.all_gather(0, a, b); }, {"rank 0 called all_gather twice"});
  std::vector<float> small(3);
  test::expect_error([&] { c.all_gather(1, small, b); }, {"rank 1 sends 3 floats", "holds 4"});
}

TEST(Communicator, UnknownKindsAreListed) {
  // make_communicator("nccl", n): tests/test_cuda_nccl.cpp.
  test::expect_error([] { make_communicator("mpi", 2); },
                     {"'mpi' is unknown", "in_process, device_in_process, nccl"});
  EXPECT_FALSE(make_communicator("in_process", 2)->device_buffers());
}

// GPU tensors reach only cuda ranks; host ranks name the mismatch before touching the data.
TEST(Dcp, GpuTensorsOnHostRanksAreAnError) {
  Options o;
  o.attention_backend = "reference";
  o.dcp_size = 2;
  DcpAttention g(gqa_model(), o, test::host_config(2, 256, 32));
  g.reserve_prefix(0, 4);
  ForwardBatch b = make_decode_batch({0}, {5});
  b.out_cache_loc.assign(1, 0);
  g.begin_step(b);
  TensorView q(reinterpret_cast<void*>(uintptr_t{4096}), DType::bf16, {1, 6, 16},
               Device::cuda(0));
  test::expect_error([&] { g.forward(0, AttnArgs{.q = q, .out = q}); },
                     {"q is bf16[1, 6, 16] on cuda", "host backends", "pass host tensors"});
  g.end_step();
}

// set_stream on host ranks changes nothing (host pools have no stream, as one runtime's; nor has
// the in_process communicator): a prefill and a decode give the bits of a group never moved.
TEST(Dcp, SetStreamOnHostRanksIsHarmless) {
  Options o;
  o.attention_backend = "reference";
  o.dcp_size = 2;
  const RuntimeConfig cfg = test::host_config(2, 256, 32);
  DcpAttention moved(gqa_model(), o, cfg), plain(gqa_model(), o, cfg);
  void* stream = reinterpret_cast<void*>(uintptr_t{4096});
  moved.set_stream(stream);
  moved.communicator().set_stream(1, stream);
  EXPECT_EQ(moved.stream(), nullptr);
  EXPECT_EQ(moved.communicator().stream(1), nullptr);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(moved.rank(r).stream(), nullptr) << "rank " << r;
  std::mt19937 rng(fresh_seed());
  for (ForwardBatch b : {make_extend_batch({0}, {0}, {7}), make_decode_batch({0}, {8})}) {
    b.out_cache_loc.assign(b.positions.size(), 0);
    const int64_t T = b.num_tokens();
    HostBuffer q = test::random_buffer(DType::f32, {T, 6, 16}, rng);
    HostBuffer k = test::random_buffer(DType::f32, {T, 2, 16}, rng);
    HostBuffer v = test::random_buffer(DType::f32, {T, 2, 16}, rng);
    HostBuffer out_moved(DType::f32, {T, 6, 16}), out_plain(DType::f32, {T, 6, 16});
    for (auto [g, out] : {std::pair{&moved, &out_moved}, std::pair{&plain, &out_plain}}) {
      g->begin_step(b);
      g->forward(0, AttnArgs{.q = q.view(), .k = k.view(), .v = v.view(), .out = out->view()});
      g->end_step();
    }
    EXPECT_EQ(std::memcmp(out_moved.view().data, out_plain.view().data, T * 6 * 16 * sizeof(float)),
              0)
        << forward_mode_name(b.mode) << ": the group told of a stream differs";
  }
}

// reserve_prefix: a long context without its prefill. Each rank holds its columns, and a decode
// over them plans (forward and exchange in their two halves, partial + exchange, too).
TEST(Dcp, ReservePrefixAllocatesEachRanksColumns) {
  Options o;
  o.attention_backend = "reference";
  o.dcp_size = 3;
  DcpAttention g(gqa_model(), o, test::host_config(2, 256, 32, 64));
  g.reserve_prefix(1, 10);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(g.rank(r).local_row(1).size(), static_cast<size_t>(dcp_local_count(10, r, 3)))
        << "rank " << r;
  }
  g.reserve_prefix(1, 7);  // already held: nothing changes
  EXPECT_EQ(g.rank(0).local_row(1).size(), 4u);
  ForwardBatch b = make_decode_batch({1}, {11});
  b.out_cache_loc.assign(1, 0);
  g.begin_step(b);
  std::mt19937 rng(7);
  HostBuffer q = test::random_buffer(DType::f32, {1, 6, 16}, rng);
  HostBuffer out(DType::f32, {1, 6, 16});
  test::poison(out.view());
  const AttnArgs a{.q = q.view(), .out = out.view()};
  for (int r = 0; r < 3; ++r) g.rank(r).partial(0, a);
  for (int r = 0; r < 3; ++r) g.rank(r).exchange();
  for (int r = 0; r < 3; ++r) g.rank(r).merge(0, a);
  for (int64_t i = 0; i < out.view().numel(); ++i) {
    EXPECT_TRUE(std::isfinite(out.view().ptr<float>()[i])) << "out[" << i << "] not written";
  }
  test::expect_error([&] { g.rank(0).exchange(); }, {"exchange() without a partial"});
  g.end_step();
  test::expect_error([&] { g.reserve_prefix(1, 65); }, {"65 tokens", "max_context_len = 64"});
}

// The fixed buffers of a rank's CUDA-graph steps (docs/dcp.md "CUDA graphs") hold the largest
// layer of each: 6 / 2 heads of 16 (the q rows, the partial and the send buffer), the 4 / 4 heads
// with v_head_dim 12 (v rows), the uneven split of 6 heads over 4 ranks (1, 2, 1, 2: the
// receive buffer), one entry list per window; MLA gathers no v. Activations at the model's dtype,
// at least 2 bytes.
TEST(DcpGraph, SizesHoldTheLargestLayerOfEachBuffer) {
  const DcpGraphSizes s0 = dcp_graph_sizes(gqa_model(), 4, 0, 5);
  const DcpGraphSizes s1 = dcp_graph_sizes(gqa_model(), 4, 1, 5);
  EXPECT_EQ(s1.tokens, 5);
  EXPECT_EQ(s1.gather[0], 5u * 6 * 16 * 4);  // q of layer 0
  EXPECT_EQ(s1.gather[1], 5u * 2 * 16 * 4);  // k: 2 x 16 = 4 x 8 per row
  EXPECT_EQ(s1.gather[2], 5u * 4 * 12 * 4);  // v of layer 1
  EXPECT_EQ(s1.out, 5u * 6 * 16 * 4);
  EXPECT_EQ(s1.lse, 5u * 6 * 4);
  EXPECT_EQ(s1.send, 5u * 6 * 17 * 4);      // every head, dv + 1 floats
  EXPECT_EQ(s0.recv, 4u * 5 * 1 * 17 * 4);  // rank 0 merges 1 head of layer 0 (and of 2)
  EXPECT_EQ(s1.recv, 4u * 5 * 2 * 17 * 4);  // rank 1 merges 2 of layer 0
  EXPECT_EQ(s1.index, 2u * 5 * 8);
  EXPECT_EQ(s1.parts, 2);  // full attention and the window of 9
  EXPECT_EQ(s1.total(), s1.gather[0] + s1.gather[1] + s1.gather[2] + s1.out + s1.lse + s1.send +
                            s1.recv + 2 * s1.index);
  // Rows scale every buffer; bf16 activations take 2 bytes, fp32 ones (lse, partials) stay 4.
  ModelSpec half = gqa_model();
  half.dtype = DType::bf16;
  const DcpGraphSizes h = dcp_graph_sizes(half, 4, 1, 10);
  EXPECT_EQ(h.gather[0], 10u * 6 * 16 * 2);
  EXPECT_EQ(h.out, 10u * 6 * 16 * 2);
  EXPECT_EQ(h.send, 2 * s1.send);
  EXPECT_EQ(h.recv, 2 * s1.recv);
  ModelSpec fp8 = gqa_model();
  fp8.dtype = DType::e4m3;
  EXPECT_EQ(dcp_graph_sizes(fp8, 4, 1, 5).gather[0], 5u * 6 * 16 * 2);
  const DcpGraphSizes m = dcp_graph_sizes(mla_model(), 2, 1, 3);
  EXPECT_EQ(m.gather[0], 3u * 5 * 40 * 4);
  EXPECT_EQ(m.gather[1], 3u * 1 * 40 * 4);  // the latent rows
  EXPECT_EQ(m.gather[2], 0u);               // V is a view of them
  EXPECT_EQ(m.out, 3u * 5 * 32 * 4);
  EXPECT_EQ(m.recv, 2u * 3 * 3 * 33 * 4);  // rank 1 merges heads 2..4
  EXPECT_EQ(m.parts, 1);
  test::expect_error([] { dcp_graph_sizes(mla_model(), 2, 0, 0); }, {"0 tokens"});
  test::expect_error([] { dcp_graph_sizes(mla_model(), 2, 2, 4); }, {"rank 2 of 2"});
}

// The entry list the device work reads: an eager step's entries then each row's entry (-1: no
// entry here); a graph step's padded to the captured rows with row 0, which no row maps to.
TEST(DcpGraph, EntryListsPadToTheCapturedRows) {
  const std::vector<int64_t> rows = {3, 0, 4};
  std::vector<int64_t> eager(3 + 6, 99), graph(6 + 6, 99), none(4 + 4, 99);
  dcp_entry_list(rows, 3, 6, eager.data());
  EXPECT_EQ(eager, (std::vector<int64_t>{3, 0, 4, 1, -1, -1, 0, 2, -1}));
  dcp_entry_list(rows, 6, 6, graph.data());
  EXPECT_EQ(graph, (std::vector<int64_t>{3, 0, 4, 0, 0, 0, 1, -1, -1, 0, 2, -1}));
  dcp_entry_list({}, 4, 4, none.data());  // a rank without a key for any row: every row empty
  EXPECT_EQ(none, (std::vector<int64_t>{0, 0, 0, 0, -1, -1, -1, -1}));
  std::vector<int64_t> buf(16);
  test::expect_error([&] { dcp_entry_list(rows, 2, 6, buf.data()); }, {"3 entries in a list of 2"});
  test::expect_error([&] { dcp_entry_list(rows, 3, 4, buf.data()); },
                     {"entry 2 is row 4", "rows 0..3"});
}

// Host ranks have no graph steps: the reason names the host and what is needed, every graph call
// is refused with it, and eager steps go on.
TEST(DcpGraph, HostRanksRefuseGraphStepsWithTheReason) {
  Options o;
  o.attention_backend = "reference";
  o.dcp_size = 2;
  RuntimeConfig cfg = test::host_config(2, 256, 32);
  cfg.cuda_graphs = true;
  DcpAttention g(gqa_model(), o, cfg);
  EXPECT_FALSE(g.cuda_graphs_enabled());
  EXPECT_NE(g.cuda_graphs_off_reason().find("on the host"), std::string::npos)
      << g.cuda_graphs_off_reason();
  EXPECT_NE(g.cuda_graphs_off_reason().find("cuda ranks"), std::string::npos);
  test::expect_error([&] { g.init_cuda_graph_state(8); },
                     {"init_cuda_graph_state", "CUDA graphs are off", "on the host"});
  test::expect_error([&] { g.begin_capture_step(4); },
                     {"begin_capture_step", "CUDA graphs are off"});
  ForwardBatch b = make_extend_batch({0}, {0}, {3});
  b.out_cache_loc.assign(3, 0);
  test::expect_error([&] { g.begin_replay_step(b, 4); },
                     {"begin_replay_step", "CUDA graphs are off"});
  EXPECT_TRUE(g.rank(0).local_row(0).empty()) << "a refused replay stored a token";
  g.begin_step(b);
  std::mt19937 rng(fresh_seed());
  HostBuffer q = test::random_buffer(DType::f32, {3, 6, 16}, rng);
  HostBuffer k = test::random_buffer(DType::f32, {3, 2, 16}, rng);
  HostBuffer v = test::random_buffer(DType::f32, {3, 2, 16}, rng);
  HostBuffer out(DType::f32, {3, 6, 16});
  test::poison(out.view());
  g.forward(0, AttnArgs{.q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()});
  g.end_step();
  for (int64_t i = 0; i < out.view().numel(); ++i) {
    ASSERT_TRUE(std::isfinite(out.view().ptr<float>()[i])) << "out[" << i << "] not written";
  }
}

TEST(Dcp, OptionErrorsNameTheValueAndWhatIsAllowed) {
  Options o;
  o.attention_backend = "reference";
  o.dcp_size = 0;
  test::expect_error([&] { validate_dcp(gqa_model(), o); }, {"dcp_size = 0", "[1, 64]"});
  o.dcp_size = 65;
  test::expect_error([&] { validate_dcp(gqa_model(), o); }, {"dcp_size = 65", "[1, 64]"});
  o.dcp_size = 2;
  ModelSpec enc = gqa_model();
  enc.layers[1].attn_type = AttnType::encoder_only;
  test::expect_error([&] { validate_dcp(enc, o); }, {"dcp_size = 2", "layer 1", "not causal"});
  o.dcp_size = 1;
  validate_dcp(enc, o);
  o.dcp_size = 2;
  test::expect_error([&] { AttentionRuntime rt(gqa_model(), o); },
                     {"Options.dcp_size = 2", "DcpAttention"});
}

TEST(Dcp, MisuseIsAnError) {
  Options o;
  o.attention_backend = "reference";
  o.dcp_size = 2;
  const RuntimeConfig cfg = test::host_config(2, 256, 32);
  DcpAttention g(gqa_model(), o, cfg);
  // A decode whose prefix was never stored.
  const int row = 1;
  ForwardBatch b = make_decode_batch({row}, {5});
  b.out_cache_loc.assign(1, 0);
  test::expect_error([&] { g.begin_step(b); }, {"prefix of 4 tokens", "rank 0 holds 0 of its 2"});
  // An IDLE step does nothing, even without tensors.
  const ForwardBatch idle = make_idle_batch();
  g.begin_step(idle);
  g.forward(0, AttnArgs{});
  g.end_step();
  test::expect_error(
      [&] {
        HostBuffer q(DType::f32, {1, 6, 16});
        g.forward(0, AttnArgs{.q = q.view(), .out = q.view()});
      },
      {"outside a step"});
  // A step with more query rows than the key-list rows a rank keeps (max_num_tokens).
  ForwardBatch big = make_extend_batch({row}, {0}, {33});
  big.out_cache_loc.assign(33, 0);
  test::expect_error([&] { g.begin_step(big); }, {"33 tokens", "max_num_tokens = 32"});
}

// Tokens land on their owners, compacted; free_request gives every slot back on every rank.
TEST(Dcp, RequestsLiveInterleavedAndFreeEverySlot) {
  Options o;
  o.attention_backend = "reference";
  o.dcp_size = 3;
  o.page_size = 16;
  const RuntimeConfig cfg = test::host_config(2, 512, 64);
  DcpAttention g(gqa_model(), o, cfg);
  std::vector<int64_t> before;
  for (int r = 0; r < 3; ++r) before.push_back(g.rank(r).runtime().allocator().available_size());
  ForwardBatch b = make_extend_batch({0, 1}, {0, 0}, {20, 7});
  b.out_cache_loc.assign(27, 0);
  g.begin_step(b);
  g.end_step();
  ForwardBatch v = make_verify_batch({0, 1}, {20, 7}, SpecInfo::chain(2, 4));
  v.out_cache_loc.assign(8, 0);
  g.begin_step(v);
  g.end_step();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(g.rank(r).local_row(0).size(), static_cast<size_t>(dcp_local_count(24, r, 3)));
    EXPECT_EQ(g.rank(r).local_row(1).size(), static_cast<size_t>(dcp_local_count(11, r, 3)));
  }
  g.free_request(0);
  g.free_request(1);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(g.rank(r).runtime().allocator().available_size(), before[r]);
    EXPECT_TRUE(g.rank(r).local_row(0).empty());
  }
  test::expect_error([&] { g.free_request(2); }, {"row 2", "0..1"});
}

// `attnrt run --dcp-size N`: the target's attention layers also run on N simulated ranks and match
// the single runtime; what cannot be split is named.
class DcpCli : public test::CliTest {};

TEST_F(DcpCli, RunSplitsTheTargetOverSimulatedRanks) {
  const auto trace = dir_ / "tiny.jsonl";
  std::ofstream(trace)
      << R"({"arrival_step":0,"id":"a","output_len":4,"prompt_len":30})"
         "\n"
      << R"({"arrival_step":1,"id":"b","output_len":6,"prompt_len":50,"shared_prefix":"s","shared_prefix_len":16})"
         "\n"
      << R"({"arrival_step":1,"id":"c","output_len":5,"prompt_len":24,"shared_prefix":"s","shared_prefix_len":16})"
         "\n";
  const test::CommandResult r =
      run("run --trace '" + trace.string() +
          "' --attention-backend cpu --dcp-size 3 --no-progress --speculative-num-steps 2 "
          "--chunked-prefill-size 32 --check-every 2");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  // The demo model's sliding-window layer (2) splits too: its window is on global positions.
  test::expect_contains(r.out,
                        {"dcp: 3 simulated ranks", "over layers 0, 1, 2, 3", "0 beyond tolerance",
                         "shared prefixes: not reused", "TARGET_VERIFY"});
  const test::CommandResult zero = run("run --dcp-size 0 --no-progress");
  EXPECT_NE(zero.status, 0);
  test::expect_contains(zero.err, {"dcp_size = 0", "[1, 64]"});
  // Trees: the accepted paths are committed on the ranks after every verify.
  const test::CommandResult tree =
      run("run --trace '" + trace.string() +
          "' --attention-backend cpu --dcp-size 2 --no-progress --speculative-num-steps 2 "
          "--speculative-eagle-topk 2 --speculative-num-draft-tokens 4 --page-size 16");
  ASSERT_EQ(tree.status, 0) << tree.out << tree.err;
  test::expect_contains(tree.out, {"dcp: 2 simulated ranks", "0 beyond tolerance"});
}

// Ranks as threads: each DcpRank on a thread of its own over a blocking communicator gives the
// bits the sequential group gives (the same partials, merged in the same order).
TEST(Dcp, RanksOnThreadsMatchTheSequentialGroup) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int n = 3;
  Options o;
  o.attention_backend = "reference";
  o.kv_cache_dtype = "fp32";
  o.page_size = 16;
  o.dcp_size = n;
  const RuntimeConfig cfg = test::host_config(2, 1024, 64);
  const ModelSpec model = gqa_model();
  DcpAttention group(model, o, cfg);
  InProcessCommunicator comm(n, /*blocking=*/true);
  std::vector<std::unique_ptr<DcpRank>> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(std::make_unique<DcpRank>(r, model, o, cfg, comm));

  std::mt19937 rng(seed);
  const std::vector<ForwardBatch> steps = {make_extend_batch({0, 1}, {0, 0}, {23, 9}),
                                           make_extend_batch({0, 1}, {23, 9}, {5, 11}),
                                           make_decode_batch({0, 1}, {29, 21})};
  for (ForwardBatch b : steps) {
    b.out_cache_loc.assign(b.positions.size(), 0);
    const int64_t T = b.num_tokens();
    group.begin_step(b);
    std::vector<std::thread> threads;
    for (auto& r : ranks) r->begin_step(b);
    for (const LayerSpec& l : model.layers) {
      const int dv = l.v_head_dim;
      HostBuffer q = test::random_buffer(DType::f32, {T, l.num_q_heads, l.head_dim}, rng);
      HostBuffer k = test::random_buffer(DType::f32, {T, l.num_kv_heads, l.head_dim}, rng);
      HostBuffer v = test::random_buffer(DType::f32, {T, l.num_kv_heads, dv}, rng);
      std::vector<float> sinks(l.num_q_heads, 0.3f);
      HostBuffer seq(DType::f32, {T, l.num_q_heads, dv}), thr(DType::f32, {T, l.num_q_heads, dv});
      test::poison(seq.view());
      test::poison(thr.view());
      AttnArgs a;
      a.q = q.view();
      a.k = k.view();
      a.v = v.view();
      a.sinks = l.has_sinks ? sinks.data() : nullptr;
      a.out = seq.view();
      group.forward(l.layer_id, a);
      a.out = thr.view();
      threads.clear();
      for (auto& r : ranks) {
        threads.emplace_back([&, rank = r.get()] {
          rank->forward(l.layer_id, a);  // returns once every rank's partials are exchanged
          rank->merge(l.layer_id, a);
        });
      }
      for (std::thread& t : threads) t.join();
      EXPECT_EQ(std::memcmp(seq.data(), thr.data(), seq.view().numel() * sizeof(float)), 0)
          << "layer " << l.layer_id;
    }
    group.end_step();
    for (auto& r : ranks) r->end_step();
  }
}

}  // namespace
