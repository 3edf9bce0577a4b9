// Which prefill CTA runs a launch (one instantiation file per head dim, so they compile in
// parallel).
#include "backends/cuda/kernels/prefill.h"

namespace attnrt::cuda {

AttnCtaEntry prefill_entry(int head_dim, bool fp16, bool verify) {
  const int ws = prefill_ws_mode();
  if (!verify && ws != 0) {
    const bool ping_pong = ws == 2 || (ws == kWsAuto && head_dim <= 128);
    return prefill_ws_entry(head_dim, fp16, ping_pong);
  }
  switch (head_dim) {
    case 64:
      return prefill_kernel_entry_d64(fp16, verify);
    case 128:
      return prefill_kernel_entry_d128(fp16, verify);
    case 256:
      return prefill_kernel_entry_d256(fp16, verify);
    default:
      return {};
  }
}

}  // namespace attnrt::cuda
