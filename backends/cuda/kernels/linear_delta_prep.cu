// The prep kernels of the chunked delta rule (linear_delta_chunked.cuh): per (chunk, value head),
// everything that does not depend on the state, for GDN and for KDA.
#include <cuda_bf16.h>

#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/linear.h"
#include "backends/cuda/kernels/linear_delta_chunked.cuh"
#include "backends/cuda/kernels/primitives.cuh"

namespace attnrt::cuda::linear::delta {
namespace {

// ---- 2. prep ----------------------------------------------------------------------------------

// Row `row` of q and k, channels lane + 32 m; zero past the request (valid = false). Y: y's
// element type (float or bf16).
template <int DK, typename Y>
__device__ __forceinline__ void load_qk_row(const DeltaParams& p, const Y* yq, const Y* yk,
                                            int64_t row, bool valid, float (&qv)[DK / 32],
                                            float (&kv)[DK / 32]) {
  const int64_t base = row * p.state.conv_dim + (threadIdx.x & 31);
#pragma unroll
  for (int m = 0; m < DK / 32; ++m) {
    qv[m] = valid ? to_float(yq[base + 32 * m]) : 0.f;
    kv[m] = valid ? to_float(yk[base + 32 * m]) : 0.f;
  }
}

// L2-normalises a row of q (times the scale) and of k spread over the warp as above.
template <int DK>
__device__ __forceinline__ void normalise_qk_row(const DeltaParams& p, float (&qv)[DK / 32],
                                                 float (&kv)[DK / 32]) {
  float sq = 0.f, sk = 0.f;
#pragma unroll
  for (int m = 0; m < DK / 32; ++m) {
    sq += qv[m] * qv[m];
    sk += kv[m] * kv[m];
  }
  const float fq = p.scale * rsqrtf(group_sum<32>(sq) + 1e-6f),
              fk = rsqrtf(group_sum<32>(sk) + 1e-6f);
#pragma unroll
  for (int m = 0; m < DK / 32; ++m) {
    qv[m] *= fq;
    kv[m] *= fk;
  }
}

template <int DK, int DV>
struct KdaPrepSmem {
  static constexpr int LF = DK + 1;       // fp32 rows: odd stride, column walks are conflict-free
  static constexpr int LC = kChunk + 4;   // kk^T rows: 16-byte aligned for float4 broadcasts
  static constexpr int LQ = kChunk + 1;
  static constexpr int LB = DK + 8;       // bf16 MMA operand rows
  static constexpr int LX = DK + DV;
  static constexpr int KC_ROWS = 96;      // kda column operands for row blocks 1, 2, 3: 16 + 32 + 48
  float q[kChunk * LF], k[kChunk * LF];   // normalised (q scaled)
  float g[kChunk * LF];                   // cumulative log decay per channel
  float kk[kChunk * LC];                  // transposed, times beta: kk[i][t] = beta_t kk(t, i), i < t
  float qk[kChunk * LQ];                  // qk[t][i], i <= t
  float beta[kChunk];
  union {
    struct {
      bf16 qr[kChunk * LB], kr[kChunk * LB];  // q, k scaled to the row block's first token
      bf16 kc[KC_ROWS * LB];                  // k scaled from the row block's first token
    } op;
    float x[kChunk * LX];  // the substitution's rows [beta Kd | beta V], once kk / qk are done
  };
};

template <int DK, int DV, typename Y>
__global__ void __launch_bounds__(kThreads, 1)
    kda_prep_kernel(const DeltaParams p, const Layout L, char* __restrict__ ws) {
  using Sm = KdaPrepSmem<DK, DV>;
  constexpr int LF = Sm::LF, LC = Sm::LC, LQ = Sm::LQ, LB = Sm::LB, LX = Sm::LX;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Sm& s = *reinterpret_cast<Sm*>(smem_raw);
  const int slot = blockIdx.x, h = blockIdx.y;
  const PrepChunk<Y> ch = prep_chunk<DK, DV, Y>(p, L, ws, slot, h);
  if (ch.r < 0) return;
  const int n = ch.n;
  const int64_t tok0 = ch.tok0;
  const int hv = p.state.heads;
  const int64_t ldy = p.state.conv_dim;
  const Y *yq = ch.yq, *yk = ch.yk, *yv = ch.yv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kWarps = kThreads / 32;
  auto G = [&](int t, int c) -> float { return s.g[t * LF + c]; };

  // q, k, L2-normalised; tokens past the request are zero (and get beta = 0, g = 0 below, so
  // that they change nothing).
  for (int t = warp; t < kChunk; t += kWarps) {
    float qv[DK / 32], kv[DK / 32];
    load_qk_row<DK>(p, yq, yk, tok0 + t, t < n, qv, kv);
    normalise_qk_row<DK>(p, qv, kv);
#pragma unroll
    for (int m = 0; m < DK / 32; ++m) {
      s.q[t * LF + lane + 32 * m] = qv[m];
      s.k[t * LF + lane + 32 * m] = kv[m];
    }
  }
  const float decay_rate = -expf(p.A_log[h]);
  if (threadIdx.x < kChunk) {
    const int t = threadIdx.x;
    const float b = t < n ? load_elem(p.b, p.b_dtype, (tok0 + t) * p.b_stride + h) : 0.f;
    s.beta[t] = t < n ? 1.f / (1.f + expf(-b)) : 0.f;
  }
  for (int c = threadIdx.x; c < DK; c += kThreads) {
    const float bias = p.dt_bias[h * DK + c];
    float av[kChunk];  // every load in flight before the scan
#pragma unroll
    for (int t = 0; t < kChunk; ++t)
      av[t] = t < n ? load_elem(p.a, p.a_dtype, (tok0 + t) * p.a_stride + h * DK + c) : 0.f;
    float acc = 0.f;
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (t < n) acc += decay_rate * softplus(av[t] + bias);
      s.g[t * LF + c] = acc;
    }
  }
  __syncthreads();

  // bf16 MMA operands.
  for (int e = threadIdx.x; e < kChunk * DK / 2; e += kThreads) {
    const int t = e / (DK / 2), c = 2 * (e % (DK / 2));
    const int r0 = t & ~15;
    const float f0 = expf(G(t, c) - G(r0, c)), f1 = expf(G(t, c + 1) - G(r0, c + 1));
    store_bf16x2(&s.op.kr[t * LB + c], s.k[t * LF + c] * f0, s.k[t * LF + c + 1] * f1);
    store_bf16x2(&s.op.qr[t * LB + c], s.q[t * LF + c] * f0, s.q[t * LF + c + 1] * f1);
  }
  for (int e = threadIdx.x; e < Sm::KC_ROWS * DK / 2; e += kThreads) {
    const int row = e / (DK / 2), c = 2 * (e % (DK / 2));
    const int bt = row < 16 ? 1 : (row < 48 ? 2 : 3);
    const int i = row - 8 * bt * (bt - 1), r0 = 16 * bt;
    const float f0 = expf(G(r0, c) - G(i, c)), f1 = expf(G(r0, c + 1) - G(i, c + 1));
    store_bf16x2(&s.op.kc[row * LB + c], s.k[i * LF + c] * f0, s.k[i * LF + c + 1] * f1);
  }
  __syncthreads();

  // kk (strictly lower) and qk (lower), fp32 in shared memory; entries above are never read.
  // Off-diagonal 16-token blocks (row block bt, columns below 16 bt): 12 tiles of 16x8 for each
  // of kk, qk.
  for (int job = warp; job < 24; job += kWarps) {
    const int prod = job / 12, idx = job % 12;
    const int bt = idx < 2 ? 1 : (idx < 6 ? 2 : 3);
    const int nt = idx - (bt == 1 ? 0 : (bt == 2 ? 2 : 6));
    const bf16* A = prod ? s.op.qr : s.op.kr;
    float acc[4] = {};
#pragma unroll
    for (int k0 = 0; k0 < DK; k0 += 16) {
      uint32_t a[4], b0, b1;
      frag_a(a, A, LB, 16 * bt, k0);
      frag_b(b0, b1, s.op.kc, LB, 8 * bt * (bt - 1) + 8 * nt, k0);
      mma_16816<bf16>(acc, a, b0, b1);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = acc_row(16 * bt, e), i = acc_col(8 * nt, e);
      if (prod) {
        s.qk[t * LQ + i] = acc[e];
      } else {
        s.kk[i * LC + t] = s.beta[t] * acc[e];
      }
    }
  }
  // Diagonal blocks, per pair (t, i), i <= t in the same 16-token block: 4 x 136 pairs, one
  // per thread (lanes of a warp walk different rows: the odd row stride spreads the banks).
  for (int pr = threadIdx.x; pr < 4 * 136; pr += kThreads) {
    const int bt = pr / 136, q = pr % 136;
    int tl = static_cast<int>((sqrtf(8.f * q + 1.f) - 1.f) * 0.5f);
    while ((tl + 1) * (tl + 2) / 2 <= q) ++tl;
    while (tl * (tl + 1) / 2 > q) --tl;
    const int t = 16 * bt + tl, i = 16 * bt + q - tl * (tl + 1) / 2;
    float skk = 0.f, sqk = 0.f;
#pragma unroll 4
    for (int c = 0; c < DK; ++c) {
      const float ki = s.k[i * LF + c] * expf(s.g[t * LF + c] - s.g[i * LF + c]);
      skk += s.k[t * LF + c] * ki;
      sqk += s.q[t * LF + c] * ki;
    }
    s.kk[i * LC + t] = i < t ? s.beta[t] * skk : 0.f;
    s.qk[t * LQ + i] = sqk;
  }
  __syncthreads();

  const PrepUnit u = prep_unit(L, ws, slot, hv, h);
  bf16 *W = u.W, *Qd = u.Qd, *KlT = u.KlT, *Mqk = u.Mqk;
  float *U = u.U, *el = u.el;

  // Forward substitution: X_t = beta_t X0_t - sum_{i<t} (beta_t kk[t][i]) X_i, one column per
  // thread, 16 rows at a time in registers; the finished rows of earlier blocks are read back from
  // shared memory (each thread its own column, so no barrier), kk^T as float4 broadcasts.
  for (int col = threadIdx.x; col < DK + DV; col += kThreads) {
#pragma unroll 1
    for (int blk = 0; blk < kChunk / 16; ++blk) {
      const int t0 = 16 * blk;
      float x[16];
      if (col < DK) {
#pragma unroll
        for (int tl = 0; tl < 16; ++tl) {
          const int t = t0 + tl;
          x[tl] = s.beta[t] * expf(G(t, col)) * s.k[t * LF + col];
        }
      } else {
#pragma unroll
        for (int tl = 0; tl < 16; ++tl) {
          const int t = t0 + tl;
          x[tl] = t < n ? s.beta[t] * to_float(yv[(tok0 + t) * ldy + col - DK]) : 0.f;
        }
      }
#pragma unroll 2
      for (int i = 0; i < t0; ++i) {
        const float xi = s.x[i * LX + col];
        const float4* a = reinterpret_cast<const float4*>(&s.kk[i * LC + t0]);
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) {
          const float4 v = a[q4];
          x[4 * q4] -= v.x * xi;
          x[4 * q4 + 1] -= v.y * xi;
          x[4 * q4 + 2] -= v.z * xi;
          x[4 * q4 + 3] -= v.w * xi;
        }
      }
#pragma unroll
      for (int il = 0; il < 15; ++il) {
        const float xi = x[il];
        const float4* a = reinterpret_cast<const float4*>(&s.kk[(t0 + il) * LC + t0]);
#pragma unroll
        for (int q4 = il / 4; q4 < 4; ++q4) {
          const float4 v = a[q4];
          const float w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (4 * q4 + e > il) x[4 * q4 + e] -= w[e] * xi;
          }
        }
      }
#pragma unroll
      for (int tl = 0; tl < 16; ++tl) s.x[(t0 + tl) * LX + col] = x[tl];
      if (col < DK) {
#pragma unroll
        for (int tl = 0; tl < 16; ++tl) W[wq_elem(t0 + tl, col)] = __float2bfloat16_rn(x[tl]);
      } else {
        // U^T row col - DK: 16 tokens from t0, two 8-token pieces, four float4 stores.
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) {
          *reinterpret_cast<float4*>(&U[ut_elem(col - DK, t0 + 4 * q4)]) =
              make_float4(x[4 * q4], x[4 * q4 + 1], x[4 * q4 + 2], x[4 * q4 + 3]);
        }
      }
    }
  }
  // The state pass's other operands.
  for (int e = threadIdx.x; e < kChunk * DK / 2; e += kThreads) {
    const int t = e / (DK / 2), c = 2 * (e % (DK / 2));
    store_bf16x2(&Qd[wq_elem(t, c)], expf(G(t, c)) * s.q[t * LF + c],
                 expf(G(t, c + 1)) * s.q[t * LF + c + 1]);
  }
  for (int e = threadIdx.x; e < DK * kChunk / 2; e += kThreads) {
    const int c = e / (kChunk / 2), i = 2 * (e % (kChunk / 2));
    const float gl = G(kChunk - 1, c);
    store_bf16x2(&KlT[klt_elem(DK, c, i)], expf(gl - G(i, c)) * s.k[i * LF + c],
                 expf(gl - G(i + 1, c)) * s.k[(i + 1) * LF + c]);
  }
  for (int e = threadIdx.x; e < kChunk * kChunk / 2; e += kThreads) {
    const int t = e / (kChunk / 2), i = 2 * (e % (kChunk / 2));
    store_bf16x2(&Mqk[mqk_elem(t, i)], i <= t ? s.qk[t * LQ + i] : 0.f,
                 i + 1 <= t ? s.qk[t * LQ + i + 1] : 0.f);
  }
  for (int c = threadIdx.x; c < DK; c += kThreads) el[c] = expf(G(kChunk - 1, c));
}

// GDN: the gate is one scalar per token, so every decay factor comes from tables of 64 numbers
// (no per-element exponentials), q and k are kept only as the bf16 MMA operands, and qk goes from
// the MMA accumulators straight to the workspace. The system (I + A) X = diag(beta) X0, with
// A[t][i] = beta_t e^{g_t - g_i} k_t . k_i (i < t) and X0 = [e^g (.) K | V], is solved as
// X = T diag(beta) X0 with T = (I + A)^{-1} (unit lower triangular), built in fp32 by 16x16 blocks:
//   M_ik = T_ii A_ik (k < i) and T_ii, one forward substitution per column of [A_i0 .. | I];
//   T_ij = -sum_{k=j}^{i-1} M_ik T_kj, three levels (i - j = 1, 2, 3), one entry per thread.
// The product runs on bf16 tensor cores with fp32 accumulators: T (scaled by the column's beta or
// beta e^g) is split into bf16 hi + lo, so is V; K is exact in bf16. Each term of the product
// keeps ~2^-17 of relative accuracy (W is then rounded to bf16, U stays fp32), far below the bf16
// rounding of u and W S^T in the state pass. V is fetched with cp.async at the start, behind the
// q / k loads, in y's element type Y: fp32 V is split as above; bf16 V (bf16 y) is exact in bf16,
// its lo part zero, so its B fragments come straight from shared memory by the transposing
// ldmatrix and the hi x lo product (zero) is skipped. ~104 KB of shared memory for DK = DV = 128
// with fp32 y (~88 KB with bf16 y), two CTAs per SM.
template <int DK, int DV, typename Y>
struct GdnPrepSmem {
  static constexpr int LB = DK + 8;      // bf16 MMA operand rows
  static constexpr int LA = kChunk + 8;  // fp32 64 x 64 rows: float2 fragment loads conflict-free
  // V rows: fp32, B-fragment column reads conflict-free; bf16, 16-byte rows for cp.async and
  // conflict-free ldmatrix (as LB).
  static constexpr int LV = sizeof(Y) == 4 ? DV + 4 : DV + 8;
  bf16 q[kChunk * LB], k[kChunk * LB];  // normalised (q scaled)
  float a[kChunk * LA];     // A[t][i] (zero for i >= t); its blocks below the diagonal become M
  float tinv[kChunk * LA];  // T, its 16x16 blocks on and below the diagonal
  Y v[kChunk * LV];         // the chunk's V rows, zero past the request
  float g[kChunk];          // cumulative log decay
  float beta[kChunk];
  float beg[kChunk];  // beta_t e^{g_t}
  float eg[kChunk];   // e^{g_t}
  float egl[kChunk];  // e^{g_last - g_t}
};

// x0, x1 -> bf16 pairs hi, lo with hi + lo = x to 2^-17 relative.
__device__ __forceinline__ void split_bf16x2(uint32_t& hi, uint32_t& lo, float x0, float x1) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = pack2<bf16>(x0 - hf.x, x1 - hf.y);
}

// Two CTAs per SM: 228 KB of shared memory per SM, 1 KB of it reserved per CTA.
static_assert(sizeof(GdnPrepSmem<128, 128, float>) <= 113 * 1024,
              "gdn_prep_kernel: two CTAs per SM");

template <int DK, int DV, typename Y>
__global__ void __launch_bounds__(kThreads, 2)
    gdn_prep_kernel(const DeltaParams p, const Layout L, char* __restrict__ ws) {
  static_assert(DK == DV && (DK == 64 || DK == 128) && kThreads == 256 && kChunk == 64,
                "the block solve maps one thread to one entry of a 16x16 block and 8 warps to "
                "the columns of W and U");
  using Sm = GdnPrepSmem<DK, DV, Y>;
  constexpr int LB = Sm::LB, LA = Sm::LA, LV = Sm::LV;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Sm& s = *reinterpret_cast<Sm*>(smem_raw);
  // One CTA per (chunk slot, value head), the heads of a chunk neighbours in the grid: the two
  // value heads of a key head share its q / k rows (the second reads them from L2), and the units
  // are written in address order.
  const int hv = p.state.heads;
  const int slot = static_cast<int>(blockIdx.x / hv), h = static_cast<int>(blockIdx.x % hv);
  const PrepChunk<Y> ch = prep_chunk<DK, DV, Y>(p, L, ws, slot, h);
  if (ch.r < 0) return;
  const int n = ch.n;
  const int64_t tok0 = ch.tok0;
  const int64_t ldy = p.state.conv_dim;
  const Y *yq = ch.yq, *yk = ch.yk, *yv = ch.yv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kWarps = kThreads / 32;

  // The gate inputs of the last warp's scan, then V (cp.async, zero past the request), both in
  // flight while the q / k rows load.
  float ga0 = 0.f, ga1 = 0.f, gb0 = 0.f, gb1 = 0.f;
  if (warp == kWarps - 1) {
    if (lane < n) {
      ga0 = load_elem(p.a, p.a_dtype, (tok0 + lane) * p.a_stride + h);
      gb0 = load_elem(p.b, p.b_dtype, (tok0 + lane) * p.b_stride + h);
    }
    if (lane + 32 < n) {
      ga1 = load_elem(p.a, p.a_dtype, (tok0 + lane + 32) * p.a_stride + h);
      gb1 = load_elem(p.b, p.b_dtype, (tok0 + lane + 32) * p.b_stride + h);
    }
  }
  constexpr int VE = 16 / sizeof(Y), RV = DV / VE;  // elements per 16-byte piece, pieces per row
  for (int e = threadIdx.x; e < kChunk * RV; e += kThreads) {
    const int t = e / RV, q = e % RV;
    cp_async_16(&s.v[t * LV + VE * q], yv + (tok0 + (t < n ? t : 0)) * ldy + VE * q, t < n);
  }
  cp_async_commit();

  // q, k, L2-normalised: rows warp + 8 rr, every load of the warp's rows issued before the first
  // reduction (whose shuffles would otherwise hold back the next row's loads). Tokens past the
  // request are zero (and get beta = 0 and the last token's g below, so that they change nothing).
  {
    constexpr int RW = kChunk / kWarps;
    float qv[RW][DK / 32], kv[RW][DK / 32];
#pragma unroll
    for (int rr = 0; rr < RW; ++rr) {
      const int t = warp + kWarps * rr;
      load_qk_row<DK>(p, yq, yk, tok0 + t, t < n, qv[rr], kv[rr]);
    }
#pragma unroll
    for (int rr = 0; rr < RW; ++rr) {
      const int t = warp + kWarps * rr;
      normalise_qk_row<DK>(p, qv[rr], kv[rr]);
#pragma unroll
      for (int m = 0; m < DK / 32; ++m) {
        s.q[t * LB + lane + 32 * m] = __float2bfloat16_rn(qv[rr][m]);
        s.k[t * LB + lane + 32 * m] = __float2bfloat16_rn(kv[rr][m]);
      }
    }
  }
  if (warp == kWarps - 1) {  // inclusive scan of 64 scalars: two per lane
    const float decay_rate = -expf(p.A_log[h]), bias = p.dt_bias[h];
    float g0 = lane < n ? decay_rate * softplus(ga0 + bias) : 0.f;
    float g1 = lane + 32 < n ? decay_rate * softplus(ga1 + bias) : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float x0 = __shfl_up_sync(0xffffffffu, g0, o), x1 = __shfl_up_sync(0xffffffffu, g1, o);
      if (lane >= o) {
        g0 += x0;
        g1 += x1;
      }
    }
    g1 += __shfl_sync(0xffffffffu, g0, 31);
    const float gl = __shfl_sync(0xffffffffu, g1, 31);
    const float b0 = lane < n ? 1.f / (1.f + expf(-gb0)) : 0.f;
    const float b1 = lane + 32 < n ? 1.f / (1.f + expf(-gb1)) : 0.f;
    s.g[lane] = g0;
    s.g[lane + 32] = g1;
    s.beta[lane] = b0;
    s.beta[lane + 32] = b1;
    const float e0 = expf(g0), e1 = expf(g1);
    s.eg[lane] = e0;
    s.eg[lane + 32] = e1;
    s.beg[lane] = b0 * e0;
    s.beg[lane + 32] = b1 * e1;
    s.egl[lane] = expf(gl - g0);
    s.egl[lane + 32] = expf(gl - g1);
  }
  __syncthreads();

  const PrepUnit u = prep_unit(L, ws, slot, hv, h);
  bf16 *W = u.W, *Qd = u.Qd, *KlT = u.KlT, *Mqk = u.Mqk;
  float *U = u.U, *el = u.el;

  // A (strictly lower, zero elsewhere) to shared memory; qk (lower, zero above) to Mqk.
  {
    const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
    float akk[4][4] = {}, aqk[4][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < DK; k0 += 16) {
      uint32_t ak[4], aq[4];
      frag_a(ak, s.k, LB, m0, k0);
      frag_a(aq, s.q, LB, m0, k0);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        uint32_t b0, b1;
        frag_b(b0, b1, s.k, LB, n0 + 8 * nt, k0);
        mma_16816<bf16>(akk[nt], ak, b0, b1);
        mma_16816<bf16>(aqk[nt], aq, b0, b1);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float d[4], av[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = acc_row(m0, e), i = acc_col(n0 + 8 * nt, e);
        d[e] = i <= t ? expf(s.g[t] - s.g[i]) : 0.f;
        av[e] = i < t ? s.beta[t] * akk[nt][e] * d[e] : 0.f;
      }
      const int t = acc_row(m0, 0), i = acc_col(n0 + 8 * nt, 0);
      *reinterpret_cast<float2*>(&s.a[t * LA + i]) = make_float2(av[0], av[1]);
      *reinterpret_cast<float2*>(&s.a[(t + 8) * LA + i]) = make_float2(av[2], av[3]);
      store_bf16x2(&Mqk[mqk_elem(t, i)], aqk[nt][0] * d[0], aqk[nt][1] * d[1]);
      store_bf16x2(&Mqk[mqk_elem(t + 8, i)], aqk[nt][2] * d[2], aqk[nt][3] * d[3]);
    }
  }
  __syncthreads();  // A is in

  constexpr int kSolveThreads = 160;  // the columns of [A_i0 .. A_i,i-1 | I] over block rows i
  if (threadIdx.x < kSolveThreads) {
    // Block row bi, column u of [A_bi,0 .. A_bi,bi-1 | I]: solve (I + A_bi,bi) x = that column by
    // forward substitution. Identity columns give T_bi,bi (zeros above its diagonal included),
    // the others M_bi,k = T_bi,bi A_bi,k, written over the A column they came from (only this
    // thread reads it; A_bi,bi itself is not overwritten).
    const int tid = threadIdx.x;
    const int bi = tid < 16 ? 0 : (tid < 48 ? 1 : (tid < 96 ? 2 : 3));
    const int r0 = 16 * bi, u = tid - 8 * bi * (bi + 1);
    const bool ident = u >= r0;
    float x[16];
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
      x[rr] = ident ? (rr == u - r0 ? 1.f : 0.f) : s.a[(r0 + rr) * LA + u];
    }
#pragma unroll
    for (int rr = 1; rr < 16; ++rr) {
      const float4* arow = reinterpret_cast<const float4*>(&s.a[(r0 + rr) * LA + r0]);
      float acc0 = x[rr], acc1 = 0.f;
#pragma unroll
      for (int q4 = 0; 4 * q4 < rr; ++q4) {
        const float4 w = arow[q4];
        const float wv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (4 * q4 + e < rr) {
            if (e & 1) {
              acc1 -= wv[e] * x[4 * q4 + e];
            } else {
              acc0 -= wv[e] * x[4 * q4 + e];
            }
          }
        }
      }
      x[rr] = acc0 + acc1;
    }
    float* dst = ident ? &s.tinv[r0 * LA + u] : &s.a[r0 * LA + u];
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) dst[rr * LA] = x[rr];
  } else {
    // Meanwhile the state pass's operands that do not need X, in 16-byte stores: Qd = e^G (.) Q
    // (8 channels of a token per item), KlT = (e^{G_last - G} (.) K)^T (2 channels x 8 tokens per
    // item; a warp's lanes read neighbouring channel pairs of the same tokens), el = e^{G_last}.
    constexpr int kOther = kThreads - kSolveThreads;
    const int tw = threadIdx.x - kSolveThreads;
    for (int e = tw; e < kChunk * DK / 8; e += kOther) {
      const int t = e / (DK / 8), c = 8 * (e % (DK / 8));
      const uint4 raw = *reinterpret_cast<const uint4*>(&s.q[t * LB + c]);
      const uint32_t in[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t out[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in[q]));
        out[q] = pack2<bf16>(s.eg[t] * v.x, s.eg[t] * v.y);
      }
      *reinterpret_cast<uint4*>(&Qd[wq_elem(t, c)]) = make_uint4(out[0], out[1], out[2], out[3]);
    }
    for (int e = tw; e < (DK / 2) * (kChunk / 8); e += kOther) {
      const int c = 2 * (e % (DK / 2)), i0 = 8 * (e / (DK / 2));
      uint32_t c0[4], c1[4];  // channels c and c + 1, tokens i0 .. i0 + 7
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = i0 + 2 * q;
        const float2 k0 =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&s.k[i * LB + c]));
        const float2 k1 =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&s.k[(i + 1) * LB + c]));
        c0[q] = pack2<bf16>(s.egl[i] * k0.x, s.egl[i + 1] * k1.x);
        c1[q] = pack2<bf16>(s.egl[i] * k0.y, s.egl[i + 1] * k1.y);
      }
      *reinterpret_cast<uint4*>(&KlT[klt_elem(DK, c, i0)]) = make_uint4(c0[0], c0[1], c0[2], c0[3]);
      *reinterpret_cast<uint4*>(&KlT[klt_elem(DK, c + 1, i0)]) =
          make_uint4(c1[0], c1[1], c1[2], c1[3]);
    }
    for (int c = tw; c < DK; c += kOther) el[c] = s.eg[kChunk - 1];
  }
  cp_async_wait<0>();
  __syncthreads();  // T's diagonal blocks, M and V are in

  // T_ij = -sum_{k=j}^{i-1} M_ik T_kj, level i - j = 1, 2, 3; thread (row rr, column cc) of each
  // block of the level (a warp reads two M rows as float4 broadcasts and one T row).
  {
    const int rr = threadIdx.x >> 4, cc = threadIdx.x & 15;
#pragma unroll 1
    for (int lvl = 1; lvl < 4; ++lvl) {
#pragma unroll 1
      for (int bj = 0; bj + lvl < 4; ++bj) {
        const int bi = bj + lvl;
        float acc = 0.f;
#pragma unroll 1
        for (int bk = bj; bk < bi; ++bk) {
          const float4* mrow =
              reinterpret_cast<const float4*>(&s.a[(16 * bi + rr) * LA + 16 * bk]);
          const float* tcol = &s.tinv[16 * bk * LA + 16 * bj + cc];
#pragma unroll
          for (int q4 = 0; q4 < 4; ++q4) {
            const float4 mv = mrow[q4];
            acc += mv.x * tcol[(4 * q4) * LA] + mv.y * tcol[(4 * q4 + 1) * LA] +
                   mv.z * tcol[(4 * q4 + 2) * LA] + mv.w * tcol[(4 * q4 + 3) * LA];
          }
        }
        s.tinv[(16 * bi + rr) * LA + 16 * bj + cc] = -acc;
      }
      __syncthreads();
    }
  }

  // X = T diag(beta) [e^g (.) K | V] on tensor cores, the k-steps above the diagonal skipped.
  // Warp w takes the 8 NT columns from 8 NT w of W and of U. W = (T diag(beta e^g)) K with K from
  // shared memory transposed by ldmatrix: 2 MMAs (T hi, lo); U = (T diag(beta)) V: 3 MMAs
  // (hi hi, hi lo, lo hi).
  {
    constexpr int NT = DK / 64;
    const int cw = 8 * NT * warp;
    const int gr = lane >> 2, cq = 2 * (lane & 3);
#pragma unroll 1
    for (int mt = 0; mt < 4; ++mt) {
      float aw[NT][4] = {}, au[NT][4] = {};
#pragma unroll 1
      for (int kt = 0; kt <= mt; ++kt) {
        const int k0 = 16 * kt;
        uint32_t tu_hi[4], tu_lo[4], tw_hi[4], tw_lo[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int row = 16 * mt + gr + 8 * (q & 1), col = k0 + cq + 8 * (q >> 1);
          const float2 tv = *reinterpret_cast<const float2*>(&s.tinv[row * LA + col]);
          const float2 bv = *reinterpret_cast<const float2*>(&s.beta[col]);
          const float2 ev = *reinterpret_cast<const float2*>(&s.beg[col]);
          split_bf16x2(tu_hi[q], tu_lo[q], tv.x * bv.x, tv.y * bv.y);
          split_bf16x2(tw_hi[q], tw_lo[q], tv.x * ev.x, tv.y * ev.y);
        }
        // B fragments of rows k0 .. k0 + 15 of a [chunk][ld] bf16 tile, columns cw .. cw + 8 NT - 1
        // (ldmatrix transposed: the MMA's K = the tile's rows).
        auto b_frags = [&](const bf16* m, int ld, uint32_t(&out)[NT][2]) {
          if constexpr (NT == 2) {
            uint32_t f[4];
            ldmatrix_x4_trans(f, &m[(k0 + (lane & 15)) * ld + cw + 8 * (lane >> 4)]);
            out[0][0] = f[0];
            out[0][1] = f[1];
            out[1][0] = f[2];
            out[1][1] = f[3];
          } else {
            uint32_t f[2];
            ldmatrix_x2_trans(f, &m[(k0 + (lane & 15)) * ld + cw]);
            out[0][0] = f[0];
            out[0][1] = f[1];
          }
        };
        uint32_t kb[NT][2];
        b_frags(s.k, LB, kb);
        if constexpr (sizeof(Y) == 4) {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const float* vc = &s.v[(k0 + cq) * LV + cw + 8 * nt + gr];
            uint32_t vh0, vl0, vh1, vl1;
            split_bf16x2(vh0, vl0, vc[0], vc[LV]);
            split_bf16x2(vh1, vl1, vc[8 * LV], vc[9 * LV]);
            mma_16816<bf16>(aw[nt], tw_hi, kb[nt][0], kb[nt][1]);
            mma_16816<bf16>(aw[nt], tw_lo, kb[nt][0], kb[nt][1]);
            mma_16816<bf16>(au[nt], tu_lo, vh0, vh1);
            mma_16816<bf16>(au[nt], tu_hi, vl0, vl1);
            mma_16816<bf16>(au[nt], tu_hi, vh0, vh1);
          }
        } else {
          // bf16 V: the B fragments as K's (vl = 0, so tu_hi x vl adds nothing).
          uint32_t vb[NT][2];
          b_frags(s.v, LV, vb);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            mma_16816<bf16>(aw[nt], tw_hi, kb[nt][0], kb[nt][1]);
            mma_16816<bf16>(aw[nt], tw_lo, kb[nt][0], kb[nt][1]);
            mma_16816<bf16>(au[nt], tu_lo, vb[nt][0], vb[nt][1]);
            mma_16816<bf16>(au[nt], tu_hi, vb[nt][0], vb[nt][1]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int t = acc_row(16 * mt, 0), c = acc_col(cw + 8 * nt, 0);
        store_bf16x2(&W[wq_elem(t, c)], aw[nt][0], aw[nt][1]);
        store_bf16x2(&W[wq_elem(t + 8, c)], aw[nt][2], aw[nt][3]);
        // U^T: per register, the warp's lanes fill 8 tokens (one 32-byte piece) of 4 rows.
        U[ut_elem(c, t)] = au[nt][0];
        U[ut_elem(c + 1, t)] = au[nt][1];
        U[ut_elem(c, t + 8)] = au[nt][2];
        U[ut_elem(c + 1, t + 8)] = au[nt][3];
      }
    }
  }
}

template <int DK, int DV, bool KDA, typename Y>
cudaError_t run_prep(const DeltaParams& p, const Layout& L, char* ws, cudaStream_t stream) {
  auto prep = KDA ? kda_prep_kernel<DK, DV, Y> : gdn_prep_kernel<DK, DV, Y>;
  constexpr int prep_smem = KDA ? sizeof(KdaPrepSmem<DK, DV>) : sizeof(GdnPrepSmem<DK, DV, Y>);
  const cudaError_t err =
      cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, prep_smem);
  if (err != cudaSuccess) return err;
  const int hv = p.state.heads;
  if constexpr (KDA) {
    prep<<<dim3(static_cast<unsigned>(L.bound), hv), kThreads, prep_smem, stream>>>(p, L, ws);
  } else {
    if (L.bound * hv > INT32_MAX) return cudaErrorInvalidValue;
    prep<<<static_cast<unsigned>(L.bound * hv), kThreads, prep_smem, stream>>>(p, L, ws);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_prep(const DeltaParams& p, const Layout& L, char* ws, cudaStream_t stream) {
  return with_f32_or_bf16(p.y_dtype, cudaErrorInvalidValue, [&](auto y) {
    using Y = typename decltype(y)::type;
    if (p.state.cols == 64) {
      return p.kda ? run_prep<64, 64, true, Y>(p, L, ws, stream)
                   : run_prep<64, 64, false, Y>(p, L, ws, stream);
    }
    return p.kda ? run_prep<128, 128, true, Y>(p, L, ws, stream)
                 : run_prep<128, 128, false, Y>(p, L, ws, stream);
  });
}

}  // namespace attnrt::cuda::linear::delta
