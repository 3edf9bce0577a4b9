// The warp-specialised prefill CTA over fp8 pages at head dim 256 (prefill_kv8_ws.cuh).
#include "backends/cuda/kernels/prefill_kv8_ws.cuh"

namespace attnrt::cuda {

AttnCtaEntry prefill_kv8_entry_d256(bool fp16) { return kv8_entry<PrefillWsKv8Cfg<256>>(fp16); }

}  // namespace attnrt::cuda
