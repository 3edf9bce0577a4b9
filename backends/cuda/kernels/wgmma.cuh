// Hopper warpgroup MMA (wgmma, sm_90a) helpers for the prefill kernels and the delta rule's state
// pass: shared-memory matrix descriptors for the 128-byte swizzled layout, fences, and m64nNk16
// MMAs with fp32 accumulators (A from shared memory or from registers, B from shared memory,
// K-major or MN-major).
//
// Shared-memory tiles use one layout for Q, K and V: a [rows][D] 16-bit tile is stored as D / 64
// column blocks of [rows][64] (128-byte rows), and inside each 1024-byte group of 8 rows the
// 16-byte chunk c of row r sits at c ^ (r & 7): the hardware's 128-byte swizzle. Q and K are read
// K-major (rows = M / N, contiguous head dim), V is read MN-major (B transposed: keys are the K
// dimension, head dim the N dimension), so all three are written by the same copy code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attnrt::cuda {

// Byte offset of 16-byte chunk `chunk` (head-dim elements 8 * chunk ..) of row `row` in a swizzled
// tile of `rows` rows.
__device__ __forceinline__ uint32_t swz128_offset(int rows, int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * rows * 128 + row * 128 +
                               (((chunk & 7) ^ (row & 7)) << 4));
}

// Descriptor of a swizzled operand starting at shared address `addr` (16-byte units in the low
// bits). `lbo`: bytes between 64-element column blocks (used by MN-major operands only);
// stride between 8-row groups is 1024 bytes. Layout type 1 = 128-byte swizzle.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t lbo) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>(1024 >> 4) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}

// Descriptor d moved `bytes` further into shared memory (a multiple of 16): the start-address
// field (bits 0-13, address / 16) grows by bytes / 16, the rest stays. Exact while the address
// stays below 256 KiB, as every shared-memory address does. One 32-bit add where encoding the
// moved address anew takes four dependent instructions (add, mask, shift, or) per MMA.
__device__ __forceinline__ uint64_t wgmma_desc_add(uint64_t d, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(d) + (bytes >> 4);
  return (d & 0xFFFFFFFF00000000ull) | lo;
}

// The same for a K-major operand in the 64-byte swizzled layout (rows of 64 bytes; inside each
// 512-byte group of 8 rows the 16-byte chunk c of row r sits at c ^ ((r >> 1) & 3)); stride
// between 8-row groups 512 bytes. Layout type 2 = 64-byte swizzle.
__device__ __forceinline__ uint64_t wgmma_desc_sw64(uint32_t addr) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>(1) << 16;
  d |= static_cast<uint64_t>(512 >> 4) << 32;
  d |= static_cast<uint64_t>(2) << 62;
  return d;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins each register of an accumulator array where it stands: the compiler may not move its reads
// or writes across this point, nor copy the array into other registers around an MMA in flight
// (which makes ptxas wait for every MMA before the copy).
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Orders this thread's generic-proxy shared-memory writes (cp.async, st.shared) before later
// async-proxy reads (wgmma operands).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// D[64 x N] (+)= A[64 x 16] * B[16 x N]: A and B K-major in shared memory (descriptors);
// `accumulate` = 0 overwrites D.
template <int N, typename T>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate);
// D[64 x N] (+)= A[64 x 16] * B[16 x N]: A K-major in shared memory, B MN-major in shared memory
// (as wgmma_rs's B: keys are the K dimension).
template <int N, typename T>
__device__ __forceinline__ void wgmma_ss_mn(float (&d)[N / 2], uint64_t a, uint64_t b,
                                            int accumulate);
// D[64 x N] (+)= A[64 x 16] * B[16 x N]: A MN-major in shared memory (M contiguous, as a V tile
// read with the head dim as M), B K-major in shared memory.
template <int N, typename T>
__device__ __forceinline__ void wgmma_ss_tn(float (&d)[N / 2], uint64_t a, uint64_t b,
                                            int accumulate);
// D[64 x N] += A[64 x 16] * B[16 x N]: A in registers (the m16n8k16 A fragment of each warp's 16
// rows), B MN-major in shared memory.
template <int N, typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b);
// D[64 x N] (+)= A[64 x 16] * B[16 x N]: A in registers (as wgmma_rs), B K-major in shared memory
// (rows = N, the reduction index contiguous, as wgmma_ss's B); `accumulate` = 0 overwrites D.
template <int N, typename T>
__device__ __forceinline__ void wgmma_rs_k(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,
                                           int accumulate);

// D[64 x N] (+)= A[64 x 32] * B[32 x N] in fp8 e4m3 (k32: 32 bytes of a row, as a 16-bit k16
// step): A and B K-major in shared memory. fp8 MMAs read both operands K-major only.
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[N / 2], uint64_t a, uint64_t b,
                                              int accumulate);
// D[64 x N] += A[64 x 32] * B[32 x N] in fp8 e4m3: A in registers (four 32-bit registers of four
// e4m3 bytes, fp8_pv_layout.h), B K-major in shared memory.
template <int N>
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t b);

// The m64nNk16 MMAs with fp32 accumulators, written once per N and instantiated for bf16 and f16
// below: ATTNRT_WGMMA_ACC<n> lists the n accumulator operands (%0 .. %n-1), ATTNRT_WGMMA_REGS<n>
// their names in the instruction; the operands after them are numbered from n.
// clang-format off
#define ATTNRT_WGMMA_ACC8(d)                                                                       \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])

#define ATTNRT_WGMMA_ACC16(d)                                                                      \
  ATTNRT_WGMMA_ACC8(d), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),         \
  "+f"(d[15])

#define ATTNRT_WGMMA_ACC32(d)                                                                      \
  ATTNRT_WGMMA_ACC16(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),       \
  "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),       \
  "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

#define ATTNRT_WGMMA_ACC64(d)                                                                      \
  ATTNRT_WGMMA_ACC32(d),                                                                           \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),       \
  "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]),       \
  "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]),       \
  "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),       \
  "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define ATTNRT_WGMMA_REGS8 "%0, %1, %2, %3, %4, %5, %6, %7"

#define ATTNRT_WGMMA_REGS16                                                                        \
  ATTNRT_WGMMA_REGS8 ", %8, %9, %10, %11, %12, %13, %14, %15"

#define ATTNRT_WGMMA_REGS32                                                                        \
  ATTNRT_WGMMA_REGS16 ", "                                                                         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"

#define ATTNRT_WGMMA_REGS64                                                                        \
  ATTNRT_WGMMA_REGS32                                                                              \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// N columns, ACC = N / 2 accumulators, T and its PTX type name TY; the operand numbers after the
// accumulators: ss: a, b, accumulate; rs: a[0..3], b, the scale-d flag (1 for wgmma_rs,
// `accumulate` for wgmma_rs_k).
#define ATTNRT_WGMMA_PAIR(N, ACC, T, TY, SS_A, SS_B, SS_P, RS_A0, RS_A1, RS_A2, RS_A3, RS_B, RS_P) \
  template <>                                                                                      \
  __device__ __forceinline__ void wgmma_ss<N, T>(float(&d)[ACC], uint64_t a, uint64_t b,           \
                                                 int accumulate) {                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SS_P ", 0;\n"                               \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {"                  \
                 ATTNRT_WGMMA_REGS##ACC "}, %" #SS_A ", %" #SS_B ", p, 1, 1, 0, 0;\n}\n"           \
                 : ATTNRT_WGMMA_ACC##ACC(d)                                                        \
                 : "l"(a), "l"(b), "r"(accumulate));                                               \
  }                                                                                                \
  template <>                                                                                      \
  __device__ __forceinline__ void wgmma_ss_mn<N, T>(float(&d)[ACC], uint64_t a, uint64_t b,        \
                                                    int accumulate) {                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SS_P ", 0;\n"                               \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {"                  \
                 ATTNRT_WGMMA_REGS##ACC "}, %" #SS_A ", %" #SS_B ", p, 1, 1, 0, 1;\n}\n"           \
                 : ATTNRT_WGMMA_ACC##ACC(d)                                                        \
                 : "l"(a), "l"(b), "r"(accumulate));                                               \
  }                                                                                                \
  template <>                                                                                      \
  __device__ __forceinline__ void wgmma_ss_tn<N, T>(float(&d)[ACC], uint64_t a, uint64_t b,        \
                                                    int accumulate) {                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SS_P ", 0;\n"                               \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {"                  \
                 ATTNRT_WGMMA_REGS##ACC "}, %" #SS_A ", %" #SS_B ", p, 1, 1, 1, 0;\n}\n"           \
                 : ATTNRT_WGMMA_ACC##ACC(d)                                                        \
                 : "l"(a), "l"(b), "r"(accumulate));                                               \
  }                                                                                                \
  template <>                                                                                      \
  __device__ __forceinline__ void wgmma_rs<N, T>(float(&d)[ACC], const uint32_t(&a)[4],            \
                                                 uint64_t b) {                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #RS_P ", 0;\n"                               \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {"                  \
                 ATTNRT_WGMMA_REGS##ACC "}, {%" #RS_A0 ", %" #RS_A1 ", %" #RS_A2 ", %" #RS_A3      \
                 "}, %" #RS_B ", p, 1, 1, 1;\n}\n"                                                 \
                 : ATTNRT_WGMMA_ACC##ACC(d)                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                    \
  }                                                                                                \
  template <>                                                                                      \
  __device__ __forceinline__ void wgmma_rs_k<N, T>(float(&d)[ACC], const uint32_t(&a)[4],          \
                                                   uint64_t b, int accumulate) {                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #RS_P ", 0;\n"                               \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {"                  \
                 ATTNRT_WGMMA_REGS##ACC "}, {%" #RS_A0 ", %" #RS_A1 ", %" #RS_A2 ", %" #RS_A3      \
                 "}, %" #RS_B ", p, 1, 1, 0;\n}\n"                                                 \
                 : ATTNRT_WGMMA_ACC##ACC(d)                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));           \
  }

// clang-format on

ATTNRT_WGMMA_PAIR(16, 8, __nv_bfloat16, "bf16", 8, 9, 10, 8, 9, 10, 11, 12, 13)
ATTNRT_WGMMA_PAIR(16, 8, __half, "f16", 8, 9, 10, 8, 9, 10, 11, 12, 13)
ATTNRT_WGMMA_PAIR(32, 16, __nv_bfloat16, "bf16", 16, 17, 18, 16, 17, 18, 19, 20, 21)
ATTNRT_WGMMA_PAIR(32, 16, __half, "f16", 16, 17, 18, 16, 17, 18, 19, 20, 21)
ATTNRT_WGMMA_PAIR(64, 32, __nv_bfloat16, "bf16", 32, 33, 34, 32, 33, 34, 35, 36, 37)
ATTNRT_WGMMA_PAIR(64, 32, __half, "f16", 32, 33, 34, 32, 33, 34, 35, 36, 37)
ATTNRT_WGMMA_PAIR(128, 64, __nv_bfloat16, "bf16", 64, 65, 66, 64, 65, 66, 67, 68, 69)
ATTNRT_WGMMA_PAIR(128, 64, __half, "f16", 64, 65, 66, 64, 65, 66, 67, 68, 69)

// clang-format off
// The fp8 MMAs (no transpose operands: both K-major), N columns, ACC = N / 2 accumulators.
#define ATTNRT_WGMMA_E4M3(N, ACC, SS_A, SS_B, SS_P, RS_A0, RS_A1, RS_A2, RS_A3, RS_B, RS_P)       \
  template <>                                                                                      \
  __device__ __forceinline__ void wgmma_ss_e4m3<N>(float(&d)[ACC], uint64_t a, uint64_t b,         \
                                                   int accumulate) {                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SS_P ", 0;\n"                               \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {"                      \
                 ATTNRT_WGMMA_REGS##ACC "}, %" #SS_A ", %" #SS_B ", p, 1, 1;\n}\n"                 \
                 : ATTNRT_WGMMA_ACC##ACC(d)                                                        \
                 : "l"(a), "l"(b), "r"(accumulate));                                               \
  }                                                                                                \
  template <>                                                                                      \
  __device__ __forceinline__ void wgmma_rs_e4m3<N>(float(&d)[ACC], const uint32_t(&a)[4],          \
                                                   uint64_t b) {                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #RS_P ", 0;\n"                               \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {"                      \
                 ATTNRT_WGMMA_REGS##ACC "}, {%" #RS_A0 ", %" #RS_A1 ", %" #RS_A2 ", %" #RS_A3      \
                 "}, %" #RS_B ", p, 1, 1;\n}\n"                                                    \
                 : ATTNRT_WGMMA_ACC##ACC(d)                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                    \
  }

ATTNRT_WGMMA_E4M3(64, 32, 32, 33, 34, 32, 33, 34, 35, 36, 37)
ATTNRT_WGMMA_E4M3(128, 64, 64, 65, 66, 64, 65, 66, 67, 68, 69)
// clang-format on

#undef ATTNRT_WGMMA_E4M3
#undef ATTNRT_WGMMA_PAIR
#undef ATTNRT_WGMMA_REGS64
#undef ATTNRT_WGMMA_REGS32
#undef ATTNRT_WGMMA_REGS16
#undef ATTNRT_WGMMA_REGS8
#undef ATTNRT_WGMMA_ACC64
#undef ATTNRT_WGMMA_ACC32
#undef ATTNRT_WGMMA_ACC16
#undef ATTNRT_WGMMA_ACC8

}  // namespace attnrt::cuda
