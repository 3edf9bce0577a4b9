// Prefill / extend attention on tensor cores (mma.m16n8k16), flash-attention-2 structure tuned for
// long query runs: EXTEND, MIXED and DRAFT_EXTEND steps whose CTAs hold 128 query rows, causal or
// not, with the cached prefix read from the paged pool.
//
// A CTA owns 128 flattened (token, head-in-group) rows of one KV head -- the same work items the
// plan builds for TileShape::prefill -- so each K/V tile is read once per GQA group. Differences
// from the general kernel in attention.cuh, each of which the H200 measurements motivated:
//  - head dims 64 / 128 give every warp 32 rows (two m16 blocks), so one ldmatrix of K or V feeds
//    twice as many MMAs; that halves shared-memory traffic per MMA, the limit of 16-row warps.
//    At head dim 128 the O accumulators (128 floats) leave no room for Q in registers: Q fragments
//    are re-read from shared memory per key tile (cheap next to K/V, shared by the two m blocks).
//  - 4-warp CTAs with a register cap of two (d128) or three (d64) CTAs per SM: independent CTAs
//    overlap one CTA's softmax with another's MMAs, which barrier-locked warps of one CTA cannot.
//  - a STAGES-deep K/V ring with ONE barrier per tile (the barrier that publishes tile i also
//    proves every warp is done with the stage that tile i + STAGES - 1 overwrites);
//  - page-table lookups for a whole tile issued before its copies (independent loads in flight,
//    not one dependent lookup per 16-byte chunk);
//  - masks evaluated only on tiles that straddle the causal diagonal, the window edge or the end
//    of the key range, and key tiles a warp cannot see at all skipped by that warp;
//  - exp2 with the softmax scale folded into one FFMA per logit, and the O rescale skipped when no
//    row maximum of the warp moved.
// Softcap and window stay run-time flags, tested once per tile outside the element loops: making
// them template parameters would double the instantiations (CI compiles these on two cores) for
// features the large prefill rows do not use.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/prefill.h"
#include "backends/cuda/kernels/primitives.cuh"

namespace attnrt::cuda {

template <int D, int WARPS, int MW, int BN, int STAGES, bool QREGS, int MIN_CTAS>
struct PrefillConfig {
  static constexpr int kHeadDim = D;
  static constexpr int kWarps = WARPS;
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kMw = MW;            // m16 row blocks per warp
  static constexpr int kBN = BN;            // keys per tile
  static constexpr int kStages = STAGES;    // K/V tiles resident (cp.async ring depth)
  static constexpr bool kQRegs = QREGS;     // Q fragments held in registers for the whole loop
  static constexpr int kMinCtas = MIN_CTAS; // CTAs per SM the register cap must allow
  static constexpr int kRows = WARPS * 16 * MW;
  static constexpr int kChunks = D / 8;  // 16-byte chunks of a 16-bit row
  static constexpr int kQBytes = kRows * D * 2;
  static constexpr int kTileElems = BN * D;  // one K or V tile
  static constexpr int kSmemBytes = kQBytes + STAGES * 2 * kTileElems * 2;
  // Tile copies: thread i moves chunk i % kChunks of keys i / kChunks + n * kKeysPerPass.
  static constexpr int kKeysPerPass = kThreads / kChunks;
  static constexpr int kPasses = BN / kKeysPerPass;
  static_assert(kRows == kPrefillTileRows, "prefill CTAs must match the plan's prefill tile");
  static_assert(kThreads % kChunks == 0 && BN % kKeysPerPass == 0 && BN % 16 == 0 &&
                STAGES >= 2 && D % 16 == 0);
};

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinCtas) prefill_kernel(const AttnParams p) {
  constexpr int D = Cfg::kHeadDim, BN = Cfg::kBN, MW = Cfg::kMw, ST = Cfg::kStages;
  constexpr int CH = Cfg::kChunks, NT = Cfg::kThreads, TE = Cfg::kTileElems;
  constexpr int WROWS = 16 * MW;  // rows per warp
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sKV = reinterpret_cast<T*>(smem + Cfg::kQBytes);  // stage s: K at s * 2 * TE, V after it

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;
  const int kvh = blockIdx.x;
  const WorkItem item = p.work[blockIdx.y];
  const ReqInfo req = p.reqs[item.req];
  const int G = p.group;
  const int t_first = item.f0 / G;
  const int t_last = min(req.qlen - 1, (item.f0 + Cfg::kRows - 1) / G);
  const bool causal = p.causal != 0;
  const bool windowed = causal && p.window >= 0;

  // Keys of this CTA's split: those the tile's rows can see, cut into num_splits chunks of whole
  // tiles (derived from lengths only, like the general kernel, so the plan stays kernel-agnostic).
  int hi = req.kv_len, lo = 0;
  if (causal) {
    hi = min(hi, req.prefix + t_last + 1);
    if (windowed) lo = max(0, req.prefix + t_first - p.window);
  }
  {
    const int span = max(hi - lo, 0);
    const int chunk = (span + req.num_splits - 1) / req.num_splits;
    const int chunk_tiles = (chunk + BN - 1) / BN * BN;
    lo += item.split * chunk_tiles;
    hi = min(lo + chunk_tiles, hi);
  }
  const int num_tiles = hi > lo ? (hi - lo + BN - 1) / BN : 0;

  // ---- Q: rows f0 .. f0 + 128 of the flattened (token, head-in-group) index; rows past the
  // request's tokens are zero (finite logits, never stored).
  {
    const T* q = static_cast<const T*>(p.q);
    for (int i = tid; i < Cfg::kRows * CH; i += NT) {
      const int r = i / CH, c = i % CH;
      const int f = item.f0 + r, t = f / G, hg = f - t * G;
      const bool valid = t < req.qlen;
      const T* src = valid ? q + (req.qo_start + t) * p.q_stride_tok +
                                 (kvh * G + hg) * p.q_stride_head + c * 8
                           : q;
      cp_async_16(sQ + r * D + swz(r, c) * 8, src, valid);
    }
  }

  // Pages that become committed with this step go back to the persistent row table, once per
  // launch, exactly as the general kernel does (see ReqInfo): other CTAs read those pages from
  // the step's array (j >= pt_known), so nothing reads what is written here.
  if (kvh == 0 && item.split == 0 && item.f0 == 0) {
    for (int j = req.pt_known + tid; j < req.pt_commit; j += NT)
      p.row_table[req.pt_row + j] = p.page_table[req.pt_start + j - req.pt_known];
  }

  // ---- K/V tile copies through the page table. All lookups of a tile are issued before its
  // copies so their latencies overlap.
  const int32_t* pt_step = p.page_table + req.pt_start - req.pt_known;
  const int32_t* pt_row = p.row_table != nullptr ? p.row_table + req.pt_row : nullptr;
  auto page_of = [&](int pj) -> int32_t { return pj < req.pt_known ? pt_row[pj] : pt_step[pj]; };
  const int pshift = p.page_shift, pmask = (1 << p.page_shift) - 1;
  const T* kbase = static_cast<const T*>(p.k) + kvh * D;
  const T* vbase = static_cast<const T*>(p.v) + kvh * D;
  const int ld_c = tid % CH, ld_key = tid / CH;
  auto load_tile = [&](int kb, int stage) {
    T* dk = sKV + stage * 2 * TE;
    T* dv = dk + TE;
    // Slots fit 32 bits (page ids are int32 and a pool of 2^31 tokens is far beyond any GPU).
    int32_t slot[Cfg::kPasses];
#pragma unroll
    for (int n = 0; n < Cfg::kPasses; ++n) {
      const int j = kb + ld_key + n * Cfg::kKeysPerPass;
      slot[n] = j < hi ? (page_of(j >> pshift) << pshift) | (j & pmask) : -1;
    }
    if (p.slot_map != nullptr) {
#pragma unroll
      for (int n = 0; n < Cfg::kPasses; ++n)
        if (slot[n] >= 0) slot[n] = static_cast<int32_t>(p.slot_map[slot[n]]);
    }
#pragma unroll
    for (int n = 0; n < Cfg::kPasses; ++n) {
      const int key = ld_key + n * Cfg::kKeysPerPass;
      const bool valid = slot[n] >= 0;
      const int64_t s = valid ? slot[n] : 0;
      const int so = key * D + swz(key, ld_c) * 8;
      cp_async_16(dk + so, kbase + s * p.k_row_stride + ld_c * 8, valid);
      cp_async_16(dv + so, vbase + s * p.v_row_stride + ld_c * 8, valid);
    }
  };

  // Prologue: tiles 0 .. ST - 2 (Q rides in the first group). Every loop iteration commits one
  // group, empty or not, so wait_group<ST - 2> at iteration i means "tile i has landed".
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < num_tiles) load_tile(lo + s * BN, s);
    cp_async_commit();
  }

  // Per-thread rows: g and g + 8 of each of the warp's m16 blocks.
  const int row0 = warp * WROWS;
  int row_t[MW][2];
#pragma unroll
  for (int mb = 0; mb < MW; ++mb)
#pragma unroll
    for (int h = 0; h < 2; ++h) row_t[mb][h] = (item.f0 + row0 + mb * 16 + g + 8 * h) / G;
  // Token range of the warp's rows (clamped to real tokens) for the per-tile mask decisions.
  const bool warp_idle = (item.f0 + row0) / G >= req.qlen;
  const int wt_lo = min((item.f0 + row0) / G, req.qlen - 1);
  const int wt_hi = min((item.f0 + row0 + WROWS - 1) / G, req.qlen - 1);

  const bool capped = p.softcap > 0.f;
  const float sl = capped ? 1.f : p.scale_log2;  // logit -> log2 units after the softcap pass
  const float cap_in = capped ? p.softmax_scale / p.softcap : 0.f;
  const float cap_out = p.softcap * 1.4426950408889634f;

  float o[MW][D / 8][4];
#pragma unroll
  for (int mb = 0; mb < MW; ++mb)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[mb][i][0] = o[mb][i][1] = o[mb][i][2] = o[mb][i][3] = 0.f;
  float m[MW][2], l[MW][2];
#pragma unroll
  for (int mb = 0; mb < MW; ++mb) m[mb][0] = m[mb][1] = -INFINITY, l[mb][0] = l[mb][1] = 0.f;
  uint32_t qf[Cfg::kQRegs ? MW : 1][Cfg::kQRegs ? D / 16 : 1][4];

  // ldmatrix addressing (see primitives.cuh for the fragment layouts): A rows / K keys / V keys
  // handled by this lane inside a 16-row block, and which 16-byte chunk of the pair it reads.
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_chk = lane >> 4;
  const int k_key = (lane & 7) + (lane >> 4) * 8, k_chk = (lane >> 3) & 1;
  const int v_key = (lane & 7) + ((lane >> 3) & 1) * 8, v_chk = lane >> 4;

  for (int it = 0; it < num_tiles; ++it) {
    cp_async_wait<ST - 2>();
    __syncthreads();
    if (it + ST - 1 < num_tiles) load_tile(lo + (it + ST - 1) * BN, (it + ST - 1) % ST);
    cp_async_commit();
    if constexpr (Cfg::kQRegs) {
      if (it == 0) {
#pragma unroll
        for (int mb = 0; mb < MW; ++mb)
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            const int r = row0 + mb * 16 + a_row;
            ldmatrix_x4(qf[mb][kk], sQ + r * D + swz(r, kk * 2 + a_chk) * 8);
          }
      }
    }
    const int kb = lo + it * BN;
    // A tile wholly right of every row's diagonal or left of every row's window is skipped, and
    // so is everything for a warp whose rows all lie past the request's last token.
    if (warp_idle || (causal && kb > req.prefix + wt_hi)) continue;
    if (windowed && kb + BN - 1 < req.prefix + wt_lo - p.window) continue;
    const T* tK = sKV + (it % ST) * 2 * TE;
    const T* tV = tK + TE;

    // ---- S = Q K^T.
    float s[MW][BN / 8][4];
#pragma unroll
    for (int mb = 0; mb < MW; ++mb)
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) s[mb][i][0] = s[mb][i][1] = s[mb][i][2] = s[mb][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      [[maybe_unused]] uint32_t qa[MW][4];
      if constexpr (!Cfg::kQRegs) {
#pragma unroll
        for (int mb = 0; mb < MW; ++mb) {
          const int r = row0 + mb * 16 + a_row;
          ldmatrix_x4(qa[mb], sQ + r * D + swz(r, kk * 2 + a_chk) * 8);
        }
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        const int key = np * 16 + k_key;
        uint32_t b[4];
        ldmatrix_x4(b, tK + key * D + swz(key, kk * 2 + k_chk) * 8);
#pragma unroll
        for (int mb = 0; mb < MW; ++mb) {
          if constexpr (Cfg::kQRegs) {
            mma_16816<T>(s[mb][2 * np], qf[mb][kk], b[0], b[1]);
            mma_16816<T>(s[mb][2 * np + 1], qf[mb][kk], b[2], b[3]);
          } else {
            mma_16816<T>(s[mb][2 * np], qa[mb], b[0], b[1]);
            mma_16816<T>(s[mb][2 * np + 1], qa[mb], b[2], b[3]);
          }
        }
      }
    }

    // ---- Softcap (log2 units afterwards), then the mask on tiles that need one.
    if (capped) {
#pragma unroll
      for (int mb = 0; mb < MW; ++mb)
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mb][nb][e] = cap_out * tanhf(s[mb][nb][e] * cap_in);
    }
    const bool need_mask = kb + BN > hi || (causal && kb + BN - 1 > req.prefix + wt_lo) ||
                           (windowed && kb < req.prefix + wt_hi - p.window);
    if (need_mask) {
#pragma unroll
      for (int mb = 0; mb < MW; ++mb)
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = kb + nb * 8 + 2 * c4 + (e & 1);
            const int qpos = req.prefix + row_t[mb][e >> 1];
            bool vis = j < hi;
            if (causal) vis = vis && j <= qpos;
            if (windowed) vis = vis && qpos - j <= p.window;
            if (!vis) s[mb][nb][e] = -INFINITY;
          }
    }

    // ---- Online softmax (rows g and g + 8 of each block; a quad of lanes shares a row). m is in
    // log2 units: p = 2^(s * sl - m), one FFMA and one MUFU per logit.
    bool moved = false;
    float alpha[MW][2];
#pragma unroll
    for (int mb = 0; mb < MW; ++mb)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
          mx = fmaxf(mx, fmaxf(s[mb][nb][2 * h], s[mb][nb][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m[mb][h], mx * sl);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        alpha[mb][h] = fast_exp2(m[mb][h] - m_use);
        moved = moved || m_new != m[mb][h];
        m[mb][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
          s[mb][nb][2 * h] = fast_exp2(fmaf(s[mb][nb][2 * h], sl, -m_use));
          s[mb][nb][2 * h + 1] = fast_exp2(fmaf(s[mb][nb][2 * h + 1], sl, -m_use));
          sum += s[mb][nb][2 * h] + s[mb][nb][2 * h + 1];
        }
        l[mb][h] = l[mb][h] * alpha[mb][h] + sum;
      }
    if (__any_sync(0xffffffff, moved)) {
#pragma unroll
      for (int mb = 0; mb < MW; ++mb)
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          o[mb][i][0] *= alpha[mb][0];
          o[mb][i][1] *= alpha[mb][0];
          o[mb][i][2] *= alpha[mb][1];
          o[mb][i][3] *= alpha[mb][1];
        }
    }

    // ---- O += P V: P (accumulator layout) becomes the A operand 16 keys at a time.
#pragma unroll
    for (int k16 = 0; k16 < BN / 16; ++k16) {
      uint32_t pa[MW][4];
#pragma unroll
      for (int mb = 0; mb < MW; ++mb) {
        pa[mb][0] = pack2<T>(s[mb][2 * k16][0], s[mb][2 * k16][1]);
        pa[mb][1] = pack2<T>(s[mb][2 * k16][2], s[mb][2 * k16][3]);
        pa[mb][2] = pack2<T>(s[mb][2 * k16 + 1][0], s[mb][2 * k16 + 1][1]);
        pa[mb][3] = pack2<T>(s[mb][2 * k16 + 1][2], s[mb][2 * k16 + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int key = k16 * 16 + v_key;
        uint32_t b[4];
        ldmatrix_x4_trans(b, tV + key * D + swz(key, dp * 2 + v_chk) * 8);
#pragma unroll
        for (int mb = 0; mb < MW; ++mb) {
          mma_16816<T>(o[mb][2 * dp], pa[mb], b[0], b[1]);
          mma_16816<T>(o[mb][2 * dp + 1], pa[mb], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- Epilogue: finish the row sums, then write the output (or this split's partial).
  const bool split = req.num_splits > 1;
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int mb = 0; mb < MW; ++mb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float ll = l[mb][h];
      ll += __shfl_xor_sync(0xffffffff, ll, 1);
      ll += __shfl_xor_sync(0xffffffff, ll, 2);
      const float mm = m[mb][h];
      const int f = item.f0 + row0 + mb * 16 + g + 8 * h;
      const int t = row_t[mb][h], hg = f - t * G;
      if (t >= req.qlen) continue;
      const int head = kvh * G + hg;
      if (split) {
        const int64_t prow = req.part_start + static_cast<int64_t>(item.split) * req.qlen + t;
        const float inv = ll > 0.f ? 1.f / ll : 0.f;
        float* dst = p.part_o + (prow * p.num_q_heads + head) * D + 2 * c4;
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb)
          *reinterpret_cast<float2*>(dst + nb * 8) =
              make_float2(o[mb][nb][2 * h] * inv, o[mb][nb][2 * h + 1] * inv);
        if (c4 == 0) p.part_lse[prow * p.num_q_heads + head] = ll > 0.f ? mm + log2f(ll) : -INFINITY;
      } else {
        const float m_use = mm == -INFINITY ? 0.f : mm;
        float den = ll;
        if (p.sinks != nullptr) den += fast_exp2(p.sinks[head] * kLog2e - m_use);
        const float inv = den > 0.f ? p.v_scale / den : 0.f;
        T* dst = static_cast<T*>(p.out) + (req.qo_start + t) * p.o_stride_tok +
                 head * p.o_stride_head + 2 * c4;
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb)
          *reinterpret_cast<uint32_t*>(dst + nb * 8) =
              pack2<T>(o[mb][nb][2 * h] * inv, o[mb][nb][2 * h + 1] * inv);
        if (p.lse_out != nullptr && c4 == 0)
          p.lse_out[(req.qo_start + t) * p.lse_stride_tok + head] = (m_use + log2f(den)) * kLn2;
      }
    }
}

// Per head dim: 4 warps x 32 rows at 64 / 128 (Q in registers at 64, re-read at 128, where the
// O accumulators take the registers), 8 warps x 16 rows at 256 (O alone is 128 floats per thread).
template <int D>
using PrefillCfg = std::conditional_t<
    D == 64, PrefillConfig<64, 4, 2, 64, 3, true, 2>,
    std::conditional_t<D == 128, PrefillConfig<128, 4, 2, 64, 2, false, 2>,
                       PrefillConfig<256, 8, 1, 64, 2, false, 1>>>;
template <typename T, typename Cfg>
cudaError_t launch_prefill_cfg(const AttnParams& p, int num_items, cudaStream_t stream) {
  static const cudaError_t attr =
      cudaFuncSetAttribute(prefill_kernel<T, Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           Cfg::kSmemBytes);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(p.num_kv_heads, num_items);
  prefill_kernel<T, Cfg><<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <int D>
cudaError_t launch_prefill_dim(const AttnParams& p, bool fp16, int num_items, cudaStream_t stream) {
  return fp16 ? launch_prefill_cfg<__half, PrefillCfg<D>>(p, num_items, stream)
              : launch_prefill_cfg<__nv_bfloat16, PrefillCfg<D>>(p, num_items, stream);
}

}  // namespace attnrt::cuda
