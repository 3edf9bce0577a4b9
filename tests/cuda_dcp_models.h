// What the cuda DCP tests share (tests/test_cuda_dcp.cpp, tests/test_cuda_dcp_graphs.cpp): their
// models (bf16 activations, as the cuda kernels take) and an owned non-blocking stream.
#pragma once

#include <gtest/gtest.h>

#include "attnrt/model/model_spec.h"
#include "tests/test_util.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace attnrt::test {

// Full attention with GQA and soft-cap, a layer with sinks, and a sliding window of 9 on global
// positions (windows need page size 1 on cuda ranks).
inline ModelSpec dcp_gqa_model() {
  LayerSpec a = attention_layer(0, 8, 2, 128);
  a.logit_cap = 30.f;
  LayerSpec b = attention_layer(1, 6, 6, 64);
  b.has_sinks = true;
  LayerSpec w = attention_layer(2, 8, 2, 128);
  w.kind = LayerKind::swa;
  w.sliding_window = 9;
  return make_model("cuda-dcp-gqa", DType::bf16, 512, {a, b, w});
}

// Full attention only (GQA with soft-cap, a layer with sinks): what cuda ranks run at
// page_size > 1 (a window's key lists are not row prefixes).
inline ModelSpec dcp_full_model() {
  ModelSpec m = dcp_gqa_model();
  m.layers.pop_back();
  m.name = "cuda-dcp-full";
  return m;
}

// DeepSeek-V3's latent rows (kv_lora_rank 512 + rope 64), 16 heads (a TP shard's), absorbed.
inline ModelSpec dcp_mla_model() {
  LayerSpec l = attention_layer(0, 16, 1, 576, 512);
  l.kind = LayerKind::mla;
  l.kv_lora_rank = 512;
  l.qk_rope_head_dim = 64;
  l.scaling = 0.06f;
  return make_model("cuda-dcp-mla", DType::bf16, 512, {l});
}

#ifdef ATTNRT_HAS_CUDA
// A non-blocking stream owned by a test (the engine's stream the ranks are moved to).
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};
#endif

}  // namespace attnrt::test
