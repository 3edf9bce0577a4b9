// Row scatter shared by the host KV pools: float conversion per (source, storage) dtype pair, the
// checks of a pool's shape and of a set_kv_buffer input.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include "attnrt/core/error.h"
#include "attnrt/core/tensor.h"

namespace attnrt::kv_scatter {

// Raw element type and float conversions of each float dtype, so the copy loops below are
// instantiated per (source, storage) pair instead of switching per element.
template <class Raw, float (*Load)(Raw), Raw (*Store)(float)>
struct CodecOf {
  using raw = Raw;
  static float load(raw x) { return Load(x); }
  static raw store(float x) { return Store(x); }
};
inline float identity(float x) { return x; }

template <DType T>
struct Codec;
template <>
struct Codec<DType::f32> : CodecOf<float, identity, identity> {};
template <>
struct Codec<DType::f16> : CodecOf<uint16_t, fp16_to_float, float_to_fp16> {};
template <>
struct Codec<DType::bf16> : CodecOf<uint16_t, bf16_to_float, float_to_bf16> {};
template <>
struct Codec<DType::e4m3> : CodecOf<uint8_t, e4m3_to_float, float_to_e4m3> {};
template <>
struct Codec<DType::e5m2> : CodecOf<uint8_t, e5m2_to_float, float_to_e5m2> {};

// Calls f(std::integral_constant<DType, t>{}) for the first of `Ts` that equals `t`; false when
// none does.
template <DType... Ts, class F>
bool dispatch_among(DType t, F&& f) {
  return ((t == Ts ? (f(std::integral_constant<DType, Ts>{}), true) : false) || ...);
}

// f(std::integral_constant<DType, t>{}) for a float dtype `t`; attnrt::Error for any other.
template <class F>
void dispatch_float(DType t, F&& f) {
  if (!dispatch_among<DType::f32, DType::f16, DType::bf16, DType::e4m3, DType::e5m2>(t, f)) {
    fail("KV pool: {} is not a float dtype", dtype_name(t));
  }
}

// dst rows [slot, heads, dim] contiguous; src element (t, h, d) at t*s0 + h*s1 + d*s2.
template <DType S, DType D>
void scatter_rows(const TensorView& src, std::span<const int64_t> loc, void* dst, float scale) {
  using SR = typename Codec<S>::raw;
  using DR = typename Codec<D>::raw;
  const int64_t heads = src.shape[1], dim = src.shape[2];
  const int64_t s0 = src.strides[0], s1 = src.strides[1], s2 = src.strides[2];
  const auto* in = static_cast<const SR*>(src.data);
  auto* out = static_cast<DR*>(dst);
  const bool copy = S == D && scale == 1.f && s2 == 1;
  for (size_t t = 0; t < loc.size(); ++t) {
    DR* row = out + loc[t] * heads * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const SR* x = in + static_cast<int64_t>(t) * s0 + h * s1;
      DR* y = row + h * dim;
      if (copy) {
        std::memcpy(y, x, static_cast<size_t>(dim) * sizeof(DR));
      } else {
        for (int64_t d = 0; d < dim; ++d) y[d] = Codec<D>::store(Codec<S>::load(x[d * s2]) / scale);
      }
    }
  }
}

// Writes rows `loc` of a pool stored as `dst_dtype` at `dst` from `src`: divided by `scale`, then
// cast.
inline void scatter(const TensorView& src, std::span<const int64_t> loc, DType dst_dtype, void* dst,
                    float scale) {
  dispatch_float(src.dtype, [&](auto s) {
    dispatch_float(dst_dtype, [&](auto d) {
      scatter_rows<decltype(s)::value, decltype(d)::value>(src, loc, dst, scale);
    });
  });
}

// The checks of a pool's constructor; `pool` starts every message ("MHATokenToKVPool").
inline void check_pool(const char* pool, int64_t rows, DType dtype) {
  ATTNRT_CHECK(rows >= 1, "{}: {} rows; a pool needs at least the reserved row", pool, rows);
  ATTNRT_CHECK(is_float(dtype),
               "{}: {} is not a KV storage dtype; use bf16, fp16, fp32, fp8_e4m3 or fp8_e5m2", pool,
               dtype_name(dtype));
}

// Every slot of `loc` lies in the pool's rows 0..rows-1. Slot 0 is the reserved dummy row: padded
// rows of a graph replay write there by design.
inline void check_slots(int layer_id, std::span<const int64_t> loc, int64_t rows) {
  for (size_t i = 0; i < loc.size(); ++i) {
    ATTNRT_CHECK(loc[i] >= 0 && loc[i] < rows,
                 "set_kv_buffer(layer {}): loc[{}] = {} is outside the pool's slots 0..{}",
                 layer_id, i, loc[i], rows - 1);
  }
}

inline void check_input(const char* name, const TensorView& x, int64_t tokens, int heads, int dim,
                 int layer_id) {
  const bool shape_ok =
      x.ndim == 3 && x.shape[0] == tokens && x.shape[1] == heads && x.shape[2] == dim;
  ATTNRT_CHECK(shape_ok,
               "set_kv_buffer(layer {}): {} is {}, expected [{}, {}, {}] (tokens, kv heads, head "
               "dim)",
               layer_id, name, x.describe(), tokens, heads, dim);
  ATTNRT_CHECK(x.device.kind == DeviceKind::cpu,
               "set_kv_buffer(layer {}): {} is {}; the host KV pool takes host tensors", layer_id,
               name, x.describe());
  ATTNRT_CHECK(is_float(x.dtype),
               "set_kv_buffer(layer {}): {} is {}; K/V must be fp32, fp16, bf16 or fp8", layer_id,
               name, x.describe());
  ATTNRT_CHECK(tokens == 0 || x.data != nullptr, "set_kv_buffer(layer {}): {} has no data ({})",
               layer_id, name, x.describe());
}

}  // namespace attnrt::kv_scatter
