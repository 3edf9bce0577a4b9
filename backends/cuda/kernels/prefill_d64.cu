#include "backends/cuda/kernels/prefill.cuh"

namespace attnrt::cuda {

AttnCtaEntry prefill_kernel_entry_d64(bool fp16, bool verify) {
  return prefill_kernel_entry<64>(fp16, verify);
}

}  // namespace attnrt::cuda
