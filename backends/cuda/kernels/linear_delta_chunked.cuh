// The chunked (WY / UT) form of the delta rule for extend steps (reference-semantics §8.9.1 GDN,
// §8.9.2 KDA) behind launch_delta_chunked (linear.h). Per chunk of 64 tokens of one request and
// one value head, with G_t = the cumulative log decay inside the chunk (per key channel for kda):
//   kk[t][i] = sum_c k_t[c] k_i[c] e^{G_t[c] - G_i[c]}   (i < t),   qk likewise with q_t (i <= t)
//   (I + diag(beta) kk) X = diag(beta) [e^G (.) K | V]   ->   W = X[:, :Dk], U = X[:, Dk:]
//   per chunk, in order:  u = U - W S^T
//                         o = (e^G (.) Q) S^T + qk u
//                         S = S (.) e^{G_last} + u^T (e^{G_last - G} (.) K)
// (S is the slot's [Dv, Dk] state.) Three kernels:
//   1. chunk table: where each request's chunks sit in the workspace (one block, a scan);
//   2. prep, one CTA per (chunk, head), everything that does not depend on the state: the
//      normalised q / k, the gates, kk and qk (tensor cores), X, and the state pass's operands in
//      bf16. GDN and KDA have separate prep kernels: GDN's gate is one scalar per token, so its
//      decays are 64-entry tables and q / k live only as bf16 operands; it solves for X as
//      T diag(beta) X0 with T = (I + diag(beta) kk)^{-1} inverted in fp32 by 16x16 blocks and the
//      product on tensor cores (bf16 hi + lo splits), V arriving by cp.async behind the q / k
//      loads; two CTAs fit an SM. KDA keeps q / k / G per channel in fp32 and a forward
//      substitution (fp32, one column of X per thread, 16 rows at a time in registers; ~195 KB,
//      one CTA per SM);
//   3. state pass, one CTA per (request, value head), warp specialised: a producer warp copies
//      each chunk's unit (linear_delta_layout.h: the 16-bit operands already in the wgmma
//      swizzled layout) into a two-stage ring with bulk copies completing on mbarriers; one
//      consumer warpgroup per 64 value rows keeps its rows of S in fp32 wgmma accumulators across
//      the request's chunks and runs every product with S or u^T as the register A operand, in
//      the transposed orientation (value rows as M): u^T = U^T - S W^T, o^T = S Qd^T + u^T Mqk^T,
//      S = S (.) el + u^T Kl. The outputs go out through a per-warp staging tile (no per-chunk
//      states stored).
// KDA's pairwise decay ratios are never formed as e^{G_t} e^{-G_i} over a whole chunk: the
// off-diagonal 16-token blocks factor through the first token r of the row block
// (e^{G_t - G_r} and e^{G_r - G_i}, both <= 1), and the diagonal blocks take the ratio per pair.
//
// This header holds what the kernels share: the tile sizes, the workspace layout (the unit's
// inside: linear_delta_layout.h) and the MMA fragment access of the prep kernels;
// linear_delta_prep.cu holds the prep kernels, linear_delta_chunked.cu the chunk table, the state
// pass and the launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/linear.h"
#include "backends/cuda/kernels/linear_delta_layout.h"

namespace attnrt::cuda::linear::delta {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;  // prep

// Workspace: the chunk table, then one unit of chunk operands per (chunk slot, value head).
struct Layout {
  int64_t bound = 0;  // chunk slots: num_tokens / 64 + num_reqs >= sum of ceil(tokens / 64)
  int64_t coff_off = 0, table_off = 0, units_off = 0, total = 0;
  // Inside a unit (bytes, unit_layout): W, Qd [64, Dk] bf16; KlT [Dk, 64] bf16; Mqk [64, 64]
  // bf16 (all four swizzled); U^T [Dv, 64] fp32 (swizzled); el [Dk] fp32.
  int64_t w_off = 0, qd_off = 0, klt_off = 0, m_off = 0, u_off = 0, el_off = 0, unit_bytes = 0;
};

inline int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

inline Layout make_layout(int num_reqs, int64_t num_tokens, int dk, int dv, int heads) {
  Layout L;
  L.bound = num_tokens / kChunk + num_reqs;
  L.coff_off = 0;
  L.table_off = align_up(static_cast<int64_t>(num_reqs + 1) * 4, 256);
  L.units_off = align_up(L.table_off + L.bound * 4, 256);
  const UnitLayout u = unit_layout(dk, dv);
  L.w_off = u.w;
  L.qd_off = u.qd;
  L.klt_off = u.klt;
  L.m_off = u.m;
  L.u_off = u.u;
  L.el_off = u.el;
  L.unit_bytes = u.bytes;
  L.total = L.units_off + L.bound * heads * L.unit_bytes;
  return L;
}

__device__ __forceinline__ int chunks_of(int32_t tokens) {
  return tokens > 0 ? (tokens + kChunk - 1) / kChunk : 0;
}

// MMA operands from shared memory, both stored with the reduction index contiguous: A [m][k]
// (row stride `ld` elements) and B as [n][k]. Rows padded by 8 elements make the 32-bit loads of
// a fragment hit 32 different banks.
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const bf16* s, int ld, int m0, int k0) {
  const int g = (threadIdx.x & 31) >> 2, c = k0 + 2 * (threadIdx.x & 3);
  a[0] = *reinterpret_cast<const uint32_t*>(s + (m0 + g) * ld + c);
  a[1] = *reinterpret_cast<const uint32_t*>(s + (m0 + g + 8) * ld + c);
  a[2] = *reinterpret_cast<const uint32_t*>(s + (m0 + g) * ld + c + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(s + (m0 + g + 8) * ld + c + 8);
}
__device__ __forceinline__ void frag_b(uint32_t& b0, uint32_t& b1, const bf16* s, int ld, int n0,
                                       int k0) {
  const int g = (threadIdx.x & 31) >> 2, c = k0 + 2 * (threadIdx.x & 3);
  b0 = *reinterpret_cast<const uint32_t*>(s + (n0 + g) * ld + c);
  b1 = *reinterpret_cast<const uint32_t*>(s + (n0 + g) * ld + c + 8);
}
// Row / column of accumulator element e (0..3) of a 16x8 tile at (m0, n0).
__device__ __forceinline__ int acc_row(int m0, int e) {
  return m0 + ((threadIdx.x & 31) >> 2) + (e >= 2 ? 8 : 0);
}
__device__ __forceinline__ int acc_col(int n0, int e) {
  return n0 + 2 * (threadIdx.x & 3) + (e & 1);
}
__device__ __forceinline__ void store_bf16x2(bf16* dst, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(dst) = pack2<bf16>(lo, hi);
}

// The chunk of a prep CTA: chunk slot `slot` of the workspace for value head h. Y: y's element
// type (float or bf16, linear.h's y_dtype).
template <typename Y>
struct PrepChunk {
  // Its request; < 0: the slot is past the step's chunks (nothing else is set).
  int r;
  LinReq req;
  int n;         // tokens in the chunk (kChunk but at a request's end)
  int64_t tok0;  // the chunk's first token
  const Y* yq;   // y columns of the head's q and k (its key head's) and of its v
  const Y* yk;
  const Y* yv;
};
template <int DK, int DV, typename Y>
__device__ __forceinline__ PrepChunk<Y> prep_chunk(const DeltaParams& p, const Layout& L,
                                                   const char* ws, int slot, int h) {
  PrepChunk<Y> c;
  c.r = reinterpret_cast<const int32_t*>(ws + L.table_off)[slot];
  if (c.r < 0) return c;
  c.req = p.step.reqs[c.r];
  const int j = slot - reinterpret_cast<const int32_t*>(ws + L.coff_off)[c.r];
  c.n = min(kChunk, c.req.tokens - j * kChunk);
  c.tok0 = c.req.token_start + static_cast<int64_t>(j) * kChunk;
  const int hv = p.state.heads, hk = p.key_heads;
  const int kh = h / (hv / hk);
  const Y* y = static_cast<const Y*>(p.y);
  c.yq = y + static_cast<int64_t>(kh) * DK;
  c.yk = y + static_cast<int64_t>(hk + kh) * DK;
  c.yv = y + static_cast<int64_t>(2 * hk) * DK + static_cast<int64_t>(h) * DV;
  return c;
}

// The operands a prep CTA writes for the state pass: the workspace unit of (slot, h); element
// (row, col) of each array at wq_elem / klt_elem / mqk_elem / ut_elem (linear_delta_layout.h).
struct PrepUnit {
  bf16* W;
  bf16* Qd;
  bf16* KlT;
  bf16* Mqk;
  float* U;  // U^T
  float* el;
};
__device__ __forceinline__ PrepUnit prep_unit(const Layout& L, char* ws, int slot, int hv, int h) {
  char* unit = ws + L.units_off + (static_cast<int64_t>(slot) * hv + h) * L.unit_bytes;
  return {reinterpret_cast<bf16*>(unit + L.w_off),   reinterpret_cast<bf16*>(unit + L.qd_off),
          reinterpret_cast<bf16*>(unit + L.klt_off), reinterpret_cast<bf16*>(unit + L.m_off),
          reinterpret_cast<float*>(unit + L.u_off),  reinterpret_cast<float*>(unit + L.el_off)};
}

// Launches the prep kernel of the step (GDN or KDA by p.kda, Dk = Dv = p.state.cols, 64 or 128;
// y as p.y_dtype, f32 or bf16, 16-byte aligned) over the chunk slots of layout L in workspace ws,
// after the chunk table.
cudaError_t launch_prep(const DeltaParams& p, const Layout& L, char* ws, cudaStream_t stream);

}  // namespace attnrt::cuda::linear::delta
