// Small device helpers the tensor-core kernels are built from: async copies, ldmatrix, the m16n8k16
// tensor-core MMA, the shared-memory swizzle (conversions: common/convert.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attnrt::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; `valid == false` writes 16 zero bytes (masked tails must be finite:
// a zero probability times a garbage NaN would still poison the output).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_bytes));
}
// 32-bit shared-memory access by address, volatile: kept in order with the cp.async waits
// around them (which carry no memory clobber).
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t smem) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(smem));
  return v;
}
__device__ __forceinline__ void st_shared_u32(uint32_t smem, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(smem), "r"(v));
}
// 16-byte shared-memory access by address, volatile. Through a uint4 pointer nvcc may split a
// load whose words are used apart into four 32-bit loads (the e4m3 conversions of the MLA CTAs:
// four threads of a quarter warp on one bank).
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t smem) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem));
  return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t smem, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w));
}
// 4-byte global -> shared copy (through the L1: .cg takes 16 bytes only).
__device__ __forceinline__ void cp_async_4(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// cp.async.wait_group min(n, MAX) for a run-time n: until at most that many of this thread's
// groups are pending.
template <int MAX>
__device__ __forceinline__ void cp_async_wait_upto(int n) {
  if constexpr (MAX > 0) {
    if (n >= MAX) {
      cp_async_wait<MAX>();
      return;
    }
    cp_async_wait_upto<MAX - 1>(n);
  } else {
    cp_async_wait<0>();
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// D = A * B + D, A 16x16 (row), B 16x8 (col), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);
// The specialisation for T, whose PTX type name is TY.
#define ATTNRT_MMA_16816(T, TY)                                                                  \
  template <>                                                                                    \
  __device__ __forceinline__ void mma_16816<T>(float(&d)[4], const uint32_t(&a)[4], uint32_t b0, \
                                               uint32_t b1) {                                    \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY                              \
                 ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "                                     \
                 "{%8, %9}, {%0, %1, %2, %3};\n"                                                 \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                \
  }
ATTNRT_MMA_16816(__nv_bfloat16, "bf16")
ATTNRT_MMA_16816(__half, "f16")
#undef ATTNRT_MMA_16816

// Rows of `chunks` 16-byte chunks in shared memory; chunk c of row r lives at c ^ (r & 7), so the
// eight row addresses of one ldmatrix (same chunk, consecutive rows) hit eight different banks.
__device__ __forceinline__ int swz(int row, int chunk) { return chunk ^ (row & 7); }

}  // namespace attnrt::cuda
