// Case builders shared by the GPU conformance files (test_cuda_generic.cpp, test_cuda_mla.cpp):
// attention and MLA layers, and one step of every forward mode over them.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/dtype.h"
#include "attnrt/model/model_spec.h"
#include "tests/conformance/conformance.h"
#include "tests/test_util.h"

namespace attnrt::test {

inline LayerSpec attn(int hq, int hkv, int d, int dv) { return attention_layer(0, hq, hkv, d, dv); }

// An MLA layer in its absorbed form: one latent KV head of rank + rope columns, V the first `rank`.
inline LayerSpec mla(int hq, int rank = 512, int rope = 64) {
  LayerSpec l = attn(hq, 1, rank + rope, rank);
  l.kind = LayerKind::mla;
  l.kv_lora_rank = rank;
  l.qk_rope_head_dim = rope;
  l.scaling = 1.f / 13.856406f;  // (128 + 64)^-1/2, DeepSeek's unabsorbed head dim
  return l;
}

// One step per mode: extend with a cached prefix, decode (long rows: split-KV partials and their
// merge), mixed, tree verify, draft extend.
inline std::vector<conformance::CaseSpec> every_mode(const std::vector<LayerSpec>& layers, DType kv,
                                                     uint64_t seed) {
  std::vector<conformance::CaseSpec> out;
  auto spec = [&](ForwardMode m, std::vector<int32_t> prefix, std::vector<int32_t> query) {
    conformance::CaseSpec s;
    s.label = std::string(forward_mode_name(m));
    s.seed = seed++;
    s.mode = m;
    s.layers = layers;
    s.act_dtype = DType::bf16;
    s.kv_dtype = kv;
    s.page_size = 16;
    s.prefix_lens = std::move(prefix);
    s.query_lens = std::move(query);
    s.want_lse = true;
    if (is_fp8(kv)) s.k_scale = s.v_scale = 0.6f;
    return s;
  };
  out.push_back(spec(ForwardMode::EXTEND, {0, 37, 300}, {70, 5, 129}));
  out.push_back(spec(ForwardMode::DECODE, {3000, 15, 900, 0}, {1, 1, 1, 1}));
  out.push_back(spec(ForwardMode::MIXED, {40, 200, 7}, {30, 1, 1}));
  conformance::CaseSpec tree = spec(ForwardMode::TARGET_VERIFY, {90, 17}, {6, 6});
  tree.spec.draft_token_num = 6;
  tree.spec.topk = 2;
  tree.spec.parents = {-1, 0, 0, 1, 2, 2, -1, 0, 1, 0, 3, 3};
  out.push_back(tree);
  conformance::CaseSpec chain = spec(ForwardMode::TARGET_VERIFY, {50, 3}, {4, 4});
  chain.spec = SpecInfo::chain(2, 4);
  out.push_back(chain);
  out.push_back(spec(ForwardMode::DRAFT_EXTEND, {40, 9}, {3, 1}));
  return out;
}

}  // namespace attnrt::test
