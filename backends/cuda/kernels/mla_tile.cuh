// The latent-tile copies both MLA CTAs (mla_decode.cu, mla_keys_m.cu) share: 64 keys of the
// 576-column latent rows a tile, in the 128-byte swizzled layout of wgmma.cuh, two stages. A
// thread copies chunk ld_c of every 64-column block of RPT key rows (ld_row + step r, step a
// multiple of 8 so the rows share one swizzle): every chunk sits at one base offset plus
// constants. The pool slots of a thread's rows are looked up a tile ahead (prefetch_slots), so a
// page of one token adds no latency to the copies. An fp8 cache is copied raw: by mla_decode.cu
// into two 36 KB stages in the second bf16 tile's space, converted (through f16, exactly, in units
// of 2^-112) into a bf16 tile; by mla_keys_m.cu into its own stages (load_raw_swizzled).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/mask.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/mla_fp8_layout.h"
#include "backends/cuda/kernels/paged_kv.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda {

inline constexpr int kMlaTileKeys = 64;
inline constexpr int kMlaTileBytes = kMlaTileKeys * kMlaHeadDim * 2;

// An fp8 tile is converted to bf16 values times 2^-112 (convert.cuh's fp8x4_to: the exact f16 bits
// moved into bf16 position, a shift instead of two more conversions a pair), so a CTA reading it
// scales Q by kMlaFp8QScale and P by kMlaFp8PScale before their MMAs (no product underflows), and
// multiplies S and O by kMlaFp8Unit = 2^112 / 2^64 after them.
inline constexpr float kMlaFp8QScale = 0x1p64f;
inline constexpr float kMlaFp8PScale = 0x1p64f;
inline constexpr float kMlaFp8Unit = 0x1p48f;

// The fp8 latent tile that the keys-on-M CTA (mla_keys_m.cu) reads with ldmatrix: the 64 keys'
// raw 576-byte rows as four 8 KB blocks of 128 columns ([key][128 bytes], 16-byte chunk c of a row
// at c ^ (key & 7)) and one 4 KB block of the 64 rope columns ([key][64 bytes], chunk c at
// c ^ ((key >> 1) & 3)), so that the eight rows of an 8 x 16-byte ldmatrix (eight keys, one chunk)
// and the eight chunks of a row's copies each fall on all 32 banks.
inline constexpr int kMlaRawTileBytes = kMlaTileKeys * kMlaHeadDim;
__device__ __forceinline__ uint32_t mla_raw_offset(int key, int c) {
  return c < 32 ? (c >> 3) * kMlaTileKeys * 128 + key * 128 + (((c & 7) ^ (key & 7)) << 4)
                : 4 * kMlaTileKeys * 128 + key * 64 + (((c - 32) ^ ((key >> 1) & 3)) << 4);
}

// 16 fp8 bytes (E5M2 or e4m3) -> 16 bf16 values times 2^-112, in two 16-byte chunks.
template <bool E5M2>
__device__ __forceinline__ void fp8x16_to_bf16(const uint4& w, uint4& lo, uint4& hi) {
  uint32_t b[8];
  fp8x4_to<__nv_bfloat16>(w.x, E5M2, b[0], b[1]);
  fp8x4_to<__nv_bfloat16>(w.y, E5M2, b[2], b[3]);
  fp8x4_to<__nv_bfloat16>(w.z, E5M2, b[4], b[5]);
  fp8x4_to<__nv_bfloat16>(w.w, E5M2, b[6], b[7]);
  lo = make_uint4(b[0], b[1], b[2], b[3]);
  hi = make_uint4(b[4], b[5], b[6], b[7]);
}

// Converts column blocks [B0, B1) (B0 even) of a tile whose raw chunks landed in place
// (mla_fp8_layout.h), by the 128 threads of a warpgroup (wt: 0 .. 127; tile: its shared-memory
// address). A pair of blocks (k, k + 1): the eight threads of a quarter warp read the eight raw
// chunks of a row (four rows each), meet at a __syncwarp (a row's bf16 chunks of block k overwrite
// raw chunks of all eight), then each writes the 32 bytes that cover its chunk, in block k or
// k + 1; block 8 alone, two rows a thread. mla_convert_src / mla_convert_dst give the offsets, and
// make a quarter warp's load and each of its two stores fall on the 32 banks once. 16-byte
// accesses by ld_shared_v4 / st_shared_v4 (through a uint4 pointer nvcc split the e4m3 loads into
// four 32-bit ones: 3.8x the ideal wavefronts measured). Values come out times 2^-112
// (fp8x16_to_bf16).
template <bool E5M2, int RPT>
__device__ __forceinline__ void mla_convert_rows(uint32_t src, uint32_t dst, uint32_t row_step,
                                                 bool odd_first) {
  uint4 w[RPT];
#pragma unroll
  for (int r = 0; r < RPT; ++r) w[r] = ld_shared_v4(src + r * row_step);
  __syncwarp();
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    uint4 v = w[r];
    if (odd_first) v = make_uint4(v.z, v.w, v.x, v.y);  // the odd chunk's bytes first
    uint4 first, second;
    fp8x16_to_bf16<E5M2>(v, first, second);
    st_shared_v4(dst + r * row_step, first);
    st_shared_v4((dst + r * row_step) ^ 16u, second);
  }
}

template <bool E5M2, int B0, int B1>
__device__ __forceinline__ void mla_convert_in_place(uint32_t tile, int wt) {
  static_assert(B0 % 2 == 0);
  constexpr uint32_t kBlock = kMlaTileKeys * 128;
  const bool odd_first = (wt & 4) != 0;
  const uint32_t src = tile + mla_convert_src(wt, 0, false),
                 dst = tile + mla_convert_dst(wt, 0, false);
#pragma unroll
  for (int k = B0; k + 1 < B1; k += 2)
    mla_convert_rows<E5M2, 4>(src + k * kBlock, dst + k * kBlock, 16 * 128, odd_first);
  if constexpr ((B1 - B0) % 2 == 1)
    mla_convert_rows<E5M2, 2>(tile + mla_convert_src(wt, 0, true) + (B1 - 1) * kBlock,
                              tile + mla_convert_dst(wt, 0, true) + (B1 - 1) * kBlock, 32 * 128,
                              odd_first);
}

// Eight bf16 values at `p` (shared memory) times 2^64, exactly (an exponent step; q is far below
// 2^63).
__device__ __forceinline__ void scale_q_chunk(unsigned char* p) {
  uint4 v = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162 k = __float2bfloat162_rn(kMlaFp8QScale);
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __hmul2(h[i], k);
  *reinterpret_cast<uint4*>(p) = v;
}

// The work item of an MLA CTA (blockIdx.y): its request, the tokens of its `rows` (token, head)
// rows, and the keys of its split in whole 64-key tiles.
struct MlaItem {
  WorkItem item;
  ReqInfo req;
  int t_first, t_last;  // tokens of the item's rows
  int lo, hi;           // keys of the split
  int num_tiles;

  __device__ __forceinline__ MlaItem(const AttnParams& p, int rows)
      : item(p.work[blockIdx.y]), req(p.reqs[item.req]) {
    t_first = item.f0 / p.group;
    t_last = min(req.qlen - 1, (item.f0 + rows - 1) / p.group);
    const KeyRange kr = split_keys(Mask<true>{p, req}.span(t_first, t_last), req.num_splits,
                                   item.split, kMlaTileKeys);
    lo = kr.lo;
    hi = kr.hi;
    num_tiles = hi > lo ? (hi - lo + kMlaTileKeys - 1) / kMlaTileKeys : 0;
  }
};

// One finished (token t, q head) row of an MLA CTA, with its softmax state m (log2 units) and
// row sum l: a split writes its fp32 partial (times unit / l) and log2 lse, otherwise the row is
// normalised (sinks in the denominator, v_scale folded in) and written in T with the natural-log
// lse. `lead`: this thread writes the lse. put(c, x) stores column c of the row, x as accumulated.
template <typename T>
struct MlaRowOut {
  float* part = nullptr;
  T* out = nullptr;
  float inv = 0.f;

  __device__ __forceinline__ MlaRowOut(const AttnParams& p, const ReqInfo& req, int split, int t,
                                       int head, float l, float m, float unit, bool lead) {
    if (req.num_splits > 1) {
      const int64_t prow = req.part_start + static_cast<int64_t>(split) * req.qlen + t;
      inv = l > 0.f ? unit / l : 0.f;
      part = p.part_o + (prow * p.num_q_heads + head) * kMlaVHeadDim;
      if (lead) p.part_lse[prow * p.num_q_heads + head] = l > 0.f ? m + log2f(l) : -INFINITY;
    } else {
      const float m_use = m == -INFINITY ? 0.f : m;
      float den = l;
      if (p.sinks != nullptr) den += fast_exp2(p.sinks[head] * kLog2e - m_use);
      inv = den > 0.f ? p.v_scale * unit / den : 0.f;
      out = static_cast<T*>(p.out) + (req.qo_start + t) * p.o_stride_tok + head * p.o_stride_head;
      if (p.lse_out != nullptr && lead)
        p.lse_out[(req.qo_start + t) * p.lse_stride_tok + head] = (m_use + log2f(den)) * kLn2;
    }
  }
  __device__ __forceinline__ void put(int c, float x) const {
    if (part != nullptr) {
      part[c] = x * inv;
    } else {
      out[c] = from_float<T>(x * inv);
    }
  }
  // Columns c and c + 1 (c even).
  __device__ __forceinline__ void put2(int c, float x0, float x1) const {
    if (part != nullptr) {
      *reinterpret_cast<float2*>(part + c) = make_float2(x0 * inv, x1 * inv);
    } else {
      *reinterpret_cast<uint32_t*>(out + c) = pack2<T>(x0 * inv, x1 * inv);
    }
  }
};

// The Q rows f0 .. f0 + 63 of a 64-row MLA CTA's item into the swizzled [9 blocks][64 rows] tile at
// `sq`, by 256 threads: eight a row, two rows each (ld_row and ld_row + 32, ld_row = tid / 8),
// thread ld_c = tid % 8 taking 16-byte chunk ld_c of each 64-column block at ld_swz plus constants.
// Rows past the request's tokens are zero (finite, never stored).
template <typename T>
__device__ __forceinline__ void mla_load_q64(const AttnParams& p, const ReqInfo& req,
                                             const WorkItem& item, int kvh, unsigned char* sq,
                                             int ld_row, int ld_c, uint32_t ld_swz) {
  constexpr int kRows = 64;
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const int G = p.group;
    const int f = item.f0 + ld_row + 32 * r2, t = f / G, hg = f - t * G;
    const bool valid = t < req.qlen;
    const T* src = static_cast<const T*>(p.q);
    if (valid) src += (req.qo_start + t) * p.q_stride_tok + (kvh * G + hg) * p.q_stride_head;
#pragma unroll
    for (int i = 0; i < kMlaHeadDim / 64; ++i)
      cp_async_16(sq + ld_swz + r2 * 32 * 128 + i * kRows * 128,
                  src + (valid ? ld_c * 8 + i * 64 : 0), valid);
  }
}

// An m64nN accumulator's logits (this thread's: key k0 + 8 nb + 2 c4 (+1) of its rows g, g + 8,
// s[4 nb + 2 h (+1)]) that the rows do not see set to -inf.
template <int N>
__device__ __forceinline__ void mla_mask_keys(const Mask<true>& mask, const MaskRow (&rows)[2],
                                              float (&s)[N / 2], int k0, int hi, int c4) {
#pragma unroll
  for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = k0 + nb * 8 + 2 * c4 + (e & 1);
      if (!mask.visible(rows[e >> 1], j, hi)) s[nb * 4 + e] = -INFINITY;
    }
}

// The maximum of row g + 8 h of an m64nN accumulator over its N columns (the row's quad of lanes).
template <int N>
__device__ __forceinline__ float mla_row_max(const float (&s)[N / 2], int h) {
  float v = -INFINITY;
#pragma unroll
  for (int nb = 0; nb < N / 8; ++nb) v = fmaxf(v, fmaxf(s[nb * 4 + 2 * h], s[nb * 4 + 2 * h + 1]));
  v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffff, v, 2));
}

// A warpgroup's 256 output columns of its rows g and g + 8 (o[nb][4 i + 2 h (+1)]) times f[h].
__device__ __forceinline__ void mla_scale_rows(float (&o)[2][64], const float (&f)[2]) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      o[nb][4 * i] *= f[0];
      o[nb][4 * i + 1] *= f[0];
      o[nb][4 * i + 2] *= f[1];
      o[nb][4 * i + 3] *= f[1];
    }
}

// An m64nN accumulator's probabilities times f[h] (row g + 8 h) as T into a [64 rows][64 keys]
// P tile at `tile` (one 128-byte swizzled row per query row, the K-major A operand of P V), keys
// key0 .. key0 + N - 1.
template <typename T, int N>
__device__ __forceinline__ void mla_store_p(unsigned char* tile, const float (&s)[N / 2], int key0,
                                            const float (&f)[2], int wq, int g, int c4) {
#pragma unroll
  for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wq * 16 + g + 8 * h;
      const int key = key0 + nb * 8 + 2 * c4;
      const uint32_t off = r * 128 + (((key >> 3) ^ (r & 7)) << 4) + (key & 7) * 2;
      *reinterpret_cast<uint32_t*>(tile + off) =
          pack2<T>(s[nb * 4 + 2 * h] * f[h], s[nb * 4 + 2 * h + 1] * f[h]);
    }
}

// The epilogue of a 64-row MLA CTA whose warpgroup wg holds output columns 256 wg .. 256 wg + 255
// of all 64 rows (o[nb][4 i + 2 h (+1)]: columns 128 nb + 8 i + 2 c4 (+1) of rows g + 8 h of warp
// wq's 16) and this thread's part of the rows' sums l: the quads' sums, then the two warpgroups'
// meet in `xl` (2 x 64 floats, free for reuse: the caller's __syncthreads comes first; l becomes
// the quads' sums), then each row is written (MlaRowOut: this split's partial or the output).
template <typename T>
__device__ __forceinline__ void mla_store_rows64(const AttnParams& p, const ReqInfo& req,
                                                 const WorkItem& item, int kvh, int wg, int wq,
                                                 int g, int c4, float (&l)[2], const float (&m)[2],
                                                 const int (&row_t)[2], const float (&o)[2][64],
                                                 float unit, float* xl) {
  constexpr int kRows = 64, kON = kMlaVHeadDim / 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float ll = l[h];
    ll += __shfl_xor_sync(0xffffffff, ll, 1);
    ll += __shfl_xor_sync(0xffffffff, ll, 2);
    l[h] = ll;
    if (c4 == 0) xl[wg * kRows + wq * 16 + g + 8 * h] = ll;
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wq * 16 + g + 8 * h;
    const float ll = l[h] + xl[(wg ^ 1) * kRows + r];
    const int G = p.group;
    const int f = item.f0 + r, t = row_t[h], hg = f - t * G;
    if (t >= req.qlen) continue;
    const MlaRowOut<T> row(p, req, item.split, t, kvh * G + hg, ll, m[h], unit, wg == 0 && c4 == 0);
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int i = 0; i < 16; ++i)
        row.put2(wg * kON + nb * 128 + i * 8 + 2 * c4, o[nb][4 * i + 2 * h],
                 o[nb][4 * i + 2 * h + 1]);
  }
}

// T: the activations (bf16); FP8 / E5M2: the cache's storage; RPT: key rows a thread copies.
// mla_decode.cu's fp8 stages lie in the second bf16 tile's space (kRawAt).
template <typename T, bool FP8, bool E5M2, int RPT>
struct MlaTileCopier {
  static constexpr int kD = kMlaHeadDim, kBN = kMlaTileKeys;
  static constexpr int kElem = FP8 ? 1 : 2;
  static constexpr int kRowChunks = kD * kElem / 16;  // 16-byte chunks of a stored row
  static constexpr int kRawBytes = kBN * kD;          // an fp8 stage
  static constexpr int kRawAt = kMlaTileBytes;

  const AttnParams& p;
  const ReqInfo& req;
  unsigned char* tiles;  // the two bf16 tiles (or the bf16 tile and the two raw stages)
  int lo, hi, num_tiles;
  const unsigned char* kbytes;
  int ld_row, ld_c, step;
  uint32_t ld_swz;
  int page_mask;
  // A pool row's stride in bytes; the rows of the tile load() copies next as page[r], off[r]
  // (slot_at): the page id as loaded from the page table (the mapped slot through an SWA slot
  // map) and the key's place in its page (-1: past the keys). 32 bits (the pool holds fewer than
  // 2^31 rows, CudaKVCache checks), so a row's address is one wide multiply-add (row_src).
  int32_t row_bytes;
  int32_t page[RPT] = {};
  int32_t off[RPT];

  __device__ __forceinline__ MlaTileCopier(const AttnParams& p_, const ReqInfo& req_,
                                           unsigned char* tiles_, int lo_, int hi_, int num_tiles_,
                                           int kvh, int ld_row_, int ld_c_, uint32_t ld_swz_,
                                           int step_)
      : p(p_),
        req(req_),
        tiles(tiles_),
        lo(lo_),
        hi(hi_),
        num_tiles(num_tiles_),
        kbytes(static_cast<const unsigned char*>(p_.k) + static_cast<int64_t>(kvh) * kD * kElem),
        ld_row(ld_row_),
        ld_c(ld_c_),
        step(step_),
        ld_swz(ld_swz_),
        page_mask((1 << p_.page_shift) - 1),
        row_bytes(static_cast<int32_t>(p_.k_row_stride * kElem)) {}

  // The pool address of slot s (a slot of -1, past the keys, gives the pool's first row: its
  // copies read nothing, source size 0).
  __device__ __forceinline__ const unsigned char* row_src(int32_t s) const {
    return kbytes + static_cast<int64_t>(max(s, 0)) * row_bytes;
  }

  // The pool slot of this thread's row r of the prefetched load (-1: past the keys; the row is
  // zero-filled): computed where a copy needs it, not where its page id is loaded.
  __device__ __forceinline__ int32_t slot_at(int r) const {
    return off[r] < 0 ? -1 : p.slot_map ? page[r] : (page[r] << p.page_shift) | off[r];
  }

  // The page ids of this thread's rows of load t. Without a slot map every row's page-table load
  // is issued unconditionally (a row past the keys reads the page of key lo) and nothing
  // consumes its value before the copies (slot_at): with the load under `if (row valid)` and
  // the slot computed inside it, ptxas had to consume the value inside that block, and every
  // warp waited there for the page table (7% of the paired-tile CTA's stall samples at page 64,
  // Nsight Compute, H200).
  __device__ __forceinline__ void prefetch_slots(int t) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int j = lo + t * kBN + ld_row + step * r;
      off[r] = t < num_tiles && j < hi ? j & page_mask : -1;
    }
    if (p.slot_map == nullptr) {
      if (num_tiles > 0) {
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
          const int j = off[r] >= 0 ? lo + t * kBN + ld_row + step * r : lo;
          page[r] = page_id(p, req, j >> p.page_shift);
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < RPT; ++r) {
        const int j = lo + t * kBN + ld_row + step * r;
        if (off[r] >= 0)
          page[r] = static_cast<int32_t>(
              slot_of_page(p, page_mask, page_id(p, req, j >> p.page_shift), j));
      }
    }
  }

  // Issues the copies of load t (its slots prefetched) into stage t & 1, or `stage`.
  __device__ __forceinline__ void load(int t) { load_into(t & 1); }
  __device__ __forceinline__ void load_into(int stage) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int32_t slot = slot_at(r);
      const bool valid = slot >= 0;
      const unsigned char* src = row_src(slot);
      if constexpr (!FP8) {
        copy_blocks<0, kD / 64>(stage, r, src, valid);
      } else {
        unsigned char* dk =
            tiles + kRawAt + stage * kRawBytes + (ld_row + step * r) * kD + ld_c * 16;
#pragma unroll
        for (int i = 0; i < (kRowChunks + 7) / 8; ++i) {
          if (ld_c + 8 * i < kRowChunks)
            cp_async_16(dk + i * 128, src + ld_c * 16 + i * 128, valid);
        }
      }
    }
  }

  // bf16: column blocks [B0, B1) of this thread's rows of the load whose slots were prefetched,
  // into `stage` (the paired-tile CTA's warpgroups each copy their own blocks of a tile).
  template <int B0, int B1>
  __device__ __forceinline__ void load_blocks(int stage) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int32_t slot = slot_at(r);
      copy_blocks<B0, B1>(stage, r, row_src(slot), slot >= 0);
    }
  }
  // fp8 (the paired-tile CTA, ld_swz from mla_raw_in_place): a pair of blocks' raw chunks of a
  // row land in the even block's row in their global order (mla_fp8_layout.h), where
  // mla_convert_in_place turns them into bf16 in place. Eight threads a row take the part's
  // 4 (B1 - B0) raw chunks of the row eight at a time.
  template <int B0, int B1>
  __device__ __forceinline__ void copy_blocks(int stage, int r, const unsigned char* src,
                                              bool valid) {
    unsigned char* dk = tiles + stage * kMlaTileBytes + ld_swz + r * step * 128;
    // One base a row, the blocks at immediate offsets from it: a row past the keys copies nothing
    // (source size 0) from its in-pool address, so no select a block.
    const unsigned char* s = src + ld_c * 16;
    if constexpr (!FP8) {
#pragma unroll
      for (int i = B0; i < B1; ++i) cp_async_16(dk + i * kBN * 128, s + i * 128, valid);
    } else {
      // ld_swz holds the chunk of the pair's row (mla_raw_in_place): the part starts on an even
      // block, and a pair's two blocks land in the even one's rows.
      static_assert(B0 % 2 == 0);
      constexpr int kChunks = 4 * (B1 - B0);
#pragma unroll
      for (int i = 0; i < kChunks; i += 8) {
        if (i + 8 <= kChunks || ld_c < 4)
          cp_async_16(dk + (B0 + i / 4) * kBN * 128, s + (4 * B0 + i) * 16, valid);
      }
    }
  }

  // The paired-tile CTA's form: the page ids of load t come by cp.async (4 bytes a row) into
  // this thread's shared words ids + r * ids_step, one load ahead, and load_blocks_ids(t) reads
  // them after a cp.async.wait_group. Loaded into registers (prefetch_slots), ptxas computes each
  // row's address right after the load anyway, and every warp waits there for the page table
  // (mla_pairs.cu takes this form at pages of up to 16 slots: page 1 1.35x). Commits one group.
  // Through an SWA slot map the mapped slot is looked up here and stored.
  __device__ __forceinline__ void issue_ids(int t, uint32_t ids, int ids_step) const {
    if (p.slot_map == nullptr) {
#pragma unroll
      for (int r = 0; r < RPT; ++r) {
        const int j = lo + t * kBN + ld_row + step * r;
        if (t < num_tiles && j < hi)
          cp_async_4(ids + r * ids_step, page_id_at(p, req, j >> p.page_shift));
      }
    } else {
#pragma unroll 1
      for (int r = 0; r < RPT; ++r) {
        const int j = lo + t * kBN + ld_row + step * r;
        if (t < num_tiles && j < hi)
          st_shared_u32(ids + r * ids_step,
                        static_cast<uint32_t>(
                            slot_of_page(p, page_mask, *page_id_at(p, req, j >> p.page_shift), j)));
      }
    }
    cp_async_commit();
  }
  // Column blocks [B0, B1) and [C0, C1) of load t into `stage`.
  template <int B0, int B1, int C0 = 0, int C1 = 0>
  __device__ __forceinline__ void load_blocks_ids(int t, int stage, uint32_t ids, int ids_step) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int j = lo + t * kBN + ld_row + step * r;
      const bool valid = t < num_tiles && j < hi;
      int32_t row = 0;
      if (valid) {
        const int32_t v = static_cast<int32_t>(ld_shared_u32(ids + r * ids_step));
        row = p.slot_map ? v : (v << p.page_shift) | (j & page_mask);
      }
      const unsigned char* src = row_src(row);
      copy_blocks<B0, B1>(stage, r, src, valid);
      if constexpr (C1 > C0) copy_blocks<C0, C1>(stage, r, src, valid);
    }
  }

  // The slots of load t from the page ids issue_ids put in shared memory (landed), for load().
  __device__ __forceinline__ void slots_from_ids(int t, uint32_t ids, int ids_step) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int j = lo + t * kBN + ld_row + step * r;
      off[r] = -1;
      if (t < num_tiles && j < hi) {
        page[r] = static_cast<int32_t>(ld_shared_u32(ids + r * ids_step));
        off[r] = j & page_mask;
      }
    }
  }

  // Column blocks [B0, B1) and [C0, C1) of load t into `stage`: page ids through shared memory
  // (IDS: load_blocks_ids) or prefetched into registers (load_blocks).
  template <bool IDS, int B0, int B1, int C0 = 0, int C1 = 0>
  __device__ __forceinline__ void load_part(int t, int stage, uint32_t ids, int ids_step) {
    if constexpr (IDS) {
      load_blocks_ids<B0, B1, C0, C1>(t, stage, ids, ids_step);
    } else {
      load_blocks<B0, B1>(stage);
      if constexpr (C1 > C0) load_blocks<C0, C1>(stage);
    }
  }

  // fp8, whole tiles: the rows of load t (its slots prefetched) into `stage` in the layout of
  // mla_raw_offset.
  __device__ __forceinline__ void load_raw_swizzled(unsigned char* stage) {
    static_assert(FP8);
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int key = ld_row + step * r;
      const int32_t slot = slot_at(r);
      const bool valid = slot >= 0;
      const unsigned char* src = row_src(slot);
#pragma unroll
      for (int i = 0; i < (kRowChunks + 7) / 8; ++i) {
        const int c = ld_c + 8 * i;
        if (c < kRowChunks) cp_async_16(stage + mla_raw_offset(key, c), src + c * 16, valid);
      }
    }
  }

  // fp8: this thread's own raw chunks of stage `stage` into the first bf16 tile (no barrier
  // needed before: a thread reads only what its own copies wrote). Raw chunk c holds columns
  // 16c .. 16c + 15: bf16 chunks 2c and 2c + 1.
  __device__ __forceinline__ void convert(int stage) const {
    if constexpr (FP8) {
#pragma unroll
      for (int r = 0; r < RPT; ++r) {
        const int key = ld_row + step * r;
        const unsigned char* src = tiles + kRawAt + stage * kRawBytes + key * kD + ld_c * 16;
#pragma unroll
        for (int i = 0; i < (kRowChunks + 7) / 8; ++i) {
          const int c = ld_c + 8 * i;
          if (c < kRowChunks) {
            uint4 lo16, hi16;
            fp8x16_to_bf16<E5M2>(ld_shared_v4(smem_addr(src + i * 128)), lo16, hi16);
            // Threads ld_c < 4 and >= 4 write the same slots of two column blocks (the same
            // banks): the second four store their odd chunk first, so each store of a quarter
            // warp covers all 32 banks once (the even-first order measured 11.9M bank conflicts
            // on mla-decode-h16-64x8192-fp8 and made fp8 slower than bf16).
            const bool odd_first = ld_c & 4;
            const uint32_t even = swz128_offset(kBN, key, 2 * c);
            const uint32_t odd = swz128_offset(kBN, key, 2 * c + 1);
            *reinterpret_cast<uint4*>(tiles + (odd_first ? odd : even)) = odd_first ? hi16 : lo16;
            *reinterpret_cast<uint4*>(tiles + (odd_first ? even : odd)) = odd_first ? lo16 : hi16;
          }
        }
      }
    }
  }
};

}  // namespace attnrt::cuda
