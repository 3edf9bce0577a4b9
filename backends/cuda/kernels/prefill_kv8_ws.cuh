// The warp-specialised prefill CTA over fp8 pages (prefill_ws.cuh with PrefillWsKv8Cfg<D>) as an
// entry per head dim: its instantiations (bf16 and fp16 q / out, consumers in ping-pong, cp.async
// producer with the fp8 -> f16 conversion) live in one translation unit per head dim
// (prefill_kv8_ws.cu: 128 and the switch; prefill_kv8_ws_d64.cu, prefill_kv8_ws_d256.cu), so that
// the three compile side by side.
#pragma once

#include "backends/cuda/kernels/prefill_ws.cuh"

namespace attnrt::cuda {

template <typename T, typename Cfg>
struct Kv8Cta {
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey&, int num_items,
                            cudaStream_t stream, bool) {
    return launch_prefill_ws_cfg<T, Cfg, false>(p, WsTensorMaps{}, num_items,
                                                prefill_ws_persistent(), stream);
  }
  static int occupancy(const AttnKernelKey&) {
    return resident_ctas<prefill_ws_kernel<T, Cfg, false>>(Cfg::kThreads, Cfg::kSmemBytes);
  }
};

template <typename Cfg>
AttnCtaEntry kv8_entry(bool fp16) {
  return fp16 ? AttnCtaEntry{&Kv8Cta<__half, Cfg>::launch, &Kv8Cta<__half, Cfg>::occupancy}
              : AttnCtaEntry{&Kv8Cta<__nv_bfloat16, Cfg>::launch,
                             &Kv8Cta<__nv_bfloat16, Cfg>::occupancy};
}

// The head dims other than 128, each from its own translation unit.
AttnCtaEntry prefill_kv8_entry_d64(bool fp16);
AttnCtaEntry prefill_kv8_entry_d256(bool fp16);

}  // namespace attnrt::cuda
