#include "backends/cuda/kernels/prefill.cuh"

namespace attnrt::cuda {

AttnCtaEntry prefill_kernel_entry_d256(bool fp16, bool verify) {
  return prefill_kernel_entry<256>(fp16, verify);
}

}  // namespace attnrt::cuda
