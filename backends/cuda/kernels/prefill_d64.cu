#include "backends/cuda/kernels/prefill.cuh"

namespace attnrt::cuda {

cudaError_t launch_prefill_d64(const AttnParams& p, bool fp16, int num_items, cudaStream_t stream) {
  return launch_prefill_dim<64>(p, fp16, num_items, stream);
}

cudaError_t launch_prefill_verify_d64(const AttnParams& p, bool fp16, int num_items,
                                      cudaStream_t stream, bool dependent) {
  return launch_prefill_verify_dim<64>(p, fp16, num_items, stream, dependent);
}

int prefill_verify_occupancy_d64(bool fp16) { return prefill_verify_occupancy_dim<64>(fp16); }

}  // namespace attnrt::cuda
