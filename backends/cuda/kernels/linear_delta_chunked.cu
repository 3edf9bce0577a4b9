// The chunked (WY / UT) form of the delta rule for extend steps (reference-semantics §8.9.1 GDN,
// §8.9.2 KDA), the launcher declared in linear.h. Per chunk of 64 tokens of one request and one
// value head, with G_t = the cumulative log decay inside the chunk (per key channel for kda):
//   kk[t][i] = sum_c k_t[c] k_i[c] e^{G_t[c] - G_i[c]}   (i < t),   qk likewise with q_t (i <= t)
//   (I + diag(beta) kk) X = diag(beta) [e^G (.) K | V]   ->   W = X[:, :Dk], U = X[:, Dk:]
//   per chunk, in order:  u = U - W S^T
//                         o = (e^G (.) Q) S^T + qk u
//                         S = S (.) e^{G_last} + u^T (e^{G_last - G} (.) K)
// (S is the slot's [Dv, Dk] state.) Three kernels:
//   1. chunk table: where each request's chunks sit in the workspace (one block, a scan);
//   2. prep, one CTA per (chunk, head), everything that does not depend on the state: the
//      normalised q / k, the gates, kk and qk (tensor cores), the forward substitution (fp32, one
//      column of X per thread, 16 rows at a time in registers), and the state pass's operands in
//      bf16. GDN and KDA have separate prep kernels: GDN's gate is one scalar per token, so its
//      decays are four 64-entry tables, q / k live only as bf16 operands and two CTAs fit an SM;
//      KDA keeps q / k / G per channel in fp32 (~195 KB, one CTA per SM);
//   3. state pass, one CTA per (request, head, 64 value rows of S): S stays in fp32 registers
//      (as MMA accumulators) across the request's chunks, the chunk operands stream in through a
//      cp.async double buffer, and the outputs are written there (no per-chunk states stored).
// KDA's pairwise decay ratios are never formed as e^{G_t} e^{-G_i} over a whole chunk: the
// off-diagonal 16-token blocks factor through the first token r of the row block
// (e^{G_t - G_r} and e^{G_r - G_i}, both <= 1), and the diagonal blocks take the ratio per pair.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attnrt/core/dtype.h"
#include "backends/cuda/kernels/linear.h"
#include "backends/cuda/kernels/primitives.cuh"

namespace attnrt::cuda::linear {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kChunk = 64;      // tokens per chunk (the only chunk size supported)
constexpr int kThreads = 256;   // prep and state pass
constexpr int kVTile = 64;      // value rows of S per state-pass CTA
constexpr int kTableThreads = 1024;
constexpr DTypeCode kF32 = static_cast<DTypeCode>(DType::f32);
constexpr DTypeCode kF16 = static_cast<DTypeCode>(DType::f16);
constexpr DTypeCode kBF16 = static_cast<DTypeCode>(DType::bf16);

// Workspace: the chunk table, then one unit of chunk operands per (chunk slot, value head).
struct Layout {
  int64_t bound = 0;  // chunk slots: num_tokens / 64 + num_reqs >= sum of ceil(tokens / 64)
  int64_t coff_off = 0, table_off = 0, units_off = 0, total = 0;
  // Inside a unit (bytes): W, Qd [64, Dk] bf16; KlT [Dk, 64] bf16; Mqk [64, 64] bf16;
  // U [64, Dv] fp32; el [Dk] fp32.
  int64_t w_off = 0, qd_off = 0, klt_off = 0, m_off = 0, u_off = 0, el_off = 0, unit_bytes = 0;
};

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

Layout make_layout(int num_reqs, int64_t num_tokens, int dk, int dv, int heads) {
  Layout L;
  L.bound = num_tokens / kChunk + num_reqs;
  L.coff_off = 0;
  L.table_off = align_up(static_cast<int64_t>(num_reqs + 1) * 4, 256);
  L.units_off = align_up(L.table_off + L.bound * 4, 256);
  L.w_off = 0;
  L.qd_off = L.w_off + int64_t{kChunk} * dk * 2;
  L.klt_off = L.qd_off + int64_t{kChunk} * dk * 2;
  L.m_off = L.klt_off + int64_t{kChunk} * dk * 2;
  L.u_off = L.m_off + int64_t{kChunk} * kChunk * 2;
  L.el_off = L.u_off + int64_t{kChunk} * dv * 4;
  L.unit_bytes = align_up(L.el_off + int64_t{dk} * 4, 128);
  L.total = L.units_off + L.bound * heads * L.unit_bytes;
  return L;
}

__device__ __forceinline__ float load_elem(const void* p, DTypeCode t, int64_t i) {
  if (t == kBF16) return __bfloat162float(static_cast<const bf16*>(p)[i]);
  if (t == kF16) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_elem(void* p, DTypeCode t, int64_t i, float x) {
  if (t == kBF16) {
    static_cast<bf16*>(p)[i] = __float2bfloat16_rn(x);
  } else if (t == kF16) {
    static_cast<__half*>(p)[i] = __float2half_rn(x);
  } else {
    static_cast<float*>(p)[i] = x;
  }
}

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ int chunks_of(int32_t tokens) {
  return tokens > 0 ? (tokens + kChunk - 1) / kChunk : 0;
}

// MMA operands from shared memory, both stored with the reduction index contiguous: A [m][k]
// (row stride `ld` elements) and B as [n][k]. Rows padded by 8 elements make the 32-bit loads of
// a fragment hit 32 different banks.
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const bf16* s, int ld, int m0, int k0) {
  const int g = (threadIdx.x & 31) >> 2, c = k0 + 2 * (threadIdx.x & 3);
  a[0] = *reinterpret_cast<const uint32_t*>(s + (m0 + g) * ld + c);
  a[1] = *reinterpret_cast<const uint32_t*>(s + (m0 + g + 8) * ld + c);
  a[2] = *reinterpret_cast<const uint32_t*>(s + (m0 + g) * ld + c + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(s + (m0 + g + 8) * ld + c + 8);
}
__device__ __forceinline__ void frag_b(uint32_t& b0, uint32_t& b1, const bf16* s, int ld, int n0,
                                       int k0) {
  const int g = (threadIdx.x & 31) >> 2, c = k0 + 2 * (threadIdx.x & 3);
  b0 = *reinterpret_cast<const uint32_t*>(s + (n0 + g) * ld + c);
  b1 = *reinterpret_cast<const uint32_t*>(s + (n0 + g) * ld + c + 8);
}
// Row / column of accumulator element e (0..3) of a 16x8 tile at (m0, n0).
__device__ __forceinline__ int acc_row(int m0, int e) {
  return m0 + ((threadIdx.x & 31) >> 2) + (e >= 2 ? 8 : 0);
}
__device__ __forceinline__ int acc_col(int n0, int e) {
  return n0 + 2 * (threadIdx.x & 3) + (e & 1);
}
__device__ __forceinline__ void store_bf16x2(bf16* dst, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(dst) = pack2<bf16>(lo, hi);
}

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

// ---- 2. prep ----------------------------------------------------------------------------------

// Row `row` of q and k, L2-normalised (q times the scale), channels lane + 32 m; zero past the
// request (valid = false).
template <int DK>
__device__ __forceinline__ void normalised_row(const DeltaParams& p, const float* yq,
                                               const float* yk, int64_t row, bool valid,
                                               float (&qv)[DK / 32], float (&kv)[DK / 32]) {
  const int64_t base = row * p.state.conv_dim + (threadIdx.x & 31);
  float sq = 0.f, sk = 0.f;
#pragma unroll
  for (int m = 0; m < DK / 32; ++m) {
    qv[m] = valid ? yq[base + 32 * m] : 0.f;
    kv[m] = valid ? yk[base + 32 * m] : 0.f;
    sq += qv[m] * qv[m];
    sk += kv[m] * kv[m];
  }
  const float fq = p.scale * rsqrtf(warp_sum(sq) + 1e-6f), fk = rsqrtf(warp_sum(sk) + 1e-6f);
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

template <int DK, int DV>
__global__ void __launch_bounds__(kThreads, 1)
    kda_prep_kernel(const DeltaParams p, const Layout L, char* __restrict__ ws) {
  using Sm = KdaPrepSmem<DK, DV>;
  constexpr int LF = Sm::LF, LC = Sm::LC, LQ = Sm::LQ, LB = Sm::LB, LX = Sm::LX;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Sm& s = *reinterpret_cast<Sm*>(smem_raw);
  const int32_t* coff = reinterpret_cast<const int32_t*>(ws + L.coff_off);
  const int32_t* table = reinterpret_cast<const int32_t*>(ws + L.table_off);
  const int slot = blockIdx.x, h = blockIdx.y;
  const int r = table[slot];
  if (r < 0) return;
  const LinReq req = p.step.reqs[r];
  const int j = slot - coff[r];
  const int n = min(kChunk, req.tokens - j * kChunk);
  const int64_t tok0 = req.token_start + static_cast<int64_t>(j) * kChunk;
  const int hv = p.state.heads, hk = p.key_heads;
  const int kh = h / (hv / hk);
  const int64_t ldy = p.state.conv_dim;
  const float* yq = p.y + static_cast<int64_t>(kh) * DK;
  const float* yk = p.y + static_cast<int64_t>(hk + kh) * DK;
  const float* yv = p.y + static_cast<int64_t>(2 * hk) * DK + static_cast<int64_t>(h) * DV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kWarps = kThreads / 32;
  auto G = [&](int t, int c) -> float { return s.g[t * LF + c]; };

  // q, k, L2-normalised; tokens past the request are zero (and get beta = 0, g = 0 below, so
  // that they change nothing).
  for (int t = warp; t < kChunk; t += kWarps) {
    float qv[DK / 32], kv[DK / 32];
    normalised_row<DK>(p, yq, yk, tok0 + t, t < n, qv, kv);
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

  char* unit = ws + L.units_off + (static_cast<int64_t>(slot) * hv + h) * L.unit_bytes;
  bf16* W = reinterpret_cast<bf16*>(unit + L.w_off);
  bf16* Qd = reinterpret_cast<bf16*>(unit + L.qd_off);
  bf16* KlT = reinterpret_cast<bf16*>(unit + L.klt_off);
  bf16* Mqk = reinterpret_cast<bf16*>(unit + L.m_off);
  float* U = reinterpret_cast<float*>(unit + L.u_off);
  float* el = reinterpret_cast<float*>(unit + L.el_off);

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
          x[tl] = t < n ? s.beta[t] * yv[(tok0 + t) * ldy + col - DK] : 0.f;
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
      for (int tl = 0; tl < 16; ++tl) {
        const int t = t0 + tl;
        s.x[t * LX + col] = x[tl];
        if (col < DK) {
          W[t * DK + col] = __float2bfloat16_rn(x[tl]);
        } else {
          U[t * DV + col - DK] = x[tl];
        }
      }
    }
  }
  // The state pass's other operands.
  for (int e = threadIdx.x; e < kChunk * DK / 2; e += kThreads) {
    const int t = e / (DK / 2), c = 2 * (e % (DK / 2));
    store_bf16x2(&Qd[t * DK + c], expf(G(t, c)) * s.q[t * LF + c],
                 expf(G(t, c + 1)) * s.q[t * LF + c + 1]);
  }
  for (int e = threadIdx.x; e < DK * kChunk / 2; e += kThreads) {
    const int c = e / (kChunk / 2), i = 2 * (e % (kChunk / 2));
    const float gl = G(kChunk - 1, c);
    store_bf16x2(&KlT[c * kChunk + i], expf(gl - G(i, c)) * s.k[i * LF + c],
                 expf(gl - G(i + 1, c)) * s.k[(i + 1) * LF + c]);
  }
  for (int e = threadIdx.x; e < kChunk * kChunk / 2; e += kThreads) {
    const int t = e / (kChunk / 2), i = 2 * (e % (kChunk / 2));
    store_bf16x2(&Mqk[t * kChunk + i], i <= t ? s.qk[t * LQ + i] : 0.f,
                 i + 1 <= t ? s.qk[t * LQ + i + 1] : 0.f);
  }
  for (int c = threadIdx.x; c < DK; c += kThreads) el[c] = expf(G(kChunk - 1, c));
}

// GDN: the gate is one scalar per token, so every decay factor comes from four tables of 64
// numbers (no per-element exponentials), q and k are kept only as the bf16 MMA operands, qk goes
// from the MMA accumulators straight to the workspace, and the substitution keeps only rows 0..47
// in shared memory: ~102 KB for DK = DV = 128, two CTAs per SM.
template <int DK, int DV>
struct GdnPrepSmem {
  static constexpr int LB = DK + 8;      // bf16 MMA operand rows
  static constexpr int LC = kChunk + 4;  // kk^T rows: 16-byte aligned for float4 broadcasts
  bf16 q[kChunk * LB], k[kChunk * LB];   // normalised (q scaled)
  float kk[kChunk * LC];  // kk[i][t] = beta_t e^{g_t - g_i} k_t . k_i for i < t, else 0
  float x[(kChunk - 16) * (DK + DV)];  // the substitution's finished rows 0..47
  float g[kChunk];                     // cumulative log decay
  float beta[kChunk];
  float eg[kChunk];   // e^{g_t}
  float egl[kChunk];  // e^{g_last - g_t}
};

template <int DK, int DV>
__global__ void __launch_bounds__(kThreads, 2)
    gdn_prep_kernel(const DeltaParams p, const Layout L, char* __restrict__ ws) {
  using Sm = GdnPrepSmem<DK, DV>;
  constexpr int LB = Sm::LB, LC = Sm::LC;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Sm& s = *reinterpret_cast<Sm*>(smem_raw);
  const int32_t* coff = reinterpret_cast<const int32_t*>(ws + L.coff_off);
  const int32_t* table = reinterpret_cast<const int32_t*>(ws + L.table_off);
  const int slot = blockIdx.x, h = blockIdx.y;
  const int r = table[slot];
  if (r < 0) return;
  const LinReq req = p.step.reqs[r];
  const int j = slot - coff[r];
  const int n = min(kChunk, req.tokens - j * kChunk);
  const int64_t tok0 = req.token_start + static_cast<int64_t>(j) * kChunk;
  const int hv = p.state.heads, hk = p.key_heads;
  const int kh = h / (hv / hk);
  const int64_t ldy = p.state.conv_dim;
  const float* yq = p.y + static_cast<int64_t>(kh) * DK;
  const float* yk = p.y + static_cast<int64_t>(hk + kh) * DK;
  const float* yv = p.y + static_cast<int64_t>(2 * hk) * DK + static_cast<int64_t>(h) * DV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kWarps = kThreads / 32;

  // q, k, L2-normalised, two rows per warp at a time; tokens past the request are zero (and get
  // beta = 0 and the last token's g below, so that they change nothing).
#pragma unroll 2
  for (int t = warp; t < kChunk; t += kWarps) {
    float qv[DK / 32], kv[DK / 32];
    normalised_row<DK>(p, yq, yk, tok0 + t, t < n, qv, kv);
#pragma unroll
    for (int m = 0; m < DK / 32; ++m) {
      s.q[t * LB + lane + 32 * m] = __float2bfloat16_rn(qv[m]);
      s.k[t * LB + lane + 32 * m] = __float2bfloat16_rn(kv[m]);
    }
  }
  if (threadIdx.x < kChunk) {
    const int t = threadIdx.x;
    const float b = t < n ? load_elem(p.b, p.b_dtype, (tok0 + t) * p.b_stride + h) : 0.f;
    s.beta[t] = t < n ? 1.f / (1.f + expf(-b)) : 0.f;
  }
  if (warp == kWarps - 1) {  // inclusive scan of 64 scalars: two per lane
    const float decay_rate = -expf(p.A_log[h]), bias = p.dt_bias[h];
    float g0 = 0.f, g1 = 0.f;
    if (lane < n)
      g0 = decay_rate * softplus(load_elem(p.a, p.a_dtype, (tok0 + lane) * p.a_stride + h) + bias);
    if (lane + 32 < n)
      g1 = decay_rate *
           softplus(load_elem(p.a, p.a_dtype, (tok0 + lane + 32) * p.a_stride + h) + bias);
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
    s.g[lane] = g0;
    s.g[lane + 32] = g1;
    s.eg[lane] = expf(g0);
    s.eg[lane + 32] = expf(g1);
    s.egl[lane] = expf(gl - g0);
    s.egl[lane + 32] = expf(gl - g1);
  }
  __syncthreads();

  char* unit = ws + L.units_off + (static_cast<int64_t>(slot) * hv + h) * L.unit_bytes;
  bf16* W = reinterpret_cast<bf16*>(unit + L.w_off);
  bf16* Qd = reinterpret_cast<bf16*>(unit + L.qd_off);
  bf16* KlT = reinterpret_cast<bf16*>(unit + L.klt_off);
  bf16* Mqk = reinterpret_cast<bf16*>(unit + L.m_off);
  float* U = reinterpret_cast<float*>(unit + L.u_off);
  float* el = reinterpret_cast<float*>(unit + L.el_off);

  // kk (strictly lower, times beta, transposed) to shared memory; qk (lower, zero above) to Mqk.
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
      float d[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = acc_row(m0, e), i = acc_col(n0 + 8 * nt, e);
        d[e] = i <= t ? expf(s.g[t] - s.g[i]) : 0.f;
        s.kk[i * LC + t] = i < t ? s.beta[t] * akk[nt][e] * d[e] : 0.f;
      }
      const int t = acc_row(m0, 0), i = acc_col(n0 + 8 * nt, 0);
      store_bf16x2(&Mqk[t * kChunk + i], aqk[nt][0] * d[0], aqk[nt][1] * d[1]);
      store_bf16x2(&Mqk[(t + 8) * kChunk + i], aqk[nt][2] * d[2], aqk[nt][3] * d[3]);
    }
  }
  // The state pass's operands that do not need X: Qd = e^G (.) Q, KlT = (e^{G_last - G} (.) K)^T
  // (2 x 2 blocks per thread; eight lanes cover 16 tokens of one channel pair), el = e^{G_last}.
  for (int e = threadIdx.x; e < kChunk * DK / 2; e += kThreads) {
    const int t = e / (DK / 2), c = 2 * (e % (DK / 2));
    const float2 qv =
        __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&s.q[t * LB + c]));
    store_bf16x2(&Qd[t * DK + c], s.eg[t] * qv.x, s.eg[t] * qv.y);
  }
  for (int e = threadIdx.x; e < kChunk * DK / 4; e += kThreads) {
    const int i = 2 * ((e & 7) + 8 * ((e >> 5) % (kChunk / 16)));
    const int c = 2 * (((e >> 3) & 3) + 4 * ((e >> 5) / (kChunk / 16)));
    const float2 k0 =
        __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&s.k[i * LB + c]));
    const float2 k1 =
        __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&s.k[(i + 1) * LB + c]));
    store_bf16x2(&KlT[c * kChunk + i], s.egl[i] * k0.x, s.egl[i + 1] * k1.x);
    store_bf16x2(&KlT[(c + 1) * kChunk + i], s.egl[i] * k0.y, s.egl[i + 1] * k1.y);
  }
  for (int c = threadIdx.x; c < DK; c += kThreads) el[c] = s.eg[kChunk - 1];
  __syncthreads();  // kk is in

  // Forward substitution as in the KDA prep: X_t = beta_t X0_t - sum_{i<t} (beta_t kk[t][i]) X_i,
  // one column per thread, 16 rows at a time in registers; the finished rows of earlier blocks are
  // read back from shared memory (each thread its own column, so no barrier), kk^T as float4
  // broadcasts.
  constexpr int LX = DK + DV;
  for (int col = threadIdx.x; col < DK + DV; col += kThreads) {
#pragma unroll 1
    for (int blk = 0; blk < kChunk / 16; ++blk) {
      const int t0 = 16 * blk;
      float x[16];
      if (col < DK) {
#pragma unroll
        for (int tl = 0; tl < 16; ++tl) {
          const int t = t0 + tl;
          x[tl] = s.beta[t] * s.eg[t] * __bfloat162float(s.k[t * LB + col]);
        }
      } else {
#pragma unroll
        for (int tl = 0; tl < 16; ++tl) {
          const int t = t0 + tl;
          x[tl] = t < n ? s.beta[t] * yv[(tok0 + t) * ldy + col - DK] : 0.f;
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
      for (int tl = 0; tl < 16; ++tl) {
        const int t = t0 + tl;
        if (t < kChunk - 16) s.x[t * LX + col] = x[tl];
        if (col < DK) {
          W[t * DK + col] = __float2bfloat16_rn(x[tl]);
        } else {
          U[t * DV + col - DK] = x[tl];
        }
      }
    }
  }
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

template <int DK, int DV, bool KDA>
cudaError_t run_chunked(const DeltaParams& p, const Layout& L, char* ws, cudaStream_t stream) {
  auto prep = KDA ? kda_prep_kernel<DK, DV> : gdn_prep_kernel<DK, DV>;
  auto pass = delta_pass_kernel<DK, DV>;
  constexpr int prep_smem = KDA ? sizeof(KdaPrepSmem<DK, DV>) : sizeof(GdnPrepSmem<DK, DV>);
  constexpr int pass_smem = sizeof(PassSmem<DK>);
  cudaError_t err =
      cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, prep_smem);
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(pass, cudaFuncAttributeMaxDynamicSharedMemorySize, pass_smem);
  if (err != cudaSuccess) return err;
  const int hv = p.state.heads;
  prep<<<dim3(static_cast<unsigned>(L.bound), hv), kThreads, prep_smem, stream>>>(p, L, ws);
  pass<<<dim3(p.step.num_reqs * (DV / kVTile), hv), kThreads, pass_smem, stream>>>(p, L, ws);
  return cudaGetLastError();
}

bool valid_dtype(DTypeCode t) { return t == kF32 || t == kF16 || t == kBF16; }

}  // namespace

size_t delta_chunked_workspace(const DeltaParams& p, int64_t num_tokens, int chunk) {
  if (chunk != kChunk || num_tokens < 0 || p.step.num_reqs < 0) return 0;
  return static_cast<size_t>(
      make_layout(p.step.num_reqs, num_tokens, p.state.cols, p.state.rows, p.state.heads).total);
}

// Supported: chunk 64, non-verify steps, (Dk, Dv) = (64, 64) or (128, 128), state fp32 / bf16,
// activations fp32 / bf16 / fp16; anything else returns cudaErrorInvalidValue without launching.
cudaError_t launch_delta_chunked(const DeltaParams& p, int64_t num_tokens, int chunk,
                                 void* workspace, cudaStream_t stream) {
  const int dk = p.state.cols, dv = p.state.rows, hv = p.state.heads, hk = p.key_heads;
  if (chunk != kChunk || p.step.verify != 0) return cudaErrorInvalidValue;
  if (!((dk == 64 && dv == 64) || (dk == 128 && dv == 128))) return cudaErrorInvalidValue;
  if (hk <= 0 || hv <= 0 || hv % hk != 0) return cudaErrorInvalidValue;
  if (p.state.conv_dim != 2 * hk * dk + hv * dv) return cudaErrorInvalidValue;
  if (!(p.state.ssm_dtype == kF32 || p.state.ssm_dtype == kBF16)) return cudaErrorInvalidValue;
  if (!valid_dtype(p.a_dtype) || !valid_dtype(p.b_dtype) || !valid_dtype(p.out_dtype))
    return cudaErrorInvalidValue;
  if (p.step.num_reqs <= 0 || num_tokens <= 0) return cudaSuccess;
  if (workspace == nullptr) return cudaErrorInvalidValue;
  const Layout L = make_layout(p.step.num_reqs, num_tokens, dk, dv, hv);
  char* ws = static_cast<char*>(workspace);
  chunk_table_kernel<<<1, kTableThreads, 0, stream>>>(
      p.step.reqs, p.step.num_reqs, L.bound, reinterpret_cast<int32_t*>(ws + L.coff_off),
      reinterpret_cast<int32_t*>(ws + L.table_off));
  if (dk == 64) {
    return p.kda ? run_chunked<64, 64, true>(p, L, ws, stream)
                 : run_chunked<64, 64, false>(p, L, ws, stream);
  }
  return p.kda ? run_chunked<128, 128, true>(p, L, ws, stream)
               : run_chunked<128, 128, false>(p, L, ws, stream);
}

}  // namespace attnrt::cuda::linear
