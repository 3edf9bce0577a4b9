// Warp-specialised variant of the 128-row prefill CTA (prefill.cuh), sm_90a, and the default for
// every 128-row prefill launch (prefill.cu; ATTNRT_PREFILL_WS=0 takes prefill_kernel): a producer
// warpgroup issues every copy (TMA tensor-map copies of whole pages where they apply, else
// cp.async), two consumer warpgroups only compute; persistent CTAs walk the step's units. It
// serves exactly the launches of prefill_kernel (TileShape::prefill work items, 16-bit K/V, head
// dims 64 / 128 / 256) with the same work list, key ranges, masks, softcap, sinks, splits,
// partials and lse as prefill_kernel; instantiated over fp8 pages (below), the same launches over
// e4m3 / e5m2 pools at head dim 128.
//
// Roles (384 threads, one CTA per SM):
//  - warpgroup 0, the producer (setmaxnreg down to kProducerRegs): for every tile of a unit's
//    key range (and Q after the first tile; see the unit walk in the kernel) resolves the tile's
//    pool slots (one key per thread, through the paged_kv.cuh page-table helpers, the next tile's
//    lookups in flight while the current tile's copies are issued), waits until the tile's ring
//    stage is free ("empty" mbarrier) and issues 16-byte cp.async copies of K and V into the stage
//    in the 128-byte swizzled layout of wgmma.cuh; each thread's copies arrive on the stage's
//    "full" mbarrier when they land (cp.async.mbarrier.arrive.noinc: 128 arrivals complete the
//    phase).
//    With the TMA producer (template flag TMA, see below) the whole pages of a tile come in by
//    cp.async.bulk.tensor instead, a handful of copies per tile in place of 2 x BN x D / 8.
//  - warpgroups 1 and 2, the consumers (setmaxnreg up to kConsumerRegs): consumer c owns rows
//    64c .. 64c + 63 of the tile (one m64 block), waits for each stage to be full, runs S = Q K^T,
//    the mask / softcap / online softmax and O += P V exactly as prefill_kernel does for one m64
//    block, then one lane per warp arrives on the stage's "empty" mbarrier (8 arrivals).
// Every consumer waits on every tile of the range, even one its own rows cannot see (it then
// skips the MMAs): each consumer thus observes every phase of every full barrier in order, and a
// stage is only rewritten after both consumers have seen its copies land, so the parity waits
// are never ambiguous and no copy races an older copy to the same stage.
// The copies are generic-proxy writes and the MMAs read through the async proxy: a consumer
// fences (fence.proxy.async) after its wait, before its MMAs (TMA boxes are async-proxy writes
// already; the TMA producer's cp.async rows still need the fence).
// Two consumer schedules (Cfg::kPingPong; ATTNRT_PREFILL_WS=1 / 2):
//  - free-running: each consumer issues S, waits, runs the softmax, issues P V, waits; the two
//    drift apart on the shared ring, so one's softmax overlaps the other's MMAs as the two CTAs
//    per SM of prefill_kernel do, while the loads leave the consumers' path.
//  - ping-pong: the consumers take strict turns to issue their MMAs (named barriers), and a
//    consumer issues tile i's S together with tile i - 1's P V, then runs tile i's softmax while
//    the other consumer's MMAs run; a stage is then released one tile later (its V is read in the
//    next tile's turn).
//
// The TMA producer (TMA = true; prefill_ws.cu takes it where prefill_tma_applies: 16-bit KV
// without an SWA slot map, pages of 8 slots or more, 16-byte aligned pool and rows): the K and V
// pools are 3-D tensor maps {D, kv heads, slots} with a box of {64, 1, P} (P = min(page size, BN)
// rows, always inside one page) and the 128-byte swizzle, which writes exactly the layout of
// swz128_offset when a box lands at column block cb, rows r0 .. r0 + P - 1 of a tile (r0 a multiple
// of 8). Per tile, chunk q < BN / P (rows qP .. qP + P - 1) belongs to lane q / 4 of producer warp
// q % 4, which resolves its page one tile ahead (as the slots are) and issues its D / 64 boxes of
// K and of V: the four warps issue side by side (one warp took 8 rounds a tile at 16-slot pages,
// the boxes' coordinates differing by lane; 1.03-1.12x on the prefill rows). Only chunks
// wholly below hi are loaded so: the rows of a partial last page and every row past it are loaded
// (or zero-filled) by all 128 producer threads with cp.async, since keys past hi must be zero in
// shared memory (a zero probability times a NaN is NaN) and pages wholly past hi may not exist.
// The full barrier then counts 129 arrivals per phase: the 128 cp.async arrivals (with no copies
// on most tiles) and thread 0's arrive.expect_tx of the tile's TMA bytes. A unit's key range must
// start on a page: ws_unit rounds a window's first key down to a tile (the extra keys are outside
// the window, the first tile is masked as any window tile), so splits stay tile aligned too.
// Q by TMA too (QTMA; where the group is a power of two and q's map can be encoded: prefill_ws.cu's
// ws_tensor_maps): q as a tensor map {D, q heads, tokens} with a box of {64, G, ROWS / G}, so a
// unit's Q tile is D / 64 boxes issued by producer thread 0 (after its wait for q empty), its
// arrive.expect_tx the only arrival on q full; the cp.async copy it replaces was 16 copies and
// ~750 instructions a producer warp, and the consumers waited for it at most unit starts of the
// short causal rows. Rows of a tile past its request hold the next request's tokens (zeros past
// the tensor) instead of zeros: rows are independent and never stored, so nothing changes.
//
// Over fp8 pages (PrefillWsKv8Config; prefill_kv8_ws*.cu, dispatch.h's AttnCta::prefill_kv8): the
// TileShape::prefill items of non-tree steps over an e4m3 or e5m2 pool at head dims 64, 128 and
// 256, bf16 or fp16 q / out, computed at 16-bit precision. Every e4m3 and e5m2 value is an f16
// value, so the MMAs run in f16 (fp32 accumulators) whatever q's type, with nothing rounded that
// the mma.sync CTA before it kept:
//  - the producer (prefill_ws_kv8.cuh) copies each tile's fp8 K and V rows with cp.async into a
//    staging tile, and NS - 1 tiles later (each tile its own cp.async group, then the producer's
//    named barrier) waits for the tile's ring stage, converts the staged bytes to f16 into it
//    (cvt.rn.f16x2.e4m3x2 per pair; e5m2 is the high byte of an f16) in the 128-byte swizzled
//    layout above, fences and arrives on the stage's full barrier. V needs no transpose (the P V
//    MMA reads it MN-major) and keys past hi are zero-filled in staging, hence zero in the stage.
//    The stage wait comes only at the conversion, so copies run NS - 1 tiles ahead of it.
//  - the consumers are this kernel's (in ping-pong at head dims 64 and 128, free-running at 256,
//    as the 16-bit CTA's by default), with the MMA element type f16 (MT) while q, the output and
//    the partials keep their own types; P is packed to f16. fp16 q is used as it is. bf16 q is
//    converted in place: each consumer, after the Q barrier, scales its own 64 rows by a power of
//    two qs that brings their |max| into (2^13, 2^14] and rounds them to f16
//    (prefill_q_scale.cuh; exact for every element down to 2^-30 of the largest), and the logit
//    scales (scale_log2, the softcap's) take 1 / qs. The k scale is in those scales and the v
//    scale in the epilogue, as for 16-bit KV.
// Shared memory at head dim 128, BN = 64, 4 stages, 4 staging tiles: Q 32 KiB, stages 4 x 32 KiB
// (f16 K and V), the slots and barriers, staging 4 x 16 KiB (fp8 K and V): 225 KiB. Why 64-key
// tiles: at 128 keys an f16 stage is 64 KiB and, next to Q, two stages and the staging leave no
// room for a third; with two, the stage of tile i + 1 comes free only when the second consumer's
// MMAs of tile i - 1 are done (a stage is released a tile late in ping-pong), about when the first
// consumer wants tile i + 1, so the conversion would sit on the consumers' path every tile. At 64
// keys the ring holds two converted tiles ahead of the two the consumers hold, and the staging
// three tiles of copies in flight behind the one being converted. The other head dims:
// PrefillWsKv8Cfg.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/paged_kv.cuh"
#include "backends/cuda/kernels/prefill.h"
#include "backends/cuda/kernels/prefill_q_scale.cuh"
#include "backends/cuda/kernels/prefill_store.cuh"
#include "backends/cuda/kernels/prefill_ws_kv8.cuh"
#include "backends/cuda/kernels/prefill_ws_pipeline.cuh"
#include "backends/cuda/kernels/prefill_ws_sync.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

// D: head dim of Q and K; DV: head dim of V and the output (D for every layer but MLA's MHA form,
// 192 / 128); BN: keys per tile; STAGES: K/V tiles resident; PP: the consumers' ping-pong with
// tile i's S = Q K^T issued together with tile i - 1's O += P V.
template <int D, int DV, int BN, int STAGES, bool PP>
struct PrefillWsConfig {
  static constexpr bool kKv8 = false;  // K / V in q's 16-bit type (PrefillWsKv8Config: fp8 pages)
  static constexpr bool kPingPong = PP;
  static constexpr int kHeadDim = D;
  static constexpr int kVHeadDim = DV;
  static constexpr int kBN = BN;
  static constexpr int kStages = STAGES;
  static constexpr int kRows = kPrefillTileRows;
  static constexpr int kConsumers = kRows / 64;  // consumer warpgroups, one m64 block each
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // The cp.async producer of the MHA form (D != DV: separate K and V chunk counts) needs more
  // than 40 registers not to spill.
  static constexpr int kProducerRegs = DV > 128 && PP ? 24 : D != DV ? 56 : 40;
  static constexpr int kConsumerRegs = DV > 128 && PP ? 240 : D != DV ? 224 : 232;
  static constexpr int kChunks = D / 8;    // 16-byte chunks of a Q / K row
  static constexpr int kVChunks = DV / 8;  // of a V row
  static constexpr int kON = DV > 128 ? 128 : DV;
  static constexpr int kQBytes = kRows * D * 2;
  static constexpr int kTileBytes = BN * D * 2;     // K tile; the V tile follows it
  static constexpr int kVTileBytes = BN * DV * 2;
  static constexpr int kStageBytes = kTileBytes + kVTileBytes;
  static constexpr int kRingBytes = STAGES * kStageBytes;
  static constexpr int kSlotBytes = BN * 4;
  // full[STAGES], empty[STAGES], q full, q empty, unit, 8 bytes that align the two unit slots
  // after them
  static constexpr int kBarBytes = (2 * STAGES + 4) * 8 + 2 * int{sizeof(WsUnitSlot)};
  static constexpr int kSmemBytes = 1024 + kQBytes + kRingBytes + kSlotBytes + kBarBytes;
  static_assert(kConsumers == 2 && D % 64 == 0 && DV % 64 == 0 && DV <= D && BN % 64 == 0 &&
                BN <= 128 && STAGES >= 2);
  static_assert(BN * kChunks % 128 == 0 && kRows * kChunks % 128 == 0);
  static_assert(kSmemBytes <= 227 * 1024, "the ring must fit one SM's shared memory");
  // setmaxnreg moves registers between the warpgroups of the CTA only: what the consumers gain
  // the producer must give up from the launch allocation (65536 / kThreads rounded down to 8).
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= kLaunchRegs * kThreads,
                "setmaxnreg.inc would wait forever");
};

template <int D, bool PP>
using PrefillWsCfg =
    std::conditional_t<D == 64, PrefillWsConfig<64, 64, 128, 4, PP>,
                       std::conditional_t<D == 128, PrefillWsConfig<128, 128, 128, 3, PP>,
                                          PrefillWsConfig<256, 256, 64, 2, PP>>>;
// MLA's MHA form: q / k 192 (128 nope + 64 rope), v 128; 80 KiB a stage at 128 keys, 40 at 64.
template <int BN, int STAGES, bool PP>
using PrefillWsMlaCfg = PrefillWsConfig<kMlaMhaHeadDim, kMlaMhaVHeadDim, BN, STAGES, PP>;

// The CTA over fp8 pages (the header comment): head dim D, BN keys a tile, STAGES f16 stages,
// STAGING staging tiles of fp8 K + V after the barriers, the consumers on f16 MMAs in ping-pong
// (PP) or free-running, as the 16-bit CTA of the same head dim by default (prefill.cu).
template <int D, int BN, int STAGES, int STAGING, bool PP = true>
struct PrefillWsKv8Config : PrefillWsConfig<D, D, BN, STAGES, PP> {
  using Base = PrefillWsConfig<D, D, BN, STAGES, PP>;
  static constexpr bool kKv8 = true;
  // Producer / consumer registers by the producer's conversion work a tile (ptxas -v): 56 / 224
  // at head dim 128 and 64-key tiles (no spills; at 40 / 232, the 16-bit CTA's split, the producer
  // spills its staging, ring and barrier addresses across the conversion), 64 / 216 at 64 and 128
  // keys (no spills), 72 / 216 for 16 KiB fp8 tiles (256 x 64 keys, 128 x 128: no spills, 4 bytes
  // in one of the two q types).
  static constexpr int kProducerRegs = BN * D >= 16384 ? 72 : D == 64 ? 64 : 56;
  static constexpr int kConsumerRegs = kProducerRegs == 56 ? 224 : 216;
  static constexpr int kStaging = STAGING;
  static constexpr int kStagingTileBytes = 2 * kv8_staged_tile_bytes(BN, D);  // fp8 K, then V
  static constexpr int kStagingOffset =
      (Base::kQBytes + Base::kRingBytes + Base::kSlotBytes + Base::kBarBytes + 127) / 128 * 128;
  static constexpr int kSmemBytes = 1024 + kStagingOffset + STAGING * kStagingTileBytes;
  static_assert(STAGING >= 1);
  static_assert(kSmemBytes <= 227 * 1024, "the ring and staging must fit one SM's shared memory");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * Base::kConsumers <=
                    Base::kLaunchRegs * Base::kThreads,
                "setmaxnreg.inc would wait forever");
};
// Per head dim. 64: 128-key tiles (the 16-bit CTA's, its S and P V MMAs twice as wide as at 64
// keys) in 3 f16 stages of 32 KiB behind 3 staging tiles (16 KiB of Q: 209 KiB). 128: 64-key tiles
// (a 128-key f16 stage is 64 KiB, two of them beside Q and staging leave no third), 4 + 4. 256:
// 64-key tiles, 2 stages of 64 KiB and one staging tile (Q alone is 64 KiB: 225 KiB), so each
// tile's copies wait for the previous tile's conversion; the consumers free-running, as the
// 16-bit CTA's at 256 (in ping-pong a stage is held a tile longer, which two stages cannot
// spare; and ping-pong's extra live registers spilled there).
template <int D>
using PrefillWsKv8Cfg =
    std::conditional_t<D == 64, PrefillWsKv8Config<64, 128, 3, 3>,
                       std::conditional_t<D == 128, PrefillWsKv8Config<128, 64, 4, 4>,
                                          PrefillWsKv8Config<256, 64, 2, 1, false>>>;

// QTMA (with TMA): Q comes by TMA too, through maps.q; the instance is taken where maps.q_tma.

template <typename T, typename Cfg, bool TMA, bool QTMA = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    prefill_ws_kernel(const AttnParams p, int num_units,
                      const __grid_constant__ WsTensorMaps maps) {
  // Q by TMA: the producer's 40 registers spilled its box coordinates (24-28 bytes); it takes 56,
  // the consumers 224 (the split of the MHA form's cp.async producer).
  constexpr bool kQRegs = QTMA && Cfg::kProducerRegs == 40;
  constexpr int kProducerRegs = kQRegs ? 56 : Cfg::kProducerRegs;
  constexpr int kConsumerRegs = kQRegs ? 224 : Cfg::kConsumerRegs;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * Cfg::kConsumers <=
                Cfg::kLaunchRegs * Cfg::kThreads);
  constexpr int D = Cfg::kHeadDim, DV = Cfg::kVHeadDim, BN = Cfg::kBN, ST = Cfg::kStages;
  constexpr int CH = Cfg::kChunks, CHV = Cfg::kVChunks;
  constexpr int ON = Cfg::kON, NO = DV / ON, ROWS = Cfg::kRows;
  constexpr int kLog2BN = BN == 128 ? 7 : 6;
  static_assert(BN == 1 << kLog2BN);
  // The MMAs' element type: T, or f16 over fp8 pages (K and V exact; bf16 q converted in place by
  // the consumers at a power-of-two scale: kScaleQ).
  constexpr bool KV8 = Cfg::kKv8;
  using MT = std::conditional_t<KV8, __half, T>;
  constexpr bool kScaleQ = KV8 && !std::is_same_v<T, __half>;
  static_assert(!(KV8 && TMA), "the TMA producer loads 16-bit pages");
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
  unsigned char* smem = smem_raw + pad;
  const uint32_t sQ = raw + pad;
  const uint32_t sKV = sQ + Cfg::kQBytes;
  int32_t* sSlot = reinterpret_cast<int32_t*>(smem + Cfg::kQBytes + Cfg::kRingBytes);
  const uint32_t sBar = sKV + Cfg::kRingBytes + Cfg::kSlotBytes;
  auto full_bar = [&](int s) { return sBar + 8 * s; };
  auto empty_bar = [&](int s) { return sBar + 8 * (ST + s); };
  const uint32_t q_bar = sBar + 8 * 2 * ST;
  const uint32_t q_empty = q_bar + 8;
  const uint32_t unit_bar = q_bar + 16;
  WsUnitSlot* unit_slot = reinterpret_cast<WsUnitSlot*>(smem + Cfg::kQBytes + Cfg::kRingBytes +
                                                        Cfg::kSlotBytes + (2 * ST + 4) * 8);

  const int tid = threadIdx.x, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(full_bar(s), TMA ? 129 : 128);
      mbar_init(empty_bar(s), 4 * Cfg::kConsumers);
    }
    // Q by TMA: thread 0's arrive.expect_tx alone; else every producer thread's cp.async arrival.
    mbar_init(q_bar, QTMA ? 1 : 128);
    mbar_init(q_empty, 4 * Cfg::kConsumers);
    mbar_init(unit_bar, 1);
  }
  __syncthreads();

  // A plain launch (the 128-row prefill is never a dependent): both calls are no-ops there, kept
  // at the point prefill_kernel has them so the PDL rules stay those of dependent_launch.cuh.
  grid_dependency_wait();
  launch_dependent_grids();
  // The CTA's units (work item, KV head): first unit blockIdx.x, then tickets handed out in list
  // order (heaviest items first) by an atomic counter (p.sched), fetched by producer thread 0
  // while the current unit's tiles are issued. Thread 0 publishes the n-th unit of the CTA in
  // unit_slot[n & 1] (the ticket and the unit's ws_unit, so the consumers need no global load to
  // start it) and arrives on the unit barrier (its n-th phase); the consumers read it there and
  // arrive on the "unit taken" named barrier, which the producer waits on. A unit >= num_units
  // ends both loops. The producer publishes unit n once unit n - 1 is taken, so it runs one unit
  // ahead at most: it never overwrites a slot still to be read, and the consumers never see the
  // unit barrier two phases on. It loads Q of unit n only once the consumers are done reading Q of
  // unit n - 1 ("q empty"), after unit n's first K / V tile: so that tile's copies, and the
  // unit's lookups, run while the consumers finish unit n - 1 (FlashAttention-3's producer orders
  // its loads so, too). The K/V ring's stages and phases run on across units (tile_base: the tiles
  // of the CTA's earlier units), and so do the phases of the Q barriers (q full: its n-th
  // completion; q empty: the n-th unit's Q is read no more). Each role walks the units in its own
  // loop, after its setmaxnreg, so that ptxas allocates each loop under its own register count.
  const int G = p.group;
  // The mask's flags, read once (the scalar rule of common/mask.cuh; chain rows only here).
  const bool causal = p.causal != 0;
  const bool windowed = causal && p.window >= 0;
  // The ring position of tile `it` of the current unit (each thread has one role, so one
  // counter serves both loops).
  int tile_base = 0;
  auto stage_of = [&](int it) { return (tile_base + it) % ST; };
  auto parity_of = [&](int it) { return static_cast<uint32_t>((tile_base + it) / ST) & 1u; };
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if constexpr (TMA) {
      if (tid == 0) {
        prefetch_tensor_map(&maps.k);
        prefetch_tensor_map(&maps.v);
        if constexpr (QTMA) prefetch_tensor_map(&maps.q);
      }
    }
    int ticket = blockIdx.x;  // thread 0: the CTA's next unit
    for (int n = 0;; ++n) {
      // The consumers have taken the previous unit from its slot (and every earlier one, so this
      // slot's last unit too) and so waited for its phase of the unit barrier: this unit's phase
      // completes no earlier than the one they wait for next.
      if (n > 0) named_bar_sync(kWsUnitTakenBar, Cfg::kThreads);
      WsUnitSlot& pub = unit_slot[n & 1];
      if (tid == 0) pub.unit = ticket;
      named_bar_sync(1, 128);
      const int unit = pub.unit;
      if (unit >= num_units) {
        if (tid == 0) mbar_arrive(unit_bar);
        break;
      }
      const WsUnit u = ws_unit<ROWS, BN, TMA>(p, unit);
      if (tid == 0) {
        pub.u = u;
        mbar_arrive(unit_bar);
      }
      const int kvh = u.kvh, lo = u.lo, hi = u.hi, num_tiles = u.num_tiles;
      const WorkItem item = u.item;
      const ReqInfo req = u.req;
      {
        // ================= producer =================
        write_back_committed_pages(p, req, item, kvh, tid, 128);
        // The next ticket, in flight while this unit's copies are issued.
        if (tid == 0) ticket = static_cast<int>(gridDim.x) + atomicAdd(p.sched, 1);
        // Q of this unit, once the consumers' last S = Q K^T of the previous one has completed.
        // The 16-bit producers call it after the unit's first K / V tile: that tile's copies
        // then overlap the previous unit's last tile, its epilogue and the wait for Q.
        auto load_q = [&] {
          if constexpr (QTMA) {
            // ROWS / G whole tokens x the G heads of kvh, one box per 64 columns (D / 64
            // instructions of one thread in place of the 128 threads' ROWS * D / 1024 copies).
            if (tid == 0) {
              if (n > 0) mbar_wait(q_empty, (n - 1) & 1);
              mbar_arrive_expect_tx(q_bar, ROWS * D * 2);
              // The box's first head and token from the unit's slot: values held in registers
              // across the tile loop for this one use made the 40-register producer spill.
              const WsUnit& su = unit_slot[n & 1].u;
              const int q_h0 = su.kvh * G, q_t0 = su.req.qo_start + su.item.f0 / G;
#pragma unroll
              for (int cb = 0; cb < D / 64; ++cb)
                tma_load_3d(sQ + cb * ROWS * 128, &maps.q, cb * 64, q_h0, q_t0, q_bar);
            }
            return;
          }
          if (n > 0) mbar_wait(q_empty, (n - 1) & 1);
          const int f0 = item.f0, qlen = req.qlen, qo_start = req.qo_start, q_head0 = kvh * G;
          const T* q = static_cast<const T*>(p.q);
          // The thread index read here: its swizzled Q addresses, computed once at the kernel's
          // start, would be held (spilled) across the whole unit loop.
          if constexpr (128 % CH == 0) {
            // A thread copies chunk c of rows r0, r0 + RS, ..: the (token, head) of row f0 + r
            // steps by a constant, so one division a unit instead of one a copy (the divisions
            // were most of the producer's ~1,000 instructions a warp for Q, and the consumers
            // waited for Q at most unit starts of the short causal rows).
            constexpr int RS = 128 / CH;
            const int i0 = fresh_thread_index();
            const int r0 = i0 / CH, c = i0 % CH;
            const int dt = RS / G, dh = RS - dt * G;
            int t = (f0 + r0) / G;
            int hg = f0 + r0 - t * G;
#pragma unroll 4
            for (int r = r0; r < ROWS; r += RS) {
              const bool valid = t < qlen;
              const T* src = valid ? q + (qo_start + t) * p.q_stride_tok +
                                         (q_head0 + hg) * p.q_stride_head + c * 8
                                   : q;
              cp_async_16(smem + swz128_offset(ROWS, r, c), src, valid);
              t += dt;
              hg += dh;
              if (hg >= G) {
                hg -= G;
                ++t;
              }
            }
          } else {
#pragma unroll 4
            for (int i = fresh_thread_index(); i < ROWS * CH; i += 128) {
              const int r = i / CH, c = i % CH;
              const int f = f0 + r, t = f / G, hg = f - t * G;
              const bool valid = t < qlen;
              const T* src = valid ? q + (qo_start + t) * p.q_stride_tok +
                                         (q_head0 + hg) * p.q_stride_head + c * 8
                                   : q;
              cp_async_16(smem + swz128_offset(ROWS, r, c), src, valid);
            }
          }
          mbar_arrive_cp_async(q_bar);
        };
        const int pmask = (1 << p.page_shift) - 1;
        // The row of key j of the unit's request.
        auto key_slot = [&](int j) -> int64_t {
          return p.kv_ragged ? int64_t{req.pt_start} + j
                             : slot_of_page(p, pmask, page_id(p, req, j >> p.page_shift), j);
        };
        const T* kbase = static_cast<const T*>(p.k) + kvh * D;
        const T* vbase = static_cast<const T*>(p.v) + kvh * DV;
        if constexpr (KV8) {
          load_q();
          WsPipe<ST> w(sBar, smem + Cfg::kQBytes + Cfg::kRingBytes + Cfg::kSlotBytes);
          w.tile_base = tile_base;
          ws_produce_kv8_tiles<BN, D, ST, Cfg::kStaging, Cfg::kStageBytes>(
              p, w, u, smem + Cfg::kQBytes, smem + Cfg::kStagingOffset, sSlot, tid);
        } else if constexpr (TMA) {
          // Chunks of P rows (a power of two, 8 .. BN: one page or a BN-row piece of one).
          const int pshift = min(p.page_shift, kLog2BN);
          const int P = 1 << pshift;
          // Chunk c of a tile is issued by lane c / 4 of producer warp c % 4: the four warps issue
          // their boxes side by side. A box's tensor coordinates must be uniform, so a warp whose
          // lanes hold different pages issues them one lane after another (ptxas' ELECT /
          // BRA.U.ANY loop); at 16-slot pages a 128-key tile is 8 chunks, 32 boxes, which one warp
          // took 8 rounds at each of its four issue points to issue.
          const int chunk = (tid >> 5) + 4 * (tid & 31);
          // The first slot of this thread's chunk of tile `it`; -1 where the chunk is not loaded
          // by TMA (past the tile's chunks, past the range, or not wholly below hi).
          auto resolve_chunk = [&](int it) -> int32_t {
            const int j0 = lo + it * BN + (chunk << pshift);
            if (chunk >= (BN >> pshift) || it >= num_tiles || j0 + P > hi) return -1;
            return static_cast<int32_t>(key_slot(j0));
          };
          int32_t next_slot = resolve_chunk(0);
#pragma unroll 1
          for (int it = 0; it < num_tiles; ++it) {
            const int stage = stage_of(it);
            const int kb = lo + it * BN;
            const int tma_rows = min(BN, hi - kb) & ~(P - 1);  // whole chunks below hi
            // The last tile: rows tma_rows .. BN - 1 hold the partial page at hi (keys j_tail ..
            // hi - 1, one page; its first slot looked up while the stage drains) and zeros past hi.
            const int j_tail = kb + tma_rows;
            const int64_t tail_slot =
                tma_rows < BN && j_tail < hi
                    ? key_slot(j_tail)
                    : 0;
            if (tile_base + it >= ST) mbar_wait(empty_bar(stage), parity_of(it) ^ 1u);
            const int32_t slot = next_slot;
            next_slot = resolve_chunk(it + 1);  // in flight while this tile's copies are issued
            const uint32_t dk = sKV + stage * Cfg::kStageBytes, dv = dk + Cfg::kTileBytes;
            // The tile's TMA bytes: thread 0's arrival holds the phase open, so boxes of other
            // warps may land before it (the transaction count may dip below zero meanwhile).
            if (tid == 0) mbar_arrive_expect_tx(full_bar(stage), tma_rows * (D + DV) * 2);
            if (chunk < (BN >> pshift) && (chunk << pshift) < tma_rows) {
              const uint32_t r0 = (chunk << pshift) * 128;
#pragma unroll
              for (int cb = 0; cb < D / 64; ++cb) {
                tma_load_3d(dk + cb * BN * 128 + r0, &maps.k, cb * 64, kvh, slot, full_bar(stage));
                if (cb < DV / 64)
                  tma_load_3d(dv + cb * BN * 128 + r0, &maps.v, cb * 64, kvh, slot,
                              full_bar(stage));
              }
            }
            if (tma_rows < BN) {
              unsigned char* ck = smem + Cfg::kQBytes + stage * Cfg::kStageBytes;
              unsigned char* cv = ck + Cfg::kTileBytes;
#pragma unroll 1
              for (int i = tid; i < (BN - tma_rows) * CH; i += 128) {
                const int key = tma_rows + i / CH, c = i % CH;
                const bool valid = kb + key < hi;
                const int64_t s = valid ? tail_slot + (key - tma_rows) : 0;
                const uint32_t so = swz128_offset(BN, key, c);
                cp_async_16(ck + so, kbase + s * p.k_row_stride + c * 8, valid);
                if (CHV == CH || c < CHV)
                  cp_async_16(cv + swz128_offset(BN, key, c), vbase + s * p.v_row_stride + c * 8,
                              valid);
              }
            }
            mbar_arrive_cp_async(full_bar(stage));
            if (it == 0) load_q();
          }
          if (num_tiles == 0) load_q();
        } else {
          auto resolve = [&](int it) -> int32_t {
            const int j = lo + it * BN + tid;
            if (tid >= BN || it >= num_tiles || j >= hi) return -1;
            return static_cast<int32_t>(key_slot(j));
          };
          int32_t next_slot = resolve(0);
          for (int it = 0; it < num_tiles; ++it) {
            const int stage = stage_of(it);
            if (tile_base + it >= ST) mbar_wait(empty_bar(stage), parity_of(it) ^ 1u);
            named_bar_sync(1, 128);  // every producer thread is done reading the previous slots
            if (tid < BN) sSlot[tid] = next_slot;
            named_bar_sync(1, 128);
            next_slot = resolve(it + 1);  // in flight while this tile's copies are issued
            unsigned char* dk = smem + Cfg::kQBytes + stage * Cfg::kStageBytes;
            unsigned char* dv = dk + Cfg::kTileBytes;
#pragma unroll 2
            for (int i = tid; i < BN * CH; i += 128) {
              const int key = i / CH, c = i % CH;
              const int32_t sl = sSlot[key];
              const bool valid = sl >= 0;
              const int64_t s = valid ? sl : 0;
              const uint32_t so = swz128_offset(BN, key, c);
              cp_async_16(dk + so, kbase + s * p.k_row_stride + c * 8, valid);
              if (CHV == CH || c < CHV) cp_async_16(dv + so, vbase + s * p.v_row_stride + c * 8, valid);
            }
            mbar_arrive_cp_async(full_bar(stage));
            if (it == 0) load_q();
          }
          if (num_tiles == 0) load_q();
        }
      }
      tile_base += num_tiles;
    }
    ws_producer_exit(p, tid);
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    // Ping-pong: the turns alternate over all the CTA's units, the first consumer first (the
    // second consumer's hand-over here) and taking the second's last hand-over after the last
    // unit. Pairing them per unit instead would let the second consumer's hand-over for the next
    // unit land on the same barrier phase as its last one of this unit (both are arrivals of
    // barrier 2: 256 threads counted without the first consumer's wait).
    const int consumer = (tid - 128) >> 7;
    if constexpr (Cfg::kPingPong) {
      if (consumer == 1) named_bar_arrive(2, 256);
    }
    for (int n = 0;; ++n) {
      mbar_wait(unit_bar, n & 1);
      const WsUnitSlot& slot = unit_slot[n & 1];
      if (slot.unit >= num_units) break;
      // Every field of the unit this warp uses is read before it arrives on "unit taken" (a warp
      // arrives whole, so every lane has read them): the producer may then overwrite the slot two
      // units later, and compute-sanitizer's racecheck (which flagged reads of the slot in the
      // epilogue, ordered only through the next unit's arrival) finds no hazard. The whole request
      // held in registers made the consumers spill; only the fields used are kept.
      const int kvh = slot.u.kvh, lo = slot.u.lo, hi = slot.u.hi, num_tiles = slot.u.num_tiles;
      const int f0 = slot.u.item.f0, prefix = slot.u.req.prefix, qlen = slot.u.req.qlen;
      const ReqInfo req = slot.u.req;
      const int split = slot.u.item.split;
      named_bar_arrive(kWsUnitTakenBar, Cfg::kThreads);
      {
        // ================= consumers =================
        const int ct = tid - 128, lane = ct & 31, wq = (ct >> 5) & 3, cw = ct >> 7;
        const int g = lane >> 2, c4 = lane & 3;
        const int wg_row0 = cw * 64;
        const int r0 = f0 + wg_row0 + wq * 16;
        int row_t[2], row_q[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          row_t[h] = (r0 + g + 8 * h) / G;
          row_q[h] = prefix + row_t[h];
        }
        const int wt_lo = min(r0 / G, qlen - 1);
        const int wt_hi = min((r0 + 15) / G, qlen - 1);
        const bool wg_idle = (f0 + wg_row0) / G >= qlen;
        const int gt_lo = min((f0 + wg_row0) / G, qlen - 1);
        const int gt_hi = min((f0 + wg_row0 + 63) / G, qlen - 1);

        // bf16 q over fp8 pages: the consumer converts its rows to f16 at scale qs first, and the
        // logits of the f16 MMAs are qs times the true ones: the scales take 1 / qs.
        float inv_qs = 1.f;
        if constexpr (kScaleQ) {
          __shared__ float q_amax[Cfg::kConsumers][4];
          mbar_wait(q_bar, n & 1);
          inv_qs = scale_q_rows_f16<T, ROWS, D>(smem, ct, q_amax);
        }
        const SoftCap cap(p.softcap, p.softmax_scale * inv_qs);
        const float sl = cap.exp_scale(p.scale_log2 * inv_qs);

        float o[NO][ON / 2];
#pragma unroll
        for (int nb = 0; nb < NO; ++nb)
#pragma unroll
          for (int i = 0; i < ON / 2; ++i) o[nb][i] = 0.f;
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

        if constexpr (!kScaleQ) mbar_wait(q_bar, n & 1);

        // A tile's MMA descriptors: the first one's plus constants (wgmma_desc_add) at head dims
        // from 128, which saves the per-MMA encoding chain (1.015-1.05x on the d128 / d256 rows,
        // three H100 calls); at 64 each is encoded anew, as the base + constant form measured
        // 0.97-0.98x there in the same three calls (not explained).
        constexpr bool kDescAdd = D >= 128;
        auto desc_at = [](uint32_t base, uint64_t base_desc, uint32_t offset, uint32_t lbo) {
          return kDescAdd ? wgmma_desc_add(base_desc, offset) : wgmma_desc(base + offset, lbo);
        };
        // S = Q K^T (64 rows x BN keys) issued as one wgmma group.
        // The tiles' addresses through a warp shuffle from lane 0: ptxas then knows them to be the
        // same in the whole warp and builds the descriptors in uniform registers (UIADD3 a
        // descriptor), where from the stage of a unit read out of shared memory it built them in
        // vector registers and moved both into uniform ones before every MMA (4 R2UR, 2 MOV and
        // a LEA / LOP3 an MMA: R2UR was 9.9% of the d128 CTA's executed instructions).
        auto issue_s = [&](float(&s)[BN / 2], uint32_t tK) {
          tK = __shfl_sync(0xffffffffu, tK, 0);
          const uint32_t tQ = __shfl_sync(0xffffffffu, sQ + wg_row0 * 128, 0);
          const uint64_t q_desc = wgmma_desc(tQ, 16), k_desc = wgmma_desc(tK, 16);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            const uint64_t da = desc_at(tQ, q_desc, (kk >> 2) * ROWS * 128 + (kk & 3) * 32, 16);
            const uint64_t db = desc_at(tK, k_desc, (kk >> 2) * BN * 128 + (kk & 3) * 32, 16);
            wgmma_ss<BN, MT>(s, da, db, kk > 0 ? 1 : 0);
          }
          wgmma_commit();
        };
        // O += P V, P from registers, issued as one wgmma group.
        auto issue_pv = [&](const uint32_t(&pa)[BN / 16][4], uint32_t tV) {
          tV = __shfl_sync(0xffffffffu, tV, 0);
          const uint64_t v_desc = wgmma_desc(tV, BN * 128);
          wgmma_fence();
#pragma unroll
          for (int k16 = 0; k16 < BN / 16; ++k16)
#pragma unroll
            for (int nb = 0; nb < NO; ++nb) {
              const uint64_t db =
                  desc_at(tV, v_desc, k16 * 16 * 128 + nb * (ON / 64) * BN * 128, BN * 128);
              wgmma_rs<ON, MT>(o[nb], pa[k16], db);
            }
          wgmma_commit();
        };
        // Softcap, the mask of tiles that need one, then the online softmax in log2 units: s
        // becomes the tile's probabilities, m and l move, alpha is the factor of the O rows (moved:
        // some row maximum of the warp changed).
        auto softmax_tile = [&](float(&s)[BN / 2], int kb, float(&alpha)[2]) -> bool {
          if (cap.on) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) s[i] = cap(s[i]);
          }
          if (tile_needs_mask(causal, windowed, p.window, prefix, kb, BN, hi, wt_lo, wt_hi)) {
            // Each row's visible keys as a range relative to this thread's first column.
            int lb[2], ub[2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
              chain_visible_range(causal, windowed, p.window, row_q[h], hi, kb + 2 * c4, lb[h],
                                  ub[h]);
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int rel = nb * 8 + (e & 1);
                if (rel > ub[e >> 1] || rel < lb[e >> 1]) s[nb * 4 + e] = -INFINITY;
              }
          }
          bool moved = false;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float mx = -INFINITY;
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb)
              mx = fmaxf(mx, fmaxf(s[nb * 4 + 2 * h], s[nb * 4 + 2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            // Lazy rescaling (common/math.cuh): O and l move on a few tiles of a row.
            float m_use;
            const bool move = lazy_max(m[h], mx * sl, m_use, alpha[h]);
            moved = moved || move;
            float sum = 0.f;
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) {
              float& x0 = s[nb * 4 + 2 * h];
              float& x1 = s[nb * 4 + 2 * h + 1];
              x0 = fast_exp2(fmaf(x0, sl, -m_use));
              x1 = fast_exp2(fmaf(x1, sl, -m_use));
              sum += x0 + x1;
            }
            l[h] = l[h] * alpha[h] + sum;
          }
          return __any_sync(0xffffffff, moved);
        };
        auto rescale_o = [&](const float(&alpha)[2]) {
#pragma unroll
          for (int nb = 0; nb < NO; ++nb)
#pragma unroll
            for (int i = 0; i < ON / 8; ++i) {
              o[nb][4 * i] *= alpha[0];
              o[nb][4 * i + 1] *= alpha[0];
              o[nb][4 * i + 2] *= alpha[1];
              o[nb][4 * i + 3] *= alpha[1];
            }
        };
        auto pack_p = [&](const float(&s)[BN / 2], uint32_t(&pa)[BN / 16][4]) {
#pragma unroll
          for (int k16 = 0; k16 < BN / 16; ++k16) {
            pa[k16][0] = pack2<MT>(s[8 * k16], s[8 * k16 + 1]);
            pa[k16][1] = pack2<MT>(s[8 * k16 + 2], s[8 * k16 + 3]);
            pa[k16][2] = pack2<MT>(s[8 * k16 + 4], s[8 * k16 + 5]);
            pa[k16][3] = pack2<MT>(s[8 * k16 + 6], s[8 * k16 + 7]);
          }
        };
        // This warp is done with the stage (its MMAs on it have completed).
        auto release = [&](int stage) {
          if (lane == 0) mbar_arrive(empty_bar(stage));
        };
        auto skips = [&](int kb) {
          return wg_idle || tile_hidden(causal, windowed, p.window, prefix, kb, BN, gt_lo, gt_hi);
        };
        auto tile_k = [&](int stage) { return sKV + stage * Cfg::kStageBytes; };
        // The tiles this consumer's rows can see are one run [it_begin, it_end) (the window cuts a
        // prefix, the diagonal a suffix). Once the run's last S = Q K^T has completed, Q is read no
        // more: the warp tells the producer (q empty), which loads the next unit's Q while this
        // unit's last P V and epilogue run.
        // At head dims >= 128 the run is found from its two ends (a hidden tile is left of the
        // window or right of the diagonal, a few at either end) instead of by testing every tile
        // (~1,000 instructions a warp a unit at 64 tiles); measured with the stepped stages below
        // and store_prefill_row's FAST epilogue (H100): 1.02-1.03x on the d128 rows and MLA's
        // d192, 0.975x at d64, which therefore keeps all three as they were, as does d256 (not
        // measured with them).
        constexpr bool kTrim = D == 128 || D == 192;
        int it_begin = num_tiles, it_end = num_tiles;
        if constexpr (kTrim) {
          it_begin = 0;
          while (it_begin < num_tiles && skips(lo + it_begin * BN)) ++it_begin;
          it_end = num_tiles;
          while (it_end > it_begin && skips(lo + (it_end - 1) * BN)) --it_end;
        } else {
          for (int it = 0; it < num_tiles; ++it) {
            if (!skips(lo + it * BN)) {
              if (it_begin == num_tiles) it_begin = it;
              it_end = it + 1;
            }
          }
        }
        auto q_done = [&] {
          if (lane == 0) mbar_arrive(q_empty);
        };
        if (it_begin == it_end) q_done();

        if constexpr (!Cfg::kPingPong) {
          for (int it = 0; it < num_tiles; ++it) {
            const int stage = stage_of(it);
            const int kb = lo + it * BN;
            mbar_wait(full_bar(stage), parity_of(it));
            if (!skips(kb)) {
              fence_proxy_async_smem();
              float s[BN / 2];
              issue_s(s, tile_k(stage));
              wgmma_wait<0>();
              if (it == it_end - 1) q_done();
              float alpha[2];
              if (softmax_tile(s, kb, alpha)) rescale_o(alpha);
              uint32_t pa[BN / 16][4];
              pack_p(s, pa);
              issue_pv(pa, tile_k(stage) + Cfg::kTileBytes);
              wgmma_wait<0>();
            }
            release(stage);
          }
        } else {
          // Ping-pong: the consumers take turns on the tensor cores (named barrier 2 + consumer),
          // and within a consumer tile i's S = Q K^T is issued together with the previous tile's O
          // += P V, so the softmax of one consumer overlaps the MMAs of the other. Every consumer
          // takes its turn on every tile, with MMAs or not, so the turns stay paired (the first
          // and last hand-overs are outside the unit loop). The MMAs of the run [it_begin,
          // it_end) are issued on straight-line paths (a conditional wgmma makes ptxas serialise
          // them).
          auto turn_sync = [&] {
            if (cw == 0)
              named_bar_sync(2, 256);
            else
              named_bar_sync(3, 256);
          };
          auto turn_pass = [&] {
            if (cw == 0)
              named_bar_arrive(3, 256);
            else
              named_bar_arrive(2, 256);
          };
          // A tile outside the run: the turn, then the stage goes back once its copies landed.
          auto pass_tile = [&](int it) {
            mbar_wait(full_bar(stage_of(it)), parity_of(it));
            turn_sync();
            turn_pass();
            release(stage_of(it));
          };
          for (int it = 0; it < it_begin; ++it) pass_tile(it);
          if (it_begin < it_end) {
            uint32_t pa[BN / 16][4];
            {
              const int stage = stage_of(it_begin);
              mbar_wait(full_bar(stage), parity_of(it_begin));
              fence_proxy_async_smem();
              float s[BN / 2];
              turn_sync();
              issue_s(s, tile_k(stage));
              turn_pass();
              wgmma_wait<0>();
              if (it_begin == it_end - 1) q_done();
              float alpha[2];
              if (softmax_tile(s, lo + it_begin * BN, alpha)) rescale_o(alpha);
              pack_p(s, pa);
            }
            // The stage and phase of tile it: stepped along where kTrim, else
            // stage_of / parity_of (a division by ST each).
            int stage = stage_of(it_begin);
            uint32_t parity = parity_of(it_begin);
            for (int it = it_begin + 1; it < it_end; ++it) {
              int prev = stage;
              if constexpr (kTrim) {
                if (++stage == ST) {
                  stage = 0;
                  parity ^= 1u;
                }
              } else {
                stage = stage_of(it);
                prev = stage_of(it - 1);
                parity = parity_of(it);
              }
              mbar_wait(full_bar(stage), parity);
              fence_proxy_async_smem();
              float s[BN / 2];
              turn_sync();
              issue_s(s, tile_k(stage));
              issue_pv(pa, tile_k(prev) + Cfg::kTileBytes);
              turn_pass();
              wgmma_wait<1>();  // S, the older group, has completed
              if (it == it_end - 1) q_done();
              float alpha[2];
              const bool moved = softmax_tile(s, lo + it * BN, alpha);
              // The own P V's wait, once for the whole warpgroup: `moved` is a warp's vote, so a
              // wait in each branch (which kept ptxas from hoisting it above the softmax) had the
              // warps of one warpgroup at different wgmma.wait_group instructions, which PTX
              // leaves undefined (compute-sanitizer's synccheck: "mismatching warpgroup
              // instruction pc"). The placement measured 0.98-1.015x before (H100): the other
              // consumer's MMAs fill the tensor cores either way.
              wgmma_wait<0>();
              release(prev);
              if (moved) rescale_o(alpha);
              pack_p(s, pa);
            }
            const int last = stage_of(it_end - 1);
            issue_pv(pa, tile_k(last) + Cfg::kTileBytes);
            wgmma_wait<0>();
            release(last);
          }
          for (int it = it_end; it < num_tiles; ++it) pass_tile(it);
        }

        // ---- Epilogue, as prefill_kernel's for one m64 block.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float ll = l[h];
          ll += __shfl_xor_sync(0xffffffff, ll, 1);
          ll += __shfl_xor_sync(0xffffffff, ll, 2);
          const int f = r0 + g + 8 * h;
          const int t = row_t[h], hg = f - t * G;
          if (t >= qlen) continue;
          store_prefill_row<T, DV, ON, kTrim>(p, req, split, t, kvh * G + hg, c4, h, ll, m[h], o);
        }
      }
      tile_base += num_tiles;
    }
    if constexpr (Cfg::kPingPong) {
      if (consumer == 0) named_bar_sync(2, 256);
    }
  }
}

// The launch over num_items x num_kv_heads units (launch_ws_units: persistent where there are
// enough units). TMA: the TMA producer over `maps` (prefill_tma_applies must hold for p).
template <typename T, typename Cfg, bool TMA, bool QTMA = false>
cudaError_t launch_prefill_ws_cfg(const AttnParams& p, const WsTensorMaps& maps, int num_items,
                                  bool persistent, cudaStream_t stream) {
  static_assert(TMA || !QTMA);
  return launch_ws_units<prefill_ws_kernel<T, Cfg, TMA, QTMA>, Cfg>(p, num_items, persistent,
                                                                    stream, maps);
}

}  // namespace attnrt::cuda
