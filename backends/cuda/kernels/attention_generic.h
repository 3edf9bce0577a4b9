// Host-callable launcher of the generic-dims attention kernel (attention_generic.cu): the path for
// layers whose dims have no tensor-core kernel (head_dim not 64 / 128 / 256, v_head_dim !=
// head_dim, MLA's 576 / 512). Correct, not fast.
#pragma once

#include <cuda_runtime_api.h>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

// head_dim and v_head_dim: multiples of 8, at most this.
inline constexpr int kGenericMaxDim = 576;

// SIMT kernel, fp32 accumulation and an online softmax, one warp per query row: reads the same
// AttnParams, work items (tile_rows(shape) rows each), page tables, tree masks and split-KV
// partials ([rows, Hq, v_head_dim] fp32, lse in log2 units) as launch_attention, so the plan and
// the merge are unchanged. Every mode, GQA / MQA, window, soft-cap, sinks, fp8 KV. Returns
// cudaErrorInvalidValue for dims it does not take. Grid: (kv heads, num_items).
cudaError_t launch_attention_generic(const AttnParams& p, int head_dim, int v_head_dim, bool fp16,
                                     TileShape shape, int num_items, cudaStream_t stream);

// Resident CTAs per SM of the generic kernel (occupancy API; at least 1).
int attention_occupancy_generic(bool fp16);

}  // namespace attnrt::cuda
