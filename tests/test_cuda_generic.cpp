// The cuda backend's generic-dims kernel and MLA layers against the reference backend: head dims
// without a tensor-core kernel (96, 192, v_head_dim != head_dim, 576), MLA's 576 / 512 latent rows
// in every mode, fp8 KV, tree verify, window / soft-cap / sinks, split-KV merges wider than 512
// dims; the MLA latent pool on the GPU (V a view of K, the k rows stored bit for bit like the host
// pool's); `attnrt run` on deepseek-v3 layers with GPU pools, CUDA graphs and speculative verify.
// Skips (with the reason) where no CUDA device is usable.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/backend/registry.h"
#include "attnrt/core/device.h"
#include "attnrt/memory/kv_cache.h"
#include "tools/sim/driver.h"
#include "tools/sim/trace.h"
#include "tests/conformance/conformance.h"
#include "tests/test_cuda_cases.h"
#include "tests/test_cuda_util.h"
#include "tests/test_sim_util.h"
#include "tests/test_util.h"

#ifdef ATTNRT_HAS_CUDA
#include "backends/cuda/cuda_kv_cache.h"
#endif

namespace attnrt {
namespace {

using namespace attnrt::conformance;

using test::attn;
using test::every_mode;
using test::mla;

void expect_matches_reference(const CaseSpec& s) {
  const CaseResult r = run_case("cuda", make_case(s));
  EXPECT_TRUE(r.ok) << r.detail;
}

TEST(CudaGeneric, HeadDimsWithoutTensorCoreKernelsInEveryMode) {
  SKIP_WITHOUT_GPU();
  struct Dims {
    int hq, hkv, d, dv;
  };
  const Dims dims[] = {{8, 2, 96, 96}, {8, 8, 192, 192}, {12, 4, 192, 128},
                       {8, 1, 128, 64}, {4, 2, 64, 128}, {4, 1, 576, 576}};
  uint64_t seed = 1;
  for (const Dims& x : dims) {
    for (DType kv : {DType::bf16, DType::e4m3}) {
      for (CaseSpec& s : every_mode({attn(x.hq, x.hkv, x.d, x.dv)}, kv, seed)) {
        SCOPED_TRACE(s.describe());
        expect_matches_reference(s);
      }
      seed += 16;
    }
  }
}

TEST(CudaGeneric, WindowSoftcapSinksNonCausalFp16AndPageSizes) {
  SKIP_WITHOUT_GPU();
  LayerSpec w = attn(8, 2, 96, 160);
  w.kind = LayerKind::swa;
  w.sliding_window = 40;
  w.logit_cap = 20.f;
  w.has_sinks = true;
  for (CaseSpec& s : every_mode({w, attn(8, 2, 96, 160)}, DType::e5m2, 100)) {
    s.q_amplitude = 3.f;
    SCOPED_TRACE(s.describe());
    expect_matches_reference(s);
  }
  for (int page : {1, 64}) {
    for (CaseSpec& s : every_mode({attn(6, 3, 80, 80)}, DType::f16, 200 + page)) {
      s.act_dtype = DType::f16;
      s.page_size = page;
      SCOPED_TRACE(s.describe());
      expect_matches_reference(s);
    }
  }
  LayerSpec nc = attn(4, 2, 192, 128);
  nc.attn_type = AttnType::decoder_bidirectional;
  for (CaseSpec& s : every_mode({nc}, DType::bf16, 300)) {
    if (s.mode != ForwardMode::EXTEND && s.mode != ForwardMode::MIXED) continue;
    SCOPED_TRACE(s.describe());
    expect_matches_reference(s);
  }
}

TEST(CudaGeneric, ConformanceFeaturesPass) {
  SKIP_WITHOUT_GPU();
  const BackendEntry& e = Registry::global().get("cuda");
  for (Feature f : {Feature::head_dim_other, Feature::v_head_dim_differs, Feature::mla}) {
    ASSERT_EQ(unsupported_reason(e.caps, f), "") << feature_name(f);
    for (uint64_t seed = 0; seed < 6; ++seed) {
      const CaseResult r = run_case(e, generate_case(f, 0x9e1ull + seed, e.caps));
      EXPECT_TRUE(r.ok) << r.detail;
    }
  }
}

TEST(CudaMla, LatentRowsInEveryModeAndKvDtype) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 500;
  for (DType kv : {DType::bf16, DType::e4m3, DType::e5m2}) {
    for (CaseSpec& s : every_mode({mla(16, 512, 64), mla(32, 512, 64)}, kv, seed)) {
      SCOPED_TRACE(s.describe());
      expect_matches_reference(s);
    }
    seed += 16;
  }
  // DeepSeek-V3's 128 heads on one rank: a decode token is two 64-row MLA items.
  CaseSpec d = every_mode({mla(128, 512, 64)}, DType::bf16, 600)[1];
  ASSERT_EQ(d.mode, ForwardMode::DECODE);
  SCOPED_TRACE(d.describe());
  expect_matches_reference(d);
}

#ifdef ATTNRT_HAS_CUDA
// The latent pool on the GPU: V is a view of K (same pointer and stride, one scale), the step's k
// rows are stored bit for bit like the host pool's, v is not read.
TEST(CudaMla, LatentPoolOnTheGpuMatchesTheHostPool) {
  SKIP_WITHOUT_GPU();
  ModelSpec m;
  m.name = "mla";
  m.dtype = DType::bf16;
  LayerSpec l = mla(16, 512, 64);
  l.layer_id = 0;
  m.layers = {l};
  for (DType dtype : {DType::bf16, DType::e4m3}) {
    KVCacheConfig cfg;
    cfg.full_slots = 64;
    cfg.page_size = 16;
    cfg.dtype = dtype;
    KVStorage host = make_host_kv_storage(m, cfg);
    KVStorage dev = cuda::make_cuda_kv_storage(m, cfg);
    auto* gpu = static_cast<cuda::CudaKVCache*>(dev.cache.get());
    const float scale = is_fp8(dtype) ? 0.5f : 1.f;
    host.cache->set_kv_scales(0, scale, scale);
    gpu->set_kv_scales(0, scale, scale);
    EXPECT_THROW(gpu->set_kv_scales(0, 0.5f, 2.f), Error);
    const KVLayerView g = gpu->layer(0), h = host.cache->layer(0);
    EXPECT_EQ(g.v, g.k);
    EXPECT_EQ(g.v_row_stride, g.k_row_stride);
    EXPECT_EQ(g.k_row_stride, h.k_row_stride);
    EXPECT_EQ(g.v_head_dim, 512);
    EXPECT_EQ(g.v_scale, g.k_scale);

    ForwardBatch b;
    b.mode = ForwardMode::EXTEND;
    b.out_cache_loc = {17, 3, 40};
    host.cache->begin_step(b);
    gpu->begin_step(b);
    HostBuffer k(DType::bf16, {3, 1, 576});
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-3.f, 3.f);
    for (int64_t i = 0; i < k.numel(); ++i) store_from_float(k.data(), DType::bf16, i, u(rng));
    host.cache->store_step_kv(0, k.view(), TensorView());
    gpu->store_step_kv(0, k.view(), TensorView());
    const size_t row = static_cast<size_t>(h.k_row_stride) * dtype_size(dtype);
    std::vector<char> got(static_cast<size_t>(h.num_rows) * row);
    gpu->copy_layer_to_host(0, got.data(), nullptr);
    for (int64_t s : b.out_cache_loc) {
      EXPECT_EQ(std::memcmp(got.data() + s * row, static_cast<const char*>(h.k) + s * row, row), 0)
          << dtype_name(dtype) << " slot " << s;
    }
  }
}
#endif

// `attnrt run` on two deepseek-v3 layers (tensor parallel 8: 16 q heads per rank, the latent kv
// head on every rank) with GPU pools: every step checked against reference on the host copy,
// decode and verify steps as CUDA graphs, tree paths moved inside the latent pool.
TEST(CudaMla, DeepSeekRunWithGraphsAndSpeculativeVerify) {
  SKIP_WITHOUT_GPU();
  const sim::Trace trace = sim::parse_trace(
      "{\"id\": \"a\", \"arrival_step\": 0, \"prompt_len\": 40, \"output_len\": 6}\n"
      "{\"id\": \"b\", \"arrival_step\": 1, \"prompt_len\": 70, \"output_len\": 9}\n"
      "{\"id\": \"c\", \"arrival_step\": 3, \"prompt_len\": 25, \"output_len\": 5}\n",
      "mla-run");
  for (int topk : {0, 1, 3}) {
    SCOPED_TRACE(testing::Message() << "topk " << topk);
    Options o;
    o.attention_backend = "cuda";
    o.page_size = 16;
    if (topk > 0) {
      o.speculative_num_steps = 3;
      o.speculative_eagle_topk = topk;
      o.speculative_num_draft_tokens = topk == 1 ? 4 : 7;
    }
    sim::RunConfig rc = test::small_run_config(2048, 1, 5);
    rc.layers = 2;
    rc.scheduler.spec.accept_prob = 0.8;
    const sim::RunReport r =
        sim::run_trace(apply_tensor_parallel(model_preset("deepseek-v3"), 8), o, trace, rc);
    EXPECT_TRUE(r.ok()) << sim::format_report(r);
    int64_t graph_steps = 0;
    for (const sim::ModeStats& s : r.modes) {
      EXPECT_EQ(s.checked_steps, s.steps) << forward_mode_name(s.mode);
      graph_steps += s.graph_steps;
    }
    EXPECT_GT(graph_steps, 0) << sim::format_report(r);
  }
}

}  // namespace
}  // namespace attnrt
