// Device helpers shared by the linear-attention kernels: element loads and stores by dtype code,
// vector loads and stores of a few state elements, the activations of §8.8 / §8.9.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "backends/cuda/kernels/linear.h"

namespace attnrt::cuda::linear {

// attnrt::DType values (include/attnrt/core/dtype.h); the host glue checks that they agree.
constexpr DTypeCode kF32 = 0;
constexpr DTypeCode kF16 = 1;
constexpr DTypeCode kBF16 = 2;

// Element i of an activation tensor of dtype `t`.
__device__ __forceinline__ float load_elem(const void* base, DTypeCode t, int64_t i) {
  if (t == kF32) return static_cast<const float*>(base)[i];
  if (t == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  return __half2float(static_cast<const __half*>(base)[i]);
}

__device__ __forceinline__ void store_elem(void* base, DTypeCode t, int64_t i, float v) {
  if (t == kF32) {
    static_cast<float*>(base)[i] = v;
  } else if (t == kBF16) {
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<__half*>(base)[i] = __float2half_rn(v);
  }
}

// State elements: float or __nv_bfloat16 (and __half, for activations read as vectors).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename S>
__device__ __forceinline__ S from_float_as(float x);
template <>
__device__ __forceinline__ float from_float_as<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float_as<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// x rounded to the precision of S (what storing and reloading it gives).
template <typename S>
__device__ __forceinline__ float round_as(float x) {
  return to_float(from_float_as<S>(x));
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
  for (int e = 0; e < E; ++e) r.v[e] = from_float_as<S>(in[e]);
  *reinterpret_cast<Vec<S, E>*>(p) = r;
}

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

}  // namespace attnrt::cuda::linear
