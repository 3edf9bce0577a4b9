// The mma.sync and keys-on-M CTAs of one head dim as entry points (included by
// attention_d{64,128,256}.cu so that the three head dims compile in parallel).
#pragma once

#include "backends/cuda/kernels/attention.cuh"
#include "backends/cuda/kernels/cta_entry.cuh"
#include "backends/cuda/kernels/decode_keys_m.cuh"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

// Decode: 16 rows; a 64-key tile split over 4 warps (2 warps of 32-key tiles at head dim 256, to
// keep three CTAs per SM). Decode32: 32 rows (a chain verify block at group 4) as two row groups of
// the decode CTA, 8 warps (4 at head dim 256) sharing each K/V tile, so the tile is read once; two
// CTAs per SM. Verify: 64 rows (all draft tokens x heads of a group), one 16-row slice per warp.
// Decode32 and verify serve fp8 KV and head dim 256: 16-bit KV at head dims 64 and 128 runs
// prefill.cuh's 64-row warpgroup-MMA CTA on both shapes. 16-bit KV runs two stages; fp8 KV,
// dequantised in registers, runs four stages in the same shared memory (as many bytes in flight).
// Prefill: 128 rows over 8 warps, 64-key tiles (32 at head dim 256). (H200, 64 x 4096 prefix,
// group 4, bf16: the 32-row chain took 0.364 ms as decode32 here, 0.433 ms as 4 warps of 32 keys,
// 0.596 ms on two decode CTAs, 0.317 ms on the warpgroup-MMA CTA; the 64-row tree 0.467 ms on
// mma.sync at best, 0.321 ms on the warpgroup-MMA CTA.) Decode items of at most kKeysMRows rows at
// head dims 64 and 128 run decode_keys_m.cuh's CTA instead (dispatch.h).
template <int D, bool FP8>
using DecodeCfg = std::conditional_t<(D > 128), AttnConfig<D, 2, 16, 32, FP8, FP8 ? 4 : 2>,
                                     AttnConfig<D, 4, 16, 64, FP8, FP8 ? 4 : 2>>;
template <int D, bool FP8>
using Decode32Cfg = std::conditional_t<(D > 128), AttnConfig<D, 4, 32, 32, FP8, FP8 ? 4 : 2>,
                                       AttnConfig<D, 8, 32, 64, FP8, FP8 ? 4 : 2, 2>>;
template <int D, bool FP8>
using VerifyCfg = AttnConfig<D, 4, 64, (D > 128 ? 32 : 64), FP8, FP8 ? 4 : 2>;
template <int D, bool FP8>
using PrefillCfg = AttnConfig<D, 8, 128, (D > 128 ? 32 : 64), FP8>;

static_assert(KeysMConfig<64, false>::kCols == kKeysMRows &&
              KeysMConfig<128, true>::kCols == kKeysMRows);

template <typename T, typename Cfg>
using MmaCta = GridCta<attention_kernel<T, Cfg>, Cfg>;
template <typename T, typename Cfg, bool E5M2>
using KeysMCta = GridCta<decode_keys_m_kernel<T, Cfg, E5M2>, Cfg>;

// The entry points of `cta` (dispatch.h's table) at head dim D for activations T. 16-bit KV
// decode32 and verify tiles at the head dims of the 64-row warpgroup-MMA CTA have no mma.sync
// instance, nor has head dim 256 a keys-on-M one.
template <int D, typename T>
AttnCtaEntry mma_attention_entry_t(AttnCta cta, KvKind kv) {
  const bool fp8 = kv != KvKind::same_as_q;
  switch (cta) {
    case AttnCta::keys_m:
      if constexpr (D <= 128) {
        if (!fp8) return KeysMCta<T, KeysMConfig<D, false>, false>::entry();
        return kv == KvKind::e5m2 ? KeysMCta<T, KeysMConfig<D, true>, true>::entry()
                                  : KeysMCta<T, KeysMConfig<D, true>, false>::entry();
      }
      break;
    case AttnCta::decode:
      return fp8 ? MmaCta<T, DecodeCfg<D, true>>::entry() : MmaCta<T, DecodeCfg<D, false>>::entry();
    case AttnCta::decode32:
      if (fp8) return MmaCta<T, Decode32Cfg<D, true>>::entry();
      if constexpr (!prefill_verify_dim(D)) return MmaCta<T, Decode32Cfg<D, false>>::entry();
      break;
    case AttnCta::verify:
      if (fp8) return MmaCta<T, VerifyCfg<D, true>>::entry();
      if constexpr (!prefill_verify_dim(D)) return MmaCta<T, VerifyCfg<D, false>>::entry();
      break;
    case AttnCta::mma_prefill:
      return fp8 ? MmaCta<T, PrefillCfg<D, true>>::entry()
                 : MmaCta<T, PrefillCfg<D, false>>::entry();
    default:
      break;
  }
  return {};
}

template <int D>
AttnCtaEntry mma_attention_entry(AttnCta cta, bool fp16, KvKind kv) {
  return fp16 ? mma_attention_entry_t<D, __half>(cta, kv)
              : mma_attention_entry_t<D, __nv_bfloat16>(cta, kv);
}

}  // namespace attnrt::cuda
