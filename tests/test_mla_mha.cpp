// MLA extend in the MHA form with a chunked prefix (docs/mla.md): the form rule, the chunk plan,
// cpu against reference over ragged batches, chunk sizes and page sizes, the MHA form against the
// absorbed form with consistent weights, and the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "attnrt/backend/mla_mha.h"
#include "attnrt/backend/options.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/runtime/attention_runtime.h"
#include "src/model/layer_builders.h"
#include "tests/test_util.h"
#include "tools/sim/mla_weights.h"
#include "tests/mla_mha_case.h"

namespace attnrt {
namespace {

using test::expect_close;
using test::expect_error;
using test::fill_normal;
using test::poison;

using namespace mla_mha_case;

TEST(MlaForm, FollowsTheReferenceEnginesRule) {
  Options o;
  StepLayout l;
  l.prefix_lens = {0, 0};
  EXPECT_EQ(choose_mla_form(ForwardMode::EXTEND, l, o, true), MlaForm::mha);
  EXPECT_EQ(choose_mla_form(ForwardMode::MIXED, l, o, true), MlaForm::mha);
  EXPECT_EQ(choose_mla_form(ForwardMode::EXTEND, l, o, false), MlaForm::absorbed);
  l.prefix_lens = {100, 8000};  // 8100 < 8192: a short extend on a short prefix
  EXPECT_EQ(choose_mla_form(ForwardMode::EXTEND, l, o, true), MlaForm::absorbed);
  l.prefix_lens = {192, 8000};  // 8192
  EXPECT_EQ(choose_mla_form(ForwardMode::EXTEND, l, o, true), MlaForm::mha);
  o.disable_chunked_prefix_cache = true;
  EXPECT_EQ(choose_mla_form(ForwardMode::EXTEND, l, o, true), MlaForm::absorbed);
  o.disable_chunked_prefix_cache = false;
  for (ForwardMode m : {ForwardMode::DECODE, ForwardMode::TARGET_VERIFY, ForwardMode::DRAFT_EXTEND,
                        ForwardMode::IDLE}) {
    EXPECT_EQ(choose_mla_form(m, l, o, true), MlaForm::absorbed) << forward_mode_name(m);
  }
}

TEST(MlaForm, ChunksCoverEveryPrefixInRequestOrder) {
  ReqToTokenPool pool(4, 64);
  std::vector<int64_t> a(40), b(9);
  for (int i = 0; i < 40; ++i) a[i] = 1000 + i;
  for (int i = 0; i < 9; ++i) b[i] = 2000 + i;
  const int ra = pool.alloc(), rb = pool.alloc();
  pool.write(ra, 0, a);
  pool.write(rb, 0, b);
  ForwardBatch batch = make_extend_batch({ra, rb}, {37, 5}, {3, 4});
  batch.out_cache_loc = {1037, 1038, 1039, 2005, 2006, 2007, 2008};
  const StepLayout layout = make_step_layout(batch);
  const PrefixChunkPlan plan = plan_prefix_chunks(batch, layout, pool, 32);  // 16 per request
  EXPECT_EQ(plan.chunk_len, 16);
  ASSERT_EQ(plan.num_chunks(), 3);
  EXPECT_EQ(plan.chunks[0].lens, (std::vector<int32_t>{16, 5}));
  EXPECT_EQ(plan.chunks[0].cu_seqlens, (std::vector<int64_t>{0, 16, 21}));
  EXPECT_EQ(plan.chunks[0].slots[16], 2000);
  EXPECT_EQ(plan.chunks[1].starts, (std::vector<int32_t>{16, 16}));
  EXPECT_EQ(plan.chunks[1].lens, (std::vector<int32_t>{16, 0}));
  EXPECT_EQ(plan.chunks[2].lens, (std::vector<int32_t>{5, 0}));
  EXPECT_EQ(plan.chunks[2].slots, (std::vector<int32_t>{1032, 1033, 1034, 1035, 1036}));
  expect_error([&] { plan_prefix_chunks(batch, layout, pool, 1); },
               {"max_chunk_capacity = 1", "2 requests"});
}

// cpu against reference: one chunk, many chunks, chunk boundaries inside pages, pages 1 / 16 / 64.
TEST(MlaMhaConformance, CpuMatchesReferenceOverChunkAndPageSizes) {
  const std::vector<int32_t> prefix{100, 37, 0, 150}, extend{20, 1, 33, 7};
  uint64_t seed = 11;
  for (int page : {1, 16, 64}) {
    // 1 chunk; 8 keys per request (19 chunks); 24 per request (boundaries mid-page for 16 / 64).
    for (int64_t capacity : {int64_t{1} << 20, int64_t{32}, int64_t{96}}) {
      SCOPED_TRACE(testing::Message() << "page " << page << ", capacity " << capacity);
      const Result want = mha_result("reference", page, capacity, prefix, extend, seed);
      const Result got = mha_result("cpu", page, capacity, prefix, extend, seed);
      EXPECT_EQ(got.chunks, want.chunks);
      EXPECT_EQ(want.chunks, capacity == 32 ? 19 : capacity == 96 ? 7 : 1);
      expect_close(got.out.view(), want.out.view(), 2e-4, "out");
      expect_close(got.lse.view(), want.lse.view(), 2e-4, "lse");
      ++seed;
    }
  }
}

// The chunking does not change the result: 1 chunk and 19 chunks agree on reference.
TEST(MlaMhaConformance, ChunkCountDoesNotChangeTheResult) {
  const std::vector<int32_t> prefix{100, 37, 0, 150}, extend{20, 1, 33, 7};
  const Result one = mha_result("reference", 16, int64_t{1} << 20, prefix, extend, 3);
  const Result many = mha_result("reference", 16, 32, prefix, extend, 3);
  expect_close(many.out.view(), one.out.view(), 1e-5, "out");
  expect_close(many.lse.view(), one.lse.view(), 1e-5, "lse");
}

// With consistent weights the MHA form over decompressed K/V equals the absorbed form over the
// latent pool: q_lat = [W_UK q_nope | q_rope] per head, out = W_UV^T out_lat.
TEST(MlaMhaConformance, MhaFormEqualsAbsorbedForm) {
  const std::vector<int32_t> prefix{90, 0, 203}, extend{17, 40, 2};
  for (const char* backend : {"reference", "cpu"}) {
    SCOPED_TRACE(backend);
    const Result mha = mha_result(backend, 16, 64, prefix, extend, 21);
    EXPECT_GT(mha.chunks, 1);

    Step s = make_step("reference", 16, 64, 1, prefix, extend, 21);
    const int64_t T = s.batch.num_tokens();
    std::mt19937 rng(static_cast<uint32_t>(21 * 7 + 1));
    HostBuffer q(DType::f32, {T, kHq, kQk}), latent(DType::f32, {T, 1, kRow});
    fill_normal(q.view(), rng);
    fill_normal(latent.view(), rng);
    const sim::MlaWeights w(mla_layer(0), 5);
    HostBuffer q_lat(DType::f32, {T, kHq, kRow}), out_lat(DType::f32, {T, kHq, kRank}),
        out(DType::f32, {T, kHq, kV}), lse(DType::f32, {T, kHq});
    w.absorb_q(q.view(), q_lat.view());
    poison(out_lat.view());
    s.rt->begin_step(s.batch);
    AttnArgs args;
    args.q = q_lat.view();
    args.k = latent.view();
    args.out = out_lat.view();
    args.lse = lse.view();
    s.rt->forward(0, args);
    s.rt->end_step();
    w.project_out(out_lat.view(), out.view());
    expect_close(mha.out.view(), out.view(), 2e-4, "out");
    expect_close(mha.lse.view(), lse.view(), 2e-4, "lse");
  }
}

TEST(MlaMhaErrors, MisuseIsReportedAndLeavesThePoolsUntouched) {
  for (const char* backend : {"reference", "cpu"}) {
    SCOPED_TRACE(backend);
    Step s = make_step(backend, 16, 64, 1, {40, 3}, {5, 2}, 9);
    const int64_t T = s.batch.num_tokens();
    std::mt19937 rng(4);
    HostBuffer q(DType::f32, {T, kHq, kQk}), k(DType::f32, {T, kHq, kQk}),
        v(DType::f32, {T, kHq, kV}), out(DType::f32, {T, kHq, kV}), lse(DType::f32, {T, kHq}),
        latent(DType::f32, {T, 1, kRow}), wide(DType::f32, {T, kHq, kRow});
    for (HostBuffer* b : {&q, &k, &v, &latent, &wide}) fill_normal(b->view(), rng);
    const MlaMhaArgs good{.q = q.view(), .k = k.view(), .v = v.view(), .out = out.view(),
                          .lse = lse.view(), .latent = latent.view()};
    expect_error([&] { s.rt->forward_mla_mha(0, good); }, {"outside a step", "begin_step"});

    const KVLayerView kv = s.rt->kv_cache().layer(0);
    const std::vector<float> before(static_cast<float*>(kv.k),
                                    static_cast<float*>(kv.k) + kv.num_rows * kv.k_row_stride);
    s.rt->begin_step(s.batch);
    const int chunks = s.rt->prefix_chunk_plan().num_chunks();
    ASSERT_EQ(chunks, 2);  // 32 prefix keys per request per chunk
    MlaChunkArgs chunk{.q = q.view(), .k = k.view(), .v = v.view(), .out = out.view(),
                       .lse = lse.view()};
    expect_error([&] { s.rt->forward_mla_prefix_chunk(0, 0, chunk); },
                 {"prefix chunk 0 of layer 0 before the causal part"});
    MlaMhaArgs bad = good;
    bad.q = wide.view();
    expect_error([&] { s.rt->forward_mla_mha(0, bad); },
                 {"q is fp32[7, 4, 576]", "[7, 4, 192]"});
    bad = good;
    bad.lse = TensorView();
    expect_error([&] { s.rt->forward_mla_mha(0, bad); }, {"lse is empty", "2 prefix chunks"});
    const std::vector<float> after(static_cast<float*>(kv.k),
                                   static_cast<float*>(kv.k) + kv.num_rows * kv.k_row_stride);
    EXPECT_TRUE(before == after) << "a rejected call wrote the latent pool";

    s.rt->forward_mla_mha(0, good);
    expect_error([&] { s.rt->forward_mla_prefix_chunk(0, 2, chunk); },
                 {"prefix chunk 2", "chunks [0, 2)"});
    expect_error([&] { s.rt->forward_mla_prefix_chunk(0, 0, chunk); },
                 {"k is fp32[7, 4, 192]", "[35, 4, 192]"});
    HostBuffer lat(DType::f32, {35, 1, kRank});
    expect_error([&] { s.rt->gather_prefix_chunk(0, 0, lat.view()); },
                 {"out is fp32[35, 1, 512]", "[35, 1, 576]"});
    expect_error([&] { s.rt->gather_prefix_chunk(0, 5, lat.view()); }, {"chunks [0, 2)"});
    const int64_t n = s.rt->prefix_chunk_plan().chunks[1].num_tokens;
    HostBuffer kc(DType::f32, {n, kHq, kQk}), vc(DType::f32, {n, kHq, kV});
    fill_normal(kc.view(), rng);
    fill_normal(vc.view(), rng);
    chunk.k = kc.view();
    chunk.v = vc.view();
    s.rt->forward_mla_prefix_chunk(0, 1, chunk);
    expect_error([&] { s.rt->forward_mla_prefix_chunk(0, 1, chunk); }, {"already merged"});
    s.rt->end_step();

    // A short prefix under the default threshold runs absorbed: the MHA form is refused.
    Step absorbed = make_step(backend, 16, 64, 8192, {40, 3}, {5, 2}, 9);
    absorbed.rt->begin_step(absorbed.batch);
    EXPECT_EQ(absorbed.rt->mla_form(), MlaForm::absorbed);
    expect_error([&] { absorbed.rt->forward_mla_mha(0, good); },
                 {"runs MLA in the absorbed form", "chunked_prefix_cache_threshold"});
    absorbed.rt->end_step();
  }
}

}  // namespace
}  // namespace attnrt
