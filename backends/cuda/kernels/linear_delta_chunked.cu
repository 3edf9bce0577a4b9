// The chunked (WY / UT) form of the delta rule for extend steps, the launchers declared in
// linear.h (the algorithm: linear_delta_chunked.cuh): the chunk table and the state pass, around
// the prep kernels of linear_delta_prep.cu.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>

#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/linear.h"
#include "backends/cuda/kernels/linear_delta_chunked.cuh"
#include "backends/cuda/kernels/primitives.cuh"

namespace attnrt::cuda::linear {
namespace delta {
namespace {

constexpr int kTableThreads = 1024;

// ---- 1. chunk table ---------------------------------------------------------------------------

// coff[r] = first chunk slot of request r (coff[num_reqs] = all chunks), table[slot] = its
// request or -1.
__global__ void __launch_bounds__(kTableThreads) chunk_table_kernel(const LinReq* reqs, int n,
                                                                   int64_t bound, int32_t* coff,
                                                                   int32_t* table) {
  using Scan = cub::BlockScan<int, kTableThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int per = (n + kTableThreads - 1) / kTableThreads;
  const int r0 = min(n, static_cast<int>(threadIdx.x) * per), r1 = min(n, r0 + per);
  int local = 0;
  for (int r = r0; r < r1; ++r) local += chunks_of(reqs[r].tokens);
  int first = 0, total = 0;
  Scan(scan).ExclusiveSum(local, first, total);
  for (int r = r0; r < r1; ++r) {
    coff[r] = first;
    const int c = chunks_of(reqs[r].tokens);
    for (int j = 0; j < c; ++j) {
      if (first + j < bound) table[first + j] = r;
    }
    first += c;
  }
  if (threadIdx.x == 0) coff[n] = total;
  for (int64_t i = total + threadIdx.x; i < bound; i += kTableThreads) table[i] = -1;
}

// ---- 3. state pass ----------------------------------------------------------------------------

template <int DK>
struct PassSmem {
  static constexpr int LB = DK + 8, LM = kChunk + 8, LU = kVTile + 8;
  struct Buf {
    bf16 w[kChunk * LB], qd[kChunk * LB];
    bf16 m[kChunk * LM];   // qk, lower triangle
    bf16 klt[DK * LM];     // (e^{G_last - G} (.) K)^T
    float u[kChunk * LU];  // this CTA's columns of U
    float el[DK];
  };
  Buf buf[2];
  bf16 sb[kVTile * LB];  // S tile [v][c] in bf16 (B operand)
  bf16 ut[kVTile * LM];  // u^T [v][t]
};

template <int DK, int DV>
__device__ __forceinline__ void load_chunk(typename PassSmem<DK>::Buf& b, const char* unit,
                                           const Layout& L, int vt) {
  using Sm = PassSmem<DK>;
  const bf16* W = reinterpret_cast<const bf16*>(unit + L.w_off);
  const bf16* Qd = reinterpret_cast<const bf16*>(unit + L.qd_off);
  const bf16* KlT = reinterpret_cast<const bf16*>(unit + L.klt_off);
  const bf16* M = reinterpret_cast<const bf16*>(unit + L.m_off);
  const float* U = reinterpret_cast<const float*>(unit + L.u_off) + vt * kVTile;
  const float* el = reinterpret_cast<const float*>(unit + L.el_off);
  constexpr int RK = DK / 8, RM = kChunk / 8, RU = kVTile / 4;  // 16-byte pieces per row
  for (int e = threadIdx.x; e < kChunk * RK; e += kThreads) {
    const int r = e / RK, q = e % RK;
    cp_async_16(&b.w[r * Sm::LB + 8 * q], W + r * DK + 8 * q, true);
    cp_async_16(&b.qd[r * Sm::LB + 8 * q], Qd + r * DK + 8 * q, true);
  }
  for (int e = threadIdx.x; e < DK * RM; e += kThreads) {
    const int r = e / RM, q = e % RM;
    cp_async_16(&b.klt[r * Sm::LM + 8 * q], KlT + r * kChunk + 8 * q, true);
  }
  for (int e = threadIdx.x; e < kChunk * RM; e += kThreads) {
    const int r = e / RM, q = e % RM;
    cp_async_16(&b.m[r * Sm::LM + 8 * q], M + r * kChunk + 8 * q, true);
  }
  for (int e = threadIdx.x; e < kChunk * RU; e += kThreads) {
    const int r = e / RU, q = e % RU;
    cp_async_16(&b.u[r * Sm::LU + 4 * q], U + r * DV + 4 * q, true);
  }
  for (int e = threadIdx.x; e < DK / 4; e += kThreads) cp_async_16(&b.el[4 * e], el + 4 * e, true);
  cp_async_commit();
}

template <int DK, int DV>
__global__ void __launch_bounds__(kThreads, 1)
    delta_pass_kernel(const DeltaParams p, const Layout L, const char* __restrict__ ws) {
  using Sm = PassSmem<DK>;
  constexpr int LB = Sm::LB, LM = Sm::LM, LU = Sm::LU;
  constexpr int NS = DK / 16;  // 8-column tiles of S per warp (a warp holds 16 rows x DK / 2)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Sm& s = *reinterpret_cast<Sm*>(smem_raw);
  // The value tiles of one (request, head) are neighbours in the grid, so they run together and
  // the second reads the chunk operands from L2.
  const int r = blockIdx.x / (DV / kVTile), vt = blockIdx.x % (DV / kVTile), h = blockIdx.y;
  const LinReq req = p.step.reqs[r];
  const int nchunks = chunks_of(req.tokens);
  if (nchunks == 0) return;
  const int32_t* coff = reinterpret_cast<const int32_t*>(ws + L.coff_off);
  const int64_t c0 = coff[r];
  if (c0 + nchunks > L.bound) return;  // more tokens than num_tokens: not ours to touch
  const int hv = p.state.heads;
  auto unit = [&](int64_t jc) { return ws + L.units_off + ((c0 + jc) * hv + h) * L.unit_bytes; };
  const int warp = threadIdx.x >> 5;

  // S rows vb .. vb + 15, columns cb .. cb + DK / 2 - 1 of this CTA's tile, in fp32 registers.
  const int vb = 16 * (warp & 3), cb = (warp >> 2) * (DK / 2);
  const int64_t sbase = ((req.slot * hv + h) * DV + static_cast<int64_t>(vt) * kVTile) * DK;
  float sacc[NS][4];
#pragma unroll
  for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = acc_row(vb, e), c = acc_col(cb + 8 * nt, e);
      sacc[nt][e] =
          req.has_initial_state ? load_elem(p.state.ssm, p.state.ssm_dtype, sbase + v * DK + c) : 0.f;
    }
  }
  auto stage_state = [&]() {
#pragma unroll
    for (int nt = 0; nt < NS; ++nt) {
      const int v = acc_row(vb, 0), c = acc_col(cb + 8 * nt, 0);
      store_bf16x2(&s.sb[v * LB + c], sacc[nt][0], sacc[nt][1]);
      store_bf16x2(&s.sb[(v + 8) * LB + c], sacc[nt][2], sacc[nt][3]);
    }
  };
  stage_state();
  load_chunk<DK, DV>(s.buf[0], unit(0), L, vt);

  // Output / u tile of this warp: token rows tb .. tb + 15, value columns vcb .. vcb + 31.
  const int tb = 16 * (warp & 3), vcb = 32 * (warp >> 2);
  for (int jc = 0; jc < nchunks; ++jc) {
    typename Sm::Buf& b = s.buf[jc & 1];
    cp_async_wait<0>();
    __syncthreads();  // chunk jc is in; the previous chunk's readers of the other buffer are done
    if (jc + 1 < nchunks) load_chunk<DK, DV>(s.buf[(jc + 1) & 1], unit(jc + 1), L, vt);

    // u = U - W S^T and o = Qd S^T, sharing the S fragments.
    float au[4][4] = {}, ao[4][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < DK; k0 += 16) {
      uint32_t aw[4], aq[4];
      frag_a(aw, b.w, LB, tb, k0);
      frag_a(aq, b.qd, LB, tb, k0);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        uint32_t b0, b1;
        frag_b(b0, b1, s.sb, LB, vcb + 8 * nt, k0);
        mma_16816<bf16>(au[nt], aw, b0, b1);
        mma_16816<bf16>(ao[nt], aq, b0, b1);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = acc_row(tb, e), v = acc_col(vcb + 8 * nt, e);
        s.ut[v * LM + t] = __float2bfloat16_rn(b.u[t * LU + v] - au[nt][e]);
      }
    }
    __syncthreads();

    // o += qk u, then the outputs of the request's tokens.
#pragma unroll
    for (int k0 = 0; k0 < kChunk; k0 += 16) {
      uint32_t am[4];
      frag_a(am, b.m, LM, tb, k0);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        uint32_t b0, b1;
        frag_b(b0, b1, s.ut, LM, vcb + 8 * nt, k0);
        mma_16816<bf16>(ao[nt], am, b0, b1);
      }
    }
    const int n = min(kChunk, req.tokens - jc * kChunk);
    const int64_t tok0 = req.token_start + static_cast<int64_t>(jc) * kChunk;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = acc_row(tb, e), v = acc_col(vcb + 8 * nt, e);
        if (t < n) {
          store_elem(p.out, p.out_dtype,
                     (tok0 + t) * p.out_stride + static_cast<int64_t>(h) * DV + vt * kVTile + v,
                     ao[nt][e]);
        }
      }
    }

    // S = S (.) e^{G_last} + u^T Kl.
#pragma unroll
    for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sacc[nt][e] *= b.el[acc_col(cb + 8 * nt, e)];
    }
#pragma unroll
    for (int k0 = 0; k0 < kChunk; k0 += 16) {
      uint32_t a[4];
      frag_a(a, s.ut, LM, vb, k0);
#pragma unroll
      for (int nt = 0; nt < NS; ++nt) {
        uint32_t b0, b1;
        frag_b(b0, b1, b.klt, LM, cb + 8 * nt, k0);
        mma_16816<bf16>(sacc[nt], a, b0, b1);
      }
    }
    stage_state();  // s.sb is read only before the middle barrier
  }

#pragma unroll
  for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = acc_row(vb, e), c = acc_col(cb + 8 * nt, e);
      store_elem(p.state.ssm, p.state.ssm_dtype, sbase + v * DK + c, sacc[nt][e]);
    }
  }
}

template <int DK, int DV>
cudaError_t run_pass(const DeltaParams& p, const Layout& L, char* ws, cudaStream_t stream) {
  auto pass = delta_pass_kernel<DK, DV>;
  constexpr int pass_smem = sizeof(PassSmem<DK>);
  const cudaError_t err =
      cudaFuncSetAttribute(pass, cudaFuncAttributeMaxDynamicSharedMemorySize, pass_smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.step.num_reqs * (DV / kVTile), p.state.heads);
  pass<<<grid, kThreads, pass_smem, stream>>>(p, L, ws);
  return cudaGetLastError();
}

bool valid_dtype(DTypeCode t) { return t == kF32 || t == kF16 || t == kBF16; }

}  // namespace
}  // namespace delta

size_t delta_chunked_workspace(const DeltaParams& p, int64_t num_tokens, int chunk) {
  if (chunk != delta::kChunk || num_tokens < 0 || p.step.num_reqs < 0) return 0;
  return static_cast<size_t>(
      delta::make_layout(p.step.num_reqs, num_tokens, p.state.cols, p.state.rows, p.state.heads)
          .total);
}

// Supported: chunk 64, non-verify steps, (Dk, Dv) = (64, 64) or (128, 128), state fp32 / bf16,
// activations fp32 / bf16 / fp16; anything else returns cudaErrorInvalidValue without launching.
cudaError_t launch_delta_chunked(const DeltaParams& p, int64_t num_tokens, int chunk,
                                 void* workspace, cudaStream_t stream) {
  const int dk = p.state.cols, dv = p.state.rows, hv = p.state.heads, hk = p.key_heads;
  if (chunk != delta::kChunk || p.step.verify != 0) return cudaErrorInvalidValue;
  if (!((dk == 64 && dv == 64) || (dk == 128 && dv == 128))) return cudaErrorInvalidValue;
  if (hk <= 0 || hv <= 0 || hv % hk != 0) return cudaErrorInvalidValue;
  if (p.state.conv_dim != 2 * hk * dk + hv * dv) return cudaErrorInvalidValue;
  if (!(p.state.ssm_dtype == kF32 || p.state.ssm_dtype == kBF16)) return cudaErrorInvalidValue;
  if (!delta::valid_dtype(p.a_dtype) || !delta::valid_dtype(p.b_dtype) ||
      !delta::valid_dtype(p.out_dtype))
    return cudaErrorInvalidValue;
  if (p.step.num_reqs <= 0 || num_tokens <= 0) return cudaSuccess;
  if (workspace == nullptr) return cudaErrorInvalidValue;
  const delta::Layout L = delta::make_layout(p.step.num_reqs, num_tokens, dk, dv, hv);
  char* ws = static_cast<char*>(workspace);
  delta::chunk_table_kernel<<<1, delta::kTableThreads, 0, stream>>>(
      p.step.reqs, p.step.num_reqs, L.bound, reinterpret_cast<int32_t*>(ws + L.coff_off),
      reinterpret_cast<int32_t*>(ws + L.table_off));
  const cudaError_t prep = delta::launch_prep(p, L, ws, stream);
  if (prep != cudaSuccess) return prep;
  return dk == 64 ? delta::run_pass<64, 64>(p, L, ws, stream)
                  : delta::run_pass<128, 128>(p, L, ws, stream);
}

}  // namespace attnrt::cuda::linear
