// The token-by-token recurrences of the linear-attention layers: the delta rule (GDN, KDA; §8.9.1,
// §8.9.2) and Mamba2's SSD (§8.9.3), for DECODE, TARGET_VERIFY (chain and tree) and sequential
// extend.
//
// Work split (decode is a pure stream of the state: read once, written once): the update of one
// row of a head's state needs only that row and per-token vectors, so a CTA takes a block of rows
// of one (request, head). A group of L lanes owns a row: lane li holds the E contiguous elements at
// columns (j * L + li) * E, j < J, so that each access is one coalesced vector of E * sizeof(S)
// bytes; a thread owns RT rows, all kept in registers across the request's tokens. Row sums (S k,
// S q, S C) are shuffle reductions inside the group; the L2 norms of q and k are recomputed by
// every group from the same loads (no shared memory, no block barrier).
//   delta row v of S^T:  s <- decay * s;  a1 = s.k, a2 = s.q;  u = beta (v_v - a1);  s += u k;
//                        o_v = a2 + u (k.q)      (= (decayed S + k u^T)^T q)
//   ssd row p:           s <- dA s + dt x_p B;  o_p = s.C + D x_p
// Verify: after each block token the state goes to its checkpoint (rounded to the state dtype, as
// a reload would give); a token whose parent is not the previous token reloads the parent's
// checkpoint, which the same thread stored, so no synchronisation is needed.
#include <cstdint>

#include "backends/cuda/kernels/linear.h"
#include "backends/cuda/kernels/linear_common.cuh"

namespace attnrt::cuda::linear {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

template <int L>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = L / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <typename S, int L, int E, int J, int RT, bool SSD>
struct Kernel {
  static constexpr int kGroupsPerWarp = 32 / L;
  static constexpr int kRowsPerCta = kWarps * kGroupsPerWarp * RT;
};

// One (request, head, row block). P is DeltaParams or SsdParams.
template <typename S, int L, int E, int J, int RT, bool SSD, typename P>
__global__ void __launch_bounds__(kThreads) recurrent_kernel(const P p, int row_blocks) {
  constexpr int kRowsPerCta = Kernel<S, L, E, J, RT, SSD>::kRowsPerCta;
  const int heads = p.state.heads, rows = p.state.rows, cols = p.state.cols;
  const int64_t bid = blockIdx.x;
  const int rb = static_cast<int>(bid % row_blocks);
  const int h = static_cast<int>((bid / row_blocks) % heads);
  const int i = static_cast<int>(bid / (int64_t{row_blocks} * heads));
  const LinReq r = p.step.reqs[i];
  if (r.tokens == 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int li = lane % L;
  const int row0 = rb * kRowsPerCta + (warp * (32 / L) + lane / L) * RT;
  const int64_t per_head = int64_t{rows} * cols;
  const int64_t head_base = int64_t{h} * per_head;
  const int64_t per_slot = int64_t{heads} * per_head;

  bool row_ok[RT], col_ok[J];
#pragma unroll
  for (int rr = 0; rr < RT; ++rr) row_ok[rr] = row0 + rr < rows;
#pragma unroll
  for (int j = 0; j < J; ++j) col_ok[j] = (j * L + li) * E < cols;
  auto elem = [&](int rr, int j) {
    return head_base + int64_t{row0 + rr} * cols + (j * L + li) * E;
  };

  float s[RT][J][E];
  // The state before the request's first token (or a verify root): the slot's, or zeros.
  auto load_from = [&](const S* base) {
#pragma unroll
    for (int rr = 0; rr < RT; ++rr) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (base != nullptr && row_ok[rr] && col_ok[j]) {
          load_vec<S, E>(base + elem(rr, j), s[rr][j]);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) s[rr][j][e] = 0.f;
        }
      }
    }
  };
  auto store_to = [&](S* base) {
#pragma unroll
    for (int rr = 0; rr < RT; ++rr) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (row_ok[rr] && col_ok[j]) store_vec<S, E>(base + elem(rr, j), s[rr][j]);
      }
    }
  };
  const S* slot_state =
      r.has_initial_state ? static_cast<const S*>(p.state.ssm) + r.slot * per_slot : nullptr;
  load_from(slot_state);

  const int N = p.step.draft_tokens;
  const int32_t* parents = p.step.verify ? p.step.parents + int64_t{i} * N : nullptr;
  S* inter = p.step.verify ? static_cast<S*>(p.state.inter_ssm) : nullptr;
  const float A = -expf(p.A_log[h]);

  for (int t = 0; t < r.tokens; ++t) {
    if (p.step.verify && t > 0) {
      const int parent = parents[t];
      if (parent < 0) {
        load_from(slot_state);
      } else if (parent != t - 1) {
        load_from(inter + (int64_t{i} * N + parent) * per_slot);
      }
    }
    const int64_t tok = int64_t{r.token_start} + t;
    const float* y = p.y + tok * p.state.conv_dim;
    float out_val[RT];
    if constexpr (SSD) {
      // x | B | C; head h reads B and C of group h / (heads / groups).
      const int grp = h / (heads / p.groups);
      const float* Bv = y + int64_t{heads} * rows + int64_t{grp} * cols;
      const float* Cv = Bv + int64_t{p.groups} * cols;
      const float dt = softplus(load_elem(p.a, p.a_dtype, tok * p.a_stride + h) + p.dt_bias[h]);
      const float dA = expf(dt * A);
      float Bk[J][E], Ck[J][E];
#pragma unroll
      for (int j = 0; j < J; ++j) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int k = (j * L + li) * E + e;
          Bk[j][e] = col_ok[j] ? Bv[k] : 0.f;
          Ck[j][e] = col_ok[j] ? Cv[k] : 0.f;
        }
      }
      const float Dh = p.D[h];
#pragma unroll
      for (int rr = 0; rr < RT; ++rr) {
        const float xp = row_ok[rr] ? y[int64_t{h} * rows + row0 + rr] : 0.f;
        const float dx = dt * xp;
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < J; ++j) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            s[rr][j][e] = dA * s[rr][j][e] + dx * Bk[j][e];
            acc += s[rr][j][e] * Ck[j][e];
          }
        }
        out_val[rr] = group_sum<L>(acc) + Dh * xp;
      }
    } else {
      const int kh = h / (heads / p.key_heads);
      const float* qv = y + int64_t{kh} * cols;
      const float* kv = y + int64_t{p.key_heads} * cols + int64_t{kh} * cols;
      const float* vv = y + 2 * int64_t{p.key_heads} * cols + int64_t{h} * rows;
      float q[J][E], k[J][E];
      float qq = 0.f, kk = 0.f, kq = 0.f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int c = (j * L + li) * E + e;
          q[j][e] = col_ok[j] ? qv[c] : 0.f;
          k[j][e] = col_ok[j] ? kv[c] : 0.f;
          qq += q[j][e] * q[j][e];
          kk += k[j][e] * k[j][e];
          kq += k[j][e] * q[j][e];
        }
      }
      qq = group_sum<L>(qq);
      kk = group_sum<L>(kk);
      kq = group_sum<L>(kq);
      const float qn = p.scale / sqrtf(qq + 1e-6f), kn = 1.f / sqrtf(kk + 1e-6f);
#pragma unroll
      for (int j = 0; j < J; ++j) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          q[j][e] *= qn;
          k[j][e] *= kn;
        }
      }
      kq *= qn * kn;
      const float beta = sigmoid(load_elem(p.b, p.b_dtype, tok * p.b_stride + h));
      float decay[J][E];
      if (p.kda) {
#pragma unroll
        for (int j = 0; j < J; ++j) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const int c = (j * L + li) * E + e;
            decay[j][e] =
                col_ok[j] ? expf(A * softplus(load_elem(p.a, p.a_dtype,
                                                        tok * p.a_stride + int64_t{h} * cols + c) +
                                              p.dt_bias[int64_t{h} * cols + c]))
                          : 0.f;
          }
        }
      } else {
        const float d =
            expf(A * softplus(load_elem(p.a, p.a_dtype, tok * p.a_stride + h) + p.dt_bias[h]));
#pragma unroll
        for (int j = 0; j < J; ++j) {
#pragma unroll
          for (int e = 0; e < E; ++e) decay[j][e] = d;
        }
      }
#pragma unroll
      for (int rr = 0; rr < RT; ++rr) {
        float a1 = 0.f, a2 = 0.f;
#pragma unroll
        for (int j = 0; j < J; ++j) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            s[rr][j][e] *= decay[j][e];
            a1 += s[rr][j][e] * k[j][e];
            a2 += s[rr][j][e] * q[j][e];
          }
        }
        a1 = group_sum<L>(a1);
        a2 = group_sum<L>(a2);
        const float vr = row_ok[rr] ? vv[row0 + rr] : 0.f;
        const float u = beta * (vr - a1);
#pragma unroll
        for (int j = 0; j < J; ++j) {
#pragma unroll
          for (int e = 0; e < E; ++e) s[rr][j][e] += u * k[j][e];
        }
        out_val[rr] = a2 + u * kq;
      }
    }
    if (li == 0) {
#pragma unroll
      for (int rr = 0; rr < RT; ++rr) {
        if (row_ok[rr]) {
          store_elem(p.out, p.out_dtype, tok * p.out_stride + int64_t{h} * rows + row0 + rr,
                     out_val[rr]);
        }
      }
    }
    if (p.step.verify) {
      store_to(inter + (int64_t{i} * N + t) * per_slot);
      if constexpr (sizeof(S) < sizeof(float)) {
#pragma unroll
        for (int rr = 0; rr < RT; ++rr) {
#pragma unroll
          for (int j = 0; j < J; ++j) {
#pragma unroll
            for (int e = 0; e < E; ++e) s[rr][j][e] = round_as<S>(s[rr][j][e]);
          }
        }
      }
    }
  }
  if (!p.step.verify) store_to(static_cast<S*>(p.state.ssm) + r.slot * per_slot);
}

template <typename S, int L, int E, int J, int RT, bool SSD, typename P>
cudaError_t launch_variant(const P& p, cudaStream_t stream) {
  constexpr int kRows = Kernel<S, L, E, J, RT, SSD>::kRowsPerCta;
  const int row_blocks = (p.state.rows + kRows - 1) / kRows;
  const int64_t blocks = int64_t{row_blocks} * p.state.heads * p.step.num_reqs;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  recurrent_kernel<S, L, E, J, RT, SSD, P>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, row_blocks);
  return cudaGetLastError();
}

// The variants: 16-byte vectors over 128 columns (the real models' Dk and d_state) for fp32 and
// bf16 states, and one element per lane for any other width up to 256.
template <bool SSD, typename P>
cudaError_t dispatch(const P& p, cudaStream_t stream) {
  if (p.step.num_reqs == 0 || p.step.max_tokens == 0) return cudaSuccess;
  const int cols = p.state.cols;
  if (cols < 1 || cols > 256 || p.state.rows < 1 || p.state.heads < 1) return cudaErrorInvalidValue;
  const bool wide = cols > 64 && cols <= 128 && cols % 8 == 0;
  if (p.state.ssm_dtype == kF32) {
    if (wide) return launch_variant<float, 32, 4, 1, 4, SSD>(p, stream);
    return launch_variant<float, 32, 1, 8, 2, SSD>(p, stream);
  }
  if (p.state.ssm_dtype == kBF16) {
    if (wide) return launch_variant<__nv_bfloat16, 16, 8, 1, 4, SSD>(p, stream);
    return launch_variant<__nv_bfloat16, 32, 1, 8, 2, SSD>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_delta_recurrent(const DeltaParams& p, cudaStream_t stream) {
  if (p.key_heads < 1 || p.state.heads % p.key_heads != 0) return cudaErrorInvalidValue;
  return dispatch<false>(p, stream);
}

cudaError_t launch_ssd_recurrent(const SsdParams& p, cudaStream_t stream) {
  if (p.groups < 1 || p.state.heads % p.groups != 0) return cudaErrorInvalidValue;
  return dispatch<true>(p, stream);
}

}  // namespace attnrt::cuda::linear
