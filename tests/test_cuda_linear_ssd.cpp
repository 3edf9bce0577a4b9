// The chunked Mamba2 SSD extend kernel (launch_ssd_chunked, backends/cuda/kernels/
// linear_ssd_chunked.cu) against the float64 sequential recurrence (linear::recurrent_step) on
// the same numbers: ragged requests that end on, before and after chunk boundaries, with and
// without initial state, several slots, fp32 and bf16 states, dt / out in fp32, bf16 and fp16,
// fp32 and bf16 conv outputs y (the reference reads the bf16-rounded values), small dims and the
// Nemotron-H ones. Decays per token span exp(-0.001) .. exp(-1). Each run
// draws a fresh seed (printed; ATTNRT_TEST_SEED replays one). Outputs are poisoned with NaN
// first; slots and output columns the step does not own must come back unchanged. One more test
// prints (never asserts) the kernel time at the Nemotron-H shape, with fp32 and with bf16 y. Skips
// without a usable GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <iostream>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "attnrt/core/device.h"
#include "attnrt/core/dtype.h"
#include "attnrt/linear/linear_math.h"

#include "tests/test_cuda_util.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/kernels/linear.h"
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

using test::DeviceMemory;

namespace cl = cuda::linear;

// Raw host bytes of `n` elements of a float dtype.
struct HostArray {
  DType dtype;
  std::vector<unsigned char> bytes;
  HostArray(DType t, int64_t n) : dtype(t), bytes(static_cast<size_t>(n) * dtype_size(t)) {}
  float get(int64_t i) const { return load_as_float(bytes.data(), dtype, static_cast<size_t>(i)); }
  void set(int64_t i, float v) { store_from_float(bytes.data(), dtype, static_cast<size_t>(i), v); }
  int64_t size() const { return static_cast<int64_t>(bytes.size() / dtype_size(dtype)); }
};

struct SsdCase {
  int heads = 8, groups = 2, head_dim = 64, d_state = 64, chunk = 64;
  std::vector<int> tokens;    // per request
  std::vector<int> has_init;  // per request: 1 = start from the slot's state
  DType ssm = DType::f32, a = DType::f32, out = DType::f32;
  int a_pad = 0, out_pad = 0;  // extra elements per row of a and out
  DType y = DType::f32;        // the conv outputs (y_dtype): f32 or bf16
};

double softplus_inverse(double y) { return std::log(std::expm1(y)); }

// The device side of one step: requests, state slots, inputs, parameters and the output.
struct SsdDevice {
  DeviceMemory reqs, ssm, y, a, A_log, dt_bias, D, out;

  // The launch parameters of `c`'s layer shape and dtypes over these buffers.
  cl::SsdParams params(const SsdCase& c, int num_reqs, int max_tokens, int64_t a_stride,
                       int64_t out_stride) const {
    cl::SsdParams p{};
    p.step.reqs = reqs.as<const cl::LinReq>();
    p.step.num_reqs = num_reqs;
    p.step.max_tokens = max_tokens;
    p.state.ssm = ssm.ptr;
    p.state.ssm_dtype = static_cast<cl::DTypeCode>(c.ssm);
    p.state.conv_dim = c.heads * c.head_dim + 2 * c.groups * c.d_state;
    p.state.heads = c.heads;
    p.state.rows = c.head_dim;
    p.state.cols = c.d_state;
    p.groups = c.groups;
    p.y = y.ptr;
    p.y_dtype = static_cast<cl::DTypeCode>(c.y);
    p.a = a.ptr;
    p.a_stride = a_stride;
    p.a_dtype = static_cast<cl::DTypeCode>(c.a);
    p.A_log = A_log.as<const float>();
    p.dt_bias = dt_bias.as<const float>();
    p.D = D.as<const float>();
    p.out = out.ptr;
    p.out_stride = out_stride;
    p.out_dtype = static_cast<cl::DTypeCode>(c.out);
    return p;
  }
};

// Runs one step on the GPU and the float64 recurrence on the host and compares outputs and final
// states. Returns the errors relative to the largest reference magnitude through the out-params.
void check_ssd(const SsdCase& c) {
  const uint32_t seed = test::test_seed();
  std::cout << "[ seed ] ATTNRT_TEST_SEED=" << seed << "\n";
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  auto uni = [&](double lo, double hi) { return lo + (hi - lo) * u01(rng); };

  const int H = c.heads, P = c.head_dim, N = c.d_state, G = c.groups;
  const int conv_dim = H * P + 2 * G * N;
  const int R = static_cast<int>(c.tokens.size());
  int64_t T = 0;
  int max_tokens = 0;
  for (int t : c.tokens) {
    T += t;
    max_tokens = std::max(max_tokens, t);
  }
  const int64_t a_stride = H + c.a_pad, out_stride = int64_t{H} * P + c.out_pad;

  // Parameters: A = -exp(A_log) in [-7.4, -0.37]; per head a decay scale, per token a log decay
  // dt * |A| in [1e-3, 1] (some heads remember across many chunks, some forget within one).
  linear::LayerParams lp;
  lp.kind = LayerKind::mamba2;
  lp.shape.conv_dim = conv_dim;
  lp.shape.heads = H;
  lp.shape.rows = P;
  lp.shape.cols = N;
  lp.key_heads = G;
  lp.key_dim = N;
  std::vector<float> A_log(H), dt_bias(H), D(H), speed(H);
  for (int h = 0; h < H; ++h) {
    A_log[h] = static_cast<float>(uni(-1.0, 2.0));
    dt_bias[h] = static_cast<float>(uni(-1.0, 1.0));
    D[h] = static_cast<float>(uni(0.5, 1.5));
    speed[h] = static_cast<float>(std::pow(10.0, uni(-3.0, 0.0)));
  }
  lp.A_log.assign(A_log.begin(), A_log.end());
  lp.dt_bias.assign(dt_bias.begin(), dt_bias.end());
  lp.D.assign(D.begin(), D.end());

  std::vector<float> y(static_cast<size_t>(T * conv_dim));
  for (float& v : y) v = static_cast<float>(uni(-1.0, 1.0));
  HostArray y_raw(c.y, T * conv_dim);  // as the kernel reads it; the reference takes the same
  for (int64_t i = 0; i < y_raw.size(); ++i) {
    y_raw.set(i, y[i]);
    y[i] = y_raw.get(i);
  }
  HostArray a(c.a, T * a_stride);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < a_stride; ++k) {
      const int h = static_cast<int>(k);
      if (h >= H) {
        a.set(t * a_stride + k, std::numeric_limits<float>::quiet_NaN());  // never read
        continue;
      }
      const double rate = std::exp(A_log[h]);
      const double log_decay = std::max(1e-3, speed[h] * std::pow(10.0, uni(-1.0, 0.0)));
      a.set(t * a_stride + k, static_cast<float>(softplus_inverse(log_decay / rate) - dt_bias[h]));
    }
  }

  // Slots: request i uses slot 1 + 2i (slot 0 reserved, odd slots between left alone); every
  // slot starts with random numbers, so a request without initial state must not read its slot.
  const int slots = 2 * R + 2;
  const int64_t per_slot = int64_t{H} * P * N;
  HostArray ssm(c.ssm, slots * per_slot);
  for (int64_t i = 0; i < ssm.size(); ++i) ssm.set(i, static_cast<float>(uni(-1.0, 1.0)));
  std::vector<cl::LinReq> reqs(R);
  int32_t start = 0;
  for (int i = 0; i < R; ++i) {
    reqs[i] = cl::LinReq{1 + 2 * i, start, c.tokens[i], c.has_init[i], 0};
    start += c.tokens[i];
  }

  HostArray out(c.out, T * out_stride);
  for (int64_t i = 0; i < out.size(); ++i) out.set(i, std::numeric_limits<float>::quiet_NaN());

  const SsdDevice dev{DeviceMemory(reqs.size() * sizeof(cl::LinReq)),
                      DeviceMemory(ssm.bytes.size()),
                      DeviceMemory(y_raw.bytes.size()),
                      DeviceMemory(a.bytes.size()),
                      DeviceMemory(H * sizeof(float)),
                      DeviceMemory(H * sizeof(float)),
                      DeviceMemory(H * sizeof(float)),
                      DeviceMemory(out.bytes.size())};
  dev.y.upload(y_raw.bytes.data());
  dev.a.upload(a.bytes.data());
  dev.ssm.upload(ssm.bytes.data());
  dev.out.upload(out.bytes.data());
  dev.reqs.upload(reqs.data());
  dev.A_log.upload(A_log.data());
  dev.dt_bias.upload(dt_bias.data());
  dev.D.upload(D.data());

  const cl::SsdParams p = dev.params(c, R, max_tokens, a_stride, out_stride);
  DeviceMemory ws(cl::ssd_chunked_workspace(p, T, c.chunk));
  ASSERT_EQ(cl::launch_ssd_chunked(p, T, c.chunk, ws.ptr, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  HostArray out_gpu(c.out, out.size()), ssm_gpu(c.ssm, ssm.size());
  dev.out.download(out_gpu.bytes.data());
  dev.ssm.download(ssm_gpu.bytes.data());

  // The float64 recurrence per request, from the values exactly as stored (rounded a, state).
  std::vector<std::vector<double>> ref_out(R), ref_state(R);
  std::vector<std::future<void>> jobs;
  for (int i = 0; i < R; ++i) {
    jobs.push_back(std::async(std::launch::async, [&, i] {
      std::vector<double>& S = ref_state[i];
      S.assign(static_cast<size_t>(per_slot), 0.0);
      if (c.has_init[i]) {
        for (int64_t k = 0; k < per_slot; ++k) S[k] = ssm.get(reqs[i].slot * per_slot + k);
      }
      ref_out[i].assign(static_cast<size_t>(c.tokens[i]) * H * P, 0.0);
      std::vector<double> yt(conv_dim), at(H);
      for (int t = 0; t < c.tokens[i]; ++t) {
        const int64_t row = reqs[i].token_start + t;
        for (int k = 0; k < conv_dim; ++k) yt[k] = y[row * conv_dim + k];
        for (int h = 0; h < H; ++h) at[h] = a.get(row * a_stride + h);
        linear::recurrent_step(lp, S, yt.data(), at.data(), nullptr,
                               &ref_out[i][static_cast<size_t>(t) * H * P]);
      }
    }));
  }
  for (auto& j : jobs) j.get();

  double out_max = 0, out_err = 0, state_max = 0, state_err = 0;
  int64_t bad_nan = 0, pad_touched = 0, slot_touched = 0;
  for (int i = 0; i < R; ++i) {
    for (int t = 0; t < c.tokens[i]; ++t) {
      const int64_t row = reqs[i].token_start + t;
      for (int64_t k = 0; k < out_stride; ++k) {
        const float got = out_gpu.get(row * out_stride + k);
        if (k >= int64_t{H} * P) {
          pad_touched += !std::isnan(got);
          continue;
        }
        const double ref = ref_out[i][static_cast<size_t>(t) * H * P + k];
        if (!std::isfinite(got)) ++bad_nan;
        out_max = std::max(out_max, std::abs(ref));
        out_err = std::max(out_err, std::abs(got - ref));
      }
    }
    if (c.tokens[i] == 0) continue;
    for (int64_t k = 0; k < per_slot; ++k) {
      const float got = ssm_gpu.get(reqs[i].slot * per_slot + k);
      if (!std::isfinite(got)) ++bad_nan;
      state_max = std::max(state_max, std::abs(ref_state[i][k]));
      state_err = std::max(state_err, std::abs(got - ref_state[i][k]));
    }
  }
  // Slots of no request and of requests with no tokens keep their bytes.
  for (int s = 0; s < slots; ++s) {
    bool owned = false;
    for (int i = 0; i < R; ++i) owned |= reqs[i].slot == s && c.tokens[i] > 0;
    if (owned) continue;
    const size_t es = dtype_size(c.ssm);
    slot_touched += std::memcmp(&ssm.bytes[s * per_slot * es], &ssm_gpu.bytes[s * per_slot * es],
                                per_slot * es) != 0;
  }
  const double out_rel = out_err / std::max(out_max, 1e-30);
  const double state_rel = state_err / std::max(state_max, 1e-30);
  std::cout << "[ ssd  ] heads " << H << " groups " << G << " P " << P << " N " << N << " chunk "
            << c.chunk << " state " << dtype_name(c.ssm) << " dt " << dtype_name(c.a) << " out "
            << dtype_name(c.out) << " y " << dtype_name(c.y) << ": out max|err| " << out_err
            << " (max|ref| " << out_max << ", " << out_rel << "), state max|err| " << state_err
            << " (max|ref| " << state_max << ", " << state_rel << ")\n";
  EXPECT_EQ(bad_nan, 0) << "non-finite outputs or states";
  EXPECT_EQ(pad_touched, 0) << "output columns past heads * head_dim were written";
  EXPECT_EQ(slot_touched, 0) << "slots the step does not own changed";
  // bf16 tensor-core operands (x, B, C, the masked weights, the state copy read for Y_off) carry
  // 2^-9 relative rounding each; fp32 accumulation. Outputs stored as 16-bit add their rounding.
  const double tol = 2e-2;
  EXPECT_LE(out_rel, tol);
  EXPECT_LE(state_rel, tol);
}

// Ragged: a single token, a chunk minus one, exactly one, one plus one, several chunks with a
// partial last one, and a long request.
const std::vector<int> kRagged = {1, 127, 128, 129, 300, 1000};

// `heads` heads of 64 in `groups` groups, state size `d_state`, chunks of `chunk` tokens, over the
// ragged requests (`has_init`: which start from their slot's state).
SsdCase ragged_case(int heads, int groups, int d_state, int chunk, std::vector<int> has_init) {
  return {.heads = heads,
          .groups = groups,
          .d_state = d_state,
          .chunk = chunk,
          .tokens = kRagged,
          .has_init = std::move(has_init)};
}

TEST(CudaLinearSsd, SmallDimsChunk64MatchesRecurrence) {
  SKIP_WITHOUT_GPU();
  check_ssd({.tokens = {1, 63, 64, 65, 200, 0, 130},
             .has_init = {1, 0, 1, 0, 1, 1, 1},
             .a_pad = 3,
             .out_pad = 3});  // odd row stride: element-wise output stores
}

TEST(CudaLinearSsd, SmallDimsChunk128DState128Bf16State) {
  SKIP_WITHOUT_GPU();
  SsdCase c = ragged_case(6, 3, 128, 128, {1, 1, 0, 1, 0, 1});
  c.ssm = c.a = c.out = DType::bf16;
  c.out_pad = 2;
  check_ssd(c);
}

TEST(CudaLinearSsd, OneGroupFp16Out) {
  SKIP_WITHOUT_GPU();
  check_ssd({.heads = 4,
             .groups = 1,
             .chunk = 128,
             .tokens = {129, 5, 256},
             .has_init = {0, 1, 1},
             .a = DType::f16,
             .out = DType::f16});
}

TEST(CudaLinearSsd, NemotronShapeFp32State) {
  SKIP_WITHOUT_GPU();
  SsdCase c = ragged_case(128, 8, 128, 128, {1, 0, 1, 1, 0, 1});
  c.a = c.out = DType::bf16;
  check_ssd(c);
}

TEST(CudaLinearSsd, NemotronShapeBf16StateChunk64) {
  SKIP_WITHOUT_GPU();
  SsdCase c = ragged_case(128, 8, 128, 64, {0, 1, 1, 0, 1, 1});
  c.ssm = DType::bf16;
  c.a = c.out = DType::f32;
  check_ssd(c);
}

// bf16 y (16-bit activations): x, B and C straight from y's rows, no workspace.
TEST(CudaLinearSsd, NemotronShapeBf16ConvOutputs) {
  SKIP_WITHOUT_GPU();
  SsdCase c = ragged_case(128, 8, 128, 128, {1, 0, 1, 1, 0, 1});
  c.a = c.out = c.y = DType::bf16;
  check_ssd(c);
}

TEST(CudaLinearSsd, SmallDimsChunk64Bf16ConvOutputsBf16State) {
  SKIP_WITHOUT_GPU();
  SsdCase c = ragged_case(6, 3, 64, 64, {1, 1, 0, 1, 0, 1});
  c.ssm = c.a = c.out = c.y = DType::bf16;
  c.out_pad = 3;
  check_ssd(c);
}

TEST(CudaLinearSsd, RejectsUnsupportedShapes) {
  SKIP_WITHOUT_GPU();
  cl::SsdParams p{};
  cl::LinReq r{1, 0, 4, 0, 0};
  p.step.reqs = &r;
  p.step.num_reqs = 1;
  p.state.heads = 4;
  p.state.rows = 64;
  p.state.cols = 64;
  p.groups = 2;
  p.state.conv_dim = 4 * 64 + 2 * 2 * 64;
  p.state.ssm_dtype = static_cast<cl::DTypeCode>(DType::f32);
  p.out_dtype = p.a_dtype = static_cast<cl::DTypeCode>(DType::f32);
  EXPECT_EQ(cl::launch_ssd_chunked(p, 4, 32, nullptr, nullptr), cudaErrorInvalidValue);  // chunk
  p.state.rows = 32;
  p.state.conv_dim = 4 * 32 + 2 * 2 * 64;
  EXPECT_EQ(cl::launch_ssd_chunked(p, 4, 64, nullptr, nullptr), cudaErrorInvalidValue);  // P
  p.state.rows = 64;
  p.state.conv_dim = 4 * 64 + 2 * 2 * 64;
  p.step.verify = 1;
  EXPECT_EQ(cl::launch_ssd_chunked(p, 4, 64, nullptr, nullptr), cudaErrorInvalidValue);
  p.step.verify = 0;
  ASSERT_GT(cl::ssd_chunked_workspace(p, 4, 64), 0u);
  EXPECT_EQ(cl::launch_ssd_chunked(p, 4, 64, nullptr, nullptr), cudaErrorInvalidValue);  // no ws
  cudaGetLastError();
}

// Kernel time at Nemotron-H-8B's shape (128 heads x head_dim 64, d_state 128, 8 groups, chunk
// 128): bf16 dt and out, fp32 state, no initial state, fp32 and bf16 y. Printed only: CUDA events
// around each launcher call (fp32 y: the B | C conversion and the scan; bf16 y: the scan) after 3
// warm-ups, median of 10. FLOPs are those
// of the dense chunked form per head and chunk (2 Q^2 N for C B^T, 2 Q^2 P for the masked scores
// times X, 2 Q P N each for the chunk state and for C h^T), as the torch chunked scan computes
// them.
TEST(CudaLinearSsd, ThroughputNemotronShape) {
  SKIP_WITHOUT_GPU();
  const int H = 128, P = 64, N = 128, G = 8, Q = 128;
  const int conv_dim = H * P + 2 * G * N;
  for (const auto& [R, L, yt] : std::vector<std::tuple<int, int, DType>>{{1, 8192, DType::f32},
                                                                         {8, 8192, DType::f32},
                                                                         {1, 8192, DType::bf16},
                                                                         {8, 8192, DType::bf16}}) {
    const int64_t T = int64_t{R} * L;
    HostArray y(yt, int64_t{L} * conv_dim);
    uint32_t x = 12345u;
    for (int64_t i = 0; i < y.size(); ++i) {
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      y.set(i, static_cast<float>(x >> 8) * (2.f / 16777216.f) - 1.f);
    }
    std::vector<uint16_t> a(static_cast<size_t>(T) * H);
    for (size_t i = 0; i < a.size(); ++i) a[i] = float_to_bf16(-4.f + 3.f * ((i * 37) % 97) / 97.f);
    const SsdDevice dev{DeviceMemory(R * sizeof(cl::LinReq)),
                        DeviceMemory(static_cast<size_t>(R + 1) * H * P * N * 4),
                        DeviceMemory(static_cast<size_t>(T) * conv_dim * dtype_size(yt)),
                        DeviceMemory(a.size() * 2),
                        DeviceMemory(H * 4),
                        DeviceMemory(H * 4),
                        DeviceMemory(H * 4),
                        DeviceMemory(static_cast<size_t>(T) * H * P * 2)};
    for (int r = 0; r < R; ++r) {
      ASSERT_EQ(cudaMemcpy(dev.y.as<unsigned char>() + y.bytes.size() * r, y.bytes.data(),
                           y.bytes.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    dev.a.upload(a.data());
    std::vector<cl::LinReq> reqs;
    for (int r = 0; r < R; ++r) reqs.push_back(cl::LinReq{1 + r, r * L, L, 0, 0});
    dev.reqs.upload(reqs.data());
    std::vector<float> params(H, 0.5f);
    dev.A_log.upload(params.data());
    dev.dt_bias.upload(params.data());
    dev.D.upload(params.data());

    // fp32 state, bf16 dt and out.
    const SsdCase c{.heads = H,
                    .groups = G,
                    .head_dim = P,
                    .d_state = N,
                    .chunk = Q,
                    .a = DType::bf16,
                    .out = DType::bf16,
                    .y = yt};
    const cl::SsdParams p = dev.params(c, R, L, H, int64_t{H} * P);
    DeviceMemory ws(cl::ssd_chunked_workspace(p, T, Q));

    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int i = 0; i < 3; ++i)
      ASSERT_EQ(cl::launch_ssd_chunked(p, T, Q, ws.ptr, nullptr), cudaSuccess);
    std::vector<float> ms;
    for (int i = 0; i < 10; ++i) {
      cudaEventRecord(e0);
      cl::launch_ssd_chunked(p, T, Q, ws.ptr, nullptr);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float m = 0;
      cudaEventElapsedTime(&m, e0, e1);
      ms.push_back(m);
    }
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    const double flops =
        double(T) * H * (2.0 * Q * N + 2.0 * Q * P + 4.0 * P * N);  // per token: one row of each
    const double bytes = double(T) * (conv_dim * double(dtype_size(yt)) + H * 2.0 + H * P * 2.0);
    std::cout << "[ perf ] ssd chunked " << R << " x " << L << " (heads " << H << ", P " << P
              << ", N " << N << ", groups " << G << ", chunk " << Q << ", y " << dtype_name(yt)
              << "): median " << med << " ms (min " << ms.front() << ", max " << ms.back() << "), "
              << flops / (med * 1e-3) / 1e12 << " TFLOP/s, " << T / (med * 1e-3) / 1e6
              << " M tokens/s, " << bytes / (med * 1e-3) / 1e12 << " TB/s of y/dt/out\n";
  }
}

#else

TEST(CudaLinearSsd, SkippedWithoutCuda) {
  GTEST_SKIP() << "attnrt was built without CUDA: " << query_cuda().reason;
}

#endif

}  // namespace
}  // namespace attnrt
