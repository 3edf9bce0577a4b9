// The data `attnrt run` feeds its layers: fresh random activations for every layer of every step
// from a fast generator, fixed random weights for the linear-attention layers, and the host buffers
// they are cut from.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/core/tensor.h"
#include "attnrt/model/model_spec.h"

namespace attnrt::sim {

// xoshiro256+: the q/k/v of every layer of every step are fresh random numbers, and there are many
// of them; a small fast generator keeps data generation well below the attention cost.
class FastRng {
 public:
  explicit FastRng(uint64_t seed);
  uint64_t next();
  // Uniform in [-scale, scale).
  float symmetric(float scale) {
    return static_cast<float>(static_cast<int32_t>(next() >> 32)) * (scale * 0x1.0p-31f);
  }

 private:
  std::array<uint64_t, 4> s_{};
};

// Uniform values in [-scale, scale) into a float tensor (fp32, fp16 or bf16); throws attnrt::Error
// for other dtypes.
void fill_random(const TensorView& t, FastRng& rng, float scale);

// Per-layer buffers sized for the largest step; views are cut per step and layer.
struct LayerBuffers {
  HostBuffer q, k, v, out;
  std::vector<float> sinks;
  // Linear-attention layers: mixed_qkv, the gate inputs a and b.
  HostBuffer mixed, gate_a, gate_b;
  // DSA layers (docs/dsa.md): the indexer's q [rows, Hi * Di], k [rows, Di] and weights [rows, Hi].
  HostBuffer index_q, index_k, index_w;
};

// A [rows, heads, dim] view of the start of `buf`.
TensorView cut(const HostBuffer& buf, int64_t rows, int heads, int dim);

// Weights of a linear-attention layer (fixed for the run), fp32 as LinearArgs wants them: conv
// weights and bias, A_log (decay rates exp(A_log) in about [0.2, 1.6]), dt_bias, and D.
struct LinearWeights {
  HostBuffer conv_w, conv_b, A_log, dt_bias, D;
};
LinearWeights make_linear_weights(const LayerSpec& l, FastRng& rng);

// Widths of a linear layer's per-token inputs: mixed_qkv, a, b, and of its output.
struct LinearWidths {
  int64_t mixed = 0, a = 0, b = 0, out = 0;
};
LinearWidths linear_widths(const LayerSpec& l);

// The step's inputs of a linear layer over the shared buffers (T tokens, activations in `dtype`).
LinearArgs linear_args(const LayerSpec& l, const LinearWeights& w, const LayerBuffers& buf,
                       int64_t T, DType dtype);

}  // namespace attnrt::sim
