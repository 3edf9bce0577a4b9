// MLA's MHA form on the cuda backend (cuda_mla_mha.cpp, the 192 / 128 warp-specialised prefill CTA)
// against the reference backend: ragged extends on cached prefixes of several chunk counts (one
// chunk, many, chunk boundaries inside pages), pages 1 / 16 / 64, tensor-parallel head counts,
// bf16 and fp8 latent pools, host and GPU tensors, and the GPU gather of the chunks' latent rows.
// Fresh random inputs every run (ATTNRT_TEST_SEED replays one); the cases skip, with the reason,
// where no CUDA device is usable.
#include <gtest/gtest.h>

#include <vector>

#include "tests/mla_mha_case.h"
#include "tests/test_cuda_util.h"

namespace attnrt {
namespace {

using namespace mla_mha_case;
using test::expect_close;

// bf16 outputs of two backends that read the same bf16 inputs: both round once at the end.
constexpr double kTol = 2e-2;

void expect_cuda_matches_reference(int page, int64_t capacity, const std::vector<int32_t>& prefix,
                                   const std::vector<int32_t>& extend, int hq,
                                   const std::string& kv_dtype = "") {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "page " << page << ", capacity " << capacity << ", heads "
                                  << hq << ", kv " << (kv_dtype.empty() ? "bf16" : kv_dtype)
                                  << ", seed " << seed);
  const Result want =
      mha_result("reference", page, capacity, prefix, extend, seed, DType::bf16, hq, kv_dtype);
  const Result got =
      mha_result("cuda", page, capacity, prefix, extend, seed, DType::bf16, hq, kv_dtype);
  EXPECT_EQ(got.chunks, want.chunks);
  expect_close(got.out.view(), want.out.view(), kTol, "out");
  expect_close(got.lse.view(), want.lse.view(), 1e-3, "lse");
}

TEST(CudaMlaMha, MatchesReferenceOverChunkAndPageSizes) {
  SKIP_WITHOUT_GPU();
  const std::vector<int32_t> prefix{100, 37, 0, 150}, extend{20, 1, 33, 7};
  for (int page : {1, 16, 64}) {
    // 1 chunk; 8 keys per request (19 chunks); 24 per request (boundaries mid-page).
    for (int64_t capacity : {int64_t{1} << 20, int64_t{32}, int64_t{96}})
      expect_cuda_matches_reference(page, capacity, prefix, extend, 4);
  }
}

// Requests longer than one 128-row tile and one 128-key tile, the tensor-parallel head counts, and
// a prefill without a prefix (no chunks).
TEST(CudaMlaMha, LongExtendsAtTensorParallelHeadCounts) {
  SKIP_WITHOUT_GPU();
  for (int hq : {16, 32, 128}) {
    expect_cuda_matches_reference(64, 600, {0, 0, 0}, {300, 129, 17}, hq);
    expect_cuda_matches_reference(16, 300, {411, 0, 129}, {260, 300, 1}, hq);
  }
}

TEST(CudaMlaMha, Fp8LatentPoolsDequantiseInTheGather) {
  SKIP_WITHOUT_GPU();
  for (const char* kv : {"fp8_e4m3", "fp8_e5m2"})
    expect_cuda_matches_reference(16, 96, {100, 37, 0, 150}, {20, 1, 33, 7}, 16, kv);
}

#ifdef ATTNRT_HAS_CUDA
// The engine's path: q, k, v, out, lse and the gathered latent rows on the GPU, used in place.
TEST(CudaMlaMha, GpuTensorsMatchTheHostPath) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::vector<int32_t> prefix{200, 0, 77}, extend{40, 150, 3};
  const int hq = 16;
  const Result want = mha_result("reference", 16, 96, prefix, extend, seed, DType::bf16, hq);

  Step s = make_step("cuda", 16, 96, 1, prefix, extend, seed, DType::bf16, hq);
  const int64_t T = s.batch.num_tokens();
  std::mt19937 rng(static_cast<uint32_t>(seed * 7 + 1));
  HostBuffer q(DType::bf16, {T, hq, kQk}), latent(DType::bf16, {T, 1, kRow});
  test::fill_normal(q.view(), rng);
  test::fill_normal(latent.view(), rng);
  const sim::MlaWeights w(mla_layer(0, hq), 5);
  HostBuffer k(DType::bf16, {T, hq, kQk}), v(DType::bf16, {T, hq, kV}),
      out(DType::bf16, {T, hq, kV}), lse(DType::f32, {T, hq});
  w.decompress(latent.view(), k.view(), v.view());
  test::poison(out.view());
  test::poison(lse.view());
  const test::DevTensor dq(q.view()), dk(k.view()), dv(v.view()), dout(out.view()),
      dlse(lse.view()), dlat(latent.view());
  s.rt->begin_step(s.batch);
  ASSERT_EQ(s.rt->mla_form(), MlaForm::mha);
  s.rt->forward_mla_mha(0, {.q = dq.view, .k = dk.view, .v = dv.view, .out = dout.view,
                            .lse = dlse.view, .latent = dlat.view});
  const PrefixChunkPlan& plan = s.rt->prefix_chunk_plan();
  ASSERT_GT(plan.num_chunks(), 1);
  for (int c = 0; c < plan.num_chunks(); ++c) {
    const int64_t n = plan.chunks[c].num_tokens;
    HostBuffer lat(DType::bf16, {n, 1, kRow}), kc(DType::bf16, {n, hq, kQk}),
        vc(DType::bf16, {n, hq, kV});
    test::poison(lat.view());
    const test::DevTensor dlat_c(lat.view());
    s.rt->gather_prefix_chunk(0, c, dlat_c.view);
    dlat_c.download(lat.view());
    w.decompress(lat.view(), kc.view(), vc.view());
    const test::DevTensor dkc(kc.view()), dvc(vc.view());
    s.rt->forward_mla_prefix_chunk(0, c, {.q = dq.view, .k = dkc.view, .v = dvc.view,
                                          .out = dout.view, .lse = dlse.view});
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // dkc / dvc are freed at the scope's end
  }
  s.rt->end_step();
  dout.download(out.view());
  dlse.download(lse.view());
  expect_close(out.view(), want.out.view(), kTol, "out");
  expect_close(lse.view(), want.lse.view(), 1e-3, "lse");
}

#endif

}  // namespace
}  // namespace attnrt
