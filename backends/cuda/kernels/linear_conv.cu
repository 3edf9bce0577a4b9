// The causal conv1d with SiLU of the linear-attention layers (§8.8) and the post-verify commit of
// their state (§8.10).
//
// Conv, non-verify steps (DECODE, EXTEND) when the layout allows (K = 4, conv_dim and the x row
// stride multiples of V, 16-byte aligned tensors): `conv_vec_kernel`, one thread per (request,
// V channels, chunk of kConvTokens tokens) with V = 16 / the smaller of the state's and y's element
// sizes (fp32 window and y: 4; a bf16 window or bf16 y: 8), so that every window, x, weight and y
// access is one or two 16-byte vectors (bf16 y, the case of 16-bit x: 8 channels, one 16-byte
// store per token). y is stored as Y (fp32, or bf16 rounded to nearest; linear.h). A thread keeps
// the K - 1 preceding inputs of its channels in registers, prefetches the next token's x, and, when
// the request fits in one chunk (always for DECODE), writes the slot's new window itself: a
// one-token step is one kernel that reads the window, x and the weights once and writes y and the
// window once; one-token steps take `conv_token_kernel`, the same for one token in fewer registers
// (comment above it). Otherwise (verify, other K, unaligned layouts) the scalar `conv_kernel`: one
// thread per (request, channel, chunk), channels contiguous so that a warp's accesses are
// coalesced. Requests longer than one chunk get their window from a second kernel once every chunk
// has read the old one. Verify: one thread walks the block's tokens, each starting from its
// parent's checkpoint window (re-read from what the same thread stored). The conv kernels let the
// recurrence after them be scheduled at once (dependent_launch.cuh): before its wait it reads only
// the recurrent state and the request table, which no conv kernel writes.
#include <cstdint>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/common/math.cuh"
#include "backends/cuda/kernels/dependent_launch.cuh"
#include "backends/cuda/kernels/linear.h"

namespace attnrt::cuda::linear {

namespace {

constexpr int kConvThreads = 128;
constexpr int kConvTokens = 64;
constexpr int kMaxKernel = 8;

template <typename C>
__device__ __forceinline__ float conv_at(const void* base, int64_t i) {
  return to_float(static_cast<const C*>(base)[i]);
}

template <typename C>
__device__ __forceinline__ void conv_put(void* base, int64_t i, float v) {
  static_cast<C*>(base)[i] = from_float<C>(v);
}

template <typename C, typename Y>
__global__ void __launch_bounds__(kConvThreads) conv_kernel(const ConvParams p) {
  launch_dependent_grids();
  const int c = blockIdx.x * kConvThreads + threadIdx.x;
  const int dim = p.state.conv_dim;
  if (c >= dim) return;
  const LinReq r = p.step.reqs[blockIdx.y];
  const int t0 = blockIdx.z * kConvTokens;
  if (t0 >= r.tokens) return;
  const int K = p.kernel, W = K - 1;
  float w[kMaxKernel];
#pragma unroll
  for (int j = 0; j < kMaxKernel; ++j) w[j] = j < K ? p.weight[int64_t{c} * K + j] : 0.f;
  const float bias = p.bias != nullptr ? p.bias[c] : 0.f;
  const int64_t win_elems = int64_t{W} * dim;
  const int64_t slot_base = r.slot * win_elems;
  auto x_at = [&](int t) {
    return load_elem(p.x, p.x_dtype, (int64_t{r.token_start} + t) * p.x_stride + c);
  };
  float win[kMaxKernel];  // win[j], j < W: the inputs before the current token, oldest first
  // y of token t (input xt) from the window.
  auto conv_out = [&](int t, float xt) {
    float acc = bias + w[W] * xt;
#pragma unroll
    for (int j = 0; j < kMaxKernel - 1; ++j) {
      if (j < W) acc += w[j] * win[j];
    }
    conv_put<Y>(p.y, (int64_t{r.token_start} + t) * dim + c, silu(acc));
  };

  if (p.step.verify) {
    const int N = p.step.draft_tokens;
    const int64_t row = blockIdx.y;
    const int32_t* parents = p.step.parents + row * N;
    for (int t = 0; t < r.tokens; ++t) {
      const int parent = parents[t];
#pragma unroll
      for (int j = 0; j < kMaxKernel - 1; ++j) {
        if (j >= W) break;
        if (parent >= 0) {
          win[j] =
              conv_at<C>(p.state.inter_conv, (row * N + parent) * win_elems + int64_t{j} * dim + c);
        } else {
          win[j] = r.has_initial_state ? conv_at<C>(p.state.conv, slot_base + int64_t{j} * dim + c)
                                       : 0.f;
        }
      }
      const float xt = x_at(t);
      conv_out(t, xt);
      const int64_t dst = (row * N + t) * win_elems + c;
#pragma unroll
      for (int j = 0; j < kMaxKernel - 1; ++j) {
        if (j < W)
          conv_put<C>(p.state.inter_conv, dst + int64_t{j} * dim, j + 1 < W ? win[j + 1] : xt);
      }
    }
    return;
  }

#pragma unroll
  for (int j = 0; j < kMaxKernel - 1; ++j) {
    if (j >= W) break;
    const int i = t0 - W + j;  // input index in the request; < 0: the slot's window
    if (i >= 0) {
      win[j] = x_at(i);
    } else {
      win[j] = r.has_initial_state ? conv_at<C>(p.state.conv, slot_base + int64_t{W + i} * dim + c)
                                   : 0.f;
    }
  }
  const int t1 = min(r.tokens, t0 + kConvTokens);
  for (int t = t0; t < t1; ++t) {
    const float xt = x_at(t);
    conv_out(t, xt);
#pragma unroll
    for (int j = 0; j < kMaxKernel - 1; ++j) {
      if (j < W) win[j] = j + 1 < W ? win[j + 1] : xt;
    }
  }
  if (r.tokens <= kConvTokens) {
    // The only chunk: win now holds the last W inputs of window ++ x.
#pragma unroll
    for (int j = 0; j < kMaxKernel - 1; ++j) {
      if (j < W) conv_put<C>(p.state.conv, slot_base + int64_t{j} * dim + c, win[j]);
    }
  }
}

// The K taps of channels c .. c + V - 1 (V * K consecutive floats, read as float4) and their bias
// (0 without one).
template <int V, int K>
__device__ __forceinline__ void load_taps(const ConvParams& p, int c, float (&w)[V][K],
                                          float (&bias)[V]) {
  const float4* wq = reinterpret_cast<const float4*>(p.weight + int64_t{c} * K);
#pragma unroll
  for (int q = 0; q < V * K / 4; ++q) {
    const float4 f = wq[q];
    const float fv[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) w[(4 * q + e) / K][(4 * q + e) % K] = fv[e];
  }
  if (p.bias != nullptr) {
    load_vec<float, V>(p.bias + c, bias);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) bias[e] = 0.f;
  }
}

// y = silu(bias + taps . (window ++ x)) for V channels: the K - 1 earlier inputs `win` (oldest
// first) and the token's own `xt`.
template <int V, int K>
__device__ __forceinline__ void conv_silu(const float (&w)[V][K], const float (&bias)[V],
                                          const float (&win)[K - 1][V], const float (&xt)[V],
                                          float (&y)[V]) {
#pragma unroll
  for (int e = 0; e < V; ++e) {
    float acc = bias[e] + w[e][K - 1] * xt[e];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) acc += w[e][j] * win[j][e];
    y[e] = silu(acc);
  }
}

// Tokens of x a conv_vec_kernel thread keeps in flight. One (a load of the next token, converted
// to float right away) had each thread wait out a whole memory latency every token: the
// conversion right after the load stalled on it (SASS), and at 112 registers (4 CTAs per SM) the
// GDN row's conv ran at about half the copy rate.
constexpr int kConvAhead = 4;

// Channels per thread of the vectorised kernels: 16 bytes of the narrower of the window (C) and
// y (Y) elements.
template <typename C, typename Y>
constexpr int kConvVec = 16 / (sizeof(C) < sizeof(Y) ? sizeof(C) : sizeof(Y));

// Non-verify steps, V = kConvVec<C, Y> channels per thread (see the header comment).
template <typename C, typename Y, int K>
__global__ void __launch_bounds__(kConvThreads) conv_vec_kernel(const ConvParams p) {
  constexpr int V = kConvVec<C, Y>, W = K - 1;
  static_assert((V * K) % 4 == 0, "weights are read as float4");
  launch_dependent_grids();
  const int dim = p.state.conv_dim;
  const int c = (blockIdx.x * kConvThreads + threadIdx.x) * V;
  if (c >= dim) return;
  const LinReq r = p.step.reqs[blockIdx.y];
  const int t0 = blockIdx.z * kConvTokens;
  if (t0 >= r.tokens) return;
  const int64_t win_elems = int64_t{W} * dim;
  C* const window = static_cast<C*>(p.state.conv) + r.slot * win_elems + c;
  const int64_t x0 = int64_t{r.token_start} * p.x_stride + c;
  const int t1 = min(r.tokens, t0 + kConvTokens);

  // Every independent load first: the chunk's first kConvAhead tokens of x (raw, converted at
  // use), the window, the weights and the bias.
  constexpr int P = kConvAhead;
  const int32_t xt_dtype = p.x_dtype;
  uint4 xq[P][2];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    if (t0 + k < t1) load_raw<V>(p.x, xt_dtype, x0 + int64_t{t0 + k} * p.x_stride, xq[k]);
  }
  float win[W][V];  // win[j]: the inputs before the current token, oldest first
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const int i = t0 - W + j;  // input index in the request; < 0: the slot's window
    if (i >= 0) {
      load_elems<V>(p.x, p.x_dtype, x0 + int64_t{i} * p.x_stride, win[j]);
    } else if (r.has_initial_state) {
      load_vec<C, V>(window + int64_t{W + i} * dim, win[j]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) win[j][e] = 0.f;
    }
  }
  float w[V][K];
  float bias[V];
  load_taps<V, K>(p, c, w, bias);

  // Token t's x sits in xq[t % P] (the loop unrolled by P so that every index is static); its
  // slot is refilled with token t + P's as soon as it is converted, so P loads stay in flight.
  for (int tb = t0; tb < t1; tb += P) {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int t = tb + k;
      if (t < t1) {
        float xt[V];
        raw_to_float<V>(xt_dtype, xq[k], xt);
        if (t + P < t1) load_raw<V>(p.x, xt_dtype, x0 + int64_t{t + P} * p.x_stride, xq[k]);
        float y[V];
        conv_silu<V, K>(w, bias, win, xt, y);
        store_vec<Y, V>(static_cast<Y*>(p.y) + (int64_t{r.token_start} + t) * dim + c, y);
#pragma unroll
        for (int j = 0; j < W; ++j) {
#pragma unroll
          for (int e = 0; e < V; ++e) win[j][e] = j + 1 < W ? win[j + 1][e] : xt[e];
        }
      }
    }
  }
  if (r.tokens <= kConvTokens) {
    // The only chunk: win now holds the last W inputs of window ++ x.
#pragma unroll
    for (int j = 0; j < W; ++j) store_vec<C, V>(window + int64_t{j} * dim, win[j]);
  }
}

// Resident CTAs per SM that conv_token_kernel's register count must allow (4 channels per
// thread: at most 48 registers, 8: 128).
template <int V>
constexpr int kConvTokenBlocksPerSm = V == 4 ? 10 : 4;

// One-token non-verify steps (DECODE) in conv_vec_kernel's layout: its arithmetic for one token,
// without the token loop and the next token's prefetch, in fewer registers (fp32 windows and y:
// 48, 10 CTAs per SM), so that a DECODE at batch 64 runs in one wave on 132 SMs (GDN 1024 CTAs,
// Mamba2 1280), where conv_vec_kernel (72 registers, 7 CTAs per SM) ran a second wave. With 8
// channels per thread (bf16 window or y) the grid is half as large and fits one wave at 4 CTAs
// per SM.
template <typename C, typename Y, int K>
__global__ void __launch_bounds__(kConvThreads, kConvTokenBlocksPerSm<kConvVec<C, Y>>)
    conv_token_kernel(const ConvParams p) {
  constexpr int V = kConvVec<C, Y>, W = K - 1;
  static_assert((V * K) % 4 == 0, "weights are read as float4");
  launch_dependent_grids();
  const int dim = p.state.conv_dim;
  const int c = (blockIdx.x * kConvThreads + threadIdx.x) * V;
  if (c >= dim) return;
  // Every load first: the weights and the bias (in flight while the request's record arrives),
  // then x and the window.
  float w[V][K];
  float bias[V];
  load_taps<V, K>(p, c, w, bias);
  const LinReq r = p.step.reqs[blockIdx.y];
  if (r.tokens <= 0) return;
  C* const window = static_cast<C*>(p.state.conv) + r.slot * (int64_t{W} * dim) + c;
  float xt[V];
  load_elems<V>(p.x, p.x_dtype, int64_t{r.token_start} * p.x_stride + c, xt);
  float win[W][V];  // the inputs before the token, oldest first
#pragma unroll
  for (int j = 0; j < W; ++j) {
    if (r.has_initial_state) {
      load_vec<C, V>(window + int64_t{j} * dim, win[j]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) win[j][e] = 0.f;
    }
  }

  float y[V];
  conv_silu<V, K>(w, bias, win, xt, y);
  store_vec<Y, V>(static_cast<Y*>(p.y) + int64_t{r.token_start} * dim + c, y);
  // The new window: the last W inputs of window ++ x.
#pragma unroll
  for (int j = 0; j + 1 < W; ++j) store_vec<C, V>(window + int64_t{j} * dim, win[j + 1]);
  store_vec<C, V>(window + int64_t{W - 1} * dim, xt);
}

// Requests longer than one chunk: the new window is the last W inputs, all from x (W < chunk).
template <typename C>
__global__ void __launch_bounds__(kConvThreads) conv_window_kernel(const ConvParams p) {
  const int c = blockIdx.x * kConvThreads + threadIdx.x;
  const int dim = p.state.conv_dim;
  if (c >= dim) return;
  const LinReq r = p.step.reqs[blockIdx.y];
  if (r.tokens <= kConvTokens) return;
  const int W = p.kernel - 1;
  for (int j = 0; j < W; ++j) {
    const int64_t t = int64_t{r.token_start} + r.tokens - W + j;
    conv_put<C>(p.state.conv, (r.slot * W + j) * dim + c,
                load_elem(p.x, p.x_dtype, t * p.x_stride + c));
  }
}

// The K of the vectorised kernel (every model preset's conv).
constexpr int kVecKernel = 4;

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Whether conv_vec_kernel<C, Y, kVecKernel> takes the step: every vector access aligned (y rows
// start at multiples of conv_dim, a multiple of V).
template <typename C, typename Y>
bool vec_fits(const ConvParams& p) {
  constexpr int V = kConvVec<C, Y>;
  return !p.step.verify && p.kernel == kVecKernel && p.state.conv_dim % V == 0 &&
         p.x_stride % V == 0 && aligned16(p.x) && aligned16(p.y) && aligned16(p.weight) &&
         aligned16(p.bias) && aligned16(p.state.conv);
}

template <typename C, typename Y>
cudaError_t conv_launch(const ConvParams& p, cudaStream_t stream) {
  const unsigned cblocks =
      static_cast<unsigned>((p.state.conv_dim + kConvThreads - 1) / kConvThreads);
  const unsigned chunks =
      p.step.verify ? 1u
                    : static_cast<unsigned>((p.step.max_tokens + kConvTokens - 1) / kConvTokens);
  if (vec_fits<C, Y>(p)) {
    constexpr int V = kConvVec<C, Y>;
    const int groups = p.state.conv_dim / V;
    const unsigned vblocks = static_cast<unsigned>((groups + kConvThreads - 1) / kConvThreads);
    if (p.step.max_tokens == 1) {
      conv_token_kernel<C, Y, kVecKernel>
          <<<dim3(vblocks, p.step.num_reqs), kConvThreads, 0, stream>>>(p);
      return cudaGetLastError();
    }
    conv_vec_kernel<C, Y, kVecKernel>
        <<<dim3(vblocks, p.step.num_reqs, chunks), kConvThreads, 0, stream>>>(p);
  } else {
    conv_kernel<C, Y><<<dim3(cblocks, p.step.num_reqs, chunks), kConvThreads, 0, stream>>>(p);
  }
  if (!p.step.verify && chunks > 1) {
    conv_window_kernel<C><<<dim3(cblocks, p.step.num_reqs), kConvThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// §8.10: one block per (request row, part): part 0 the conv window, part 1 the state.
template <typename Word>
__global__ void commit_kernel(const CommitParams p, int64_t conv_bytes, int64_t ssm_bytes) {
  const int i = blockIdx.x;
  const int s = p.last_accepted[i];
  if (s < 0) return;
  const bool conv = blockIdx.y == 0;
  const int64_t bytes = conv ? conv_bytes : ssm_bytes;
  const int64_t checkpoint = int64_t{i} * p.draft_tokens + s;
  const Word* src = reinterpret_cast<const Word*>(
      static_cast<const char*>(conv ? p.state.inter_conv : p.state.inter_ssm) + checkpoint * bytes);
  Word* dst = reinterpret_cast<Word*>(static_cast<char*>(conv ? p.state.conv : p.state.ssm) +
                                      p.slots[i] * bytes);
  const int64_t words = bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) dst[w] = src[w];
}

int64_t dtype_bytes(DTypeCode t) { return t == kF32 ? 4 : 2; }

}  // namespace

cudaError_t launch_conv(const ConvParams& p, cudaStream_t stream) {
  if (p.step.num_reqs == 0 || p.step.max_tokens == 0) return cudaSuccess;
  if (p.kernel < 1 || p.kernel > kMaxKernel || p.state.conv_width != p.kernel - 1 ||
      p.step.num_reqs > 65535) {
    return cudaErrorInvalidValue;
  }
  return with_f32_or_bf16(p.y_dtype, cudaErrorInvalidValue, [&](auto y) {
    using Y = typename decltype(y)::type;
    if (p.state.conv_dtype == kF32) return conv_launch<float, Y>(p, stream);
    if (p.state.conv_dtype == kBF16) return conv_launch<__nv_bfloat16, Y>(p, stream);
    return cudaErrorInvalidValue;
  });
}

cudaError_t launch_commit(const CommitParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const int64_t conv_bytes =
      int64_t{p.state.conv_width} * p.state.conv_dim * dtype_bytes(p.state.conv_dtype);
  const int64_t ssm_bytes =
      int64_t{p.state.heads} * p.state.rows * p.state.cols * dtype_bytes(p.state.ssm_dtype);
  const dim3 grid(static_cast<unsigned>(p.rows), 2);
  if (conv_bytes % 16 == 0 && ssm_bytes % 16 == 0) {
    commit_kernel<uint4><<<grid, 256, 0, stream>>>(p, conv_bytes, ssm_bytes);
  } else {
    commit_kernel<unsigned char><<<grid, 256, 0, stream>>>(p, conv_bytes, ssm_bytes);
  }
  return cudaGetLastError();
}

}  // namespace attnrt::cuda::linear
