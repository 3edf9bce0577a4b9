// What the cpu attention kernels share, compiled once per Highway target by every kernel
// translation unit that includes it after hwy/foreach_target.h: the block sizes, loading stored K/V
// elements as fp32 vectors, prefetching pool rows, the per-thread scratch, finishing a row (or
// handing its state to the merge), and the probe that says whether the bf16 dot-product
// (vdpbf16ps) kernels run.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "backends/cpu/kernels/attention_plan.h"
#include "hwy/aligned_allocator.h"

// Per-target include guard (Highway's pattern for headers of SIMD code).
#if defined(ATTNRT_CPU_KERNEL_COMMON_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTNRT_CPU_KERNEL_COMMON_INL_H_
#undef ATTNRT_CPU_KERNEL_COMMON_INL_H_
#else
#define ATTNRT_CPU_KERNEL_COMMON_INL_H_
#endif

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attnrt::cpu {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
// Row vectors of the tile kernel's largest tiles: four where the register file holds 32 vectors
// (AVX-512: a 4 x 4 block of accumulators and its operands), which halves the K/V reads and the
// per-block work per query row against two.
constexpr int kWideTile = HWY_TARGET <= HWY_AVX3 ? 4 : 2;
// Row vectors of the tiles of wide items (many q heads per kv head, e.g. MLA's 16 or 128 on one
// latent head), run in panels of kWideTile: twice kWideTile's rows on 16-register targets, so that
// every K/V row widened serves twice the rows.
constexpr int kLatentTile = 4;

// ------------------------------------------------------------------------------------------------
// Loading stored K/V elements as fp32 vectors.

template <DType DT>
struct KvElem;

template <>
struct KvElem<DType::f32> {
  using T = float;
  static HWY_INLINE VF Load(DF df, const T* p) { return hn::LoadU(df, p); }
};

// 16-bit floats the hardware widens to fp32 directly.
template <typename Half>
struct PromotedKvElem {
  using T = Half;
  static HWY_INLINE VF Load(DF df, const T* p) {
    const hn::Rebind<T, DF> d16;
    return hn::PromoteTo(df, hn::LoadU(d16, p));
  }
};

template <>
struct KvElem<DType::bf16> : PromotedKvElem<hwy::bfloat16_t> {};

template <>
struct KvElem<DType::f16> : PromotedKvElem<hwy::float16_t> {};

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

// Calls fn(KvType<DT>()) for the K/V type `dtype` (fp32, fp16, bf16, fp8 e4m3 / e5m2); nothing
// for another type.
template <DType DT>
using KvType = std::integral_constant<DType, DT>;

template <class Fn>
HWY_INLINE void WithKvType(DType dtype, const Fn& fn) {
  switch (dtype) {
    case DType::f32: return fn(KvType<DType::f32>());
    case DType::f16: return fn(KvType<DType::f16>());
    case DType::bf16: return fn(KvType<DType::bf16>());
    case DType::e4m3: return fn(KvType<DType::e4m3>());
    case DType::e5m2: return fn(KvType<DType::e5m2>());
    default: break;
  }
}

// How much larger the stored values are than what KvElem<DT>::Load returns. `inline`: an explicit
// specialization of a variable template is not implicitly inline, and this header is included by
// several kernel files (one definition each otherwise; clang's linker refuses the duplicates).
template <DType DT>
inline constexpr float kLoadFactor = 1.f;
template <>
inline constexpr float kLoadFactor<DType::e4m3> = KvElem<DType::e4m3>::kFactor;

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

// Widens n elements of a q row (fp32, fp16 or bf16 at offset `base`, `stride` elements apart) to
// fp32: whole vectors for a contiguous row, element by element otherwise.
HWY_INLINE void LoadQueryRow(const void* q, DType dtype, int64_t base, int64_t stride, int n,
                             float* dst) {
  if (stride == 1) {
    switch (dtype) {
      case DType::f32:
        return ConvertRow<DType::f32>(static_cast<const float*>(q) + base, n, dst);
      case DType::bf16:
        return ConvertRow<DType::bf16>(static_cast<const hwy::bfloat16_t*>(q) + base, n, dst);
      case DType::f16:
        return ConvertRow<DType::f16>(static_cast<const hwy::float16_t*>(q) + base, n, dst);
      default: break;
    }
  }
  for (int d = 0; d < n; ++d) {
    dst[d] = load_as_float(q, dtype, static_cast<size_t>(base + d * stride));
  }
}

// dst[d] = float_to_bf16(src[d] * norm) for n values: rounded to nearest even, NaN kept (quiet).
HWY_INLINE void ScaledRowToBf16(const float* src, int n, float norm, uint16_t* dst) {
  int d = 0;
#if HWY_TARGET != HWY_SCALAR
  const DF df;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> d16;
  const int lanes = static_cast<int>(hn::Lanes(df));
  const VF scale = hn::Set(df, norm);
  for (; d + lanes <= n; d += lanes) {
    const VF x = hn::Mul(hn::LoadU(df, src + d), scale);
    const auto u = hn::BitCast(di, x);
    const auto high = hn::And(hn::ShiftRight<16>(u), hn::Set(di, 0xffff));
    const auto rounded = hn::And(
        hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(di, 0x7fff), hn::And(high, hn::Set(di, 1))))),
        hn::Set(di, 0xffff));
    const auto bits =
        hn::IfThenElse(hn::RebindMask(di, hn::IsNaN(x)), hn::Or(high, hn::Set(di, 0x40)), rounded);
    hn::StoreU(hn::DemoteTo(d16, bits), d16, dst + d);
  }
#endif
  for (; d < n; ++d) dst[d] = float_to_bf16(src[d] * norm);
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

// One per thread and target, shared by every kernel translation unit (inline: one definition).
inline thread_local Scratch t_scratch;

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

// Non-finite inputs (docs/backends.md, "NaN and infinity"): a row whose q holds a NaN or an
// infinity, or that attends to a key whose K or V does, is written as NaN, as on `reference`. The
// q row is checked here (a few dozen loads per row); K and V reach the row through its scores and
// its weighted sum, whose state then is not finite (the score max skips NaN, so m alone is not
// enough: l or acc carries it).
HWY_INLINE bool RowIsFinite(const LayerArgs& a, int64_t t, int h, const float* acc,
                            int64_t acc_stride, float m, float l) {
  if (std::isnan(m) || m == std::numeric_limits<float>::infinity() || !std::isfinite(l)) {
    return false;
  }
  for (int d = 0; d < a.head_dim; ++d) {
    const size_t at =
        static_cast<size_t>(t * a.q_stride[0] + h * a.q_stride[1] + d * a.q_stride[2]);
    if (!std::isfinite(load_as_float(a.q, a.q_dtype, at))) return false;
  }
  for (int d = 0; d < a.v_head_dim; ++d) {
    if (!std::isfinite(acc[d * acc_stride])) return false;
  }
  return true;
}

HWY_INLINE void WriteNanRow(const LayerArgs& a, int64_t t, int h) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t base = t * a.out_stride[0] + h * a.out_stride[1];
  for (int d = 0; d < a.v_head_dim; ++d) {
    store_from_float(a.out, a.out_dtype, static_cast<size_t>(base + d * a.out_stride[2]), nan);
  }
  if (a.lse != nullptr) a.lse[t * a.lse_stride[0] + h * a.lse_stride[1]] = nan;
}

// acc: the row's Dv accumulated values (stride acc_stride between dims); m, l its softmax state.
HWY_INLINE void WriteRow(const LayerArgs& a, const RowMap& rows, int i, const float* acc,
                         int64_t acc_stride, float m, float l) {
  const int64_t t = rows.token_row(i);
  const int h = rows.head(i);
  if (!RowIsFinite(a, t, h, acc, acc_stride, m, l)) {
    WriteNanRow(a, t, h);
    return;
  }
  float big = m;
  if (a.sinks != nullptr) big = std::max(big, a.sinks[h]);
  const float keep = big == kNegInf ? 0.f : std::exp(m - big);
  float den = l * keep;
  if (a.sinks != nullptr) den += std::exp(a.sinks[h] - big);
  // Every real row sees at least its own key, so den > 0; an empty row is written as zeros.
  const float norm = den > 0.f ? keep * a.v_scale / den : 0.f;
  const int64_t base = t * a.out_stride[0] + h * a.out_stride[1];
  if (a.out_dtype == DType::bf16 && a.out_stride[2] == 1) {
    // The common case in vectors, a chunk of the row gathered at a time (a few % of a bf16
    // prefill, a fifth of an MLA step's short rows element by element).
    uint16_t* out = static_cast<uint16_t*>(a.out) + base;
    constexpr int kChunk = 64;
    HWY_ALIGN float row[kChunk];
    for (int d0 = 0; d0 < a.v_head_dim; d0 += kChunk) {
      const int n = std::min(kChunk, a.v_head_dim - d0);
      const float* src = acc + d0 * acc_stride;
      if (acc_stride != 1) {
        for (int d = 0; d < n; ++d) row[d] = src[d * acc_stride];
        src = row;
      }
      ScaledRowToBf16(src, n, norm, out + d0);
    }
  } else if (a.out_dtype == DType::bf16) {
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
// Folding dot products (single-query kernels).

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

// ------------------------------------------------------------------------------------------------
// bf16 dot products (vdpbf16ps: AVX-512 BF16, from Cooper Lake and Zen 4 on). Highway 1.0 has no
// target for them, so the few micro-kernels that use them (ATTNRT_BF16_FN, in the kernel files) use
// the intrinsics directly and run only where HasBf16Dot() says so. Products of two bf16 are exact
// in fp32; only the probabilities are rounded to bf16 for P.V, which the bf16 output rounds far
// more.

#undef ATTNRT_BF16_DOT
#undef ATTNRT_BF16_FN
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define ATTNRT_BF16_DOT 1
#define ATTNRT_BF16_FN __attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16")))

// Issue-rate probe: seconds of `iters` rounds of vdpbf16ps (kDot) or vfmadd over 12 independent
// chains, enough to hide either's latency; every chain feeds the result so that none is dropped.
template <bool kDot>
ATTNRT_BF16_FN double IssueLoopSeconds(int iters) {
  __m512 acc[12];
  for (auto& x : acc) x = _mm512_setzero_ps();
  const __m512bh pair = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const __m512 one = _mm512_set1_ps(1.f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    for (auto& x : acc) {
      if constexpr (kDot) {
        x = _mm512_dpbf16_ps(x, pair, pair);
      } else {
        x = _mm512_fmadd_ps(one, one, x);
      }
    }
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
inline bool HasBf16Dot() {
  static const bool prefer = [] {
    if (!__builtin_cpu_supports("avx512bf16")) return false;
    double dot = 1e30, fma = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      dot = std::min(dot, IssueLoopSeconds<true>(4096));
      fma = std::min(fma, IssueLoopSeconds<false>(4096));
    }
    return dot * 0.75 <= fma;
  }();
  return prefer;
}

// vpermt2w word orders that pair two rows of 32 bf16 words along the keys: kPairLo gives
// a0 b0 a1 b1 ... a15 b15, kPairHi a16 b16 ... a31 b31 (V pairs for the P.V dot products).
alignas(64) inline constexpr int16_t kPairLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) inline constexpr int16_t kPairHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                    53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                    27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// The single-query kernels' fp8 form also needs AVX-512 VBMI (fp8_dot-inl.h).
inline bool HasFp8Dot() {
  static const bool has = HasBf16Dot() && __builtin_cpu_supports("avx512vbmi");
  return has;
}

#else
#define ATTNRT_BF16_DOT 0
inline bool HasBf16Dot() { return false; }
inline bool HasFp8Dot() { return false; }
#endif

}  // namespace HWY_NAMESPACE
}  // namespace attnrt::cpu
HWY_AFTER_NAMESPACE();

#endif  // ATTNRT_CPU_KERNEL_COMMON_INL_H_
