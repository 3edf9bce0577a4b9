// The case dumper of `attnrt run --dump-step` on its own: which step and layer it writes, the case
// it writes (read back: the step's inputs, the backend's output, a replay that reproduces it), and
// why it wrote nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/runtime/attention_runtime.h"
#include "tests/test_util.h"
#include "tools/io/case_file.h"
#include "tools/io/npy.h"
#include "tools/sim/case_dumper.h"

using namespace attnrt;
using namespace attnrt::sim;

namespace {

using test::random_buffer;

LayerSpec attention_layer(int id, LayerKind kind, int window = -1) {
  LayerSpec l;
  l.layer_id = id;
  l.kind = kind;
  l.num_q_heads = 4;
  l.num_kv_heads = 2;
  l.head_dim = l.v_head_dim = 16;
  l.sliding_window = window;
  return l;
}

bool same_values(const NpyArray& a, const HostBuffer& b) {
  if (a.numel() != b.numel()) return false;
  for (int64_t i = 0; i < b.numel(); ++i) {
    if (a.as<float>()[i] != load_as_float(b.data(), b.dtype(), static_cast<size_t>(i))) return false;
  }
  return true;
}

TEST(SimCaseDumper, WritesTheFirstFullAttentionLayerElseTheFirstLayerWithAKvCache) {
  ModelSpec m;
  m.layers = {attention_layer(0, LayerKind::swa, 64), attention_layer(1, LayerKind::full, 32),
              attention_layer(2, LayerKind::full), attention_layer(3, LayerKind::full)};
  EXPECT_EQ(CaseDumper::layer_of(m), 2);  // layer 1 has a window
  m.layers.resize(2);
  EXPECT_EQ(CaseDumper::layer_of(m), 0);
  LayerSpec linear;
  linear.kind = LayerKind::gdn;
  m.layers = {linear};
  EXPECT_EQ(CaseDumper::layer_of(m), -1);
}

TEST(SimCaseDumper, WantsOnlyItsStepWhenThatStepHasTokens) {
  ModelSpec m;
  m.layers = {attention_layer(0, LayerKind::swa, 8), attention_layer(1, LayerKind::full)};
  const CaseDumper dumper(3, "unused");
  EXPECT_TRUE(dumper.wants_step(3, 5));
  EXPECT_FALSE(dumper.wants_step(3, 0));
  EXPECT_FALSE(dumper.wants_step(2, 5));
  EXPECT_TRUE(dumper.wants_layer(3, 5, m, 1));
  EXPECT_FALSE(dumper.wants_layer(3, 5, m, 0));
  const CaseDumper off(-1, "");
  for (int step : {-1, 0, 3}) EXPECT_FALSE(off.wants_step(step, 5));
}

TEST(SimCaseDumper, SaysWhyNothingWasWritten) {
  EXPECT_EQ(CaseDumper(7, "d").error(5), "--dump-step 7: the run had only 5 steps (0 .. 4)");
  EXPECT_EQ(CaseDumper(7, "d").error(10),
            "--dump-step 7: that step is IDLE (no tokens, nothing to replay); pick a step with "
            "tokens");
  EXPECT_EQ(CaseDumper(-1, "d").error(10), "");
  EXPECT_EQ(CaseDumper(7, "d").written(), "");
}

// One request prefilled on the cpu backend, then a decode step of random q/k/v, which the dumper
// writes.
TEST(SimCaseDumper, WritesAStepThatReadsBackAndReplaysToTheSameOutput) {
  ModelSpec m;
  m.name = "dumper-test";
  m.dtype = DType::bf16;
  m.max_context_len = 256;
  m.layers = {attention_layer(0, LayerKind::full)};
  Options options;
  options.attention_backend = "cpu";
  options.page_size = 4;
  RuntimeConfig rc;
  rc.max_requests = 2;
  rc.kv_slots = 256;
  AttentionRuntime rt(m, options, rc);
  std::mt19937 rng(41);
  const int row = rt.req_to_token().alloc();
  const int32_t prompt = 11;
  auto run = [&](const ForwardBatch& batch, int64_t T) {
    HostBuffer q = random_buffer(m.dtype, {T, 4, 16}, rng);
    HostBuffer k = random_buffer(m.dtype, {T, 2, 16}, rng);
    HostBuffer v = random_buffer(m.dtype, {T, 2, 16}, rng);
    HostBuffer out(m.dtype, {T, 4, 16});
    AttnArgs args;
    args.q = q.view();
    args.k = k.view();
    args.v = v.view();
    args.out = out.view();
    rt.begin_step(batch);
    rt.forward(0, args);
    rt.end_step();
    return std::make_tuple(std::move(q), std::move(k), std::move(v), std::move(out), args);
  };
  const std::vector<int64_t> loc = rt.allocator().alloc_extend(
      std::vector<int32_t>{0}, std::vector<int32_t>{prompt}, std::vector<int64_t>{-1});
  rt.req_to_token().write(row, 0, loc);
  ForwardBatch extend = make_extend_batch({row}, {0}, {prompt});
  extend.out_cache_loc = loc;
  run(extend, prompt);
  const std::vector<int64_t> next = rt.allocator().alloc_decode(
      std::vector<int32_t>{prompt + 1}, std::vector<int64_t>{loc.back()});
  rt.req_to_token().write(row, prompt, next);
  ForwardBatch decode = make_decode_batch({row}, {prompt + 1});
  decode.out_cache_loc = next;
  auto [q, k, v, out, args] = run(decode, 1);

  const std::string dir = (std::filesystem::path(::testing::TempDir()) / "attnrt-dumper").string();
  std::filesystem::remove_all(dir);
  CaseDumper dumper(6, dir);
  ASSERT_TRUE(dumper.wants_layer(6, 1, m, 0));
  dumper.write(6, ModelRole::draft, m, 0, options, decode, rt.req_to_token(), rt.kv_cache(), args,
               "cpu");
  EXPECT_EQ(dumper.written(), dir + " (step 6, draft DECODE, layer 0)");
  EXPECT_EQ(dumper.error(10), "");

  const Case c = read_case(dir);
  EXPECT_EQ(c.model_name, "dumper-test");
  EXPECT_EQ(c.backend, "cpu");
  EXPECT_EQ(c.layer.layer_id, 0);
  EXPECT_EQ(c.batch.mode, ForwardMode::DECODE);
  EXPECT_EQ(c.batch.seq_lens, decode.seq_lens);
  ASSERT_EQ(c.req_to_token.size(), 1u);
  EXPECT_EQ(c.req_to_token[0].size(), size_t{prompt} + 1);
  EXPECT_TRUE(same_values(c.q, q));
  EXPECT_TRUE(same_values(c.k, k));
  EXPECT_TRUE(same_values(c.v, v));
  ASSERT_TRUE(c.expected_out.has_value());
  EXPECT_TRUE(same_values(*c.expected_out, out));
  const ReplayResult replayed = replay_case(c, "cpu");
  ASSERT_EQ(replayed.out.bytes(), out.bytes());
  EXPECT_EQ(std::memcmp(replayed.out.data(), out.data(), out.bytes()), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
