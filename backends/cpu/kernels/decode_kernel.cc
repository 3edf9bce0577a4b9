// The single-query kernel of the cpu backend (decode, the decode rows of MIXED): head_dim in the
// vector lanes, each request's pool rows walked once for every kv head, K/V widened in registers
// once per GQA group. fp32 FMA micro-kernels for every K/V type, and bf16 dot-product ones
// (vdpbf16ps) for bf16 rows and, through fp8_dot-inl.h, fp8 rows. Compiled once per Highway
// target (foreach_target); run_decode_item() dispatches to the one chosen at run time.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backends/cpu/kernels/attention_kernels.h"
#include "backends/cpu/kernels/item_kernels.h"
#include "backends/cpu/kernels/hwy_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/kernels/decode_kernel.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "backends/cpu/kernels/fp8_dot-inl.h"
#include "backends/cpu/kernels/kernel_common-inl.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attnrt::cpu {
namespace HWY_NAMESPACE {

// Keys per block of the single-query kernel: the block's K and V rows stay in L1 between the
// score pass and the value pass.
constexpr int kDecodeKeys = 64;

// ------------------------------------------------------------------------------------------------
// Online softmax over a block of scores held key-major in lanes (single-query kernel): s[0, n) of
// one head times `scale`, padded to whole vectors with -inf. Updates m and l; leaves
// p = exp(s - m) in s (zero in the padding).

HWY_INLINE float SoftmaxKeysInLanes(float* s, int n, float scale, float softcap, float& m,
                                    float& l) {
  const DF df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  const int padded = (n + lanes - 1) / lanes * lanes;
  if (scale != 1.f) {
    for (int j = 0; j < n; j += lanes) {
      hn::Store(hn::Mul(hn::Load(df, s + j), hn::Set(df, scale)), df, s + j);
    }
  }
  for (int j = n; j < padded; ++j) s[j] = kNegInf;
  // A NaN or +inf score (a NaN or an infinity in a key's K; every key here is visible) makes the
  // row NaN (docs/backends.md, "NaN and infinity"): the maximum would skip a NaN and the soft-cap
  // could bend an infinity back, so l is set to NaN below.
  VF bad = hn::Zero(df);
  for (int j = 0; j < padded; j += lanes) {
    const VF v = hn::Load(df, s + j);
    bad = hn::Or(bad, hn::VecFromMask(df, hn::Or(hn::IsNaN(v), hn::Eq(v, hn::Set(df, kPosInf)))));
  }
  VF vmax = hn::Set(df, kNegInf);
  if (softcap > 0.f) {
    const VF cap = hn::Set(df, softcap), inv_cap = hn::Set(df, 1.f / softcap);
    for (int j = 0; j < n; j += lanes) {
      const VF v = hn::Mul(cap, hn::Tanh(df, hn::Mul(hn::Load(df, s + j), inv_cap)));
      hn::Store(v, df, s + j);
    }
    for (int j = n; j < padded; ++j) s[j] = kNegInf;
  }
  for (int j = 0; j < padded; j += lanes) vmax = hn::Max(vmax, hn::Load(df, s + j));
  const float block_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
  const float m_new = std::max(m, block_max);
  const float m_use = m_new == kNegInf ? 0.f : m_new;
  const float alpha = std::exp(m - m_use);
  const VF vm = hn::Set(df, m_use);
  VF sum = hn::Zero(df);
  for (int j = 0; j < padded; j += lanes) {
    const VF e = hn::Exp(df, hn::Sub(hn::Load(df, s + j), vm));
    hn::Store(e, df, s + j);
    sum = hn::Add(sum, e);
  }
  l = l * alpha + hn::GetLane(hn::SumOfLanes(df, sum));
  if (!hn::AllFalse(df, hn::MaskFromVec(bad))) l = kNaN;
  m = m_new;
  return alpha;
}

// ------------------------------------------------------------------------------------------------
// fp32 micro-kernels.

// Scores of NG heads (q rows NG x q_stride, zero-padded to whole vectors) against n key rows,
// 4 / NG keys at a time so that every step folds four dot products together.
template <DType DT, int NG>
HWY_INLINE void DecodeScores(const float* q, int q_stride, const typename KvElem<DT>::T* const* k,
                             const typename KvElem<DT>::T* const* pf, int n, int dim, float* tail,
                             float* s, int s_stride) {
  using T = typename KvElem<DT>::T;
  static_assert(NG == 1 || NG == 2 || NG == 4, "four accumulators per step");
  constexpr int kKeys = 4 / NG;
  const DF df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  const int full = dim / lanes * lanes;
  for (int j = 0; j < n; j += kKeys) {
    const T* kr[kKeys];
    for (int kk = 0; kk < kKeys; ++kk) kr[kk] = k[std::min(j + kk, n - 1)];
    if (pf != nullptr) {
      for (int kk = 0; kk < kKeys && j + kk < n; ++kk) PrefetchRow(pf[j + kk], dim * sizeof(T));
    }
    VF acc[4];
    for (int a = 0; a < 4; ++a) acc[a] = hn::Zero(df);
    for (int d = 0; d < full; d += lanes) {
      VF kv[kKeys];
      for (int kk = 0; kk < kKeys; ++kk) kv[kk] = KvElem<DT>::Load(df, kr[kk] + d);
      for (int g = 0; g < NG; ++g) {
        const VF qv = hn::Load(df, q + g * q_stride + d);
        for (int kk = 0; kk < kKeys; ++kk) acc[g * kKeys + kk] = hn::MulAdd(qv, kv[kk], acc[g * kKeys + kk]);
      }
    }
    if (full < dim) {
      for (int kk = 0; kk < kKeys; ++kk) {
        float* t = tail + kk * lanes;
        std::fill(t, t + lanes, 0.f);
        for (int d = full; d < dim; ++d) t[d - full] = LoadScalar<DT>(kr[kk], d);
      }
      for (int g = 0; g < NG; ++g) {
        const VF qv = hn::Load(df, q + g * q_stride + full);
        for (int kk = 0; kk < kKeys; ++kk) {
          acc[g * kKeys + kk] = hn::MulAdd(qv, hn::Load(df, tail + kk * lanes), acc[g * kKeys + kk]);
        }
      }
    }
    float out[4];
    Sum4(df, acc[0], acc[1], acc[2], acc[3], out);
    for (int g = 0; g < NG; ++g) {
      for (int kk = 0; kk < kKeys && j + kk < n; ++kk) s[g * s_stride + j + kk] = out[g * kKeys + kk];
    }
  }
}

// acc[g] = acc[g] * alpha[g] + sum_j p[g][j] * V_j for NG heads, one vector of value dims at a time.
template <DType DT, int NG>
HWY_INLINE void DecodeValues(const typename KvElem<DT>::T* const* v,
                             const typename KvElem<DT>::T* const* pf, int n, int dim,
                             const float* p, int p_stride, const float* alpha, float* acc,
                             int acc_stride, float* tail) {
  const DF df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  for (int c = 0; c < dim; c += lanes) {
    const bool partial = c + lanes > dim;
    if (partial) {
      std::fill(tail, tail + static_cast<size_t>(n) * lanes, 0.f);
      for (int j = 0; j < n; ++j) {
        for (int d = c; d < dim; ++d) tail[j * lanes + d - c] = LoadScalar<DT>(v[j], d);
      }
    }
    VF o[NG];
    for (int g = 0; g < NG; ++g) {
      o[g] = hn::Mul(hn::Load(df, acc + g * acc_stride + c), hn::Set(df, alpha[g]));
    }
    for (int j = 0; j < n; ++j) {
      if (pf != nullptr) __builtin_prefetch(pf[j] + c, 0, 2);
      const VF vv = partial ? hn::Load(df, tail + j * lanes) : KvElem<DT>::Load(df, v[j] + c);
      for (int g = 0; g < NG; ++g) o[g] = hn::MulAdd(hn::Set(df, p[g * p_stride + j]), vv, o[g]);
    }
    for (int g = 0; g < NG; ++g) hn::Store(o[g], df, acc + g * acc_stride + c);
  }
}

// ------------------------------------------------------------------------------------------------
// bf16 micro-kernels (vdpbf16ps, where HasBf16Dot()): bf16 rows as they are, fp8 rows widened to
// bf16 on the way (fp8_dot-inl.h).

#if ATTNRT_BF16_DOT

// Stored bf16 K/V rows as the words vdpbf16ps reads, 32 at a time (fp8 rows: fp8_dot-inl.h).
template <DType DT>
struct DotRow;

template <>
struct DotRow<DType::bf16> {
  static ATTNRT_BF16_FN __m512i Load(const hwy::bfloat16_t* row, int d) {
    return _mm512_loadu_si512(row + d);
  }
};

// Scores of NG heads against n key rows for the single-query kernel: q as bf16 pairs
// ([NG][q_stride] u32), dim a multiple of 32.
template <DType DT, int NG>
ATTNRT_BF16_FN void DecodeScoresBf16(const uint32_t* q, int q_stride,
                                     const typename KvElem<DT>::T* const* k,
                                     const typename KvElem<DT>::T* const* pf, int n, int dim,
                                     float* s, int s_stride) {
  using T = typename KvElem<DT>::T;
  // Eight independent accumulators hide the latency of vdpbf16ps.
  constexpr int kKeys = 8 / NG;
  const DF df;
  for (int j = 0; j < n; j += kKeys) {
    const T* kr[kKeys];
    for (int kk = 0; kk < kKeys; ++kk) kr[kk] = k[std::min(j + kk, n - 1)];
    if (pf != nullptr) {
      for (int kk = 0; kk < kKeys && j + kk < n; ++kk) PrefetchRow(pf[j + kk], dim * sizeof(T));
    }
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < dim; d += 32) {
      __m512bh kv[kKeys];
      for (int kk = 0; kk < kKeys; ++kk) kv[kk] = (__m512bh)DotRow<DT>::Load(kr[kk], d);
      for (int g = 0; g < NG; ++g) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + g * q_stride + d / 2);
        for (int kk = 0; kk < kKeys; ++kk) {
          acc[g * kKeys + kk] = _mm512_dpbf16_ps(acc[g * kKeys + kk], qv, kv[kk]);
        }
      }
    }
    float out[8];
    Sum4(df, VF{acc[0]}, VF{acc[1]}, VF{acc[2]}, VF{acc[3]}, out);
    Sum4(df, VF{acc[4]}, VF{acc[5]}, VF{acc[6]}, VF{acc[7]}, out + 4);
    for (int g = 0; g < NG; ++g) {
      for (int kk = 0; kk < kKeys && j + kk < n; ++kk) s[g * s_stride + j + kk] = out[g * kKeys + kk];
    }
  }
}

// acc[g] = acc[g] * alpha[g] + sum over key pairs of V pairs . P pairs for NG heads, vdim a
// multiple of 32; p holds each head's probabilities as bf16 ([NG][p_stride] u32 pairs).
template <DType DT, int NG>
ATTNRT_BF16_FN void DecodeValuesBf16(const typename KvElem<DT>::T* const* v,
                                     const typename KvElem<DT>::T* const* pf, int n, int vdim,
                                     const typename KvElem<DT>::T* zero, const uint32_t* p,
                                     int p_stride, const float* alpha, float* acc, int acc_stride) {
  const __m512i lo = _mm512_load_si512(kPairLo), hi = _mm512_load_si512(kPairHi);
  for (int c = 0; c < vdim; c += 32) {
    __m512 o[NG][2];
    for (int g = 0; g < NG; ++g) {
      const __m512 al = _mm512_set1_ps(alpha[g]);
      o[g][0] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * acc_stride + c), al);
      o[g][1] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * acc_stride + c + 16), al);
    }
    for (int jp = 0; 2 * jp < n; ++jp) {
      if (pf != nullptr) {
        __builtin_prefetch(pf[2 * jp] + c, 0, 2);
        if (2 * jp + 1 < n) __builtin_prefetch(pf[2 * jp + 1] + c, 0, 2);
      }
      const __m512i va = DotRow<DT>::Load(v[2 * jp], c);
      const __m512i vb = DotRow<DT>::Load(2 * jp + 1 < n ? v[2 * jp + 1] : zero, c);
      const __m512bh pair_lo = (__m512bh)_mm512_permutex2var_epi16(va, lo, vb);
      const __m512bh pair_hi = (__m512bh)_mm512_permutex2var_epi16(va, hi, vb);
      for (int g = 0; g < NG; ++g) {
        const __m512bh pg = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[g * p_stride + jp]));
        o[g][0] = _mm512_dpbf16_ps(o[g][0], pair_lo, pg);
        o[g][1] = _mm512_dpbf16_ps(o[g][1], pair_hi, pg);
      }
    }
    for (int g = 0; g < NG; ++g) {
      _mm512_storeu_ps(acc + g * acc_stride + c, o[g][0]);
      _mm512_storeu_ps(acc + g * acc_stride + c + 16, o[g][1]);
    }
  }
}

// Probabilities of n keys (a whole number of vectors, zero past n) rounded to bf16.
ATTNRT_BF16_FN void ToBf16(const float* src, int n, uint16_t* dst) {
  for (int j = 0; j < n; j += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
  }
}

// The single-query dot kernels by K/V type: bf16 rows as they are, fp8 rows widened on the way.
template <DType DT, int NG>
void DotScores(const uint32_t* q, int q_stride, const typename KvElem<DT>::T* const* k,
               const typename KvElem<DT>::T* const* pf, int n, int dim, float* s, int s_stride) {
  if constexpr (DT == DType::bf16) {
    DecodeScoresBf16<DT, NG>(q, q_stride, k, pf, n, dim, s, s_stride);
  } else {
    DecodeScoresFp8<DT, NG>(q, q_stride, k, pf, n, dim, s, s_stride);
  }
}

template <DType DT, int NG>
void DotValues(const typename KvElem<DT>::T* const* v, const typename KvElem<DT>::T* const* pf,
               int n, int vdim, const typename KvElem<DT>::T* zero, const uint32_t* p, int p_stride,
               const float* alpha, float* acc, int acc_stride) {
  if constexpr (DT == DType::bf16) {
    DecodeValuesBf16<DT, NG>(v, pf, n, vdim, zero, p, p_stride, alpha, acc, acc_stride);
  } else {
    DecodeValuesFp8<DT, NG>(v, pf, n, vdim, zero, p, p_stride, alpha, acc, acc_stride);
  }
}

#endif  // ATTNRT_BF16_DOT

// ------------------------------------------------------------------------------------------------
// The single-query kernel.

// Every kv head of a single-query item in one pass over the keys: each pool row ([kv heads, dim],
// contiguous) is fetched once, whole, instead of once per head at a stride that defeats the
// prefetchers and the TLB. Rows are (kv head, group member) pairs, row i = h * ng + g.
// kDot: bf16 q and K/V through vdpbf16ps; q kept as raw bf16 pairs (the softmax scale applied to
// the scores) and the probabilities rounded to bf16 for P.V.
template <DType DT, bool kDot>
void DecodeItem(const LayerArgs& a, const KernelPlan& p, const WorkItem& it) {
  using T = typename KvElem<DT>::T;
  const DF df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  const RequestInfo& r = p.reqs[it.req];
  const int ng = it.g1 - it.g0;
  const int heads = a.num_kv_heads;
  const int nrows = heads * ng;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int dim = a.head_dim, vdim = a.v_head_dim;
  const int dim_p = (dim + lanes - 1) / lanes * lanes;
  const int vdim_p = (vdim + lanes - 1) / lanes * lanes;

  Arena arena;
  arena.reserve(static_cast<size_t>(nrows) * dim_p);        // q
  arena.reserve(static_cast<size_t>(nrows) * vdim_p);       // acc
  arena.reserve(static_cast<size_t>(nrows) * kDecodeKeys);  // scores / probabilities
  arena.reserve(static_cast<size_t>(kDecodeKeys) * lanes);  // row tails
  for (int k = 0; k < 3; ++k) arena.reserve(nrows);         // m, l, alpha
  arena.reserve(static_cast<size_t>(nrows) * kDecodeKeys / 2);  // bf16 probabilities
  arena.reserve(static_cast<size_t>(vdim_p));               // a zero row
  arena.bind(t_scratch.get(arena.total()));
  float* q = arena.take(static_cast<size_t>(nrows) * dim_p);
  float* acc = arena.take(static_cast<size_t>(nrows) * vdim_p);
  float* s = arena.take(static_cast<size_t>(nrows) * kDecodeKeys);
  float* tail = arena.take(static_cast<size_t>(kDecodeKeys) * lanes);
  float* m = arena.take(nrows);
  float* l = arena.take(nrows);
  float* alpha = arena.take(nrows);
  [[maybe_unused]] uint16_t* p16 =
      reinterpret_cast<uint16_t*>(arena.take(static_cast<size_t>(nrows) * kDecodeKeys / 2));
  [[maybe_unused]] float* zero_row = arena.take(static_cast<size_t>(vdim_p));
  if (kDot) std::fill(zero_row, zero_row + vdim_p, 0.f);

  for (int h = 0; h < heads; ++h) {
    const RowMap rows{r.q_row, it.t0, it.g0, ng, group, h};
    for (int g = 0; g < ng; ++g) {
      const int i = h * ng + g;
      const int64_t base = rows.token_row(g) * a.q_stride[0] + rows.head(g) * a.q_stride[1];
      float* qi = q + static_cast<size_t>(i) * dim_p;
      if constexpr (kDot) {
        const uint16_t* src = static_cast<const uint16_t*>(a.q) + base;
        uint16_t* dst = reinterpret_cast<uint16_t*>(qi);
        for (int d = 0; d < dim; ++d) dst[d] = src[d * a.q_stride[2]];
      } else {
        for (int d = 0; d < dim; ++d) {
          qi[d] = load_as_float(a.q, a.q_dtype, static_cast<size_t>(base + d * a.q_stride[2])) *
                  a.qk_scale;
        }
        std::fill(qi + dim, qi + dim_p, 0.f);
      }
      std::fill(acc + static_cast<size_t>(i) * vdim_p, acc + static_cast<size_t>(i + 1) * vdim_p,
                0.f);
      m[i] = kNegInf;
      l[i] = 0.f;
    }
  }

  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int32_t* slots = p.slots + r.slot_offset;
  const T* krows[kDecodeKeys];
  const T* vrows[kDecodeKeys];
  // Each pass of the loop below reads one kv head's slice of the block's rows; the kernels
  // prefetch, row by row as they go, the slice the next pass reads (the next head, or head 0 of
  // the next block): a steady stream one pass ahead, where a burst of whole rows stalls the core
  // on its miss buffers.
  const T* kpf[kDecodeKeys];
  const T* vpf[kDecodeKeys];
  for (int kb = it.k0; kb < it.k1; kb += kDecodeKeys) {
    const int n = std::min(kDecodeKeys, it.k1 - kb);
    for (int h = 0; h < heads; ++h) {
      for (int j = 0; j < n; ++j) {
        const int64_t slot = slots[kb + j];
        krows[j] = k_cache + slot * a.k_row_stride + static_cast<int64_t>(h) * dim;
        vrows[j] = v_cache + slot * a.v_row_stride + static_cast<int64_t>(h) * vdim;
        if (h + 1 < heads) {
          kpf[j] = krows[j] + dim;
          vpf[j] = vrows[j] + vdim;
        } else if (kb + kDecodeKeys + j < it.k1) {
          const int64_t next = slots[kb + kDecodeKeys + j];
          kpf[j] = k_cache + next * a.k_row_stride;
          vpf[j] = v_cache + next * a.v_row_stride;
        } else {
          kpf[j] = krows[j];  // already cached: the prefetch is a no-op
          vpf[j] = vrows[j];
        }
      }
      float* qh = q + static_cast<size_t>(h) * ng * dim_p;
      float* sh = s + static_cast<size_t>(h) * ng * kDecodeKeys;
      float* ah = acc + static_cast<size_t>(h) * ng * vdim_p;
      float* mh = m + h * ng;
      float* lh = l + h * ng;
      float* alh = alpha + h * ng;
#if ATTNRT_BF16_DOT
      if constexpr (kDot) {
        const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qh);
        const int q_stride = dim_p;  // u32 per row: q rows are dim_p floats apart
        for (int g = 0; g < ng;) {
          float* sg = sh + static_cast<size_t>(g) * kDecodeKeys;
          const uint32_t* qg = q32 + static_cast<size_t>(g) * q_stride;
          if (ng - g >= 4) {
            DotScores<DT, 4>(qg, q_stride, krows, g == 0 ? kpf : nullptr, n, dim, sg, kDecodeKeys);
            g += 4;
          } else if (ng - g >= 2) {
            DotScores<DT, 2>(qg, q_stride, krows, g == 0 ? kpf : nullptr, n, dim, sg, kDecodeKeys);
            g += 2;
          } else {
            DotScores<DT, 1>(qg, q_stride, krows, g == 0 ? kpf : nullptr, n, dim, sg, kDecodeKeys);
            g += 1;
          }
        }
        const int padded = (n + lanes - 1) / lanes * lanes;
        uint16_t* ph = p16 + static_cast<size_t>(h) * ng * kDecodeKeys;
        for (int g = 0; g < ng; ++g) {
          float* sg = sh + static_cast<size_t>(g) * kDecodeKeys;
          alh[g] = SoftmaxKeysInLanes(sg, n, a.qk_scale, a.softcap, mh[g], lh[g]);
          ToBf16(sg, padded, ph + static_cast<size_t>(g) * kDecodeKeys);
        }
        const uint32_t* p32 = reinterpret_cast<const uint32_t*>(ph);
        const T* zero_t = reinterpret_cast<const T*>(zero_row);
        constexpr int kPStride = kDecodeKeys / 2;
        for (int g = 0; g < ng;) {
          const uint32_t* pg = p32 + static_cast<size_t>(g) * kPStride;
          float* ag = ah + static_cast<size_t>(g) * vdim_p;
          if constexpr (DT == DType::bf16) {
            if (ng - g >= 8) {
              DotValues<DT, 8>(vrows, g == 0 ? vpf : nullptr, n, vdim, zero_t, pg, kPStride,
                               alh + g, ag, vdim_p);
              g += 8;
              continue;
            }
          }
          if (ng - g >= 4) {
            DotValues<DT, 4>(vrows, g == 0 ? vpf : nullptr, n, vdim, zero_t, pg, kPStride, alh + g,
                             ag, vdim_p);
            g += 4;
          } else if (ng - g >= 2) {
            DotValues<DT, 2>(vrows, g == 0 ? vpf : nullptr, n, vdim, zero_t, pg, kPStride, alh + g,
                             ag, vdim_p);
            g += 2;
          } else {
            DotValues<DT, 1>(vrows, g == 0 ? vpf : nullptr, n, vdim, zero_t, pg, kPStride, alh + g,
                             ag, vdim_p);
            g += 1;
          }
        }
        continue;
      }
#endif
      for (int g = 0; g < ng;) {
        const float* qg = qh + static_cast<size_t>(g) * dim_p;
        float* sg = sh + static_cast<size_t>(g) * kDecodeKeys;
        if (ng - g >= 4) {
          DecodeScores<DT, 4>(qg, dim_p, krows, g == 0 ? kpf : nullptr, n, dim, tail, sg,
                              kDecodeKeys);
          g += 4;
        } else if (ng - g >= 2) {
          DecodeScores<DT, 2>(qg, dim_p, krows, g == 0 ? kpf : nullptr, n, dim, tail, sg,
                              kDecodeKeys);
          g += 2;
        } else {
          DecodeScores<DT, 1>(qg, dim_p, krows, g == 0 ? kpf : nullptr, n, dim, tail, sg,
                              kDecodeKeys);
          g += 1;
        }
      }
      for (int g = 0; g < ng; ++g) {
        alh[g] = SoftmaxKeysInLanes(sh + static_cast<size_t>(g) * kDecodeKeys, n, 1.f, a.softcap,
                                    mh[g], lh[g]);
      }
      for (int g = 0; g < ng;) {
        const float* pg = sh + static_cast<size_t>(g) * kDecodeKeys;
        float* ag = ah + static_cast<size_t>(g) * vdim_p;
        if (ng - g >= 8) {
          DecodeValues<DT, 8>(vrows, g == 0 ? vpf : nullptr, n, vdim, pg, kDecodeKeys, alh + g, ag,
                              vdim_p, tail);
          g += 8;
        } else if (ng - g >= 4) {
          DecodeValues<DT, 4>(vrows, g == 0 ? vpf : nullptr, n, vdim, pg, kDecodeKeys, alh + g, ag,
                              vdim_p, tail);
          g += 4;
        } else if (ng - g >= 2) {
          DecodeValues<DT, 2>(vrows, g == 0 ? vpf : nullptr, n, vdim, pg, kDecodeKeys, alh + g, ag,
                              vdim_p, tail);
          g += 2;
        } else {
          DecodeValues<DT, 1>(vrows, g == 0 ? vpf : nullptr, n, vdim, pg, kDecodeKeys, alh + g, ag,
                              vdim_p, tail);
          g += 1;
        }
      }
    }
  }
  for (int h = 0; h < heads; ++h) {
    const RowMap rows{r.q_row, it.t0, it.g0, ng, group, h};
    for (int g = 0; g < ng; ++g) {
      const int i = h * ng + g;
      EmitRow(a, p, it, rows, g, acc + static_cast<size_t>(i) * vdim_p, 1, m[i], l[i]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Entry point: a single-query item of any K/V type. The scales in `a` already hold the type's load
// factor; `dot`: q, K/V and the output allow the dot-product form.

template <DType DT>
void DecodeItemOf(const LayerArgs& a, const KernelPlan& p, const WorkItem& it, bool dot) {
#if ATTNRT_BF16_DOT
  if constexpr (DT == DType::bf16) {
    if (dot && a.head_dim % 32 == 0 && a.v_head_dim % 32 == 0) {
      DecodeItem<DT, true>(a, p, it);
      return;
    }
  }
  if constexpr (DT == DType::e4m3 || DT == DType::e5m2) {
    if (dot && a.head_dim % 64 == 0 && a.v_head_dim % 64 == 0) {
      DecodeItem<DT, true>(a, p, it);
      return;
    }
  }
#endif
  (void)dot;
  DecodeItem<DT, false>(a, p, it);
}

void RunDecodeItem(const LayerArgs& a, const KernelPlan& p, const WorkItem& it, bool dot) {
  WithKvType(a.kv_dtype, [&](auto kv) { DecodeItemOf<decltype(kv)::value>(a, p, it, dot); });
}

// Exposed for the exhaustive test of the fp8 widening.
bool WidenFp8ToBf16(DType dtype, const uint8_t* src, int64_t n, uint16_t* dst) {
#if ATTNRT_BF16_DOT
  if (!HasFp8Dot()) return false;
  if (dtype == DType::e4m3) {
    WidenFp8Row<DType::e4m3>(src, n, dst);
    return true;
  }
  if (dtype == DType::e5m2) {
    WidenFp8Row<DType::e5m2>(src, n, dst);
    return true;
  }
#endif
  (void)dtype, (void)src, (void)n, (void)dst;
  return false;
}

}  // namespace HWY_NAMESPACE
}  // namespace attnrt::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attnrt::cpu {

HWY_EXPORT(RunDecodeItem);
HWY_EXPORT(WidenFp8ToBf16);

void run_decode_item(const LayerArgs& args, const KernelPlan& plan, const WorkItem& item,
                     bool dot) {
  HWY_DYNAMIC_DISPATCH(RunDecodeItem)(args, plan, item, dot);
}

bool widen_fp8_to_bf16(DType dtype, const uint8_t* src, int64_t n, uint16_t* dst) {
  return HWY_DYNAMIC_DISPATCH(WidenFp8ToBf16)(dtype, src, n, dst);
}

}  // namespace attnrt::cpu
#endif  // HWY_ONCE
