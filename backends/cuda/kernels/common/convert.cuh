// Element types on the device: the dtype codes the launch parameters carry, float <-> 16-bit
// conversions, and fp8 (e4m3 / e5m2) -> 16-bit / float conversions. Every e4m3 and e5m2 value is
// exactly representable in f16, so the fp8 paths go through f16 and lose nothing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "attnrt/core/dtype.h"

namespace attnrt::cuda {

// attnrt::DType values, as the int32 dtype fields of the launch parameters hold them (linear.h's
// DTypeCode, StoreParams).
inline constexpr int32_t kF32 = static_cast<int32_t>(DType::f32);
inline constexpr int32_t kF16 = static_cast<int32_t>(DType::f16);
inline constexpr int32_t kBF16 = static_cast<int32_t>(DType::bf16);
inline constexpr int32_t kE4M3 = static_cast<int32_t>(DType::e4m3);
inline constexpr int32_t kE5M2 = static_cast<int32_t>(DType::e5m2);

// A type as a value, for generic lambdas: `using T = typename decltype(tag)::type;`.
template <typename T>
struct TypeTag {
  using type = T;
};

// f(TypeTag<float>{}) or f(TypeTag<__nv_bfloat16>{}) by the code `t` (kF32 or kBF16: the element
// types of the linear layers' conv outputs y, linear.h), `other` for any other code. Launchers
// call it once per launch, so that both kernels are instantiated and none for other codes.
template <typename R, typename F>
R with_f32_or_bf16(int32_t t, R other, F&& f) {
  if (t == kF32) return f(TypeTag<float>{});
  if (t == kBF16) return f(TypeTag<__nv_bfloat16>{});
  return other;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// x rounded to nearest (even) in T.
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// x rounded to the precision of T (what storing and reloading it gives).
template <typename T>
__device__ __forceinline__ float round_as(float x) {
  return to_float(from_float<T>(x));
}

// Two floats -> one register holding two 16-bit values of T (low half = first).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// One fp8 byte as a float.
__device__ __forceinline__ float fp8_to_float(uint8_t b, bool e5m2) {
  const __half_raw h =
      __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(__half(h));
}

// A float as one fp8 byte, rounded to nearest and saturated to the largest finite value (the
// host pools' conversion).
__device__ __forceinline__ uint8_t float_to_fp8(float x, bool e5m2) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

// Four floats as four e4m3 bytes of one register (x0 in the low byte), rounded to nearest and
// saturated: two hardware conversions.
__device__ __forceinline__ uint32_t pack4_e4m3(float x0, float x1, float x2, float x3) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// Four fp8 bytes -> two registers of two f16 values (bytes 0, 1 -> lo; 2, 3 -> hi), exactly. e4m3
// is one hardware conversion per pair; e5m2 is the upper byte of an f16, so it is only moved.
template <bool E5M2>
__device__ __forceinline__ void fp8x4_to_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (E5M2) {
    lo = __byte_perm(w, 0u, 0x1404);
    hi = __byte_perm(w, 0u, 0x3424);
  } else {
    const __half2_raw a =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    const __half2_raw b =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    lo = static_cast<uint32_t>(a.x) | (static_cast<uint32_t>(a.y) << 16);
    hi = static_cast<uint32_t>(b.x) | (static_cast<uint32_t>(b.y) << 16);
  }
}

// Four fp8 bytes -> two registers of two 16-bit values of T (bytes 0, 1 -> lo; 2, 3 -> hi). For
// bf16 the f16 bits are moved into bf16 position by a shift, which divides the value by 2^112
// exactly (e4m3 values, and e5m2 values from 2^-14 up, stay normal bf16 numbers): the caller
// undoes the factor (attention.cuh).
template <typename T>
__device__ __forceinline__ void fp8x4_to(uint32_t w, bool e5m2, uint32_t& lo, uint32_t& hi) {
  uint32_t h0, h1;
  if (e5m2) {
    fp8x4_to_f16<true>(w, h0, h1);
  } else {
    fp8x4_to_f16<false>(w, h0, h1);
  }
  if constexpr (std::is_same_v<T, __half>) {
    lo = h0;
    hi = h1;
  } else {
    lo = ((h0 >> 3) & 0x0fff0fffu) | (h0 & 0x80008000u);
    hi = ((h1 >> 3) & 0x0fff0fffu) | (h1 & 0x80008000u);
  }
}

}  // namespace attnrt::cuda
