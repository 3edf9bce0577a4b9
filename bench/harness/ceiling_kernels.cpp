// SIMD loops of the CPU ceiling probes, compiled for every Highway target and dispatched at run
// time, so the figures are what this CPU's widest vectors reach (not what the build machine had).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/harness/ceiling_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "bench/harness/ceiling_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace attnrt::bench::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Eight independent accumulators: an add has a latency of several cycles and a core issues two
// loads per cycle, so fewer chains would make this a latency test instead of a bandwidth test.
float StreamReadSum(const float* HWY_RESTRICT data, size_t count) {
  const hn::ScalableTag<float> d;
  const size_t n = hn::Lanes(d);
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  auto a4 = hn::Zero(d), a5 = hn::Zero(d), a6 = hn::Zero(d), a7 = hn::Zero(d);
  size_t i = 0;
  for (; i + 8 * n <= count; i += 8 * n) {
    a0 = hn::Add(a0, hn::LoadU(d, data + i + 0 * n));
    a1 = hn::Add(a1, hn::LoadU(d, data + i + 1 * n));
    a2 = hn::Add(a2, hn::LoadU(d, data + i + 2 * n));
    a3 = hn::Add(a3, hn::LoadU(d, data + i + 3 * n));
    a4 = hn::Add(a4, hn::LoadU(d, data + i + 4 * n));
    a5 = hn::Add(a5, hn::LoadU(d, data + i + 5 * n));
    a6 = hn::Add(a6, hn::LoadU(d, data + i + 6 * n));
    a7 = hn::Add(a7, hn::LoadU(d, data + i + 7 * n));
  }
  auto sum = hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)),
                     hn::Add(hn::Add(a4, a5), hn::Add(a6, a7)));
  float total = hn::GetLane(hn::SumOfLanes(d, sum));
  for (; i < count; ++i) total += data[i];
  return total;
}

// Twelve independent FMA chains: two FMA pipes times a latency of four to five cycles need at
// least ten in flight, and twelve accumulators plus two operands still fit AVX2's sixteen
// registers. acc = acc * a + b converges (|a| < 1), so the values never overflow or go denormal.
double FmaLoop(uint64_t iterations, float a, float b, float* sink) {
  const hn::ScalableTag<float> d;
  const auto va = hn::Set(d, a), vb = hn::Set(d, b);
  auto c0 = hn::Set(d, 0.f), c1 = hn::Set(d, 1.f), c2 = hn::Set(d, 2.f), c3 = hn::Set(d, 3.f);
  auto c4 = hn::Set(d, 4.f), c5 = hn::Set(d, 5.f), c6 = hn::Set(d, 6.f), c7 = hn::Set(d, 7.f);
  auto c8 = hn::Set(d, 8.f), c9 = hn::Set(d, 9.f), c10 = hn::Set(d, 10.f), c11 = hn::Set(d, 11.f);
  for (uint64_t it = 0; it < iterations; ++it) {
    c0 = hn::MulAdd(c0, va, vb);
    c1 = hn::MulAdd(c1, va, vb);
    c2 = hn::MulAdd(c2, va, vb);
    c3 = hn::MulAdd(c3, va, vb);
    c4 = hn::MulAdd(c4, va, vb);
    c5 = hn::MulAdd(c5, va, vb);
    c6 = hn::MulAdd(c6, va, vb);
    c7 = hn::MulAdd(c7, va, vb);
    c8 = hn::MulAdd(c8, va, vb);
    c9 = hn::MulAdd(c9, va, vb);
    c10 = hn::MulAdd(c10, va, vb);
    c11 = hn::MulAdd(c11, va, vb);
  }
  auto sum = hn::Add(hn::Add(hn::Add(c0, c1), hn::Add(c2, c3)),
                     hn::Add(hn::Add(c4, c5), hn::Add(c6, c7)));
  sum = hn::Add(sum, hn::Add(hn::Add(c8, c9), hn::Add(c10, c11)));
  *sink = hn::GetLane(hn::SumOfLanes(d, sum));
  return static_cast<double>(iterations) * 12.0 * 2.0 * static_cast<double>(hn::Lanes(d));
}

const char* TargetNameOfThisTarget() { return hwy::TargetName(HWY_TARGET); }

}  // namespace attnrt::bench::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace attnrt::bench {

HWY_EXPORT(StreamReadSum);
HWY_EXPORT(FmaLoop);
HWY_EXPORT(TargetNameOfThisTarget);

float stream_read_sum(const float* data, size_t count) {
  return HWY_DYNAMIC_DISPATCH(StreamReadSum)(data, count);
}

double fma_loop(uint64_t iterations, float a, float b, float* sink) {
  return HWY_DYNAMIC_DISPATCH(FmaLoop)(iterations, a, b, sink);
}

const char* dispatched_target_name() { return HWY_DYNAMIC_DISPATCH(TargetNameOfThisTarget)(); }

// Highway 1.0 has no target that emits vdpbf16ps, so the bf16 probe uses the intrinsic directly,
// compiled for AVX512-BF16 whatever the build flags and entered only after a run-time CPU check.
#if defined(__x86_64__) && defined(__GNUC__)
bool bf16_dot_supported(std::string* why_not) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16")) return true;
  *why_not = "n/a: this CPU has no AVX512-BF16 (no vdpbf16ps); prefill is judged against fp32 FMA";
  return false;
}

__attribute__((target("avx512f,avx512bf16"))) double bf16_dot_loop(uint64_t iterations,
                                                                    float* sink) {
  // Operands: bf16 1.0 (0x3f80) and 2^-10 (0x3a80): each step adds 2 * 2^-10 to every lane, exact
  // in fp32 for the iteration counts used here.
  const __m512i a_bits = _mm512_set1_epi16(0x3f80);
  const __m512i b_bits = _mm512_set1_epi16(0x3a80);
  const __m512bh a = reinterpret_cast<const __m512bh&>(a_bits);
  const __m512bh b = reinterpret_cast<const __m512bh&>(b_bits);
  // Distinct starting values: identical chains would be merged into one by the compiler, which
  // then measures the instruction's latency instead of its throughput.
  __m512 c0 = _mm512_set1_ps(0.f), c1 = _mm512_set1_ps(1.f), c2 = _mm512_set1_ps(2.f);
  __m512 c3 = _mm512_set1_ps(3.f), c4 = _mm512_set1_ps(4.f), c5 = _mm512_set1_ps(5.f);
  __m512 c6 = _mm512_set1_ps(6.f), c7 = _mm512_set1_ps(7.f), c8 = _mm512_set1_ps(8.f);
  __m512 c9 = _mm512_set1_ps(9.f), c10 = _mm512_set1_ps(10.f), c11 = _mm512_set1_ps(11.f);
  for (uint64_t it = 0; it < iterations; ++it) {
    c0 = _mm512_dpbf16_ps(c0, a, b);
    c1 = _mm512_dpbf16_ps(c1, a, b);
    c2 = _mm512_dpbf16_ps(c2, a, b);
    c3 = _mm512_dpbf16_ps(c3, a, b);
    c4 = _mm512_dpbf16_ps(c4, a, b);
    c5 = _mm512_dpbf16_ps(c5, a, b);
    c6 = _mm512_dpbf16_ps(c6, a, b);
    c7 = _mm512_dpbf16_ps(c7, a, b);
    c8 = _mm512_dpbf16_ps(c8, a, b);
    c9 = _mm512_dpbf16_ps(c9, a, b);
    c10 = _mm512_dpbf16_ps(c10, a, b);
    c11 = _mm512_dpbf16_ps(c11, a, b);
  }
  __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                             _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
  sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
  *sink = _mm512_reduce_add_ps(sum);
  // 16 fp32 lanes, each: two products and two adds per instruction.
  return static_cast<double>(iterations) * 12.0 * 16.0 * 4.0;
}
#else
bool bf16_dot_supported(std::string* why_not) {
  *why_not = "n/a: the bf16 dot probe exists for x86 AVX512-BF16 only";
  return false;
}

double bf16_dot_loop(uint64_t, float* sink) {
  *sink = 0;
  return 0;
}
#endif

}  // namespace attnrt::bench
#endif  // HWY_ONCE
