// The SWA-hybrid KV cache in GPU memory (CudaKVCache with an SWA pool): a model of full and
// sliding-window layers run through AttentionRuntime on the cuda backend, step by step (extend,
// decode, mixed; eager and as CUDA graphs; pages of 16 and of 1), against the reference backend on
// the host SWA-hybrid cache fed the same allocator decisions, across free_swa and the reuse of
// freed slots; the stored rows, the device full->SWA map, row moves and downloads, the buffer
// sizes, and the steps the cache refuses. Skips (with the reason) where no CUDA device is usable.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/token_allocator.h"
#include "attnrt/runtime/attention_runtime.h"
#include "backends/reference/reference_backend.h"
#include "tools/sim/scheduler.h"

#include "tests/test_cuda_util.h"
#include "tests/test_util.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/cuda_kv_cache.h"
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

LayerSpec attn_layer(int id, int hkv, int dim, int window) {
  LayerSpec l;
  l.layer_id = id;
  l.kind = window >= 0 ? LayerKind::swa : LayerKind::full;
  l.num_q_heads = 8;
  l.num_kv_heads = hkv;
  l.head_dim = l.v_head_dim = dim;
  l.sliding_window = window;
  return l;
}

constexpr int64_t kFullSlots = 1024;
constexpr double kSwaRatio = 0.5;  // the SWA pool: 512 slots
constexpr int kMaxTokens = 256;

struct Req {
  int64_t row = 0;
  std::vector<int64_t> slots;  // full-pool slots by position
  int32_t len() const { return static_cast<int32_t>(slots.size()); }
};

// The runtime under test (cuda backend, pools on the GPU) and its host twin: an SWA-hybrid host
// cache with its own SWATokenAllocator that receives the same allocation calls (so both hand out
// the same slots and maps), read by the reference backend through the runtime's req_to_token.
class SwaTwin {
 public:
  SwaTwin(int page, bool graphs) : page_(page), graphs_(graphs), rng_(page * 31 + graphs) {
    model_.name = "swa-hybrid-gpu";
    model_.dtype = DType::bf16;
    model_.max_context_len = 2048;
    // Full and sliding-window layers of two shapes; windows small enough that pages leave them.
    model_.layers = {attn_layer(0, 2, 128, -1), attn_layer(1, 2, 128, 20), attn_layer(2, 4, 64, -1),
                     attn_layer(3, 4, 64, 37)};
    options_.attention_backend = "cuda";
    options_.page_size = page;
    RuntimeConfig rc;
    rc.max_requests = 8;
    rc.kv_slots = kFullSlots;
    rc.swa_full_tokens_ratio = kSwaRatio;
    rc.max_num_tokens = kMaxTokens;
    rc.cuda_graphs = graphs;
    rt_ = std::make_unique<AttentionRuntime>(model_, options_, rc);
    gpu_ = dynamic_cast<cuda::CudaKVCache*>(&rt_->kv_cache());
    KVCacheConfig kc;
    kc.full_slots = kFullSlots;
    kc.swa_full_tokens_ratio = kSwaRatio;
    kc.page_size = page;
    kc.dtype = rt_->kv_cache().dtype();
    kc.max_num_tokens = kMaxTokens;
    host_ = make_host_kv_storage(model_, kc);
    BackendContext ctx;
    ctx.model = &model_;
    ctx.options = &options_;
    ctx.kv_cache = host_.cache.get();
    ctx.req_to_token = &rt_->req_to_token();
    ctx.device = Device::cpu();
    ref_ = std::make_unique<ReferenceBackend>(ctx);
  }

  SWATokenAllocator& host_alloc() { return dynamic_cast<SWATokenAllocator&>(*host_.allocator); }
  SWATokenAllocator& gpu_alloc() { return dynamic_cast<SWATokenAllocator&>(rt_->allocator()); }

  int add_request() {
    reqs_.push_back({rt_->req_to_token().alloc(), {}});
    return static_cast<int>(reqs_.size()) - 1;
  }

  // A step over `ids`, each getting qlen[i] new tokens (allocated on both allocators alike).
  ForwardBatch step(const std::vector<int>& ids, const std::vector<int32_t>& qlen,
                    ForwardMode mode) {
    std::vector<int64_t> rows;
    std::vector<int32_t> prefix, seq;
    std::vector<int64_t> loc;
    for (size_t i = 0; i < ids.size(); ++i) {
      Req& r = reqs_[ids[i]];
      rows.push_back(r.row);
      prefix.push_back(r.len());
      seq.push_back(r.len() + qlen[i]);
      const std::vector<int32_t> p{r.len()}, s{r.len() + qlen[i]};
      const std::vector<int64_t> last{r.slots.empty() ? -1 : r.slots.back()};
      const std::vector<int64_t> got = gpu_alloc().alloc_extend(p, s, last);
      EXPECT_EQ(host_alloc().alloc_extend(p, s, last), got) << "the allocators diverged";
      rt_->req_to_token().write(static_cast<int>(r.row), r.len(), got);
      r.slots.insert(r.slots.end(), got.begin(), got.end());
      loc.insert(loc.end(), got.begin(), got.end());
    }
    ForwardBatch b = mode == ForwardMode::DECODE ? make_decode_batch(rows, seq)
                                                 : make_extend_batch(rows, prefix, qlen, mode);
    b.out_cache_loc = loc;
    return b;
  }

  // Releases the SWA slots of request `id`'s positions [0, upto) on both allocators.
  void free_swa(int id, int32_t upto) {
    const std::vector<int64_t> gone(reqs_[id].slots.begin(), reqs_[id].slots.begin() + upto);
    gpu_alloc().free_swa(gone);
    host_alloc().free_swa(gone);
  }
  // Whole pages before the first key a query at next_pos can see in any layer.
  int32_t out_of_window(int32_t next_pos) const {
    const int32_t first = std::max(0, next_pos - 37);
    return first / page_ * page_;
  }

  void free(int id) {
    gpu_alloc().free(reqs_[id].slots);
    host_alloc().free(reqs_[id].slots);
    rt_->req_to_token().free(static_cast<int>(reqs_[id].row));
    reqs_[id].slots.clear();
  }

  // Runs `b` on the runtime (eagerly, or as a graph when `graph`) and on the reference over the
  // host twin with the same q / k / v; every layer's output must agree.
  void run(const ForwardBatch& b, bool graph, const std::string& what) {
    SCOPED_TRACE(what);
    const int64_t T = b.num_tokens();
    host_.cache->begin_step(b);
    ref_->init_forward_metadata(b);
    struct Io : test::Qkv {
      HostBuffer out, ref;
    };
    std::vector<Io> io;
    for (const LayerSpec& l : model_.layers) {
      Io x{test::random_qkv(model_.dtype, l, T, rng_),
           HostBuffer(model_.dtype, {T, l.num_q_heads, l.head_dim}),
           HostBuffer(model_.dtype, {T, l.num_q_heads, l.head_dim})};
      std::memset(x.out.data(), 0xff, x.out.bytes());  // NaN: every row must be written
      ref_->forward({.q = x.q.view(), .k = x.k.view(), .v = x.v.view(), .out = x.ref.view()}, l, b);
      io.push_back(std::move(x));
    }
    if (graph) {
      ASSERT_GT(rt_->cuda_graph_bucket(b), 0);
      for (size_t i = 0; i < io.size(); ++i) {
        const GraphLayerIO x = rt_->graph_io(model_.layers[i].layer_id, T);
        rt_->copy_tensor(x.q, io[i].q.view());
        rt_->copy_tensor(x.k, io[i].k.view());
        rt_->copy_tensor(x.v, io[i].v.view());
        rt_->copy_tensor(x.out, io[i].out.view());
      }
      rt_->forward_step_graph(b);
      rt_->synchronize();
      for (size_t i = 0; i < io.size(); ++i)
        rt_->copy_tensor(io[i].out.view(), rt_->graph_io(model_.layers[i].layer_id, T).out);
    } else {
      rt_->begin_step(b);
      for (size_t i = 0; i < io.size(); ++i) {
        const test::DevTensor q(io[i].q.view()), k(io[i].k.view()), v(io[i].v.view()),
            out(io[i].out.view());
        rt_->forward(model_.layers[i].layer_id,
                     {.q = q.view, .k = k.view, .v = v.view, .out = out.view});
        rt_->synchronize();
        out.download(io[i].out.view());
      }
      rt_->end_step();
    }
    for (size_t i = 0; i < io.size(); ++i) {
      const test::Compare co = test::compare(io[i].out.view(), io[i].ref.view(), T);
      EXPECT_TRUE(co.finite) << "layer " << i << ": non-finite output (unwritten or NaN)";
      EXPECT_LT(co.rel, 1.2e-2) << "layer " << i << ": max abs error " << co.max_abs;
      EXPECT_LT(co.max_abs, 0.08) << "layer " << i << ": relative error " << co.rel;
    }
  }

  // Pool layout, device map and stored rows against the host twin.
  void check_pools(const std::string& what) {
    SCOPED_TRACE(what);
    rt_->synchronize();
    const std::vector<int64_t>& map = *host_alloc().full_to_swa();
    ASSERT_EQ(*gpu_alloc().full_to_swa(), map) << "the allocators' maps diverged";
    const int64_t full_rows = host_alloc().full().pool_rows();
    const int64_t swa_rows = host_alloc().swa().pool_rows();
    ASSERT_LT(swa_rows, full_rows);
    for (const LayerSpec& l : model_.layers) {
      const bool swa = l.sliding_window >= 0;
      const KVLayerView g = gpu_->layer(l.layer_id), h = host_.cache->layer(l.layer_id);
      EXPECT_EQ(gpu_->rows(l.layer_id), swa ? swa_rows : full_rows) << "layer " << l.layer_id;
      EXPECT_EQ(g.num_rows, h.num_rows) << "layer " << l.layer_id;
      EXPECT_EQ(g.is_swa, swa) << "layer " << l.layer_id;
      EXPECT_EQ(g.slot_map != nullptr, swa) << "layer " << l.layer_id;
      if (swa) {
        EXPECT_EQ(g.slot_map_rows, full_rows);
        cudaPointerAttributes attr{};
        EXPECT_EQ(cudaPointerGetAttributes(&attr, g.slot_map), cudaSuccess);
        EXPECT_EQ(attr.type, cudaMemoryTypeDevice) << "the slot map is not in GPU memory";
        // Every live token with an SWA slot: the device map agrees with the host map.
        std::vector<int64_t> dev(map.size());
        ASSERT_EQ(cudaMemcpy(dev.data(), g.slot_map, dev.size() * sizeof(int64_t),
                             cudaMemcpyDeviceToHost),
                  cudaSuccess);
        int wrong = 0;
        for (const Req& r : reqs_)
          for (int64_t s : r.slots) wrong += map[s] != 0 && dev[s] != map[s];
        EXPECT_EQ(wrong, 0) << "device map entries differ from the host map";
        EXPECT_EQ(dev.back(), -1);
      }
      const size_t row_bytes = h.k_row_stride * dtype_size(h.dtype);
      std::vector<char> k(g.num_rows * row_bytes), v(g.num_rows * row_bytes);
      gpu_->copy_layer_to_host(l.layer_id, k.data(), v.data());
      int mismatched = 0, compared = 0;
      for (const Req& r : reqs_) {
        for (int64_t s : r.slots) {
          const int64_t row = h.pool_slot(s);
          if (row == 0) continue;  // released by free_swa
          ++compared;
          mismatched +=
              std::memcmp(k.data() + row * row_bytes,
                          static_cast<const char*>(h.k) + row * row_bytes, row_bytes) != 0;
          mismatched +=
              std::memcmp(v.data() + row * row_bytes,
                          static_cast<const char*>(h.v) + row * row_bytes, row_bytes) != 0;
        }
      }
      EXPECT_GT(compared, 0);
      EXPECT_EQ(mismatched, 0) << "layer " << l.layer_id << ": stored rows differ from the host";
    }
  }

  int page_;
  bool graphs_;
  std::mt19937 rng_;
  ModelSpec model_;
  Options options_;
  std::unique_ptr<AttentionRuntime> rt_;
  cuda::CudaKVCache* gpu_ = nullptr;
  KVStorage host_;
  std::unique_ptr<ReferenceBackend> ref_;
  std::vector<Req> reqs_;
};

class CudaSwaKVCache : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaSwaKVCache, StepsMatchReferenceOnTheHostSwaCache) {
  const auto [page, graphs] = GetParam();
  SwaTwin t(page, graphs);
  ASSERT_NE(t.gpu_, nullptr) << "the runtime's KV cache is not a CudaKVCache";
  ASSERT_TRUE(t.gpu_->is_swa_hybrid());
  if (graphs) ASSERT_TRUE(t.rt_->cuda_graphs_enabled()) << t.rt_->cuda_graphs_off_reason();
  const int a = t.add_request(), b = t.add_request(), c = t.add_request();

  t.run(t.step({a, b, c}, {90, 33, 7}, ForwardMode::EXTEND), false, "extend from empty");
  t.run(t.step({a, b, c}, {1, 1, 1}, ForwardMode::DECODE), graphs, "decode");
  t.check_pools("after decode");

  // A's early pages leave every window (the widest is 37 keys + the query).
  const int32_t gone = t.out_of_window(t.reqs_[a].len());
  ASSERT_GE(gone, 48);
  t.free_swa(a, gone);
  const int64_t released = t.reqs_[a].slots[0];

  // Refused steps change nothing: no step, same device map, same rows.
  {
    const KVLayerView swa = t.gpu_->layer(1);
    std::vector<int64_t> before(t.host_alloc().full_to_swa()->size()), after(before.size());
    t.rt_->synchronize();
    ASSERT_EQ(cudaMemcpy(before.data(), swa.slot_map, before.size() * sizeof(int64_t),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    ForwardBatch bad = make_decode_batch({t.reqs_[b].row}, {t.reqs_[b].len()});
    bad.out_cache_loc = {released};
    test::expect_error(
        [&] { t.gpu_->begin_step(bad); },
        {"CUDA KV cache: out_cache_loc[0] = " + std::to_string(released), "has no SWA slot"});
    bad.out_cache_loc = {t.reqs_[b].slots[3], t.reqs_[b].slots[3]};
    test::expect_error([&] { t.gpu_->begin_step(bad); },
                 {"out_cache_loc[1] = " + std::to_string(t.reqs_[b].slots[3]), "repeats"});
    const int64_t full_rows = t.host_alloc().full().pool_rows();
    bad.out_cache_loc = {full_rows};
    test::expect_error([&] { t.gpu_->begin_step(bad); },
                 {"out_cache_loc[0] = " + std::to_string(full_rows), "outside the KV pool"});
    EXPECT_EQ(t.gpu_->layer(1).step_write_loc, nullptr);
    HostBuffer k(DType::bf16, {1, 2, 128});
    test::expect_error([&] { t.gpu_->store_step_kv(1, k.view(), k.view()); }, {"call begin_step"});
    ASSERT_EQ(cudaMemcpy(after.data(), swa.slot_map, after.size() * sizeof(int64_t),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(after, before) << "a refused step changed the device map";
    t.check_pools("after refused steps");
  }

  // Mixed: A extends past its released pages, B decodes, C extends with a prefix.
  t.run(t.step({a, b, c}, {20, 1, 25}, ForwardMode::MIXED), false, "mixed after free_swa");
  t.check_pools("after mixed");

  // C leaves; D reuses freed pages (and the SWA pages A released): its slots map anew.
  t.free(c);
  const int d = t.add_request();
  t.run(t.step({a, b, d}, {1, 1, 50}, ForwardMode::MIXED), false, "mixed with reused slots");
  t.run(t.step({a, b, d}, {1, 1, 1}, ForwardMode::DECODE), graphs, "decode after reuse");
  t.free_swa(a, t.out_of_window(t.reqs_[a].len()));
  t.run(t.step({a, b, d}, {1, 1, 1}, ForwardMode::DECODE), graphs, "decode after more free_swa");
  t.check_pools("after the last step");

  // Row moves given as full slots (accepted tree paths): SWA layers move their SWA rows.
  const std::vector<int> layers = {0, 1, 2, 3};
  const auto& ds = t.reqs_[d].slots;
  const std::vector<std::pair<int64_t, int64_t>> moves = {{ds[45], ds[40]}, {ds[47], ds[41]}};
  sim::copy_kv_rows(*t.host_.cache, layers, moves);
  sim::copy_kv_rows(*t.gpu_, layers, moves);
  t.check_pools("after row moves");
  test::expect_error(
      [&] {
        t.gpu_->copy_rows(layers, std::vector<std::pair<int64_t, int64_t>>{{ds[2], released}});
      },
      {"full slot " + std::to_string(released), "has no SWA slot"});
  t.check_pools("after a refused row move");

  // Downloads into a flat (full slot space) host copy: released slots are not written.
  const KVLayerView h = t.host_.cache->layer(1);
  const size_t row_bytes = h.k_row_stride * dtype_size(h.dtype);
  std::vector<char> k(t.host_alloc().full().pool_rows() * row_bytes, 0x5a), v(k.size(), 0x5a);
  const auto& as = t.reqs_[a].slots;
  t.gpu_->download_rows(1, as, k.data(), v.data());
  int wrong = 0;
  for (int64_t s : as) {
    const int64_t row = h.pool_slot(s);
    if (row == 0) {
      wrong += k[s * row_bytes] != 0x5a || v[s * row_bytes] != 0x5a;
      continue;
    }
    wrong += std::memcmp(k.data() + s * row_bytes, static_cast<const char*>(h.k) + row * row_bytes,
                         row_bytes) != 0;
    wrong += std::memcmp(v.data() + s * row_bytes, static_cast<const char*>(h.v) + row * row_bytes,
                         row_bytes) != 0;
  }
  EXPECT_EQ(wrong, 0) << "download_rows of an SWA layer";
}

INSTANTIATE_TEST_SUITE_P(PagesAndGraphs, CudaSwaKVCache,
                         ::testing::Combine(::testing::Values(16, 1), ::testing::Bool()),
                         [](const auto& info) {
                           return "page" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_graphs" : "_eager");
                         });

#else

TEST(CudaSwaKVCache, SkippedWithoutCuda) {
  GTEST_SKIP() << "attnrt was built without CUDA: " << query_cuda().reason;
}

#endif

}  // namespace
}  // namespace attnrt
