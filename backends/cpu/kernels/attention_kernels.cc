// SIMD attention kernels of the cpu backend, compiled once per Highway target (foreach_target) and
// chosen at run time (HWY_DYNAMIC_DISPATCH).
//
// Two kernels share one work list:
// - single-query items (decode, the decode rows of MIXED) keep head_dim in the vector lanes: each
//   K/V row is loaded and widened once, in registers, and used by every query head of its GQA
//   group;
// - multi-query items (extend, verify, draft extend) are flash-style tiles that put query rows
//   (tokens x heads of a group) in the lanes: S^T = K Q^T and O^T += V^T P^T are register-blocked
//   outer products, the online softmax runs lane-wise with no horizontal reductions, and each
//   block of K/V rows is widened to fp32 once for the whole tile.
// Both accumulate in fp32 and produce an unnormalised state (acc, running max m, sum l) that is
// either finished in place or merged across key splits by log-sum-exp.

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "backends/cpu/kernels/attention_kernels.h"

// Scalable-vector targets cannot hold vectors in arrays, which the register blocking relies on;
// Arm builds use NEON instead.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/kernels/attention_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/aligned_allocator.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attnrt::cpu {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504f;
constexpr float kLn2 = 0.693147181f;
// Keys per block of the single-query kernel: the block's K and V rows stay in L1 between the
// score pass and the value pass.
constexpr int kDecodeKeys = 64;
// Keys per block of the tile kernel (a multiple of kTileKeyStep), and of its bf16 form: twice as
// many halve the per-block work (pairing V, rescaling O^T) per vdpbf16ps.
constexpr int kTileKeys = 32;
constexpr int kDotKeys = 64;
// Register blocking of the tile kernel: keys per S^T step and value dims per O^T step.
constexpr int kTileKeyStep = 4;
constexpr int kTileDvStep = 4;
// Row vectors of the tile kernel's largest tiles: four where the register file holds 32 vectors
// (AVX-512: a 4 x 4 block of accumulators and its operands), which halves the K/V reads and the
// per-block work per query row against two.
constexpr int kWideTile = HWY_TARGET <= HWY_AVX3 ? 4 : 2;

// ------------------------------------------------------------------------------------------------
// Loading stored K/V elements as fp32 vectors.

template <DType DT>
struct KvElem;

template <>
struct KvElem<DType::f32> {
  using T = float;
  static HWY_INLINE VF Load(DF df, const T* p) { return hn::LoadU(df, p); }
};

template <>
struct KvElem<DType::bf16> {
  using T = hwy::bfloat16_t;
  static HWY_INLINE VF Load(DF df, const T* p) {
    const hn::Rebind<T, DF> d16;
    return hn::PromoteTo(df, hn::LoadU(d16, p));
  }
};

template <>
struct KvElem<DType::f16> {
  using T = hwy::float16_t;
  static HWY_INLINE VF Load(DF df, const T* p) {
    const hn::Rebind<T, DF> d16;
    return hn::PromoteTo(df, hn::LoadU(d16, p));
  }
};

// fp8 is widened through fp16, whose hardware conversion handles the subnormals. e5m2 is exactly
// the top byte of an fp16. e4m3 (bias 7) sign-extended to 16 bits and shifted left by 7 lands its
// exponent and mantissa in an fp16 (bias 15): the value divided by 2^8, for normals and subnormals
// alike; that factor is folded into the softmax and output scales instead of a multiply per
// element. The two e4m3 NaN codes (S.1111.111) are kept NaN.
template <>
struct KvElem<DType::e5m2> {
  using T = uint8_t;
  static HWY_INLINE VF Load(DF df, const T* p) {
    const hn::Rebind<uint8_t, DF> d8;
    const hn::Rebind<uint16_t, DF> d16;
    const hn::Rebind<hwy::float16_t, DF> dh;
    const auto bits = hn::ShiftLeft<8>(hn::PromoteTo(d16, hn::LoadU(d8, p)));
    return hn::PromoteTo(df, hn::BitCast(dh, bits));
  }
};

template <>
struct KvElem<DType::e4m3> {
  using T = uint8_t;
  static constexpr float kFactor = 256.f;
  static HWY_INLINE VF Load(DF df, const T* p) {
    const hn::Rebind<int8_t, DF> d8;
    const hn::Rebind<int16_t, DF> d16;
    const hn::Rebind<hwy::float16_t, DF> dh;
    const auto wide = hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p)));
    // Sign-extension left copies of the sign in bits 8..15; the shift keeps one of them in bit 15
    // and one in bit 14, which the mask clears.
    auto half = hn::And(hn::ShiftLeft<7>(wide), hn::Set(d16, static_cast<int16_t>(0xbf80)));
    half = hn::IfThenElse(hn::Eq(hn::And(half, hn::Set(d16, int16_t{0x3f80})),
                                 hn::Set(d16, int16_t{0x3f80})),
                          hn::Or(half, hn::Set(d16, int16_t{0x7e00})), half);
    return hn::PromoteTo(df, hn::BitCast(dh, half));
  }
};

// How much larger the stored values are than what KvElem<DT>::Load returns.
template <DType DT>
constexpr float kLoadFactor = 1.f;
template <>
constexpr float kLoadFactor<DType::e4m3> = KvElem<DType::e4m3>::kFactor;

// One element the way Load returns it (vector tails).
template <DType DT>
HWY_INLINE float LoadScalar(const typename KvElem<DT>::T* p, int i) {
  return load_as_float(p, DT, static_cast<size_t>(i)) * (1.f / kLoadFactor<DT>);
}

// Widens n elements to fp32 (vector body, scalar tail through the shared dtype conversions).
template <DType DT>
HWY_INLINE void ConvertRow(const typename KvElem<DT>::T* src, int n, float* dst) {
  const DF df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  int i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(KvElem<DT>::Load(df, src + i), df, dst + i);
  for (; i < n; ++i) dst[i] = LoadScalar<DT>(src, i);
}

// Pages scatter a request's rows over the pool and one kv head reads a slice of each row, a
// pattern the hardware prefetchers do not follow: the kernels ask for the next block's rows
// themselves, into L2 so that the block being computed keeps L1.
HWY_INLINE void PrefetchRow(const void* row, size_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

// ------------------------------------------------------------------------------------------------
// Per-thread scratch: grows to the largest request and is reused by every later item.

class Scratch {
 public:
  float* get(size_t n) {
    if (n > capacity_) {
      buffer_ = hwy::AllocateAligned<float>(n);
      capacity_ = n;
    }
    return buffer_.get();
  }

 private:
  hwy::AlignedFreeUniquePtr<float[]> buffer_;
  size_t capacity_ = 0;
};

thread_local Scratch t_scratch;

// Carves 64-byte aligned regions out of one scratch buffer.
class Arena {
 public:
  void reserve(size_t n) { total_ += Round(n); }
  void bind(float* base) { next_ = base; }
  float* take(size_t n) {
    float* p = next_;
    next_ += Round(n);
    return p;
  }
  size_t total() const { return total_; }

 private:
  static size_t Round(size_t n) { return (n + 15) / 16 * 16; }
  size_t total_ = 0;
  float* next_ = nullptr;
};

// ------------------------------------------------------------------------------------------------
// Finishing a row: normalise (with the sink in the denominator), or hand the state to the merge.

// Query row i of an item: token t0 + i / ng, head g0 + i % ng of the group.
struct RowMap {
  int64_t q_row0;
  int32_t t0, g0, ng, group, kv_head;
  int64_t token_row(int i) const { return q_row0 + t0 + i / ng; }
  int head(int i) const { return kv_head * group + g0 + i % ng; }
};

// acc: the row's Dv accumulated values (stride acc_stride between dims); m, l its softmax state.
HWY_INLINE void WriteRow(const LayerArgs& a, const RowMap& rows, int i, const float* acc,
                         int64_t acc_stride, float m, float l) {
  const int64_t t = rows.token_row(i);
  const int h = rows.head(i);
  float big = m;
  if (a.sinks != nullptr) big = std::max(big, a.sinks[h]);
  const float keep = big == kNegInf ? 0.f : std::exp(m - big);
  float den = l * keep;
  if (a.sinks != nullptr) den += std::exp(a.sinks[h] - big);
  // Every real row sees at least its own key, so den > 0; an empty row is written as zeros.
  const float norm = den > 0.f ? keep * a.v_scale / den : 0.f;
  const int64_t base = t * a.out_stride[0] + h * a.out_stride[1];
  if (a.out_dtype == DType::bf16) {
    // The common case without the per-element dtype dispatch (a few % of a bf16 prefill).
    uint16_t* out = static_cast<uint16_t*>(a.out) + base;
    for (int d = 0; d < a.v_head_dim; ++d) {
      out[d * a.out_stride[2]] = float_to_bf16(acc[d * acc_stride] * norm);
    }
  } else {
    for (int d = 0; d < a.v_head_dim; ++d) {
      store_from_float(a.out, a.out_dtype, static_cast<size_t>(base + d * a.out_stride[2]),
                       acc[d * acc_stride] * norm);
    }
  }
  if (a.lse != nullptr) {
    a.lse[t * a.lse_stride[0] + h * a.lse_stride[1]] =
        den > 0.f ? big + std::log(den) : kNegInf;
  }
}

// Partial state of an item for one kv head: acc[rows][Dv], then m[rows], then l[rows].
struct PartView {
  float* acc;
  float* m;
  float* l;
};

HWY_INLINE PartView Part(const LayerArgs& a, const KernelPlan& p, const WorkItem& it, int kv_head) {
  const int64_t rows = static_cast<int64_t>(it.t1 - it.t0) * (it.g1 - it.g0);
  float* base = p.partial + it.part + kv_head * rows * (a.v_head_dim + 2);
  return {base, base + rows * a.v_head_dim, base + rows * a.v_head_dim + rows};
}

HWY_INLINE void EmitRow(const LayerArgs& a, const KernelPlan& p, const WorkItem& it,
                        const RowMap& rows, int i, const float* acc, int64_t acc_stride, float m,
                        float l) {
  if (it.part < 0) {
    WriteRow(a, rows, i, acc, acc_stride, m, l);
    return;
  }
  const PartView part = Part(a, p, it, rows.kv_head);
  float* dst = part.acc + static_cast<int64_t>(i) * a.v_head_dim;
  for (int d = 0; d < a.v_head_dim; ++d) dst[d] = acc[d * acc_stride];
  part.m[i] = m;
  part.l[i] = l;
}

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
  m = m_new;
  return alpha;
}

// ------------------------------------------------------------------------------------------------
// Single-query kernel.

// out[i] = sum of the lanes of v_i. Folding four vectors together costs a few shuffles per dot
// product instead of a full reduction tree each.
HWY_INLINE void Sum4(DF df, VF v0, VF v1, VF v2, VF v3, float* out) {
#if HWY_TARGET == HWY_SCALAR
  out[0] = hn::GetLane(v0);
  out[1] = hn::GetLane(v1);
  out[2] = hn::GetLane(v2);
  out[3] = hn::GetLane(v3);
  (void)df;
#else
  constexpr size_t kLanes = HWY_LANES(float);
  static_assert(kLanes >= 4, "whole 128-bit blocks");
  {
    // Halves: t01 = [v0 folded | v1 folded], then lanes: u = four groups of kLanes / 4 partial
    // sums (group i from v_i), each group inside one 128-bit block.
    const VF t01 = hn::Add(hn::ConcatLowerLower(df, v1, v0), hn::ConcatUpperUpper(df, v1, v0));
    const VF t23 = hn::Add(hn::ConcatLowerLower(df, v3, v2), hn::ConcatUpperUpper(df, v3, v2));
    VF u = hn::Add(hn::ConcatEven(df, t23, t01), hn::ConcatOdd(df, t23, t01));
    if constexpr (kLanes >= 8) u = hn::Add(u, hn::Shuffle2301(u));
    if constexpr (kLanes >= 16) u = hn::Add(u, hn::Shuffle1032(u));
    HWY_ALIGN float lanes[kLanes];
    hn::Store(u, df, lanes);
    for (size_t i = 0; i < 4; ++i) out[i] = lanes[i * (kLanes / 4)];
  }
#endif
}

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
// bf16 dot products (vdpbf16ps: AVX-512 BF16, from Cooper Lake and Zen 4 on). Highway 1.0 has no
// target for them, so these few micro-kernels use the intrinsics directly and run only where the
// CPU reports the extension. Products of two bf16 are exact in fp32; only the probabilities are
// rounded to bf16 for P.V, which the bf16 output rounds far more.

#undef ATTNRT_BF16_DOT
#undef ATTNRT_BF16_FN
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define ATTNRT_BF16_DOT 1
#define ATTNRT_BF16_FN __attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16")))

// Issue-rate probes: the same number of independent vdpbf16ps / vfmadd instructions, enough
// chains to hide either's latency; every chain feeds the result so that none is dropped.
ATTNRT_BF16_FN double DotLoopSeconds(int iters) {
  __m512 acc[12];
  for (auto& x : acc) x = _mm512_setzero_ps();
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    for (auto& x : acc) x = _mm512_dpbf16_ps(x, a, a);
  }
  const auto t1 = std::chrono::steady_clock::now();
  __m512 sum = acc[0];
  for (int k = 1; k < 12; ++k) sum = _mm512_add_ps(sum, acc[k]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return std::chrono::duration<double>(t1 - t0).count();
}

double FmaLoopSeconds(int iters) {
  __m512 acc[12];
  for (auto& x : acc) x = _mm512_setzero_ps();
  const __m512 a = _mm512_set1_ps(1.f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    for (auto& x : acc) x = _mm512_fmadd_ps(a, a, x);
  }
  const auto t1 = std::chrono::steady_clock::now();
  __m512 sum = acc[0];
  for (int k = 1; k < 12; ++k) sum = _mm512_add_ps(sum, acc[k]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return std::chrono::duration<double>(t1 - t0).count();
}

// The dot-product kernels do about as many vdpbf16ps as the fp32 ones do FMAs, for half the
// widening work: worth it where vdpbf16ps issues at least 3/4 as fast as an FMA (Zen 4), not
// where it is a fraction of that (Sapphire Rapids, whose bf16 rate lives in AMX). Measured once.
bool HasBf16Dot() {
  static const bool prefer = [] {
    if (!__builtin_cpu_supports("avx512bf16")) return false;
    double dot = 1e30, fma = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      dot = std::min(dot, DotLoopSeconds(4096));
      fma = std::min(fma, FmaLoopSeconds(4096));
    }
    return dot * 0.75 <= fma;
  }();
  return prefer;
}

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
// key) and NaN clamp to -200, whose power underflows to exactly 0.
ATTNRT_BF16_FN HWY_INLINE __m512 Exp2NonPositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.f));
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
  alignas(64) static constexpr int16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                  53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                  27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
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

// Stored bf16 K/V rows as the words vdpbf16ps reads, 32 at a time (fp8 rows: WidenFp8 below).
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
  alignas(64) static constexpr int16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                  53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                  27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
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

// ------------------------------------------------------------------------------------------------
// fp8 K/V on the bf16 dot-product kernels. Every fp8 value (e4m3 and e5m2, subnormals included) is
// a bf16 normal, so the widening is exact; it must not produce bf16 subnormals, which vdpbf16ps
// reads as zero, so a bit placement that keeps the fp8 exponent field (and its subnormals) is out.
// Instead two 128-entry byte tables (vpermt2b, AVX-512 VBMI) give the high and low byte of the
// bf16 word of each magnitude, the code's sign is or-ed into the high byte, and one more vpermt2b
// per 32 words interleaves the two bytes: five shuffles per 64 codes, where the fp16 route costs
// a conversion per 16. The tables hold value / kLoadFactor, the factor folded into the scales.

#define ATTNRT_FP8_FN __attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16,avx512vbmi")))

bool HasFp8Dot() {
  static const bool has = HasBf16Dot() && __builtin_cpu_supports("avx512vbmi");
  return has;
}

// Byte tables over the 7 magnitude bits, and the byte orders the shuffles use.
struct Fp8Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  // Output byte 2i takes byte i of the first operand, 2i + 1 byte i of the second (i < 32);
  // the upper table does the same for i in [32, 64).
  alignas(64) uint8_t pair_lower[64];
  alignas(64) uint8_t pair_upper[64];
};

template <DType DT>
const Fp8Tables& Fp8TablesOf() {
  static const Fp8Tables tables = [] {
    Fp8Tables t{};
    for (int code = 0; code < 128; ++code) {
      const auto c = static_cast<uint8_t>(code);
      const float value = DT == DType::e4m3 ? e4m3_to_float(c) : e5m2_to_float(c);
      uint16_t word = 0x7fc0;  // the NaN codes
      if (!std::isnan(value)) {
        uint32_t bits = 0;
        const float stored = value / kLoadFactor<DT>;
        std::memcpy(&bits, &stored, sizeof(bits));
        word = static_cast<uint16_t>(bits >> 16);  // exact: at most 3 mantissa bits
      }
      t.hi[code] = static_cast<uint8_t>(word >> 8);
      t.lo[code] = static_cast<uint8_t>(word & 0xff);
    }
    for (int i = 0; i < 32; ++i) {
      t.pair_lower[2 * i] = static_cast<uint8_t>(i);
      t.pair_lower[2 * i + 1] = static_cast<uint8_t>(64 + i);
      t.pair_upper[2 * i] = static_cast<uint8_t>(32 + i);
      t.pair_upper[2 * i + 1] = static_cast<uint8_t>(96 + i);
    }
    return t;
  }();
  return tables;
}

// The tables as registers: loaded once per call of a kernel below.
struct Fp8Regs {
  __m512i hi0, hi1, lo0, lo1, sign, pair_lower, pair_upper;
};

template <DType DT>
ATTNRT_FP8_FN HWY_INLINE Fp8Regs LoadFp8Regs() {
  const Fp8Tables& t = Fp8TablesOf<DT>();
  return {_mm512_load_si512(t.hi),
          _mm512_load_si512(t.hi + 64),
          _mm512_load_si512(t.lo),
          _mm512_load_si512(t.lo + 64),
          _mm512_set1_epi8(static_cast<char>(0x80)),
          _mm512_load_si512(t.pair_lower),
          _mm512_load_si512(t.pair_upper)};
}

// 64 codes to bf16 words: w0 = words of codes [0, 32), w1 = words of codes [32, 64).
ATTNRT_FP8_FN HWY_INLINE void WidenFp8(const Fp8Regs& r, __m512i codes, __m512i& w0, __m512i& w1) {
  // vpermt2b reads the low 7 bits of each index byte: the magnitude.
  __m512i hi = _mm512_permutex2var_epi8(r.hi0, codes, r.hi1);
  hi = _mm512_ternarylogic_epi32(hi, codes, r.sign, 0xf8);  // hi | (codes & 0x80)
  const __m512i lo = _mm512_permutex2var_epi8(r.lo0, codes, r.lo1);
  w0 = _mm512_permutex2var_epi8(lo, r.pair_lower, hi);
  w1 = _mm512_permutex2var_epi8(lo, r.pair_upper, hi);
}

// DecodeScoresBf16 for fp8 key rows, dim a multiple of 64.
template <DType DT, int NG>
ATTNRT_FP8_FN void DecodeScoresFp8(const uint32_t* q, int q_stride, const uint8_t* const* k,
                                   const uint8_t* const* pf, int n, int dim, float* s,
                                   int s_stride) {
  constexpr int kKeys = 8 / NG;
  const Fp8Regs regs = LoadFp8Regs<DT>();
  const DF df;
  for (int j = 0; j < n; j += kKeys) {
    const uint8_t* kr[kKeys];
    for (int kk = 0; kk < kKeys; ++kk) kr[kk] = k[std::min(j + kk, n - 1)];
    if (pf != nullptr) {
      for (int kk = 0; kk < kKeys && j + kk < n; ++kk) PrefetchRow(pf[j + kk], dim);
    }
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < dim; d += 64) {
      __m512i kw[kKeys][2];
      for (int kk = 0; kk < kKeys; ++kk) {
        WidenFp8(regs, _mm512_loadu_si512(kr[kk] + d), kw[kk][0], kw[kk][1]);
      }
      for (int g = 0; g < NG; ++g) {
        const uint32_t* qg = q + g * q_stride + d / 2;
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qg);
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qg + 16);
        for (int kk = 0; kk < kKeys; ++kk) {
          __m512& a = acc[g * kKeys + kk];
          a = _mm512_dpbf16_ps(a, q0, (__m512bh)kw[kk][0]);
          a = _mm512_dpbf16_ps(a, q1, (__m512bh)kw[kk][1]);
        }
      }
    }
    float out[8];
    Sum4(df, VF{acc[0]}, VF{acc[1]}, VF{acc[2]}, VF{acc[3]}, out);
    Sum4(df, VF{acc[4]}, VF{acc[5]}, VF{acc[6]}, VF{acc[7]}, out + 4);
    for (int g = 0; g < NG; ++g) {
      for (int kk = 0; kk < kKeys && j + kk < n; ++kk)
        s[g * s_stride + j + kk] = out[g * kKeys + kk];
    }
  }
}

// DecodeValuesBf16 for fp8 value rows, vdim a multiple of 64, NG <= 4 (4 x NG accumulators). The
// codes of two rows are interleaved first, so that widening them yields the key pairs directly.
template <DType DT, int NG>
ATTNRT_FP8_FN void DecodeValuesFp8(const uint8_t* const* v, const uint8_t* const* pf, int n,
                                   int vdim, const uint8_t* zero, const uint32_t* p, int p_stride,
                                   const float* alpha, float* acc, int acc_stride) {
  static_assert(NG <= 4, "accumulators must fit the register file");
  const Fp8Regs regs = LoadFp8Regs<DT>();
  for (int c = 0; c < vdim; c += 64) {
    __m512 o[NG][4];
    for (int g = 0; g < NG; ++g) {
      const __m512 al = _mm512_set1_ps(alpha[g]);
      for (int x = 0; x < 4; ++x) {
        o[g][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * acc_stride + c + 16 * x), al);
      }
    }
    for (int jp = 0; 2 * jp < n; ++jp) {
      if (pf != nullptr) {
        __builtin_prefetch(pf[2 * jp] + c, 0, 2);
        if (2 * jp + 1 < n) __builtin_prefetch(pf[2 * jp + 1] + c, 0, 2);
      }
      const __m512i va = _mm512_loadu_si512(v[2 * jp] + c);
      const __m512i vb = _mm512_loadu_si512((2 * jp + 1 < n ? v[2 * jp + 1] : zero) + c);
      __m512i pw[4];
      WidenFp8(regs, _mm512_permutex2var_epi8(va, regs.pair_lower, vb), pw[0], pw[1]);
      WidenFp8(regs, _mm512_permutex2var_epi8(va, regs.pair_upper, vb), pw[2], pw[3]);
      for (int g = 0; g < NG; ++g) {
        const __m512bh pg = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[g * p_stride + jp]));
        for (int x = 0; x < 4; ++x) o[g][x] = _mm512_dpbf16_ps(o[g][x], (__m512bh)pw[x], pg);
      }
    }
    for (int g = 0; g < NG; ++g) {
      for (int x = 0; x < 4; ++x) _mm512_storeu_ps(acc + g * acc_stride + c + 16 * x, o[g][x]);
    }
  }
}

// Exposed for the exhaustive test: n codes as the bf16 words the kernels above multiply.
template <DType DT>
ATTNRT_FP8_FN void WidenFp8Row(const uint8_t* src, int64_t n, uint16_t* dst) {
  const Fp8Regs regs = LoadFp8Regs<DT>();
  for (int64_t i = 0; i < n; i += 64) {
    alignas(64) uint8_t codes[64] = {};
    alignas(64) uint16_t words[64];
    const int64_t m = std::min<int64_t>(64, n - i);
    std::memcpy(codes, src + i, static_cast<size_t>(m));
    __m512i w0, w1;
    WidenFp8(regs, _mm512_load_si512(codes), w0, w1);
    _mm512_store_si512(words, w0);
    _mm512_store_si512(words + 32, w1);
    std::memcpy(dst + i, words, static_cast<size_t>(m) * sizeof(uint16_t));
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

#else
#define ATTNRT_BF16_DOT 0
bool HasBf16Dot() { return false; }
bool HasFp8Dot() { return false; }
#endif

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

  Arena arena;
  arena.reserve(static_cast<size_t>(dim) * rl);         // Q^T (fp32, or bf16 pairs)
  arena.reserve(static_cast<size_t>(kKeys) * kdim);  // a block of K, then of V
  arena.reserve(static_cast<size_t>(kKeys) * rl);   // S^T, then P^T
  arena.reserve(static_cast<size_t>(kKeys) * rl);   // P^T as bf16 pairs
  arena.reserve(static_cast<size_t>(vdim) * rl);        // O^T
  for (int k = 0; k < 5; ++k) arena.reserve(rl);        // m, l, alpha, query positions, maxima
  arena.reserve(static_cast<size_t>(ndraft) * rl);      // tree visibility per draft key
  arena.reserve(kdim);                                  // a zero row
  arena.bind(t_scratch.get(arena.total()));
  float* qt = arena.take(static_cast<size_t>(dim) * rl);
  float* kvf = arena.take(static_cast<size_t>(kKeys) * kdim);
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
  std::fill(zero_row, zero_row + kdim, 0.f);

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
      for (int d = 0; d < dim; ++d) {
        qt[static_cast<size_t>(d) * rl + i] =
            load_as_float(a.q, a.q_dtype, static_cast<size_t>(base + d * a.q_stride[2])) *
            a.qk_scale;
      }
    }
  }
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

    for (int j = 0; j < n; ++j) {
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
        VF acc[kTileKeyStep][NV];
        for (int kk = 0; kk < kTileKeyStep; ++kk) {
          for (int v = 0; v < NV; ++v) acc[kk][v] = zero;
        }
        const float* k0 = kvf + static_cast<size_t>(j) * dim;
        for (int d = 0; d < dim; ++d) {
          VF qv[NV];
          for (int v = 0; v < NV; ++v) {
            qv[v] = hn::Load(df, qt + static_cast<size_t>(d) * rl + v * lanes);
          }
          for (int kk = 0; kk < kTileKeyStep; ++kk) {
            const VF kv = hn::Set(df, k0[static_cast<size_t>(kk) * dim + d]);
            for (int v = 0; v < NV; ++v) acc[kk][v] = hn::MulAdd(kv, qv[v], acc[kk][v]);
          }
        }
        for (int kk = 0; kk < kTileKeyStep; ++kk) {
          for (int v = 0; v < NV; ++v) {
            hn::Store(acc[kk][v], df, st + static_cast<size_t>(j + kk) * rl + v * lanes);
          }
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
    VF qp[NV], bmax[NV];
    for (int v = 0; v < NV; ++v) {
      qp[v] = hn::Load(df, qpos + v * lanes);
      bmax[v] = neg_inf;
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
        if (a.softcap > 0.f) s = hn::Mul(cap, hn::Tanh(df, hn::Mul(s, inv_cap)));
        if (masked) {
          auto vis = draft ? hn::Gt(hn::Load(df, tvis + static_cast<size_t>(u) * rl + v * lanes), zero)
                           : hn::Le(kpos, qp[v]);
          if (a.window >= 0) vis = hn::And(vis, hn::Le(hn::Sub(qp[v], kpos), window));
          s = hn::IfThenElse(vis, s, neg_inf);
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
      for (int j = 0; j < n; ++j) {
        float* dst = kvf + static_cast<size_t>(j) * vdim;
        if (const T* row = key_row(v_cache, a.v_row_stride, vdim, kb + j)) {
          ConvertRow<DT>(row, vdim, dst);
        } else {
          std::fill(dst, dst + vdim, 0.f);
        }
      }
      VF al[NV];
      for (int v = 0; v < NV; ++v) al[v] = hn::Load(df, alpha + v * lanes);
      int d0 = 0;
      for (; d0 + kTileDvStep <= vdim; d0 += kTileDvStep) {
        VF o[kTileDvStep][NV];
        for (int dd = 0; dd < kTileDvStep; ++dd) {
          for (int v = 0; v < NV; ++v) {
            o[dd][v] = hn::Mul(hn::Load(df, ot + static_cast<size_t>(d0 + dd) * rl + v * lanes), al[v]);
          }
        }
        for (int j = 0; j < n; ++j) {
          VF pv[NV];
          for (int v = 0; v < NV; ++v) {
            pv[v] = hn::Load(df, st + static_cast<size_t>(j) * rl + v * lanes);
          }
          const float* vr = kvf + static_cast<size_t>(j) * vdim + d0;
          for (int dd = 0; dd < kTileDvStep; ++dd) {
            const VF vv = hn::Set(df, vr[dd]);
            for (int v = 0; v < NV; ++v) o[dd][v] = hn::MulAdd(vv, pv[v], o[dd][v]);
          }
        }
        for (int dd = 0; dd < kTileDvStep; ++dd) {
          for (int v = 0; v < NV; ++v) {
            hn::Store(o[dd][v], df, ot + static_cast<size_t>(d0 + dd) * rl + v * lanes);
          }
        }
      }
      for (; d0 < vdim; ++d0) {
        VF o[NV];
        for (int v = 0; v < NV; ++v) {
          o[v] = hn::Mul(hn::Load(df, ot + static_cast<size_t>(d0) * rl + v * lanes), al[v]);
        }
        for (int j = 0; j < n; ++j) {
          const VF vv = hn::Set(df, kvf[static_cast<size_t>(j) * vdim + d0]);
          for (int v = 0; v < NV; ++v) {
            o[v] = hn::MulAdd(vv, hn::Load(df, st + static_cast<size_t>(j) * rl + v * lanes), o[v]);
          }
        }
        for (int v = 0; v < NV; ++v) {
          hn::Store(o[v], df, ot + static_cast<size_t>(d0) * rl + v * lanes);
        }
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
// Merging the partial states of a split row set by log-sum-exp.

void MergeRows(const LayerArgs& a, const KernelPlan& p, const MergeItem& mi, int kv_head) {
  const WorkItem& first = p.items[mi.first_item];
  const RequestInfo& r = p.reqs[first.req];
  const int ng = first.g1 - first.g0;
  const int nrows = (first.t1 - first.t0) * ng;
  const int group = a.num_q_heads / a.num_kv_heads;
  const RowMap rows{r.q_row, first.t0, first.g0, ng, group, kv_head};
  const int vdim = a.v_head_dim;
  float* acc = t_scratch.get(static_cast<size_t>(vdim));
  for (int i = 0; i < nrows; ++i) {
    float m = kNegInf;
    for (int s = 0; s < mi.num_items; ++s) {
      m = std::max(m, Part(a, p, p.items[mi.first_item + s], kv_head).m[i]);
    }
    std::fill(acc, acc + vdim, 0.f);
    float l = 0.f;
    if (m != kNegInf) {
      for (int s = 0; s < mi.num_items; ++s) {
        const PartView part = Part(a, p, p.items[mi.first_item + s], kv_head);
        if (part.m[i] == kNegInf) continue;
        const float w = std::exp(part.m[i] - m);
        l += w * part.l[i];
        const float* src = part.acc + static_cast<int64_t>(i) * vdim;
        for (int d = 0; d < vdim; ++d) acc[d] += w * src[d];
      }
    }
    WriteRow(a, rows, i, acc, 1, m, l);
  }
}

// ------------------------------------------------------------------------------------------------

template <DType DT>
void RunItem(const LayerArgs& a, const KernelPlan& p, const WorkItem& it, int kv_head, bool dot) {
  const RequestInfo& r = p.reqs[it.req];
  const bool single = it.t1 - it.t0 == 1 && (r.tree < 0 || !a.causal || r.qlen == 1);
  if (single) {
    // One task covers every kv head (see DecodeItem); the plan counts it that way.
    if (kv_head != 0) return;
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
    DecodeItem<DT, false>(a, p, it);
    return;
  }
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
  } else if (vectors == 2 || kWideTile == 2) {
    TileItem<DT, 2, false>(a, p, it, kv_head);
  } else {
    TileItem<DT, kWideTile, false>(a, p, it, kv_head);
  }
}

template <DType DT>
void RunAll(const LayerArgs& args, const KernelPlan& p) {
  LayerArgs a = args;
  a.qk_scale *= kLoadFactor<DT>;
  a.v_scale *= kLoadFactor<DT>;
  // bf16 dot products where q, K/V and the output are all bf16: the output's rounding dominates
  // the bf16 probabilities' error.
  // fp8 K/V: the single-query kernel widens them to bf16 (exactly) for the same dot products.
  const bool bf16_io = a.q_dtype == DType::bf16 && a.out_dtype == DType::bf16;
  const bool dot = bf16_io && ((DT == DType::bf16 && a.head_dim % 2 == 0 && HasBf16Dot()) ||
                               ((DT == DType::e4m3 || DT == DType::e5m2) && HasFp8Dot()));
  const int64_t heads = a.num_kv_heads;
  const int64_t work = p.num_items * heads;
  const int64_t merges = p.num_merges * heads;
#pragma omp parallel num_threads(p.num_threads) if (p.num_threads > 1 && work > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < work; ++w) {
      RunItem<DT>(a, p, p.items[w / heads], static_cast<int>(w % heads), dot);
    }
#pragma omp for schedule(dynamic, 4)
    for (int64_t w = 0; w < merges; ++w) {
      MergeRows(a, p, p.merges[w / heads], static_cast<int>(w % heads));
    }
  }
}

void RunAttention(const LayerArgs& a, const KernelPlan& p) {
  switch (a.kv_dtype) {
    case DType::f32: return RunAll<DType::f32>(a, p);
    case DType::f16: return RunAll<DType::f16>(a, p);
    case DType::bf16: return RunAll<DType::bf16>(a, p);
    case DType::e4m3: return RunAll<DType::e4m3>(a, p);
    case DType::e5m2: return RunAll<DType::e5m2>(a, p);
    default: break;
  }
}

int TileRows() { return kWideTile * static_cast<int>(hn::Lanes(DF())); }

std::string TargetName() {
  std::string name = hwy::TargetName(HWY_TARGET);
  if (HasBf16Dot()) name += "+BF16";
  return name;
}

void ConvertToFloat(DType dtype, const void* src, int64_t n, float* dst) {
  const int count = static_cast<int>(n);
  if (dtype == DType::e4m3) {
    ConvertRow<DType::e4m3>(static_cast<const uint8_t*>(src), count, dst);
    for (int i = 0; i < count; ++i) dst[i] *= kLoadFactor<DType::e4m3>;
    return;
  }
  switch (dtype) {
    case DType::f32: return ConvertRow<DType::f32>(static_cast<const float*>(src), count, dst);
    case DType::f16:
      return ConvertRow<DType::f16>(static_cast<const hwy::float16_t*>(src), count, dst);
    case DType::bf16:
      return ConvertRow<DType::bf16>(static_cast<const hwy::bfloat16_t*>(src), count, dst);
    case DType::e5m2: return ConvertRow<DType::e5m2>(static_cast<const uint8_t*>(src), count, dst);
    default: break;
  }
}

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

HWY_EXPORT(RunAttention);
HWY_EXPORT(TileRows);
HWY_EXPORT(TargetName);
HWY_EXPORT(ConvertToFloat);
HWY_EXPORT(WidenFp8ToBf16);

void run_attention(const LayerArgs& args, const KernelPlan& plan) {
  HWY_DYNAMIC_DISPATCH(RunAttention)(args, plan);
}

int tile_rows() { return HWY_DYNAMIC_DISPATCH(TileRows)(); }

std::string simd_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

void convert_to_float(DType dtype, const void* src, int64_t n, float* dst) {
  HWY_DYNAMIC_DISPATCH(ConvertToFloat)(dtype, src, n, dst);
}

bool widen_fp8_to_bf16(DType dtype, const uint8_t* src, int64_t n, uint16_t* dst) {
  return HWY_DYNAMIC_DISPATCH(WidenFp8ToBf16)(dtype, src, n, dst);
}

// Every target folds the same factor (KvElem<e4m3>::kFactor), so the static target's value holds.
float kernel_load_factor(DType dtype) {
  return dtype == DType::e4m3 ? HWY_NAMESPACE::kLoadFactor<DType::e4m3> : 1.f;
}

}  // namespace attnrt::cpu
#endif  // HWY_ONCE
