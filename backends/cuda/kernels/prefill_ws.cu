// The warp-specialised prefill CTA (prefill_ws.cuh): its run-time switch and its instantiations
// (bf16 and fp16 at head dims 64, 128, 256, with and without the ping-pong, in one translation
// unit).
#include <atomic>

#include "attnrt/core/env.h"
#include "backends/cuda/kernels/prefill_ws.cuh"

namespace attnrt::cuda {
namespace {

// kWsUnread until the first read; then kWsAuto or a forced mode (0, 1, 2).
constexpr int kWsUnread = -2;
std::atomic<int> g_prefill_ws{kWsUnread};

// Persistent CTAs (one per SM, walking the units) unless ATTNRT_PREFILL_WS_PERSISTENT=0 (one CTA
// per unit), read once.
bool persistent() {
  static const bool on = env_integer("ATTNRT_PREFILL_WS_PERSISTENT", 0, 1, "cuda backend",
                                     "1 (one CTA per SM walks the work items) or 0 (one CTA per "
                                     "work item)")
                             .value_or(1) != 0;
  return on;
}

template <int D, bool PP>
cudaError_t launch_prefill_ws_cfg_pp(const AttnParams& p, bool fp16, int num_items,
                                     cudaStream_t stream) {
  return fp16 ? launch_prefill_ws_cfg<__half, PrefillWsCfg<D, PP>>(p, num_items, persistent(),
                                                                   stream)
              : launch_prefill_ws_cfg<__nv_bfloat16, PrefillWsCfg<D, PP>>(p, num_items,
                                                                          persistent(), stream);
}

template <int D>
cudaError_t launch_prefill_ws_dim(const AttnParams& p, bool fp16, bool ping_pong, int num_items,
                                  cudaStream_t stream) {
  return ping_pong ? launch_prefill_ws_cfg_pp<D, true>(p, fp16, num_items, stream)
                   : launch_prefill_ws_cfg_pp<D, false>(p, fp16, num_items, stream);
}

}  // namespace

int prefill_ws_mode() {
  int v = g_prefill_ws.load(std::memory_order_relaxed);
  if (v == kWsUnread) {
    const auto env = env_integer("ATTNRT_PREFILL_WS", kWsAuto, 2, "cuda backend",
                                 "-1 (the plan chooses), 0 (the default prefill CTA), 1 (the "
                                 "warp-specialised CTA) or 2 (it with the ping-pong schedule)");
    v = env ? static_cast<int>(*env) : kWsAuto;
    int expected = kWsUnread;
    // A concurrent set_prefill_ws_mode wins over the environment.
    if (!g_prefill_ws.compare_exchange_strong(expected, v)) v = expected;
  }
  return v;
}

void set_prefill_ws_mode(int mode) {
  g_prefill_ws.store(mode >= kWsAuto && mode <= 2 ? mode : kWsAuto);
}

cudaError_t launch_prefill_ws(const AttnParams& p, int head_dim, bool fp16, bool ping_pong,
                              int num_items, cudaStream_t stream) {
  if (num_items == 0) return cudaSuccess;
  switch (head_dim) {
    case 64:
      return launch_prefill_ws_dim<64>(p, fp16, ping_pong, num_items, stream);
    case 128:
      return launch_prefill_ws_dim<128>(p, fp16, ping_pong, num_items, stream);
    case 256:
      return launch_prefill_ws_dim<256>(p, fp16, ping_pong, num_items, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace attnrt::cuda
