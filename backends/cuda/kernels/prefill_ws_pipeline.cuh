// The producer / consumer pipeline of the warp-specialised prefill CTAs as functions: the barriers
// of the K / V ring and of Q, the persistent walk over the step's units (work item x KV head), the
// producer's 16-bit Q copy and K / V tile walk, the consumers' ping-pong walk over a unit's tiles,
// and the persistent launch. The fp8 CTA (prefill_fp8_ws.cuh) is built from them; the 16-bit CTA
// (prefill_ws.cuh) calls only the producer's tile walk and copy, and only in its instantiation over
// fp8 pages. The protocol is that of the 16-bit CTA (prefill_ws.cuh's header comment describes it)
// on the primitives of prefill_ws_sync.cuh.
//
// The 16-bit CTA's default instantiations do not call these functions, and this duplication is
// deliberate. One round shared them with the 16-bit CTA. Its default instantiations then compiled
// to other SASS and ran 2% slower on the H100 (prefill-1x16384 4 308 -> 4 416 us,
// prefill-1x8192-d64 733 -> 747 us; docs/BENCHMARKS.md). The default path comes first: prefill_ws.cuh
// keeps its inline loops, and the few dozen lines of tile walk below repeat their logic.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/paged_kv.cuh"
#include "backends/cuda/kernels/prefill_ws_sync.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

// The pipeline's barriers in shared memory from `base`: full[ST] and empty[ST] of the K / V ring,
// q full, q empty, unit; then the two unit slots (kBytes in all). tile_base: the tiles of the
// CTA's earlier units, so that the ring's stages and phases run on across units (each thread has
// one role, so one counter serves either loop).
template <int ST>
struct WsPipe {
  static constexpr int kBytes = (2 * ST + 3) * 8 + 8;
  uint32_t base;
  volatile int32_t* slot;
  int tile_base = 0;

  __device__ __forceinline__ WsPipe(uint32_t bars, unsigned char* bars_generic)
      : base(bars), slot(reinterpret_cast<volatile int32_t*>(bars_generic + (2 * ST + 3) * 8)) {}
  __device__ __forceinline__ uint32_t full(int s) const { return base + 8 * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return base + 8 * (ST + s); }
  __device__ __forceinline__ uint32_t q_full() const { return base + 8 * 2 * ST; }
  __device__ __forceinline__ uint32_t q_empty() const { return q_full() + 8; }
  __device__ __forceinline__ uint32_t unit() const { return q_full() + 16; }
  // The ring position of tile `it` of the current unit.
  __device__ __forceinline__ int stage(int it) const { return (tile_base + it) % ST; }
  __device__ __forceinline__ uint32_t parity(int it) const {
    return static_cast<uint32_t>((tile_base + it) / ST) & 1u;
  }
  // Thread 0 initialises the barriers: `full_count` arrivals complete a stage's copies, one lane
  // of each consumer warp releases it; the whole CTA syncs.
  __device__ __forceinline__ void init(int tid, int full_count, int q_count, int consumers) const {
    if (tid == 0) {
      for (int s = 0; s < ST; ++s) {
        mbar_init(full(s), full_count);
        mbar_init(empty(s), 4 * consumers);
      }
      mbar_init(q_full(), q_count);
      mbar_init(q_empty(), 4 * consumers);
      mbar_init(unit(), 1);
    }
    __syncthreads();
  }
};

// ---- The unit walk (prefill_ws.cuh): the CTA's first unit is blockIdx.x, the next ones tickets
// handed out in list order by an atomic counter (p.sched), fetched by producer thread 0 while the
// current unit's tiles are issued. Thread 0 publishes the CTA's n-th unit in slot[n & 1] and
// arrives on the unit barrier (its n-th phase); the consumers read it there and arrive on the
// "unit taken" named barrier (kWsUnitTakenBar, the whole CTA), which the producer waits on before
// it publishes the next unit. So the producer runs one unit ahead at most: it never overwrites a
// slot still to be read, the consumers never see the unit barrier two phases on, and the next
// unit's first tiles are issued while the consumers finish this one (its Q waits for "q empty"
// apart). A unit >= num_units ends both loops.

// Producer thread `tid` (of 128): publishes the n-th unit (blockIdx.x, then the ticket
// ws_take_ticket put in its slot during unit n - 1) once the consumers have taken unit n - 1
// (`threads`: the CTA's); returns it.
template <int ST>
__device__ __forceinline__ int ws_publish_unit(const WsPipe<ST>& w, int n, int tid, int threads) {
  if (n > 0) named_bar_sync(kWsUnitTakenBar, threads);
  if (tid == 0) {
    if (n == 0) w.slot[0] = static_cast<int>(blockIdx.x);
    mbar_arrive(w.unit());
  }
  named_bar_sync(kWsProducerBar, 128);
  return w.slot[n & 1];
}
// Producer thread 0, during unit n (after its publication): the CTA's next unit into slot
// (n + 1) & 1, whose last unit (n - 1) the consumers and the producer have read (the consumers took
// it before unit n was published).
template <int ST>
__device__ __forceinline__ void ws_take_ticket(const AttnParams& p, const WsPipe<ST>& w, int n,
                                               int tid) {
  if (tid == 0) w.slot[(n + 1) & 1] = static_cast<int>(gridDim.x) + atomicAdd(p.sched, 1);
}
// A consumer: the n-th unit of the CTA.
template <int ST>
__device__ __forceinline__ int ws_read_unit(const WsPipe<ST>& w, int n) {
  mbar_wait(w.unit(), n & 1);
  return w.slot[n & 1];
}
// A consumer warp that read a unit below num_units from its slot (every lane: a warp arrives
// whole, its reads performed): the producer may publish the next one.
__device__ __forceinline__ void ws_unit_taken(int threads) {
  named_bar_arrive(kWsUnitTakenBar, threads);
}
// The producer after its last unit.
__device__ __forceinline__ void ws_producer_exit(const AttnParams& p, int tid) {
  if (tid == 0) {
    // This CTA takes no more tickets; the last CTA to get here zeroes the counters for the
    // next launch (every other CTA's last ticket came before its count).
    __threadfence();
    if (atomicAdd(p.sched + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(p.sched, 0);
      atomicExch(p.sched + 1, 0);
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its issuing thread
}

// The producer's copy of a unit's Q rows f0 .. f0 + ROWS (16-bit, D columns; rows past the
// request's tokens zero) into the 128-byte swizzled tile at sq (prefill_ws.cuh's Q copy, two
// copies per loop step); each thread arrives on q_bar when its copies land.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void ws_load_q(const AttnParams& p, const WsUnit& u, unsigned char* sq,
                                          uint32_t q_bar, int tid) {
  constexpr int CH = D / 8;
  const T* q = static_cast<const T*>(p.q);
  const int G = p.group;
#pragma unroll 2
  for (int i = tid; i < ROWS * CH; i += 128) {
    const int r = i / CH, c = i % CH;
    const int f = u.item.f0 + r, t = f / G, hg = f - t * G;
    const bool valid = t < u.req.qlen;
    const T* src = valid ? q + (u.req.qo_start + t) * p.q_stride_tok +
                               (u.kvh * G + hg) * p.q_stride_head + c * 8
                         : q;
    cp_async_16(sq + swz128_offset(ROWS, r, c), src, valid);
  }
  mbar_arrive_cp_async(q_bar);
}

// Producer thread 0's copy of a unit's Q rows by TMA (prefill_ws.cuh's QTMA; the launch checked
// prefill_q_tma_applies): q's map `map` {D, q heads, tokens} in boxes of {64, G, ROWS / G}, the
// ROWS / G whole tokens from t0 on x G heads from h0 on (ws_q_box of the unit), one box per
// 128-byte column block of the tile at sq (the layout ws_load_q writes); its arrive.expect_tx the
// only arrival on q_bar. Rows past the request hold the next request's tokens (zeros past the
// tensor) instead of zeros.
struct WsQBox {
  int h0, t0;
};
__device__ __forceinline__ WsQBox ws_q_box(const WsUnit& u, int G) {
  return {u.kvh * G, u.req.qo_start + u.item.f0 / G};
}
template <int D, int ROWS>
__device__ __forceinline__ void ws_load_q_tma(const CUtensorMap* map, WsQBox box, uint32_t sq,
                                              uint32_t q_bar) {
  mbar_arrive_expect_tx(q_bar, ROWS * D * 2);
  const int h0 = box.h0, t0 = box.t0;
#pragma unroll
  for (int cb = 0; cb < D / 64; ++cb)
    tma_load_3d(sq + cb * ROWS * 128, map, cb * 64, h0, t0, q_bar);
}

// The pool row of key j of the unit's request.
__device__ __forceinline__ int64_t ws_key_slot(const AttnParams& p, const ReqInfo& req, int j) {
  const int pmask = (1 << p.page_shift) - 1;
  return p.kv_ragged ? int64_t{req.pt_start} + j
                     : slot_of_page(p, pmask, page_id(p, req, j >> p.page_shift), j);
}

// The producer's walk over a unit's tiles (prefill_ws.cuh's cp.async producer): per tile, the
// wait for its stage to be free (STAGE_WAIT; a producer that copies into staging tiles first waits
// for the stage itself, later), its keys' pool rows (one key per thread, resolved one tile ahead
// so the lookups are in flight while the previous tile's copies are issued) into sSlot (-1 past
// hi), then issue(it, stage).
template <int BN, int ST, bool STAGE_WAIT = true, typename Issue>
__device__ __forceinline__ void ws_produce_tiles(const AttnParams& p, const WsPipe<ST>& w,
                                                 const WsUnit& u, int32_t* sSlot, int tid,
                                                 Issue&& issue) {
  static_assert(BN <= 128, "one key per producer thread");
  auto resolve = [&](int it) -> int32_t {
    const int j = u.lo + it * BN + tid;
    if (tid >= BN || it >= u.num_tiles || j >= u.hi) return -1;
    return static_cast<int32_t>(ws_key_slot(p, u.req, j));
  };
  int32_t next_slot = resolve(0);
  for (int it = 0; it < u.num_tiles; ++it) {
    const int stage = w.stage(it);
    if (STAGE_WAIT && w.tile_base + it >= ST) mbar_wait(w.empty(stage), w.parity(it) ^ 1u);
    // Every producer thread is done reading the previous slots.
    named_bar_sync(kWsProducerBar, 128);
    if (tid < BN) sSlot[tid] = next_slot;
    named_bar_sync(kWsProducerBar, 128);
    next_slot = resolve(it + 1);  // in flight while this tile's copies are issued
    issue(it, stage);
  }
}

// One tile's cp.async copies: keys 0 .. BN - 1 at the pool rows sSlot (zeros for -1), the CH
// 16-byte chunks of each K and V row (kbase / vbase at the KV head, rows of bytes), into the
// 128-byte swizzled tiles dk and dv.
template <int BN, int CH>
__device__ __forceinline__ void ws_copy_tile(const AttnParams& p, const int32_t* sSlot,
                                             const uint8_t* kbase, const uint8_t* vbase,
                                             unsigned char* dk, unsigned char* dv, int tid) {
  static_assert(BN * CH % 128 == 0);
#pragma unroll 2
  for (int i = tid; i < BN * CH; i += 128) {
    const int key = i / CH, c = i % CH;
    const int32_t sl = sSlot[key];
    const bool valid = sl >= 0;
    const int64_t s = valid ? sl : 0;
    const uint32_t so = swz128_offset(BN, key, c);
    cp_async_16(dk + so, kbase + s * p.k_row_stride + c * 16, valid);
    cp_async_16(dv + so, vbase + s * p.v_row_stride + c * 16, valid);
  }
}

// The TMA producer's walk over a unit's tiles (prefill_ws.cuh's TMA producer, for byte rows: the
// launch checked its conditions, and ws_unit<.., TILED = true> started the range on a tile): chunks
// of P = min(page, BN) keys, chunk c of a tile the job of lane c / 4 of producer warp c % 4 (the
// four warps issue side by side), its first pool slot resolved one tile ahead (-1 where the chunk
// is not loaded by TMA: past the tile's chunks, past the range, or not wholly below hi). Per tile:
// the wait for its stage, a producer barrier (every thread is done with the previous tiles; the
// caller may overwrite what they read two tiles ago), then
//   issue(it, stage, slot, row0, tma_rows, tail_slot):
// rows 0 .. tma_rows - 1 (whole chunks below hi) come by TMA, this thread's chunk (rows row0 ..
// row0 + P - 1) from pool slot `slot` if slot >= 0; rows tma_rows .. BN - 1 are the partial page
// at hi (keys from kb + tma_rows on, pool slots from tail_slot on) and zeros past hi, for
// ws_copy_tail.
template <int BN, int ST, typename Issue>
__device__ __forceinline__ void ws_produce_tma_tiles(const AttnParams& p, const WsPipe<ST>& w,
                                                     const WsUnit& u, int tid, Issue&& issue) {
  constexpr int kLog2BN = BN == 128 ? 7 : 6;
  static_assert(BN == 1 << kLog2BN && BN <= 128);
  const int pshift = min(p.page_shift, kLog2BN);
  const int P = 1 << pshift;
  // This thread's chunk from the thread index read where it is used: held across the tile loop,
  // it and its first row spilled the fp8 producer with Q by TMA (56 registers).
  auto chunk_of = [] {
    const int t = fresh_thread_index();
    return (t >> 5) + 4 * (t & 31);
  };
  auto resolve_chunk = [&](int it) -> int32_t {
    const int chunk = chunk_of();
    const int j0 = u.lo + it * BN + (chunk << pshift);
    if (chunk >= (BN >> pshift) || it >= u.num_tiles || j0 + P > u.hi) return -1;
    return static_cast<int32_t>(ws_key_slot(p, u.req, j0));
  };
  int32_t next_slot = resolve_chunk(0);
#pragma unroll 1
  for (int it = 0; it < u.num_tiles; ++it) {
    const int stage = w.stage(it);
    const int kb = u.lo + it * BN;
    const int tma_rows = min(BN, u.hi - kb) & ~(P - 1);
    // The partial page's first slot, looked up while the stage drains.
    const int j_tail = kb + tma_rows;
    const int64_t tail_slot = tma_rows < BN && j_tail < u.hi ? ws_key_slot(p, u.req, j_tail) : 0;
    if (w.tile_base + it >= ST) mbar_wait(w.empty(stage), w.parity(it) ^ 1u);
    named_bar_sync(kWsProducerBar, 128);
    const int32_t slot = next_slot;
    next_slot = resolve_chunk(it + 1);  // in flight while this tile's copies are issued
    issue(it, stage, slot, chunk_of() << pshift, tma_rows, tail_slot);
  }
}

// The rows tma_rows .. BN - 1 of a tile whose first key is kb (ws_produce_tma_tiles' tail: keys
// below hi from pool slot tail_slot on, zeros from hi) by cp.async: the CH 16-byte chunks of each K
// and V row (kbase / vbase at the KV head, rows of bytes) into the 128-byte swizzled tiles dk, dv.
template <int BN, int CH>
__device__ __forceinline__ void ws_copy_tail(const AttnParams& p, int kb, int hi, int tma_rows,
                                             int64_t tail_slot, const uint8_t* kbase,
                                             const uint8_t* vbase, unsigned char* dk,
                                             unsigned char* dv, int tid) {
#pragma unroll 1
  for (int i = tid; i < (BN - tma_rows) * CH; i += 128) {
    const int key = tma_rows + i / CH, c = i % CH;
    const bool valid = kb + key < hi;
    const int64_t s = valid ? tail_slot + (key - tma_rows) : 0;
    const uint32_t so = swz128_offset(BN, key, c);
    cp_async_16(dk + so, kbase + s * p.k_row_stride + c * 16, valid);
    cp_async_16(dv + so, vbase + s * p.v_row_stride + c * 16, valid);
  }
}

// The tiles a consumer's rows can see are one run [begin, end) of the unit's (the window cuts a
// prefix, the diagonal a suffix); begin = end = num_tiles when none.
struct WsRun {
  int begin, end;
};
template <typename Skips>
__device__ __forceinline__ WsRun ws_tile_run(int num_tiles, Skips&& skips) {
  WsRun r{num_tiles, num_tiles};
  for (int it = 0; it < num_tiles; ++it) {
    if (!skips(it)) {
      if (r.begin == num_tiles) r.begin = it;
      r.end = it + 1;
    }
  }
  return r;
}

// A consumer warpgroup's walk over the unit's tiles in ping-pong with the other consumer
// (prefill_ws.cuh's kPingPong schedule). cw: the consumer (0, 1); the run as ws_tile_run. The math
// is the caller's: issue_s(s, stage) issues S = Q K^T of the stage's tile as one wgmma group,
// issue_pv(pa, stage) O += P V, softmax(s, it, alpha) the mask and online softmax of tile it (s
// becomes the weights; returns whether a row maximum of the warp moved), rescale(alpha) the O
// rows, pack(s, pa) the weights into the A operand of P V. S, PA, AL: the types of s, pa, alpha.
// Once the run's last S has completed, Q is read no more: the warp arrives on q empty. Each warp
// releases a stage (one lane on its empty barrier) once its MMAs on it have completed.
//
// The consumers take turns on the tensor cores (named barrier kWsTurnBar + consumer), and within a
// consumer tile i's S = Q K^T is issued together with the previous tile's O += P V, so the softmax
// of one consumer overlaps the MMAs of the other; a stage is released one tile late (its V is
// read in the next tile's turn). Every consumer takes its turn on every tile, with MMAs or not, so
// the turns stay paired (the first and last hand-overs are outside the unit loop: ws_turns_begin /
// ws_turns_end). The MMAs of the run are issued on straight-line paths (a conditional wgmma makes
// ptxas serialise them). (Constant barrier ids: with an id in a register ptxas reserves all 16
// barriers.)
template <typename S, typename PA, typename AL, int ST, typename IssueS, typename IssuePv,
          typename Softmax, typename Rescale, typename Pack>
__device__ __forceinline__ void ws_consume_tiles(const WsPipe<ST>& w, int num_tiles, WsRun run,
                                                 int cw, int lane, IssueS&& issue_s,
                                                 IssuePv&& issue_pv, Softmax&& softmax,
                                                 Rescale&& rescale, Pack&& pack) {
  const int it_begin = run.begin, it_end = run.end;
  auto release = [&](int stage) {
    if (lane == 0) mbar_arrive(w.empty(stage));
  };
  auto q_done = [&] {
    if (lane == 0) mbar_arrive(w.q_empty());
  };
  if (it_begin == it_end) q_done();
  auto turn_sync = [&] {
    if (cw == 0)
      named_bar_sync(kWsTurnBar, 256);
    else
      named_bar_sync(kWsTurnBar + 1, 256);
  };
  auto turn_pass = [&] {
    if (cw == 0)
      named_bar_arrive(kWsTurnBar + 1, 256);
    else
      named_bar_arrive(kWsTurnBar, 256);
  };
  // A tile outside the run: the turn, then the stage goes back once its copies landed.
  auto pass_tile = [&](int it) {
    mbar_wait(w.full(w.stage(it)), w.parity(it));
    turn_sync();
    turn_pass();
    release(w.stage(it));
  };
  for (int it = 0; it < it_begin; ++it) pass_tile(it);
  if (it_begin < it_end) {
    PA pa;
    {
      const int stage = w.stage(it_begin);
      mbar_wait(w.full(stage), w.parity(it_begin));
      fence_proxy_async_smem();
      S s;
      turn_sync();
      issue_s(s, stage);
      turn_pass();
      wgmma_wait<0>();
      if (it_begin == it_end - 1) q_done();
      AL alpha;
      if (softmax(s, it_begin, alpha)) rescale(alpha);
      pack(s, pa);
    }
    for (int it = it_begin + 1; it < it_end; ++it) {
      const int stage = w.stage(it), prev = w.stage(it - 1);
      mbar_wait(w.full(stage), w.parity(it));
      fence_proxy_async_smem();
      S s;
      turn_sync();
      issue_s(s, stage);
      issue_pv(pa, prev);
      turn_pass();
      wgmma_wait<1>();  // S, the older group, has completed
      if (it == it_end - 1) q_done();
      AL alpha;
      const bool moved = softmax(s, it, alpha);
      wgmma_wait<0>();
      release(prev);
      if (moved) rescale(alpha);
      pack(s, pa);
    }
    const int last = w.stage(it_end - 1);
    issue_pv(pa, last);
    wgmma_wait<0>();
    release(last);
  }
  for (int it = it_end; it < num_tiles; ++it) pass_tile(it);
}

// The ping-pong's turns alternate over all the CTA's units, the first consumer first (the second
// consumer's hand-over before the first unit) and taking the second's last hand-over after the
// last unit. Pairing them per unit instead would let the second consumer's hand-over for the next
// unit land on the same barrier phase as its last one of this unit (both are arrivals of one
// barrier: 256 threads counted without the first consumer's wait).
__device__ __forceinline__ void ws_turns_begin(int cw) {
  if (cw == 1) named_bar_arrive(kWsTurnBar, 256);
}
__device__ __forceinline__ void ws_turns_end(int cw) {
  if (cw == 0) named_bar_sync(kWsTurnBar, 256);
}

// The launch over num_items x num_kv_heads units (num_items with p.item_heads), as
// launch_prefill_ws_cfg's: persistent (as many CTAs as are resident at once, taking units from the
// ticket counter) when there are more than kPersistentMinWaves units per resident CTA; otherwise
// (or when `persistent` is off) one CTA per unit. p.sched must hold two zeroed words (see
// AttnParams). Kernel(p, units, extra...).
template <auto Kernel, typename Cfg, typename... Extra>
cudaError_t launch_ws_units(const AttnParams& p, int num_items, bool persistent,
                            cudaStream_t stream, const Extra&... extra) {
  if (p.sched == nullptr) return cudaErrorInvalidValue;
  const cudaError_t attr = allow_dynamic_smem<Kernel>(Cfg::kSmemBytes);
  if (attr != cudaSuccess) return attr;
  const int units = p.item_heads ? num_items : num_items * p.num_kv_heads;
  int ctas = units;
  if (persistent) {
    const int sms = sm_count();
    if (sms <= 0) return cudaErrorInvalidDevice;
    static const int per_sm = resident_ctas<Kernel>(Cfg::kThreads, Cfg::kSmemBytes);
    if (units > kPersistentMinWaves * sms * per_sm) ctas = sms * per_sm;
  }
  const dim3 grid(static_cast<unsigned>(std::min(units, ctas)));
  return launch_kernel(Kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, false, p, units,
                       extra...);
}

}  // namespace attnrt::cuda
