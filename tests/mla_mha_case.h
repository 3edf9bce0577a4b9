// One MHA-form MLA step (docs/mla.md) for the tests of every backend: a runtime whose latent pool
// holds random rows everywhere (the same for the same seed, whatever the backend and the pool's
// device), a batch of requests (prefix p_i, extend e_i), and the model's side of the step on host
// tensors: the causal part, then every prefix chunk gathered from the pool and decompressed.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/mla_mha.h"
#include "attnrt/backend/options.h"
#include "attnrt/runtime/attention_runtime.h"
#include "src/model/layer_builders.h"
#include "tests/test_util.h"
#include "tools/sim/mla_weights.h"

namespace attnrt::mla_mha_case {

constexpr int kHq = 4, kRank = 512, kRope = 64, kNope = 128, kV = 128;
constexpr int kQk = kNope + kRope, kRow = kRank + kRope;

inline LayerSpec mla_layer(int id, int hq = kHq) {
  LayerSpec l = layer_builders::mla_layer(id, hq, kRank, kRope);
  l.qk_nope_head_dim = kNope;
  l.mha_v_head_dim = kV;
  l.scaling = 1.f / std::sqrt(static_cast<float>(kQk));
  return l;
}

struct Step {
  std::unique_ptr<AttentionRuntime> rt;
  ForwardBatch batch;
};

// `dt`: the model's dtype (the latent pool's and the activations'); `kv_dtype` "" = the model's.
inline Step make_step(const std::string& backend, int page, int64_t capacity, int64_t threshold,
                      const std::vector<int32_t>& prefix, const std::vector<int32_t>& extend,
                      uint64_t pool_seed, DType dt = DType::f32, int hq = kHq,
                      const std::string& kv_dtype = "") {
  Options o;
  o.attention_backend = backend;
  o.page_size = page;
  o.max_chunk_capacity = capacity;
  o.chunked_prefix_cache_threshold = threshold;
  o.num_threads = 2;
  if (!kv_dtype.empty()) o.kv_cache_dtype = kv_dtype;
  RuntimeConfig c;
  c.max_requests = 8;
  c.kv_slots = 8192;
  c.max_num_tokens = 1024;
  c.max_context_len = 1024;
  c.cuda_graphs = false;
  Step s;
  s.rt = std::make_unique<AttentionRuntime>(
      test::make_model("mla-mha", dt, 1024, {mla_layer(0, hq)}), o, c);
  // Every row of the pool, in its dtype, uploaded whole (host or GPU pools alike).
  const KVLayerView kv = s.rt->kv_cache().layer(0);
  std::mt19937 rng(static_cast<uint32_t>(pool_seed));
  HostBuffer rows(kv.dtype, {kv.num_rows, kv.k_row_stride});
  test::fill_normal(rows.view(), rng);
  s.rt->kv_cache().copy_layer_from_host(0, rows.data(), rows.data());
  std::vector<int64_t> req_rows;
  std::vector<int64_t> new_slots;
  for (size_t i = 0; i < prefix.size(); ++i) {
    const int row = s.rt->req_to_token().alloc();
    const std::vector<int32_t> p{0}, n{prefix[i] + extend[i]};
    const std::vector<int64_t> last{-1};
    const std::vector<int64_t> slots = s.rt->allocator().alloc_extend(p, n, last);
    s.rt->req_to_token().write(row, 0, slots);
    req_rows.push_back(row);
    new_slots.insert(new_slots.end(), slots.begin() + prefix[i], slots.end());
  }
  s.batch = make_extend_batch(req_rows, prefix, extend);
  s.batch.out_cache_loc = new_slots;
  return s;
}

// The model's side of an MHA-form step for layer 0 on host tensors of q's dtype. out / lse are
// poisoned first.
inline void run_mha(AttentionRuntime& rt, const sim::MlaWeights& w, const TensorView& q,
                    const TensorView& latent, const TensorView& out, const TensorView& lse) {
  const int64_t T = q.shape[0];
  const int hq = static_cast<int>(q.shape[1]);
  const DType dt = q.dtype;
  HostBuffer k(dt, {T, hq, kQk}), v(dt, {T, hq, kV});
  w.decompress(latent, k.view(), v.view());
  test::poison(out);
  test::poison(lse);
  rt.forward_mla_mha(0, {.q = q, .k = k.view(), .v = v.view(), .out = out, .lse = lse,
                         .latent = latent});
  const PrefixChunkPlan& plan = rt.prefix_chunk_plan();
  for (int c = 0; c < plan.num_chunks(); ++c) {
    const int64_t n = plan.chunks[c].num_tokens;
    HostBuffer lat(dt, {n, 1, kRow}), kc(dt, {n, hq, kQk}), vc(dt, {n, hq, kV});
    test::poison(lat.view());
    rt.gather_prefix_chunk(0, c, lat.view());
    w.decompress(lat.view(), kc.view(), vc.view());
    rt.forward_mla_prefix_chunk(0, c, {.q = q, .k = kc.view(), .v = vc.view(), .out = out,
                                       .lse = lse});
  }
}

struct Result {
  HostBuffer out, lse;
  int chunks = 0;
};

inline Result mha_result(const std::string& backend, int page, int64_t capacity,
                         const std::vector<int32_t>& prefix, const std::vector<int32_t>& extend,
                         uint64_t seed, DType dt = DType::f32, int hq = kHq,
                         const std::string& kv_dtype = "") {
  Step s = make_step(backend, page, capacity, 1, prefix, extend, seed, dt, hq, kv_dtype);
  const int64_t T = s.batch.num_tokens();
  std::mt19937 rng(static_cast<uint32_t>(seed * 7 + 1));
  HostBuffer q(dt, {T, hq, kQk}), latent(dt, {T, 1, kRow});
  test::fill_normal(q.view(), rng);
  test::fill_normal(latent.view(), rng);
  Result r{HostBuffer(dt, {T, hq, kV}), HostBuffer(DType::f32, {T, hq}), 0};
  s.rt->begin_step(s.batch);
  EXPECT_EQ(s.rt->mla_form(), MlaForm::mha);
  r.chunks = s.rt->prefix_chunk_plan().num_chunks();
  run_mha(*s.rt, sim::MlaWeights(mla_layer(0, hq), 5), q.view(), latent.view(), r.out.view(),
          r.lse.view());
  s.rt->end_step();
  return r;
}

}  // namespace attnrt::mla_mha_case
