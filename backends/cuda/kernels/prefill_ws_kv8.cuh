// The producer of the warp-specialised prefill CTA over fp8 pages (prefill_ws.cuh instantiated with
// PrefillWsKv8Config; its header comment has the design): the e4m3 / e5m2 K and V rows of each tile
// copied into a staging tile, then converted to f16 (exactly: every e4m3 and e5m2 value is an f16
// value) into the ring stage, in the layout the 16-bit consumers read.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/fp8_pv_layout.h"
#include "backends/cuda/kernels/prefill_ws_pipeline.cuh"
#include "backends/cuda/kernels/prefill_ws_sync.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

// One staged fp8 tile of BN rows at head dim D (as ws_copy_tile<BN, D / 16> lands it: 16-byte
// chunk c of row key at swz128_offset(BN, key, c)) to f16 in the 16-bit tile at dst (D / 64 column
// blocks of BN 128-byte rows: chunk 2c and 2c + 1 of row key at swz128_offset), by the 128
// producer threads (fp8_pv_layout.h's kv8_chunk: no bank conflict on either side).
template <int BN, int D, bool E5M2>
__device__ __forceinline__ void kv8_convert_tile(const unsigned char* src, unsigned char* dst,
                                                 int tid) {
  constexpr int CH8 = D / 16;
  static_assert(BN * CH8 % 128 == 0);
#pragma unroll
  for (int n = 0; n < BN * CH8 / 128; ++n) {
    const Kv8Chunk k = kv8_chunk<CH8>(tid, n);
    const uint4 in = *reinterpret_cast<const uint4*>(src + swz128_offset(BN, k.key, k.c));
    uint4 lo, hi;
    fp8x4_to_f16<E5M2>(in.x, lo.x, lo.y);
    fp8x4_to_f16<E5M2>(in.y, lo.z, lo.w);
    fp8x4_to_f16<E5M2>(in.z, hi.x, hi.y);
    fp8x4_to_f16<E5M2>(in.w, hi.z, hi.w);
    *reinterpret_cast<uint4*>(dst + swz128_offset(BN, k.key, 2 * k.c)) = lo;
    *reinterpret_cast<uint4*>(dst + swz128_offset(BN, k.key, 2 * k.c + 1)) = hi;
  }
}

// The producer's tiles of unit u at head dim D (thread tid of 128). Per tile, in
// ws_produce_tiles' walk (the page lookups one tile ahead, no stage wait there): the cp.async
// copies of its fp8 K and V rows (zeros past hi) into staging tile (tile_base + it) % NS, one
// cp.async group. NS - 1 tiles later, once they landed (this thread's by cp.async.wait_group, every
// thread's after the producer's named barrier), `finish`: the wait for the tile's ring stage, its K
// and V converted to f16 into the stage (ring + stage * STAGE_BYTES: K, then V at BN * 2D bytes),
// the fence (the consumers' MMAs read the stage through the async proxy) and every thread's arrival
// on the stage's full barrier (128 arrivals). The tiles still staged at the unit's end are finished
// in order. A staging tile is rewritten only after the named barriers that start the tile walk's
// next step, which every thread reaches after its conversions of the tile that held it (with one
// staging tile, NS = 1, each tile's copies wait for the previous tile's conversion).
template <int BN, int D, int ST, int NS, int STAGE_BYTES>
__device__ __forceinline__ void ws_produce_kv8_tiles(const AttnParams& p, const WsPipe<ST>& w,
                                                     const WsUnit& u, unsigned char* ring,
                                                     unsigned char* staging, int32_t* sSlot,
                                                     int tid) {
  constexpr int kTile8 = kv8_staged_tile_bytes(BN, D);  // one staged fp8 K or V tile
  constexpr int kTile16 = BN * D * 2;                   // its f16 tile in the stage
  static_assert(NS >= 1 && STAGE_BYTES == 2 * kTile16);
  const uint8_t* kbase = static_cast<const uint8_t*>(p.k) + u.kvh * D;
  const uint8_t* vbase = static_cast<const uint8_t*>(p.v) + u.kvh * D;
  const bool e5m2 = p.kv_kind == KvKind::e5m2;
  auto staged = [&](int it) { return staging + (w.tile_base + it) % NS * 2 * kTile8; };
  auto finish = [&](int it) {
    named_bar_sync(kWsProducerBar, 128);
    const int stage = w.stage(it);
    if (w.tile_base + it >= ST) mbar_wait(w.empty(stage), w.parity(it) ^ 1u);
    const unsigned char* src = staged(it);
    unsigned char* dst = ring + stage * STAGE_BYTES;
    // The thread index read afresh: the conversion's addresses derive from it, and ptxas would
    // otherwise hoist them all out of the unit loop (spilling at the producer's registers).
    const int ttid = fresh_thread_index();
    if (e5m2) {
      kv8_convert_tile<BN, D, true>(src, dst, ttid);
      kv8_convert_tile<BN, D, true>(src + kTile8, dst + kTile16, ttid);
    } else {
      kv8_convert_tile<BN, D, false>(src, dst, ttid);
      kv8_convert_tile<BN, D, false>(src + kTile8, dst + kTile16, ttid);
    }
    fence_proxy_async_smem();
    mbar_arrive(w.full(stage));
  };
  ws_produce_tiles<BN, ST, false>(p, w, u, sSlot, tid, [&](int it, int) {
    unsigned char* dk = staged(it);
    ws_copy_tile<BN, D / 16>(p, sSlot, kbase, vbase, dk, dk + kTile8, tid);
    cp_async_commit();
    if (it >= NS - 1) {
      cp_async_wait<NS - 1>();
      finish(it - (NS - 1));
    }
  });
  if constexpr (NS >= 2) {
    for (int it = max(0, u.num_tiles - (NS - 1)); it < u.num_tiles; ++it) {
      cp_async_wait_upto<NS - 2>(u.num_tiles - 1 - it);  // the groups of the tiles after it
      finish(it);
    }
  }
}

}  // namespace attnrt::cuda
