// DSA's index-key cache on the GPU (CudaKVCache::store_step_index_k, copy_rows): the same bytes as
// the host pool for the same steps, keys quantised bit for bit as quantize_fp8_block, in the
// paged layout, for GPU and host k of every float dtype, pages of 1, 16 and 64; accepted drafts'
// keys moved with their latent rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/kv_cache.h"
#include "src/model/layer_builders.h"
#include "tests/test_cuda_util.h"
#include "tests/test_util.h"

#ifdef ATTNRT_HAS_CUDA
#include "backends/cuda/cuda_kv_cache.h"
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

constexpr int kIndexDim = 128;

ModelSpec two_dsa_layers() {
  std::vector<LayerSpec> layers;
  for (int id = 0; id < 2; ++id) {
    LayerSpec l = layer_builders::mla_layer(id, 16, 512, 64);
    l.indexer = {.index_topk = 64, .index_n_heads = 8, .index_head_dim = kIndexDim};
    layers.push_back(l);
  }
  return test::make_model("dsa-keys", DType::bf16, 4096, layers);
}

std::vector<uint8_t> host_bytes(const IndexKeyView& v) {
  const auto* p = v.data;
  return {p, p + static_cast<size_t>(v.num_rows) * (v.dim + 4)};
}

TEST(CudaDsaKeys, StoresAndMovesMatchTheHostPoolByteForByte) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = test::test_seed();
  std::mt19937 rng(seed);
  const ModelSpec model = two_dsa_layers();
  for (int page : {1, 16, 64}) {
    for (DType kdt : {DType::bf16, DType::f16, DType::f32}) {
      for (bool on_gpu : {true, false}) {
        SCOPED_TRACE(testing::Message() << "page " << page << " k " << dtype_name(kdt)
                                        << (on_gpu ? " on the GPU" : " on the host") << " seed "
                                        << seed);
        KVCacheConfig kc;
        kc.full_slots = 1024;
        kc.page_size = page;
        kc.dtype = DType::bf16;
        kc.max_num_tokens = 256;
        KVStorage host = make_host_kv_storage(model, kc);
        KVStorage gpu_storage = cuda::make_cuda_kv_storage(model, kc);
        auto& gpu = dynamic_cast<cuda::CudaKVCache&>(*gpu_storage.cache);
        // Three steps at random distinct slots, keys of very different magnitudes per token
        // (scales across many exponents, values near the code boundaries).
        std::vector<int64_t> all(gpu.rows() - 1);
        std::iota(all.begin(), all.end(), int64_t{1});
        std::shuffle(all.begin(), all.end(), rng);
        size_t used = 0;
        for (int step = 0; step < 3; ++step) {
          const int T = 1 + static_cast<int>(rng() % 200);
          // A one-request EXTEND of T tokens: only out_cache_loc matters to the stores.
          ForwardBatch b = make_extend_batch({0}, {0}, {T});
          b.out_cache_loc.assign(all.begin() + used, all.begin() + used + T);
          used += T;
          host.cache->begin_step(b);
          gpu.begin_step(b);
          for (int layer = 0; layer < 2; ++layer) {
            HostBuffer k(kdt, {T, kIndexDim});
            for (int t = 0; t < T; ++t) {
              const float mag = std::ldexp(1.f, static_cast<int>(rng() % 40) - 24);
              std::normal_distribution<float> d(0.f, mag);
              for (int i = 0; i < kIndexDim; ++i)
                store_from_float(k.data(), kdt, static_cast<size_t>(t) * kIndexDim + i, d(rng));
            }
            host.cache->store_step_index_k(layer, k.view());
            if (on_gpu) {
              test::DeviceMemory dk(k.bytes());
              cudaMemcpy(dk.ptr, k.data(), k.bytes(), cudaMemcpyHostToDevice);
              TensorView dv(dk.ptr, kdt, {T, kIndexDim});
              dv.device = Device::cuda(0);
              gpu.store_step_index_k(layer, dv);
              gpu.synchronize();
            } else {
              gpu.store_step_index_k(layer, k.view());
            }
          }
        }
        // Accepted drafts compacted: a destination that another move reads.
        const std::vector<std::pair<int64_t, int64_t>> moves = {
            {all[5], all[4]}, {all[6], all[5]}, {all[20], all[300]}};
        const std::vector<int> layers = {0, 1};
        host.cache->copy_rows(layers, moves);
        gpu.copy_rows(layers, moves);
        for (int layer = 0; layer < 2; ++layer) {
          const IndexKeyView hv = host.cache->index_keys(layer);
          const IndexKeyView gv = gpu.index_keys(layer);
          EXPECT_EQ(gv.device.kind, DeviceKind::cuda);
          EXPECT_EQ(gv.num_rows, hv.num_rows);
          std::vector<uint8_t> got(static_cast<size_t>(gv.num_rows) * (gv.dim + 4));
          gpu.copy_index_keys_to_host(layer, got.data());
          const std::vector<uint8_t> want = host_bytes(hv);
          size_t first_diff = 0;
          while (first_diff < got.size() && got[first_diff] == want[first_diff]) ++first_diff;
          EXPECT_EQ(first_diff, got.size())
              << "layer " << layer << ": first differing byte " << first_diff;
        }
      }
    }
  }
}

TEST(CudaDsaKeys, MisuseNamesTheLayerAndTheTensor) {
  SKIP_WITHOUT_GPU();
  ModelSpec model = two_dsa_layers();
  model.layers[1].indexer = {};
  KVCacheConfig kc;
  kc.full_slots = 64;
  kc.page_size = 16;
  kc.max_num_tokens = 8;
  KVStorage s = cuda::make_cuda_kv_storage(model, kc);
  auto& gpu = dynamic_cast<cuda::CudaKVCache&>(*s.cache);
  test::expect_error([&] { gpu.index_keys(1); }, {"layer 1 has no index-key cache"});
  HostBuffer k(DType::bf16, {2, kIndexDim});
  test::expect_error([&] { gpu.store_step_index_k(0, k.view()); }, {"no step has begun"});
  ForwardBatch b = make_extend_batch({0}, {0}, {2});
  b.out_cache_loc = {3, 4};
  gpu.begin_step(b);
  HostBuffer bad(DType::bf16, {2, 64});
  test::expect_error([&] { gpu.store_step_index_k(0, bad.view()); },
                     {"store_step_index_k(layer 0)", "[2, 128]"});
}

#endif  // ATTNRT_HAS_CUDA

}  // namespace
}  // namespace attnrt
