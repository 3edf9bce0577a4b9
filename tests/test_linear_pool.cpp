// LinearStatePool: slot life (reserved slot 0, zero-filled allocation, exhaustion, double free),
// request-row binding, copy/fork, the commit of verify checkpoints, host access to slots and
// checkpoints, every tensor operation going through the pool's LinearStateMemory, and a bf16 state
// through a backend (the commit stays exact; chunked extend stays within bf16 rounding of
// sequential decode).
#include <gtest/gtest.h>

#include <cstring>

#include "attnrt/memory/linear_state_pool.h"
#include "test_linear_util.h"

using namespace attnrt;
using namespace attnrt::testing_linear;

namespace {

ModelSpec two_layer_model() {
  ModelSpec m;
  m.name = "pool-model";
  m.dtype = DType::f32;
  m.layers = {small_layer(LayerKind::gdn, 0), test::attention_layer(1, 1, 1, 8),
              small_layer(LayerKind::mamba2, 2)};
  return m;
}

// `slots` state slots and as many request rows; `verify_rows` rows of `draft_tokens` checkpoints.
LinearStateConfig pool_config(int slots, int verify_rows = 0, int draft_tokens = 0) {
  return {.max_slots = slots,
          .max_request_rows = slots,
          .verify_rows = verify_rows,
          .num_draft_tokens = draft_tokens};
}

float* ssm_of(const LinearStatePool& p, int layer, int slot) {
  const LinearLayerState& s = p.layer(layer);
  return static_cast<float*>(s.ssm) + s.ssm_offset(slot);
}

float* conv_of(const LinearStatePool& p, int layer, int slot) {
  const LinearLayerState& s = p.layer(layer);
  return static_cast<float*>(s.conv) + s.conv_offset(slot);
}

TEST(LinearStatePool, ShapesFollowTheLayerKinds) {
  const ModelSpec m = two_layer_model();
  LinearStatePool p(m, pool_config(2));
  EXPECT_EQ(p.layer_ids(), (std::vector<int>{0, 2}));
  EXPECT_FALSE(p.holds(1));
  const LinearStateShape g = p.layer(0).shape;  // gdn: q|k|v = 2*2*20 + 4*12; state [HV, Dv, Dk]
  EXPECT_EQ(g.conv_dim, 2 * 2 * 20 + 4 * 12);
  EXPECT_EQ(g.conv_width, 3);
  EXPECT_EQ(g.heads, 4);
  EXPECT_EQ(g.rows, 12);
  EXPECT_EQ(g.cols, 20);
  const LinearStateShape s = p.layer(2).shape;  // mamba2: x|B|C = 4*12 + 2*2*20; [nh, P, N]
  EXPECT_EQ(s.conv_dim, 4 * 12 + 2 * 2 * 20);
  EXPECT_EQ(s.heads, 4);
  EXPECT_EQ(s.rows, 12);
  EXPECT_EQ(s.cols, 20);
  EXPECT_EQ(p.bytes(),
            3 * sizeof(float) * (g.conv_elems() + g.ssm_elems() + s.conv_elems() + s.ssm_elems()));
  expect_error([&] { p.layer(1); }, {"layer 1 is not a linear-attention layer"});
}

TEST(LinearStatePool, SlotsAreZeroedReusedAndBoundToRequestRows) {
  const ModelSpec m = two_layer_model();
  LinearStatePool p(m, {.max_slots = 2, .max_request_rows = 3});
  const int a = p.alloc_for(2);
  EXPECT_EQ(a, 1);  // slot 0 is reserved
  EXPECT_EQ(p.slot_of(2), a);
  EXPECT_EQ(p.slot_of(0), -1);
  // Dirty the slot, free it, take it again: zeroed.
  const int64_t n = p.layer(0).shape.ssm_elems();
  std::fill(ssm_of(p, 0, a), ssm_of(p, 0, a) + n, 3.5f);
  std::fill(conv_of(p, 2, a), conv_of(p, 2, a) + p.layer(2).shape.conv_elems(), -1.f);
  p.free_for(2);
  EXPECT_EQ(p.available(), 2);
  const int b = p.alloc();
  const int again = p.alloc();
  EXPECT_NE(b, again);
  for (int slot : {b, again}) {
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(ssm_of(p, 0, slot)[i], 0.f);
    for (int64_t i = 0; i < p.layer(2).shape.conv_elems(); ++i)
      ASSERT_EQ(conv_of(p, 2, slot)[i], 0.f);
  }
  expect_error([&] { p.alloc(); }, {"all 2 linear-state slots are in use", "max_slots"});
  p.bind(0, b);
  expect_error([&] { p.bind(0, again); }, {"request row 0 already holds slot"});
  expect_error([&] { p.bind(1, b); }, {"slot 1 is already bound to request row 0"});
  expect_error([&] { p.free(b); }, {"still bound to request row 0"});
  expect_error([&] { p.bind(5, again); }, {"request row 5 is out of range 0..2"});
  expect_error([&] { p.free(0); }, {"slot 0 is out of range 1..2 (slot 0 is reserved)"});
  p.unbind(0);
  p.free(b);
  expect_error([&] { p.free(b); }, {"is not allocated (freed twice?)"});
  expect_error([&] { p.unbind(0); }, {"request row 0 holds no slot"});
}

TEST(LinearStatePool, ForkCopiesEveryLayer) {
  const ModelSpec m = two_layer_model();
  LinearStatePool p(m, pool_config(3));
  const int src = p.alloc();
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (int layer : {0, 2}) {
    for (int64_t i = 0; i < p.layer(layer).shape.ssm_elems(); ++i)
      ssm_of(p, layer, src)[i] = u(rng);
    for (int64_t i = 0; i < p.layer(layer).shape.conv_elems(); ++i)
      conv_of(p, layer, src)[i] = u(rng);
  }
  const int dst = p.fork(src);
  for (int layer : {0, 2}) {
    EXPECT_EQ(std::memcmp(ssm_of(p, layer, src), ssm_of(p, layer, dst),
                          sizeof(float) * p.layer(layer).shape.ssm_elems()),
              0);
    EXPECT_EQ(std::memcmp(conv_of(p, layer, src), conv_of(p, layer, dst),
                          sizeof(float) * p.layer(layer).shape.conv_elems()),
              0);
  }
  expect_error([&] { p.copy(src, 3); }, {"copy (destination): slot 3 is not allocated"});
}

TEST(LinearStatePool, CommitTakesTheChosenCheckpointOfEveryLayer) {
  const ModelSpec m = two_layer_model();
  LinearStatePool p(m, pool_config(3, 2, 3));
  const int s0 = p.alloc(), s1 = p.alloc();
  // Checkpoint t of row r holds the value 10 r + t everywhere.
  for (int layer : {0, 2}) {
    const LinearLayerState& st = p.layer(layer);
    for (int r = 0; r < 2; ++r) {
      for (int t = 0; t < 3; ++t) {
        float* ssm = static_cast<float*>(st.inter_ssm) + st.inter_ssm_offset(r, t, 3);
        float* conv = static_cast<float*>(st.inter_conv) + st.inter_conv_offset(r, t, 3);
        std::fill(ssm, ssm + st.shape.ssm_elems(), 10.f * r + t);
        std::fill(conv, conv + st.shape.conv_elems(), 10.f * r + t);
      }
    }
  }
  const std::vector<int64_t> slots = {s1, s0};
  p.commit_verify(slots, std::vector<int32_t>{2, -1});
  for (int layer : {0, 2}) {
    EXPECT_EQ(ssm_of(p, layer, s1)[0], 2.f);
    EXPECT_EQ(conv_of(p, layer, s1)[p.layer(layer).shape.conv_elems() - 1], 2.f);
    EXPECT_EQ(ssm_of(p, layer, s0)[0], 0.f) << "-1 leaves the slot alone";
  }
  expect_error([&] { p.commit_verify(slots, std::vector<int32_t>{0}); },
               {"2 slots but 1 accepted indices"});
  expect_error(
      [&] {
        p.commit_verify(std::vector<int64_t>{1, 2, 3}, std::vector<int32_t>{0, 0, 0});
      },
      {"3 requests, but checkpoints exist for 2 verify rows"});
}

// A host memory that counts what the pool asks of it.
class CountingMemory final : public LinearStateMemory {
 public:
  struct Counts {
    int allocs = 0, releases = 0, zeros = 0, copies = 0, to_host = 0, from_host = 0;
  };
  explicit CountingMemory(Counts& c) : c_(c) {}
  Device device() const override { return Device::cpu(); }
  void* allocate_zeroed(size_t bytes) override {
    ++c_.allocs;
    return inner_->allocate_zeroed(bytes);
  }
  void release(void* p) override {
    ++c_.releases;
    inner_->release(p);
  }
  void zero(void* dst, size_t bytes) override {
    ++c_.zeros;
    inner_->zero(dst, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    ++c_.copies;
    inner_->copy(dst, src, bytes);
  }
  void to_host(void* dst, const void* src, size_t bytes) override {
    ++c_.to_host;
    inner_->to_host(dst, src, bytes);
  }
  void from_host(void* dst, const void* src, size_t bytes) override {
    ++c_.from_host;
    inner_->from_host(dst, src, bytes);
  }

 private:
  Counts& c_;
  std::unique_ptr<LinearStateMemory> inner_ = make_host_linear_state_memory();
};

TEST(LinearStatePool, EveryTensorOperationGoesThroughItsMemory) {
  const ModelSpec m = two_layer_model();
  const LinearStateConfig c = pool_config(3, 2, 3);
  CountingMemory::Counts n;
  {
    LinearStatePool p(m, c, std::make_unique<CountingMemory>(n));
    EXPECT_EQ(n.allocs, 2 * 4) << "conv, ssm and both checkpoint tensors of two layers";
    const int zeros0 = n.zeros;
    const int a = p.alloc();
    EXPECT_EQ(n.zeros - zeros0, 2 * 2) << "alloc zeroes the slot's conv window and state per layer";
    const int b = p.fork(a);
    EXPECT_EQ(n.copies, 2 * 2);
    p.commit_verify(std::vector<int64_t>{a, b}, std::vector<int32_t>{2, -1});
    EXPECT_EQ(n.copies, 2 * 2 + 2 * 2) << "one checkpoint copied per layer (conv and state)";
    const LinearStateShape& sh = p.layer(0).shape;
    std::vector<float> conv(static_cast<size_t>(sh.conv_elems())), ssm(sh.ssm_elems());
    p.download_slot(0, a, conv.data(), ssm.data());
    EXPECT_EQ(n.to_host, 2);
    p.upload_checkpoint(0, 1, 2, conv.data(), ssm.data());
    EXPECT_EQ(n.from_host, 2);
  }
  EXPECT_EQ(n.releases, n.allocs) << "the pool releases every tensor it allocated";
}

TEST(LinearStatePool, HostAccessToSlotsAndCheckpoints) {
  const ModelSpec m = two_layer_model();
  LinearStatePool p(m, pool_config(2, 2, 3));
  const int s = p.alloc();
  const LinearStateShape& sh = p.layer(2).shape;
  std::vector<float> conv(static_cast<size_t>(sh.conv_elems())), ssm(sh.ssm_elems());
  for (size_t i = 0; i < conv.size(); ++i) conv[i] = 0.5f * static_cast<float>(i);
  for (size_t i = 0; i < ssm.size(); ++i) ssm[i] = -1.f * static_cast<float>(i);
  p.upload_slot(2, s, conv.data(), ssm.data());
  EXPECT_EQ(ssm_of(p, 2, s)[7], -7.f);
  EXPECT_EQ(conv_of(p, 2, s)[3], 1.5f);
  EXPECT_EQ(ssm_of(p, 0, s)[7], 0.f) << "other layers untouched";
  std::vector<float> conv2(conv.size()), ssm2(ssm.size());
  p.upload_checkpoint(2, 1, 2, conv.data(), ssm.data());
  p.download_checkpoint(2, 1, 2, conv2.data(), ssm2.data());
  EXPECT_EQ(conv2, conv);
  EXPECT_EQ(ssm2, ssm);
  p.commit_verify(std::vector<int64_t>{0, s}, std::vector<int32_t>{-1, 2});
  p.download_slot(2, s, conv2.data(), ssm2.data());
  EXPECT_EQ(ssm2, ssm);
  expect_error([&] { p.download_slot(2, 3, conv2.data(), ssm2.data()); },
               {"download_slot: slot 3 is out of range 0..2"});
  expect_error([&] { p.download_checkpoint(2, 2, 0, conv2.data(), ssm2.data()); },
               {"download_checkpoint: checkpoint (row 2, token 0) is out of range: rows 0..1, "
                "tokens 0..2"});
  expect_error([&] { p.upload_slot(1, 1, conv.data(), ssm.data()); },
               {"layer 1 is not a linear-attention layer"});
  EXPECT_EQ(p.device(), Device::cpu());
}

TEST(LinearStatePool, RejectsBadConfigs) {
  const ModelSpec m = two_layer_model();
  LinearStateConfig c;
  c.max_slots = 0;
  c.max_request_rows = 1;
  expect_error([&] { LinearStatePool p(m, c); }, {"max_slots = 0 is invalid"});
  c.max_slots = 1;
  c.ssm_dtype = DType::f16;
  expect_error([&] { LinearStatePool p(m, c); },
               {"ssm_dtype = fp16 is not supported; use fp32 or bf16"});
  c.ssm_dtype = DType::f32;
  c.verify_rows = 2;
  expect_error([&] { LinearStatePool p(m, c); }, {"verify_rows = 2 and num_draft_tokens = 0"});
  ModelSpec dense = m;
  dense.layers = {m.layers[1]};
  c.verify_rows = 0;
  expect_error([&] { LinearStatePool p(dense, c); }, {"has no linear-attention layers"});
}

// A bf16 state through each backend: verify + commit is exact (the same steps, each rounded to
// bf16 once, as sequential decoding does), and chunked extend (rounded once at the end) stays
// within bf16 rounding of token-by-token decode (2e-2 + 2e-2 |x|).
class LinearBf16State : public testing::TestWithParam<std::tuple<std::string, LayerKind>> {};

TEST_P(LinearBf16State, CommitIsExactAndExtendStaysWithinRounding) {
  const auto [backend, kind] = GetParam();
  std::mt19937 rng(19);
  const LayerData d(small_layer(kind), rng);
  const int n = 4;
  Harness h(d, backend, 4, 2, n, DType::bf16);
  Harness seq(d, backend, 4, 0, 0, DType::bf16);
  h.pool().alloc_for(0);
  seq.pool().alloc_for(0);
  const Tokens stream = random_tokens(d, 19 + n, rng);
  // Prefix of 19 tokens: one extend (chunked) against 19 decode steps.
  h.run(with_slots(make_extend_batch({0}, {0}, {19})), slice(stream, d, 0, 19));
  for (int t = 0; t < 19; ++t) {
    seq.run(with_slots(make_decode_batch({0}, {t + 1})), slice(stream, d, t, t + 1));
  }
  EXPECT_LE(worst(h.state(1), seq.state(1), 2e-2, 2e-2), 1.0) << "extend vs decode, bf16 state";
  // Make both start the verify from the same bits, then verify a chain and commit 2 drafts.
  {
    const LinearLayerState& a = h.pool().layer(0);
    const LinearLayerState& b = seq.pool().layer(0);
    std::memcpy(static_cast<uint16_t*>(a.ssm) + a.ssm_offset(1),
                static_cast<uint16_t*>(b.ssm) + b.ssm_offset(1), 2 * a.shape.ssm_elems());
    std::memcpy(static_cast<uint16_t*>(a.conv) + a.conv_offset(1),
                static_cast<uint16_t*>(b.conv) + b.conv_offset(1), 2 * a.shape.conv_elems());
  }
  h.run(with_slots(make_verify_batch({0}, {19}, SpecInfo::chain(1, n))),
        slice(stream, d, 19, 19 + n));
  h.backend().update_state_after_verify(std::vector<int32_t>{2});
  for (int t = 19; t < 22; ++t) {
    seq.run(with_slots(make_decode_batch({0}, {t + 1})), slice(stream, d, t, t + 1));
  }
  EXPECT_EQ(h.state(1), seq.state(1)) << "the committed bf16 state must equal sequential decoding";
}

INSTANTIATE_TEST_SUITE_P(Backends, LinearBf16State,
                         testing::Combine(testing::Values("reference", "cpu"),
                                          testing::Values(LayerKind::gdn, LayerKind::kda,
                                                          LayerKind::mamba2)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  kind_label(std::get<1>(info.param));
                         });

}  // namespace
