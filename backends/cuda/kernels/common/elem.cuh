// Element loads and stores of tensors whose dtype is a run-time code (kBF16, kF16 or kF32 of
// convert.cuh: activations, recurrent states), one, two or V elements at a time, as floats; and
// typed vector loads and stores of a few elements.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"

namespace attnrt::cuda {

// Element i of a tensor of dtype `t`.
__device__ __forceinline__ float load_elem(const void* base, int32_t t, int64_t i) {
  if (t == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  if (t == kF16) return __half2float(static_cast<const __half*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

__device__ __forceinline__ void store_elem(void* base, int32_t t, int64_t i, float v) {
  if (t == kBF16) {
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
  } else if (t == kF16) {
    static_cast<__half*>(base)[i] = __float2half_rn(v);
  } else {
    static_cast<float*>(base)[i] = v;
  }
}

// The dtypes a code can take: any of the three, or f32 / bf16 only (recurrent states, linear.h),
// which spares the f16 test.
enum class Dtypes { any, f32_or_bf16 };

// Elements i, i + 1 (i even, the buffer aligned to two elements) in one access.
template <Dtypes D = Dtypes::any>
__device__ __forceinline__ float2 load_elem2(const void* base, int32_t t, int64_t i) {
  if (t == kBF16)
    return __bfloat1622float2(
        *reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(base) + i));
  if (D == Dtypes::any && t == kF16)
    return __half22float2(*reinterpret_cast<const __half2*>(static_cast<const __half*>(base) + i));
  return *reinterpret_cast<const float2*>(static_cast<const float*>(base) + i);
}

template <Dtypes D = Dtypes::any>
__device__ __forceinline__ void store_elem2(void* base, int32_t t, int64_t i, float a, float b) {
  if (t == kBF16) {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + i) =
        __floats2bfloat162_rn(a, b);
  } else if (D == Dtypes::any && t == kF16) {
    *reinterpret_cast<__half2*>(static_cast<__half*>(base) + i) = __floats2half2_rn(a, b);
  } else {
    *reinterpret_cast<float2*>(static_cast<float*>(base) + i) = make_float2(a, b);
  }
}

// The raw storage of E elements of S: one load or store of E * sizeof(S) bytes when that is a
// power of two up to 16.
template <typename S, int E>
struct alignas(E * sizeof(S) <= 16 ? E * sizeof(S) : 16) Vec {
  S v[E];
};

template <typename S, int E>
__device__ __forceinline__ void load_vec(const S* p, float (&out)[E]) {
  const Vec<S, E> r = *reinterpret_cast<const Vec<S, E>*>(p);
#pragma unroll
  for (int e = 0; e < E; ++e) out[e] = to_float(r.v[e]);
}

template <typename S, int E>
__device__ __forceinline__ void store_vec(S* p, const float (&in)[E]) {
  Vec<S, E> r;
#pragma unroll
  for (int e = 0; e < E; ++e) r.v[e] = from_float<S>(in[e]);
  *reinterpret_cast<Vec<S, E>*>(p) = r;
}

// Elements i .. i + V - 1 of a tensor of dtype `t` in one vector load (aligned to V elements).
template <int V>
__device__ __forceinline__ void load_elems(const void* base, int32_t t, int64_t i,
                                           float (&out)[V]) {
  if (t == kBF16) {
    load_vec<__nv_bfloat16, V>(static_cast<const __nv_bfloat16*>(base) + i, out);
  } else if (t == kF16) {
    load_vec<__half, V>(static_cast<const __half*>(base) + i, out);
  } else {
    load_vec<float, V>(static_cast<const float*>(base) + i, out);
  }
}

// load_elems in two halves, for loads issued ahead of their use: V elements of dtype t at base + i
// (aligned to V elements) as raw bits with no conversion, so that the load stays in flight until
// raw_to_float reads it (a conversion right after the load waits for it there): 2 V bytes in r[0]
// for 16-bit types, 4 V bytes in r[0] (and r[1] for V = 8) for fp32.
template <int V>
__device__ __forceinline__ void load_raw(const void* base, int32_t t, int64_t i, uint4 (&r)[2]) {
  static_assert(V == 4 || V == 8);
  if (t == kBF16 || t == kF16) {
    const uint16_t* h = static_cast<const uint16_t*>(base) + i;
    if constexpr (V == 8) {
      r[0] = *reinterpret_cast<const uint4*>(h);
    } else {
      const uint2 u = *reinterpret_cast<const uint2*>(h);
      r[0].x = u.x;
      r[0].y = u.y;
    }
  } else {
    const uint4* f = reinterpret_cast<const uint4*>(static_cast<const float*>(base) + i);
    r[0] = f[0];
    if constexpr (V == 8) r[1] = f[1];
  }
}

// The V floats of load_raw's bits (exact, as load_elems converts them).
template <int V>
__device__ __forceinline__ void raw_to_float(int32_t t, const uint4 (&r)[2], float (&out)[V]) {
  const uint32_t u[8] = {r[0].x, r[0].y, r[0].z, r[0].w, r[1].x, r[1].y, r[1].z, r[1].w};
  if (t == kBF16) {
#pragma unroll
    for (int e = 0; e < V; ++e)
      out[e] = __uint_as_float(e % 2 == 0 ? u[e / 2] << 16 : u[e / 2] & 0xffff0000u);
  } else if (t == kF16) {
#pragma unroll
    for (int e = 0; e < V; ++e)
      out[e] =
          __half2float(__ushort_as_half(static_cast<unsigned short>(u[e / 2] >> (16 * (e % 2)))));
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = __uint_as_float(u[e]);
  }
}

}  // namespace attnrt::cuda
