// The synchronisation primitives of the warp-specialised prefill CTAs (prefill_ws.cuh, the 16-bit
// CTA and its instantiation over fp8 pages; prefill_fp8_ws.cuh, the fp8 one): mbarriers, TMA
// tensor copies, named barriers, setmaxnreg, and the (work item, KV head) unit the persistent CTAs
// walk. The protocol built on them is described in prefill_ws.cuh's header comment.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/mask.cuh"

namespace attnrt::cuda {

// Named barriers: 0 is __syncthreads; 1 the producer warpgroup's own; 2 and 3 the consumers'
// ping-pong turns (256 threads); 4 + c consumer c's own (128 threads); 6 "unit taken" of the 16-bit
// CTA (prefill_ws.cuh: the consumers arrive, the producer waits; the whole CTA).
inline constexpr int kWsProducerBar = 1;
inline constexpr int kWsTurnBar = 2;
inline constexpr int kWsConsumerBar = 4;
inline constexpr int kWsUnitTakenBar = 6;

// The tensor maps of a TMA producer over the layer's K and V pools and, where q_tma is 1, over q
// (prefill_ws.cuh's header comment; prefill_ws.cu's ws_tensor_maps says when, and for the fp8 CTA
// prefill_fp8_tma_maps); unused (zeros) by the cp.async producers.
struct WsTensorMaps {
  CUtensorMap k, v, q;
  int32_t q_tma;
};

// The persistent launches: one CTA per resident slot walking the units once a step has more than
// this many units per resident CTA. On the H200 the persistent grid is 3-14% faster from 8 units
// per SM up (1x4096 at d128: 347 against 324 TFLOP/s) and 6% slower at 1x1024 (512 units, ~4 per
// SM).
constexpr int kPersistentMinWaves = 4;

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
      : "memory");
}
// Arrives on `bar` once every cp.async this thread issued so far has landed, without raising the
// pending count (the barrier's expected count covers these arrivals).
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Waits for the completion of the phase of parity `parity`.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Raises the phase's expected transaction bytes by `bytes`, then arrives (one of the counted
// arrivals).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
// One box of tensor map `map` at coordinates {c0, c1, c2} into shared memory at `dst`; its bytes
// complete on `bar`'s transaction count.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// tma_load_3d into the same offset of every CTA of the cluster in `mask`; the bytes complete on
// the mbarrier at `bar`'s offset in each of them.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map, int c0,
                                                      int c1, int c2, uint32_t bar,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
      : "memory");
}
// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster: arrive (release), then wait (acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}
// The mbarrier initialisations before it visible to the cluster (then cluster_sync).
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives on the mbarrier at `bar`'s offset in CTA `rank` of the cluster (the default release at
// CTA scope, as CUTLASS's cluster pipelines release a stage to its TMA producer; at cluster scope
// ptxas adds a GPU-wide memory barrier and an L1 invalidation a call).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// threadIdx.x, read where it is called (not a value the compiler may keep from an earlier read):
// a producer whose per-thread shared-memory addresses derive from it computes them where they are
// used instead of holding them all across its unit loop.
__device__ __forceinline__ int fresh_thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

// One unit of the warp-specialised CTA: work item `unit / num_kv_heads` on KV head
// `unit % num_kv_heads`, and the keys [lo, hi) of its split, as prefill_kernel cuts them.
struct WsUnit {
  int kvh;
  WorkItem item;
  ReqInfo req;
  int lo, hi, num_tiles;
};

// A unit as the producer publishes it to the consumers (prefill_ws.cuh): the ticket (a value >=
// the step's unit count ends the walk) and, below it, the producer's ws_unit of that ticket, so
// that the consumers start a unit on a shared-memory read instead of the work item's and the
// request's global loads.
struct alignas(16) WsUnitSlot {
  int32_t unit;
  int32_t pad[3];
  WsUnit u;
};

// TILED: the window's first key rounded down to a multiple of BN (the TMA producer loads whole
// pages from a tile's first key on).
template <int ROWS, int BN, bool TILED>
__device__ __forceinline__ WsUnit ws_unit(const AttnParams& p, int unit) {
  WsUnit u;
  if (p.item_heads) {
    u.item = p.work[unit];
    u.kvh = u.item.kvh;
  } else {
    u.kvh = unit % p.num_kv_heads;
    u.item = p.work[unit / p.num_kv_heads];
  }
  u.req = p.reqs[u.item.req];
  const int G = p.group;
  const int t_first = u.item.f0 / G;
  const int t_last = min(u.req.qlen - 1, (u.item.f0 + ROWS - 1) / G);
  KeyRange keys = Mask<false>{p, u.req}.span(t_first, t_last);
  if constexpr (TILED) keys.lo = keys.lo / BN * BN;
  const KeyRange k = split_keys(keys, u.req.num_splits, u.item.split, BN);
  u.lo = k.lo;
  u.hi = k.hi;
  u.num_tiles = k.hi > k.lo ? (k.hi - k.lo + BN - 1) / BN : 0;
  return u;
}

}  // namespace attnrt::cuda
