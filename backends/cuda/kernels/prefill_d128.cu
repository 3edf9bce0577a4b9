#include "backends/cuda/kernels/prefill.cuh"

namespace attnrt::cuda {

cudaError_t launch_prefill_d128(const AttnParams& p, bool fp16, int num_items,
                                cudaStream_t stream) {
  return launch_prefill_dim<128>(p, fp16, num_items, stream);
}

cudaError_t launch_prefill_verify_d128(const AttnParams& p, bool fp16, int num_items,
                                       cudaStream_t stream, bool dependent) {
  return launch_prefill_verify_dim<128>(p, fp16, num_items, stream, dependent);
}

int prefill_verify_occupancy_d128(bool fp16) { return prefill_verify_occupancy_dim<128>(fp16); }

}  // namespace attnrt::cuda
