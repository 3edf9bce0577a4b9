// The warp-specialised prefill CTA over fp8 pages (prefill_ws.cuh with PrefillWsKv8Config): its
// instantiations (bf16 and fp16 q / out at head dim 128, consumers in ping-pong, cp.async producer
// with the fp8 -> f16 conversion), its entry and its switch, in one translation unit.
#include "attnrt/core/env.h"
#include "backends/cuda/kernels/prefill_ws.cuh"

namespace attnrt::cuda {
namespace {

EnvSwitch g_prefill_kv8{"ATTNRT_PREFILL_KV8",
                        0,
                        1,
                        1,
                        "cuda backend",
                        "1 (default: prefill tiles over an fp8 KV cache run the warp-specialised "
                        "CTA at 16-bit precision) or 0 (the mma.sync CTA)"};

template <typename T>
struct Kv8Cta {
  using Cfg = PrefillWsKv8Cfg;
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey&, int num_items,
                            cudaStream_t stream, bool) {
    return launch_prefill_ws_cfg<T, Cfg, false>(p, WsTensorMaps{}, num_items,
                                                prefill_ws_persistent(), stream);
  }
  static int occupancy(const AttnKernelKey&) {
    return resident_ctas<prefill_ws_kernel<T, Cfg, false>>(Cfg::kThreads, Cfg::kSmemBytes);
  }
};

}  // namespace

bool prefill_kv8_enabled() { return g_prefill_kv8.get() != 0; }

void set_prefill_kv8(bool on) { g_prefill_kv8.set(on ? 1 : 0); }

AttnCtaEntry prefill_kv8_entry(bool fp16) {
  return fp16 ? AttnCtaEntry{&Kv8Cta<__half>::launch, &Kv8Cta<__half>::occupancy}
              : AttnCtaEntry{&Kv8Cta<__nv_bfloat16>::launch, &Kv8Cta<__nv_bfloat16>::occupancy};
}

}  // namespace attnrt::cuda
