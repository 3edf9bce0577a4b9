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
// AttnParams, work items (tile_rows(key.shape) rows each), page tables, tree masks and split-KV
// partials ([rows, Hq, v_head_dim] fp32, lse in log2 units) as the tensor-core CTAs, so the plan
// and the merge are unchanged. Every mode, GQA / MQA, window, soft-cap, sinks, fp8 KV. Its entry
// points (launch.h) read the dims from the key and return cudaErrorInvalidValue for dims it does
// not take.
AttnCtaEntry attention_generic_entry(bool fp16);

}  // namespace attnrt::cuda
