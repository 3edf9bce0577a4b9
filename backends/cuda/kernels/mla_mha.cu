// The small kernels of MLA's MHA form on the cuda backend (cuda_mla_mha.cpp): a prefix chunk's
// (out, lse) merged into the running result, and the gather of a chunk's latent rows from the
// latent pool for the model to decompress.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/dependent_launch.cuh"

namespace attnrt::cuda {
namespace {

// One warp per (token, head) row: (o, lse) <- merge((o, lse), (o_c, lse_c)), natural logs. A
// chunk row without keys (lse_c = -inf) leaves the row as it is; so does a running row of
// -inf (the merge then takes the chunk's values).
__global__ void merge_chunk_kernel(const MlaMergeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= p.rows) return;
  const int lane = threadIdx.x & 31;
  const int64_t t = row / p.heads;
  const int h = static_cast<int>(row % p.heads);
  const float lc = p.chunk_lse[row];
  if (lc == -INFINITY) return;
  float* lse = p.lse + t * p.lse_stride_tok + h;
  const float la = *lse;
  const float m = fmaxf(la, lc);
  const float wa = la == -INFINITY ? 0.f : expf(la - m), wc = expf(lc - m);
  const float inv = 1.f / (wa + wc);
  const int64_t o0 = t * p.o_stride_tok + h * p.o_stride_head;
  const int64_t c0 = row * p.dim;
  for (int e = 2 * lane; e < p.dim; e += 64) {
    const float2 a = load_elem2(p.out, p.dtype, o0 + e);
    const float2 c = load_elem2(p.chunk_out, p.dtype, c0 + e);
    store_elem2(p.out, p.dtype, o0 + e, (a.x * wa + c.x * wc) * inv, (a.y * wa + c.y * wc) * inv);
  }
  __syncwarp();
  if (lane == 0) *lse = m + logf(wa + wc);
}

// One block per gathered row: out[i, :] = pool row slots[i] (through the SWA map when there is
// one) times the pool's scale, converted to the output dtype.
__global__ void gather_rows_kernel(const GatherRowsParams p) {
  const int64_t i = blockIdx.x;
  int64_t s = p.slots[i];
  if (p.slot_map != nullptr) s = p.slot_map[s < 0 ? p.slot_map_rows : s];
  const bool fp8 = p.src_dtype == kE4M3 || p.src_dtype == kE5M2;
  for (int d = threadIdx.x; d < p.dim; d += blockDim.x) {
    const int64_t j = s * p.src_row_stride + d;
    const float x = fp8 ? fp8_to_float(static_cast<const uint8_t*>(p.src)[j], p.src_dtype == kE5M2)
                        : load_elem(p.src, p.src_dtype, j);
    store_elem(p.out, p.out_dtype, i * p.out_stride + d, x * p.scale);
  }
}

}  // namespace

cudaError_t launch_mla_merge_chunk(const MlaMergeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  constexpr int kWarps = 8;
  const dim3 grid(static_cast<unsigned>((p.rows + kWarps - 1) / kWarps));
  return launch_kernel(merge_chunk_kernel, grid, dim3(32 * kWarps), 0, stream, false, p);
}

cudaError_t launch_gather_rows(const GatherRowsParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  return launch_kernel(gather_rows_kernel, dim3(static_cast<unsigned>(p.count)), dim3(128), 0,
                       stream, false, p);
}

}  // namespace attnrt::cuda
