// Helpers shared by the GPU test files: the skip (with the reason) where no CUDA device is usable,
// random inputs and their seed, the attention layer of a case, output comparisons, dependent
// launches switched for a scope, device memory and device copies of host tensors.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "attnrt/core/dtype.h"
#include "attnrt/core/tensor.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/model/model_spec.h"
#include "attnrt/runtime/attention_runtime.h"
#include "backends/reference/reference_backend.h"
#include "tests/test_util.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/kernels/launch.h"
#endif

#define SKIP_WITHOUT_GPU()                                                                      \
  do {                                                                                          \
    if (!query_cuda().usable) GTEST_SKIP() << "no usable CUDA device: " << query_cuda().reason; \
  } while (0)

namespace attnrt::test {

// Options of the graph suites' cuda runtimes: pages of `page`, speculative decoding with
// `draft_tokens` drafts of EAGLE topk `topk` when spec_steps > 0.
inline Options cuda_graph_options(int page, int spec_steps, int topk, int draft_tokens) {
  Options o;
  o.attention_backend = "cuda";
  o.page_size = page;
  o.speculative_num_steps = spec_steps;
  o.speculative_eagle_topk = topk;
  o.speculative_num_draft_tokens = draft_tokens;
  return o;
}

// The graph suites' batches over request rows `rows` whose token slots are `slots[i]`: a DECODE of
// the lengths `seq` (each request's last slot written), and a TARGET_VERIFY of n block tokens per
// request after `seq` (a tree of random parents when topk > 1).
template <typename Row>
ForwardBatch graph_decode_batch(const std::vector<Row>& rows,
                                const std::vector<std::vector<int64_t>>& slots,
                                const std::vector<int32_t>& seq) {
  ForwardBatch b = make_decode_batch(std::vector<int64_t>(rows.begin(), rows.begin() + seq.size()), seq);
  b.out_cache_loc.clear();
  for (size_t i = 0; i < seq.size(); ++i) b.out_cache_loc.push_back(slots[i][seq[i] - 1]);
  return b;
}

template <typename Row>
ForwardBatch graph_verify_batch(const std::vector<Row>& rows,
                                const std::vector<std::vector<int64_t>>& slots,
                                const std::vector<int32_t>& seq, int n, int topk,
                                std::mt19937& rng) {
  SpecInfo spec = SpecInfo::chain(static_cast<int>(seq.size()), n);
  if (topk > 1) {
    spec.topk = topk;
    for (size_t i = 0; i < seq.size(); ++i)
      for (int t = 1; t < n; ++t)
        spec.parents[i * n + t] = std::uniform_int_distribution<int>(0, t - 1)(rng);
  }
  ForwardBatch b = make_verify_batch(std::vector<int64_t>(rows.begin(), rows.begin() + seq.size()),
                                     seq, std::move(spec));
  b.out_cache_loc.clear();
  for (size_t i = 0; i < seq.size(); ++i)
    for (int t = 0; t < n; ++t) b.out_cache_loc.push_back(slots[i][seq[i] + t]);
  return b;
}

// The decode-graph scenario of the graph suites: three requests padded to a bucket of 4 captured,
// replayed at the lengths `replay`, the full bucket by the same graph, then one request in a
// second graph. `step` runs and checks a decode step of those lengths; `captured` counts graphs.
inline void decode_graph_scenario(const std::function<void(const std::vector<int32_t>&)>& step,
                                  const std::function<int()>& captured,
                                  const std::vector<int32_t>& replay) {
  {
    SCOPED_TRACE("3 requests padded to 4: capture");
    step({1000, 300, 2000});
  }
  EXPECT_EQ(captured(), 1);
  {
    SCOPED_TRACE("3 requests, other lengths: replay");
    step(replay);
  }
  {
    SCOPED_TRACE("4 requests: the same graph, no padding");
    step({3800, 1, 1200, 777});
  }
  EXPECT_EQ(captured(), 1);
  {
    SCOPED_TRACE("1 request: a second graph");
    step({3333});
  }
  EXPECT_EQ(captured(), 2);
}

// ATTNRT_TEST_SEED where set (to replay a run), else a fresh random seed.
inline uint32_t test_seed() {
  if (const char* s = std::getenv("ATTNRT_TEST_SEED")) return static_cast<uint32_t>(std::atoll(s));
  return std::random_device{}();
}

// Fills a host tensor with numbers drawn uniformly from [-amp, amp].
inline void fill_random(const TensorView& t, std::mt19937& rng, float amp) {
  std::uniform_real_distribution<float> u(-amp, amp);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_float(t.data, t.dtype, i, u(rng));
}

// q, k and v of `tokens` tokens for `layer` (v with the qk head dim), drawn in that order from
// [-1, 1], [-2, 2] and [-2, 2].
struct Qkv {
  HostBuffer q, k, v;
};
inline Qkv random_qkv(DType dtype, const LayerSpec& layer, int64_t tokens, std::mt19937& rng) {
  Qkv x{HostBuffer(dtype, {tokens, layer.num_q_heads, layer.head_dim}),
        HostBuffer(dtype, {tokens, layer.num_kv_heads, layer.head_dim}),
        HostBuffer(dtype, {tokens, layer.num_kv_heads, layer.head_dim})};
  fill_random(x.q.view(), rng, 1.f);
  fill_random(x.k.view(), rng, 2.f);
  fill_random(x.v.view(), rng, 2.f);
  return x;
}

// The one attention layer of a case: full, or sliding-window where window >= 0.
struct LayerCase {
  int hq = 8, hkv = 2, dim = 128;
  int window = -1;
  float cap = 0.f;
  bool sinks = false, causal = true;

  LayerSpec layer() const {
    LayerSpec l = attention_layer(0, hq, hkv, dim);
    l.kind = window >= 0 ? LayerKind::swa : LayerKind::full;
    l.logit_cap = cap;
    l.sliding_window = window;
    l.has_sinks = sinks;
    l.attn_type = causal ? AttnType::decoder : AttnType::encoder_only;
    return l;
  }
};

// One layer of `batch` on the reference backend over `ctx`, whose KV cache takes the step's K/V:
// out and lse of `in`, with the sink logits where `sinks` is not null.
inline void reference_forward(const BackendContext& ctx, const ForwardBatch& batch,
                              const LayerSpec& layer, const Qkv& in, const float* sinks,
                              const TensorView& out, const TensorView& lse) {
  ctx.kv_cache->begin_step(batch);
  ReferenceBackend ref(ctx);
  ref.init_forward_metadata(batch);
  ref.forward({.q = in.q.view(),
               .k = in.k.view(),
               .v = in.v.view(),
               .out = out,
               .sinks = sinks,
               .lse = lse},
              layer, batch);
}

// Relative L2 error and largest absolute error of the first `rows` rows of `got` against `want`;
// a non-finite element of `got` makes both infinite.
#ifdef ATTNRT_HAS_CUDA
// The oracle of a GPU test's step: a host copy of the runtime's pools as the GPU left them (every
// layer's KV rows, and DSA layers' index keys when `index_keys`), begun on `batch`, with a
// reference backend over it. Heap-held: the backend keeps the context's addresses.
struct HostReference {
  KVStorage mirror;
  BackendContext ctx;
  std::unique_ptr<ReferenceBackend> ref;
};

inline std::unique_ptr<HostReference> host_reference(const ModelSpec& model,
                                                     const Options& options,
                                                     AttentionRuntime& rt,
                                                     const cuda::CudaKVCache& cache,
                                                     int64_t slots, const ForwardBatch& batch,
                                                     bool index_keys) {
  auto h = std::make_unique<HostReference>();
  KVCacheConfig kc;
  kc.full_slots = slots;
  kc.page_size = options.page_size;
  kc.dtype = rt.kv_cache().dtype();
  kc.max_num_tokens = 256;
  h->mirror = make_host_kv_storage(model, kc);
  for (const LayerSpec& l : model.layers) {
    const KVLayerView v = h->mirror.cache->layer(l.layer_id);
    cache.copy_layer_to_host(l.layer_id, v.k, v.v);
    if (index_keys) {
      rt.kv_cache().download_index_keys(l.layer_id, h->mirror.cache->index_keys(l.layer_id).data);
    }
  }
  h->mirror.cache->begin_step(batch);
  h->ctx.model = &model;
  h->ctx.options = &options;
  h->ctx.kv_cache = h->mirror.cache.get();
  h->ctx.req_to_token = &rt.req_to_token();
  h->ref = std::make_unique<ReferenceBackend>(h->ctx);
  h->ref->init_forward_metadata(batch);
  return h;
}
#endif

struct Compare {
  double rel = 0, max_abs = 0;
  bool finite = true;
};
inline Compare compare(const TensorView& got, const TensorView& want, int64_t rows) {
  Compare c;
  const int64_t n = got.shape[0] > 0 ? rows * (got.numel() / got.shape[0]) : 0;
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double a = load_as_float(got.data, got.dtype, i),
                 b = load_as_float(want.data, want.dtype, i);
    if (!std::isfinite(a)) return {INFINITY, INFINITY, false};
    num += (a - b) * (a - b);
    den += b * b;
    c.max_abs = std::max(c.max_abs, std::abs(a - b));
  }
  c.rel = std::sqrt(num / std::max(den, 1e-30));
  return c;
}

#ifdef ATTNRT_HAS_CUDA
// Programmatic dependent launches on or off while this object lives (kernels/launch.h).
class DependentLaunches {
 public:
  explicit DependentLaunches(bool on) : saved_(cuda::dependent_launch_enabled()) {
    cuda::set_dependent_launch(on);
  }
  ~DependentLaunches() { cuda::set_dependent_launch(saved_); }
  DependentLaunches(const DependentLaunches&) = delete;
  DependentLaunches& operator=(const DependentLaunches&) = delete;

 private:
  bool saved_;
};

// A device allocation of `bytes` (at least 16), freed with this object.
struct DeviceMemory {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceMemory(size_t n) : bytes(n) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(n, 16)), cudaSuccess);
  }
  ~DeviceMemory() { cudaFree(ptr); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
  // Copies `bytes` from or to the host.
  void upload(const void* host) const {
    EXPECT_EQ(cudaMemcpy(ptr, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void download(void* host) const {
    EXPECT_EQ(cudaMemcpy(host, ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
};

// Pinned host memory of `bytes` (at least 16): copies from and to it are truly asynchronous.
struct PinnedMem {
  void* ptr = nullptr;
  explicit PinnedMem(size_t bytes) {
    EXPECT_EQ(cudaHostAlloc(&ptr, std::max<size_t>(bytes, 16), cudaHostAllocDefault), cudaSuccess);
  }
  ~PinnedMem() { cudaFreeHost(ptr); }
  PinnedMem(const PinnedMem&) = delete;
  PinnedMem& operator=(const PinnedMem&) = delete;
};

// Device copy of a host tensor, freed with this object.
struct DevTensor {
  void* ptr = nullptr;
  TensorView view;
  DevTensor() = default;
  explicit DevTensor(const TensorView& host) {
    const size_t bytes = static_cast<size_t>(host.numel()) * dtype_size(host.dtype);
    EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, host.data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    // A plain cudaMemcpy from pageable memory may return before its DMA ran, on the legacy stream,
    // which the backends' non-blocking streams do not wait for.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    view = host;
    view.data = ptr;
    view.device = Device::cuda(0);
  }
  ~DevTensor() {
    if (ptr) cudaFree(ptr);
  }
  DevTensor(const DevTensor&) = delete;
  DevTensor& operator=(const DevTensor&) = delete;
  // Copies the device data back into `host` (same shape and dtype).
  void download(const TensorView& host) const {
    const size_t bytes = static_cast<size_t>(host.numel()) * dtype_size(host.dtype);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the kernels that wrote it ran elsewhere
    EXPECT_EQ(cudaMemcpy(host.data, ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
};

// Device copies of a step's q, k, v and out, and the arguments that point at them.
struct DeviceQkvOut {
  DevTensor q, k, v, out;
  DeviceQkvOut(const TensorView& q_host, const TensorView& k_host, const TensorView& v_host,
               const TensorView& out_host)
      : q(q_host), k(k_host), v(v_host), out(out_host) {}
  AttnArgs args() const { return {.q = q.view, .k = k.view, .v = v.view, .out = out.view}; }
};
#endif

}  // namespace attnrt::test
