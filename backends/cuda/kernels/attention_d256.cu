#include "backends/cuda/kernels/attention_launch.cuh"

namespace attnrt::cuda {

cudaError_t launch_attention_d256(const AttnParams& p, bool fp16, bool fp8_kv, TileShape shape,
                                  int num_items, cudaStream_t stream, bool dependent) {
  return launch_dim<256>(p, fp16, fp8_kv, shape, num_items, stream, dependent);
}

int attention_occupancy_d256(bool fp16, bool fp8_kv, TileShape shape, int group) {
  return occupancy_dim<256>(fp16, fp8_kv, shape, group);
}

}  // namespace attnrt::cuda
