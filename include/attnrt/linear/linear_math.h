// The math of the linear-attention layers in float64 (reference-semantics §8.8, §8.9): the causal
// conv1d with state, and the GDN, KDA and Mamba2 recurrences in a sequential (token by token) and a
// chunked form. The reference backend runs these; tests hold the two forms against each other.
//
// Conventions (one request, one layer):
//   window  [K - 1, conv_dim]        the last K - 1 conv inputs, oldest first
//   state   [heads, rows, cols]      gdn/kda: S^T per head ([Dv, Dk], value-major);
//                                    mamba2: h per head ([head_dim, d_state])
//   x       [T, conv_dim]            pre-conv inputs (mixed_qkv)
//   y       [T, conv_dim]            conv outputs after SiLU
//   a, b    [T, gate_a_width()], [T, gate_b_width()]  gate inputs (mamba2: a = dt, b unused)
//   out     [T, heads * rows]
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/memory/linear_state_pool.h"
#include "attnrt/model/model_spec.h"

namespace attnrt::linear {

// One layer's dimensions and parameters, in float64.
struct LayerParams {
  LayerKind kind = LayerKind::gdn;
  LinearStateShape shape;
  int kernel = 0;                   // K
  int key_heads = 0;                // gdn: Hk; kda: H; mamba2: n_groups
  int key_dim = 0;                  // gdn/kda: Dk; mamba2: d_state
  double scale = 1.0;               // query scale (gdn/kda)
  std::vector<double> conv_weight;  // [conv_dim, K]
  std::vector<double> conv_bias;    // [conv_dim], zeros when the layer has none
  std::vector<double> A_log;        // [heads]
  std::vector<double> dt_bias;      // gdn/mamba2: [heads]; kda: [heads, Dk]
  std::vector<double> D;            // mamba2: [heads]

  int gate_a_width() const;  // gdn: HV; kda: H * Dk; mamba2: nheads
  int gate_b_width() const;  // gdn/kda: heads; mamba2: 0
  int out_width() const { return shape.heads * shape.rows; }
};

// Reads the layer's parameters from `args` (shapes are checked by check_linear_args).
LayerParams read_params(const LinearArgs& args, const LayerSpec& layer);

double silu(double x);
double softplus(double x);  // log(1 + e^x), = x above 20 (as the kernels of the reference engine)
double sigmoid(double x);

// One conv step: y_t = SiLU(bias + sum_j w[:, j] * [window ++ x_t]_j); the window then drops its
// oldest input and appends x_t.
void conv_step(const LayerParams& p, std::span<double> window, const double* x_t, double* y_t);

// The conv over T tokens that follow `window` (left context); `window` becomes the last K - 1
// inputs of window ++ x. Same result as T conv_steps, computed from the whole sequence at once.
void conv_sequence(const LayerParams& p, std::span<double> window, int64_t T, const double* x,
                   double* y);

// One recurrent step: `state` becomes the state after the token, out_t = the token's output.
void recurrent_step(const LayerParams& p, std::span<double> state, const double* y_t,
                    const double* a_t, const double* b_t, double* out_t);

// T tokens in chunks of `chunk` (the chunked form: within a chunk, the tokens' contributions are
// combined through the cumulative decays and, for the delta rule, a forward substitution for the
// corrected values u; the state is materialised once per chunk). Equal to T recurrent_steps.
void recurrent_chunked(const LayerParams& p, std::span<double> state, int64_t T, const double* y,
                       const double* a, const double* b, int chunk, double* out);

}  // namespace attnrt::linear
