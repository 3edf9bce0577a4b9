// Random benchmark data: element codes of a storage type drawn from a fixed table of N(0, 1)
// samples. Private to the bench runners.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <random>

#include "attnrt/core/dtype.h"
#include "attnrt/core/error.h"

namespace attnrt::bench {

// Random element codes drawn from a fixed table of N(0, 1) samples already rounded to the storage
// type: filling gigabytes of KV then costs a table lookup per element, and every value is a
// plausible activation (never zero, never NaN, fp8 within range).
class ValueTable {
 public:
  ValueTable(DType dtype, uint64_t seed) : dtype_(dtype) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (auto& code : codes_) {
      float x = 0;
      while (std::fabs(x) < 1e-3f) x = normal(rng);
      if (dtype == DType::bf16) {
        code = float_to_bf16(x);
      } else if (dtype == DType::e4m3) {
        code = float_to_e4m3(x);
      } else if (dtype == DType::e5m2) {
        code = float_to_e5m2(x);
      } else if (dtype == DType::f16) {
        code = float_to_fp16(x);
      } else {
        fail("bench workloads store bf16, fp16 or fp8 KV; got {}", dtype_name(dtype));
      }
    }
  }

  // Fills `count` elements at `dst` (laid out contiguously); the stream depends only on `seed`,
  // not on the thread count.
  void fill(void* dst, int64_t count, uint64_t seed) const {
    constexpr int64_t kChunk = int64_t{1} << 16;
    const int64_t chunks = (count + kChunk - 1) / kChunk;
    const size_t elem = dtype_size(dtype_);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      uint64_t x = (seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(c + 1)) | 1;
      const int64_t begin = c * kChunk, end = std::min(count, begin + kChunk);
      for (int64_t i = begin; i < end; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        uint16_t code = codes_[(x >> 20) & (kSize - 1)];
        if (elem == 2) {
          static_cast<uint16_t*>(dst)[i] = code;
        } else {
          static_cast<uint8_t*>(dst)[i] = static_cast<uint8_t>(code);
        }
      }
    }
  }

 private:
  static constexpr size_t kSize = 4096;
  DType dtype_;
  std::array<uint16_t, kSize> codes_{};
};

}  // namespace attnrt::bench
