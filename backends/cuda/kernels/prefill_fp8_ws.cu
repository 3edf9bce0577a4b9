// The warp-specialised fp8 prefill CTA's entry points (prefill_fp8_ws.cuh): bf16 and fp16 q / out
// at head dim 128, persistent as prefill_ws.cuh's (ATTNRT_PREFILL_WS_PERSISTENT), with the TMA
// producer (Q by TMA where its map is encoded too) where prefill_fp8_tma_maps gives the maps, else
// the cp.async producer; every instance takes the same threads and shared memory.
#include <type_traits>

#include "backends/cuda/kernels/prefill_fp8_ws.cuh"

namespace attnrt::cuda {
namespace {

template <typename T>
struct Fp8WsCta {
  using Cfg = PrefillFp8WsConfig;
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey&, int num_items,
                            cudaStream_t stream, bool) {
    constexpr bool fp16 = std::is_same_v<T, __half>;
    const bool persistent = prefill_ws_persistent();
    WsTensorMaps maps{};
    if (prefill_fp8_tma_maps(p, fp16, &maps)) {
      if (maps.q_tma)
        return launch_ws_units<prefill_fp8_ws_kernel<T, true, true>, Cfg>(p, num_items, persistent,
                                                                          stream, maps);
      return launch_ws_units<prefill_fp8_ws_kernel<T, true>, Cfg>(p, num_items, persistent, stream,
                                                                  maps);
    }
    return launch_ws_units<prefill_fp8_ws_kernel<T, false>, Cfg>(p, num_items, persistent, stream,
                                                                 WsTensorMaps{});
  }
  static int occupancy(const AttnKernelKey&) {
    return resident_ctas<prefill_fp8_ws_kernel<T, false>>(Cfg::kThreads, Cfg::kSmemBytes);
  }
};

}  // namespace

AttnCtaEntry prefill_fp8_ws_entry(bool fp16) {
  return fp16 ? AttnCtaEntry{&Fp8WsCta<__half>::launch, &Fp8WsCta<__half>::occupancy}
              : AttnCtaEntry{&Fp8WsCta<__nv_bfloat16>::launch, &Fp8WsCta<__nv_bfloat16>::occupancy};
}

}  // namespace attnrt::cuda
