// The tile kernel of the cpu backend (extend, prefill, verify chains and trees, draft extend):
// flash-style tiles with query rows (tokens x heads of a GQA group) in the vector lanes, K/V blocks
// widened to fp32 once per tile, and where q, K/V and the output are bf16 and HasBf16Dot(), the
// bf16 dot-product (vdpbf16ps) form with its score, softmax and value micro-kernels. Compiled once
// per Highway target (foreach_target); run_tile_item() dispatches to the one chosen at run time.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "backends/cpu/kernels/item_kernels.h"
#include "backends/cpu/kernels/hwy_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/kernels/tile_kernel.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "backends/cpu/kernels/kernel_common-inl.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attnrt::cpu {
namespace HWY_NAMESPACE {

constexpr float kLog2e = 1.44269504f;
constexpr float kLn2 = 0.693147181f;
// Keys per block of the tile kernel (a multiple of kTileKeyStep), and of its bf16 form: twice as
// many halve the per-block work (pairing V, rescaling O^T) per vdpbf16ps.
constexpr int kTileKeys = 32;
// Dims per partial sum of the fp32 score micro-kernel.
constexpr int kScoreChunk = 32;
constexpr int kDotKeys = 64;
// Register blocking of the fp32 tile: keys per S^T step and value dims per O^T step, over panels
// of kWideTile row vectors. Where the register file holds 32 vectors (AVX-512): 4 x 4
// accumulators. Where it holds 16 (AVX2): 6 x 2, twelve independent FMA chains (4 x 2 left the
// two FMA pipes waiting on latency), their operands and a broadcast fill the other four.
constexpr int kTileKeyStep = HWY_TARGET <= HWY_AVX3 ? 4 : 6;
constexpr int kTileDvStep = HWY_TARGET <= HWY_AVX3 ? 4 : 6;

// ------------------------------------------------------------------------------------------------
// fp32 micro-kernels: P row vectors (from row vector v0 of the tile, rl rows wide) at a time.

// S^T[j + kk][rows] = sum_d K[j + kk][d] * Q^T[d][rows] for kTileKeyStep keys of kb (rows
// kstride floats apart).
template <int P>
HWY_INLINE void ScorePanel(const float* qt, int rl, int v0, const float* kb, int kstride, int dim,
                           float* st) {
  const DF df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  // Dims are summed in chunks whose sums are then added: one FMA chain over all of MLA's 576
  // dims loses about four times the accuracy of the decode kernel's lane-split sums, which showed
  // as verify steps (this kernel) drifting from decode steps (that one) in float32 models.
  VF sum[kTileKeyStep][P];
  for (int d0 = 0; d0 < dim; d0 += kScoreChunk) {
    VF acc[kTileKeyStep][P];
    for (int kk = 0; kk < kTileKeyStep; ++kk) {
      for (int v = 0; v < P; ++v) acc[kk][v] = hn::Zero(df);
    }
    for (int d = d0; d < std::min(dim, d0 + kScoreChunk); ++d) {
      VF qv[P];
      for (int v = 0; v < P; ++v) {
        qv[v] = hn::Load(df, qt + static_cast<size_t>(d) * rl + (v0 + v) * lanes);
      }
      for (int kk = 0; kk < kTileKeyStep; ++kk) {
        const VF kv = hn::Set(df, kb[static_cast<size_t>(kk) * kstride + d]);
        for (int v = 0; v < P; ++v) acc[kk][v] = hn::MulAdd(kv, qv[v], acc[kk][v]);
      }
    }
    for (int kk = 0; kk < kTileKeyStep; ++kk) {
      for (int v = 0; v < P; ++v) sum[kk][v] = d0 == 0 ? acc[kk][v] : hn::Add(sum[kk][v], acc[kk][v]);
    }
  }
  for (int kk = 0; kk < kTileKeyStep; ++kk) {
    for (int v = 0; v < P; ++v) {
      hn::Store(sum[kk][v], df, st + static_cast<size_t>(kk) * rl + (v0 + v) * lanes);
    }
  }
}

// O^T[d][rows] = O^T[d][rows] * alpha + sum_j V[j][d] * P^T[j][rows] for DV value dims from d0, n
// keys of vb (rows vstride floats apart), P^T in pt.
template <int P, int DV>
HWY_INLINE void ValuePanel(const float* pt, int rl, int v0, const float* vb, int vstride, int n,
                           int d0, const float* alpha, float* ot) {
  const DF df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  VF o[DV][P];
  for (int v = 0; v < P; ++v) {
    const VF al = hn::Load(df, alpha + (v0 + v) * lanes);
    for (int dd = 0; dd < DV; ++dd) {
      o[dd][v] =
          hn::Mul(hn::Load(df, ot + static_cast<size_t>(d0 + dd) * rl + (v0 + v) * lanes), al);
    }
  }
  for (int j = 0; j < n; ++j) {
    VF pv[P];
    for (int v = 0; v < P; ++v) {
      pv[v] = hn::Load(df, pt + static_cast<size_t>(j) * rl + (v0 + v) * lanes);
    }
    const float* vr = vb + static_cast<size_t>(j) * vstride + d0;
    for (int dd = 0; dd < DV; ++dd) {
      const VF vv = hn::Set(df, vr[dd]);
      for (int v = 0; v < P; ++v) o[dd][v] = hn::MulAdd(vv, pv[v], o[dd][v]);
    }
  }
  for (int dd = 0; dd < DV; ++dd) {
    for (int v = 0; v < P; ++v) {
      hn::Store(o[dd][v], df, ot + static_cast<size_t>(d0 + dd) * rl + (v0 + v) * lanes);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// bf16 micro-kernels (vdpbf16ps, where HasBf16Dot()).

#if ATTNRT_BF16_DOT

// Register blocks of the tile kernel's bf16 micro-kernels: keys (scores) and value dims (P.V) per
// step, for NV vectors of query rows. Four row vectors (64 rows) take 16 accumulators, the rest
// 8 x NV; either way loads and broadcasts stay well under one per vdpbf16ps.
template <int NV>
constexpr int kPairKeys = NV >= 4 ? 4 : 8;
template <int NV>
constexpr int kPairDv = NV >= 4 ? 4 : 8;

// S^T[j][rows] = sum over dim pairs of K[j] . Q^T for n_step keys (a multiple of kPairKeys); k holds
// the keys' rows as bf16 pairs, qp the pairs of Q^T ([pairs][rl]). bmax[rows] = the largest raw
// score of the n real keys (the rest are padding), taken from the accumulators before the store
// so that the softmax of an unmasked block needs no pass of its own for it. A NaN score is left
// out of the maximum (vmaxps returns its second operand when either is NaN).
template <int NV>
ATTNRT_BF16_FN void ScoresBf16(const uint32_t* const* k, int n, int n_step, int pairs,
                               const uint32_t* qp, int rl, float* st, float* bmax) {
  constexpr int kKeys = kPairKeys<NV>;
  __m512 bm[NV];
  for (int v = 0; v < NV; ++v) bm[v] = _mm512_set1_ps(kNegInf);
  for (int j = 0; j < n_step; j += kKeys) {
    __m512 acc[kKeys][NV];
    for (int kk = 0; kk < kKeys; ++kk) {
      for (int v = 0; v < NV; ++v) acc[kk][v] = _mm512_setzero_ps();
    }
    const uint32_t* kr[kKeys];
    for (int kk = 0; kk < kKeys; ++kk) kr[kk] = k[j + kk];
    for (int d = 0; d < pairs; ++d) {
      __m512bh q[NV];
      for (int v = 0; v < NV; ++v) {
        q[v] = (__m512bh)_mm512_loadu_si512(qp + static_cast<size_t>(d) * rl + v * 16);
      }
      for (int kk = 0; kk < kKeys; ++kk) {
        const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(kr[kk][d]));
        for (int v = 0; v < NV; ++v) acc[kk][v] = _mm512_dpbf16_ps(acc[kk][v], q[v], kv);
      }
    }
    for (int kk = 0; kk < kKeys; ++kk) {
      for (int v = 0; v < NV; ++v) {
        _mm512_storeu_ps(st + static_cast<size_t>(j + kk) * rl + v * 16, acc[kk][v]);
        if (j + kk < n) bm[v] = _mm512_max_ps(acc[kk][v], bm[v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(bmax + v * 16, bm[v]);
}

// 2^x for x <= 0 (a score minus its row's running maximum, in log2 units): x = n + f with n an
// integer and |f| <= 1/2, 2^f from its Taylor polynomial of degree 5 (relative error below 3.3e-6,
// far under the bf16 rounding the probabilities get next), 2^n applied by vscalefps. -inf (a masked
// key) clamps to -200, whose power underflows to exactly 0. NaN (a NaN in a visible key's K) stays
// NaN, so that the row's sum carries it (vmaxps returns its second operand when one is NaN).
ATTNRT_BF16_FN HWY_INLINE __m512 Exp2NonPositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-200.f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Online softmax of one block in log2 units, written straight as the bf16 pairs P.V reads:
// pp[jp][rows] = bf16(p[2 jp]) | bf16(p[2 jp + 1]) << 16 with p = 2^(s * c - m), n real keys of
// st ([keys][rl]) and a zero past them. bmax[rows]: the block's largest s * c. Updates m (log2
// units) and l, and leaves the factor the accumulated values must be scaled by in alpha.
template <int NV>
ATTNRT_BF16_FN void SoftmaxPairsBf16(const float* st, int n, int rl, float c, const float* bmax,
                                     float* m, float* l, float* alpha, uint32_t* pp) {
  // Word i of the result takes bf16 word i of the low half (key 2 jp) and word 16 + i (key
  // 2 jp + 1) of vcvtne2ps2bf16's output.
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                          21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                          11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512 vc = _mm512_set1_ps(c);
  const int npairs = (n + 1) / 2;
  for (int v = 0; v < NV; ++v) {
    const __m512 m_old = _mm512_loadu_ps(m + v * 16);
    const __m512 m_new = _mm512_max_ps(_mm512_loadu_ps(bmax + v * 16), m_old);
    // A row with no visible key so far keeps m = -inf; its scores are all -inf, weight 0.
    const __mmask16 empty = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);
    const __m512 m_use = _mm512_mask_blend_ps(empty, m_new, _mm512_setzero_ps());
    const __m512 neg_m = _mm512_sub_ps(_mm512_setzero_ps(), m_use);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    const float* s = st + v * 16;
    uint32_t* out = pp + v * 16;
    for (int jp = 0; jp < npairs; ++jp) {
      const size_t j0 = static_cast<size_t>(2 * jp) * rl;
      const __m512 e0 = Exp2NonPositive(_mm512_fmadd_ps(_mm512_loadu_ps(s + j0), vc, neg_m));
      const __m512 e1 = 2 * jp + 1 < n
                            ? Exp2NonPositive(_mm512_fmadd_ps(_mm512_loadu_ps(s + j0 + rl), vc, neg_m))
                            : _mm512_setzero_ps();
      sum0 = _mm512_add_ps(sum0, e0);
      sum1 = _mm512_add_ps(sum1, e1);
      const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
      _mm512_storeu_si512(out + static_cast<size_t>(jp) * rl,
                          _mm512_permutexvar_epi16(interleave, words));
    }
    const __m512 al = Exp2NonPositive(_mm512_sub_ps(m_old, m_use));
    _mm512_storeu_ps(m + v * 16, m_new);
    _mm512_storeu_ps(alpha + v * 16, al);
    _mm512_storeu_ps(l + v * 16,
                     _mm512_fmadd_ps(_mm512_loadu_ps(l + v * 16), al, _mm512_add_ps(sum0, sum1)));
  }
}

// vp[jp][d] = V[2 jp][d] | V[2 jp + 1][d] << 16: value rows paired along the keys.
ATTNRT_BF16_FN void PairValues(const uint16_t* const* v, int n, int vdim, const uint16_t* zero,
                               uint32_t* vp) {
  const __m512i lo = _mm512_load_si512(kPairLo), hi = _mm512_load_si512(kPairHi);
  for (int jp = 0; jp * 2 < n; ++jp) {
    const uint16_t* a = v[2 * jp];
    const uint16_t* b = 2 * jp + 1 < n ? v[2 * jp + 1] : zero;
    uint32_t* dst = vp + static_cast<size_t>(jp) * vdim;
    int d = 0;
    for (; d + 32 <= vdim; d += 32) {
      const __m512i va = _mm512_loadu_si512(a + d), vb = _mm512_loadu_si512(b + d);
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
    for (; d < vdim; ++d) dst[d] = a[d] | static_cast<uint32_t>(b[d]) << 16;
  }
}

// O^T[d][rows] = O^T[d][rows] * alpha + sum over key pairs of V pairs . P pairs.
template <int NV>
ATTNRT_BF16_FN void ValuesBf16(const uint32_t* vp, const uint32_t* pp, int npairs, int vdim, int rl,
                               const float* alpha, float* ot) {
  constexpr int kDims = kPairDv<NV>;
  __m512 al[NV];
  for (int v = 0; v < NV; ++v) al[v] = _mm512_loadu_ps(alpha + v * 16);
  int d0 = 0;
  for (; d0 + kDims <= vdim; d0 += kDims) {
    __m512 o[kDims][NV];
    for (int dd = 0; dd < kDims; ++dd) {
      for (int v = 0; v < NV; ++v) {
        o[dd][v] = _mm512_mul_ps(_mm512_loadu_ps(ot + static_cast<size_t>(d0 + dd) * rl + v * 16), al[v]);
      }
    }
    for (int jp = 0; jp < npairs; ++jp) {
      __m512bh pv[NV];
      for (int v = 0; v < NV; ++v) {
        pv[v] = (__m512bh)_mm512_loadu_si512(pp + static_cast<size_t>(jp) * rl + v * 16);
      }
      const uint32_t* vr = vp + static_cast<size_t>(jp) * vdim + d0;
      for (int dd = 0; dd < kDims; ++dd) {
        const __m512bh vv = (__m512bh)_mm512_set1_epi32(static_cast<int>(vr[dd]));
        for (int v = 0; v < NV; ++v) o[dd][v] = _mm512_dpbf16_ps(o[dd][v], pv[v], vv);
      }
    }
    for (int dd = 0; dd < kDims; ++dd) {
      for (int v = 0; v < NV; ++v) {
        _mm512_storeu_ps(ot + static_cast<size_t>(d0 + dd) * rl + v * 16, o[dd][v]);
      }
    }
  }
  for (; d0 < vdim; ++d0) {
    __m512 o[NV];
    for (int v = 0; v < NV; ++v) {
      o[v] = _mm512_mul_ps(_mm512_loadu_ps(ot + static_cast<size_t>(d0) * rl + v * 16), al[v]);
    }
    for (int jp = 0; jp < npairs; ++jp) {
      const __m512bh vv = (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[static_cast<size_t>(jp) * vdim + d0]));
      for (int v = 0; v < NV; ++v) {
        o[v] = _mm512_dpbf16_ps(
            o[v], (__m512bh)_mm512_loadu_si512(pp + static_cast<size_t>(jp) * rl + v * 16), vv);
      }
    }
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ot + static_cast<size_t>(d0) * rl + v * 16, o[v]);
  }
}

#endif  // ATTNRT_BF16_DOT

// ------------------------------------------------------------------------------------------------
// Tile kernel: NV vectors of query rows. kDot: bf16 q and K/V through vdpbf16ps (Q^T and K kept as
// bf16 pairs, the softmax scale applied to the scores) instead of fp32 FMA on widened blocks.

template <DType DT, int NV, bool kDot>
void TileItem(const LayerArgs& a, const KernelPlan& p, const WorkItem& it, int kv_head) {
  using T = typename KvElem<DT>::T;
  const DF df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  const int rl = NV * lanes;  // row lanes
  const RequestInfo& r = p.reqs[it.req];
  const int ng = it.g1 - it.g0;
  const int nrows = (it.t1 - it.t0) * ng;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int dim = a.head_dim, vdim = a.v_head_dim;
  const int kdim = std::max(dim, vdim);
  const bool tree = a.causal && r.tree >= 0;
  const int ndraft = tree ? r.qlen : 0;
  const RowMap rows{r.q_row, it.t0, it.g0, ng, group, kv_head};
  constexpr int kKeys = kDot ? kDotKeys : kTileKeys;
  // Row vectors per pass of the fp32 micro-kernels (tiles of more are run in panels).
  constexpr int kPanel = NV < kWideTile ? NV : kWideTile;
  static_assert(NV % kPanel == 0, "whole panels");

  Arena arena;
  arena.reserve(static_cast<size_t>(dim) * rl);         // Q^T (fp32, or bf16 pairs)
  // A block of K (padded to whole key steps), then of V unless V is a view of K's rows.
  arena.reserve(static_cast<size_t>(kKeys + kTileKeyStep) * kdim);
  arena.reserve(static_cast<size_t>(kKeys) * rl);   // S^T, then P^T
  arena.reserve(static_cast<size_t>(kKeys) * rl);   // P^T as bf16 pairs
  arena.reserve(static_cast<size_t>(vdim) * rl);        // O^T
  for (int k = 0; k < 5; ++k) arena.reserve(rl);        // m, l, alpha, query positions, maxima
  arena.reserve(static_cast<size_t>(ndraft) * rl);      // tree visibility per draft key
  arena.reserve(kdim);                                  // a zero row
  arena.bind(t_scratch.get(arena.total()));
  float* qt = arena.take(static_cast<size_t>(dim) * rl);
  float* kvf = arena.take(static_cast<size_t>(kKeys + kTileKeyStep) * kdim);
  float* st = arena.take(static_cast<size_t>(kKeys) * rl);
  [[maybe_unused]] float* pairs_p = arena.take(static_cast<size_t>(kKeys) * rl);
  float* ot = arena.take(static_cast<size_t>(vdim) * rl);
  float* m = arena.take(rl);
  float* l = arena.take(rl);
  float* alpha = arena.take(rl);
  float* qpos = arena.take(rl);
  [[maybe_unused]] float* smax = arena.take(rl);
  float* tvis = arena.take(static_cast<size_t>(ndraft) * rl);
  float* zero_row = arena.take(kdim);

  // Q^T (fp32 pre-scaled, or raw bf16 pairs); padding lanes stay zero and copy the last row's
  // position so that they never see an empty key set.
  std::fill(qt, qt + static_cast<size_t>(dim) * rl, 0.f);
  float min_pos = std::numeric_limits<float>::max(), max_pos = 0.f;
  for (int i = 0; i < rl; ++i) {
    const int row = std::min(i, nrows - 1);
    const int t = it.t0 + row / ng;
    qpos[i] = static_cast<float>(r.prefix + (tree ? p.tree_depth[r.tree + t] : t));
    if (i >= nrows) continue;
    min_pos = std::min(min_pos, qpos[i]);
    max_pos = std::max(max_pos, qpos[i]);
    const int64_t base = rows.token_row(i) * a.q_stride[0] + rows.head(i) * a.q_stride[1];
    if constexpr (kDot) {
      const uint16_t* q = static_cast<const uint16_t*>(a.q) + base;
      uint32_t* qp = reinterpret_cast<uint32_t*>(qt);
      for (int d = 0; d < dim / 2; ++d) {
        qp[static_cast<size_t>(d) * rl + i] = q[2 * d * a.q_stride[2]] |
                                              static_cast<uint32_t>(q[(2 * d + 1) * a.q_stride[2]]) << 16;
      }
    } else {
      // Widened in vectors, then scattered into Q^T's column (the zero row is free until the
      // key blocks start).
      LoadQueryRow(a.q, a.q_dtype, base, a.q_stride[2], dim, zero_row);
      for (int d = 0; d < dim; ++d) qt[static_cast<size_t>(d) * rl + i] = zero_row[d] * a.qk_scale;
    }
  }
  std::fill(zero_row, zero_row + kdim, 0.f);
  for (int u = 0; u < ndraft; ++u) {
    for (int i = 0; i < rl; ++i) {
      const int t = it.t0 + std::min(i, nrows - 1) / ng;
      const uint64_t word = p.tree_mask[static_cast<size_t>(r.tree + t) * p.tree_words + u / 64];
      tvis[static_cast<size_t>(u) * rl + i] = (word >> (u % 64)) & 1 ? 1.f : 0.f;
    }
  }
  std::fill(ot, ot + static_cast<size_t>(vdim) * rl, 0.f);
  std::fill(m, m + rl, kNegInf);
  std::fill(l, l + rl, 0.f);

  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  // MLA: V is the first vdim columns of the latent K row, already widened with it.
  const bool v_in_k = a.v_cache == a.k_cache && a.v_row_stride == a.k_row_stride && vdim <= dim &&
                      (kv_head == 0 || vdim == dim);
  const int32_t* slots = p.slots + r.slot_offset;
  const VF neg_inf = hn::Set(df, kNegInf);
  const VF zero = hn::Zero(df);
  const VF window = hn::Set(df, static_cast<float>(a.window));
  // Row of key j of the block, or null for a key the SWA pool no longer holds (outside every
  // window of this tile): zeros stand in for whatever the dummy row contains.
  auto key_row = [&](const T* cache, int64_t row_stride, int width, int key) -> const T* {
    const int64_t slot = slots[key];
    if (p.zero_slot_is_absent && slot == 0) return nullptr;
    return cache + slot * row_stride + static_cast<int64_t>(kv_head) * width;
  };

  for (int kb = it.k0; kb < it.k1; kb += kKeys) {
    const int n = std::min(kKeys, it.k1 - kb);

    for (int j = 0; j < n && !v_in_k; ++j) {
      if (const T* row = key_row(v_cache, a.v_row_stride, vdim, kb + j)) {
        PrefetchRow(row, vdim * sizeof(T));
      }
    }
    for (int j = kb + n; j < std::min(it.k1, kb + n + kKeys); ++j) {
      if (const T* row = key_row(k_cache, a.k_row_stride, dim, j)) {
        PrefetchRow(row, dim * sizeof(T));
      }
    }

    // S^T[j][rows] = sum_d K[j][d] * Q^T[d][rows].
#if ATTNRT_BF16_DOT
    if constexpr (kDot) {
      constexpr int kStep = kPairKeys<NV>;
      const int n_step = (n + kStep - 1) / kStep * kStep;
      const uint32_t* krows[kKeys];
      for (int j = 0; j < n_step; ++j) {
        const T* row = j < n ? key_row(k_cache, a.k_row_stride, dim, kb + j) : nullptr;
        krows[j] = row != nullptr ? reinterpret_cast<const uint32_t*>(row)
                                  : reinterpret_cast<const uint32_t*>(zero_row);
      }
      ScoresBf16<NV>(krows, n, n_step, dim / 2, reinterpret_cast<const uint32_t*>(qt), rl, st,
                     smax);
    }
#endif
    if constexpr (!kDot) {
      const int n_step = (n + kTileKeyStep - 1) / kTileKeyStep * kTileKeyStep;
      for (int j = 0; j < n_step; ++j) {
        float* dst = kvf + static_cast<size_t>(j) * dim;
        const T* row = j < n ? key_row(k_cache, a.k_row_stride, dim, kb + j) : nullptr;
        if (row == nullptr) {
          std::fill(dst, dst + dim, 0.f);
        } else {
          ConvertRow<DT>(row, dim, dst);
        }
      }
      for (int j = 0; j < n_step; j += kTileKeyStep) {
        for (int v0 = 0; v0 < NV; v0 += kPanel) {
          ScorePanel<kPanel>(qt, rl, v0, kvf + static_cast<size_t>(j) * dim, dim, dim,
                             st + static_cast<size_t>(j) * rl);
        }
      }
    }

    // Scale, soft-cap, mask, online softmax, lane-wise. A block is masked only where some key may
    // be invisible to some row: tree drafts, the causal edge, the window's far edge.
    const bool tree_keys = tree && kb + n > r.prefix;
    const bool causal_edge = a.causal && static_cast<float>(kb + n - 1) > min_pos;
    const bool window_edge = a.window >= 0 && max_pos - static_cast<float>(kb) > a.window;
    const bool masked = tree_keys || causal_edge || window_edge;
    // The bf16 form works in log2 units (scores times scale * log2(e)) so that its exponentials
    // are plain powers of two. A block with no mask and no soft-cap skips the pass below: the
    // score kernel already has its maxima.
    const float log2_scale = a.qk_scale * kLog2e;
    const bool direct = kDot && !masked && a.softcap <= 0.f && log2_scale > 0.f;
    // bad: rows with a NaN or +inf raw score of a visible key (a NaN or an infinity in its K),
    // which the maximum would skip and the soft-cap could bend back: their l becomes NaN below.
    VF qp[NV], bmax[NV], bad[NV];
    for (int v = 0; v < NV; ++v) {
      qp[v] = hn::Load(df, qpos + v * lanes);
      bmax[v] = neg_inf;
      bad[v] = zero;
    }
    const VF cap = hn::Set(df, kDot ? a.softcap * kLog2e : a.softcap);
    const VF inv_cap = hn::Set(df, a.softcap > 0.f ? 1.f / a.softcap : 0.f);
    const VF pre_scale =
        hn::Set(df, !kDot ? 1.f : a.softcap > 0.f ? a.qk_scale : log2_scale);
    for (int j = 0; j < n && !direct; ++j) {
      const int key = kb + j;
      const bool draft = tree && key >= r.prefix;
      const int u = key - r.prefix;
      const VF kpos = hn::Set(
          df, static_cast<float>(draft ? r.prefix + p.tree_depth[r.tree + u] : key));
      for (int v = 0; v < NV; ++v) {
        float* sp = st + static_cast<size_t>(j) * rl + v * lanes;
        VF s = hn::Load(df, sp);
        if constexpr (kDot) s = hn::Mul(s, pre_scale);
        const VF nonfinite = hn::VecFromMask(df, hn::Or(hn::IsNaN(s), hn::Eq(s, hn::Neg(neg_inf))));
        if (a.softcap > 0.f) s = hn::Mul(cap, hn::Tanh(df, hn::Mul(s, inv_cap)));
        if (masked) {
          auto vis = draft ? hn::Gt(hn::Load(df, tvis + static_cast<size_t>(u) * rl + v * lanes), zero)
                           : hn::Le(kpos, qp[v]);
          if (a.window >= 0) vis = hn::And(vis, hn::Le(hn::Sub(qp[v], kpos), window));
          s = hn::IfThenElse(vis, s, neg_inf);
          bad[v] = hn::Or(bad[v], hn::And(hn::VecFromMask(df, vis), nonfinite));
        } else {
          bad[v] = hn::Or(bad[v], nonfinite);
        }
        hn::Store(s, df, sp);
        bmax[v] = hn::Max(s, bmax[v]);  // x86 max returns the second operand for a NaN: dropped
      }
    }
#if ATTNRT_BF16_DOT
    if constexpr (kDot) {
      for (int v = 0; v < NV; ++v) {
        const VF bm = direct ? hn::Mul(hn::Load(df, smax + v * lanes), hn::Set(df, log2_scale))
                             : bmax[v];
        hn::Store(bm, df, smax + v * lanes);
      }
      SoftmaxPairsBf16<NV>(st, n, rl, direct ? log2_scale : 1.f, smax, m, l, alpha,
                           reinterpret_cast<uint32_t*>(pairs_p));
    }
#endif
    for (int v = 0; v < NV && !kDot; ++v) {
      const VF m_old = hn::Load(df, m + v * lanes);
      const VF m_new = hn::Max(m_old, bmax[v]);
      const VF m_use = hn::IfThenElse(hn::Eq(m_new, neg_inf), zero, m_new);
      const VF al = hn::Exp(df, hn::Sub(m_old, m_use));
      VF sum = zero;
      for (int j = 0; j < n; ++j) {
        float* sp = st + static_cast<size_t>(j) * rl + v * lanes;
        const VF e = hn::Exp(df, hn::Sub(hn::Load(df, sp), m_use));
        hn::Store(e, df, sp);
        sum = hn::Add(sum, e);
      }
      hn::Store(m_new, df, m + v * lanes);
      hn::Store(al, df, alpha + v * lanes);
      hn::Store(hn::MulAdd(hn::Load(df, l + v * lanes), al, sum), df, l + v * lanes);
    }
    for (int v = 0; v < NV && !direct; ++v) {
      const VF lv = hn::Load(df, l + v * lanes);
      hn::Store(hn::IfThenElse(hn::MaskFromVec(bad[v]), hn::Set(df, kNaN), lv), df, l + v * lanes);
    }

    // O^T[d][rows] = O^T[d][rows] * alpha + sum_j V[j][d] * P^T[j][rows].
#if ATTNRT_BF16_DOT
    if constexpr (kDot) {
      const uint16_t* vrows[kKeys];
      for (int j = 0; j < n; ++j) {
        const T* row = key_row(v_cache, a.v_row_stride, vdim, kb + j);
        vrows[j] = reinterpret_cast<const uint16_t*>(row != nullptr ? row : reinterpret_cast<const T*>(zero_row));
      }
      uint32_t* vp = reinterpret_cast<uint32_t*>(kvf);
      uint32_t* pp = reinterpret_cast<uint32_t*>(pairs_p);
      PairValues(vrows, n, vdim, reinterpret_cast<const uint16_t*>(zero_row), vp);
      ValuesBf16<NV>(vp, pp, (n + 1) / 2, vdim, rl, alpha, ot);
    }
#endif
    if constexpr (!kDot) {
      const int vstride = v_in_k ? dim : vdim;
      for (int j = 0; j < n && !v_in_k; ++j) {
        float* dst = kvf + static_cast<size_t>(j) * vdim;
        if (const T* row = key_row(v_cache, a.v_row_stride, vdim, kb + j)) {
          ConvertRow<DT>(row, vdim, dst);
        } else {
          std::fill(dst, dst + vdim, 0.f);
        }
      }
      for (int v0 = 0; v0 < NV; v0 += kPanel) {
        int d0 = 0;
        for (; d0 + kTileDvStep <= vdim; d0 += kTileDvStep) {
          ValuePanel<kPanel, kTileDvStep>(st, rl, v0, kvf, vstride, n, d0, alpha, ot);
        }
        for (; d0 < vdim; ++d0) ValuePanel<kPanel, 1>(st, rl, v0, kvf, vstride, n, d0, alpha, ot);
      }
    }
  }

  for (int i = 0; i < nrows; ++i) {
    // The bf16 form's maxima are in log2 units.
    const float mi = kDot ? m[i] * kLn2 : m[i];
    EmitRow(a, p, it, rows, i, ot + i, rl, mi, l[i]);
  }
}

// ------------------------------------------------------------------------------------------------
// Entry point: a multi-query item of any K/V type for one kv head, in the tile height its rows
// need. The scales in `a` already hold the type's load factor; `dot`: q, K/V and the output allow
// the dot-product form.

template <DType DT>
void TileItemOf(const LayerArgs& a, const KernelPlan& p, const WorkItem& it, int kv_head,
                bool dot) {
  const int vectors = ((it.t1 - it.t0) * (it.g1 - it.g0) + static_cast<int>(hn::Lanes(DF())) - 1) /
                      static_cast<int>(hn::Lanes(DF()));
#if ATTNRT_BF16_DOT
  if constexpr (DT == DType::bf16) {
    if (dot) {
      if (vectors == 1) {
        TileItem<DT, 1, true>(a, p, it, kv_head);
      } else if (vectors == 2) {
        TileItem<DT, 2, true>(a, p, it, kv_head);
      } else {
        TileItem<DT, kWideTile, true>(a, p, it, kv_head);
      }
      return;
    }
  }
#endif
  (void)dot;
  if (vectors == 1) {
    TileItem<DT, 1, false>(a, p, it, kv_head);
  } else if (vectors == 2) {
    TileItem<DT, 2, false>(a, p, it, kv_head);
  } else if (vectors <= kWideTile) {
    TileItem<DT, kWideTile, false>(a, p, it, kv_head);
  } else {
    TileItem<DT, kLatentTile, false>(a, p, it, kv_head);
  }
}

void RunTileItem(const LayerArgs& a, const KernelPlan& p, const WorkItem& it, int kv_head,
                 bool dot) {
  WithKvType(a.kv_dtype, [&](auto kv) { TileItemOf<decltype(kv)::value>(a, p, it, kv_head, dot); });
}

}  // namespace HWY_NAMESPACE
}  // namespace attnrt::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attnrt::cpu {

HWY_EXPORT(RunTileItem);

void run_tile_item(const LayerArgs& args, const KernelPlan& plan, const WorkItem& item, int kv_head,
                   bool dot) {
  HWY_DYNAMIC_DISPATCH(RunTileItem)(args, plan, item, kv_head, dot);
}

}  // namespace attnrt::cpu
#endif  // HWY_ONCE
