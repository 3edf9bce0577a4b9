// Programmatic dependent launch (PDL, sm_90+): a kernel launched as the DEPENDENT of the kernel
// just before it on the stream (its PRIMARY) may start while the primary's last CTAs still run,
// so that the drain of one grid, the launch of the next and the next one's prologue overlap.
//
// The rules every use here follows (CUDA programming guide, "Programmatic Dependent Launch";
// PTX griddepcontrol):
// - launch_dependent_grids() in the primary only lets the dependent's CTAs be scheduled once every
//   CTA of the primary has issued it or exited. It says nothing about memory: the primary's writes
//   are NOT visible to the dependent because of it, wherever it is placed.
// - grid_dependency_wait() in the dependent returns once the primary grid has completed and its
//   memory operations are visible. Before it, a dependent may read only what the primary does not
//   write, and write nothing the primary reads or writes. Such data is complete when it reads it:
//   the primary itself was launched in stream order (it started after everything before it had
//   completed), and the dependent starts only after the primary did.
// - A dependent that never waits has no ordering with its primary at all, and the grid after it
//   would be ordered only after it, not after the primary. So every thread of a dependent kernel
//   executes grid_dependency_wait() on every path before it exits, even when it has no use for the
//   primary's results: then the dependent's completion implies the primary's.
// - A kernel that is itself a dependent and triggers its own dependent before its wait lets that
//   one start before ITS primary completed: the grandchild's pre-wait part may then only read what
//   was complete before the first kernel of the chain that was launched in stream order.
// Without a dependent launch (plain launch, or PDL off) both instructions do nothing.
//
// Who may be launched as a dependent is the caller's promise (`dependent` of launch_kernel): the
// operation just before it on the stream is the primary the kernel was written for (see each
// kernel's comment at its wait). In a CUDA-graph capture such a launch becomes a programmatic edge
// (CUDA 12.3 and later).
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

namespace detail {

// Whether every architecture this translation unit builds device code for executes the
// instructions above (a kernel compiled without them must never be launched as a dependent).
constexpr bool compiled_with_griddepcontrol() {
#ifdef __CUDA_ARCH_LIST__
  for (const int arch : {__CUDA_ARCH_LIST__}) {
    if (arch < 900) return false;
  }
  return true;
#else
  return false;
#endif
}

// False once a launch with the attribute failed where a plain one succeeded (dependent_launch.cu).
bool dependent_launch_usable();
void dependent_launch_failed();

}  // namespace detail

// SMs of the current device (read once per device); 0 when it cannot be read.
int sm_count();

// Lets `Kernel` use `smem` bytes of dynamic shared memory. Set once per kernel (every launch of a
// kernel asks for the same size); the first call's result is kept.
template <auto Kernel>
cudaError_t allow_dynamic_smem(size_t smem) {
  static const cudaError_t attr = cudaFuncSetAttribute(
      Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  return attr;
}

// Resident CTAs per SM of `Kernel` at `threads` threads and `smem` bytes of dynamic shared memory
// (occupancy API; 1 when the query fails).
template <auto Kernel>
int resident_ctas(int threads, size_t smem) {
  if (allow_dynamic_smem<Kernel>(smem) != cudaSuccess) return 1;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, smem) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  return n > 0 ? n : 1;
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch when
// `dependent` (see the top of the file) and dependent launches are on (launch.h). A launch with the
// attribute that fails is retried once without it; when that one succeeds, the attribute is never
// set again in this process.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, bool dependent, const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  if (!(detail::compiled_with_griddepcontrol() && dependent && dependent_launch_enabled() &&
        detail::dependent_launch_usable())) {
    return cudaLaunchKernelEx(&cfg, kernel, args...);
  }
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return cudaSuccess;
  cudaGetLastError();
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (err == cudaSuccess) detail::dependent_launch_failed();
  return err;
}

// launch_kernel in clusters of `cluster` CTAs (the grid a multiple of it in every dimension).
template <typename... Params, typename... Args>
cudaError_t launch_kernel_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                   cudaStream_t stream, bool dependent, dim3 cluster,
                                   const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2] = {};
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = cluster.x;
  attrs[0].val.clusterDim.y = cluster.y;
  attrs[0].val.clusterDim.z = cluster.z;
  cfg.attrs = attrs;
  cfg.numAttrs = 1;
  if (!(detail::compiled_with_griddepcontrol() && dependent && dependent_launch_enabled() &&
        detail::dependent_launch_usable())) {
    return cudaLaunchKernelEx(&cfg, kernel, args...);
  }
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.numAttrs = 2;
  if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return cudaSuccess;
  cudaGetLastError();
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (err == cudaSuccess) detail::dependent_launch_failed();
  return err;
}

}  // namespace attnrt::cuda
