// The DSA index-key cache on the GPU (docs/dsa.md "The index-key cache"): the store of a step's
// index keys, quantised per token to fp8 e4m3 codes with a power-of-two scale exactly as the host's
// quantize_fp8_block, and the moves of accepted drafts' keys. Page p of P slots: P * D code bytes,
// slot after slot, then P fp32 scales.
#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

namespace {

constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ int64_t codes_offset(int64_t slot, int page, int dim) {
  return (slot / page) * page * (dim + 4) + (slot % page) * dim;
}
__device__ __forceinline__ int64_t scale_offset(int64_t slot, int page, int dim) {
  return (slot / page) * page * (dim + 4) + int64_t{page} * dim + (slot % page) * 4;
}

// One warp per token: the block's largest magnitude, its exact power-of-two scale
// 2^ceil(log2(max(amax, 1e-4) / 448)) (from the binary exponent, as the host), then the codes.
__global__ void store_index_keys_kernel(const IndexKeyStoreParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;
  const int64_t slot = p.loc[t];
  const int64_t base = t * p.src_stride_tok;
  float amax = 1e-4f;
  for (int i = lane; i < p.dim; i += 32) amax = fmaxf(amax, fabsf(load_elem(p.src, p.src_dtype, base + i)));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  int e = 0;
  const float m = frexpf(amax / 448.f, &e);
  const float scale = ldexpf(1.f, m == 0.5f ? e - 1 : e);
  uint8_t* codes = p.data + codes_offset(slot, p.page_size, p.dim);
  for (int i = lane; i < p.dim; i += 32)
    codes[i] = float_to_fp8(load_elem(p.src, p.src_dtype, base + i) / scale, false);
  if (lane == 0) *reinterpret_cast<float*>(p.data + scale_offset(slot, p.page_size, p.dim)) = scale;
}

// Moves: gather (to_scratch) copies slot src_rows[i]'s codes and scale into scratch row i
// (dim + 4 bytes); scatter copies scratch row i to slot dst_rows[i]. One block per move.
__global__ void move_index_keys_kernel(const IndexKeyMoveParams p, bool to_scratch) {
  const int64_t i = blockIdx.x;
  const int64_t slot = to_scratch ? p.src_rows[i] : p.dst_rows[i];
  uint8_t* codes = p.data + codes_offset(slot, p.page_size, p.dim);
  uint8_t* scale = p.data + scale_offset(slot, p.page_size, p.dim);
  uint8_t* row = p.scratch + i * (p.dim + 4);
  for (int b = threadIdx.x; b < p.dim + 4; b += blockDim.x) {
    uint8_t* pool = b < p.dim ? codes + b : scale + (b - p.dim);
    if (to_scratch) {
      row[b] = *pool;
    } else {
      *pool = row[b];
    }
  }
}

}  // namespace

cudaError_t launch_store_index_keys(const IndexKeyStoreParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.dim <= 0 || p.page_size <= 0) return cudaErrorInvalidValue;
  const auto blocks =
      static_cast<unsigned>((p.num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  store_index_keys_kernel<<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_move_index_keys(const IndexKeyMoveParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  if (p.count < 0 || p.count > INT32_MAX || p.dim <= 0 || p.page_size <= 0)
    return cudaErrorInvalidValue;
  const auto blocks = static_cast<unsigned>(p.count);
  // Every source is read (into scratch) before any destination is written.
  move_index_keys_kernel<<<blocks, 128, 0, stream>>>(p, true);
  move_index_keys_kernel<<<blocks, 128, 0, stream>>>(p, false);
  return cudaGetLastError();
}

}  // namespace attnrt::cuda
