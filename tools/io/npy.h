// NumPy .npy files (format 1.0 / 2.0 / 3.0 read, 1.0 or 2.0 written; little endian, C order).
// Element types: float32 '<f4', float16 '<f2', int32 '<i4', int64 '<i8', uint8 '|u1'. NumPy has no
// bfloat16 or fp8: attnrt writes bf16 as its raw bits '<u2' and fp8 as raw bytes '|u1', and reads
// '<u2' back as bf16; a reader that expects fp8 accepts '|u1' (the true dtype lives beside the
// file, e.g. in a case's case.json).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "attnrt/core/tensor.h"

namespace attnrt {

struct NpyArray {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // numel * dtype_size, C order
  std::string origin;          // file it came from ("" when built in memory), for messages

  int64_t numel() const;
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(bytes.data());
  }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(bytes.data());
  }
  // Contiguous view of the bytes (valid while this array lives and is not resized).
  TensorView view() const;
  // Throws attnrt::Error naming the origin when dtype or shape differ. An fp8 `dtype` accepts a
  // uint8 array (fp8 is stored as raw bytes) and relabels it. -1 in `shape` matches any extent.
  void expect(DType dtype, std::span<const int64_t> shape);
  void expect(DType dtype, std::initializer_list<int64_t> shape) {
    expect(dtype, std::span<const int64_t>(shape.begin(), shape.size()));
  }
};

// Builds an array from a contiguous host buffer (nullptr: zero-filled).
NpyArray make_npy(DType dtype, std::span<const int64_t> shape, const void* data);
// Copies any host tensor (strided or not) into a float32 array; the tensor's dtype must be a float
// type.
NpyArray npy_from_tensor_f32(const TensorView& t);

void write_npy(const std::string& path, const NpyArray& array);
void write_npy(const std::string& path, DType dtype, std::span<const int64_t> shape,
               const void* data);
// Throws attnrt::Error naming the file: bad magic, unsupported version or dtype, big-endian data,
// Fortran order, malformed header, truncated or oversized data.
NpyArray read_npy(const std::string& path);
// The same from the file's bytes in memory; `path` names it in messages.
NpyArray parse_npy(std::string_view file, const std::string& path);

}  // namespace attnrt
