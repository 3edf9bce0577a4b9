// fp8 K/V (e4m3, e5m2) on the single-query bf16 dot-product kernels: the byte tables that widen
// fp8 codes exactly to bf16, and the score and value micro-kernels over fp8 rows (AVX-512 BF16 +
// VBMI only). Compiled once per Highway target by decode_kernel.cc, which includes it after
// hwy/foreach_target.h.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// Per-target include guard (Highway's pattern for headers of SIMD code).
#if defined(ATTNRT_CPU_FP8_DOT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTNRT_CPU_FP8_DOT_INL_H_
#undef ATTNRT_CPU_FP8_DOT_INL_H_
#else
#define ATTNRT_CPU_FP8_DOT_INL_H_
#endif

#include "backends/cpu/kernels/kernel_common-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attnrt::cpu {
namespace HWY_NAMESPACE {

#if ATTNRT_BF16_DOT

// fp8 K/V on the bf16 dot-product kernels. Every fp8 value (e4m3 and e5m2, subnormals included) is
// a bf16 normal, so the widening is exact; it must not produce bf16 subnormals, which vdpbf16ps
// reads as zero, so a bit placement that keeps the fp8 exponent field (and its subnormals) is out.
// Instead two 128-entry byte tables (vpermt2b, AVX-512 VBMI) give the high and low byte of the
// bf16 word of each magnitude, the code's sign is or-ed into the high byte, and one more vpermt2b
// per 32 words interleaves the two bytes: five shuffles per 64 codes, where the fp16 route costs
// a conversion per 16. The tables hold value / kLoadFactor, the factor folded into the scales.

#undef ATTNRT_FP8_FN
#define ATTNRT_FP8_FN __attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16,avx512vbmi")))

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

#endif  // ATTNRT_BF16_DOT

}  // namespace HWY_NAMESPACE
}  // namespace attnrt::cpu
HWY_AFTER_NAMESPACE();

#endif  // ATTNRT_CPU_FP8_DOT_INL_H_
