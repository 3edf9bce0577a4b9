// The entry points (launch.h's AttnCtaEntry) of an attention CTA that takes AttnParams alone and
// runs one CTA per (KV head, work item).
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

// Kernel: the __global__ function; Cfg: its kThreads and kSmemBytes (dynamic shared memory).
template <auto Kernel, typename Cfg>
struct GridCta {
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey&, int num_items,
                            cudaStream_t stream, bool dependent) {
    const cudaError_t attr = allow_dynamic_smem<Kernel>(Cfg::kSmemBytes);
    if (attr != cudaSuccess) return attr;
    const dim3 grid(p.num_kv_heads, num_items);
    return launch_kernel(Kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, dependent, p);
  }
  static int occupancy(const AttnKernelKey&) {
    return resident_ctas<Kernel>(Cfg::kThreads, Cfg::kSmemBytes);
  }
  static constexpr AttnCtaEntry entry() { return {&launch, &occupancy}; }
};

}  // namespace attnrt::cuda
