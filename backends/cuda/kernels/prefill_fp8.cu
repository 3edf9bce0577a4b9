// The fp8 prefill CTAs' entry: the one-warpgroup CTA (prefill_fp8.cuh, bf16 and fp16 q / out at
// head dim 128, here) or the warp-specialised one (prefill_fp8_ws.cu), as
// ATTNRT_PREFILL_FP8_WS says.
#include "attnrt/core/env.h"
#include "backends/cuda/kernels/prefill_fp8.cuh"

namespace attnrt::cuda {
namespace {

EnvSwitch g_prefill_fp8_ws{"ATTNRT_PREFILL_FP8_WS",
                           0,
                           1,
                           1,
                           "cuda backend",
                           "1 (default: --fp8-prefill-attention runs the warp-specialised fp8 "
                           "CTA) or 0 (the one-warpgroup fp8 CTA)"};

}  // namespace

bool prefill_fp8_ws_enabled() { return g_prefill_fp8_ws.get() != 0; }

void set_prefill_fp8_ws(bool on) { g_prefill_fp8_ws.set(on ? 1 : 0); }

AttnCtaEntry prefill_fp8_entry(int head_dim, bool fp16) {
  if (head_dim != 128) return {};
  if (prefill_fp8_ws_enabled()) return prefill_fp8_ws_entry(fp16);
  using Cfg = PrefillFp8Config;
  return fp16 ? GridCta<prefill_fp8_kernel<__half>, Cfg>::entry()
              : GridCta<prefill_fp8_kernel<__nv_bfloat16>, Cfg>::entry();
}

}  // namespace attnrt::cuda
