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

using test::DevTensor;
using test::fill_random;

struct PrefillCase : test::LayerCase {
  ForwardMode mode = ForwardMode::EXTEND;
  int page = 16;
  DType act = DType::bf16;
  std::vector<int32_t> prefix, qlen;  // DRAFT_EXTEND: qlen = accepted drafts + 1
  uint32_t seed = 1;
};

// A case of the default layer with these request lengths.
PrefillCase lengths(std::vector<int32_t> prefix, std::vector<int32_t> qlen, uint32_t seed = 1) {
  PrefillCase c;
  c.prefix = std::move(prefix);
  c.qlen = std::move(qlen);
  c.seed = seed;
  return c;
}

// Runs one step through the reference (host pools) and the cuda backend (device pools with the
// same bytes, same slots) and compares out and lse; failures name the case as `what`.
void check_prefill(const PrefillCase& c, const testing::Message& what = testing::Message()) {
  SCOPED_TRACE(what);
  std::mt19937 rng(c.seed);
  ModelSpec model;
  model.name = "prefill-test";
  model.dtype = c.act;
  const LayerSpec layer = c.layer();
  model.layers = {layer};
  const int bs = static_cast<int>(c.prefix.size());
  int32_t max_kv = 0;
  for (int i = 0; i < bs; ++i) max_kv = std::max(max_kv, c.prefix[i] + c.qlen[i]);
  model.max_context_len = max_kv + c.page;
  Options options;
  options.page_size = c.page;

  // Pools with every request's pages scattered by a random permutation (page 0 is reserved).
  std::vector<int64_t> pages_of(bs);
  int64_t pages = 0;
  for (int i = 0; i < bs; ++i)
    pages += pages_of[i] = (c.prefix[i] + c.qlen[i] + c.page - 1) / c.page;
  KVCacheConfig cfg;
  cfg.full_slots = (pages + 2) * c.page;
  cfg.page_size = c.page;
  cfg.dtype = c.act;
  cfg.max_num_tokens = 1 << 15;
  KVStorage host = make_host_kv_storage(model, cfg);
  KVStorage dev = cuda::make_cuda_kv_storage(model, cfg);
  auto* dev_cache = static_cast<cuda::CudaKVCache*>(dev.cache.get());
  const KVLayerView hv = host.cache->layer(0);
  fill_random(TensorView(hv.k, hv.dtype, {hv.num_rows * hv.k_row_stride}), rng, 2.f);
  fill_random(TensorView(hv.v, hv.dtype, {hv.num_rows * hv.v_row_stride}), rng, 2.f);

  ReqToTokenPool pool(bs, model.max_context_len);
  std::vector<int64_t> perm(pages);
  std::iota(perm.begin(), perm.end(), 1);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> rows;
  std::vector<std::vector<int64_t>> slots(bs);
  int64_t next_page = 0;
  for (int i = 0; i < bs; ++i) {
    rows.push_back(pool.alloc());
    for (int32_t j = 0; j < c.prefix[i] + c.qlen[i]; ++j)
      slots[i].push_back(perm[next_page + j / c.page] * c.page + j % c.page);
    next_page += pages_of[i];
    pool.write(static_cast<int>(rows.back()), 0, slots[i]);
  }
  // NaN in every row no request uses (the tails of last pages, the reserved and spare pages).
  std::vector<bool> used(hv.num_rows, false);
  for (const auto& s : slots)
    for (int64_t slot : s) used[slot] = true;
  for (int64_t row = 0; row < hv.num_rows; ++row) {
    if (used[row]) continue;
    for (int64_t e = 0; e < int64_t{hv.kv_heads} * hv.head_dim; ++e) {
      store_from_float(hv.k, hv.dtype, row * hv.k_row_stride + e, NAN);
      store_from_float(hv.v, hv.dtype, row * hv.v_row_stride + e, NAN);
    }
  }
  dev_cache->copy_layer_from_host(0, hv.k, hv.v);

  ForwardBatch batch;
  if (c.mode == ForwardMode::DRAFT_EXTEND) {
    std::vector<int32_t> seq(bs), accept(bs);
    for (int i = 0; i < bs; ++i) {
      seq[i] = c.prefix[i] + c.qlen[i];
      accept[i] = c.qlen[i] - 1;
    }
    batch = make_draft_extend_batch(rows, seq, accept);
  } else {
    batch = make_extend_batch(rows, c.prefix, c.qlen, c.mode);
  }
  batch.out_cache_loc.clear();
  for (int i = 0; i < bs; ++i)
    for (int32_t t = 0; t < c.qlen[i]; ++t)
      batch.out_cache_loc.push_back(slots[i][c.prefix[i] + t]);
  const int64_t T = batch.num_tokens();

  const test::Qkv in = test::random_qkv(c.act, layer, T, rng);
  const auto& [q, k, v] = in;
  std::vector<float> sinks(c.hq);
  for (float& s : sinks) s = std::uniform_real_distribution<float>(-1.f, 3.f)(rng);

  auto context = [&](KVCache* cache, Device device) {
    BackendContext x;
    x.model = &model;
    x.options = &options;
    x.kv_cache = cache;
    x.req_to_token = &pool;
    x.device = device;
    return x;
  };

  HostBuffer ref_out(c.act, {T, c.hq, c.dim}), ref_lse(DType::f32, {T, c.hq});
  test::reference_forward(context(host.cache.get(), Device::cpu()), batch, layer, in,
                          c.sinks ? sinks.data() : nullptr, ref_out.view(), ref_lse.view());

  HostBuffer out(c.act, {T, c.hq, c.dim}), lse(DType::f32, {T, c.hq});
  std::memset(out.data(), 0xff, out.bytes());  // NaN poison: every element must be written
  std::memset(lse.data(), 0xff, lse.bytes());
  HostBuffer sink_buf(DType::f32, {c.hq});
  std::memcpy(sink_buf.data(), sinks.data(), sinks.size() * sizeof(float));
  DevTensor dq(q.view()), dk(k.view()), dv(v.view()), dout(out.view()), dlse(lse.view());
  DevTensor dsinks(sink_buf.view());
  dev.cache->begin_step(batch);
  cuda::CudaBackend be(context(dev.cache.get(), Device::cuda(0)));
  be.init_forward_metadata(batch);
  ASSERT_EQ(be.plan().classes.size(), 1u);
  ASSERT_EQ(be.plan().classes[0].shape, cuda::TileShape::prefill)
      << "the case does not reach the prefill kernel";
  const AttnArgs a{.q = dq.view,
                   .k = dk.view,
                   .v = dv.view,
                   .out = dout.view,
                   .sinks = c.sinks ? static_cast<const float*>(dsinks.ptr) : nullptr,
                   .lse = dlse.view};
  // The producer the warp-specialised CTA takes for this layer (the launch's own decision, on
  // the pool the backend reads): the TMA one wherever it applies, unless switched off.
  const int ws = cuda::prefill_ws_mode();
  if (ws != 0) {
    const KVLayerView dv_layer = dev.cache->layer(0);
    cuda::AttnParams p{};
    p.k = dv_layer.k;
    p.v = dv_layer.v;
    p.k_row_stride = dv_layer.k_row_stride;
    p.v_row_stride = dv_layer.v_row_stride;
    p.kv_rows = dv_layer.num_rows;
    p.kv_kind = cuda::KvKind::same_as_q;
    p.page_shift = std::countr_zero(static_cast<unsigned>(c.page));
    p.num_kv_heads = c.hkv;
    const bool ping_pong = ws == 2 || (ws == cuda::kWsAuto && c.dim <= 128);
    const bool tma = cuda::prefill_ws_uses_tma(p, c.dim, c.act == DType::f16, ping_pong);
    const bool want = cuda::prefill_tma_enabled() && c.page >= 8 &&
                      ping_pong == (c.dim <= 128);  // the TMA instantiations: the default's CTAs
    EXPECT_EQ(tma, want) << "page " << c.page << ", dim " << c.dim << ", ws mode " << ws;
  }
  be.forward(a, layer, batch);
  ASSERT_EQ(cudaStreamSynchronize(be.stream()), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  dout.download(out.view());
  dlse.download(lse.view());

  const test::Compare co = test::compare(out.view(), ref_out.view(), T);
  double worst_lse = 0;
  bool lse_finite = true;
  for (int64_t i = 0; i < T * c.hq; ++i) {
    const double got = lse.ptr<float>()[i];
    lse_finite = lse_finite && std::isfinite(got);
    worst_lse = std::max(worst_lse, std::abs(got - ref_lse.ptr<float>()[i]));
  }
  EXPECT_TRUE(co.finite && lse_finite) << "non-finite output or lse (unwritten or NaN)";
  EXPECT_LT(co.rel, c.act == DType::f16 ? 4e-3 : 1.2e-2) << "max abs error " << co.max_abs;
  EXPECT_LT(co.max_abs, 0.08);
  EXPECT_LT(worst_lse, 2e-2) << "lse differs from the reference";
}

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

#else

TEST(CudaPrefillTest, SkippedWithoutCuda) {
  GTEST_SKIP() << "attnrt was built without CUDA: " << query_cuda().reason;
}

#endif

}  // namespace
}  // namespace attnrt
