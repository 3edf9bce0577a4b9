// Instantiation of the attention kernel for one head dim (included by attention_d{64,128,256}.cu
// so that the three head dims compile in parallel).
#pragma once

#include "backends/cuda/kernels/attention.cuh"
#include "backends/cuda/kernels/decode_keys_m.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/prefill.h"

namespace attnrt::cuda {

template <typename T, typename Cfg>
cudaError_t launch_cfg(const AttnParams& p, int num_items, cudaStream_t stream, bool dependent) {
  const cudaError_t attr = allow_dynamic_smem<attention_kernel<T, Cfg>>(Cfg::kSmemBytes);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(p.num_kv_heads, num_items);
  return launch_kernel(attention_kernel<T, Cfg>, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream,
                       dependent, p);
}

template <typename T, typename Cfg>
int occupancy_cfg() {
  return resident_ctas<attention_kernel<T, Cfg>>(Cfg::kThreads, Cfg::kSmemBytes);
}

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
// mma.sync at best, 0.321 ms on the warpgroup-MMA CTA.)
// Decode work items of at most 8 rows (a decode token at groups up to 8) at head dims 64 and 128
// run decode_keys_m.cuh's CTA instead, with the keys on the MMA's M side (16-bit and fp8 KV; H200,
// 64 x 4096 at group 4, per step: bf16 277 -> 266 us, fp8 e4m3 280 -> 181 us).
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

template <int D, typename T>
cudaError_t launch_dim_t(const AttnParams& p, bool fp8_kv, TileShape shape, int num_items,
                         cudaStream_t stream, bool dependent) {
  if (shape == TileShape::decode32 || shape == TileShape::verify) {
    const bool d32 = shape == TileShape::decode32;
    if (fp8_kv) {
      return d32 ? launch_cfg<T, Decode32Cfg<D, true>>(p, num_items, stream, dependent)
                 : launch_cfg<T, VerifyCfg<D, true>>(p, num_items, stream, dependent);
    }
    if constexpr (prefill_verify_dim(D)) {
      return cudaErrorInvalidValue;  // launch_prefill_verify
    } else {
      return d32 ? launch_cfg<T, Decode32Cfg<D, false>>(p, num_items, stream, dependent)
                 : launch_cfg<T, VerifyCfg<D, false>>(p, num_items, stream, dependent);
    }
  }
  if (shape == TileShape::decode) {
    if constexpr (D <= 128) {
      if (p.item_rows <= KeysMConfig<D, false>::kCols) {
        if (!fp8_kv)
          return launch_keys_m_cfg<T, KeysMConfig<D, false>>(p, num_items, stream, dependent);
        using Fp8Cfg = KeysMConfig<D, true>;
        return p.kv_kind == KvKind::e5m2
                   ? launch_keys_m_cfg<T, Fp8Cfg, true>(p, num_items, stream, dependent)
                   : launch_keys_m_cfg<T, Fp8Cfg, false>(p, num_items, stream, dependent);
      }
    }
    return fp8_kv ? launch_cfg<T, DecodeCfg<D, true>>(p, num_items, stream, dependent)
                  : launch_cfg<T, DecodeCfg<D, false>>(p, num_items, stream, dependent);
  }
  return fp8_kv ? launch_cfg<T, PrefillCfg<D, true>>(p, num_items, stream, dependent)
                : launch_cfg<T, PrefillCfg<D, false>>(p, num_items, stream, dependent);
}

template <int D, typename T>
int occupancy_dim_t(bool fp8_kv, TileShape shape, int group) {
  if (shape == TileShape::decode32 || shape == TileShape::verify) {
    const bool d32 = shape == TileShape::decode32;
    if (fp8_kv)
      return d32 ? occupancy_cfg<T, Decode32Cfg<D, true>>()
                 : occupancy_cfg<T, VerifyCfg<D, true>>();
    if constexpr (prefill_verify_dim(D)) {
      return 1;  // prefill_verify_occupancy
    } else {
      return d32 ? occupancy_cfg<T, Decode32Cfg<D, false>>()
                 : occupancy_cfg<T, VerifyCfg<D, false>>();
    }
  }
  if (shape == TileShape::decode) {
    // A decode token's item holds `group` rows: the keys-on-M CTA takes it up to kCols.
    if constexpr (D <= 128) {
      if (group <= KeysMConfig<D, false>::kCols) {
        return fp8_kv ? occupancy_keys_m_cfg<T, KeysMConfig<D, true>>()
                      : occupancy_keys_m_cfg<T, KeysMConfig<D, false>>();
      }
    }
    return fp8_kv ? occupancy_cfg<T, DecodeCfg<D, true>>() : occupancy_cfg<T, DecodeCfg<D, false>>();
  }
  return fp8_kv ? occupancy_cfg<T, PrefillCfg<D, true>>() : occupancy_cfg<T, PrefillCfg<D, false>>();
}

template <int D>
int occupancy_dim(bool fp16, bool fp8_kv, TileShape shape, int group) {
  return fp16 ? occupancy_dim_t<D, __half>(fp8_kv, shape, group)
              : occupancy_dim_t<D, __nv_bfloat16>(fp8_kv, shape, group);
}

template <int D>
cudaError_t launch_dim(const AttnParams& p, bool fp16, bool fp8_kv, TileShape shape, int num_items,
                       cudaStream_t stream, bool dependent) {
  return fp16 ? launch_dim_t<D, __half>(p, fp8_kv, shape, num_items, stream, dependent)
              : launch_dim_t<D, __nv_bfloat16>(p, fp8_kv, shape, num_items, stream, dependent);
}

}  // namespace attnrt::cuda
