// The gather of a prefix chunk's latent rows from the latent pool for the model to decompress
// (MLA's MHA form on the cuda backend, cuda_mla_mha.cpp).
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

cudaError_t launch_gather_rows(const GatherRowsParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  return launch_kernel(gather_rows_kernel, dim3(static_cast<unsigned>(p.count)), dim3(128), 0,
                       stream, false, p);
}

}  // namespace attnrt::cuda
