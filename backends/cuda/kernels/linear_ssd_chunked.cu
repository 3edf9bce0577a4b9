// Mamba2 SSD extend (reference-semantics §8.9.3) in the chunked form, on m16n8k16 bf16 tensor-core
// MMAs with fp32 accumulation: launch_ssd_chunked of linear.h.
//
// One CTA per (request, head) walks the request's chunks in order and carries the head's state h
// (P x N, fp32) in the MMA accumulators of its warps from chunk to chunk, so the inter-chunk pass
// costs nothing but the state update itself: no chunk states go through global memory. Per chunk
// of Q tokens, with L_t the cumulative dt * A from the chunk start:
//   Y_off  = exp(L_t) * C_t h^T                      (h: the state at the chunk start, bf16 copy)
//   Y_diag = ((C B^T) (.) exp(L_t - L_s) dt_s, s <= t) X
//   y      = Y_off + Y_diag + D x
//   h      = exp(L_end) h + X^T diag(exp(L_end - L_s) dt_s) B
// Only differences of cumulative sums are exponentiated, every one <= 0.
//
// Warps: P / 16 = 4. Warp w owns state rows 16w .. 16w + 15 (all N columns) and, for the outputs,
// the 16-token row blocks w and Q/16 - 1 - w (one short and one long stretch of the causal
// triangle, so the four warps do the same number of MMAs). x, B and C of the chunk live as bf16 in
// shared memory (rows of 16-byte chunks, swizzled for conflict-free ldmatrix); C B^T is computed
// 16 x 16 tile at a time and goes from the accumulators straight into the A operand of the
// (masked scores) x X MMA, as attention kernels do with probabilities.
//
// fp32 y: B and C are shared by the heads of a group, so a first kernel converts them to bf16 once
// per token (the workspace: [T, 2, groups, N]); the heads' CTAs then fetch them with cp.async, all
// of a chunk in flight at once, while their own x rows come through registers (converted on the
// way). Loading fp32 B and C through registers as well, eight 16-byte loads per thread at a time,
// took 1.43 / 6.13 ms at 1 / 8 x 8192 tokens (Nemotron-H shape, H200) against 1.05 / 4.67 ms then.
// bf16 y (16-bit activations, linear.h): x, B and C are already the MMA operands, so the CTAs
// fetch all three with cp.async straight from y's rows; no conversion kernel, no workspace. The
// element type of y is the kernel's template parameter Y.
//
// What bounds it (Nsight Compute at 1 x 8192): one CTA of four warps per SM (two fit, by registers
// and shared memory), 5.8 cycles between a warp's instructions, 38% of the stalls on global loads
// (x rows, dt, x again for D x); SM throughput 17%. Latency, not MMA or bandwidth: more warps per
// SM (two heads of a group per CTA sharing C B^T, or P split across CTAs) and loading the next
// chunk during this one are the next steps.
//
// Parallelism is requests x heads (1024 CTAs at 8 requests x 128 heads, 128 at one request);
// neighbouring CTAs are heads of one group and read the same B and C rows, which L2 serves.
// Instantiated for P = 64, N in {64, 128}, Q in {64, 128}.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/linear.h"
#include "backends/cuda/kernels/primitives.cuh"

namespace attnrt::cuda::linear {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kHeadDim = 64;  // P
constexpr int kWarps = kHeadDim / 16;
constexpr int kThreads = kWarps * 32;

template <int Q, int N>
struct SsdSmem {
  static constexpr int kX = 0;                      // bf16 [Q][P]
  static constexpr int kB = kX + Q * kHeadDim * 2;  // bf16 [Q][N]
  static constexpr int kC = kB + Q * N * 2;         // bf16 [Q][N]
  static constexpr int kH = kC + Q * N * 2;         // bf16 [P][N], the state at chunk start
  static constexpr int kL = kH + kHeadDim * N * 2;  // f32 [Q] cumulative dt*A, log2 units
  static constexpr int kDt = kL + Q * 4;            // f32 [Q] dt
  static constexpr int kBytes = kDt + Q * 4;
};

// Element (row, col) of a bf16 tile with COLS columns: 16-byte chunks swizzled by the row.
template <int COLS>
__device__ __forceinline__ int sidx(int row, int col) {
  return row * COLS + (swz(row, col >> 3) << 3) + (col & 7);
}

// Multiplies the two bf16 values of `v` by (lo, hi) in fp32.
__device__ __forceinline__ uint32_t scale2(uint32_t v, float lo, float hi) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  return pack2<bf16>(f.x * lo, f.y * hi);
}

// Rows [0, valid) of a [rows, COLS] fp32 block of y (rows `stride` floats apart) into a bf16 tile;
// rows [valid, ROWS) become zeros. All of a thread's 16-byte loads (at most 16: 64 registers, next
// to the 64 of the state accumulators) are issued before the first conversion.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile(bf16* dst, const float* __restrict__ src, int64_t stride,
                                          int valid) {
  constexpr int kVecs = ROWS * COLS / 4, kPerThread = kVecs / kThreads;
  constexpr int kBatch = kPerThread < 16 ? kPerThread : 16;
  static_assert(kVecs % kThreads == 0 && kPerThread % kBatch == 0);
#pragma unroll 1
  for (int b0 = 0; b0 < kPerThread; b0 += kBatch) {
    float4 v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = (b0 + k) * kThreads + static_cast<int>(threadIdx.x);
      const int row = i / (COLS / 4), col = (i % (COLS / 4)) * 4;
      v[k] = row < valid ? __ldg(reinterpret_cast<const float4*>(src + row * stride + col))
                         : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = (b0 + k) * kThreads + static_cast<int>(threadIdx.x);
      const int row = i / (COLS / 4), col = (i % (COLS / 4)) * 4;
      uint2 w;
      w.x = pack2<bf16>(v[k].x, v[k].y);
      w.y = pack2<bf16>(v[k].z, v[k].w);
      *reinterpret_cast<uint2*>(dst + sidx<COLS>(row, col)) = w;
    }
  }
}

// Rows [0, valid) of a [rows, COLS] bf16 block (rows `stride` elements apart) into a swizzled tile
// with cp.async; rows [valid, ROWS) are zero-filled.
template <int ROWS, int COLS>
__device__ __forceinline__ void copy_tile_async(bf16* dst, const bf16* __restrict__ src,
                                                int64_t stride, int valid) {
  constexpr int kChunks = ROWS * COLS / 8;
  static_assert(kChunks % kThreads == 0);
#pragma unroll
  for (int k = 0; k < kChunks / kThreads; ++k) {
    const int i = k * kThreads + static_cast<int>(threadIdx.x);
    const int row = i / (COLS / 8), col = (i % (COLS / 8)) * 8;
    const bool ok = row < valid;
    cp_async_16(dst + sidx<COLS>(row, col), ok ? src + row * stride + col : src, ok);
  }
}

// bf16 y: rows [0, valid) of a [rows, COLS] block of y (rows `stride` elements apart) into a
// swizzled tile with cp.async, rows [valid, ROWS) zero-filled; copy_tile_async's layout, but each
// thread keeps one shared and one global address and steps both (a step of the CTA covers
// kThreads * 8 elements, kThreads * 8 / COLS whole rows, so the thread's swizzle does not change).
// Per-copy addresses held across the chunk loop cost the kernel its last free registers.
template <int ROWS, int COLS>
__device__ __forceinline__ void copy_rows_async(bf16* dst, const bf16* __restrict__ src,
                                                int64_t stride, int valid) {
  constexpr int kRowsPerStep = kThreads * 8 / COLS;
  static_assert(ROWS % kRowsPerStep == 0);
  const int r0 = static_cast<int>(threadIdx.x) / (COLS / 8);
  const int col = (static_cast<int>(threadIdx.x) % (COLS / 8)) * 8;
  bf16* d = dst + sidx<COLS>(r0, col);
  const bf16* g = src + r0 * stride + col;
  const int64_t step = kRowsPerStep * stride;
#pragma unroll
  for (int k = 0; k < ROWS / kRowsPerStep; ++k) {
    const bool ok = r0 + k * kRowsPerStep < valid;
    cp_async_16(d + k * kRowsPerStep * COLS, ok ? g : src, ok);
    g += step;
  }
}

// y's B | C columns of every token as bf16: bc[t, 0, g, :] = B, bc[t, 1, g, :] = C.
__global__ void __launch_bounds__(256)
    ssd_convert_bc_kernel(const float* __restrict__ y, int64_t ystride, int64_t offset, int width,
                          int64_t tokens, bf16* bc) {
  const int per_row = width / 8;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * per_row) return;
  const int64_t t = i / per_row;
  const int col = static_cast<int>(i % per_row) * 8;
  const float4* src = reinterpret_cast<const float4*>(y + t * ystride + offset + col);
  const float4 a = __ldg(src), b = __ldg(src + 1);
  uint4 w;
  w.x = pack2<bf16>(a.x, a.y);
  w.y = pack2<bf16>(a.z, a.w);
  w.z = pack2<bf16>(b.x, b.y);
  w.w = pack2<bf16>(b.z, b.w);
  *reinterpret_cast<uint4*>(bc + t * width + col) = w;
}

// bc: fp32 y's B | C in bf16 (ssd_convert_bc_kernel); unused with bf16 y (Y = bf16).
template <int Q, int N, typename Y>
__global__ void __launch_bounds__(kThreads, 2)
    ssd_chunked_kernel(const SsdParams p, const bf16* __restrict__ bc) {
  constexpr bool kBf16Y = sizeof(Y) == 2;
  constexpr int P = kHeadDim, NT = N / 8, PT = P / 8, RB = Q / 16;
  using Smem = SsdSmem<Q, N>;
  const LinReq req = p.step.reqs[blockIdx.y];
  if (req.tokens <= 0) return;
  const int h = blockIdx.x;
  const int heads = p.state.heads, groups = p.groups;
  const int grp = h / (heads / groups);
  const int64_t ystride = p.state.conv_dim;

  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Xs = reinterpret_cast<bf16*>(smem + Smem::kX);
  bf16* Bs = reinterpret_cast<bf16*>(smem + Smem::kB);
  bf16* Cs = reinterpret_cast<bf16*>(smem + Smem::kC);
  bf16* Hs = reinterpret_cast<bf16*>(smem + Smem::kH);
  float* Ls = reinterpret_cast<float*>(smem + Smem::kL);
  float* dts = reinterpret_cast<float*>(smem + Smem::kDt);

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const int p0 = warp * 16;  // this warp's state rows
  const float A2 = -expf(p.A_log[h]) * kLog2e;
  const float dt_bias = p.dt_bias[h], Dh = p.D[h];
  // Output element pairs (8j + 2c, +1) are aligned for one store when rows start at even indices.
  const bool out_pairs = p.out_stride % 2 == 0 && reinterpret_cast<uintptr_t>(p.out) % 8 == 0;

  // The state: hacc[j] holds h[p0 + g][8j + 2c, +1] (regs 0, 1) and h[p0 + g + 8][...] (2, 3).
  float hacc[NT][4];
  const int64_t state_off = (req.slot * heads + h) * static_cast<int64_t>(P) * N;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    float2 lo = make_float2(0.f, 0.f), hi = lo;
    if (req.has_initial_state) {
      lo = load_elem2<Dtypes::f32_or_bf16>(p.state.ssm, p.state.ssm_dtype,
                                           state_off + (p0 + g) * N + 8 * j + 2 * c);
      hi = load_elem2<Dtypes::f32_or_bf16>(p.state.ssm, p.state.ssm_dtype,
                                           state_off + (p0 + g + 8) * N + 8 * j + 2 * c);
    }
    hacc[j][0] = lo.x;
    hacc[j][1] = lo.y;
    hacc[j][2] = hi.x;
    hacc[j][3] = hi.y;
  }

  for (int c0 = 0; c0 < req.tokens; c0 += Q) {
    const int valid = min(Q, req.tokens - c0);
    const int64_t t_first = req.token_start + static_cast<int64_t>(c0);
    const Y* yrow = static_cast<const Y*>(p.y) + t_first * ystride;
    // Every warp is done with the previous chunk's tiles and state copy.
    __syncthreads();
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      *reinterpret_cast<uint32_t*>(Hs + sidx<N>(p0 + g, 8 * j + 2 * c)) =
          pack2<bf16>(hacc[j][0], hacc[j][1]);
      *reinterpret_cast<uint32_t*>(Hs + sidx<N>(p0 + g + 8, 8 * j + 2 * c)) =
          pack2<bf16>(hacc[j][2], hacc[j][3]);
    }
    if constexpr (kBf16Y) {  // x, B and C from y's rows
      const bf16* bcrow = yrow + static_cast<int64_t>(heads) * P;
      copy_rows_async<Q, N>(Bs, bcrow + grp * N, ystride, valid);
      copy_rows_async<Q, N>(Cs, bcrow + (groups + grp) * N, ystride, valid);
      copy_rows_async<Q, P>(Xs, yrow + static_cast<int64_t>(h) * P, ystride, valid);
    } else {
      const bf16* bcrow = bc + t_first * (2 * groups * N);
      copy_tile_async<Q, N>(Bs, bcrow + grp * N, 2 * groups * N, valid);
      copy_tile_async<Q, N>(Cs, bcrow + (groups + grp) * N, 2 * groups * N, valid);
    }
    cp_async_commit();
    if (warp == 0) {
      // dt and the inclusive cumulative dt * A (log2 units); padded tokens get dt = 0.
      constexpr int kPer = Q / 32;
      float part[kPer];
      float run = 0.f;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int s = lane * kPer + k;
        float d = 0.f;
        if (s < valid)
          d = softplus(load_elem(p.a, p.a_dtype, (t_first + s) * p.a_stride + h) + dt_bias);
        dts[s] = d;
        run += d * A2;
        part[k] = run;
      }
      float incl = run;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
      }
      const float base = incl - run;
#pragma unroll
      for (int k = 0; k < kPer; ++k) Ls[lane * kPer + k] = base + part[k];
    }
    if constexpr (!kBf16Y) load_tile<Q, P>(Xs, yrow + static_cast<int64_t>(h) * P, ystride, valid);
    cp_async_wait<0>();
    __syncthreads();

    // Outputs of this warp's row blocks.
#pragma unroll 1
    for (int half = 0; half < (RB > kWarps ? 2 : 1); ++half) {
      const int rb = half == 0 ? warp : RB - 1 - warp;
      const int t0 = rb * 16;
      if (t0 >= valid) continue;
      // C rows t0 .. t0 + 15 as A fragments (k = state dim).
      uint32_t ca[N / 16][4];
#pragma unroll
      for (int ks = 0; ks < N / 16; ++ks) {
        ldmatrix_x4(ca[ks], Cs + sidx<N>(t0 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                         ks * 16 + (lane >> 4) * 8));
      }
      // Y_off = C h^T, then scaled per row by exp(L_t).
      float yacc[PT][4];
#pragma unroll
      for (int j = 0; j < PT; ++j) yacc[j][0] = yacc[j][1] = yacc[j][2] = yacc[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < N / 16; ++ks) {
#pragma unroll
        for (int np = 0; np < P / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, Hs + sidx<N>(np * 16 + (lane & 7) + (lane >> 4) * 8,
                                      ks * 16 + ((lane >> 3) & 1) * 8));
          mma_16816<bf16>(yacc[2 * np], ca[ks], b[0], b[1]);
          mma_16816<bf16>(yacc[2 * np + 1], ca[ks], b[2], b[3]);
        }
      }
      const float Lt0 = Ls[t0 + g], Lt1 = Ls[t0 + g + 8];
      {
        const float e0 = fast_exp2(Lt0), e1 = fast_exp2(Lt1);
#pragma unroll
        for (int j = 0; j < PT; ++j) {
          yacc[j][0] *= e0;
          yacc[j][1] *= e0;
          yacc[j][2] *= e1;
          yacc[j][3] *= e1;
        }
      }
      // Y_diag over the key blocks s0 <= t0.
#pragma unroll 1
      for (int kb = 0; kb <= rb; ++kb) {
        const int s0 = kb * 16;
        // Two accumulator sets (even / odd k steps) halve the dependent MMA chain.
        float sacc[2][4] = {}, sodd[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < N / 16; ++ks) {
          uint32_t b[4];
          ldmatrix_x4(
              b, Bs + sidx<N>(s0 + (lane & 7) + (lane >> 4) * 8, ks * 16 + ((lane >> 3) & 1) * 8));
          float(&acc)[2][4] = ks % 2 == 0 ? sacc : sodd;
          mma_16816<bf16>(acc[0], ca[ks], b[0], b[1]);
          mma_16816<bf16>(acc[1], ca[ks], b[2], b[3]);
        }
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
          for (int e = 0; e < 4; ++e) sacc[jj][e] += sodd[jj][e];
        }
        // Weights w[t][s] = (C_t . B_s) exp(L_t - L_s) dt_s for s <= t, else 0.
        uint32_t pa[4];
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int s = s0 + jj * 8 + 2 * c;
          const float2 Lsv = *reinterpret_cast<const float2*>(Ls + s);
          const float2 dtv = *reinterpret_cast<const float2*>(dts + s);
          const int t_lo = t0 + g, t_hi = t0 + g + 8;
          const float w00 = s <= t_lo ? sacc[jj][0] * fast_exp2(Lt0 - Lsv.x) * dtv.x : 0.f;
          const float w01 = s + 1 <= t_lo ? sacc[jj][1] * fast_exp2(Lt0 - Lsv.y) * dtv.y : 0.f;
          const float w10 = s <= t_hi ? sacc[jj][2] * fast_exp2(Lt1 - Lsv.x) * dtv.x : 0.f;
          const float w11 = s + 1 <= t_hi ? sacc[jj][3] * fast_exp2(Lt1 - Lsv.y) * dtv.y : 0.f;
          pa[2 * jj] = pack2<bf16>(w00, w01);
          pa[2 * jj + 1] = pack2<bf16>(w10, w11);
        }
#pragma unroll
        for (int np = 0; np < P / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(
              b, Xs + sidx<P>(s0 + (lane & 7) + ((lane >> 3) & 1) * 8, np * 16 + (lane >> 4) * 8));
          mma_16816<bf16>(yacc[2 * np], pa, b[0], b[1]);
          mma_16816<bf16>(yacc[2 * np + 1], pa, b[2], b[3]);
        }
      }
      // y = Y_off + Y_diag + D x (x in fp32 from y; bf16 y: from the x tile, the same values),
      // rows below `valid` only.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int t = t0 + g + 8 * r;
        if (t >= valid) continue;
        const int64_t orow = (t_first + t) * p.out_stride + static_cast<int64_t>(h) * P;
#pragma unroll
        for (int j = 0; j < PT; ++j) {
          const int col = 8 * j + 2 * c;
          float2 xv;
          if constexpr (kBf16Y) {
            xv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(Xs + sidx<P>(t, col)));
          } else {
            const float* xrow = yrow + t * ystride + static_cast<int64_t>(h) * P;
            xv = __ldg(reinterpret_cast<const float2*>(xrow + col));
          }
          const float o0 = yacc[j][2 * r] + Dh * xv.x, o1 = yacc[j][2 * r + 1] + Dh * xv.y;
          if (out_pairs) {
            store_elem2(p.out, p.out_dtype, orow + col, o0, o1);
          } else {
            store_elem(p.out, p.out_dtype, orow + col, o0);
            store_elem(p.out, p.out_dtype, orow + col + 1, o1);
          }
        }
      }
    }

    // h = exp(L_end) h + sum_s (x_s exp(L_end - L_s) dt_s) B_s^T: rows p0 .. p0 + 15 of this warp.
    const float Lend = Ls[Q - 1];
    {
      const float e = fast_exp2(Lend);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        hacc[j][0] *= e;
        hacc[j][1] *= e;
        hacc[j][2] *= e;
        hacc[j][3] *= e;
      }
    }
#pragma unroll 1
    for (int ks = 0; ks < RB; ++ks) {
      const int s0 = ks * 16;
      if (s0 >= valid) break;
      // A = X^T (m = state row p, k = token s) through the transposing ldmatrix of X [s][p].
      uint32_t xa[4];
      ldmatrix_x4_trans(
          xa, Xs + sidx<P>(s0 + (lane & 7) + (lane >> 4) * 8, p0 + ((lane >> 3) & 1) * 8));
      const float2 Llo = *reinterpret_cast<const float2*>(Ls + s0 + 2 * c);
      const float2 Lhi = *reinterpret_cast<const float2*>(Ls + s0 + 8 + 2 * c);
      const float2 dlo = *reinterpret_cast<const float2*>(dts + s0 + 2 * c);
      const float2 dhi = *reinterpret_cast<const float2*>(dts + s0 + 8 + 2 * c);
      const float wl0 = fast_exp2(Lend - Llo.x) * dlo.x, wl1 = fast_exp2(Lend - Llo.y) * dlo.y;
      const float wh0 = fast_exp2(Lend - Lhi.x) * dhi.x, wh1 = fast_exp2(Lend - Lhi.y) * dhi.y;
      xa[0] = scale2(xa[0], wl0, wl1);
      xa[1] = scale2(xa[1], wl0, wl1);
      xa[2] = scale2(xa[2], wh0, wh1);
      xa[3] = scale2(xa[3], wh0, wh1);
#pragma unroll
      for (int np = 0; np < N / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(
            b, Bs + sidx<N>(s0 + (lane & 7) + ((lane >> 3) & 1) * 8, np * 16 + (lane >> 4) * 8));
        mma_16816<bf16>(hacc[2 * np], xa, b[0], b[1]);
        mma_16816<bf16>(hacc[2 * np + 1], xa, b[2], b[3]);
      }
    }
  }

#pragma unroll
  for (int j = 0; j < NT; ++j) {
    store_elem2<Dtypes::f32_or_bf16>(p.state.ssm, p.state.ssm_dtype,
                                     state_off + (p0 + g) * N + 8 * j + 2 * c, hacc[j][0],
                                     hacc[j][1]);
    store_elem2<Dtypes::f32_or_bf16>(p.state.ssm, p.state.ssm_dtype,
                                     state_off + (p0 + g + 8) * N + 8 * j + 2 * c, hacc[j][2],
                                     hacc[j][3]);
  }
}

template <int Q, int N, typename Y>
cudaError_t launch(const SsdParams& p, int64_t num_tokens, bf16* bc, cudaStream_t stream) {
  constexpr int kBytes = SsdSmem<Q, N>::kBytes;
  const cudaError_t e = cudaFuncSetAttribute(ssd_chunked_kernel<Q, N, Y>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (e != cudaSuccess) return e;
  if constexpr (sizeof(Y) == 4) {
    const int width = 2 * p.groups * N;
    const int64_t items = num_tokens * (width / 8);
    ssd_convert_bc_kernel<<<static_cast<unsigned>((items + 255) / 256), 256, 0, stream>>>(
        static_cast<const float*>(p.y), p.state.conv_dim, int64_t{p.state.heads} * p.state.rows,
        width, num_tokens, bc);
  }
  const dim3 grid(static_cast<unsigned>(p.state.heads), static_cast<unsigned>(p.step.num_reqs));
  ssd_chunked_kernel<Q, N, Y><<<grid, kThreads, kBytes, stream>>>(p, bc);
  return cudaGetLastError();
}

bool is_act_dtype(DTypeCode t) { return t == kF32 || t == kBF16 || t == kF16; }

}  // namespace

// fp32 y: B | C of every token of the step in bf16; bf16 y: none (the kernel reads y).
size_t ssd_chunked_workspace(const SsdParams& p, int64_t num_tokens, int) {
  if (p.y_dtype == kBF16) return 0;
  return static_cast<size_t>(num_tokens) * 2 * p.groups * p.state.cols * sizeof(bf16);
}

cudaError_t launch_ssd_chunked(const SsdParams& p, int64_t num_tokens, int chunk, void* workspace,
                               cudaStream_t stream) {
  if (p.step.num_reqs <= 0 || num_tokens <= 0) return cudaSuccess;
  const LinState& s = p.state;
  // Non-verify steps, head_dim 64, d_state 64 or 128, chunk 64 or 128, x | B | C rows of y.
  const bool shape_ok = p.step.verify == 0 && s.rows == kHeadDim &&
                        (s.cols == 64 || s.cols == 128) && (chunk == 64 || chunk == 128) &&
                        p.groups > 0 && s.heads > 0 && s.heads % p.groups == 0 &&
                        s.conv_dim == s.heads * s.rows + 2 * p.groups * s.cols;
  const bool types_ok = is_act_dtype(p.a_dtype) && is_act_dtype(p.out_dtype) &&
                        (s.ssm_dtype == kF32 || s.ssm_dtype == kBF16) &&
                        (p.y_dtype == kF32 || p.y_dtype == kBF16);
  // 16-byte loads of y rows (bf16 y: conv_dim, heads * P and N are multiples of 8 elements) and
  // of the workspace (fp32 y only).
  const bool aligned = reinterpret_cast<uintptr_t>(p.y) % 16 == 0 &&
                       (p.y_dtype == kBF16 ||
                        (reinterpret_cast<uintptr_t>(workspace) % 16 == 0 && workspace != nullptr));
  if (!shape_ok || !types_ok || !aligned || p.step.num_reqs > 65535) return cudaErrorInvalidValue;
  bf16* bc = static_cast<bf16*>(workspace);
  return with_f32_or_bf16(p.y_dtype, cudaErrorInvalidValue, [&](auto y) {
    using Y = typename decltype(y)::type;
    if (chunk == 64) {
      return s.cols == 64 ? launch<64, 64, Y>(p, num_tokens, bc, stream)
                          : launch<64, 128, Y>(p, num_tokens, bc, stream);
    }
    return s.cols == 64 ? launch<128, 64, Y>(p, num_tokens, bc, stream)
                        : launch<128, 128, Y>(p, num_tokens, bc, stream);
  });
}

}  // namespace attnrt::cuda::linear
