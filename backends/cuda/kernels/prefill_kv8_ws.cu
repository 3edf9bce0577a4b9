// The warp-specialised prefill CTA over fp8 pages (prefill_ws.cuh with PrefillWsKv8Cfg): its head
// dim 128 instantiations, its entry for every head dim and its switches.
#include "attnrt/core/env.h"
#include "backends/cuda/kernels/prefill_kv8_ws.cuh"

namespace attnrt::cuda {
namespace {

EnvSwitch g_prefill_kv8{"ATTNRT_PREFILL_KV8",
                        0,
                        1,
                        1,
                        "cuda backend",
                        "1 (default: prefill tiles over an fp8 KV cache run the warp-specialised "
                        "CTA at 16-bit precision) or 0 (the mma.sync CTA)"};

// Keys per tile at head dim 128, for A/B (ATTNRT_PREFILL_KV8_WIDE): 64 (0, PrefillWsKv8Cfg<128>:
// 4 stages, 4 staging tiles) or 128 (1: 2 stages of 64 KiB, 2 staging tiles, 226 KiB; the S MMAs
// twice as wide, but a stage is held a tile longer in ping-pong).
using Kv8Cfg128Keys = PrefillWsKv8Config<128, 128, 2, 2>;
bool kv8_wide_tiles() {
  static const bool wide =
      env_integer("ATTNRT_PREFILL_KV8_WIDE", 0, 1, "cuda backend",
                  "0 (default: 64-key tiles in 4 stages over fp8 pages at head dim 128) or 1 "
                  "(128-key tiles in 2 stages)")
          .value_or(0) != 0;
  return wide;
}

}  // namespace

bool prefill_kv8_enabled() { return g_prefill_kv8.get() != 0; }

void set_prefill_kv8(bool on) { g_prefill_kv8.set(on ? 1 : 0); }

AttnCtaEntry prefill_kv8_entry(int head_dim, bool fp16) {
  switch (head_dim) {
    case 64:
      return prefill_kv8_entry_d64(fp16);
    case 128:
      return kv8_wide_tiles() ? kv8_entry<Kv8Cfg128Keys>(fp16)
                                : kv8_entry<PrefillWsKv8Cfg<128>>(fp16);
    case 256:
      return prefill_kv8_entry_d256(fp16);
    default:
      return {};
  }
}

}  // namespace attnrt::cuda
