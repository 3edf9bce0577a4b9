// Decode CTA with the keys on the M side of the MMA, for requests whose (token, head-in-group) rows
// fit in 8 (one decode token at GQA groups up to 8). The 16-row decode CTA of attention.cuh puts
// those rows on M: at group 4 twelve of its 16 rows are padding, and so are 3/4 of its S and PV
// MMAs and of its softmax. Here S^T (16 keys x 8 rows) = K (16 keys x 16 dims) . Q^T (16 dims x 8
// rows) and O^T (16 dims x 8 rows) += V^T (16 dims x 16 keys) . P^T (16 keys x 8 rows), so a warp
// spends D/16 + D/16 MMAs on 16 keys instead of twice that, and each thread exponentiates 4 logits
// instead of 8. S^T's accumulator holds keys on the group index and rows on the quad index, the B
// fragment P^T needs the opposite: two movmatrix transposes per 16 keys.
//
// 4 warps, each taking 16 keys of every 64-key tile; a warp reads only its own keys' K and V rows.
// 16-bit KV: each warp runs its own pipeline (WarpRing below: warp barriers only in the key loop).
// fp8 KV: the CTA loads whole tiles through shared stages (CtaStages). Everything else is the
// decode CTA's: splits and the (O, lse) partials the merge kernel reads; k/v scales, softcap,
// sinks, sliding window, causal and tree masks; the PDL wait before the first K/V load; the
// row-table write-back.
//
// fp8 KV runs the MMAs in f16 whatever the activations: e4m3 -> f16 is one hardware conversion per
// pair and e5m2 is the upper byte of an f16 (exact both ways), where bf16 would need a shift and
// masks on top (attention.cuh's 2^-112 trick) -- a third of the fp8 CTA's instructions. bf16 Q is
// brought into f16 range per row by a power of two (its largest |q| lands in [2^14, 2^15); bf16's 8
// significant bits fit f16's 11), undone in the row's logit scale; P is in [0, 1]. K is
// the A operand: thread (g, c4) reads whole 16-byte chunks of keys g and g + 8 (the head-dim order
// of the fp8 decode CTA, applied to Q too). V^T is the A operand: thread (g, c4) reads D/8
// consecutive bytes (output dims (D/8) g ..) of keys 2 c4, 2 c4 + 1, 2 c4 + 8, 2 c4 + 9 and pairs
// them bytewise into key pairs; the output-dim permutation this implies is undone at the store.
#pragma once

#include "backends/cuda/kernels/attention.cuh"
#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"

namespace attnrt::cuda {

template <int D, bool FP8>
struct KeysMConfig {
  static_assert(D == 64 || D == 128);
  static constexpr int kHeadDim = D;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kCols = 8;  // query rows, on the MMA's N side
  static constexpr int kBN = 64;   // keys per tile
  static constexpr int kKW = kBN / kWarps;
  static constexpr bool kFp8 = FP8;
  // 16-bit KV: the per-warp ring of WarpRing, 3 chunks (one tile in flight), 48 KB of shared
  // memory at head dim 128, so that four CTAs fit an SM (the plan's splits are sized for the
  // occupancy of the CTA that runs). H200, bf16 decode 64x4096: 270 us on two whole-tile stages
  // shared by the CTA (67 KB, three CTAs per SM, 3 splits and their merge), 263 us on the ring
  // (one split). fp8 KV: three whole-tile stages shared by the CTA (48 KB); fp8 on a per-warp
  // ring was slower: 10% with K and V as 6 chunks (64x4096 152 -> 168 us), 5% with whole tiles.
  static constexpr bool kWarpRing = !FP8;
  static constexpr int kRing = 3;
  static constexpr int kStages = 3;
  // WarpRing: tiles whose slots are resolved before their first chunk is issued (a tile's slots
  // are written at the end of tile t - kAhead and first read by the issue of its K chunk,
  // kRing - 1 chunks ahead of its use), in a ring of kSlotTiles per warp.
  static constexpr int kAhead = (kRing + 2) / 2;
  static constexpr int kSlotTiles = 4;
  static constexpr int kMinBlocks = 4;  // 128 registers
  static constexpr int kElem = FP8 ? 1 : 2;
  static constexpr int kLoadChunks = D * kElem / 16;  // 16-byte pieces of a key's row
  static constexpr int kQBytes = kCols * D * 2;
  static constexpr int kTileBytes = kBN * D * kElem;  // K or V of 64 keys, 16 per warp
  static constexpr int kKVBytes = (kWarpRing ? kRing : 2 * kStages) * kTileBytes;
  static constexpr int kMergeStride = D + 4;  // floats per merged row (spreads the banks)
  static constexpr int kMergeBytes = kWarps * kCols * (kMergeStride + 2) * 4;
  static constexpr int kKVRegion = kKVBytes > kMergeBytes ? kKVBytes : kMergeBytes;
  static constexpr int kSlotBytes = (kWarpRing ? kWarps * kSlotTiles * kKW : kStages * kBN) * 8;
  static constexpr int kSmemBytes = kQBytes + kKVRegion + kSlotBytes;
  static_assert(kKW == 16 && (kKW * kLoadChunks) % 32 == 0 && kAhead <= kSlotTiles);
};

// Transposes the 8x8 matrix of 16-bit values the warp holds in fragment layout (thread (g, c4):
// row g, columns 2 c4, 2 c4 + 1).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Issues warp `warp`'s cp.async loads of the K (V_ROWS false) or V rows of its 16 keys of one tile
// into ring entry `dst` (64 swizzled 16-bit rows; the warp's are 16 warp ..): pool slots
// slots[0 .. 16), -1 = no key (zero-filled), KV head `kvh`.
template <typename Cfg, bool V_ROWS>
__device__ __forceinline__ void load_keys_m_rows(const AttnParams& p, const int64_t* slots,
                                                 unsigned char* dst, int kvh, int warp,
                                                 int lane) {
  static_assert(!Cfg::kFp8);
  constexpr int D = Cfg::kHeadDim, LC = Cfg::kLoadChunks, KW = Cfg::kKW;
  const unsigned char* base = static_cast<const unsigned char*>(V_ROWS ? p.v : p.k);
  const int64_t row_stride = V_ROWS ? p.v_row_stride : p.k_row_stride;
#pragma unroll
  for (int n = 0; n < KW * LC / 32; ++n) {
    const int i = lane + 32 * n;
    const int kl = i / LC, c = i % LC;
    const int key = warp * KW + kl;
    const int64_t s = slots[kl];
    const bool valid = s >= 0;
    const unsigned char* src = base;
    if (valid) src += (s * row_stride + kvh * D) * Cfg::kElem + c * 16;
    cp_async_16(dst + key * D * Cfg::kElem + swz(key, c) * 16, src, valid);
  }
}

// The CTA's K/V pipelines. Both give: prologue() (first slots and loads), k_tile(it) (waits for
// tile it's K rows, returns their ring entry), v_tile(it) (the same for V), end_tile(it) and
// finish() (the ring is free for the merge).
//
// WarpRing: warp w streams the K and V rows of its 16 keys of every tile through a ring of
// kRing entries of its own (chunk c of its stream: the K rows, c even, or V rows, c odd, of tile
// c / 2, in entry c % kRing), kRing - 1 chunks in flight, each issue one cp.async group; it
// resolves its keys' pool slots kAhead tiles ahead.
template <typename Cfg>
struct WarpRing {
  static constexpr int R = Cfg::kRing, AH = Cfg::kAhead, SLOTS = Cfg::kSlotTiles;
  static constexpr int KW = Cfg::kKW, BN = Cfg::kBN, TILE = Cfg::kTileBytes;
  const AttnParams& p;
  const ReqInfo& req;
  const KeyRange kr;
  const int num_tiles, page_mask, kvh, warp, lane;
  unsigned char* const kv;
  int64_t* const slot;  // this warp's: tile t's at slot[(t % SLOTS) * KW + key - 16 warp]
  bool prefetch = false;
  int pf_j = 0;
  int32_t pf_page = 0;

  __device__ WarpRing(const AttnParams& p_, const ReqInfo& req_, KeyRange kr_, int num_tiles_,
                      int page_mask_, int kvh_, int tid, unsigned char* kv_, int64_t* slots)
      : p(p_), req(req_), kr(kr_), num_tiles(num_tiles_), page_mask(page_mask_), kvh(kvh_),
        warp(tid >> 5), lane(tid & 31), kv(kv_), slot(slots + (tid >> 5) * SLOTS * KW) {}

  // Lane `lane` (< KW): its key in tile t.
  __device__ int key_of(int t) const { return kr.lo + t * BN + warp * KW + lane; }
  __device__ void issue(int c) {
    if (c < 2 * num_tiles) {
      const int64_t* slots = slot + ((c >> 1) % SLOTS) * KW;
      unsigned char* dst = kv + (c % R) * TILE;
      if (c & 1) {
        load_keys_m_rows<Cfg, true>(p, slots, dst, kvh, warp, lane);
      } else {
        load_keys_m_rows<Cfg, false>(p, slots, dst, kvh, warp, lane);
      }
    }
    cp_async_commit();
  }
  __device__ void prologue() {
    if (lane < KW) {
      for (int t = 0; t < AH && t < num_tiles; ++t) {
        const int j = key_of(t);
        slot[(t % SLOTS) * KW + lane] =
            j < kr.hi ? slot_of_page(p, page_mask, page_id(p, req, j >> p.page_shift), j) : -1;
      }
    }
    __syncwarp();
    for (int c = 0; c < R - 1; ++c) issue(c);  // the first group also completes Q
  }
  // Chunk 2 it is read; chunk 2 it + R - 1 goes into the entry the last V phase freed.
  __device__ const unsigned char* k_tile(int it) {
    issue(2 * it + R - 1);
    prefetch = it + AH < num_tiles && lane < KW;
    pf_j = key_of(it + AH);
    pf_page = prefetch && pf_j < kr.hi ? page_id(p, req, pf_j >> p.page_shift) : 0;
    cp_async_wait<R - 1>();
    __syncwarp();
    if (it == 0) __syncthreads();  // every thread's Q copies (in its first group) have landed
    return kv + ((2 * it) % R) * TILE;
  }
  // Chunk 2 it + 1 is read; the K entry just read takes chunk 2 it + R.
  __device__ const unsigned char* v_tile(int it) {
    __syncwarp();
    issue(2 * it + R);
    cp_async_wait<R - 1>();
    __syncwarp();
    return kv + ((2 * it + 1) % R) * TILE;
  }
  __device__ void end_tile(int it) {
    if (prefetch) {
      slot[((it + AH) % SLOTS) * KW + lane] =
          pf_j < kr.hi ? slot_of_page(p, page_mask, pf_page, pf_j) : -1;
    }
    __syncwarp();  // the V entry is read and the slots written before the next issue
  }
  __device__ void finish() {
    cp_async_wait<0>();
    __syncthreads();
  }
};

// CtaStages: kStages stages of whole tiles (K and V of 64 keys) loaded by all threads
// (paged_kv.cuh's load_kv_tile). A tile's slots are written at the end of the tile kStages
// before it from page ids read one tile earlier still, so that a page-table read has two tiles'
// time to arrive (an fp8 tile streams in about half a 16-bit tile's time; H200: 0.2-0.6% off
// the fp8 decode rows).
template <typename Cfg>
struct CtaStages {
  static constexpr int ST = Cfg::kStages, BN = Cfg::kBN, TILE = Cfg::kTileBytes;
  const AttnParams& p;
  const ReqInfo& req;
  const KeyRange kr;
  const int num_tiles, page_mask, kvh, tid;
  unsigned char* const sK;  // stage s at sK + s * TILE, V after the K stages
  int64_t* const sSlot;     // [ST][BN], -1 = no key
  int32_t page_due = 0;     // page id of key `tid` of tile it + ST, read in tile it - 1
  int32_t page_next = 0;    // the same of tile it + ST + 1, read in tile it

  __device__ CtaStages(const AttnParams& p_, const ReqInfo& req_, KeyRange kr_, int num_tiles_,
                       int page_mask_, int kvh_, int tid_, unsigned char* kv, int64_t* slots)
      : p(p_), req(req_), kr(kr_), num_tiles(num_tiles_), page_mask(page_mask_), kvh(kvh_),
        tid(tid_), sK(kv), sSlot(slots) {}

  __device__ int key_of(int t) const { return kr.lo + t * BN + tid; }
  __device__ int32_t page_of(int t) const {
    const int j = key_of(t);
    return t < num_tiles && tid < BN && j < kr.hi ? page_id(p, req, j >> p.page_shift) : 0;
  }
  __device__ void load(int t) {
    load_kv_tile<Cfg, Fp8VPlacement::keys_m>(p, t, sSlot, sK, sK + ST * TILE, kvh, tid);
  }
  __device__ void prologue() {
    resolve_first_slots<Cfg>(p, req, kr, num_tiles, page_mask, sSlot, tid);
    __syncthreads();
    for (int i = 0; i < ST - 1; ++i) {
      if (i < num_tiles) load(i);
      cp_async_commit();
    }
    page_due = page_of(ST);
  }
  __device__ const unsigned char* k_tile(int it) {
    if (it + ST - 1 < num_tiles) load(it + ST - 1);
    cp_async_commit();
    page_next = page_of(it + ST + 1);
    cp_async_wait<ST - 1>();
    __syncthreads();
    return sK + (it % ST) * TILE;
  }
  __device__ const unsigned char* v_tile(int it) { return sK + (ST + it % ST) * TILE; }
  __device__ void end_tile(int it) {
    const int t = it + ST;
    if (t < num_tiles && tid < BN) {
      const int j = key_of(t);
      sSlot[(t % ST) * BN + tid] = j < kr.hi ? slot_of_page(p, page_mask, page_due, j) : -1;
    }
    page_due = page_next;
    __syncthreads();
  }
  __device__ void finish() { cp_async_wait<0>(); }
};

// E5M2: the fp8 kind (fp8 KV only).
template <typename T, typename Cfg, bool E5M2>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) decode_keys_m_kernel(const AttnParams p) {
  constexpr int D = Cfg::kHeadDim, BN = Cfg::kBN, COLS = Cfg::kCols, KW = Cfg::kKW;
  constexpr int NT = Cfg::kThreads;
  constexpr int MS = Cfg::kMergeStride;
  constexpr bool FP8 = Cfg::kFp8;
  using C = std::conditional_t<FP8, __half, T>;                      // MMA operand type
  constexpr bool kQScale = FP8 && std::is_same_v<T, __nv_bfloat16>;  // bf16 Q scaled into f16
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  unsigned char* kv = smem + Cfg::kQBytes;
  int64_t* slots = reinterpret_cast<int64_t*>(kv + Cfg::kKVRegion);  // the pipeline's

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;
  const int kvh = blockIdx.x;
  const WorkItem item = p.work[blockIdx.y];
  const ReqInfo req = p.reqs[item.req];
  // A padded item of a batch-invariant graph step (GraphLayout::det_splits): nothing to do.
  if (item.split >= req.num_splits) return;
  const int G = p.group;
  const int t_first = item.f0 / G;
  const int t_last = min(req.qlen - 1, (item.f0 + COLS - 1) / G);
  const Mask<true> mask{p, req};
  const KeyRange kr = split_range(mask, t_first, t_last, item.split, BN);
  const int page_mask = (1 << p.page_shift) - 1;

  // ---- Q: rows f0 .. f0 + 8 of the flattened (token, head-in-group) index.
  load_q_tile<T, COLS, D, NT>(p, req, item.f0, kvh, sQ, tid);

  // As in attention_kernel: only the work item, the request and q (which the step's KV-store
  // kernels do not write) were read so far; their rows are read below.
  grid_dependency_wait();
  launch_dependent_grids();

  write_back_committed_pages(p, req, item, kvh, tid, NT);

  const int num_tiles = kr.hi > kr.lo ? ceil_div_i(kr.hi - kr.lo, BN) : 0;
  using Pipe = std::conditional_t<Cfg::kWarpRing, WarpRing<Cfg>, CtaStages<Cfg>>;
  Pipe pipe(p, req, kr, num_tiles, page_mask, kvh, tid, kv, slots);
  pipe.prologue();

  // Per-thread query rows (columns of S^T): 2 c4 and 2 c4 + 1.
  MaskRow rows[2];
  for (int h = 0; h < 2; ++h) rows[h] = mask.row((item.f0 + 2 * c4 + h) / G);

  // O^T: o[m][e] is output dim out_dim(m, e >> 1) of row 2 c4 + (e & 1).
  float o[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t qb[D / 16][2];  // Q^T as the B operand, per k-step

  // Per row 2 c4 + h: the factor undoing its Q scale in the logits (1 unless kQScale).
  float col_unit[2] = {1.f, 1.f};
  const SoftCap cap(p.softcap, p.softmax_scale);
  for (int it = 0; it < num_tiles; ++it) {
    const int kb = kr.lo + it * BN;
    const unsigned char* tK = pipe.k_tile(it);
    if (it == 0) {
      if constexpr (FP8) {
        // Logical k-step kk of thread c4 covers dims P .. P + 3,
        // P = ((kk / 4) * 4 + c4) * 16 + (kk % 4) * 4 (the order of the fp8 K reads below).
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const int P = ((kk >> 2) * 4 + c4) * 16 + (kk & 3) * 4;
          const uint2 v =
              *reinterpret_cast<const uint2*>(sQ + g * D + swz(g, P >> 3) * 8 + (P & 7));
          qb[kk][0] = v.x;
          qb[kk][1] = v.y;
        }
        if constexpr (kQScale) {
          // Row g's largest |q| (its four lanes hold all of it) -> a power of two 2^a putting it
          // in [2^14, 2^15).
          auto as_f2 = [](uint32_t x) {
            return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
          };
          float mx = 0.f;
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const float2 f = as_f2(qb[kk][j]);
              mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
            }
          }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
          int e = 0;
          frexpf(mx, &e);
          const int a = mx > 0.f ? min(15 - e, 100) : 0;
          const float qs = ldexpf(1.f, a);
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const float2 f = as_f2(qb[kk][j]);
              qb[kk][j] = pack2<__half>(f.x * qs, f.y * qs);
            }
          }
#pragma unroll
          for (int h = 0; h < 2; ++h)
            col_unit[h] = ldexpf(1.f, -__shfl_sync(0xffffffff, a, 4 * (2 * c4 + h)));
        }
      } else {
#pragma unroll
        for (int k2 = 0; k2 < D / 32; ++k2) {
          const int c = k2 * 4 + (lane >> 3);
          uint32_t r[4];
          ldmatrix_x4(r, sQ + (lane & 7) * D + swz(lane & 7, c) * 8);
          qb[2 * k2][0] = r[0];
          qb[2 * k2][1] = r[1];
          qb[2 * k2 + 1][0] = r[2];
          qb[2 * k2 + 1][1] = r[3];
        }
      }
    }
    const int kw0 = kb + warp * KW;  // first key of this warp

    // S^T = K Q^T for the warp's 16 keys; two accumulator chains (even / odd k-steps).
    float s2[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    if constexpr (FP8) {
#pragma unroll
      for (int i = 0; i < D / 64; ++i) {
        uint4 raw[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = warp * KW + g + 8 * h;
          raw[h] =
              *reinterpret_cast<const uint4*>(tK + key * D + fp8_k_chunk<D>(key, i * 4 + c4) * 16);
        }
        const uint32_t w0[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
        const uint32_t w1[4] = {raw[1].x, raw[1].y, raw[1].z, raw[1].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t a[4];
          fp8x4_to_f16<E5M2>(w0[q], a[0], a[2]);
          fp8x4_to_f16<E5M2>(w1[q], a[1], a[3]);
          mma_16816<C>(s2[q & 1], a, qb[i * 4 + q][0], qb[i * 4 + q][1]);
        }
      }
    } else {
      const T* tK16 = reinterpret_cast<const T*>(tK);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int key = warp * KW + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int c = kk * 2 + (lane >> 4);
        uint32_t a[4];
        ldmatrix_x4(a, tK16 + key * D + swz(key, c) * 8);
        mma_16816<T>(s2[kk & 1], a, qb[kk][0], qb[kk][1]);
      }
    }
    // s[e]: key g + 8 (e >> 1) of the warp, row 2 c4 + (e & 1).
    float s[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = s2[0][e] + s2[1][e];

    // Logits to log2 units: the scale rides in the exponent's FFMA (sl); a softcap is applied
    // first (to the logit with its Q scale undone) and leaves its result in log2 units.
    const float sl[2] = {cap.exp_scale(p.scale_log2 * col_unit[0]),
                         cap.exp_scale(p.scale_log2 * col_unit[1])};
    const bool need_mask = mask.needs_mask(kw0, KW, kr.hi, t_first, t_last);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[e];
      if (cap.on) x = cap(x * col_unit[e & 1]);
      if (need_mask && !mask.visible(rows[e & 1], kw0 + g + 8 * (e >> 1), kr.hi)) x = -INFINITY;
      s[e] = x;
    }

    // Online softmax per row (column of S^T): the eight lanes of a quad index share it.
    float alpha[2];
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(s[h], s[2 + h]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 16));
      const float m_new = fmaxf(m[h], mx * sl[h]);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      moved = moved || m_new != m[h];
      alpha[h] = fast_exp2(m[h] - m_use);
      m[h] = m_new;
      s[h] = fast_exp2(fmaf(s[h], sl[h], -m_use));
      s[2 + h] = fast_exp2(fmaf(s[2 + h], sl[h], -m_use));
      l[h] = l[h] * alpha[h] + (s[h] + s[2 + h]);
    }
    if (__any_sync(0xffffffff, moved)) {
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[1];
        o[i][2] *= alpha[0];
        o[i][3] *= alpha[1];
      }
    }

    // P^T as the B operand: keys 2 c4, 2 c4 + 1 (b0) and 2 c4 + 8, 2 c4 + 9 (b1) of row g.
    const uint32_t pb0 = movmatrix_trans(pack2<C>(s[0], s[1]));
    const uint32_t pb1 = movmatrix_trans(pack2<C>(s[2], s[3]));
    const unsigned char* tV = pipe.v_tile(it);

    // O^T += V^T P^T.
    if constexpr (FP8) {
      constexpr int W = D / 32;  // 4-byte words of a thread's run of one key
      const int k0 = warp * KW + 2 * c4;
      uint32_t w[4][W];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int key = k0 + (r & 1) + 8 * (r >> 1);
        if constexpr (D >= 128) {
          const uint4 v =
              *reinterpret_cast<const uint4*>(tV + key * D + keys_m_v_chunk<D>(key, g) * 16);
          w[r][0] = v.x;
          w[r][1] = v.y;
          w[r][2] = v.z;
          w[r][3] = v.w;
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(
              tV + key * D + keys_m_v_chunk<D>(key, g >> 1) * 16 + (g & 1) * 8);
          w[r][0] = v.x;
          w[r][1] = v.y;
        }
      }
#pragma unroll
      for (int q = 0; q < W; ++q) {
        // Dims 4q .. 4q + 3 of the run, each as a pair of keys: lo keys (2 c4, 2 c4 + 1), hi keys
        // (2 c4 + 8, 2 c4 + 9).
        uint32_t lo[4], hi[4];
        fp8x4_to_f16<E5M2>(__byte_perm(w[0][q], w[1][q], 0x5140), lo[0], lo[1]);
        fp8x4_to_f16<E5M2>(__byte_perm(w[0][q], w[1][q], 0x7362), lo[2], lo[3]);
        fp8x4_to_f16<E5M2>(__byte_perm(w[2][q], w[3][q], 0x5140), hi[0], hi[1]);
        fp8x4_to_f16<E5M2>(__byte_perm(w[2][q], w[3][q], 0x7362), hi[2], hi[3]);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t a[4] = {lo[2 * half], lo[2 * half + 1], hi[2 * half], hi[2 * half + 1]};
          mma_16816<C>(o[2 * q + half], a, pb0, pb1);
        }
      }
    } else {
      const T* tV16 = reinterpret_cast<const T*>(tV);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int key = warp * KW + (lane & 7) + (lane >> 4) * 8;
        const int c = dp * 2 + ((lane >> 3) & 1);
        uint32_t a[4];
        ldmatrix_x4_trans(a, tV16 + key * D + swz(key, c) * 8);
        mma_16816<T>(o[dp], a, pb0, pb1);
      }
    }
    pipe.end_tile(it);
  }
  pipe.finish();  // the K/V region is free for the merge below

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 4);
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 8);
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 16);
  }

  // Output dim of o[m][2 h + e1] (row g + 8 h of MMA m).
  auto out_dim = [&](int mi, int h) {
    return FP8 ? (D / 8) * g + 4 * (mi >> 1) + 2 * (mi & 1) + h : 16 * mi + g + 8 * h;
  };

  // Merge the four warps' states of each row through shared memory, then store.
  float* mo = reinterpret_cast<float*>(kv);   // [WARPS][COLS][MS]
  float* mml = mo + Cfg::kWarps * COLS * MS;  // [WARPS][COLS][2]
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      mo[(warp * COLS + 2 * c4 + (e & 1)) * MS + out_dim(i, e >> 1)] = o[i][e];
  }
  if (g == 0) {
    for (int h = 0; h < 2; ++h) {
      mml[(warp * COLS + 2 * c4 + h) * 2] = m[h];
      mml[(warp * COLS + 2 * c4 + h) * 2 + 1] = l[h];
    }
  }
  __syncthreads();

  const bool split = req.num_splits > 1;
  constexpr int kVec = 4;
  for (int i = tid; i < COLS * (D / kVec); i += NT) {
    const int col = i / (D / kVec), d0 = (i % (D / kVec)) * kVec;
    const int f = item.f0 + col, t = f / G, hg = f % G;
    if (t >= req.qlen) continue;
    float mm = -INFINITY;
    for (int w = 0; w < Cfg::kWarps; ++w) mm = fmaxf(mm, mml[(w * COLS + col) * 2]);
    const float m_use = mm == -INFINITY ? 0.f : mm;
    float ll = 0.f, vals[kVec] = {0.f, 0.f, 0.f, 0.f};
    for (int w = 0; w < Cfg::kWarps; ++w) {
      const int ww = w * COLS + col;
      const float sc = exp2f(mml[ww * 2] - m_use);
      ll += mml[ww * 2 + 1] * sc;
      const float4 ov = *reinterpret_cast<const float4*>(mo + ww * MS + d0);
      vals[0] += ov.x * sc;
      vals[1] += ov.y * sc;
      vals[2] += ov.z * sc;
      vals[3] += ov.w * sc;
    }
    const int head = kvh * G + hg;
    if (split) {
      const int64_t prow = req.part_start + static_cast<int64_t>(item.split) * req.qlen + t;
      const float inv = ll > 0.f ? 1.f / ll : 0.f;
      float* dst = p.part_o + (prow * p.num_q_heads + head) * D + d0;
      *reinterpret_cast<float4*>(dst) =
          make_float4(vals[0] * inv, vals[1] * inv, vals[2] * inv, vals[3] * inv);
      if (d0 == 0) p.part_lse[prow * p.num_q_heads + head] = ll > 0.f ? mm + log2f(ll) : -INFINITY;
    } else {
      float den = ll;
      if (p.sinks) den += exp2f(p.sinks[head] * kLog2e - (mm == -INFINITY ? 0.f : mm));
      const float inv = den > 0.f ? p.v_scale / den : 0.f;
      T* dst = static_cast<T*>(p.out) + (req.qo_start + t) * p.o_stride_tok +
               head * p.o_stride_head + d0;
#pragma unroll
      for (int k = 0; k < kVec; ++k) dst[k] = from_float<T>(vals[k] * inv);
      if (p.lse_out && d0 == 0)
        p.lse_out[(req.qo_start + t) * p.lse_stride_tok + head] = (mm + log2f(den)) * kLn2;
    }
  }
}

}  // namespace attnrt::cuda
