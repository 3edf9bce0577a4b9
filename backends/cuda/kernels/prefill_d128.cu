#include "backends/cuda/kernels/prefill.cuh"

namespace attnrt::cuda {

AttnCtaEntry prefill_kernel_entry_d128(bool fp16, bool verify) {
  return prefill_kernel_entry<128>(fp16, verify);
}

}  // namespace attnrt::cuda
