#include "backends/cuda/kernels/prefill.cuh"

namespace attnrt::cuda {

cudaError_t launch_prefill_d128(const AttnParams& p, bool fp16, int num_items,
                                cudaStream_t stream) {
  return launch_prefill_dim<128>(p, fp16, num_items, stream);
}

}  // namespace attnrt::cuda
