// Instantiation of the attention kernel for one head dim (included by attention_d{64,128,256}.cu
// so that the three head dims compile in parallel).
#pragma once

#include "backends/cuda/kernels/attention.cuh"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

template <typename T, typename Cfg>
cudaError_t launch_cfg(const AttnParams& p, int num_items, cudaStream_t stream) {
  static const cudaError_t attr =
      cudaFuncSetAttribute(attention_kernel<T, Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           Cfg::kSmemBytes);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(p.num_kv_heads, num_items);
  attention_kernel<T, Cfg><<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Decode: 16 rows; a 64-key tile split over 4 warps (2 warps of 32-key tiles at head dim 256, to
// keep three CTAs per SM). Two stages everywhere: four fp8 stages (as many bytes in flight as
// bf16) measured slower on the H200 (decode 128x8192 1.26 -> 1.55 ms), since the fp8 path is
// bound by its in-shared-memory conversion, not by loads in flight. Prefill: 128 rows over 8
// warps, 64-key tiles (32 at head dim 256).
template <int D, bool FP8>
using DecodeCfg = std::conditional_t<(D > 128), AttnConfig<D, 2, 16, 32, FP8>,
                                     AttnConfig<D, 4, 16, 64, FP8>>;
template <int D, bool FP8>
using PrefillCfg = AttnConfig<D, 8, 128, (D > 128 ? 32 : 64), FP8>;

template <int D, typename T>
cudaError_t launch_dim_t(const AttnParams& p, bool fp8_kv, TileShape shape, int num_items,
                         cudaStream_t stream) {
  if (shape == TileShape::decode) {
    return fp8_kv ? launch_cfg<T, DecodeCfg<D, true>>(p, num_items, stream)
                  : launch_cfg<T, DecodeCfg<D, false>>(p, num_items, stream);
  }
  return fp8_kv ? launch_cfg<T, PrefillCfg<D, true>>(p, num_items, stream)
                : launch_cfg<T, PrefillCfg<D, false>>(p, num_items, stream);
}

template <int D>
cudaError_t launch_dim(const AttnParams& p, bool fp16, bool fp8_kv, TileShape shape, int num_items,
                       cudaStream_t stream) {
  return fp16 ? launch_dim_t<D, __half>(p, fp8_kv, shape, num_items, stream)
              : launch_dim_t<D, __nv_bfloat16>(p, fp8_kv, shape, num_items, stream);
}

}  // namespace attnrt::cuda
