// Warp-specialised fp8 prefill CTA (sm_90a): the math of the one-warpgroup fp8 CTA
// (prefill_fp8.cuh: q quantised to e4m3 at a power-of-two scale, S = Q K^T and O += P V on e4m3
// wgmma, P offset by 2^8, V transposed in shared memory in fp8_pv_layout.h's key order) in the
// shape of the 16-bit warp-specialised CTA (prefill_ws.cuh; its protocol as functions in
// prefill_ws_pipeline.cuh): a producer warpgroup, two consumer warpgroups of 64 rows each in
// ping-pong, setmaxnreg, persistent CTAs walking the same (work item, KV head) units. It takes the
// same launches as prefill_fp8.cuh (TileShape::prefill items of non-tree steps over an e4m3 pool,
// bf16 / fp16 q and out, head dim 128) with the same key ranges, masks (causal, window, softcap,
// sinks), splits, partials and lse. prefill_fp8_entry chooses it when ATTNRT_PREFILL_FP8_WS=1.
//
// Roles (384 threads, one CTA per SM, 128 keys per tile, 4 stages):
//  - warpgroup 0, the producer (kProducerRegs): per tile waits for the tile's stage, copies the
//    e4m3 K rows into the stage and the V rows into one of two staging tiles, and once the copies
//    of the tile before have landed (one tile behind: its own cp.async group, then the producer's
//    named barrier, since each thread transposes bytes other threads copied; with TMA also the
//    staging tile's barrier) transposes that tile's V from its staging tile into the stage
//    (transpose_v64 on each half of 64 keys), fences (its st.shared are read by wgmma) and
//    arrives on the stage's full barrier. The transpose stays one tile behind across units too:
//    the last tile of a unit is transposed after the next unit's first tile is issued. The unit's
//    16-bit Q rows come after its first tile (prefill_ws.cuh's order), once the consumers' last S
//    of the previous unit completed (q empty); the producer publishes a unit as soon as the
//    consumers took the previous one ("unit taken", prefill_ws_pipeline.cuh), so the next unit's
//    first tiles are in flight while the consumers finish this one.
//    Two producers (the template flag TMA; prefill_fp8_ws.cu takes TMA where prefill_fp8_tma_maps
//    encodes the maps: an e4m3 pool without an SWA slot map, pages of 8 slots or more, 16-byte
//    aligned rows):
//     * cp.async: per tile it resolves the keys' pool rows (one key a thread, a tile ahead) and
//       issues 16-byte cp.async copies of K and V (ws_produce_tiles / ws_copy_tile); the stage's
//       full barrier counts the 128 transposers' arrivals.
//     * TMA (ws_produce_tma_tiles): the pools are byte tensor maps {128, kv heads, slots} with a
//       box of {128, 1, P} (P = min(page, 128) rows, inside one page) and the 128-byte swizzle: 128
//       e4m3 values are one swizzle row, so a box at rows r0 .. r0 + P - 1 (r0 a multiple of 8)
//       writes exactly swz128_offset's layout, which the S MMAs' K descriptors read and
//       transpose_v64 reads from the staging tile (fp8_pv_layout.h's v_stage_offset). Chunk q of
//       a tile is issued by lane q / 4 of producer warp q % 4 (prefill_ws.cuh's spread): its K box
//       into the stage, completing on the stage's full barrier, and its V box into the staging
//       tile, completing on that staging tile's barrier. Thread 0 arrives on both with
//       expect_tx of the tile's TMA bytes, so the full barrier counts 129 arrivals (the 128
//       transposers' and thread 0's) and its K bytes, the staging barrier one arrival and its V
//       bytes; the transposers wait on the staging barrier (its phase: the tile's index over the
//       CTA / 2) after their cp.async wait. Rows of a partial page at hi and rows past hi come by
//       cp.async (zeros past hi: pages past hi may not exist), as in prefill_ws.cuh. Before each
//       tile's copies the producer meets on its named barrier: every thread has finished the
//       transpose of the tile two back, whose staging tile the copies overwrite (and waited for
//       that staging barrier's phase before its next one completes). A unit's key range starts
//       on a tile (ws_unit's TILED), as prefill_ws.cuh's TMA producer needs.
//       With QTMA, Q too comes by TMA (ws_load_q_tma: q's 16-bit map, thread 0's arrive.expect_tx
//       the only arrival on q full); rows past the request then hold other tokens, so the
//       consumers choose the q scale from the request's rows only.
//  - warpgroups 1 and 2, the consumers (kConsumerRegs): consumer c owns rows 64c .. 64c + 63.
//    On a new unit it waits for Q, quantises its own 64 rows to e4m3 in place (below), then walks
//    the tiles in ping-pong (ws_consume_tiles): S = Q K^T (m64n128k32 x 4), the mask / softcap /
//    online softmax of prefill_tile.cuh with P' = 2^8 P, P' packed to e4m3 as the register A
//    operand, O += P V (m64n128k32 x 4) against the transposed V of the stage.
//
// Why the producer transposes V. The transpose costs about 1 000 warp instructions a tile
// (16 KiB: 32-bit loads, byte permutes, 32-bit stores, their addresses), a quarter of an SMSP's
// issue slots over the ~1 000 cycles the tile's MMAs take at the fp8 peak. Every warp of the CTA
// shares the four SMSPs, so whoever runs it takes the same slots; what matters is the consumers'
// dependency chain. In a consumer the transpose would sit between S and P V of every tile (its
// result is P V's operand) and would need both consumers to meet on every tile (each reads the
// whole tile's V, each would write half); in the one-warpgroup CTA it hides under the S MMAs only
// because that CTA has no other warp to give it to. In the producer it runs while the consumers
// compute on tiles already full (the ring holds 3 ready tiles ahead), with no barrier between the
// consumers, and fills the issue slots their wgmma waits leave idle. It costs the producer 16
// registers (56 instead of the 16-bit CTA's 40; the consumers keep 224, without spills; the TMA
// producer fits the same 56).
//
// Q. The producer cannot hold 128 rows of q in 56 registers to find their maximum before
// converting, so it copies the 16-bit rows as prefill_ws.cuh does, and each consumer quantises its
// own 64 rows: reads its rows (8 x 16 bytes a thread, fp8_pv_layout.h's q_convert_chunk of the
// consumers' thread index), reduces the |max| of the request's rows among them over the warpgroup
// (consumer named barrier), writes the e4m3 bytes in place (rows r of the 128-byte-row e4m3 tile
// lie at r * 128, inside the bytes the consumer's own 16-bit rows held: [64c, 64c + 64) x 128 of
// column block 0; the two consumers never touch each other's bytes), fences and syncs again. The
// scale is per 64 rows instead of per 128 (at least as accurate; the consumers need not meet). The
// Q buffer is the 16-bit tile's 32 KiB; the producer overwrites it for the next unit only after
// both consumers' last S (q empty), as prefill_ws.cuh.
//
// Shared memory (~194 KiB): Q 32 KiB, 4 stages of K 16 KiB + transposed V 16 KiB, 2 staging V
// tiles of 16 KiB, the slots, the barriers (the pipeline's, then the two staging tiles').
// Named barriers: prefill_ws_pipeline.cuh's.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/paged_kv.cuh"
#include "backends/cuda/kernels/prefill.h"
#include "backends/cuda/kernels/prefill_fp8_tile.cuh"
#include "backends/cuda/kernels/prefill_q_scale.cuh"
#include "backends/cuda/kernels/prefill_tile.cuh"
#include "backends/cuda/kernels/prefill_ws_pipeline.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

struct PrefillFp8WsConfig {
  static constexpr int kHeadDim = kFp8HeadDim;
  static constexpr int kBN = 128;
  static constexpr int kStages = 4;
  static constexpr int kRows = kPrefillTileRows;
  static constexpr int kConsumers = kRows / 64;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // ptxas -v: no spills at 56 / 224; at 40 / 232 the producer spills (its transpose addresses
  // and the unit's fields), at 72 / 216 the consumers.
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static constexpr int kChunks = kHeadDim / 16;         // 16-byte chunks of an e4m3 row
  static constexpr int kQBytes = kRows * kHeadDim * 2;  // the 16-bit Q the producer copies
  static constexpr int kTileBytes = kBN * kHeadDim;     // K, a staged V, a transposed V
  static constexpr int kStageBytes = 2 * kTileBytes;    // K, then the transposed V
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kStagingBytes = 2 * kTileBytes;
  static constexpr int kSlotBytes = kBN * 4;
  static constexpr int kBarOffset = kQBytes + kRingBytes + kStagingBytes + kSlotBytes;
  // The pipeline's barriers and slots, then the two staging tiles' barriers (the TMA producer).
  static constexpr int kSmemBytes = 1024 + kBarOffset + WsPipe<kStages>::kBytes + 16;
  static_assert(kConsumers == 2 && kBN % 64 == 0 && kTileBytes == kBN / 64 * kFp8VtBytes);
  // ws_consume_tiles releases a stage one tile late in ping-pong and the producer marks a tile
  // full one tile late: a stage must come free while the producer waits with two tiles unmarked.
  static_assert(kStages >= 3);
  static_assert(kSmemBytes <= 227 * 1024, "the ring must fit one SM's shared memory");
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= kLaunchRegs * kThreads,
                "setmaxnreg.inc would wait forever");
};

// The consumers' thread ct (0 .. 255) quantises its share of its consumer's 64 rows of the unit's
// Q to e4m3 in place (prefill_q_scale.cuh's scale_q_rows; the e4m3 rows at q8_offset, inside the
// bytes of the consumer's own 16-bit rows, see the header comment), at a scale chosen from the
// tile's rows below valid_rows; red: a float per warp of each consumer. Returns the scale's
// inverse.
template <typename T>
__device__ __forceinline__ float quantise_q_rows(unsigned char* sq, int ct, float (&red)[2][4],
                                                 int valid_rows) {
  return scale_q_rows<T, PrefillFp8WsConfig::kRows, PrefillFp8WsConfig::kHeadDim, true>(
      sq, ct, red, kE4m3Max, 100,
      [&](const uint4& v, QChunk q, float qs) {
        *reinterpret_cast<uint2*>(sq + q8_offset(q.r, q.c)) = quantise8_e4m3<T>(v, qs);
      },
      valid_rows);
}

// TMA: the TMA producer over maps.k / maps.v (prefill_fp8_tma_maps); QTMA (with TMA): Q by TMA
// too, through maps.q, where maps.q_tma. Else the cp.async producer (maps unused).
template <typename T, bool TMA, bool QTMA = false>
__global__ void __launch_bounds__(PrefillFp8WsConfig::kThreads, 1)
    prefill_fp8_ws_kernel(const AttnParams p, int num_units,
                          const __grid_constant__ WsTensorMaps maps) {
  static_assert(TMA || !QTMA);
  using Cfg = PrefillFp8WsConfig;
  constexpr int D = Cfg::kHeadDim, BN = Cfg::kBN, ST = Cfg::kStages, ROWS = Cfg::kRows;
  constexpr int CH = Cfg::kChunks;
  extern __shared__ unsigned char smem_raw[];
  __shared__ float red[Cfg::kConsumers][4];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
  unsigned char* smem = smem_raw + pad;
  const uint32_t sQ = raw + pad;
  const uint32_t sRing = sQ + Cfg::kQBytes;
  const uint32_t sStaging = sRing + Cfg::kRingBytes;
  unsigned char* ring = smem + Cfg::kQBytes;
  unsigned char* staging = ring + Cfg::kRingBytes;
  int32_t* sSlot = reinterpret_cast<int32_t*>(staging + Cfg::kStagingBytes);
  WsPipe<ST> w(sQ + Cfg::kBarOffset, smem + Cfg::kBarOffset);
  // The staging tile of the CTA's tile g (its index over all units), and with TMA its barrier.
  auto staged_bar = [&](int g) { return sQ + Cfg::kBarOffset + WsPipe<ST>::kBytes + 8 * (g & 1); };

  const int tid = threadIdx.x, wg = tid >> 7;
  if (TMA && tid == 0) {
    mbar_init(staged_bar(0), 1);
    mbar_init(staged_bar(1), 1);
  }
  // A stage is full after the 128 transposers' arrivals (and with TMA thread 0's arrive.expect_tx
  // of its K bytes); Q after thread 0's arrive.expect_tx with Q by TMA, else 128 cp.async arrivals.
  w.init(tid, TMA ? 129 : 128, QTMA ? 1 : 128, Cfg::kConsumers);

  // A plain launch, as prefill_ws.cuh's.
  grid_dependency_wait();
  launch_dependent_grids();
  if (wg == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if constexpr (TMA) {
      if (tid == 0) {
        prefetch_tensor_map(&maps.k);
        prefetch_tensor_map(&maps.v);
        if constexpr (QTMA) prefetch_tensor_map(&maps.q);
      }
    }
    // Tile g's copies have landed (this thread's by the caller's cp.async wait, every thread's
    // after the barrier; with TMA its V boxes on the staging barrier): its V transposed into the
    // stage, the stage full.
    auto finish = [&](int g) {
      named_bar_sync(kWsProducerBar, 128);
      if constexpr (TMA) mbar_wait(staged_bar(g), static_cast<uint32_t>(g >> 1) & 1u);
      const unsigned char* sv = staging + (g & 1) * Cfg::kTileBytes;
      unsigned char* vt = ring + (g % ST) * Cfg::kStageBytes + Cfg::kTileBytes;
      // The thread index read afresh: the transpose's 64 addresses derive from it, and ptxas
      // would otherwise hoist them all out of the unit loop (spilling at kProducerRegs).
      const int ttid = fresh_thread_index();
#pragma unroll
      for (int h = 0; h < BN / 64; ++h)
        transpose_v64(sv + h * 64 * kFp8HeadDim, vt + h * kFp8VtBytes, ttid);
      fence_proxy_async_smem();
      mbar_arrive(w.full(g % ST));
    };
    // The transpose runs one tile behind the copies, across units too: `pending` is the tile
    // whose copies were issued last and whose V is not transposed yet (-1: none). Once tile g's
    // copies are issued (g = -1: none), pending is finished and g takes its place.
    int pending = -1;
    auto finish_pending = [&](int g) {
      if (pending >= 0) {
        if (g >= 0)
          cp_async_wait<1>();
        else
          cp_async_wait<0>();
        finish(pending);
      }
      pending = g;
    };
    for (int n = 0;; ++n) {
      const int unit = ws_publish_unit(w, n, tid, Cfg::kThreads);
      if (unit >= num_units) break;
      const WsUnit u = ws_unit<ROWS, BN, TMA>(p, unit);
      // ================= producer =================
      write_back_committed_pages(p, u.req, u.item, u.kvh, tid, 128);
      // Q by TMA: thread 0 keeps its box in the (unused) slot words, not in registers across the
      // tile loop (they spilled at kProducerRegs).
      WsQBox* q_box = reinterpret_cast<WsQBox*>(sSlot);
      if (QTMA && tid == 0) *q_box = ws_q_box(u, p.group);
      // Q of this unit, after its first K / V tile (and the last tile of the previous unit
      // finished: the consumers' last S of that unit may wait for it), once the consumers are done
      // reading Q of the previous unit; then the CTA's next unit (ws_take_ticket: its ticket
      // straight into the next slot, not in a register across the tile loop).
      auto load_q = [&] {
        if constexpr (QTMA) {
          if (tid == 0) {
            if (n > 0) mbar_wait(w.q_empty(), (n - 1) & 1);
            ws_load_q_tma<D, ROWS>(&maps.q, *q_box, sQ, w.q_full());
          }
        } else {
          if (n > 0) mbar_wait(w.q_empty(), (n - 1) & 1);
          ws_load_q<T, D, ROWS>(p, u, smem, w.q_full(), tid);
        }
        ws_take_ticket(p, w, n, tid);
      };
      // The unit's K / V head in the pools (bytes), formed where used: the TMA producer needs them
      // on a unit's last tile only.
      auto kbase = [&] { return static_cast<const uint8_t*>(p.k) + u.kvh * D; };
      auto vbase = [&] { return static_cast<const uint8_t*>(p.v) + u.kvh * D; };
      if constexpr (TMA) {
        ws_produce_tma_tiles<BN>(
            p, w, u, tid,
            [&](int it, int stage, int32_t slot, int row0, int tma_rows, int64_t tail_slot) {
              const int g = w.tile_base + it;
              const uint32_t dk = sRing + stage * Cfg::kStageBytes;
              const uint32_t dv = sStaging + (g & 1) * Cfg::kTileBytes;
              // Thread 0's arrivals hold both phases open while other warps' boxes land.
              if (tid == 0) {
                mbar_arrive_expect_tx(w.full(stage), tma_rows * D);
                mbar_arrive_expect_tx(staged_bar(g), tma_rows * D);
              }
              if (slot >= 0) {
                tma_load_3d(dk + row0 * D, &maps.k, 0, u.kvh, slot, w.full(stage));
                tma_load_3d(dv + row0 * D, &maps.v, 0, u.kvh, slot, staged_bar(g));
              }
              if (tma_rows < BN)
                ws_copy_tail<BN, CH>(p, u.lo + it * BN, u.hi, tma_rows, tail_slot, kbase(), vbase(),
                                     ring + stage * Cfg::kStageBytes,
                                     staging + (g & 1) * Cfg::kTileBytes, tid);
              cp_async_commit();
              finish_pending(g);
              if (it == 0) load_q();
            });
      } else {
        ws_produce_tiles<BN>(p, w, u, sSlot, tid, [&](int it, int stage) {
          const int g = w.tile_base + it;
          ws_copy_tile<BN, CH>(p, sSlot, kbase(), vbase(), ring + stage * Cfg::kStageBytes,
                               staging + (g & 1) * Cfg::kTileBytes, tid);
          cp_async_commit();
          finish_pending(g);
          if (it == 0) load_q();
        });
      }
      if (u.num_tiles == 0) {
        finish_pending(-1);
        load_q();
      }
      w.tile_base += u.num_tiles;
    }
    finish_pending(-1);
    ws_producer_exit(p, tid);
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int ct = tid - 128, cw = ct >> 7, lane = ct & 31, wq = (ct >> 5) & 3;
    const int g = lane >> 2, c4 = lane & 3;
    ws_turns_begin(cw);
    for (int n = 0;; ++n) {
      const int unit = ws_read_unit(w, n);
      if (unit >= num_units) break;
      ws_unit_taken(Cfg::kThreads);
      const WsUnit u = ws_unit<ROWS, BN, TMA>(p, unit);
      // ================= consumers =================
      const int G = p.group;
      const Mask<false> mask{p, u.req};
      const int wg_row0 = u.item.f0 + cw * 64;
      const int first_row = wg_row0 + wq * 16;
      const PrefillRows<1, false> rows(mask, first_row, g, G, u.req.qlen);
      const bool wg_idle = wg_row0 / G >= u.req.qlen;
      const int gt_lo = min(wg_row0 / G, u.req.qlen - 1);
      const int gt_hi = min((wg_row0 + 63) / G, u.req.qlen - 1);
      const WsRun run = ws_tile_run(u.num_tiles, [&](int it) {
        return wg_idle || mask.hides(u.lo + it * BN, BN, gt_lo, gt_hi);
      });

      mbar_wait(w.q_full(), n & 1);
      // Only the request's rows choose the scale (Q by TMA holds other tokens past them).
      const float inv_qs = quantise_q_rows<T>(smem, ct, red, u.req.qlen * G - u.item.f0);
      // Logits of the fp8 product are qs times the true ones: the scales take 1 / qs.
      const SoftCap cap(p.softcap, p.softmax_scale * inv_qs);
      const float sl = cap.exp_scale(p.scale_log2 * inv_qs);

      float o[1][1][D / 2];
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o[0][0][i] = 0.f;
      float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.f, 0.f}};

      const uint32_t sQb = sQ + cw * 64 * kFp8HeadDim;
      // The tiles' addresses through a warp shuffle from lane 0, so that ptxas builds the MMA
      // descriptors in uniform registers (prefill_ws.cuh's issue_s says why).
      auto issue_s = [&](float(&s)[1][BN / 2], int stage) {
        const uint32_t tq = __shfl_sync(0xffffffffu, sQb, 0);
        const uint32_t tk = __shfl_sync(0xffffffffu, sRing + stage * Cfg::kStageBytes, 0);
        wgmma_fence();
        mma_s_e4m3<BN>(s[0], tq, tk);
        wgmma_commit();
      };
      auto issue_pv = [&](const uint32_t(&pa)[BN / 32][4], int stage) {
        const uint32_t tv =
            __shfl_sync(0xffffffffu, sRing + stage * Cfg::kStageBytes + Cfg::kTileBytes, 0);
        wgmma_fence();
        mma_pv_e4m3<BN>(o[0][0], pa, tv);
        wgmma_commit();
      };
      auto softmax = [&](float(&s)[1][BN / 2], int it, float(&alpha)[1][2]) -> bool {
        cap_and_mask<1, BN>(s, cap, mask, rows, u.lo + it * BN, u.hi, c4);
        return __any_sync(0xffffffff, online_softmax<1, BN, kFp8POffset>(s, m, l, alpha, sl));
      };
      auto rescale = [&](const float(&alpha)[1][2]) { rescale_o<1, 1, D>(o, alpha, true); };
      auto pack = [&](const float(&s)[1][BN / 2], uint32_t(&pa)[BN / 32][4]) {
        pack_p_e4m3<BN>(s[0], pa);
      };
      ws_consume_tiles<float[1][BN / 2], uint32_t[BN / 32][4], float[1][2]>(
          w, u.num_tiles, run, cw, lane, issue_s, issue_pv, softmax, rescale, pack);

      // ---- Epilogue: the stored maximum is that of P (m - 8), so that lse and the merge see P.
      store_prefill_rows<T, D, D, kFp8POffset>(p, u.req, u.item, u.kvh, first_row, g, c4, rows, l,
                                               m, o);
      w.tile_base += u.num_tiles;
    }
    ws_turns_end(cw);
  }
}

}  // namespace attnrt::cuda
