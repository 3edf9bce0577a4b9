// Host-callable launchers of the prefill / extend kernel (prefill.cuh), compiled by nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include "backends/cuda/kernels/attention_params.h"

namespace attnrt::cuda {

// Query rows per CTA; the plan's TileShape::prefill work items must use this stride.
inline constexpr int kPrefillTileRows = 128;

// Non-tree steps with 16-bit KV (q/out and KV bf16, or all fp16), head dims 64, 128, 256; the
// work list and split counts are those of a TileShape::prefill plan. Grid: (kv heads, num_items).
cudaError_t launch_prefill(const AttnParams& p, int head_dim, bool fp16, int num_items,
                           cudaStream_t stream);
cudaError_t launch_prefill_d64(const AttnParams& p, bool fp16, int num_items, cudaStream_t stream);
cudaError_t launch_prefill_d128(const AttnParams& p, bool fp16, int num_items, cudaStream_t stream);
cudaError_t launch_prefill_d256(const AttnParams& p, bool fp16, int num_items, cudaStream_t stream);

}  // namespace attnrt::cuda
