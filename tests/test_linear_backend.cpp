// The linear-attention side of every CPU backend (reference, cpu), for gdn, kda and mamba2:
// - chunked extend equals sequential decode of the same tokens (outputs and state), with chunk
//   boundaries inside requests, requests of different lengths in one step, and cached prefixes
//   continued by EXTEND and MIXED steps;
// - after TARGET_VERIFY and the commit of k accepted drafts, the state equals sequential decoding
//   of those tokens, for every k (chain) and every node (tree), and outputs equal the sequential
//   outputs along each token's path;
// - cpu equals reference on every mode;
// - errors for misuse.
// Tolerances (fp32 state): reference, whose two forms both run in float64 and round once to
// fp32, within 2e-6 + 1e-5 |x|; cpu (fp32 arithmetic, chunked vs sequential order of
// summation) within 1e-4 + 1e-3 |x|. A verify leaves the committed state bit for bit unchanged.
#include <gtest/gtest.h>

#include <map>
#include <numeric>

#include "attnrt/memory/linear_state_pool.h"
#include "backends/reference/linear_backend.h"
#include "test_linear_util.h"

using namespace attnrt;
using namespace attnrt::testing_linear;

namespace {

struct Case {
  std::string backend;
  LayerKind kind;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.backend << "/" << kind_label(c.kind); }

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return info.param.backend + "_" + kind_label(info.param.kind);
}

struct Tol {
  double atol, rtol;
};

Tol tolerance(const std::string& backend) {
  return backend == "reference" ? Tol{2e-6, 1e-5} : Tol{1e-4, 1e-3};
}

// Decodes each stream token by token (one DECODE step per token position, every request that
// still has tokens in the step) starting from each slot's current state; seq_lens count
// `prefix[i]` earlier tokens. Returns the outputs per request.
std::vector<std::vector<float>> decode(Harness& h, const std::vector<int>& rows,
                                       const std::vector<Tokens>& streams,
                                       const std::vector<int32_t>& prefix) {
  const LayerData& d = h.data();
  std::vector<std::vector<float>> outs(streams.size());
  int64_t longest = 0;
  for (const Tokens& s : streams) longest = std::max(longest, s.n);
  for (int64_t t = 0; t < longest; ++t) {
    std::vector<int64_t> step_rows;
    std::vector<int32_t> seq;
    std::vector<size_t> who;
    Tokens in;
    for (size_t i = 0; i < streams.size(); ++i) {
      if (t >= streams[i].n) continue;
      step_rows.push_back(rows[i]);
      seq.push_back(static_cast<int32_t>(prefix[i] + t + 1));
      who.push_back(i);
      append(in, slice(streams[i], d, t, t + 1));
    }
    const std::vector<float> out = h.run(with_slots(make_decode_batch(step_rows, seq)), in);
    const int w = d.out_width();
    for (size_t j = 0; j < who.size(); ++j) {
      outs[who[j]].insert(outs[who[j]].end(), out.begin() + j * w, out.begin() + (j + 1) * w);
    }
  }
  return outs;
}

class LinearBackend : public testing::TestWithParam<Case> {
 protected:
  LinearBackend()
      : rng_(static_cast<unsigned>(
            std::hash<std::string>{}(case_name(testing::TestParamInfo<Case>(GetParam(), 0))))),
        data_(small_layer(GetParam().kind), rng_),
        tol_(tolerance(GetParam().backend)) {}

  std::vector<int> alloc_rows(Harness& h, int n) {
    std::vector<int> rows;
    for (int i = 0; i < n; ++i) {
      h.pool().alloc_for(i);
      rows.push_back(i);
    }
    return rows;
  }

  void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                    const std::string& what) {
    const double w = worst(got, want, tol_.atol, tol_.rtol);
    EXPECT_LE(w, 1.0) << what << ": worst error " << w << " x the tolerance (atol " << tol_.atol
                      << ", rtol " << tol_.rtol << ")";
  }

  // Verify blocks of N tokens for N requests that share one prefix and one block; request i commits
  // block token accepted(i), then its state must equal sequential decoding of the prefix and the
  // path root -> accepted(i). -1 (the last request) leaves the state at the prefix.
  void run_verify(Harness& h, Harness& seq, const std::vector<int32_t>& parents, int topk) {
    const LayerData& data = data_;
    std::mt19937& rng = rng_;
    const int n = static_cast<int>(parents.size());
    const int bs = n + 1;
    const int32_t prefix = 10;
    const Tokens pre = random_tokens(data, prefix, rng);
    const Tokens block = random_tokens(data, n, rng);
    std::vector<int64_t> rows;
    for (int i = 0; i < bs; ++i) {
      h.pool().alloc_for(i);
      rows.push_back(i);
    }
    Tokens pres;
    for (int i = 0; i < bs; ++i) append(pres, pre);
    h.run(with_slots(make_extend_batch(rows, std::vector<int32_t>(bs, 0),
                                       std::vector<int32_t>(bs, prefix))),
          pres);
    const std::vector<float> before = h.state(h.pool().slot_of(0));

    SpecInfo spec;
    spec.draft_token_num = n;
    spec.topk = topk;
    for (int i = 0; i < bs; ++i)
      spec.parents.insert(spec.parents.end(), parents.begin(), parents.end());
    Tokens blocks;
    for (int i = 0; i < bs; ++i) append(blocks, block);
    const std::vector<float> out =
        h.run(with_slots(make_verify_batch(rows, std::vector<int32_t>(bs, prefix), spec)), blocks);
    // Verify leaves the committed state alone.
    for (int i = 0; i < bs; ++i) {
      EXPECT_EQ(h.state(h.pool().slot_of(i)), before)
          << "verify changed the state of request " << i;
    }
    std::vector<int32_t> accepted(bs);
    for (int i = 0; i < n; ++i) accepted[i] = i;
    accepted[n] = -1;
    h.backend().update_state_after_verify(accepted);

    const int w = data.out_width();
    for (int t = 0; t < n; ++t) {
      std::vector<int> path;
      for (int u = t; u >= 0; u = parents[u]) path.insert(path.begin(), u);
      Tokens stream = pre;
      for (int u : path) append(stream, slice(block, data, u, u + 1));
      const int row = t;
      seq.pool().alloc_for(row);
      const auto want = decode(seq, {row}, {stream}, {0})[0];
      expect_close(
          std::vector<float>(out.begin() + (int64_t{t} * n + t) * w,
                             out.begin() + (int64_t{t} * n + t + 1) * w),
          std::vector<float>(want.end() - w, want.end()),
          fmt::format("verify output of block token {} (path of {} tokens)", t, path.size()));
      expect_close(h.state(h.pool().slot_of(t)), seq.state(seq.pool().slot_of(row)),
                   fmt::format("state committed at block token {}", t));
    }
    EXPECT_EQ(h.state(h.pool().slot_of(n)), before) << "last_accepted -1 must leave the state";
  }

  std::mt19937 rng_;
  LayerData data_;
  Tol tol_;
};

TEST_P(LinearBackend, ChunkedExtendEqualsSequentialDecode) {
  // Lengths: one token, exactly two chunks, and ragged across three chunks.
  const std::vector<int32_t> lens = {1, 16, 21};
  std::vector<Tokens> streams;
  for (int32_t n : lens) streams.push_back(random_tokens(data_, n, rng_));

  Harness ext(data_, GetParam().backend);
  const std::vector<int> rows = alloc_rows(ext, 3);
  Tokens all;
  for (const Tokens& s : streams) append(all, s);
  const std::vector<float> out =
      ext.run(with_slots(make_extend_batch({0, 1, 2}, {0, 0, 0}, lens)), all);

  Harness seq(data_, GetParam().backend);
  alloc_rows(seq, 3);
  const auto want = decode(seq, rows, streams, {0, 0, 0});
  int64_t at = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t n = int64_t{lens[i]} * data_.out_width();
    expect_close(std::vector<float>(out.begin() + at, out.begin() + at + n), want[i],
                 fmt::format("outputs of request {} ({} tokens)", i, lens[i]));
    at += n;
    expect_close(ext.state(ext.pool().slot_of(rows[i])), seq.state(seq.pool().slot_of(rows[i])),
                 fmt::format("state of request {}", i));
  }
}

TEST_P(LinearBackend, ExtendContinuesACachedPrefixInExtendAndMixedSteps) {
  // Request 0: 5 then 14 tokens (prefix inside a chunk); request 1: 8 then one decode row of the
  // MIXED step; request 2: 11 then 9 more tokens, then a decode step.
  const std::vector<int32_t> first = {5, 8, 11}, second = {14, 1, 9};
  std::vector<Tokens> streams;
  for (int i = 0; i < 3; ++i)
    streams.push_back(random_tokens(data_, first[i] + second[i] + 1, rng_));

  Harness ext(data_, GetParam().backend);
  const std::vector<int> rows = alloc_rows(ext, 3);
  std::vector<std::vector<float>> got(3);
  auto keep = [&](const std::vector<float>& out, const std::vector<int32_t>& lens) {
    int64_t at = 0;
    for (int i = 0; i < 3; ++i) {
      const int64_t n = int64_t{lens[i]} * data_.out_width();
      got[i].insert(got[i].end(), out.begin() + at, out.begin() + at + n);
      at += n;
    }
  };
  Tokens in1, in2, in3;
  for (int i = 0; i < 3; ++i) {
    append(in1, slice(streams[i], data_, 0, first[i]));
    append(in2, slice(streams[i], data_, first[i], first[i] + second[i]));
    append(in3, slice(streams[i], data_, first[i] + second[i], first[i] + second[i] + 1));
  }
  keep(ext.run(with_slots(make_extend_batch({0, 1, 2}, {0, 0, 0}, first)), in1), first);
  keep(ext.run(with_slots(make_extend_batch({0, 1, 2}, first, second, ForwardMode::MIXED)), in2),
       second);
  std::vector<int32_t> seq_lens(3);
  for (int i = 0; i < 3; ++i) seq_lens[i] = first[i] + second[i] + 1;
  keep(ext.run(with_slots(make_decode_batch({0, 1, 2}, seq_lens)), in3), {1, 1, 1});

  Harness seq(data_, GetParam().backend);
  alloc_rows(seq, 3);
  const auto want = decode(seq, rows, streams, {0, 0, 0});
  for (int i = 0; i < 3; ++i) {
    expect_close(got[i], want[i], fmt::format("outputs of request {}", i));
    expect_close(ext.state(ext.pool().slot_of(i)), seq.state(seq.pool().slot_of(i)),
                 fmt::format("state of request {}", i));
  }
}

TEST_P(LinearBackend, ChainVerifyCommitEqualsSequentialDecodeForEveryAcceptedLength) {
  const int n = 5;
  std::vector<int32_t> chain(n);
  std::iota(chain.begin(), chain.end(), -1);
  Harness h(data_, GetParam().backend, 8, 8, n);
  Harness seq(data_, GetParam().backend, 8);
  run_verify(h, seq, chain, 1);
}

TEST_P(LinearBackend, TreeVerifyCommitEqualsSequentialDecodeOfEachPath) {
  // Root with two children, grandchildren under both, one great-grandchild.
  const std::vector<int32_t> tree = {-1, 0, 0, 1, 1, 2, 4};
  const int n = static_cast<int>(tree.size());
  Harness h(data_, GetParam().backend, 9, 8, n);
  Harness seq(data_, GetParam().backend, 9);
  run_verify(h, seq, tree, 2);
}

TEST_P(LinearBackend, MatchesReferenceOnEveryMode) {
  if (GetParam().backend == "reference") GTEST_SKIP() << "the reference is the oracle itself";
  const int n = 4;
  Harness cpu(data_, GetParam().backend, 6, 4, n);
  Harness ref(data_, "reference", 6, 4, n);
  const Tol cross{2e-4, 2e-3};  // fp32 against float64 over a few dozen recurrent steps
  auto both = [&](const ForwardBatch& b, const Tokens& in, const std::string& what) {
    const std::vector<float> got = cpu.run(b, in), want = ref.run(b, in);
    const double w = worst(got, want, cross.atol, cross.rtol);
    EXPECT_LE(w, 1.0) << what << ": worst error " << w << " x the tolerance";
  };
  for (int i = 0; i < 3; ++i) {
    cpu.pool().alloc_for(i);
    ref.pool().alloc_for(i);
  }
  const std::vector<int32_t> first = {3, 17, 9};
  Tokens in;
  for (int32_t e : first) append(in, random_tokens(data_, e, rng_));
  both(with_slots(make_extend_batch({0, 1, 2}, {0, 0, 0}, first)), in, "EXTEND");
  in = random_tokens(data_, 1 + 12 + 1, rng_);
  both(with_slots(make_extend_batch({0, 1, 2}, first, {1, 12, 1}, ForwardMode::MIXED)), in,
       "MIXED");
  in = random_tokens(data_, 3, rng_);
  both(with_slots(make_decode_batch({0, 1, 2}, {5, 30, 11})), in, "DECODE");
  SpecInfo spec;
  spec.draft_token_num = n;
  spec.topk = 2;
  for (int i = 0; i < 3; ++i) spec.parents.insert(spec.parents.end(), {-1, 0, 0, 2});
  in = random_tokens(data_, 3 * n, rng_);
  both(with_slots(make_verify_batch({0, 1, 2}, {5, 30, 11}, spec)), in, "TARGET_VERIFY (tree)");
  cpu.backend().update_state_after_verify(std::vector<int32_t>{3, -1, 1});
  ref.backend().update_state_after_verify(std::vector<int32_t>{3, -1, 1});
  in = random_tokens(data_, 3 + 2 + 1, rng_);
  both(with_slots(make_draft_extend_batch({0, 1, 2}, {9, 32, 13}, {2, 1, 0})), in, "DRAFT_EXTEND");
  for (int i = 0; i < 3; ++i) {
    const double w = worst(cpu.state(i + 1), ref.state(i + 1), cross.atol, cross.rtol);
    EXPECT_LE(w, 1.0) << "state of request " << i << ": worst error " << w << " x the tolerance";
  }
}

// The reference backend's extend forms: token by token, and chunked with 3 and with the layer's
// 8 tokens, on a batch with a cached prefix; all three agree to float64 rounding (stored as fp32).
TEST(LinearReferenceForms, SequentialAndChunkedExtendAgree) {
  for (LayerKind kind : {LayerKind::gdn, LayerKind::kda, LayerKind::mamba2}) {
    SCOPED_TRACE(kind_label(kind));
    std::mt19937 rng(101);
    const LayerData d(small_layer(kind), rng);
    const Tokens first = random_tokens(d, 5 + 7, rng), second = random_tokens(d, 17 + 2, rng);
    std::vector<std::vector<float>> outs, states;
    for (int chunk : {-1, 3, 0}) {
      Harness h(d, "reference");
      h.pool().alloc_for(0);
      h.pool().alloc_for(1);
      auto& ref = dynamic_cast<ReferenceLinearBackend&>(h.backend());
      ref.set_extend_chunk(chunk);
      h.run(with_slots(make_extend_batch({0, 1}, {0, 0}, {5, 7})), first);
      outs.push_back(h.run(with_slots(make_extend_batch({0, 1}, {5, 7}, {17, 2})), second));
      std::vector<float> st = h.state(1);
      const std::vector<float> st2 = h.state(2);
      st.insert(st.end(), st2.begin(), st2.end());
      states.push_back(st);
    }
    for (size_t i = 1; i < outs.size(); ++i) {
      EXPECT_LE(worst(outs[i], outs[0], 1e-6, 1e-5), 1.0) << "outputs, form " << i;
      EXPECT_LE(worst(states[i], states[0], 1e-6, 1e-5), 1.0) << "states, form " << i;
    }
  }
}

TEST_P(LinearBackend, IdleStepsTouchNothing) {
  Harness h(data_, GetParam().backend);
  h.pool().alloc_for(0);
  Tokens in = random_tokens(data_, 6, rng_);
  h.run(with_slots(make_extend_batch({0}, {0}, {6})), in);
  const std::vector<float> before = h.state(1);
  const ForwardBatch idle = make_idle_batch();
  h.backend().init_forward_metadata(idle);
  std::vector<float> none;
  h.backend().forward_linear(LinearArgs{}, data_.layer, idle);
  EXPECT_EQ(h.state(1), before);
}

TEST_P(LinearBackend, RejectsMisuseWithClearErrors) {
  Harness h(data_, GetParam().backend, 4);
  const Tokens in = random_tokens(data_, 3, rng_);
  // A request row without a state slot.
  expect_error([&] { h.run(with_slots(make_extend_batch({2}, {0}, {3})), in); },
               {"request 0 (request row 2) has no linear state slot", "alloc_for"});
  h.pool().alloc_for(0);
  // A verify step on a pool built without checkpoints.
  expect_error([&] { h.run(with_slots(make_verify_batch({0}, {4}, SpecInfo::chain(1, 3))), in); },
               {"keeps no per-token checkpoints", "--speculative-num-steps"});
  // Shapes.
  const ForwardBatch ext = with_slots(make_extend_batch({0}, {0}, {3}));
  h.backend().init_forward_metadata(ext);
  std::vector<float> out(static_cast<size_t>(3 * data_.out_width()));
  LinearArgs bad = h.args(in, out);
  bad.mixed_qkv.shape[1] += 1;
  expect_error([&] { h.backend().forward_linear(bad, data_.layer, ext); },
               {"mixed_qkv is fp32[3, " + std::to_string(data_.shape.conv_dim + 1) + "]",
                "[tokens, conv_dim] = [3, " + std::to_string(data_.shape.conv_dim) + "]"});
  bad = h.args(in, out);
  bad.out = TensorView();
  expect_error([&] { h.backend().forward_linear(bad, data_.layer, ext); }, {"out is empty"});
  bad = h.args(in, out);
  std::vector<uint16_t> half_a(data_.A_log.size());
  bad.A_log = TensorView(half_a.data(), DType::bf16, {data_.shape.heads});
  expect_error([&] { h.backend().forward_linear(bad, data_.layer, ext); },
               {"A_log is bf16", "layer parameters are fp32"});
  // A step that was not planned.
  const ForwardBatch other = with_slots(make_extend_batch({0}, {0}, {2}));
  expect_error([&] { h.backend().forward_linear(h.args(in, out), data_.layer, other); },
               {"without a matching init_forward_metadata"});
  // Committing after anything but a verify.
  expect_error([&] { h.backend().update_state_after_verify(std::vector<int32_t>{0}); },
               {"update_state_after_verify after a EXTEND step"});
  // A full-attention call on the linear object.
  LayerSpec full;
  full.kind = LayerKind::full;
  full.layer_id = 3;
  expect_error([&] { h.backend().forward_extend(AttnArgs{}, full, ext); },
               {"layer 3 (full) is not a linear-attention layer"});
}

TEST_P(LinearBackend, CommitRejectsBadAcceptedIndicesBeforeCopying) {
  const int n = 3;
  Harness h(data_, GetParam().backend, 4, 2, n);
  h.pool().alloc_for(0);
  h.pool().alloc_for(1);
  const Tokens in = random_tokens(data_, 2 * n, rng_);
  h.run(with_slots(make_verify_batch({0, 1}, {0, 0}, SpecInfo::chain(2, n))), in);
  const std::vector<float> before = h.state(1);
  expect_error(
      [&] {
        h.backend().update_state_after_verify(std::vector<int32_t>{0, n});
      },
      {"last accepted index 3 of request 1 is out of range -1..2"});
  EXPECT_EQ(h.state(1), before) << "a rejected commit must not copy anything";
  expect_error([&] { h.backend().update_state_after_verify(std::vector<int32_t>{0}); },
               {"1 accepted indices for a verify step of 2 requests"});
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const char* b : {"reference", "cpu"}) {
    if (!Registry::global().find(b) || !Registry::global().get(b).linear_factory) continue;
    for (LayerKind k : {LayerKind::gdn, LayerKind::kda, LayerKind::mamba2}) cases.push_back({b, k});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Backends, LinearBackend, testing::ValuesIn(all_cases()), case_name);

}  // namespace
