// Paged attention on tensor cores (flash-attention-2 structure): one kernel for every
// full-attention mode. A CTA takes ROWS query rows of one KV head -- rows are (token, head in GQA
// group) pairs, so the query heads sharing a KV head read each K/V tile once -- and streams the
// keys of its split through double-buffered shared memory, with S = Q K^T and O += P V on
// mma.m16n8k16 and an online softmax in registers.
//
// Warps are arranged as ROWS/16 row groups times WPR key parts: a prefill CTA gives every warp its
// own 16 rows (WPR = 1); a decode CTA has 16 rows and its warps split each K/V tile, merging their
// softmax states through shared memory at the end (WPR = 4).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/primitives.cuh"

namespace attnrt::cuda {

template <int D, int WARPS, int ROWS, int BN, bool FP8, int STAGES = 2>
struct AttnConfig {
  static constexpr int kHeadDim = D;
  static constexpr int kWarps = WARPS;
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kRows = ROWS;
  static constexpr int kBN = BN;
  static constexpr bool kFp8 = FP8;
  static constexpr int kStages = STAGES;  // K/V tiles in flight (cp.async pipeline depth)
  static constexpr int kRowGroups = ROWS / 16;
  static constexpr int kWpr = WARPS / kRowGroups;  // warps sharing a row group
  static constexpr int kKW = BN / kWpr;            // keys of a tile per warp
  static constexpr int kChunks = D / 8;            // 16-byte chunks of a 16-bit row
  static_assert(ROWS % 16 == 0 && WARPS % kRowGroups == 0 && kKW % 16 == 0 && D % 16 == 0 &&
                STAGES >= 2);

  // Shared memory (bytes): Q tile, K/V tiles (STAGES stages of 16-bit tiles, or STAGES stages of
  // raw fp8 tiles plus one converted 16-bit stage), and the cross-warp merge area, which reuses
  // the K/V tiles once the key loop is over.
  static constexpr int kQBytes = ROWS * D * 2;
  static constexpr int kTileBytes = BN * D * 2;  // one 16-bit K or V tile
  static constexpr int kKVBytes =
      FP8 ? (2 * kTileBytes + 2 * STAGES * BN * D) : 2 * STAGES * kTileBytes;
  static constexpr int kMergeBytes = kWpr > 1 ? WARPS * 16 * (D + 2) * 4 : 0;
  static constexpr int kSmemBytes = kQBytes + (kKVBytes > kMergeBytes ? kKVBytes : kMergeBytes);
};

__device__ __forceinline__ int ceil_div_i(int a, int b) { return (a + b - 1) / b; }

// The key range [lo, hi) of split `split`: the keys any row of the tile can see, cut into
// `num_splits` chunks of whole tiles. Depends only on lengths read on the device.
struct KeyRange {
  int lo, hi;
};
__device__ __forceinline__ KeyRange split_range(const AttnParams& p, const ReqInfo& r, int t_first,
                                                int t_last, int split, int bn) {
  int hi = r.kv_len;
  int lo = 0;
  if (p.causal) {
    if (!p.tree) hi = min(hi, r.prefix + t_last + 1);
    if (p.window >= 0) lo = max(0, r.prefix + (p.tree ? 0 : t_first) - p.window);
  }
  const int span = max(hi - lo, 0);
  const int chunk = ceil_div_i(ceil_div_i(span, r.num_splits), bn) * bn;
  KeyRange k;
  k.lo = lo + split * chunk;
  k.hi = min(k.lo + chunk, hi);
  return k;
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) attention_kernel(const AttnParams p) {
  constexpr int D = Cfg::kHeadDim, BN = Cfg::kBN, ROWS = Cfg::kRows, KW = Cfg::kKW;
  constexpr int CH = Cfg::kChunks, NT = Cfg::kThreads, ST = Cfg::kStages;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  unsigned char* kv = smem + Cfg::kQBytes;
  // 16-bit tiles: stage s of K at sK + s * BN * D. fp8: one converted stage, raw stages after it.
  T* sK = reinterpret_cast<T*>(kv);
  T* sV = reinterpret_cast<T*>(kv + (Cfg::kFp8 ? 1 : ST) * Cfg::kTileBytes);
  unsigned char* sKraw = kv + 2 * Cfg::kTileBytes;
  unsigned char* sVraw = sKraw + ST * BN * D;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rg = warp / Cfg::kWpr, kp = warp % Cfg::kWpr;
  const int g = lane >> 2, c4 = lane & 3;
  const int kvh = blockIdx.x;
  const WorkItem item = p.work[blockIdx.y];
  const ReqInfo req = p.reqs[item.req];
  const int G = p.group;
  const int t_first = item.f0 / G;
  const int t_last = min(req.qlen - 1, (item.f0 + ROWS - 1) / G);
  const KeyRange kr = split_range(p, req, t_first, t_last, item.split, BN);
  const int32_t* pt = p.page_table + req.pt_start;
  const int page_mask = (1 << p.page_shift) - 1;

  // ---- Q tile: rows f0 .. f0 + ROWS of the flattened (token, head-in-group) index.
  for (int i = tid; i < ROWS * CH; i += NT) {
    const int r = i / CH, c = i % CH;
    const int f = item.f0 + r, t = f / G, hg = f % G;
    const bool valid = t < req.qlen;
    const T* src = static_cast<const T*>(p.q);
    if (valid)
      src += (req.qo_start + t) * p.q_stride_tok + (kvh * G + hg) * p.q_stride_head + c * 8;
    cp_async_16(sQ + r * D + swz(r, c) * 8, src, valid);
  }

  auto slot_of = [&](int j) -> int64_t {
    int64_t s = (static_cast<int64_t>(pt[j >> p.page_shift]) << p.page_shift) | (j & page_mask);
    if (p.slot_map) s = p.slot_map[s];
    return s;
  };
  auto load_tile = [&](int kb, int stage) {
    if constexpr (!Cfg::kFp8) {
      T* dk = sK + stage * BN * D;
      T* dv = sV + stage * BN * D;
      for (int i = tid; i < BN * CH; i += NT) {
        const int key = i / CH, c = i % CH, j = kb + key;
        const bool valid = j < kr.hi;
        const T* ks = static_cast<const T*>(p.k);
        const T* vs = static_cast<const T*>(p.v);
        if (valid) {
          const int64_t s = slot_of(j);
          ks += s * p.k_row_stride + kvh * D + c * 8;
          vs += s * p.v_row_stride + kvh * D + c * 8;
        }
        cp_async_16(dk + key * D + swz(key, c) * 8, ks, valid);
        cp_async_16(dv + key * D + swz(key, c) * 8, vs, valid);
      }
    } else {
      constexpr int CH8 = D / 16;
      unsigned char* dk = sKraw + stage * BN * D;
      unsigned char* dv = sVraw + stage * BN * D;
      for (int i = tid; i < BN * CH8; i += NT) {
        const int key = i / CH8, c = i % CH8, j = kb + key;
        const bool valid = j < kr.hi;
        const unsigned char* ks = static_cast<const unsigned char*>(p.k);
        const unsigned char* vs = static_cast<const unsigned char*>(p.v);
        if (valid) {
          const int64_t s = slot_of(j);
          ks += s * p.k_row_stride + kvh * D + c * 16;
          vs += s * p.v_row_stride + kvh * D + c * 16;
        }
        cp_async_16(dk + key * D + c * 16, ks, valid);
        cp_async_16(dv + key * D + c * 16, vs, valid);
      }
    }
  };
  // fp8 raw stage -> the 16-bit tile the MMAs read (exact conversion; scales are applied to the
  // logits and the output instead).
  auto convert_tile = [&](int stage) {
    constexpr int CH8 = D / 16;
    const bool e5m2 = p.kv_kind == KvKind::e5m2;
    for (int i = tid; i < 2 * BN * CH8; i += NT) {
      const bool is_v = i >= BN * CH8;
      const int ii = is_v ? i - BN * CH8 : i;
      const int key = ii / CH8, c = ii % CH8;
      const unsigned char* src = (is_v ? sVraw : sKraw) + stage * BN * D + key * D + c * 16;
      const uint4 raw = *reinterpret_cast<const uint4*>(src);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      uint4 lo, hi;
      lo.x = fp8x2_to<T>(w[0] & 0xffff, e5m2);
      lo.y = fp8x2_to<T>(w[0] >> 16, e5m2);
      lo.z = fp8x2_to<T>(w[1] & 0xffff, e5m2);
      lo.w = fp8x2_to<T>(w[1] >> 16, e5m2);
      hi.x = fp8x2_to<T>(w[2] & 0xffff, e5m2);
      hi.y = fp8x2_to<T>(w[2] >> 16, e5m2);
      hi.z = fp8x2_to<T>(w[3] & 0xffff, e5m2);
      hi.w = fp8x2_to<T>(w[3] >> 16, e5m2);
      T* dst = is_v ? sV : sK;
      *reinterpret_cast<uint4*>(dst + key * D + swz(key, 2 * c) * 8) = lo;
      *reinterpret_cast<uint4*>(dst + key * D + swz(key, 2 * c + 1) * 8) = hi;
    }
  };

  const int num_tiles = kr.hi > kr.lo ? ceil_div_i(kr.hi - kr.lo, BN) : 0;
  // Prologue: the first ST - 1 tiles (the Q tile rides in the first group). Every iteration
  // commits one group, empty or not, so wait_group<ST - 1> always means "tile `it` has landed".
  for (int i = 0; i < ST - 1; ++i) {
    if (i < num_tiles) load_tile(kr.lo + i * BN, i);
    cp_async_commit();
  }

  // Per-thread rows: g and g + 8 of the warp's row group.
  int row_t[2];
  int row_qpos[2];
  uint64_t row_tree[2] = {0, 0};
  for (int h = 0; h < 2; ++h) {
    const int f = item.f0 + rg * 16 + g + 8 * h;
    row_t[h] = f / G;
    int depth = row_t[h];
    if (p.tree && row_t[h] < req.qlen) {
      depth = p.tree_depth[req.tree_start + row_t[h]];
      row_tree[h] = p.tree_mask[req.tree_start + row_t[h]];
    }
    row_qpos[h] = req.prefix + depth;
  }

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t qf[D / 16][4];

  for (int it = 0; it < num_tiles; ++it) {
    const int stage = Cfg::kFp8 ? 0 : it % ST;
    const int kb = kr.lo + it * BN;
    if (it + ST - 1 < num_tiles) load_tile(kb + (ST - 1) * BN, (it + ST - 1) % ST);
    cp_async_commit();
    cp_async_wait<ST - 1>();
    __syncthreads();
    if constexpr (Cfg::kFp8) {
      convert_tile(it % ST);
      __syncthreads();
    }
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int r = rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int c = kk * 2 + (lane >> 4);
        ldmatrix_x4(qf[kk], sQ + r * D + swz(r, c) * 8);
      }
    }
    const T* tK = sK + stage * BN * D;
    const T* tV = sV + stage * BN * D;
    const int kw0 = kb + kp * KW;  // first key of this warp

    // S = Q K^T for the warp's KW keys.
    float s[KW / 8][4];
#pragma unroll
    for (int i = 0; i < KW / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < KW / 16; ++np) {
        const int key = kp * KW + np * 16 + (lane & 7) + (lane >> 4) * 8;
        const int c = kk * 2 + ((lane >> 3) & 1);
        uint32_t b[4];
        ldmatrix_x4(b, tK + key * D + swz(key, c) * 8);
        mma_16816<T>(s[2 * np], qf[kk], b[0], b[1]);
        mma_16816<T>(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }

    // Logits in log2 units, masked.
    const bool need_mask =
        kw0 + KW > kr.hi ||
        (p.causal && (p.tree ? kw0 + KW > req.prefix : kw0 + KW - 1 > req.prefix + t_first)) ||
        (p.causal && p.window >= 0 && kw0 < req.prefix + t_last - p.window);
#pragma unroll
    for (int nb = 0; nb < KW / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nb][e];
        if (p.softcap > 0.f) {
          x = p.softcap * tanhf(x * p.softmax_scale / p.softcap) * 1.4426950408889634f;
        } else {
          x *= p.scale_log2;
        }
        if (need_mask) {
          const int h = e >> 1;
          const int j = kw0 + nb * 8 + 2 * c4 + (e & 1);
          bool vis = j < kr.hi;
          int kpos = j;
          if (vis && p.causal) {
            if (p.tree) {
              if (j >= req.prefix) {
                const int u = j - req.prefix;
                vis = (row_tree[h] >> u) & 1;
                kpos = req.prefix + p.tree_depth[req.tree_start + u];
              }
            } else {
              vis = j <= req.prefix + row_t[h];
            }
            if (p.window >= 0) vis = vis && row_qpos[h] - kpos <= p.window;
          }
          if (!vis) x = -INFINITY;
        }
        s[nb][e] = x;
      }
    }

    // Online softmax (rows g and g + 8; the four lanes of a quad share a row).
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < KW / 8; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      const float m_new = fmaxf(m[h], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = exp2f(m[h] - m_use);
      m[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < KW / 8; ++nb) {
        s[nb][2 * h] = exp2f(s[nb][2 * h] - m_use);
        s[nb][2 * h + 1] = exp2f(s[nb][2 * h + 1] - m_use);
        sum += s[nb][2 * h] + s[nb][2 * h + 1];
      }
      l[h] = l[h] * alpha[h] + sum;
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= alpha[0];
      o[i][1] *= alpha[0];
      o[i][2] *= alpha[1];
      o[i][3] *= alpha[1];
    }

    // O += P V: P (accumulator layout) becomes the A operand 16 keys at a time.
#pragma unroll
    for (int kb2 = 0; kb2 < KW / 16; ++kb2) {
      uint32_t a[4];
      a[0] = pack2<T>(s[2 * kb2][0], s[2 * kb2][1]);
      a[1] = pack2<T>(s[2 * kb2][2], s[2 * kb2][3]);
      a[2] = pack2<T>(s[2 * kb2 + 1][0], s[2 * kb2 + 1][1]);
      a[3] = pack2<T>(s[2 * kb2 + 1][2], s[2 * kb2 + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int key = kp * KW + kb2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int c = dp * 2 + (lane >> 4);
        uint32_t b[4];
        ldmatrix_x4_trans(b, tV + key * D + swz(key, c) * 8);
        mma_16816<T>(o[2 * dp], a, b[0], b[1]);
        mma_16816<T>(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 2);
  }

  const bool split = req.num_splits > 1;
  const float sink_log2e = 1.4426950408889634f;
  // Writes one finished row element range; `mm`, `ll`: the row's max (log2) and sum.
  auto store_row = [&](int r_local, int d0, int nd, const float* vals, float mm, float ll) {
    const int f = item.f0 + r_local, t = f / G, hg = f % G;
    if (t >= req.qlen) return;
    const int head = kvh * G + hg;
    if (split) {
      const int64_t prow = req.part_start + static_cast<int64_t>(item.split) * req.qlen + t;
      const float inv = ll > 0.f ? 1.f / ll : 0.f;
      float* dst = p.part_o + (prow * p.num_q_heads + head) * D + d0;
      for (int i = 0; i < nd; ++i) dst[i] = vals[i] * inv;
      if (d0 == 0) p.part_lse[prow * p.num_q_heads + head] = ll > 0.f ? mm + log2f(ll) : -INFINITY;
    } else {
      float den = ll;
      if (p.sinks) den += exp2f(p.sinks[head] * sink_log2e - (mm == -INFINITY ? 0.f : mm));
      const float inv = den > 0.f ? p.v_scale / den : 0.f;
      T* dst = static_cast<T*>(p.out) + (req.qo_start + t) * p.o_stride_tok +
               head * p.o_stride_head + d0;
      for (int i = 0; i < nd; ++i) dst[i] = from_float<T>(vals[i] * inv);
      if (p.lse_out && d0 == 0)
        p.lse_out[(req.qo_start + t) * p.lse_stride_tok + head] =
            (mm + log2f(den)) * 0.6931471805599453f;
    }
  };

  if constexpr (Cfg::kWpr == 1) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float vals[2] = {o[i][2 * h], o[i][2 * h + 1]};
        // The lse is written by the lane holding dims 0..1 (i == 0, c4 == 0).
        store_row(rg * 16 + g + 8 * h, i * 8 + 2 * c4, 2, vals, m[h], l[h]);
      }
    }
  } else {
    // Merge the key parts of each row group through shared memory.
    float* mo = reinterpret_cast<float*>(kv);                  // [WARPS][16][D]
    float* mml = mo + Cfg::kWarps * 16 * D;                    // [WARPS][16][2]
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* dst = mo + (warp * 16 + g + 8 * h) * D + i * 8 + 2 * c4;
        dst[0] = o[i][2 * h];
        dst[1] = o[i][2 * h + 1];
      }
    }
    if (c4 == 0) {
      for (int h = 0; h < 2; ++h) {
        mml[(warp * 16 + g + 8 * h) * 2] = m[h];
        mml[(warp * 16 + g + 8 * h) * 2 + 1] = l[h];
      }
    }
    __syncthreads();
    constexpr int kVec = 4;
    for (int i = tid; i < Cfg::kRowGroups * 16 * (D / kVec); i += NT) {
      const int row = i / (D / kVec), d0 = (i % (D / kVec)) * kVec;
      const int grp = row / 16, r16 = row % 16;
      float mm = -INFINITY;
      for (int w = 0; w < Cfg::kWpr; ++w)
        mm = fmaxf(mm, mml[((grp * Cfg::kWpr + w) * 16 + r16) * 2]);
      const float m_use = mm == -INFINITY ? 0.f : mm;
      float ll = 0.f, vals[kVec] = {0.f, 0.f, 0.f, 0.f};
      for (int w = 0; w < Cfg::kWpr; ++w) {
        const int ww = (grp * Cfg::kWpr + w) * 16 + r16;
        const float sc = exp2f(mml[ww * 2] - m_use);
        ll += mml[ww * 2 + 1] * sc;
        const float4 ov = *reinterpret_cast<const float4*>(mo + ww * D + d0);
        vals[0] += ov.x * sc;
        vals[1] += ov.y * sc;
        vals[2] += ov.z * sc;
        vals[3] += ov.w * sc;
      }
      store_row(row, d0, kVec, vals, mm, ll);
    }
  }
}

}  // namespace attnrt::cuda
