// The DSA indexer's tensor-core score kernel (kernels/dsa.cu, ATTNRT_DSA_INDEXER=mma) through
// launch_dsa_select, against the CUDA-core kernel and a float64 host computation of the same
// scores (index queries rounded by round_index_query, keys read back from the paged fp8 cache):
// every score within a tight relative tolerance of both, and the selected slots those of the exact
// order but for swaps among scores within that tolerance of the cut. DeepSeek-V3.2's index shape
// (64 heads x 128) at pages 64 and 1, and 48 heads x 64; candidate counts past 2048 that end
// inside a key tile; index_topk 2048 and 16; per-head query and per-key magnitudes spread over
// powers of two, so the power-of-two scales differ. Outputs poisoned before every launch. Fresh
// random inputs every run (ATTNRT_TEST_SEED replays one).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "attnrt/backend/dsa.h"
#include "attnrt/core/dtype.h"
#include "attnrt/core/tensor.h"
#include "attnrt/memory/index_key_cache.h"
#include "tests/test_cuda_util.h"

#ifdef ATTNRT_HAS_CUDA
#include "backends/cuda/kernels/dsa.h"
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

using cuda::DsaIndexer;

// Scores may differ from the float64 ones (and between the kernels) by this much relative to the
// token's largest score: fp32 dots summed in another order (a few 1e-7 at these sizes).
constexpr double kRelTol = 1e-5;

struct Shape {
  int heads, dim, page;
  std::vector<int32_t> cands;  // per query token, each > the largest topk tested
};

// One launch's inputs on the host and the device: every token one request of one query over
// candidates 0 .. cands - 1, its pages a rotation of one random permutation of the pool's pages.
struct Indexer {
  Shape s;
  int64_t T = 0, num_scores = 0, slots = 0;
  HostBuffer q, w;
  std::vector<uint8_t> keys;
  std::vector<int32_t> page_table, pt_start;
  std::vector<int64_t> score_off;
  std::vector<std::vector<double>> want;  // float64 scores [token][candidate]
  double score_scale = 0;

  Indexer(const Shape& shape, std::mt19937& rng)
      : s(shape),
        T(static_cast<int64_t>(shape.cands.size())),
        q(DType::bf16, {T, shape.heads, shape.dim}),
        w(DType::f32, {T, shape.heads}) {
    const int H = s.heads, D = s.dim, P = s.page;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_int_distribution<int> octave(-4, 4);
    // Queries: each head at its own magnitude (its scale), bf16 as the model hands them.
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        const float mag = std::ldexp(1.f, octave(rng));
        for (int d = 0; d < D; ++d)
          store_from_float(q.data(), DType::bf16, (t * H + h) * D + d, nd(rng) * mag);
      }
    test::fill_normal(w.view(), rng);
    // The pool: pages of P slots, [P * D codes | P fp32 scales], every key at its own magnitude.
    const int32_t most = *std::max_element(s.cands.begin(), s.cands.end());
    const int32_t pages = (most + P - 1) / P + 3;
    slots = int64_t{pages} * P;
    keys.assign(static_cast<size_t>(slots) * (D + 4), 0);
    std::vector<float> x(D), kf(static_cast<size_t>(slots) * D);
    for (int64_t slot = 0; slot < slots; ++slot) {
      const float mag = std::ldexp(1.f, octave(rng));
      for (float& v : x) v = nd(rng) * mag;
      uint8_t* codes = keys.data() + codes_at(slot);
      const float scale = quantize_fp8_block(x.data(), D, codes);
      std::memcpy(keys.data() + scale_at(slot), &scale, 4);
      for (int d = 0; d < D; ++d) kf[slot * D + d] = e4m3_to_float(codes[d]) * scale;
    }
    std::vector<int32_t> perm(pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    score_scale = 1.0 / std::sqrt(static_cast<double>(H) * D);
    std::vector<float> qf(D), qr(static_cast<size_t>(H) * D);
    for (int64_t t = 0; t < T; ++t) {
      const int32_t n = s.cands[t];
      pt_start.push_back(static_cast<int32_t>(page_table.size()));
      for (int32_t pg = 0; pg < (n + P - 1) / P; ++pg)
        page_table.push_back(perm[(pg + 7 * t) % pages]);
      score_off.push_back(num_scores);
      num_scores += n;
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d)
          qf[d] = load_as_float(q.data(), DType::bf16, (t * H + h) * D + d);
        round_index_query(qf.data(), D, qr.data() + static_cast<size_t>(h) * D);
      }
      std::vector<double>& sc = want.emplace_back(n);
      for (int32_t m = 0; m < n; ++m) {
        const float* k = kf.data() + slot_of(t, m) * D;
        double sum = 0;
        for (int h = 0; h < H; ++h) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += double{qr[h * D + d]} * k[d];
          sum += double{w.ptr<float>()[t * H + h]} * std::max(dot, 0.0);
        }
        sc[m] = score_scale * sum;
      }
    }
  }

  int64_t codes_at(int64_t slot) const {
    return (slot / s.page) * s.page * (s.dim + 4) + (slot % s.page) * s.dim;
  }
  int64_t scale_at(int64_t slot) const {
    return (slot / s.page) * s.page * (s.dim + 4) + int64_t{s.page} * s.dim + (slot % s.page) * 4;
  }
  int64_t slot_of(int64_t t, int32_t m) const {
    return int64_t{page_table[pt_start[t] + m / s.page]} * s.page + m % s.page;
  }
};

struct Selected {
  std::vector<float> scores;   // [num_scores]
  std::vector<int32_t> slots;  // [T, topk]
};

// launch_dsa_select on `kernel` (the process's choice restored after).
Selected run_indexer(const Indexer& in, DsaIndexer kernel, int topk) {
  const int64_t T = in.T;
  std::vector<cuda::ReqInfo> reqs(T);
  std::vector<cuda::DsaToken> tokens(T);
  std::vector<int32_t> scored(T);
  int32_t max_cand = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t n = in.s.cands[t];
    reqs[t] = cuda::ReqInfo{.qo_start = static_cast<int32_t>(t),
                            .qlen = 1,
                            .prefix = n - 1,
                            .kv_len = n,
                            .pt_start = in.pt_start[t],
                            .num_splits = 1,
                            .part_start = 0,
                            .tree_start = -1,
                            .pt_row = 0,
                            .pt_known = 0,
                            .pt_commit = 0,
                            .pad = 0};
    tokens[t] = cuda::DsaToken{.req = static_cast<int32_t>(t),
                               .t = 0,
                               .num_cand = n,
                               .pad = 0,
                               .score_off = in.score_off[t]};
    scored[t] = static_cast<int32_t>(t);
    max_cand = std::max(max_cand, n);
  }
  const test::DeviceMemory d_reqs(reqs.size() * sizeof(cuda::ReqInfo)),
      d_pt(in.page_table.size() * sizeof(int32_t)),
      d_tokens(tokens.size() * sizeof(cuda::DsaToken)), d_scored(scored.size() * sizeof(int32_t)),
      d_keys(in.keys.size()), d_scores(static_cast<size_t>(in.num_scores) * sizeof(float)),
      d_slots(static_cast<size_t>(T) * topk * sizeof(int32_t));
  d_reqs.upload(reqs.data());
  d_pt.upload(in.page_table.data());
  d_tokens.upload(tokens.data());
  d_scored.upload(scored.data());
  d_keys.upload(in.keys.data());
  const test::DevTensor q(in.q.view()), w(in.w.view());
  // Poison: NaN scores, slot -1.
  EXPECT_EQ(cudaMemset(d_scores.ptr, 0xff, d_scores.bytes), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_slots.ptr, 0xff, d_slots.bytes), cudaSuccess);

  cuda::DsaParams p{};
  p.reqs = d_reqs.as<cuda::ReqInfo>();
  p.page_table = d_pt.as<int32_t>();
  p.page_shift = static_cast<int32_t>(std::countr_zero(static_cast<unsigned>(in.s.page)));
  p.tokens = d_tokens.as<cuda::DsaToken>();
  p.row0 = 0;
  p.num_tokens = T;
  p.scored = d_scored.as<int32_t>();
  p.num_scored = static_cast<int32_t>(T);
  p.max_cand = max_cand;
  p.q = q.ptr;
  p.q_dtype = static_cast<int32_t>(DType::bf16);
  p.q_s0 = int64_t{in.s.heads} * in.s.dim;
  p.q_s1 = in.s.dim;
  p.q_s2 = 1;
  p.w = w.ptr;
  p.w_dtype = static_cast<int32_t>(DType::f32);
  p.w_s0 = in.s.heads;
  p.w_s1 = 1;
  p.heads = in.s.heads;
  p.dim = in.s.dim;
  p.score_scale = in.score_scale;
  p.keys = d_keys.as<uint8_t>();
  p.key_page = in.s.page;
  p.scores = d_scores.as<float>();
  p.topk = topk;
  p.sel_slots = d_slots.as<int32_t>();

  const DsaIndexer before = cuda::dsa_indexer();
  cuda::set_dsa_indexer(kernel);
  EXPECT_EQ(cuda::launch_dsa_select(p, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cuda::set_dsa_indexer(before);
  Selected r{std::vector<float>(static_cast<size_t>(in.num_scores)),
             std::vector<int32_t>(static_cast<size_t>(T) * topk)};
  d_scores.download(r.scores.data());
  d_slots.download(r.slots.data());
  return r;
}

double token_max(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Every score of `got` within kRelTol x the token's largest of `want`.
void expect_scores_near(const Indexer& in, const std::vector<float>& got,
                        const std::vector<std::vector<double>>& want, const char* what) {
  int bad = 0;
  for (int64_t t = 0; t < in.T; ++t) {
    const double tol = kRelTol * token_max(want[t]);
    EXPECT_GT(tol, 0.0) << "token " << t << " has no nonzero score";
    for (size_t m = 0; m < want[t].size(); ++m) {
      const double x = got[in.score_off[t] + m], y = want[t][m];
      if (!(std::fabs(x - y) <= tol) && bad++ < 8)
        ADD_FAILURE() << what << ": token " << t << " candidate " << m << " scored " << x
                      << ", want " << y << " (tolerance " << tol << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what << ": scores past the tolerance";
}

// The selection of token t in `got` (slots in increasing token index) against the exact rule on
// `order` (dsa_ranks_before): the same count, increasing candidates, and where the sets differ only
// candidates whose `order` score is within `tol` of the cut (the topk-th score).
void expect_selection(const Indexer& in, const Selected& got, int topk,
                      const std::vector<std::vector<double>>& order, double rel_tol,
                      const char* what) {
  for (int64_t t = 0; t < in.T; ++t) {
    SCOPED_TRACE(testing::Message() << what << ", token " << t << ", topk " << topk);
    const int32_t n = in.s.cands[t];
    const std::vector<double>& sc = order[t];
    std::vector<int32_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    std::nth_element(idx.begin(), idx.begin() + (topk - 1), idx.end(),
                     [&](int32_t a, int32_t b) { return dsa_ranks_before(sc[a], a, sc[b], b); });
    const double cut = sc[idx[topk - 1]];
    std::vector<char> want(n, 0), have(n, 0);
    for (int k = 0; k < topk; ++k) want[idx[k]] = 1;
    // Slot -> candidate of this token.
    std::vector<int32_t> cand_of(static_cast<size_t>(in.slots), -1);
    for (int32_t m = 0; m < n; ++m) cand_of[in.slot_of(t, m)] = m;
    int32_t prev = -1;
    for (int k = 0; k < topk; ++k) {
      const int32_t slot = got.slots[t * topk + k];
      ASSERT_TRUE(slot >= 0 && slot < in.slots) << "selected key " << k << " is slot " << slot;
      const int32_t m = cand_of[slot];
      ASSERT_GT(m, prev) << "selected key " << k << " (slot " << slot
                         << ") is no candidate or out of order";
      have[m] = 1;
      prev = m;
    }
    const double tol = rel_tol * token_max(sc);
    int swaps = 0;
    for (int32_t m = 0; m < n; ++m) {
      if (want[m] == have[m]) continue;
      ++swaps;
      EXPECT_LE(std::fabs(sc[m] - cut), tol)
          << "candidate " << m << (have[m] ? " selected" : " left out") << " with score " << sc[m]
          << ", the cut is " << cut;
    }
    EXPECT_LE(swaps, 8) << "more swaps at the cut than near-ties explain";
  }
}

std::vector<std::vector<double>> as_double(const Indexer& in, const std::vector<float>& s) {
  std::vector<std::vector<double>> v(in.T);
  for (int64_t t = 0; t < in.T; ++t)
    v[t].assign(s.begin() + in.score_off[t], s.begin() + in.score_off[t] + in.s.cands[t]);
  return v;
}

TEST(CudaDsaMma, ScoresAndSelectionsMatchTheCudaCoreKernelAndFloat64) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const std::vector<Shape> shapes = {{64, 128, 64, {2049, 3000, 4133, 2176}},
                                     {64, 128, 1, {2050, 2400}},
                                     {48, 64, 16, {2081, 2999}}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(testing::Message() << s.heads << " heads x " << s.dim << ", page " << s.page);
    ASSERT_TRUE(cuda::dsa_mma_takes(s.heads, s.dim));
    const Indexer in(s, rng);
    for (int topk : {2048, 16}) {
      const Selected core = run_indexer(in, DsaIndexer::cuda_core, topk);
      const Selected mma = run_indexer(in, DsaIndexer::mma, topk);
      const std::vector<std::vector<double>> core_d = as_double(in, core.scores);
      expect_scores_near(in, core.scores, in.want, "cuda_core against float64");
      expect_scores_near(in, mma.scores, in.want, "mma against float64");
      expect_scores_near(in, mma.scores, core_d, "mma against cuda_core");
      // The select kernel takes the exact order of the scores it is given.
      expect_selection(in, core, topk, core_d, 0.0, "cuda_core selection of its scores");
      expect_selection(in, mma, topk, as_double(in, mma.scores), 0.0,
                       "mma selection of its scores");
      expect_selection(in, mma, topk, core_d, kRelTol, "mma selection against cuda_core");
      expect_selection(in, mma, topk, in.want, kRelTol, "mma selection against float64");
    }
  }
}

TEST(CudaDsaMma, TakesIndexDimsThatAreMultiplesOf16) {
  EXPECT_TRUE(cuda::dsa_mma_takes(64, 128));
  EXPECT_TRUE(cuda::dsa_mma_takes(16, 16));
  EXPECT_TRUE(cuda::dsa_mma_takes(48, 64));
  EXPECT_FALSE(cuda::dsa_mma_takes(4, 32));    // the small test dims: CUDA cores
  EXPECT_FALSE(cuda::dsa_mma_takes(64, 132));  // past kDsaMaxIndexDim
  EXPECT_FALSE(cuda::dsa_mma_takes(80, 128));  // past kDsaMaxIndexHeads
  EXPECT_FALSE(cuda::dsa_mma_takes(64, 120));
}

#endif  // ATTNRT_HAS_CUDA

}  // namespace
}  // namespace attnrt
