// The fp8 prefill CTA's entry points (prefill_fp8.cuh): bf16 and fp16 q / out at head dim 128.
#include "backends/cuda/kernels/prefill_fp8.cuh"

namespace attnrt::cuda {

AttnCtaEntry prefill_fp8_entry(int head_dim, bool fp16) {
  if (head_dim != 128) return {};
  using Cfg = PrefillFp8Config;
  return fp16 ? GridCta<prefill_fp8_kernel<__half>, Cfg>::entry()
              : GridCta<prefill_fp8_kernel<__nv_bfloat16>, Cfg>::entry();
}

}  // namespace attnrt::cuda
