// Host-callable launchers of the cuda backend's linear-attention kernels (reference-semantics §8.8,
// §8.9): the causal conv1d with state, the delta rule (GDN: scalar decay per head; KDA: one decay
// per key channel) and Mamba2's SSD, for every mode, plus the post-verify commit (§8.10). Plain old
// data only, so that the host glue (g++) fills the parameters and the kernels (nvcc) read them.
//
// Data flow of one layer call (backends/cuda/cuda_linear_backend.cpp):
//   mixed_qkv --launch_conv--> y ([T, conv_dim], the conv outputs after SiLU)
//   y, a, b   --launch_delta_* / launch_ssd_*--> out
// y's element type is `y_dtype` of the parameters (the same buffer and code in all three): fp32
// when mixed_qkv is fp32, bf16 (rounded to nearest) when it is 16-bit (bf16 or fp16), as serving
// engines keep the conv output in the activation dtype; it halves y's HBM traffic (written once,
// read back by the recurrence). The kernels that read it take the type as a template parameter
// (both instantiated, dispatched once per launch) and compute in fp32 either way.
// State layouts are those of LinearStatePool (include/attnrt/memory/linear_state_pool.h): per layer
//   conv        [slots, K - 1, conv_dim]                 oldest input first
//   ssm         [slots, heads, rows, cols]               delta: [HV, Dv, Dk]; ssd: [nh, P, N]
//   inter_conv  [verify_rows, N, K - 1, conv_dim]        after each verify block token
//   inter_ssm   [verify_rows, N, heads, rows, cols]
// Checkpoints are indexed by the request's row in the verify step (its index in `reqs`), not by
// its slot.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attnrt::cuda::linear {

// Element types of activations and states: attnrt::DType values (f32, bf16, f16 here).
using DTypeCode = int32_t;

// One request of the step, uploaded once per step and shared by every layer.
struct LinReq {
  int64_t slot;               // state slot (0 = reserved; padded rows point there, with tokens 0)
  int32_t token_start;        // first row of the request in the step's per-token tensors
  int32_t tokens;             // rows of the request this step (0: nothing to do)
  int32_t has_initial_state;  // 1: start from the slot's state / window; 0: from zeros
  int32_t pad;
};

// The step: its requests and, for TARGET_VERIFY, the tree. Device pointers.
struct LinStep {
  const LinReq* reqs;
  int32_t num_reqs;
  int32_t max_tokens;       // longest request of the step
  int32_t verify;           // 1: TARGET_VERIFY: per-token checkpoints, slots left unchanged
  int32_t draft_tokens;     // verify: N (rows per request block)
  const int32_t* parents;   // verify: [num_reqs * N], parent inside the block, -1 for the root
};

// One layer's state. Device pointers; inter_* are null without speculative decoding.
struct LinState {
  void* conv;
  void* ssm;
  void* inter_conv;
  void* inter_ssm;
  DTypeCode conv_dtype;  // f32 or bf16
  DTypeCode ssm_dtype;   // f32 or bf16
  int32_t conv_dim;      // channels of the conv
  int32_t conv_width;    // K - 1
  int32_t heads, rows, cols;  // recurrent state per slot: [heads, rows, cols]
};

// Causal conv1d with SiLU over the step (§8.8). Non-verify: from the slot's window (or zeros
// without initial state) over the request's tokens, then the window becomes the last K - 1 inputs;
// verify: token t's window is its parent's checkpoint window (the root: the slot's, or zeros), the
// window after t goes to inter_conv[row, t], and the slot's window is left alone.
struct ConvParams {
  LinStep step;
  LinState state;
  const void* x;  // mixed_qkv rows, `x_stride` elements apart, channels contiguous
  int64_t x_stride;
  DTypeCode x_dtype;
  const float* weight;  // [conv_dim, K]; column K - 1 multiplies the newest input
  const float* bias;    // [conv_dim] or null
  int32_t kernel;       // K
  void* y;              // [T, conv_dim], contiguous rows of y_dtype
  DTypeCode y_dtype;    // f32 or bf16
};
cudaError_t launch_conv(const ConvParams& p, cudaStream_t stream);

// The delta rule (§8.9.1 GDN, §8.9.2 KDA) on the conv outputs y: for value head h (key head
// h / (heads / key_heads)) q = y[t, kh*Dk ...], k = y[t, key_heads*Dk + kh*Dk ...],
// v = y[t, 2*key_heads*Dk + h*Dv ...]; q, k are L2-normalised (eps 1e-6 inside the sqrt), q then
// scaled by `scale`; g = -exp(A_log[h]) * softplus(a + dt_bias) (gdn: a [T, heads], dt_bias
// [heads]; kda: a [T, heads, Dk], dt_bias [heads, Dk]); beta = sigmoid(b[t, h]).
struct DeltaParams {
  LinStep step;
  LinState state;  // rows = Dv, cols = Dk
  int32_t kda;     // 1: per-channel decay (kda), 0: one decay per head (gdn)
  int32_t key_heads;
  float scale;
  const void* y;      // [T, conv_dim], contiguous rows of y_dtype
  DTypeCode y_dtype;  // f32 or bf16
  const void* a;      // rows `a_stride` elements apart
  int64_t a_stride;
  DTypeCode a_dtype;
  const void* b;
  int64_t b_stride;
  DTypeCode b_dtype;
  const float* A_log;    // [heads]
  const float* dt_bias;  // gdn [heads]; kda [heads, Dk]
  void* out;             // [T, heads, Dv], rows `out_stride` elements apart
  int64_t out_stride;
  DTypeCode out_dtype;
};
// Token by token: DECODE, TARGET_VERIFY (each token from its parent's checkpoint, every token's
// state to inter_ssm) and any extend (the request's tokens in order, state written back once).
// `dependent` (kernels/dependent_launch.cuh): the launch just before on `stream` is launch_conv's
// kernel of this step, and the request table, the state and a / b were complete when it was
// launched; DECODE steps then load their first state rows while the conv finishes.
cudaError_t launch_delta_recurrent(const DeltaParams& p, cudaStream_t stream, bool dependent);
// Chunked extend (chunk = `chunk` tokens, the WY/UT form): same results as the recurrent form
// for non-verify steps, within fp32 rounding. `workspace` of delta_chunked_workspace() bytes.
size_t delta_chunked_workspace(const DeltaParams& p, int64_t num_tokens, int chunk);
cudaError_t launch_delta_chunked(const DeltaParams& p, int64_t num_tokens, int chunk,
                                 void* workspace, cudaStream_t stream);

// Mamba2 SSD (§8.9.3) on the conv outputs y = x | B | C: head h (group h / (heads / groups)) reads
// x = y[t, h*P ...], B = y[t, heads*P + grp*N ...], C = y[t, heads*P + groups*N + grp*N ...];
// dt = softplus(a[t, h] + dt_bias[h]); decay = exp(dt * -exp(A_log[h])); h <- decay h + dt x B^T;
// out = h C + D[h] x.
struct SsdParams {
  LinStep step;
  LinState state;  // rows = P (head_dim), cols = N (d_state)
  int32_t groups;
  const void* y;      // [T, conv_dim], contiguous rows of y_dtype
  DTypeCode y_dtype;  // f32 or bf16
  const void* a;      // dt [T, heads], rows `a_stride` elements apart
  int64_t a_stride;
  DTypeCode a_dtype;
  const float* A_log;    // [heads]
  const float* dt_bias;  // [heads]
  const float* D;        // [heads]
  void* out;             // [T, heads, P]
  int64_t out_stride;
  DTypeCode out_dtype;
};
// `dependent`: as launch_delta_recurrent's.
cudaError_t launch_ssd_recurrent(const SsdParams& p, cudaStream_t stream, bool dependent);
size_t ssd_chunked_workspace(const SsdParams& p, int64_t num_tokens, int chunk);
cudaError_t launch_ssd_chunked(const SsdParams& p, int64_t num_tokens, int chunk, void* workspace,
                               cudaStream_t stream);

// §8.10 for one layer: for request row i with last_accepted[i] = s >= 0, slot slots[i] takes
// inter_conv[i, s] and inter_ssm[i, s]; rows with s < 0 are skipped.
struct CommitParams {
  LinState state;
  const int64_t* slots;          // [rows]
  const int32_t* last_accepted;  // [rows]
  int32_t rows;
  int32_t draft_tokens;  // N
};
cudaError_t launch_commit(const CommitParams& p, cudaStream_t stream);

}  // namespace attnrt::cuda::linear
