// Head-dim dispatch of the prefill kernel (one instantiation file per head dim, so they compile in
// parallel).
#include "backends/cuda/kernels/prefill.h"

namespace attnrt::cuda {

cudaError_t launch_prefill(const AttnParams& p, int head_dim, bool fp16, int num_items,
                           cudaStream_t stream) {
  if (num_items == 0) return cudaSuccess;
  const int ws = prefill_ws_mode();
  if (ws != 0) {
    const bool ping_pong = ws == 2 || (ws == kWsAuto && head_dim <= 128);
    return launch_prefill_ws(p, head_dim, fp16, ping_pong, num_items, stream);
  }
  switch (head_dim) {
    case 64:
      return launch_prefill_d64(p, fp16, num_items, stream);
    case 128:
      return launch_prefill_d128(p, fp16, num_items, stream);
    case 256:
      return launch_prefill_d256(p, fp16, num_items, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_prefill_verify(const AttnParams& p, int head_dim, bool fp16, int num_items,
                                  cudaStream_t stream, bool dependent) {
  if (num_items == 0) return cudaSuccess;
  switch (head_dim) {
    case 64:
      return launch_prefill_verify_d64(p, fp16, num_items, stream, dependent);
    case 128:
      return launch_prefill_verify_d128(p, fp16, num_items, stream, dependent);
    default:
      return cudaErrorInvalidValue;
  }
}

int prefill_verify_occupancy(int head_dim, bool fp16) {
  switch (head_dim) {
    case 64:
      return prefill_verify_occupancy_d64(fp16);
    case 128:
      return prefill_verify_occupancy_d128(fp16);
    default:
      return 1;
  }
}

}  // namespace attnrt::cuda
