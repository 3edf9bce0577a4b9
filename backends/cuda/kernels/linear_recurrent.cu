// The token-by-token recurrences of the linear-attention layers: the delta rule (GDN, KDA; §8.9.1,
// §8.9.2) and Mamba2's SSD (§8.9.3), for DECODE, TARGET_VERIFY (chain and tree) and sequential
// extend.
//
// Work split (decode is a pure stream of the state: read once, written once): the update of one
// row of a head's state needs only that row and per-token vectors, so the work comes in blocks of
// rows of one (request, head). A group of L lanes owns a row: lane li holds the E contiguous
// elements at columns (j * L + li) * E, j < J, so that each access is one coalesced vector of
// E * sizeof(S) bytes; a thread owns RT rows. Row sums (S k, S q, S C) are shuffle reductions
// inside the group; the L2 norms of q and k are recomputed by every group from the same loads (no
// shared memory, no block barrier). The arithmetic of one token is token_update, shared by both
// kernels below:
//   delta row v of S^T:  s <- decay * s;  a1 = s.k, a2 = s.q;  u = beta (v_v - a1);  s += u k;
//                        o_v = a2 + u (k.q)      (= (decayed S + k u^T)^T q)
//   ssd row p:           s <- dA s + dt x_p B;  o_p = s.C + D x_p
// Two kernels:
// - recurrent_kernel (verify, extend, any shape): one CTA per (request, head, row block), the
//   state in registers across the request's tokens. Verify: after each block token the state goes
//   to its checkpoint (rounded to the state dtype, as a reload would give); a token whose parent is
//   not the previous token reloads the parent's checkpoint, which the same thread stored, so no
//   synchronisation is needed.
// - decode_kernel (DECODE steps on 128-column states): a persistent grid that streams the state
//   through a ring of shared-memory stages with bulk copies, the loads of the next items in flight
//   while the CTA updates and stores the current one (comment above it). recurrent_kernel on the
//   same steps (one 8 KB CTA per row block) reached 60-75% of a copy of the same bytes.
// Both read the conv outputs y as Y (float or bf16, linear.h's y_dtype, a template parameter
// dispatched once per launch) and convert them to fp32 on load.
#include <algorithm>
#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/linear.h"

namespace attnrt::cuda::linear {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

template <typename S, int L, int E, int J, int RT, bool SSD>
struct Kernel {
  static constexpr int kGroupsPerWarp = 32 / L;
  static constexpr int kRowsPerCta = kWarps * kGroupsPerWarp * RT;
};

// Where a thread's rows and columns of one (request, head) sit: rows row0 .. row0 + RT - 1 (those
// with row_ok), columns (j * L + li) * E + e for the j with col_ok.
template <int J, int RT>
struct Lanes {
  int h, row0, li;
  bool row_ok[RT], col_ok[J];
};

// One token's inputs to one thread's rows, as read from memory (the arithmetic is in
// token_update): loaded apart so that the decode kernel can issue them an item ahead.
template <int E, int J, int RT, bool SSD>
struct TokenIn;

template <int E, int J, int RT>
struct TokenIn<E, J, RT, false> {
  float q[J][E], k[J][E], v[RT];
  float b, A_log;
  float g;         // gdn: a + dt_bias of the head (the argument of softplus)
  float kg[J][E];  // kda: a + dt_bias of each column
};

template <int E, int J, int RT>
struct TokenIn<E, J, RT, true> {
  float B[J][E], C[J][E], x[RT];
  float dt_arg, A_log, D;  // dt_arg = a + dt_bias
};

// Element i of y (float or bf16) as a float. bf16: a 16-bit load widened by a shift (exactly
// __bfloat162float); with __nv_bfloat16 loads ptxas kept the delta kernels' address arithmetic in
// uniform registers and spilled some (recurrent_kernel with fp32 state and 8 columns per lane).
template <typename Y>
__device__ __forceinline__ float y_at(const Y* y, int64_t i) {
  if constexpr (sizeof(Y) == 2) {
    return __uint_as_float(uint32_t{reinterpret_cast<const uint16_t*>(y)[i]} << 16);
  } else {
    return y[i];
  }
}

template <int L, typename Y, int E, int J, int RT>
__device__ __forceinline__ void load_token(const DeltaParams& p, int64_t tok, const Lanes<J, RT>& w,
                                           TokenIn<E, J, RT, false>& in) {
  const int h = w.h, heads = p.state.heads, rows = p.state.rows, cols = p.state.cols;
  const Y* y = static_cast<const Y*>(p.y) + tok * p.state.conv_dim;
  const int kh = h / (heads / p.key_heads);
  const Y* qv = y + int64_t{kh} * cols;
  const Y* kv = y + int64_t{p.key_heads} * cols + int64_t{kh} * cols;
  const Y* vv = y + 2 * int64_t{p.key_heads} * cols + int64_t{h} * rows;
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int c = (j * L + w.li) * E + e;
      in.q[j][e] = w.col_ok[j] ? y_at(qv, c) : 0.f;
      in.k[j][e] = w.col_ok[j] ? y_at(kv, c) : 0.f;
    }
  }
#pragma unroll
  for (int rr = 0; rr < RT; ++rr) in.v[rr] = w.row_ok[rr] ? y_at(vv, w.row0 + rr) : 0.f;
  in.b = load_elem(p.b, p.b_dtype, tok * p.b_stride + h);
  in.A_log = p.A_log[h];
  if (p.kda) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int c = (j * L + w.li) * E + e;
        in.kg[j][e] = w.col_ok[j] ? load_elem(p.a, p.a_dtype,
                                              tok * p.a_stride + int64_t{h} * cols + c) +
                                        p.dt_bias[int64_t{h} * cols + c]
                                  : 0.f;
      }
    }
  } else {
    in.g = load_elem(p.a, p.a_dtype, tok * p.a_stride + h) + p.dt_bias[h];
  }
}

template <int L, typename Y, int E, int J, int RT>
__device__ __forceinline__ void load_token(const SsdParams& p, int64_t tok, const Lanes<J, RT>& w,
                                           TokenIn<E, J, RT, true>& in) {
  const int h = w.h, heads = p.state.heads, rows = p.state.rows, cols = p.state.cols;
  const Y* y = static_cast<const Y*>(p.y) + tok * p.state.conv_dim;
  // x | B | C; head h reads B and C of group h / (heads / groups).
  const int grp = h / (heads / p.groups);
  const Y* Bv = y + int64_t{heads} * rows + int64_t{grp} * cols;
  const Y* Cv = Bv + int64_t{p.groups} * cols;
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int k = (j * L + w.li) * E + e;
      in.B[j][e] = w.col_ok[j] ? y_at(Bv, k) : 0.f;
      in.C[j][e] = w.col_ok[j] ? y_at(Cv, k) : 0.f;
    }
  }
#pragma unroll
  for (int rr = 0; rr < RT; ++rr)
    in.x[rr] = w.row_ok[rr] ? y_at(y, int64_t{h} * rows + w.row0 + rr) : 0.f;
  in.dt_arg = load_elem(p.a, p.a_dtype, tok * p.a_stride + h) + p.dt_bias[h];
  in.A_log = p.A_log[h];
  in.D = p.D[h];
}

// One token on a thread's rows: s updated in place, out_val[rr] the output of row rr (every lane
// of the group holds it).
template <int L, int E, int J, int RT>
__device__ __forceinline__ void token_update(const DeltaParams& p, TokenIn<E, J, RT, false>& in,
                                             float (&s)[RT][J][E], float (&out_val)[RT]) {
  const float A = -expf(in.A_log);
  float qq = 0.f, kk = 0.f, kq = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qq += in.q[j][e] * in.q[j][e];
      kk += in.k[j][e] * in.k[j][e];
      kq += in.k[j][e] * in.q[j][e];
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
      in.q[j][e] *= qn;
      in.k[j][e] *= kn;
    }
  }
  kq *= qn * kn;
  const float beta = sigmoid(in.b);
  float decay[J][E];
  if (p.kda) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
      for (int e = 0; e < E; ++e) decay[j][e] = expf(A * softplus(in.kg[j][e]));
    }
  } else {
    const float d = expf(A * softplus(in.g));
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
        a1 += s[rr][j][e] * in.k[j][e];
        a2 += s[rr][j][e] * in.q[j][e];
      }
    }
    a1 = group_sum<L>(a1);
    a2 = group_sum<L>(a2);
    const float u = beta * (in.v[rr] - a1);
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
      for (int e = 0; e < E; ++e) s[rr][j][e] += u * in.k[j][e];
    }
    out_val[rr] = a2 + u * kq;
  }
}

template <int L, int E, int J, int RT>
__device__ __forceinline__ void token_update(const SsdParams&, TokenIn<E, J, RT, true>& in,
                                             float (&s)[RT][J][E], float (&out_val)[RT]) {
  const float A = -expf(in.A_log);
  const float dt = softplus(in.dt_arg);
  const float dA = expf(dt * A);
#pragma unroll
  for (int rr = 0; rr < RT; ++rr) {
    const float xp = in.x[rr];
    const float dx = dt * xp;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        s[rr][j][e] = dA * s[rr][j][e] + dx * in.B[j][e];
        acc += s[rr][j][e] * in.C[j][e];
      }
    }
    out_val[rr] = group_sum<L>(acc) + in.D * xp;
  }
}

// The outputs of one token: lane 0 of each group writes its rows.
template <int RT, typename P>
__device__ __forceinline__ void store_out(const P& p, int64_t tok, int h, int row0, int li,
                                          const bool (&row_ok)[RT], const float (&out_val)[RT]) {
  if (li != 0) return;
#pragma unroll
  for (int rr = 0; rr < RT; ++rr) {
    if (row_ok[rr]) {
      store_elem(p.out, p.out_dtype, tok * p.out_stride + int64_t{h} * p.state.rows + row0 + rr,
                 out_val[rr]);
    }
  }
}

// One (request, head, row block). P is DeltaParams or SsdParams; Y is y's element type.
template <typename S, int L, int E, int J, int RT, bool SSD, typename Y, typename P>
__global__ void __launch_bounds__(kThreads) recurrent_kernel(const P p, int row_blocks) {
  constexpr int kRowsPerCta = Kernel<S, L, E, J, RT, SSD>::kRowsPerCta;
  const int heads = p.state.heads, rows = p.state.rows, cols = p.state.cols;
  const int64_t bid = blockIdx.x;
  const int rb = static_cast<int>(bid % row_blocks);
  const int i = static_cast<int>(bid / (int64_t{row_blocks} * heads));
  const LinReq r = p.step.reqs[i];
  if (r.tokens == 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Lanes<J, RT> w;
  w.h = static_cast<int>((bid / row_blocks) % heads);
  w.li = lane % L;
  w.row0 = rb * kRowsPerCta + (warp * (32 / L) + lane / L) * RT;
  const int h = w.h, li = w.li, row0 = w.row0;
  const int64_t per_head = int64_t{rows} * cols;
  const int64_t head_base = int64_t{h} * per_head;
  const int64_t per_slot = int64_t{heads} * per_head;

#pragma unroll
  for (int rr = 0; rr < RT; ++rr) w.row_ok[rr] = row0 + rr < rows;
#pragma unroll
  for (int j = 0; j < J; ++j) w.col_ok[j] = (j * L + li) * E < cols;
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
        if (base != nullptr && w.row_ok[rr] && w.col_ok[j]) {
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
        if (w.row_ok[rr] && w.col_ok[j]) store_vec<S, E>(base + elem(rr, j), s[rr][j]);
      }
    }
  };
  const S* slot_state =
      r.has_initial_state ? static_cast<const S*>(p.state.ssm) + r.slot * per_slot : nullptr;
  load_from(slot_state);

  const int N = p.step.draft_tokens;
  const int32_t* parents = p.step.verify ? p.step.parents + int64_t{i} * N : nullptr;
  S* inter = p.step.verify ? static_cast<S*>(p.state.inter_ssm) : nullptr;

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
    TokenIn<E, J, RT, SSD> in;
    load_token<L, Y>(p, tok, w, in);
    float out_val[RT];
    token_update<L>(p, in, s, out_val);
    store_out<RT>(p, tok, h, row0, li, w.row_ok, out_val);
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

// ---- DECODE: one token per request, a persistent grid streaming the state through shared memory.

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// Bulk copies (the copy engine): global -> shared completing on `bar`, shared -> global in a bulk
// group. Addresses 16-byte aligned, sizes multiples of 16.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most N bulk groups of this thread still read shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// A decode work item is (request, head, block of kRows rows): kRows * cols contiguous elements of
// the slot's state. The CTAs of a persistent grid take items n = blockIdx.x + k * gridDim.x (those
// of requests with a token); thread 0 keeps the next STAGES - 1 items' state on their way into a
// ring of shared-memory stages (bulk copies completing on one mbarrier per stage), the CTA updates
// an item in place there (thread mapping of recurrent_kernel: a group of L lanes per row, E
// columns per lane, RT rows per thread) and thread 0 writes it back with one bulk store, so the
// loads of the next items overlap the compute and the stores of this one. The token inputs (q, k,
// v, gates / x, B, C, dt) of the next item are read into registers before waiting for the current
// one. Launched as the dependent of the conv kernel (launch_*_recurrent's `dependent`), a CTA sets
// up its barriers and issues the loads of its first STAGES - 1 items' state while the conv still
// runs, and waits for it before the first read of y.
template <typename S, int L, int E, int RT, int W>
struct Decode {
  static constexpr int kThreads = W * 32;
  static constexpr int kCols = L * E;  // the state's cols, exactly
  static constexpr int kRows = W * (32 / L) * RT;
  static constexpr uint32_t kItemBytes = kRows * kCols * sizeof(S);
  static constexpr size_t smem_bytes(int stages) {
    return size_t{kItemBytes} * stages + 8 * stages;
  }
};

template <typename S, int L, int E, int RT, int W, int STAGES, bool SSD, typename Y, typename P>
__global__ void __launch_bounds__(W * 32) decode_kernel(const P p, int row_blocks, int64_t items) {
  using D = Decode<S, L, E, RT, W>;
  constexpr int kCols = D::kCols, kRows = D::kRows;
  constexpr int kItemElems = kRows * kCols;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  S* ring = reinterpret_cast<S*>(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw + size_t{D::kItemBytes} * STAGES);

  const int heads = p.state.heads;
  const int64_t per_head = int64_t{p.state.rows} * kCols;
  const int64_t per_slot = int64_t{heads} * per_head;
  const int64_t per_req = int64_t{row_blocks} * heads;
  const int64_t stride = gridDim.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group_row = (warp * (32 / L) + lane / L) * RT;  // first row of the thread in an item
  const int li = lane % L;
  S* const ssm = static_cast<S*>(p.state.ssm);

  // The first item at or after n (in this CTA's sequence) whose request has a token.
  auto valid_from = [&](int64_t n) {
    for (; n < items; n += stride) {
      if (p.step.reqs[n / per_req].tokens > 0) break;
    }
    return n;
  };
  // Global address of item n's state block, and whether it has one (else zeros).
  auto item_state = [&](int64_t n, bool& has) -> S* {
    const int i = static_cast<int>(n / per_req);
    const int rem = static_cast<int>(n % per_req);
    const int h = rem / row_blocks, rb = rem % row_blocks;
    const LinReq r = p.step.reqs[i];
    has = r.has_initial_state != 0;
    return ssm + r.slot * per_slot + h * per_head + int64_t{rb} * kItemElems;
  };
  auto fill = [&](int64_t n, int stage) {  // thread 0
    bool has = false;
    const S* src = item_state(n, has);
    if (has) {
      mbar_arrive_expect_tx(&full[stage], D::kItemBytes);
      bulk_load(ring + stage * kItemElems, src, D::kItemBytes, &full[stage]);
    } else {
      mbar_arrive(&full[stage]);
    }
  };
  auto lanes_of = [&](int64_t n, Lanes<1, RT>& w) {
    const int rem = static_cast<int>(n % per_req);
    w.h = rem / row_blocks;
    w.row0 = (rem % row_blocks) * kRows + group_row;
    w.li = li;
#pragma unroll
    for (int rr = 0; rr < RT; ++rr) w.row_ok[rr] = true;
    w.col_ok[0] = true;
  };

  int64_t cur = valid_from(blockIdx.x);
  int64_t ahead = cur;  // thread 0: the next item to fill (item k + STAGES - 1 in iteration k)
  if (threadIdx.x == 0) {
    for (int st = 0; st < STAGES; ++st) mbar_init(&full[st], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int st = 0; st < STAGES - 1 && ahead < items; ++st) {
      fill(ahead, st);
      ahead = valid_from(ahead + stride);
    }
  }
  // So far the CTA read the request table and the slots' recurrent states and wrote only shared
  // memory. The conv kernel (the primary of a dependent launch) reads x, its weights and the conv
  // windows and writes the windows and y, never the recurrent state or the table; both were
  // complete when it was launched (the table's upload and the state's last writers -- the previous
  // step's kernels, a verify commit -- come before it on the stream). y is read from here on.
  // Every thread waits, so the grid's completion implies the conv's.
  grid_dependency_wait();
  __syncthreads();

  Lanes<1, RT> w;
  TokenIn<E, 1, RT, SSD> in;
  if (cur < items) {
    lanes_of(cur, w);
    load_token<L, Y>(p, p.step.reqs[cur / per_req].token_start, w, in);
  }
  for (int k = 0; cur < items; ++k) {
    const int stage = k % STAGES;
    const int64_t next = valid_from(cur + stride);
    const int i = static_cast<int>(cur / per_req);
    const LinReq r = p.step.reqs[i];
    const int64_t tok = r.token_start;
    const Lanes<1, RT> wc = w;
    TokenIn<E, 1, RT, SSD> in_c = in;
    if (next < items) {  // the next item's inputs, in flight while this one computes
      lanes_of(next, w);
      load_token<L, Y>(p, p.step.reqs[next / per_req].token_start, w, in);
    }
    mbar_wait(&full[stage], (k / STAGES) & 1);
    S* buf = ring + stage * kItemElems;
    float s[RT][1][E];
#pragma unroll
    for (int rr = 0; rr < RT; ++rr) {
      S* at = buf + (group_row + rr) * kCols + li * E;
      if (r.has_initial_state) {
        load_vec<S, E>(at, s[rr][0]);
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) s[rr][0][e] = 0.f;
      }
    }
    float out_val[RT];
    token_update<L>(p, in_c, s, out_val);
    store_out<RT>(p, tok, wc.h, wc.row0, li, wc.row_ok, out_val);
#pragma unroll
    for (int rr = 0; rr < RT; ++rr) store_vec<S, E>(buf + (group_row + rr) * kCols + li * E, s[rr][0]);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      bool has = false;
      bulk_store(item_state(cur, has), buf, D::kItemBytes);
      if (ahead < items) {
        // Its stage held item k - 1, whose store was issued one iteration ago.
        bulk_wait_read<1>();
        fill(ahead, (k + STAGES - 1) % STAGES);
        ahead = valid_from(ahead + stride);
      }
    }
    cur = next;
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <typename S, int L, int E, int J, int RT, bool SSD, typename Y, typename P>
cudaError_t launch_variant(const P& p, cudaStream_t stream) {
  constexpr int kRows = Kernel<S, L, E, J, RT, SSD>::kRowsPerCta;
  const int row_blocks = (p.state.rows + kRows - 1) / kRows;
  const int64_t blocks = int64_t{row_blocks} * p.state.heads * p.step.num_reqs;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  recurrent_kernel<S, L, E, J, RT, SSD, Y, P>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, row_blocks);
  return cudaGetLastError();
}

// Whether decode_kernel<S, L, E, RT, W> takes the step: DECODE (one token per request at most,
// no verify) on a state of exactly L * E columns and a multiple of its item rows.
template <typename S, int L, int E, int RT, int W, typename P>
bool decode_fits(const P& p) {
  using D = Decode<S, L, E, RT, W>;
  return !p.step.verify && p.step.max_tokens == 1 && p.state.cols == D::kCols &&
         p.state.rows % D::kRows == 0 && reinterpret_cast<uintptr_t>(p.state.ssm) % 16 == 0;
}

// The persistent grid: (resident CTAs per SM, at most max_per_sm) x SMs, no more than the items.
template <typename S, int L, int E, int RT, int W, int STAGES, bool SSD, typename Y, typename P>
cudaError_t launch_decode(const P& p, cudaStream_t stream, bool dependent, int max_per_sm) {
  using D = Decode<S, L, E, RT, W>;
  auto kernel = decode_kernel<S, L, E, RT, W, STAGES, SSD, Y, P>;
  const size_t smem = D::smem_bytes(STAGES);
  struct Fit {
    int sms = 0, per_sm = 0;
  };
  constexpr int kMaxDevices = 16;
  static Fit fits[kMaxDevices];  // per device; filled once (identical values if two threads race)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  Fit& fit = fits[dev];
  if (fit.per_sm == 0) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    int sms = 0, per_sm = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, D::kThreads, smem);
    if (err != cudaSuccess) return err;
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    fit.sms = sms;
    fit.per_sm = per_sm;
  }
  const int row_blocks = p.state.rows / D::kRows;
  const int64_t items = int64_t{row_blocks} * p.state.heads * p.step.num_reqs;
  const int64_t grid = std::min<int64_t>(items, int64_t{fit.sms} * std::min(fit.per_sm, max_per_sm));
  if (grid < 1) return cudaSuccess;
  return launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(D::kThreads), smem, stream,
                       dependent, p, row_blocks, items);
}

// The decode variants: items of 64 rows (fp32: 32 KB, bf16: 16 KB), 8 warps, 3 stages, as many
// CTAs per SM as fit (fp32: 2). Measured on the H200 at the GDN and Mamba2 shapes, batch 64 and
// 256, the kernel alone: 84-90% of a cudaMemcpy of the same bytes; 4 warps with 32-row items and
// 2-4 stages 0-2% slower, 16-row items 3-15% slower, at most 2 CTAs of 4 warps per SM 5-17%
// slower.
constexpr int kDecodeWarps = 8;
constexpr int kDecodeStages = 3;
constexpr int kDecodePerSm = 32;

// The variants: 16-byte vectors over 128 columns (the real models' Dk and d_state) for fp32 and
// bf16 states, and one element per lane for any other width up to 256; each for fp32 and bf16 y.
template <bool SSD, typename Y, typename P>
cudaError_t dispatch_state(const P& p, cudaStream_t stream, bool dependent) {
  const bool wide = p.state.cols > 64 && p.state.cols <= 128 && p.state.cols % 8 == 0;
  if (p.state.ssm_dtype == kF32) {
    if (decode_fits<float, 32, 4, 8, kDecodeWarps>(p)) {
      return launch_decode<float, 32, 4, 8, kDecodeWarps, kDecodeStages, SSD, Y>(
          p, stream, dependent, kDecodePerSm);
    }
    if (wide) return launch_variant<float, 32, 4, 1, 4, SSD, Y>(p, stream);
    return launch_variant<float, 32, 1, 8, 2, SSD, Y>(p, stream);
  }
  if (p.state.ssm_dtype == kBF16) {
    if (decode_fits<__nv_bfloat16, 16, 8, 4, kDecodeWarps>(p)) {
      return launch_decode<__nv_bfloat16, 16, 8, 4, kDecodeWarps, kDecodeStages, SSD, Y>(
          p, stream, dependent, kDecodePerSm);
    }
    if (wide) return launch_variant<__nv_bfloat16, 16, 8, 1, 4, SSD, Y>(p, stream);
    return launch_variant<__nv_bfloat16, 32, 1, 8, 2, SSD, Y>(p, stream);
  }
  return cudaErrorInvalidValue;
}

template <bool SSD, typename P>
cudaError_t dispatch(const P& p, cudaStream_t stream, bool dependent) {
  if (p.step.num_reqs == 0 || p.step.max_tokens == 0) return cudaSuccess;
  const int cols = p.state.cols;
  if (cols < 1 || cols > 256 || p.state.rows < 1 || p.state.heads < 1) return cudaErrorInvalidValue;
  return with_f32_or_bf16(p.y_dtype, cudaErrorInvalidValue, [&](auto y) {
    return dispatch_state<SSD, typename decltype(y)::type>(p, stream, dependent);
  });
}

}  // namespace

cudaError_t launch_delta_recurrent(const DeltaParams& p, cudaStream_t stream, bool dependent) {
  if (p.key_heads < 1 || p.state.heads % p.key_heads != 0) return cudaErrorInvalidValue;
  return dispatch<false>(p, stream, dependent);
}

cudaError_t launch_ssd_recurrent(const SsdParams& p, cudaStream_t stream, bool dependent) {
  if (p.groups < 1 || p.state.heads % p.groups != 0) return cudaErrorInvalidValue;
  return dispatch<true>(p, stream, dependent);
}

}  // namespace attnrt::cuda::linear
