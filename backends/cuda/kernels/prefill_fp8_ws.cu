// The warp-specialised fp8 prefill CTA's entry points (prefill_fp8_ws.cuh): bf16 and fp16 q / out
// at head dim 128, persistent as prefill_ws.cuh's (ATTNRT_PREFILL_WS_PERSISTENT).
#include "backends/cuda/kernels/prefill_fp8_ws.cuh"

namespace attnrt::cuda {
namespace {

template <typename T>
struct Fp8WsCta {
  using Cfg = PrefillFp8WsConfig;
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey&, int num_items,
                            cudaStream_t stream, bool) {
    return launch_ws_units<prefill_fp8_ws_kernel<T>, Cfg>(p, num_items, prefill_ws_persistent(),
                                                          stream);
  }
  static int occupancy(const AttnKernelKey&) {
    return resident_ctas<prefill_fp8_ws_kernel<T>>(Cfg::kThreads, Cfg::kSmemBytes);
  }
};

}  // namespace

AttnCtaEntry prefill_fp8_ws_entry(bool fp16) {
  return fp16 ? AttnCtaEntry{&Fp8WsCta<__half>::launch, &Fp8WsCta<__half>::occupancy}
              : AttnCtaEntry{&Fp8WsCta<__nv_bfloat16>::launch, &Fp8WsCta<__nv_bfloat16>::occupancy};
}

}  // namespace attnrt::cuda
