// The decompression weights of a simulated MLA layer (docs/mla.md), for the MHA form: random fixed
// W_UK [Hq, kv_lora_rank, qk_nope] and W_UV [Hq, kv_lora_rank, mha_v], and the three maps a model
// applies with them. The same weights give the absorbed form (q_lat = W_UK q_nope per head, out =
// W_UV^T out_lat), so either form checks the other. Each column (one output dim of one head) has
// kNonzeros random rows: the maps cost kNonzeros multiply-adds per output instead of
// kv_lora_rank, which keeps `attnrt run` with 128 heads fast, and stay dense enough that q_lat
// mixes every nope dim into many latent dims.
#pragma once

#include <cstdint>
#include <vector>

#include "attnrt/core/tensor.h"
#include "attnrt/model/model_spec.h"

namespace attnrt::sim {

class MlaWeights {
 public:
  static constexpr int kNonzeros = 16;

  // Throws attnrt::Error for a layer without an MHA form. `threads`: the most threads the three
  // products below wake (0: every core); a call wakes one per 2^20 multiply-adds of its work.
  MlaWeights(const LayerSpec& layer, uint64_t seed, int threads = 0);

  // k [n, Hq, qk_nope + qk_rope] = [W_UK^T c | rope] and v [n, Hq, mha_v] = W_UV^T c per head from
  // the latent rows [n, 1, kv_lora_rank + qk_rope] (c: the first kv_lora_rank columns). Contiguous
  // tensors of any float dtype.
  void decompress(const TensorView& latent, const TensorView& k, const TensorView& v) const;
  // q_lat [T, Hq, kv_lora_rank + qk_rope] = [W_UK q_nope | q_rope] from q [T, Hq, qk_nope + qk_rope].
  void absorb_q(const TensorView& q, const TensorView& q_lat) const;
  // out [T, Hq, mha_v] = W_UV^T out_lat from out_lat [T, Hq, kv_lora_rank].
  void project_out(const TensorView& out_lat, const TensorView& out) const;

 private:
  int threads_for(int64_t work) const;

  int heads_, rank_, rope_, nope_, v_;
  int threads_;
  // Column (h, d) of W_UK: rows uk_row[(h * nope + d) * kNonzeros + i], weights uk_w[...]; W_UV
  // likewise with mha_v columns.
  std::vector<int32_t> uk_row_, uv_row_;
  std::vector<float> uk_w_, uv_w_;
};

}  // namespace attnrt::sim
