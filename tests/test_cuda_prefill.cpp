// The cuda backend's prefill / extend kernel (backends/cuda/kernels/prefill.cuh) against the
// reference backend: ragged causal batches with cached prefixes that start and end on and off page
// boundaries, pages scattered through the pool, every head dim, GQA groups that do and do not
// divide the 128-row tile, non-causal layers, window / softcap / sinks, split-KV with lse, MIXED
// and DRAFT_EXTEND steps, fp16. Every case first checks that the plan gave it the prefill tile
// shape with 16-bit KV, i.e. that the prefill kernel is the one under test. Skips (with the
// reason) where no CUDA device is usable. Every case runs on the earlier prefill CTA (prefill.cuh),
// on the warp-specialised one (prefill_ws.cuh) with its cp.async producer without and with its
// ping-pong, and on the default (the warp-specialised CTA with its TMA producer where it applies:
// pages of 8 slots or more; each case checks that it does). Pool rows no request uses hold NaN,
// so a kernel that lets a key past a request's last one into its sums fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "backends/reference/reference_backend.h"
#include "tests/test_cuda_prefill_case.h"
#include "tests/test_cuda_util.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/prefill.h"
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

using test::check_prefill;
using test::lengths;
using test::PrefillCase;

// CudaPrefillTest runs every case on the earlier prefill CTA (prefill.cuh), CudaPrefillWsTest and
// CudaPrefillWsPingPongTest on the warp-specialised one (prefill_ws.cuh, ATTNRT_PREFILL_WS=1 and
// 2) with the cp.async producer (ATTNRT_PREFILL_TMA=0), CudaPrefillWsTmaTest on the default
// (ATTNRT_PREFILL_WS=-1, ATTNRT_PREFILL_TMA=1); each restores the switches after.
class CudaPrefillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!query_cuda().usable) GTEST_SKIP() << "no usable CUDA device: " << query_cuda().reason;
    saved_ = cuda::prefill_ws_mode();
    saved_tma_ = cuda::prefill_tma_enabled();
    cuda::set_prefill_ws_mode(ws_mode());
    cuda::set_prefill_tma(tma());
    ASSERT_EQ(cuda::prefill_ws_mode(), ws_mode());
    ASSERT_EQ(cuda::prefill_tma_enabled(), tma());
  }
  void TearDown() override {
    if (!query_cuda().usable) return;
    cuda::set_prefill_ws_mode(saved_);
    cuda::set_prefill_tma(saved_tma_);
  }
  virtual int ws_mode() const { return 0; }
  virtual bool tma() const { return false; }

 private:
  int saved_ = 0;
  bool saved_tma_ = true;
};

class CudaPrefillWsTest : public CudaPrefillTest {
 protected:
  int ws_mode() const override { return 1; }
};

class CudaPrefillWsPingPongTest : public CudaPrefillTest {
 protected:
  int ws_mode() const override { return 2; }
};

class CudaPrefillWsTmaTest : public CudaPrefillTest {
 protected:
  int ws_mode() const override { return cuda::kWsAuto; }
  bool tma() const override { return true; }
};

// A case of the four suites.
#define PREFILL_CASE(name)                                  \
  void name##Case();                                        \
  TEST_F(CudaPrefillTest, name) { name##Case(); }           \
  TEST_F(CudaPrefillWsTest, name) { name##Case(); }         \
  TEST_F(CudaPrefillWsPingPongTest, name) { name##Case(); } \
  TEST_F(CudaPrefillWsTmaTest, name) { name##Case(); }      \
  void name##Case()

// The prefill kernel walks the plan's prefill and verify work items: its CTAs must cover the same
// rows.
TEST(CudaPrefillTile, MatchesThePlansPrefillAndVerifyTiles) {
  EXPECT_EQ(cuda::kPrefillTileRows, cuda::tile_rows(cuda::TileShape::prefill));
  EXPECT_EQ(cuda::kPrefillVerifyTileRows, cuda::tile_rows(cuda::TileShape::verify));
}

PREFILL_CASE(RaggedCausalExtendAcrossHeadDims) {
  for (int dim : {64, 128, 256}) {
    // Prefixes on a page boundary (0, 32, 256), one key past one (17), and mid-page (301); query
    // runs shorter than a tile, one token, and several tiles long.
    PrefillCase c =
        lengths({0, 17, 256, 32, 301}, {300, 45, 1, 129, 200}, static_cast<uint32_t>(dim));
    c.dim = dim;
    check_prefill(c, testing::Message() << "dim " << dim);
  }
}

PREFILL_CASE(GroupsThatSplitTokensAcrossTiles) {
  // Group 3: a 128-row tile ends inside a token's heads; group 1 and 8: one and many heads.
  for (auto [hq, hkv] : {std::pair{12, 4}, std::pair{4, 4}, std::pair{32, 4}}) {
    PrefillCase c = lengths({48, 0, 5}, {170, 97, 64}, static_cast<uint32_t>(hq * 10 + hkv));
    c.hq = hq;
    c.hkv = hkv;
    check_prefill(c, testing::Message() << "hq " << hq << " hkv " << hkv);
  }
}

PREFILL_CASE(PageSizesAndLongRuns) {
  // Many key tiles per CTA (the K/V ring wraps many times) on pages of 1, 8 (the smallest the TMA
  // producer takes: 16 boxes per tile and column block), 64 and 128 slots (one box per tile at
  // head dims 64 and 128; two at 256).
  for (int page : {1, 8, 64, 128}) {
    PrefillCase c = lengths({640, 0}, {400, 600}, static_cast<uint32_t>(page + 3));
    c.page = page;
    check_prefill(c, testing::Message() << "page " << page);
  }
}

PREFILL_CASE(MoreWorkItemsThanSms) {
  // 32 ragged requests x 4 KV heads: ~900 (work item, KV head) units, more than 4 per SM, so the
  // warp-specialised CTAs run persistent and walk several units each, the K/V ring and the Q
  // barriers carrying on from one unit to the next at every ring position.
  PrefillCase c;
  c.hq = 16;
  c.hkv = 4;
  for (int i = 0; i < 32; ++i) {
    c.prefix.push_back((i * 37) % 300);
    c.qlen.push_back(150 + (i * 53) % 120);
  }
  c.seed = 29;
  check_prefill(c);
}

PREFILL_CASE(NonCausalWithAndWithoutPrefix) {
  for (int dim : {64, 256}) {
    PrefillCase c = lengths({0, 80}, {260, 150}, static_cast<uint32_t>(dim + 7));
    c.causal = false;
    c.dim = dim;
    check_prefill(c, testing::Message() << "dim " << dim);
  }
}

PREFILL_CASE(WindowSoftcapAndSinks) {
  PrefillCase c = lengths({500, 0, 64}, {300, 260, 150});
  c.window = 100;
  c.cap = 20.f;
  c.sinks = true;
  check_prefill(c);
  c.window = 0;  // each query sees only itself
  c.cap = 0.f;
  c.seed = 2;
  check_prefill(c);
  c.window = 130;  // a window edge that moves inside one key tile
  c.sinks = false;
  c.dim = 64;
  c.seed = 3;
  check_prefill(c);
}

PREFILL_CASE(WindowStartingInsideATileWithSplitKeys) {
  // One long request, its keys split: the window's first key (prefix + first token - window) is
  // no multiple of the key tile, so the warp-specialised CTA starts its range a tile boundary
  // earlier (the TMA producer loads whole pages) and masks the keys before the window.
  for (auto [dim, page] : {std::pair{128, 64}, std::pair{256, 8}, std::pair{64, 128}}) {
    PrefillCase c = lengths({2990}, {140}, static_cast<uint32_t>(dim + page));
    c.dim = dim;
    c.page = page;
    c.window = 1001;
    check_prefill(c, testing::Message() << "dim " << dim << " page " << page);
  }
}

PREFILL_CASE(LastPagesEndingMidPageOverNaNRows) {
  // Every request's keys end inside a page whose other rows are NaN; the last tile of each range
  // holds whole pages, the partial page and rows past it (zero-filled), at every page size the
  // TMA producer takes.
  for (int page : {8, 16, 32, 128}) {
    for (int dim : {64, 256}) {
      PrefillCase c = lengths({0, 21, 130}, {133, 250, 1}, static_cast<uint32_t>(page * 3 + dim));
      c.dim = dim;
      c.page = page;
      check_prefill(c, testing::Message() << "page " << page << " dim " << dim);
    }
  }
}

PREFILL_CASE(SplitKeysMergeWithLse) {
  // Few CTAs and many keys: the plan splits the keys and the merge kernel combines the partials.
  PrefillCase c = lengths({3000}, {129});
  check_prefill(c);
  c.causal = false;
  c.dim = 256;
  c.seed = 9;
  check_prefill(c);
}

PREFILL_CASE(MixedAndDraftExtendSteps) {
  PrefillCase m = lengths({100, 40, 41, 700}, {150, 1, 1, 1});
  m.mode = ForwardMode::MIXED;
  check_prefill(m);
  PrefillCase d = lengths({300, 1000, 64}, {9, 4, 7}, 4);
  d.mode = ForwardMode::DRAFT_EXTEND;
  d.hq = 32;
  d.hkv = 4;  // 9 tokens x group 8 = 72 rows: the prefill shape
  check_prefill(d);
}

PREFILL_CASE(RowMaximaJumpingFromTileToTile) {
  // Keys growing along each request (by k_growth per 128 keys): from tile to tile the rows' maxima
  // pass their lazy reference by a few units, then by tens (at 1.6x a tile), or by far more (16x a
  // tile). The softmax has to move its reference, rescale O and l, and keep no probability of an
  // old reference that overflowed; fp16 P too (at 1.6x: 16x a tile overflows fp16 keys).
  for (float growth : {1.6f, 16.f}) {
    for (DType act : {DType::bf16, DType::f16}) {
      if (act == DType::f16 && growth > 2.f) continue;
      PrefillCase c = lengths({0, 0}, {900, 640}, static_cast<uint32_t>(growth * 10));
      c.k_growth = growth;
      c.act = act;
      check_prefill(c, testing::Message() << "growth " << growth << " " << dtype_name(act));
    }
  }
}

PREFILL_CASE(Fp16Activations) {
  PrefillCase c = lengths({33, 0}, {220, 140});
  c.act = DType::f16;
  for (int dim : {64, 128, 256}) {
    c.dim = dim;
    c.seed = static_cast<uint32_t>(dim + 11);
    check_prefill(c, testing::Message() << "dim " << dim);
  }
}

#undef PREFILL_CASE

// Which launches can take the TMA producer: host checks only, so this runs without a GPU.
TEST(CudaPrefillTma, AppliesToPlainPoolsWithPagesOfEightOrMore) {
  alignas(16) static int64_t pool[64];
  cuda::AttnParams p{};
  p.k = pool;
  p.v = pool + 16;
  p.k_row_stride = p.v_row_stride = 2 * 128;
  p.kv_rows = 1 << 20;
  p.kv_kind = cuda::KvKind::same_as_q;
  p.page_shift = 4;
  p.num_kv_heads = 2;
  EXPECT_TRUE(cuda::prefill_tma_applies(p, 128, true));
  EXPECT_TRUE(cuda::prefill_tma_applies(p, 64, true));
  EXPECT_FALSE(cuda::prefill_tma_applies(p, 128, false)) << "no TMA instantiation";
  cuda::AttnParams q = p;
  q.k_row_stride = q.v_row_stride = 2 * 256;
  EXPECT_TRUE(cuda::prefill_tma_applies(q, 256, false));
  EXPECT_FALSE(cuda::prefill_tma_applies(q, 256, true)) << "no TMA instantiation";
  q = p;
  q.page_shift = 3;
  EXPECT_TRUE(cuda::prefill_tma_applies(q, 128, true)) << "pages of 8";
  q.page_shift = 2;
  EXPECT_FALSE(cuda::prefill_tma_applies(q, 128, true)) << "pages of 4";
  q.page_shift = 0;
  EXPECT_FALSE(cuda::prefill_tma_applies(q, 128, true)) << "pages of 1";
  q = p;
  const int64_t map[2] = {0, -1};
  q.slot_map = map;
  EXPECT_FALSE(cuda::prefill_tma_applies(q, 128, true)) << "SWA pool: slots remapped";
  q = p;
  q.kv_kind = cuda::KvKind::e4m3;
  EXPECT_FALSE(cuda::prefill_tma_applies(q, 128, true)) << "fp8 KV";
  q = p;
  q.kv_rows = 0;
  EXPECT_FALSE(cuda::prefill_tma_applies(q, 128, true)) << "pool rows unknown";
  q = p;
  q.k = reinterpret_cast<const char*>(pool) + 8;
  EXPECT_FALSE(cuda::prefill_tma_applies(q, 128, true)) << "K base not 16-byte aligned";
  q = p;
  q.v_row_stride = 2 * 128 + 4;
  EXPECT_FALSE(cuda::prefill_tma_applies(q, 128, true)) << "V rows not 16-byte aligned";
}

// Which of those launches take Q by TMA too: host checks only.
TEST(CudaPrefillTma, QByTmaWhereATileIsWholeTokensOfOneGroup) {
  alignas(16) static uint16_t act[4096];
  cuda::AttnParams p{};
  p.q = act;
  p.q_rows = 7;
  p.num_kv_heads = 2;
  p.q_stride_head = 128;
  for (int g : {1, 2, 4, 8, 16, 64, 128}) {
    p.group = g;
    p.num_q_heads = 2 * g;
    p.q_stride_tok = int64_t{p.num_q_heads} * 128;
    EXPECT_TRUE(cuda::prefill_q_tma_applies(p)) << "group " << g;
  }
  cuda::AttnParams q = p;
  for (int g : {3, 5, 6, 7, 12, 256}) {
    q.group = g;
    q.num_q_heads = 2 * g;
    EXPECT_FALSE(cuda::prefill_q_tma_applies(q)) << "group " << g;
  }
  q = p;
  q.q_rows = 0;
  EXPECT_FALSE(cuda::prefill_q_tma_applies(q)) << "rows unknown (the MHA form)";
  q = p;
  q.q = act + 4;
  EXPECT_FALSE(cuda::prefill_q_tma_applies(q)) << "q not 16-byte aligned";
  q = p;
  q.q_stride_tok += 4;
  EXPECT_FALSE(cuda::prefill_q_tma_applies(q)) << "tokens not 16 bytes apart";
  q = p;
  q.q_stride_head = 132;
  EXPECT_TRUE(cuda::prefill_q_tma_applies(p));
  EXPECT_FALSE(cuda::prefill_q_tma_applies(q)) << "heads not 16 bytes apart";
}

#else

TEST(CudaPrefillTest, SkippedWithoutCuda) {
  GTEST_SKIP() << "attnrt was built without CUDA: " << query_cuda().reason;
}

#endif

}  // namespace
}  // namespace attnrt
