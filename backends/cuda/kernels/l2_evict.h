// The clean L2 flush of `attnrt bench` on a GPU (ATTNRT_BENCH_FLUSH=clean, docs/bench.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace attnrt::cuda {

// Reads the first `bytes` of `buf` with 16-byte loads over 4 CTAs per SM and writes nothing but,
// never in practice, one word to `sink`. Read over a buffer of at least 4x the L2, it leaves the L2
// holding clean lines of `buf` only: every line a later kernel finds there is neither its own nor
// dirty. `buf` 16-byte aligned and `bytes` a multiple of 16, else cudaErrorInvalidValue.
cudaError_t evict_l2_by_reading(const void* buf, size_t bytes, uint32_t* sink, cudaStream_t s);

}  // namespace attnrt::cuda
