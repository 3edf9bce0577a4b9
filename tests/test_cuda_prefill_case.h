// The prefill suites' one step against the reference (test_cuda_prefill.cpp, the 16-bit CTAs;
// test_cuda_prefill_fp8.cpp, the fp8 one): a ragged batch whose pages are scattered through the
// pool, pool rows no request uses poisoned with NaN, outputs poisoned before the run, out and lse
// compared with the reference backend over the same pool bytes.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "tests/test_cuda_util.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/prefill.h"

namespace attnrt::test {

struct PrefillCase : LayerCase {
  ForwardMode mode = ForwardMode::EXTEND;
  int page = 16;
  DType act = DType::bf16;
  std::vector<int32_t> prefix, qlen;  // DRAFT_EXTEND: qlen = accepted drafts + 1
  uint32_t seed = 1;
  // An fp8 KV cache (fp8_dtype: e4m3 or e5m2) with these per-layer scales, and
  // Options::fp8_prefill_attention (the fp8 prefill CTA, test_cuda_prefill_fp8.cpp). Without the
  // option, fp8 pages at head dims 64, 128 and 256 run the warp-specialised CTA over fp8 pages
  // (test_cuda_prefill_kv8.cpp).
  bool fp8_kv = false;
  DType fp8_dtype = DType::e4m3;
  float k_scale = 0.6f, v_scale = 1.3f;
  bool fp8_prefill = false;
  // q drawn from [-q_mul, q_mul] instead of [-1, 1] (rounded to the activation dtype).
  float q_mul = 1.f;
  // The step's key of token t of a request times k_growth^(t / 128): rows whose maxima grow from
  // one 128-key tile to the next.
  float k_growth = 1.f;
};

// A case of the default layer with these request lengths.
inline PrefillCase lengths(std::vector<int32_t> prefix, std::vector<int32_t> qlen,
                           uint32_t seed = 1) {
  PrefillCase c;
  c.prefix = std::move(prefix);
  c.qlen = std::move(qlen);
  c.seed = seed;
  return c;
}

// ATTNRT_PREFILL_KV8 (prefill.h) switched for a scope, restored after.
class ScopedPrefillKv8 {
 public:
  explicit ScopedPrefillKv8(bool on) : saved_(cuda::prefill_kv8_enabled()) {
    cuda::set_prefill_kv8(on);
  }
  ~ScopedPrefillKv8() { cuda::set_prefill_kv8(saved_); }
  ScopedPrefillKv8(const ScopedPrefillKv8&) = delete;
  ScopedPrefillKv8& operator=(const ScopedPrefillKv8&) = delete;

 private:
  bool saved_;
};

// Scenarios both fp8-pool prefill suites run (test_cuda_prefill_fp8.cpp on the fp8 CTAs,
// test_cuda_prefill_kv8.cpp on the 16-bit CTA over fp8 pages), each built by the suite's own
// `make(prefix, qlen, seed)`.
// MIXED: one extend beside three decodes.
template <typename Make>
PrefillCase mixed_step_case(Make make) {
  PrefillCase m = make({100, 40, 41, 700}, {150, 1, 1, 1}, 19);
  m.mode = ForwardMode::MIXED;
  return m;
}
// DRAFT_EXTEND: 9 tokens x group 8 = 72 rows, the prefill shape.
template <typename Make>
PrefillCase draft_extend_case(Make make) {
  PrefillCase d = make({300, 1000, 64}, {9, 4, 7}, 20);
  d.mode = ForwardMode::DRAFT_EXTEND;
  d.hq = 32;
  d.hkv = 4;
  return d;
}
// Two row tiles over three key tiles, the last one partial, a prefix off a page edge: every path
// of a CTA (q conversion, ring, staging, masked diagonal, epilogue) at a size compute-sanitizer's
// racecheck runs in seconds.
template <typename Make>
PrefillCase small_step_case(Make make) {
  return make({17}, {150}, 30);
}
// A ring at a sanitizer's size: a unit of 7 (128-key) or 14 (64-key) tiles, every stage and staging
// tile reused, the barrier phases flipping; a 40-token request whose second row tile leaves a
// consumer idle; a one-tile unit.
template <typename Make>
PrefillCase ring_wrap_case(Make make) {
  PrefillCase c = make({700, 3}, {150, 40}, 31);
  c.hq = 8;
  c.hkv = 2;
  return c;
}
// 32 ragged requests x 4 KV heads: ~900 (work item, KV head) units, more than 4 per SM, so a
// warp-specialised CTA runs persistent and walks several units each: the ring, the staging tiles,
// the Q barriers and the consumers' turns carrying on from one unit to the next.
template <typename Make>
PrefillCase many_units_case(Make make) {
  PrefillCase c = make({}, {}, 29);
  c.hq = 16;
  c.hkv = 4;
  for (int i = 0; i < 32; ++i) {
    c.prefix.push_back((i * 37) % 300);
    c.qlen.push_back(150 + (i * 53) % 120);
  }
  return c;
}

// Scenario groups both fp8-pool suites check, through the suite's `check(case, what)`.
// Group 1, 4 and 8 (and 3: a 128-row tile ends inside a token's heads).
template <typename Make, typename Check>
void check_gqa_groups(Make make, Check check) {
  for (auto [hq, hkv] : {std::pair{4, 4}, std::pair{16, 4}, std::pair{32, 4}, std::pair{12, 4}}) {
    PrefillCase c = make({48, 0, 5}, {170, 97, 64}, static_cast<uint32_t>(hq * 10 + hkv));
    c.hq = hq;
    c.hkv = hkv;
    check(c, testing::Message() << "hq " << hq << " hkv " << hkv);
  }
}
template <typename Make, typename Check>
void check_non_causal_and_long(Make make, Check check) {
  PrefillCase c = make({0, 80}, {260, 150}, 7);
  c.causal = false;
  check(c, testing::Message() << "non-causal");
  check(make({640, 0}, {400, 600}, 8), testing::Message() << "long");
}
template <typename Make, typename Check>
void check_window_softcap_and_sinks(Make make, Check check) {
  PrefillCase c = make({500, 0, 64}, {300, 260, 150}, 11);
  c.window = 100;
  c.cap = 20.f;
  c.sinks = true;
  check(c, testing::Message() << "window 100, softcap, sinks");
  c.window = 0;  // each query sees only itself
  c.cap = 0.f;
  c.seed = 12;
  check(c, testing::Message() << "window 0");
  c.window = 130;  // a window edge that moves inside one key tile
  c.sinks = false;
  c.seed = 13;
  check(c, testing::Message() << "window 130");
  PrefillCase s = make({2990}, {140}, 14);
  s.window = 1001;  // the window's first key inside a tile, keys split
  s.page = 64;
  check(s, testing::Message() << "window 1001, split keys");
}
template <typename Make, typename Check>
void check_split_keys(Make make, Check check) {
  PrefillCase c = make({3000}, {129}, 15);
  check(c, testing::Message() << "causal");
  c.causal = false;
  c.seed = 16;
  check(c, testing::Message() << "non-causal");
}

// What check_prefill accepts against the reference: relative L2 error of the output, its largest
// absolute error, the largest lse error. The 16-bit CTAs' defaults (bf16 / fp16 rounding of P).
struct PrefillTolerance {
  double rel = 1.2e-2, rel_f16 = 4e-3, max_abs = 0.08, lse = 2e-2;
};

// Runs one step through the reference (host pools) and the cuda backend (device pools with the
// same bytes, same slots) and compares out and lse; failures name the case as `what`.
inline void check_prefill(const PrefillCase& c, const testing::Message& what = testing::Message(),
                          const PrefillTolerance& tol = PrefillTolerance()) {
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
  options.fp8_prefill_attention = c.fp8_prefill;

  // Pools with every request's pages scattered by a random permutation (page 0 is reserved).
  std::vector<int64_t> pages_of(bs);
  int64_t pages = 0;
  for (int i = 0; i < bs; ++i)
    pages += pages_of[i] = (c.prefix[i] + c.qlen[i] + c.page - 1) / c.page;
  KVCacheConfig cfg;
  cfg.full_slots = (pages + 2) * c.page;
  cfg.page_size = c.page;
  cfg.dtype = c.fp8_kv ? c.fp8_dtype : c.act;
  cfg.max_num_tokens = 1 << 15;
  KVStorage host = make_host_kv_storage(model, cfg);
  KVStorage dev = cuda::make_cuda_kv_storage(model, cfg);
  auto* dev_cache = static_cast<cuda::CudaKVCache*>(dev.cache.get());
  if (c.fp8_kv) {
    host.cache->set_kv_scales(0, c.k_scale, c.v_scale);
    dev.cache->set_kv_scales(0, c.k_scale, c.v_scale);
  }
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

  Qkv in = random_qkv(c.act, layer, T, rng);
  if (c.q_mul != 1.f) {
    const TensorView qv = in.q.view();
    for (int64_t i = 0; i < qv.numel(); ++i)
      store_from_float(qv.data, qv.dtype, i, load_as_float(qv.data, qv.dtype, i) * c.q_mul);
  }
  if (c.k_growth != 1.f) {
    const TensorView kv = in.k.view();
    const int64_t row = kv.numel() / T;
    int64_t tok = 0;
    for (int i = 0; i < bs; ++i)
      for (int32_t t = 0; t < c.qlen[i]; ++t, ++tok) {
        const float f = std::pow(c.k_growth, static_cast<float>(t) / 128.f);
        for (int64_t e = tok * row; e < (tok + 1) * row; ++e)
          store_from_float(kv.data, kv.dtype, e, load_as_float(kv.data, kv.dtype, e) * f);
      }
  }
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
  reference_forward(context(host.cache.get(), Device::cpu()), batch, layer, in,
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
  // Which CTA the table gives the case's prefill items: the fp8 one exactly when asked for; over
  // fp8 pages without it, at head dims 64, 128 and 256, the warp-specialised CTA over fp8 pages
  // unless switched off (the launch's own choice, effective_attention_cta), else the mma.sync CTA.
  const cuda::KvKind kv = !c.fp8_kv                    ? cuda::KvKind::same_as_q
                          : c.fp8_dtype == DType::e5m2 ? cuda::KvKind::e5m2
                                                       : cuda::KvKind::e4m3;
  const cuda::AttnKernelKey key{.head_dim = c.dim,
                                .v_head_dim = c.dim,
                                .fp16 = c.act == DType::f16,
                                .kv = kv,
                                .shape = cuda::TileShape::prefill,
                                .target_verify = false,
                                .fp8_prefill = c.fp8_prefill};
  const bool fp8_cta = c.fp8_prefill && kv == cuda::KvKind::e4m3 && c.dim == 128;
  ASSERT_EQ(cuda::attention_cta(key) == cuda::AttnCta::fp8_prefill, fp8_cta)
      << "the case does not reach the CTA under test";
  if (c.fp8_kv && !fp8_cta) {
    ASSERT_EQ(cuda::effective_attention_cta(key),
              (c.dim == 64 || c.dim == 128 || c.dim == 256) && cuda::prefill_kv8_enabled()
                                                      ? cuda::AttnCta::prefill_kv8
                                                      : cuda::AttnCta::mma_prefill)
        << "the case does not reach the CTA under test";
  }
  // The producer the warp-specialised CTA takes for this layer (the launch's own decision, on
  // the pool the backend reads): the TMA one wherever it applies, unless switched off.
  const auto pool_params = [&] {
    const KVLayerView dv_layer = dev.cache->layer(0);
    cuda::AttnParams p{};
    p.k = dv_layer.k;
    p.v = dv_layer.v;
    p.k_row_stride = dv_layer.k_row_stride;
    p.v_row_stride = dv_layer.v_row_stride;
    p.kv_rows = dv_layer.num_rows;
    p.kv_kind = kv;
    p.page_shift = std::countr_zero(static_cast<unsigned>(c.page));
    p.num_kv_heads = c.hkv;
    p.num_q_heads = c.hq;
    p.group = c.hq / c.hkv;
    p.q = a.q.data;
    p.q_rows = T;
    p.q_stride_tok = a.q.strides[0];
    p.q_stride_head = a.q.strides[1];
    return p;
  };
  const int ws = cuda::prefill_ws_mode();
  if (ws != 0 && !c.fp8_kv) {
    const cuda::AttnParams p = pool_params();
    const bool ping_pong = ws == 2 || (ws == cuda::kWsAuto && c.dim <= 128);
    const bool tma = cuda::prefill_ws_uses_tma(p, c.dim, c.act == DType::f16, ping_pong);
    const bool want = cuda::prefill_tma_enabled() && c.page >= 8 &&
                      ping_pong == (c.dim <= 128);  // the TMA instantiations: the default's CTAs
    EXPECT_EQ(tma, want) << "page " << c.page << ", dim " << c.dim << ", ws mode " << ws;
    // And Q by TMA where a tile is whole tokens of one group.
    const bool q_tma = cuda::prefill_ws_q_by_tma(p, c.dim, c.act == DType::f16, ping_pong);
    EXPECT_EQ(q_tma, want && std::has_single_bit(static_cast<unsigned>(p.group)))
        << "group " << p.group << ", page " << c.page << ", dim " << c.dim;
  }
  // The warp-specialised fp8 CTA's producer likewise: TMA on pages of 8 or more unless switched
  // off (the test pools' rows are aligned), Q by TMA with it where the group is a power of two.
  if (fp8_cta && cuda::prefill_fp8_ws_enabled()) {
    const cuda::AttnParams p = pool_params();
    const bool fp16 = c.act == DType::f16;
    const bool want = cuda::prefill_tma_enabled() && c.page >= 8;
    EXPECT_EQ(cuda::prefill_fp8_ws_uses_tma(p, fp16), want) << "fp8 CTA, page " << c.page;
    EXPECT_EQ(cuda::prefill_fp8_ws_q_by_tma(p, fp16),
              want && std::has_single_bit(static_cast<unsigned>(p.group)))
        << "fp8 CTA, group " << p.group << ", page " << c.page;
  }
  be.forward(a, layer, batch);
  ASSERT_EQ(cudaStreamSynchronize(be.stream()), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  dout.download(out.view());
  dlse.download(lse.view());

  const Compare co = compare(out.view(), ref_out.view(), T);
  double worst_lse = 0;
  int64_t worst_row = 0;
  bool lse_finite = true;
  for (int64_t i = 0; i < T * c.hq; ++i) {
    const double got = lse.ptr<float>()[i];
    lse_finite = lse_finite && std::isfinite(got);
    // The lse is a float: past |lse| ~ 1e4 a few of its ulps exceed tol.lse, so the allowance
    // grows with it (8 float epsilons of the reference: 0.25 at 2.6e5, where q ~ 1e5 put it).
    const double ref = ref_lse.ptr<float>()[i];
    const double err = std::abs(got - ref) /
                       (1.0 + 8.0 * std::numeric_limits<float>::epsilon() * std::abs(ref) / tol.lse);
    if (err > worst_lse) worst_lse = err, worst_row = i;
  }
  EXPECT_TRUE(co.finite && lse_finite) << "non-finite output or lse (unwritten or NaN)";
  EXPECT_LT(co.rel, c.act == DType::f16 ? tol.rel_f16 : tol.rel) << "max abs error " << co.max_abs;
  EXPECT_LT(co.max_abs, tol.max_abs);
  EXPECT_LT(worst_lse, tol.lse) << "lse differs from the reference (beyond tol.lse + 8 float "
                                   "epsilons of it): token "
                                << worst_row / c.hq << ", q head " << worst_row % c.hq << ": "
                                << lse.ptr<float>()[worst_row] << " against "
                                << ref_lse.ptr<float>()[worst_row];
}

}  // namespace attnrt::test

#endif
