// The clean L2 flush of `attnrt bench` on a GPU (ATTNRT_BENCH_FLUSH=clean, docs/bench.md), and its
// row-gather probe (the ceiling of page-1 reads).
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

// The gather probe of `attnrt bench`'s ceilings: reads rows[i] of `pool` for i < n, each row
// `row_bytes` long (a multiple of 16) at byte offset slots[i] * row_bytes, one warp a row with
// 16-byte loads through the L2, 2048 threads per SM; writes nothing but, never in practice, one
// word to `sink`. With slots a random permutation it is what a decode kernel over pages of one
// slot must do at best (rows of one token scattered over the pool); with slots in order, the same
// bytes read as a stream. cudaErrorInvalidValue for a misaligned pool or row size.
cudaError_t gather_rows_by_reading(const void* pool, const int32_t* slots, int64_t n,
                                   int row_bytes, uint32_t* sink, cudaStream_t s);

}  // namespace attnrt::cuda
