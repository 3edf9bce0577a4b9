// The warp-specialised prefill CTA over fp8 pages (backends/cuda/kernels/prefill_ws.cuh with
// PrefillWsKv8Config, producer in prefill_ws_kv8.cuh): the default for prefill / extend tiles over
// an e4m3 or e5m2 KV cache at head dims 64, 128 and 256. Its producer converts the fp8 K / V tiles to f16, the
// 16-bit CTA's consumers run on f16 MMAs, and bf16 q is scaled into f16 by a power of two, so it is
// held to the tolerance of the 16-bit CTAs over a bf16 cache (PrefillTolerance's defaults): K and
// V are exact in f16, q too (a power-of-two scale, bf16's 8 significant bits inside f16's 11), and
// P is rounded to f16 instead of bf16.
//
// Without a GPU: the conversion's thread mapping (coverage, placement, bank conflicts), the
// dispatch table and, in a CUDA build, the switch and `info --explain`. On the GPU, every case on
// an e4m3 and an e5m2 pool against the reference backend over the same pool bytes (unused rows
// NaN, outputs poisoned): ragged extend batches with cached prefixes crossing page edges, pages of
// 1, 16 and 128 slots (a page longer than the CTA's 64-key tile), GQA groups 1, 3, 4 and 8, causal
// and not, sliding windows, softcap, sinks, split keys merged by lse, MIXED and DRAFT_EXTEND steps,
// bf16 and fp16 activations, q of large and tiny magnitude, persistent CTAs walking many units.
// Each case checks that the launch takes this CTA.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/fp8_pv_layout.h"
#include "tests/test_cuda_prefill_case.h"
#include "tests/test_cuda_util.h"

#ifdef ATTNRT_HAS_CUDA
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/prefill.h"
#endif

namespace attnrt {
namespace {

// ---- Host models (no GPU).

// The producer's conversion of one staged fp8 tile of `keys` rows at head dim D run on the host,
// over the kernel's thread indices: thread tid reads in pass n the 16-byte chunk
// kv8_chunk<D / 16>(tid, n) of the staged tile (where ws_copy_tile's cp.async put it: wgmma.cuh's
// swz128_offset over 128-byte rows, q16_offset here; a 64-wide row fills half of one) and writes
// the 16-bit chunks 2c and 2c + 1 of the same row into the f16 tile (swz128_offset over D / 64
// column blocks, q16_offset here). Every staged chunk is read once, every f16 chunk written once,
// nothing outside either tile; each quarter warp's 16-byte loads and stores touch 8 different
// 16-byte bank groups.
template <int D>
void check_kv8_conversion(int keys) {
  constexpr int CH8 = D / 16;
  const int staged_bytes = cuda::kv8_staged_tile_bytes(keys, D);
  std::vector<int> read(staged_bytes / 16, 0), written(keys * 2 * CH8, 0);
  const int passes = keys * CH8 / 128;
  for (int warp = 0; warp < 4; ++warp)
    for (int n = 0; n < passes; ++n)
      for (int quarter = 0; quarter < 4; ++quarter) {
        std::set<int> load_groups, store_lo_groups, store_hi_groups;
        for (int l = 0; l < 8; ++l) {
          const int tid = 32 * warp + 8 * quarter + l;
          const cuda::Kv8Chunk k = cuda::kv8_chunk<CH8>(tid, n);
          ASSERT_GE(k.key, 0);
          ASSERT_LT(k.key, keys) << "thread " << tid << " pass " << n;
          ASSERT_GE(k.c, 0);
          ASSERT_LT(k.c, CH8);
          const int src = cuda::q16_offset(keys, k.key, k.c);
          ASSERT_LE(src + 16, staged_bytes);
          ++read[src / 16];
          load_groups.insert((src / 16) % 8);
          const int lo = cuda::q16_offset(keys, k.key, 2 * k.c);
          const int hi = cuda::q16_offset(keys, k.key, 2 * k.c + 1);
          ASSERT_LE(hi + 16, keys * D * 2);
          ASSERT_LE(lo + 16, keys * D * 2);
          ++written[lo / 16];
          ++written[hi / 16];
          store_lo_groups.insert((lo / 16) % 8);
          store_hi_groups.insert((hi / 16) % 8);
        }
        EXPECT_EQ(load_groups.size(), 8u) << "warp " << warp << " pass " << n << " quarter "
                                          << quarter << ": bank conflict on the loads";
        EXPECT_EQ(store_lo_groups.size(), 8u) << "warp " << warp << " pass " << n;
        EXPECT_EQ(store_hi_groups.size(), 8u) << "warp " << warp << " pass " << n;
      }
  // Staged chunks a 64-wide row does not fill (the second half of its 128-byte row) are read by
  // no one; every other one exactly once.
  for (size_t i = 0; i < read.size(); ++i) {
    const int row = static_cast<int>(i % (keys * 8)) / 8;
    const int chunk = 8 * (static_cast<int>(i) / (keys * 8)) + ((static_cast<int>(i) % 8) ^ (row % 8));
    ASSERT_EQ(read[i], chunk < CH8 ? 1 : 0) << "D " << D << ", " << keys << " keys, staged chunk " << i;
  }
  for (size_t i = 0; i < written.size(); ++i)
    ASSERT_EQ(written[i], 1) << "D " << D << ", " << keys << " keys, f16 chunk " << i;
}

TEST(Kv8PrefillLayout, ConversionCoversEveryChunkOnceWithoutBankConflicts) {
  check_kv8_conversion<128>(64);   // the CTA's tile
  check_kv8_conversion<128>(128);  // the 16-bit CTA's tile at head dim 128
  check_kv8_conversion<64>(64);
  check_kv8_conversion<64>(128);
  check_kv8_conversion<256>(64);
}

// Staged chunk c of row key holds fp8 elements 16c .. 16c + 15 of that key; the two f16 chunks it
// becomes must be elements 16c .. 16c + 7 and 16c + 8 .. 16c + 15 of the same key in the 16-bit
// layout: column block (2c) / 8, row key, chunk 2c % 8 swizzled by key % 8.
template <int D>
void check_kv8_placement(int keys) {
  constexpr int CH8 = D / 16;
  for (int tid = 0; tid < 128; ++tid)
    for (int n = 0; n < keys * CH8 / 128; ++n) {
      const cuda::Kv8Chunk k = cuda::kv8_chunk<CH8>(tid, n);
      for (int h = 0; h < 2; ++h) {
        const int chunk = 2 * k.c + h, off = cuda::q16_offset(keys, k.key, chunk);
        EXPECT_EQ(off / (keys * 128), chunk / 8);
        EXPECT_EQ(off % (keys * 128) / 128, k.key);
        EXPECT_EQ((off % 128) / 16, (chunk % 8) ^ (k.key % 8));
      }
      // The staged fp8 row: chunk c at c % 8 ^ key % 8 of 128-byte rows in column block c / 8
      // (what ws_copy_tile<BN, D / 16> writes).
      const int src = cuda::q16_offset(keys, k.key, k.c);
      EXPECT_EQ(src / (keys * 128), k.c / 8);
      EXPECT_EQ((src % 128) / 16, (k.c % 8) ^ (k.key % 8));
      if (D == 128) EXPECT_EQ(cuda::v_stage_offset(k.key, 16 * k.c), src);
    }
}

TEST(Kv8PrefillLayout, ConvertedChunksKeepTheirRowAndColumns) {
  for (int keys : {64, 128}) {
    check_kv8_placement<128>(keys);
    check_kv8_placement<64>(keys);
  }
  check_kv8_placement<256>(64);
}

// bf16 q's in-place conversion to f16 (prefill_q_scale.cuh's scale_q_rows_f16 at head dim D) run
// on the host over the consumers' thread indices: consumer thread ct reads and rewrites in pass n
// (of q_convert_passes(D)) the 16-bit chunk q_convert_chunk<D>(ct, n) of the copied Q tile. Each
// consumer touches only its own rows 64c .. 64c + 63, every chunk of them exactly once, and
// nothing outside the 128-row tile (D / 64 column blocks of 128-byte rows).
template <int D>
void check_q_scale_chunks() {
  constexpr int kRows = 128, kChunks = D / 8;
  std::vector<int> owner(kRows * kChunks, -1);
  for (int ct = 0; ct < 256; ++ct)
    for (int n = 0; n < cuda::q_convert_passes(D); ++n) {
      const int c = ct / 128;
      const cuda::QChunk q = cuda::q_convert_chunk<D>(ct, n);
      ASSERT_GE(q.r, 64 * c) << "D " << D << " thread " << ct << " pass " << n;
      ASSERT_LT(q.r, 64 * c + 64) << "D " << D << " thread " << ct << " pass " << n;
      ASSERT_GE(q.c, 0);
      ASSERT_LT(q.c, kChunks);
      const int off = cuda::q16_offset(kRows, q.r, q.c);
      ASSERT_EQ(off % 16, 0);
      ASSERT_LT(off, kRows * D * 2);
      ASSERT_EQ(owner[off / 16], -1) << "D " << D << ": row " << q.r << " chunk " << q.c
                                     << " converted twice";
      owner[off / 16] = c;
    }
  for (int i = 0; i < kRows * kChunks; ++i) ASSERT_NE(owner[i], -1) << "D " << D << " chunk " << i;
}

TEST(Kv8PrefillLayout, QScaleCoversEachConsumersOwnRowsOnce) {
  check_q_scale_chunks<64>();
  check_q_scale_chunks<128>();
  check_q_scale_chunks<256>();
}

// The table (host code): prefill items over e4m3 and e5m2 pools at head dims 64, 128 and 256 go
// to the warp-specialised CTA over fp8 pages, bf16 and fp16, unless the fp8 option takes the e4m3
// ones (head dim 128); TARGET_VERIFY, other head dims and other shapes as before.
TEST(Kv8PrefillDispatch, Fp8PrefillItemsAtHeadDims64To256) {
  using cuda::AttnCta;
  using cuda::AttnKernelKey;
  using cuda::KvKind;
  using cuda::TileShape;
  const AttnKernelKey e4m3{.head_dim = 128,
                           .v_head_dim = 128,
                           .kv = KvKind::e4m3,
                           .shape = TileShape::prefill,
                           .rows = 128};
  EXPECT_EQ(cuda::attention_cta(e4m3), AttnCta::prefill_kv8);
  AttnKernelKey k = e4m3;
  k.fp16 = true;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill_kv8) << "fp16 q / out";
  k = e4m3;
  k.kv = KvKind::e5m2;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill_kv8) << "e5m2";
  k.fp8_prefill = true;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill_kv8) << "e5m2: the fp8 CTA reads e4m3 only";
  k = e4m3;
  k.fp8_prefill = true;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::fp8_prefill) << "the option keeps the fp8 CTA";
  k = e4m3;
  k.kv = KvKind::same_as_q;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill) << "16-bit KV";
  k = e4m3;
  k.target_verify = true;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::mma_prefill) << "TARGET_VERIFY (tree masks)";
  for (int d : {64, 256}) {
    k = e4m3;
    k.head_dim = k.v_head_dim = d;
    EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill_kv8) << "head dim " << d;
    k.fp8_prefill = true;
    EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill_kv8)
        << "head dim " << d << ": the fp8 CTA has head dim 128 only";
    k.fp8_prefill = false;
    k.kv = KvKind::e5m2;
    EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill_kv8) << "head dim " << d << ", e5m2";
  }
  for (int d : {32, 96, 192}) {
    k = e4m3;
    k.head_dim = k.v_head_dim = d;
    EXPECT_NE(cuda::attention_cta(k), AttnCta::prefill_kv8) << "head dim " << d;
  }
  k = e4m3;
  k.v_head_dim = 64;
  EXPECT_NE(cuda::attention_cta(k), AttnCta::prefill_kv8) << "K 128 wide, V 64";
  for (TileShape sh : {TileShape::decode, TileShape::decode32, TileShape::verify}) {
    k = e4m3;
    k.shape = sh;
    k.rows = cuda::tile_rows(sh);
    EXPECT_NE(cuda::attention_cta(k), AttnCta::prefill_kv8) << static_cast<int>(sh);
  }
  EXPECT_FALSE(cuda::launches_as_dependent(AttnCta::prefill_kv8));
}

#ifdef ATTNRT_HAS_CUDA

using test::check_gqa_groups;
using test::check_non_causal_and_long;
using test::check_prefill;
using test::check_split_keys;
using test::check_window_softcap_and_sinks;
using test::draft_extend_case;
using test::lengths;
using test::many_units_case;
using test::mixed_step_case;
using test::PrefillCase;
using test::ring_wrap_case;
using test::ScopedPrefillKv8;
using test::small_step_case;

// Host only: ATTNRT_PREFILL_KV8=0 sends the items to the mma.sync CTA, and `info --explain` names
// whichever runs.
TEST(Kv8PrefillDispatch, SwitchOffRunsTheMmaSyncCtaAndExplainSaysSo) {
  const cuda::AttnKernelKey key{.head_dim = 128,
                                .v_head_dim = 128,
                                .kv = cuda::KvKind::e5m2,
                                .shape = cuda::TileShape::prefill,
                                .rows = 128};
  ModelSpec m;
  m.name = "kv8-prefill-explain";
  m.layers = {test::attention_layer(0, 32, 8, 128)};
  const Options o;
  auto extend_line = [&](DType kv) {
    for (const std::string& line : cuda::explain_cuda_kernels(m, o, kv))
      if (line.find("  extend") == 0) return line;
    return std::string();
  };
  {
    const ScopedPrefillKv8 on(true);
    EXPECT_EQ(cuda::effective_attention_cta(key), cuda::AttnCta::prefill_kv8);
    for (DType kv : {DType::e4m3, DType::e5m2}) {
      const std::string line = extend_line(kv);
      EXPECT_NE(line.find("warp-specialised prefill CTA over fp8 pages"), std::string::npos)
          << line;
      EXPECT_NE(line.find(kv == DType::e4m3 ? "e4m3" : "e5m2"), std::string::npos) << line;
    }
  }
  {
    const ScopedPrefillKv8 off(false);
    EXPECT_EQ(cuda::effective_attention_cta(key), cuda::AttnCta::mma_prefill);
    const std::string line = extend_line(DType::e4m3);
    EXPECT_NE(line.find("mma.sync CTA"), std::string::npos) << line;
    EXPECT_NE(line.find("ATTNRT_PREFILL_KV8=0"), std::string::npos) << line;
  }
}

// Every GPU case on an e4m3 and an e5m2 pool at head dims 64, 128 and 256 (each its own
// configuration of the CTA: tile, stages, staging), the CTA switched on (restored after each test).
struct Kv8Param {
  DType dtype;
  int dim;
};

class CudaKv8PrefillTest : public ::testing::TestWithParam<Kv8Param> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }

  PrefillCase kv8_case(std::vector<int32_t> prefix, std::vector<int32_t> qlen,
                       uint32_t seed) const {
    PrefillCase c = lengths(std::move(prefix), std::move(qlen), seed);
    c.fp8_kv = true;
    c.fp8_dtype = GetParam().dtype;
    c.dim = GetParam().dim;
    return c;
  }
  // check_prefill as the shared scenario groups' `check`.
  static auto check() {
    return [](const PrefillCase& c, const testing::Message& what) { check_prefill(c, what); };
  }
  // kv8_case as the shared scenarios' `make` (test_cuda_prefill_case.h).
  auto make() const {
    return [this](std::vector<int32_t> prefix, std::vector<int32_t> qlen, uint32_t seed) {
      return kv8_case(std::move(prefix), std::move(qlen), seed);
    };
  }

 private:
  ScopedPrefillKv8 on_{true};
};

TEST_P(CudaKv8PrefillTest, RaggedCausalExtendOverPageEdges) {
  // Prefixes on a page boundary (0, 32, 256), one key past one (17) and mid-page (301); query runs
  // shorter than a tile, one token, and several tiles long. Pages of 1 and 16 slots (several pages
  // a key tile) and of 128 (a page longer than the 64-key tile).
  for (int page : {1, 16, 128}) {
    PrefillCase c =
        kv8_case({0, 17, 256, 32, 301}, {300, 45, 1, 129, 200}, static_cast<uint32_t>(page + 100));
    c.page = page;
    check_prefill(c, testing::Message() << "page " << page);
  }
}

TEST_P(CudaKv8PrefillTest, Fp16Activations) {
  // q / out fp16: q used as it is (no scale), the rest as with bf16.
  for (int page : {1, 16}) {
    PrefillCase c = kv8_case({0, 17, 301}, {300, 45, 200}, static_cast<uint32_t>(page + 200));
    c.page = page;
    c.act = DType::f16;
    check_prefill(c, testing::Message() << "fp16, page " << page);
  }
}

TEST_P(CudaKv8PrefillTest, GqaGroups) {
  check_gqa_groups(make(), check());
}

TEST_P(CudaKv8PrefillTest, NonCausalAndLongRuns) {
  check_non_causal_and_long(make(), check());
}

TEST_P(CudaKv8PrefillTest, WindowSoftcapAndSinks) {
  check_window_softcap_and_sinks(make(), check());
}

TEST_P(CudaKv8PrefillTest, SplitKeysMergeWithLse) {
  check_split_keys(make(), check());
}

TEST_P(CudaKv8PrefillTest, ScalesAndLargeQ) {
  // Other per-layer scales (the k scale folded into the logit scale, the v scale into the
  // epilogue), then q far from 1: around 1e4 (bf16 and fp16), and around 1e5 in bf16, past f16's
  // largest value (65504): the power-of-two scale must bring it into f16's range. Its lse lies
  // near 1e5, where check_prefill compares at float precision (LargeQOnTheOtherCtas: the mma.sync
  // and 16-bit CTAs differ from the float64 reference by as many float ulps as this one).
  PrefillCase c = kv8_case({33, 0}, {220, 140}, 17);
  c.k_scale = 0.05f;
  c.v_scale = 4.f;
  check_prefill(c, testing::Message() << "k_scale 0.05, v_scale 4");
  c.k_scale = 2.f;
  c.v_scale = 0.25f;
  c.seed = 18;
  c.act = DType::f16;
  check_prefill(c, testing::Message() << "fp16, k_scale 2, v_scale 0.25");
  PrefillCase big = kv8_case({300, 64}, {200, 150}, 22);
  big.q_mul = 1e4f;
  check_prefill(big, testing::Message() << "bf16 q ~ 1e4");
  big.act = DType::f16;
  big.seed = 23;
  check_prefill(big, testing::Message() << "fp16 q ~ 1e4");
  big.act = DType::bf16;
  big.q_mul = 1e5f;
  big.k_scale = 0.01f;
  big.seed = 24;
  check_prefill(big, testing::Message() << "bf16 q ~ 1e5, k_scale 0.01");
}

// q around 1e5 (past f16's range, scaled by a power of two into it) on the other CTAs that take
// the same case: the mma.sync CTA over the same fp8 pages, and the 16-bit CTA over a bf16 pool
// (no f16 step at all): on the H100 all three differed from the float64 reference's lse (near
// 1e5) by 3-5 float ulps, the same for each, which check_prefill's relative term allows.
TEST_P(CudaKv8PrefillTest, LargeQOnTheOtherCtas) {
  PrefillCase big = kv8_case({300, 64}, {200, 150}, 24);
  big.q_mul = 1e5f;
  big.k_scale = 0.001f;
  {
    ScopedPrefillKv8 off(false);
    check_prefill(big, testing::Message() << "mma.sync CTA over fp8 pages, bf16 q ~ 1e5");
  }
  big.fp8_kv = false;
  check_prefill(big, testing::Message() << "16-bit CTA over a bf16 pool, bf16 q ~ 1e5");
}

TEST_P(CudaKv8PrefillTest, TinyQ) {
  // bf16 q around 1e-6, below f16's normal range (6.1e-5): unscaled, it would keep only a few
  // bits in f16; k_scale brings the logits to a few units so that those bits would show.
  PrefillCase c = kv8_case({500, 64}, {200, 150}, 25);
  c.q_mul = 1e-6f;
  c.k_scale = 4e6f;
  check_prefill(c, testing::Message() << "bf16 q ~ 1e-6, k_scale 4e6");
}

TEST_P(CudaKv8PrefillTest, MixedAndDraftExtendSteps) {
  check_prefill(mixed_step_case(make()), testing::Message() << "MIXED");
  check_prefill(draft_extend_case(make()), testing::Message() << "DRAFT_EXTEND");
}

TEST_P(CudaKv8PrefillTest, SmallStepForTheSanitizers) {
  check_prefill(small_step_case(make()));
}

TEST_P(CudaKv8PrefillTest, RingWrapForTheSanitizers) {
  check_prefill(ring_wrap_case(make()));
}

TEST_P(CudaKv8PrefillTest, MoreWorkItemsThanSms) {
  check_prefill(many_units_case(make()));
}

INSTANTIATE_TEST_SUITE_P(Fp8Pools, CudaKv8PrefillTest,
                         ::testing::Values(Kv8Param{DType::e4m3, 128}, Kv8Param{DType::e5m2, 128},
                                           Kv8Param{DType::e4m3, 64}, Kv8Param{DType::e5m2, 64},
                                           Kv8Param{DType::e4m3, 256}, Kv8Param{DType::e5m2, 256}),
                         [](const ::testing::TestParamInfo<Kv8Param>& info) {
                           return std::string(info.param.dtype == DType::e4m3 ? "E4m3" : "E5m2") +
                                  "D" + std::to_string(info.param.dim);
                         });

#endif

}  // namespace
}  // namespace attnrt
