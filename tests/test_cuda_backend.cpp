// The cuda backend against the reference backend: every full-attention mode, dtype, head dim, page
// size and feature the backend claims, on random ragged batches; the KV-write kernel against the
// host pools byte for byte; CUDA-graph capture/replay at other lengths; the error messages. Skips
// (with the reason) where no CUDA device is usable.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>
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
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

using test::Compare;
using test::compare;
using test::DevTensor;
using test::fill_random;

struct Case : test::LayerCase {
  ForwardMode mode = ForwardMode::DECODE;
  int page = 16;
  DType kv = DType::bf16, act = DType::bf16;
  std::vector<int32_t> prefix, qlen;  // per request (decode: prefix = seq_len - 1, qlen 1)
  bool lse = true;
  int topk = 1;             // verify: > 1 builds a random tree
  float k_scale = 1.f, v_scale = 1.f;
  bool host_tensors = false;  // q/k/v/out in host memory (staged by the backend)
  bool host_cache = false;    // the backend mirrors a host KV cache
  bool deterministic = false;
  uint32_t seed = 1;
};

// A one-layer model, a host cache (the reference's) and a device cache holding the same bytes,
// one request row per request with its slots allocated in page order.
class Harness {
 public:
  explicit Harness(const Case& c) : c_(c), rng_(c.seed) {
    model_.name = "test";
    model_.dtype = c.act;
    model_.max_context_len = 1 << 16;
    model_.layers = {c.layer()};
    options_.page_size = c.page;
    options_.deterministic = c.deterministic;

    int64_t need = 0;
    for (size_t i = 0; i < c.prefix.size(); ++i) need += (c.prefix[i] + c.qlen[i] + c.page) / c.page * c.page;
    KVCacheConfig cfg;
    cfg.full_slots = need + 4 * c.page;
    cfg.page_size = c.page;
    cfg.dtype = c.kv;
    cfg.max_num_tokens = 1 << 16;
    host_ = make_host_kv_storage(model_, cfg);
    if (!c.host_cache) {
      dev_ = cuda::make_cuda_kv_storage(model_, cfg);
      dev_cache_ = static_cast<cuda::CudaKVCache*>(dev_.cache.get());
    }
    host_.cache->set_kv_scales(0, c.k_scale, c.v_scale);
    if (dev_cache_) dev_cache_->set_kv_scales(0, c.k_scale, c.v_scale);
    const KVLayerView hv = host_.cache->layer(0);
    // Random pool contents: stored values are what `x / scale` rounded to the pool dtype gives.
    fill_random(TensorView(hv.k, hv.dtype, {hv.num_rows * hv.k_row_stride}), rng_, 2.f);
    fill_random(TensorView(hv.v, hv.dtype, {hv.num_rows * hv.v_row_stride}), rng_, 2.f);
    if (dev_cache_) dev_cache_->copy_layer_from_host(0, hv.k, hv.v);

    pool_ = std::make_unique<ReqToTokenPool>(static_cast<int>(c.prefix.size()) + 2,
                                             model_.max_context_len);
    for (size_t i = 0; i < c.prefix.size(); ++i) {
      const int row = pool_->alloc();
      rows_.push_back(row);
      const int32_t total = c.prefix[i] + c.qlen[i];
      const std::vector<int32_t> zero{0}, len{total};
      const std::vector<int64_t> last{-1};
      slots_.push_back(host_.allocator->alloc_extend(zero, len, last));
      pool_->write(row, 0, slots_.back());
    }
  }

  ForwardBatch batch() {
    const Case& c = c_;
    ForwardBatch b;
    std::vector<int32_t> seq;
    switch (c.mode) {
      case ForwardMode::DECODE:
        for (size_t i = 0; i < c.prefix.size(); ++i) seq.push_back(c.prefix[i] + 1);
        b = make_decode_batch(rows_, seq);
        break;
      case ForwardMode::TARGET_VERIFY: {
        const int n = c.qlen[0];
        SpecInfo spec = SpecInfo::chain(static_cast<int>(c.prefix.size()), n);
        if (c.topk > 1) {
          spec.topk = c.topk;
          for (size_t i = 0; i < c.prefix.size(); ++i)
            for (int t = 1; t < n; ++t)
              spec.parents[i * n + t] = std::uniform_int_distribution<int>(0, t - 1)(rng_);
        }
        b = make_verify_batch(rows_, c.prefix, std::move(spec));
        break;
      }
      case ForwardMode::DRAFT_EXTEND: {
        std::vector<int32_t> accept;
        for (size_t i = 0; i < c.prefix.size(); ++i) {
          seq.push_back(c.prefix[i] + c.qlen[i]);
          accept.push_back(c.qlen[i] - 1);
        }
        b = make_draft_extend_batch(rows_, seq, accept);
        break;
      }
      default:
        b = make_extend_batch(rows_, c.prefix, c.qlen, c.mode);
    }
    b.out_cache_loc.clear();
    for (size_t i = 0; i < c.prefix.size(); ++i)
      for (int32_t t = 0; t < c.qlen[i]; ++t) b.out_cache_loc.push_back(slots_[i][c.prefix[i] + t]);
    return b;
  }

  BackendContext ctx(bool device) const {
    BackendContext x;
    x.model = &model_;
    x.options = &options_;
    x.kv_cache = device && dev_cache_ ? dev_.cache.get() : host_.cache.get();
    x.req_to_token = pool_.get();
    x.device = device ? Device::cuda(0) : Device::cpu();
    return x;
  }

  const Case& c_;
  std::mt19937 rng_;
  ModelSpec model_;
  Options options_;
  KVStorage host_, dev_;
  cuda::CudaKVCache* dev_cache_ = nullptr;
  std::unique_ptr<ReqToTokenPool> pool_;
  std::vector<int64_t> rows_;
  std::vector<std::vector<int64_t>> slots_;
};

// Runs one step through the reference (host) and the cuda backend and compares outputs, lse and
// (for a device cache) the pool rows the step wrote.
void check_case(const Case& c) {
  Harness h(c);
  const ForwardBatch batch = h.batch();
  const int64_t T = batch.num_tokens();
  const LayerSpec& layer = h.model_.layers[0];
  std::mt19937 rng(c.seed * 7919u + 3);

  const test::Qkv in = test::random_qkv(c.act, layer, T, rng);
  const auto& [q, k, v] = in;
  std::vector<float> sinks(c.hq);
  for (float& s : sinks) s = std::uniform_real_distribution<float>(-1.f, 3.f)(rng);
  HostBuffer ref_out(c.act, {T, c.hq, c.dim}), ref_lse(DType::f32, {T, c.hq});
  HostBuffer out(c.act, {T, c.hq, c.dim}), lse(DType::f32, {T, c.hq});
  std::memset(out.data(), 0xff, out.bytes());  // NaN poison: every element must be written
  std::memset(lse.data(), 0xff, lse.bytes());

  // Reference first: its host cache receives the step's K/V.
  test::reference_forward(h.ctx(false), batch, layer, in, c.sinks ? sinks.data() : nullptr,
                          ref_out.view(), ref_lse.view());

  // The cuda backend on the device cache (or mirroring a second host cache in the same state).
  Harness* hh = &h;
  std::unique_ptr<Harness> mirror;
  if (c.host_cache) {
    mirror = std::make_unique<Harness>(c);  // same seed: same pool contents and slots
    hh = mirror.get();
  }
  KVCache& cache = c.host_cache ? *hh->host_.cache : *h.dev_.cache;
  cache.begin_step(batch);
  cuda::CudaBackend be(c.host_cache ? hh->ctx(false) : h.ctx(true));
  be.init_forward_metadata(batch);
  AttnArgs a;
  std::optional<test::DeviceQkvOut> dev;
  std::optional<DevTensor> dlse, dsinks;
  if (c.host_tensors || c.host_cache) {
    a = {.q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()};
    if (c.lse) a.lse = lse.view();
  } else {
    dev.emplace(q.view(), k.view(), v.view(), out.view());
    dlse.emplace(lse.view());
    a = dev->args();
    if (c.lse) a.lse = dlse->view;
  }
  a.sinks = c.sinks ? sinks.data() : nullptr;
  if (dev && c.sinks) {
    HostBuffer sb(DType::f32, {c.hq});
    std::memcpy(sb.data(), sinks.data(), sinks.size() * sizeof(float));
    dsinks.emplace(sb.view());
    a.sinks = static_cast<const float*>(dsinks->ptr);
  }
  be.forward(a, layer, batch);
  ASSERT_EQ(cudaStreamSynchronize(be.stream()), cudaSuccess);
  if (dev) {
    dev->out.download(out.view());
    dlse->download(lse.view());
  }

  const Compare co = compare(out.view(), ref_out.view(), T);
  const double tol = c.act == DType::f16 ? 4e-3 : 1.2e-2;
  EXPECT_TRUE(co.finite) << "non-finite output (unwritten or NaN)";
  EXPECT_LT(co.rel, tol) << "max abs error " << co.max_abs;
  EXPECT_LT(co.max_abs, 0.08);
  if (c.lse) {
    double worst = 0;
    for (int64_t i = 0; i < T * c.hq; ++i)
      worst = std::max(worst, std::abs(double{lse.ptr<float>()[i]} - ref_lse.ptr<float>()[i]));
    EXPECT_LT(worst, 2e-2) << "lse differs from the reference";
  }
  if (h.dev_cache_) {
    // The KV-write kernel: the rows this step wrote equal the host pool's, bit for bit.
    const KVLayerView hv = h.host_.cache->layer(0);
    const size_t kb = hv.num_rows * hv.k_row_stride * dtype_size(hv.dtype);
    std::vector<char> dk_host(kb), dv_host(kb);
    h.dev_cache_->copy_layer_to_host(0, dk_host.data(), dv_host.data());
    const size_t row_bytes = hv.k_row_stride * dtype_size(hv.dtype);
    int mismatched = 0;
    for (int64_t s : batch.out_cache_loc) {
      mismatched += std::memcmp(dk_host.data() + s * row_bytes,
                                static_cast<char*>(hv.k) + s * row_bytes, row_bytes) != 0;
      mismatched += std::memcmp(dv_host.data() + s * row_bytes,
                                static_cast<char*>(hv.v) + s * row_bytes, row_bytes) != 0;
    }
    EXPECT_EQ(mismatched, 0) << "stored K/V rows differ from the host pool's";
  }
}

std::vector<int32_t> random_lens(std::mt19937& rng, int n, int lo, int hi) {
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = std::uniform_int_distribution<int>(lo, hi)(rng);
  return v;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
  // `n` requests with random prefixes of `lo`..`hi` tokens and `qlen` new tokens each (verify: a
  // chain of drafts at topk 1, else a random tree).
  Case random_case(ForwardMode mode, int n, int lo, int hi, int qlen, int topk = 1) {
    Case c;
    c.mode = mode;
    c.topk = topk;
    c.prefix = random_lens(rng, n, lo, hi);
    c.qlen.assign(n, qlen);
    return c;
  }
  std::mt19937 rng{20260417};
};

TEST_F(CudaBackendTest, DecodeMatchesReferenceAcrossHeadDimsAndGroups) {
  for (int dim : {64, 128, 256}) {
    for (auto [hq, hkv] : {std::pair{8, 2}, std::pair{8, 8}, std::pair{32, 2}, std::pair{12, 4}}) {
      Case c = random_case(ForwardMode::DECODE, 5, 0, 700, 1);
      c.dim = dim;
      c.hq = hq;
      c.hkv = hkv;
      c.seed = dim + hq;
      SCOPED_TRACE(testing::Message() << "dim " << dim << " hq " << hq << " hkv " << hkv);
      check_case(c);
    }
  }
}

TEST_F(CudaBackendTest, DecodeSplitsLongRequests) {
  Case c;
  c.prefix = {20000, 3, 9000};
  c.qlen = {1, 1, 1};
  check_case(c);
  c.deterministic = true;
  check_case(c);
}

TEST_F(CudaBackendTest, DecodeDtypesAndPageSizes) {
  for (DType kv : {DType::bf16, DType::e4m3, DType::e5m2}) {
    for (int page : {1, 16, 64}) {
      Case c = random_case(ForwardMode::DECODE, 4, 1, 1500, 1);
      c.kv = kv;
      c.page = page;
      if (is_fp8(kv)) {
        c.k_scale = 0.7f;
        c.v_scale = 1.6f;
      }
      SCOPED_TRACE(testing::Message() << dtype_name(kv) << " page " << page);
      check_case(c);
    }
  }
  Case h;
  h.act = h.kv = DType::f16;
  h.prefix = {100, 900};
  h.qlen = {1, 1};
  check_case(h);
  h.kv = DType::e4m3;
  check_case(h);
}

TEST_F(CudaBackendTest, DecodeWindowSoftcapSinks) {
  Case c = random_case(ForwardMode::DECODE, 4, 50, 3000, 1);
  c.window = 200;
  c.cap = 30.f;
  c.sinks = true;
  check_case(c);
  c.window = 0;
  check_case(c);
}

// Work items of up to 8 (token, head-in-group) rows at head dims 64 and 128 run the decode CTA
// with the keys on the MMA's M side (decode_keys_m.cuh): groups 8, 4 and 2 with one to four query
// tokens per request (causal rows within the item), a chain and a tree of two drafts, a window,
// a softcap and sinks, fp16 and both fp8 kinds, long prefixes cut into splits.
TEST_F(CudaBackendTest, NarrowDecodeTilesWithSeveralTokensPerItem) {
  for (int dim : {64, 128}) {
    for (auto [hq, hkv, q] : {std::tuple{16, 2, 1}, std::tuple{8, 2, 2}, std::tuple{8, 4, 4}}) {
      Case c;
      c.mode = q > 1 ? ForwardMode::EXTEND : ForwardMode::DECODE;
      c.dim = dim;
      c.hq = hq;
      c.hkv = hkv;
      c.prefix = {3000, 0, 517, 40};
      c.qlen = {q, 1, q, q};
      c.window = 60;
      c.seed = dim + hq + q;
      SCOPED_TRACE(testing::Message() << "dim " << dim << " hq " << hq << " hkv " << hkv << " q "
                                      << q);
      check_case(c);
      c.kv = dim == 64 ? DType::e5m2 : DType::e4m3;
      c.act = DType::f16;
      c.window = -1;
      c.cap = 20.f;
      c.sinks = true;
      c.k_scale = 0.9f;
      c.v_scale = 1.2f;
      check_case(c);
    }
  }
  // 2 drafts x group 4 = 8 rows.
  Case v = random_case(ForwardMode::TARGET_VERIFY, 3, 20, 1500, 2, 1);
  check_case(v);
  v.topk = 2;
  v.kv = DType::e4m3;
  check_case(v);
}

TEST_F(CudaBackendTest, ExtendWithCachedPrefix) {
  for (int dim : {64, 128, 256}) {
    Case c;
    c.mode = ForwardMode::EXTEND;
    c.dim = dim;
    c.prefix = {0, 37, 300, 16};
    c.qlen = {200, 5, 129, 1};
    SCOPED_TRACE(testing::Message() << "dim " << dim);
    check_case(c);
  }
  Case w;
  w.mode = ForwardMode::EXTEND;
  w.prefix = {500, 0};
  w.qlen = {300, 260};
  w.window = 100;
  w.cap = 20.f;
  w.sinks = true;
  w.kv = DType::e4m3;
  w.k_scale = 0.5f;
  check_case(w);
}

TEST_F(CudaBackendTest, MixedNonCausalAndDraftExtend) {
  Case m;
  m.mode = ForwardMode::MIXED;
  m.prefix = {100, 40, 41, 700};
  m.qlen = {150, 1, 1, 1};
  check_case(m);
  Case nc;
  nc.mode = ForwardMode::EXTEND;
  nc.causal = false;
  nc.prefix = {0, 20};
  nc.qlen = {180, 40};
  check_case(nc);
  Case d;
  d.mode = ForwardMode::DRAFT_EXTEND;
  d.prefix = {300, 1000, 64};
  d.qlen = {3, 1, 4};
  check_case(d);
}

TEST_F(CudaBackendTest, TargetVerifyChainAndTree) {
  const Case chain = random_case(ForwardMode::TARGET_VERIFY, 6, 10, 2000, 8, 1);
  check_case(chain);
  Case tree = chain;
  tree.topk = 4;
  tree.qlen.assign(6, 16);
  check_case(tree);
  tree.window = 40;
  tree.seed = 5;
  check_case(tree);
}

// Verify- and decode32-shaped steps (17..64 rows of a request) on 16-bit KV at head dims 64 and
// 128 run the 64-row warpgroup-MMA CTA (prefill.cuh): trees at both head dims and page sizes 1 and
// 16, GQA groups 3 (48 rows) and 8 (64 rows), a 16-token chain (the causal path), fp16 with a
// window, a softcap and sinks on a tree (window 0: every row sees itself alone), long prefixes cut
// into splits (also deterministic), and 32-row tiles: trees and chains of 8 at group 4, of 16 at
// group 2, short extends.
TEST_F(CudaBackendTest, VerifyAndDecode32TilesOnWarpgroupMmas) {
  for (int dim : {64, 128}) {
    for (int page : {1, 16}) {
      Case t = random_case(ForwardMode::TARGET_VERIFY, 5, 1, 1500, 16, 4);
      t.dim = dim;
      t.page = page;
      t.seed = static_cast<uint32_t>(dim + page);
      SCOPED_TRACE(testing::Message() << "tree dim " << dim << " page " << page);
      check_case(t);
    }
  }
  for (auto [hq, hkv, drafts] : {std::tuple{12, 4, 16}, std::tuple{16, 2, 8}}) {
    Case g = random_case(ForwardMode::TARGET_VERIFY, 4, 0, 900, drafts, 3);
    g.hq = hq;
    g.hkv = hkv;
    g.seed = static_cast<uint32_t>(hq);
    SCOPED_TRACE(testing::Message() << "tree hq " << hq << " hkv " << hkv);
    check_case(g);
    g.topk = 1;
    SCOPED_TRACE("chain");
    check_case(g);
  }
  Case chain = random_case(ForwardMode::TARGET_VERIFY, 3, 100, 700, 16, 1);
  chain.dim = 64;
  chain.window = 30;
  {
    SCOPED_TRACE("chain of 16 with a window, dim 64");
    check_case(chain);
  }
  Case w = random_case(ForwardMode::TARGET_VERIFY, 4, 20, 1200, 16, 4);
  w.act = w.kv = DType::f16;
  w.window = 40;
  w.cap = 25.f;
  w.sinks = true;
  w.seed = 11;
  for (int dim : {64, 128}) {
    w.dim = dim;
    SCOPED_TRACE(testing::Message() << "fp16 tree, window, softcap, sinks, dim " << dim);
    check_case(w);
  }
  w.window = 0;
  {
    SCOPED_TRACE("fp16 tree, window 0");
    check_case(w);
  }
  Case s;
  s.mode = ForwardMode::TARGET_VERIFY;
  s.topk = 4;
  s.prefix = {9000, 20, 4100};
  s.qlen.assign(3, 16);
  {
    SCOPED_TRACE("tree over split prefixes");
    check_case(s);
  }
  s.deterministic = true;
  {
    SCOPED_TRACE("deterministic");
    check_case(s);
  }
  for (auto [hq, hkv, drafts] : {std::tuple{8, 2, 8}, std::tuple{8, 4, 16}}) {
    Case d = random_case(ForwardMode::TARGET_VERIFY, 5, 0, 2500, drafts, 2);
    d.hq = hq;
    d.hkv = hkv;
    d.dim = 64;
    d.act = d.kv = DType::f16;
    d.page = 1;
    d.window = 25;
    d.cap = 30.f;
    d.seed = static_cast<uint32_t>(drafts);
    SCOPED_TRACE(testing::Message() << "32-row tree, hq " << hq << " hkv " << hkv);
    check_case(d);
    d.topk = 1;
    d.dim = 128;
    d.act = d.kv = DType::bf16;
    d.page = 16;
    d.window = -1;
    d.cap = 0.f;
    d.sinks = true;
    SCOPED_TRACE("32-row chain, dim 128, sinks");
    check_case(d);
  }
  Case e;
  e.mode = ForwardMode::EXTEND;
  e.prefix = {700, 0, 33, 4000};
  e.qlen = {8, 3, 5, 1};  // 8 x group 4 = 32 rows: the decode32 shape
  e.dim = 64;
  SCOPED_TRACE("short extend");
  check_case(e);
}

// fp8 KV is dequantised in registers with a permuted head-dim / output-dim order and its own
// shared-memory layout per head dim: every head dim, both formats, the decode and the verify
// shapes, fp16 and bf16 activations. Short extends (rows of a request fit 64) take the verify
// shape too.
TEST_F(CudaBackendTest, Fp8AcrossHeadDimsShapesAndShortExtends) {
  for (DType kv : {DType::e4m3, DType::e5m2}) {
    for (int dim : {64, 128, 256}) {
      Case c = random_case(ForwardMode::DECODE, 3, 1, 2500, 1);
      c.kv = kv;
      c.dim = dim;
      c.k_scale = 1.3f;
      c.v_scale = 0.45f;
      c.seed = dim + 17;
      SCOPED_TRACE(testing::Message() << dtype_name(kv) << " decode dim " << dim);
      check_case(c);
      Case t = c;
      t.mode = ForwardMode::TARGET_VERIFY;
      t.topk = 4;
      t.qlen.assign(3, 16);
      SCOPED_TRACE("tree verify");
      check_case(t);
    }
  }
  Case e;
  e.mode = ForwardMode::EXTEND;
  e.prefix = {700, 0, 33};
  e.qlen = {16, 3, 9};  // 16 x group 4 = 64 rows: the verify shape
  check_case(e);
  e.kv = DType::e4m3;
  e.act = DType::f16;
  e.window = 50;
  e.k_scale = 0.8f;
  check_case(e);
}

// One backend across steps: decode rows grow (committed pages come from the device row table),
// a plan that never reaches a kernel is dropped, and a row that changes hands (free + alloc, new
// slots) is re-read. Every step is checked against the reference on the same pools.
TEST_F(CudaBackendTest, IncrementalPageTablesFollowRowChanges) {
  for (int page : {1, 16}) {
    Case c;
    c.page = page;
    c.prefix = {900, 37, 2100, 300};
    c.qlen.assign(4, 1);
    Harness h(c);  // every row holds prefix + 1 slots; steps use prefixes up to that
    const LayerSpec& layer = h.model_.layers[0];
    cuda::CudaBackend be(h.ctx(true));
    const int bs = 4;
    HostBuffer q(c.act, {bs, c.hq, c.dim}), out(c.act, {bs, c.hq, c.dim});
    HostBuffer ref_out(c.act, {bs, c.hq, c.dim});
    DevTensor dq(q.view()), dout(out.view());
    std::mt19937 rng(page + 5);
    auto step = [&](const std::vector<int32_t>& seq, bool plan_twice) {
      ForwardBatch b = make_decode_batch(h.rows_, seq);
      b.out_cache_loc.assign(bs, 0);
      for (int i = 0; i < bs; ++i)
        b.out_cache_loc[i] = h.pool_->get(static_cast<int>(h.rows_[i]), seq[i] - 1);
      fill_random(q.view(), rng, 1.f);
      ASSERT_EQ(cudaMemcpy(dq.ptr, q.data(), q.bytes(), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the legacy-stream copy, before the backend's stream
      AttnArgs a;
      a.q = dq.view;
      a.out = dout.view;
      a.save_kv = false;
      if (plan_twice) be.init_forward_metadata(b);  // never followed by a kernel
      be.init_forward_metadata(b);
      be.forward(a, layer, b);
      ASSERT_EQ(cudaStreamSynchronize(be.stream()), cudaSuccess);
      dout.download(out.view());
      ReferenceBackend ref(h.ctx(false));
      ref.init_forward_metadata(b);
      AttnArgs ra;
      ra.q = q.view();
      ra.out = ref_out.view();
      ra.save_kv = false;
      ref.forward(ra, layer, b);
      const Compare co = compare(out.view(), ref_out.view(), bs);
      EXPECT_TRUE(co.finite);
      EXPECT_LT(co.rel, 1.2e-2) << "max abs " << co.max_abs;
    };
    {
      SCOPED_TRACE(testing::Message() << "page " << page << ": first step");
      step({600, 20, 1500, 100}, false);
    }
    {
      SCOPED_TRACE("grown rows, one plan dropped");
      step({601, 36, 1517, 250}, true);
    }
    EXPECT_TRUE(be.plan().incremental);
    {
      // Row 0 changes hands: the new request's slots are request 2's, with its own length.
      SCOPED_TRACE("row 0 reassigned");
      const int row = static_cast<int>(h.rows_[0]);
      h.pool_->free(row);
      ASSERT_EQ(h.pool_->alloc(), row);
      h.pool_->write(row, 0, h.slots_[2]);
      step({1700, 37, 1518, 251}, false);
    }
    {
      SCOPED_TRACE("steady decode after the change");
      step({1701, 38, 1519, 252}, false);
    }
  }
}

TEST_F(CudaBackendTest, HostTensorsAndHostCacheMirror) {
  Case c;
  c.mode = ForwardMode::EXTEND;
  c.prefix = {33, 0};
  c.qlen = {20, 70};
  c.host_tensors = true;
  check_case(c);
  c.host_tensors = false;
  c.host_cache = true;
  c.page = 1;
  check_case(c);
}

TEST_F(CudaBackendTest, RejectsWhatItCannotRun) {
  Case c;
  c.prefix = {10};
  c.qlen = {1};
  Harness h(c);
  const ForwardBatch batch = h.batch();
  cuda::CudaBackend be(h.ctx(true));
  LayerSpec odd = h.model_.layers[0];
  odd.head_dim = odd.v_head_dim = 100;  // not a multiple of 8: no kernel takes it
  HostBuffer q(DType::bf16, {1, 8, 100}), out(DType::bf16, {1, 8, 100});
  AttnArgs a;
  a.q = q.view();
  a.out = out.view();
  try {
    be.forward(a, h.model_.layers[0], batch);
    FAIL() << "forward without a plan was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("init_forward_metadata"), std::string::npos) << e.what();
  }
  be.init_forward_metadata(batch);
  try {
    be.forward(a, odd, batch);
    FAIL() << "head_dim 100 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 100 / v_head_dim 100; the kernels take "
                                         "multiples of 8 up to"),
              std::string::npos)
        << e.what();
  }
}

// Capture one decode step (plan outside, kernels inside the graph) at one set of lengths, replay
// it at others (and padded), and compare with the reference; a sync inside capture would fail it.
TEST_F(CudaBackendTest, GraphCaptureReplaysAtNewLengths) {
  Case c;
  c.prefix = {1500, 40, 3000, 7};
  c.qlen.assign(4, 1);
  Harness h(c);
  const LayerSpec& layer = h.model_.layers[0];
  cuda::CudaBackend be(h.ctx(true));
  be.init_cuda_graph_state(4, 4);
  const int bs = 4;
  std::mt19937 rng(11);
  auto [q, k, v] = test::random_qkv(c.act, layer, bs, rng);
  HostBuffer out(c.act, {bs, c.hq, c.dim}), ref_out(c.act, {bs, c.hq, c.dim});
  const test::DeviceQkvOut dev(q.view(), k.view(), v.view(), out.view());
  const AttnArgs a = dev.args();

  ForwardBatch cap = h.batch();
  h.dev_.cache->begin_step(cap);
  be.init_forward_metadata_capture_cuda_graph(bs, bs, cap);
  cudaStream_t s = be.stream();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  be.forward(a, layer, cap);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  // Replay at new lengths: the same rows, shorter and longer sequences (still inside the rows'
  // allocated slots), then with the last request padded.
  for (int round = 0; round < 2; ++round) {
    std::vector<int32_t> seq = {round ? 1200 : 300, 41, round ? 2500 : 3001, 8};
    const int raw = round ? 3 : 4;
    if (raw < bs) seq[bs - 1] = 1;  // padded row: the fill value, writing the dummy slot 0
    ForwardBatch b = make_decode_batch(h.rows_, seq);
    b.out_cache_loc.assign(bs, 0);
    for (int i = 0; i < raw; ++i) b.out_cache_loc[i] = h.slots_[i][seq[i] - 1];
    fill_random(q.view(), rng, 1.f);
    fill_random(k.view(), rng, 2.f);
    ASSERT_EQ(cudaMemcpy(dev.q.ptr, q.data(), q.bytes(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev.k.ptr, k.data(), k.bytes(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the legacy-stream copies, before the graph's stream
    h.dev_.cache->begin_step(b);
    be.init_forward_metadata_replay_cuda_graph(bs, bs, b);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    dev.out.download(out.view());

    ForwardBatch rb = b;
    if (raw < bs) {
      rb = make_decode_batch({h.rows_.begin(), h.rows_.begin() + raw},
                             {seq.begin(), seq.begin() + raw});
      rb.out_cache_loc.assign(b.out_cache_loc.begin(), b.out_cache_loc.begin() + raw);
    }
    h.host_.cache->begin_step(rb);
    ReferenceBackend ref(h.ctx(false));
    ref.init_forward_metadata(rb);
    AttnArgs ra;
    ra.q = TensorView(q.data(), c.act, {raw, c.hq, c.dim});
    ra.k = TensorView(k.data(), c.act, {raw, c.hkv, c.dim});
    ra.v = TensorView(v.data(), c.act, {raw, c.hkv, c.dim});
    ra.out = ref_out.view();
    ra.out.shape[0] = raw;
    ref.forward(ra, layer, rb);
    const Compare co = compare(out.view(), ref_out.view(), raw);
    EXPECT_TRUE(co.finite);
    EXPECT_LT(co.rel, 1.2e-2) << "round " << round << " max abs " << co.max_abs;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Programmatic dependent launches (kernels/dependent_launch.cuh: the V store overlapping the K
// store, the attention kernel the stores, the merge the attention kernel) give the bits of plain
// launches, eager and as a replayed graph. Before every step the rows it stores are set to NaN
// bytes, so an attention CTA that read K/V before the stores completed would return NaN: requests
// without a prefix see nothing but those rows; the long ones split (merge).
class DependentLaunchSteps {
 public:
  explicit DependentLaunchSteps(ForwardMode mode) {
    c_.mode = mode;
    c_.prefix = {0, 9000, 0, 300, 14000, 1};
    c_.qlen.assign(c_.prefix.size(), mode == ForwardMode::DECODE ? 1 : 6);
    h_ = std::make_unique<Harness>(c_);
    batch_ = h_->batch();
    const int64_t T = batch_.num_tokens();
    std::mt19937 rng(5);
    const test::Qkv in = test::random_qkv(c_.act, h_->model_.layers[0], T, rng);
    out_ = HostBuffer(c_.act, {T, c_.hq, c_.dim});
    device_.emplace(in.q.view(), in.k.view(), in.v.view(), out_.view());
    args_ = device_->args();
    be_ = std::make_unique<cuda::CudaBackend>(h_->ctx(true));
  }

  // One eager step; the output's bytes.
  std::vector<char> eager(bool dependent) {
    test::DependentLaunches mode(dependent);
    poison();
    h_->dev_.cache->begin_step(batch_);
    be_->init_forward_metadata(batch_);
    be_->forward(args_, h_->model_.layers[0], batch_);
    return output();
  }

  // A graph of the step captured with dependent launches on or off, then replayed `replays` times
  // (poisoned before each); each replay's output bytes.
  std::vector<std::vector<char>> graph(bool dependent, int replays) {
    const int bs = batch_.batch_size;
    const int tokens = static_cast<int>(batch_.num_tokens());
    be_->init_cuda_graph_state(bs, tokens);
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    {
      test::DependentLaunches mode(dependent);
      h_->dev_.cache->begin_step(batch_);
      be_->init_forward_metadata_capture_cuda_graph(bs, tokens, batch_);
      EXPECT_EQ(cudaStreamBeginCapture(be_->stream(), cudaStreamCaptureModeGlobal), cudaSuccess);
      be_->forward(args_, h_->model_.layers[0], batch_);
      EXPECT_EQ(cudaStreamEndCapture(be_->stream(), &g), cudaSuccess);
      EXPECT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
    }
    std::vector<std::vector<char>> bytes;
    for (int r = 0; r < replays; ++r) {
      poison();
      h_->dev_.cache->begin_step(batch_);
      be_->init_forward_metadata_replay_cuda_graph(bs, bs, batch_);
      EXPECT_EQ(cudaGraphLaunch(exec, be_->stream()), cudaSuccess);
      bytes.push_back(output());
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    return bytes;
  }

  bool finite(const std::vector<char>& bytes) const {
    const TensorView t(const_cast<char*>(bytes.data()), c_.act, {out_.view().numel()});
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(load_as_float(t.data, t.dtype, i))) return false;
    return true;
  }

 private:
  void poison() {
    const KVLayerView kv = h_->dev_cache_->layer(0);
    const size_t k_row = kv.k_row_stride * dtype_size(kv.dtype);
    const size_t v_row = kv.v_row_stride * dtype_size(kv.dtype);
    for (int64_t s : batch_.out_cache_loc) {
      EXPECT_EQ(cudaMemsetAsync(static_cast<char*>(kv.k) + s * k_row, 0xff, k_row, be_->stream()),
                cudaSuccess);
      EXPECT_EQ(cudaMemsetAsync(static_cast<char*>(kv.v) + s * v_row, 0xff, v_row, be_->stream()),
                cudaSuccess);
    }
  }

  std::vector<char> output() {
    EXPECT_EQ(cudaStreamSynchronize(be_->stream()), cudaSuccess);
    device_->out.download(out_.view());
    const char* p = static_cast<const char*>(out_.data());
    return std::vector<char>(p, p + out_.bytes());
  }

  Case c_;
  std::unique_ptr<Harness> h_;
  ForwardBatch batch_;
  HostBuffer out_;
  std::optional<test::DeviceQkvOut> device_;
  AttnArgs args_;
  std::unique_ptr<cuda::CudaBackend> be_;
};

TEST_F(CudaBackendTest, DependentLaunchesGiveTheBitsOfPlainLaunches) {
  for (ForwardMode mode : {ForwardMode::DECODE, ForwardMode::TARGET_VERIFY}) {
    SCOPED_TRACE(forward_mode_name(mode));
    DependentLaunchSteps steps(mode);
    const std::vector<char> plain = steps.eager(false);
    ASSERT_TRUE(steps.finite(plain)) << "plain launches returned NaN";
    int differ = 0;
    for (int round = 0; round < 20; ++round) differ += steps.eager(true) != plain;
    EXPECT_EQ(differ, 0) << differ << " of 20 eager steps with dependent launches differ";
    // A graph step may split differently from the eager one (its counts depend on the batch size
    // only), so graphs are compared with each other.
    const std::vector<char> plain_graph = steps.graph(false, 1).at(0);
    ASSERT_TRUE(steps.finite(plain_graph)) << "a graph of plain launches returned NaN";
    differ = 0;
    for (const std::vector<char>& out : steps.graph(true, 20)) differ += out != plain_graph;
    EXPECT_EQ(differ, 0) << differ << " of 20 replays of a graph of dependent launches differ";
  }
}

// ATTNRT_PLAN_COPY_MIN_BYTES (64 KiB by default) pads the plan's upload with its staging buffer's
// stale tail (up to what the graph's metadata buffer holds): the outputs keep the bits of an
// unpadded upload (0), eager and as a replayed graph.
TEST_F(CudaBackendTest, PaddedPlanUploadGivesTheSameBits) {
  for (ForwardMode mode : {ForwardMode::DECODE, ForwardMode::TARGET_VERIFY}) {
    SCOPED_TRACE(forward_mode_name(mode));
    ASSERT_EQ(setenv("ATTNRT_PLAN_COPY_MIN_BYTES", "0", 1), 0);
    DependentLaunchSteps plain(mode);
    unsetenv("ATTNRT_PLAN_COPY_MIN_BYTES");
    const std::vector<char> eager = plain.eager(true);
    const std::vector<char> graph = plain.graph(true, 1).at(0);
    ASSERT_TRUE(plain.finite(eager));
    ASSERT_EQ(setenv("ATTNRT_PLAN_COPY_MIN_BYTES", "65536", 1), 0);
    DependentLaunchSteps padded(mode);
    unsetenv("ATTNRT_PLAN_COPY_MIN_BYTES");
    EXPECT_TRUE(padded.eager(true) == eager) << "eager step with a padded upload differs";
    EXPECT_TRUE(padded.eager(true) == eager) << "second eager step with a padded upload differs";
    EXPECT_TRUE(padded.graph(true, 1).at(0) == graph)
        << "graph replay with a padded upload differs";
  }
}

// The eager plan and forward themselves never synchronise: run a whole step inside a capture.
TEST_F(CudaBackendTest, EagerStepRunsInsideStreamCapture) {
  Case c;
  c.mode = ForwardMode::EXTEND;
  c.prefix = {64, 5};
  c.qlen = {30, 3};
  Harness h(c);
  const ForwardBatch batch = h.batch();
  const int64_t T = batch.num_tokens();
  cuda::CudaBackend be(h.ctx(true));
  HostBuffer q(c.act, {T, c.hq, c.dim}), k(c.act, {T, c.hkv, c.dim}), out(c.act, {T, c.hq, c.dim});
  std::mt19937 rng(3);
  fill_random(q.view(), rng, 1.f);
  fill_random(k.view(), rng, 1.f);
  const test::DeviceQkvOut dev(q.view(), k.view(), k.view(), out.view());
  const AttnArgs a = dev.args();
  h.dev_.cache->begin_step(batch);
  be.init_forward_metadata(batch);  // warm-up: buffers reach their size
  be.forward(a, h.model_.layers[0], batch);
  ASSERT_EQ(cudaStreamSynchronize(be.stream()), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(be.stream(), cudaStreamCaptureModeGlobal), cudaSuccess);
  h.dev_.cache->begin_step(batch);
  be.init_forward_metadata(batch);
  be.forward(a, h.model_.layers[0], batch);
  ASSERT_EQ(cudaStreamEndCapture(be.stream(), &graph), cudaSuccess);
  size_t nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  EXPECT_GE(nodes, 3u);  // uploads, KV stores and attention
  cudaGraphDestroy(graph);
}

#else

TEST(CudaBackendTest, SkippedWithoutCuda) {
  GTEST_SKIP() << "attnrt was built without CUDA: " << query_cuda().reason;
}

#endif

}  // namespace
}  // namespace attnrt
