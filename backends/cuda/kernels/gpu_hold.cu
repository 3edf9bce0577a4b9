#include "backends/cuda/kernels/gpu_hold.h"

namespace attnrt::cuda {

namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void delay_kernel(uint64_t ns) {
  const uint64_t start = global_ns();
  while (global_ns() - start < ns) __nanosleep(1000);
}

__global__ void hold_kernel(int32_t* gate, uint64_t timeout_ns) {
  const uint64_t start = global_ns();
  volatile int32_t* state = gate;
  bool opened = false;
  while (!(opened = *state != 0) && global_ns() - start < timeout_ns) __nanosleep(2000);
  gate[1] = opened ? 1 : 2;
  __threadfence_system();
}

__global__ void signal_kernel(int32_t* gate) {
  *reinterpret_cast<volatile int32_t*>(gate) = 1;
  __threadfence_system();
}

}  // namespace

cudaError_t launch_gpu_delay(uint64_t ns, cudaStream_t stream) {
  delay_kernel<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

cudaError_t gate_hold(int32_t* gate, uint64_t timeout_ns, cudaStream_t stream) {
  hold_kernel<<<1, 1, 0, stream>>>(gate, timeout_ns);
  return cudaGetLastError();
}

cudaError_t gate_signal(int32_t* gate, cudaStream_t stream) {
  signal_kernel<<<1, 1, 0, stream>>>(gate);
  return cudaGetLastError();
}

}  // namespace attnrt::cuda
