// The cuda backend's chunked delta-rule kernel (backends/cuda/kernels/linear_delta_chunked.cu,
// `launch_delta_chunked`) against the float64 sequential form of src/linear (recurrent_step over
// each request's tokens): GDN and KDA, head dims 64 and 128, ragged requests (1 .. 1000 tokens,
// chunk boundaries on and off, an empty request, rows between requests that no request owns),
// with and without an initial state, fp32 / bf16 states, fp32 / bf16 / fp16 gates and outputs,
// fp32 / bf16 conv outputs y (the reference reads the bf16-rounded values), strong KDA decays.
// Device buffers are filled by hand (no backend object). Outputs are poisoned with NaN first, so
// unwritten elements show; slots no request touches must keep their bytes. One more test prints
// (never asserts) the kernel time at 8 x 8192 tokens for the Qwen3-Next GDN and Kimi-Linear KDA
// shapes, with fp32 and with bf16 y. Skips (with the reason) where no CUDA device is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
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

namespace cl = cuda::linear;

constexpr int kChunk = 64;

// Relative tolerance of the checks: bf16 tensor-core products with fp32 accumulation and fp32
// state; max |gpu - ref| <= kTol * max |ref| over each compared tensor.
constexpr double kTol = 2e-2;

using test::DeviceMemory;

class CudaLinearChunked : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

// Raw bytes of `n` elements of dtype `t`, filled from `values` (rounded to `t`); `values` is
// replaced by the rounded numbers, so that the reference sees exactly what the kernel reads.
std::vector<uint8_t> encode(std::vector<float>& values, DType t) {
  std::vector<uint8_t> raw(values.size() * dtype_size(t));
  for (size_t i = 0; i < values.size(); ++i) {
    store_from_float(raw.data(), t, i, values[i]);
    values[i] = load_as_float(raw.data(), t, i);
  }
  return raw;
}

struct ChunkedCase {
  bool kda = false;
  int hk = 2, hv = 4, dk = 64, dv = 64;
  DType state = DType::f32, gates = DType::f32, out = DType::f32;
  DType y = DType::f32;                   // the conv outputs (y_dtype): f32 or bf16
  std::vector<int> lens, slots, initial;  // per request
  int gap = 0;                            // rows no request owns, before each request
  int num_slots = 8;
  int out_pad = 0;  // output rows hv * dv + out_pad elements apart
  float a_lo = -4.1f, a_hi = 1.3f;  // gate inputs: decays about e^-0.01 .. e^-2 per token
};

struct Inputs {
  int conv_dim = 0, a_width = 0;
  int64_t rows = 0;
  std::vector<int32_t> starts;
  std::vector<float> y, a, b, A_log, dt_bias, state;
};

Inputs make_inputs(const ChunkedCase& c, std::mt19937& rng) {
  Inputs in;
  in.conv_dim = 2 * c.hk * c.dk + c.hv * c.dv;
  in.a_width = c.kda ? c.hv * c.dk : c.hv;
  int64_t row = 0;
  for (int len : c.lens) {
    row += c.gap;
    in.starts.push_back(static_cast<int32_t>(row));
    row += len;
  }
  in.rows = row + c.gap;
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> ua(c.a_lo, c.a_hi), small(-0.3f, 0.3f);
  in.y.resize(static_cast<size_t>(in.rows * in.conv_dim));
  for (float& v : in.y) v = normal(rng);
  in.a.resize(static_cast<size_t>(in.rows * in.a_width));
  for (float& v : in.a) v = ua(rng);
  in.b.resize(static_cast<size_t>(in.rows * c.hv));
  for (float& v : in.b) v = normal(rng);
  in.A_log.resize(c.hv);
  for (float& v : in.A_log) v = small(rng);
  in.dt_bias.resize(c.kda ? c.hv * c.dk : c.hv);
  for (float& v : in.dt_bias) v = small(rng);
  in.state.resize(static_cast<size_t>(c.num_slots) * c.hv * c.dv * c.dk);
  for (float& v : in.state) v = 0.5f * normal(rng);
  return in;
}

linear::LayerParams layer_params(const ChunkedCase& c, const Inputs& in) {
  linear::LayerParams lp;
  lp.kind = c.kda ? LayerKind::kda : LayerKind::gdn;
  lp.shape.conv_dim = in.conv_dim;
  lp.shape.heads = c.hv;
  lp.shape.rows = c.dv;
  lp.shape.cols = c.dk;
  lp.key_heads = c.hk;
  lp.key_dim = c.dk;
  lp.scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
  lp.A_log.assign(in.A_log.begin(), in.A_log.end());
  lp.dt_bias.assign(in.dt_bias.begin(), in.dt_bias.end());
  return lp;
}

// Device buffers of one case (`rows` rows of inputs and outputs, `state_bytes` of state slots) and
// the parameter block pointing into them.
struct DeviceCase {
  DeviceMemory reqs, y, a, b, A_log, dt_bias, state, out;
  cl::DeltaParams p{};
  DeviceCase(const ChunkedCase& c, int conv_dim, int a_width, int64_t rows, size_t state_bytes)
      : reqs(sizeof(cl::LinReq) * std::max<size_t>(c.lens.size(), 1)),
        y(static_cast<size_t>(rows) * conv_dim * dtype_size(c.y)),
        a(static_cast<size_t>(rows) * a_width * dtype_size(c.gates)),
        b(static_cast<size_t>(rows) * c.hv * dtype_size(c.gates)),
        A_log(static_cast<size_t>(c.hv) * 4),
        dt_bias(static_cast<size_t>(c.kda ? c.hv * c.dk : c.hv) * 4),
        state(state_bytes),
        out(static_cast<size_t>(rows) * (c.hv * c.dv + c.out_pad) * dtype_size(c.out)) {
    p.step.reqs = reqs.as<const cl::LinReq>();
    p.step.num_reqs = static_cast<int32_t>(c.lens.size());
    p.step.max_tokens = c.lens.empty() ? 0 : *std::max_element(c.lens.begin(), c.lens.end());
    p.state.ssm = state.ptr;
    p.state.ssm_dtype = static_cast<cl::DTypeCode>(c.state);
    p.state.conv_dim = conv_dim;
    p.state.heads = c.hv;
    p.state.rows = c.dv;
    p.state.cols = c.dk;
    p.kda = c.kda ? 1 : 0;
    p.key_heads = c.hk;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dk)));
    p.y = y.ptr;
    p.y_dtype = static_cast<cl::DTypeCode>(c.y);
    p.a = a.ptr;
    p.a_stride = a_width;
    p.a_dtype = static_cast<cl::DTypeCode>(c.gates);
    p.b = b.ptr;
    p.b_stride = c.hv;
    p.b_dtype = static_cast<cl::DTypeCode>(c.gates);
    p.A_log = A_log.as<const float>();
    p.dt_bias = dt_bias.as<const float>();
    p.out = out.ptr;
    p.out_stride = static_cast<int64_t>(c.hv) * c.dv + c.out_pad;
    p.out_dtype = static_cast<cl::DTypeCode>(c.out);
  }
};

// Runs the chunked kernel on one case and compares with the float64 recurrence.
void check_chunked(const ChunkedCase& c) {
  const uint32_t seed = std::random_device{}();
  std::printf("[ seed %u ] %s hk=%d hv=%d dk=%d dv=%d state=%s gates=%s out=%s y=%s\n", seed,
              c.kda ? "kda" : "gdn", c.hk, c.hv, c.dk, c.dv, dtype_name(c.state).data(),
              dtype_name(c.gates).data(), dtype_name(c.out).data(), dtype_name(c.y).data());
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  Inputs in = make_inputs(c, rng);
  const std::vector<uint8_t> a_raw = encode(in.a, c.gates), b_raw = encode(in.b, c.gates);
  const std::vector<uint8_t> state_raw = encode(in.state, c.state), y_raw = encode(in.y, c.y);
  const int64_t out_width = static_cast<int64_t>(c.hv) * c.dv;
  const int64_t out_stride = out_width + c.out_pad;
  const size_t out_bytes = static_cast<size_t>(in.rows * out_stride) * dtype_size(c.out);

  DeviceCase dev(c, in.conv_dim, in.a_width, in.rows, state_raw.size());
  std::vector<cl::LinReq> reqs(c.lens.size());
  for (size_t r = 0; r < c.lens.size(); ++r) {
    reqs[r].slot = c.slots[r];
    reqs[r].token_start = in.starts[r];
    reqs[r].tokens = c.lens[r];
    reqs[r].has_initial_state = c.initial[r];
  }
  dev.reqs.upload(reqs.data());
  dev.y.upload(y_raw.data());
  dev.a.upload(a_raw.data());
  dev.b.upload(b_raw.data());
  dev.A_log.upload(in.A_log.data());
  dev.dt_bias.upload(in.dt_bias.data());
  dev.state.upload(state_raw.data());
  ASSERT_EQ(cudaMemset(dev.out.ptr, 0xff, out_bytes), cudaSuccess);  // NaN in every dtype

  const size_t ws_bytes = cl::delta_chunked_workspace(dev.p, in.rows, kChunk);
  ASSERT_GT(ws_bytes, 0u);
  DeviceMemory ws(ws_bytes);
  ASSERT_EQ(cl::launch_delta_chunked(dev.p, in.rows, kChunk, ws.ptr, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<uint8_t> out_raw(out_bytes), state_after(state_raw.size());
  dev.out.download(out_raw.data());
  dev.state.download(state_after.data());

  // The reference, request by request; rows no request owns must still be NaN.
  const linear::LayerParams lp = layer_params(c, in);
  const int64_t per_slot = static_cast<int64_t>(c.hv) * c.dv * c.dk;
  std::vector<bool> owned(static_cast<size_t>(in.rows), false), touched(c.num_slots, false);
  double out_err = 0, out_max = 0, st_err = 0, st_max = 0;
  int64_t worst_row = -1, worst_col = -1;
  std::vector<double> y_t(in.conv_dim), a_t(in.a_width), b_t(c.hv), o_t(out_width);
  for (size_t r = 0; r < c.lens.size(); ++r) {
    if (c.lens[r] == 0) continue;
    touched[c.slots[r]] = true;
    std::vector<double> S(static_cast<size_t>(per_slot), 0.0);
    if (c.initial[r]) {
      for (int64_t i = 0; i < per_slot; ++i) S[i] = in.state[c.slots[r] * per_slot + i];
    }
    for (int t = 0; t < c.lens[r]; ++t) {
      const int64_t row = in.starts[r] + t;
      owned[row] = true;
      for (int i = 0; i < in.conv_dim; ++i) y_t[i] = in.y[row * in.conv_dim + i];
      for (int i = 0; i < in.a_width; ++i) a_t[i] = in.a[row * in.a_width + i];
      for (int i = 0; i < c.hv; ++i) b_t[i] = in.b[row * c.hv + i];
      linear::recurrent_step(lp, S, y_t.data(), a_t.data(), b_t.data(), o_t.data());
      for (int64_t i = 0; i < out_width; ++i) {
        const double got = load_as_float(out_raw.data(), c.out, row * out_stride + i);
        const double err = std::isnan(got) ? INFINITY : std::abs(got - o_t[i]);
        if (err > out_err) {
          out_err = err;
          worst_row = row;
          worst_col = i;
        }
        out_max = std::max(out_max, std::abs(o_t[i]));
      }
    }
    for (int64_t i = 0; i < per_slot; ++i) {
      const double got = load_as_float(state_after.data(), c.state, c.slots[r] * per_slot + i);
      st_err = std::max(st_err, std::isnan(got) ? INFINITY : std::abs(got - S[i]));
      st_max = std::max(st_max, std::abs(S[i]));
    }
  }
  std::printf("  out: max err %.3e, max |ref| %.3e, ratio %.2e (worst row %lld col %lld); "
              "state: max err %.3e, max |ref| %.3e, ratio %.2e\n",
              out_err, out_max, out_err / out_max, static_cast<long long>(worst_row),
              static_cast<long long>(worst_col), st_err, st_max, st_err / st_max);
  EXPECT_LE(out_err, kTol * out_max);
  EXPECT_LE(st_err, kTol * st_max);
  int64_t written_unowned = 0;
  for (int64_t row = 0; row < in.rows; ++row) {
    for (int64_t i = owned[row] ? out_width : 0; i < out_stride; ++i)
      written_unowned += !std::isnan(load_as_float(out_raw.data(), c.out, row * out_stride + i));
  }
  EXPECT_EQ(written_unowned, 0)
      << "output elements written outside the requests' rows or past the heads in a row";
  const size_t slot_bytes = static_cast<size_t>(per_slot) * dtype_size(c.state);
  for (int s = 0; s < c.num_slots; ++s) {
    if (touched[s]) continue;
    EXPECT_EQ(std::memcmp(state_after.data() + s * slot_bytes, state_raw.data() + s * slot_bytes,
                          slot_bytes),
              0)
        << "slot " << s << " changed, but no request with tokens uses it";
  }
}

// Lengths on and off the chunk boundary, a one-token and an empty request, a long one.
ChunkedCase ragged(bool kda, int dk) {
  ChunkedCase c;
  c.kda = kda;
  c.dk = c.dv = dk;
  c.hk = kda ? 4 : 2;
  c.hv = 4;
  c.lens = {1, 63, 64, 65, 0, 200, 1000};
  c.slots = {3, 1, 5, 2, 6, 7, 4};
  c.initial = {1, 0, 1, 0, 1, 1, 1};
  c.gap = 3;
  return c;
}

TEST_F(CudaLinearChunked, GdnMatchesRecurrenceOnRaggedRequests) { check_chunked(ragged(false, 64)); }

TEST_F(CudaLinearChunked, KdaMatchesRecurrenceOnRaggedRequests) { check_chunked(ragged(true, 64)); }

TEST_F(CudaLinearChunked, Bf16StateGatesAndOutputs) {
  for (bool kda : {false, true}) {
    ChunkedCase c = ragged(kda, 64);
    c.state = c.gates = c.out = DType::bf16;
    check_chunked(c);
  }
}

// bf16 y, as the backend stores it for 16-bit activations: bf16 gates and outputs, both head
// dims, fp32 (GDN) and bf16 (KDA) states.
TEST_F(CudaLinearChunked, Bf16ConvOutputs) {
  for (bool kda : {false, true}) {
    for (int dk : {64, 128}) {
      ChunkedCase c = ragged(kda, dk);
      c.y = c.gates = c.out = DType::bf16;
      c.state = kda ? DType::bf16 : DType::f32;
      check_chunked(c);
    }
  }
}

TEST_F(CudaLinearChunked, Fp16GatesAndOutputs) {
  ChunkedCase c = ragged(true, 64);
  c.gates = c.out = DType::f16;
  check_chunked(c);
}

TEST_F(CudaLinearChunked, HeadDim128) {
  for (bool kda : {false, true}) {
    ChunkedCase c;
    c.kda = kda;
    c.dk = c.dv = 128;
    c.hk = kda ? 4 : 2;
    c.hv = 4;
    c.lens = {1, 65, 200, 640};
    c.slots = {2, 6, 1, 3};
    c.initial = {1, 1, 0, 1};
    c.gap = 1;
    c.state = kda ? DType::f32 : DType::bf16;
    c.out = kda ? DType::f32 : DType::bf16;
    check_chunked(c);
  }
}

// The warp-specialised state pass at head dim 128 on ragged requests (tails, one token, an empty
// request, a ring of two stages wrapping many times), bf16 states for both kinds; GDN's output
// rows are an odd number of elements apart (the pass's one-by-one output stores), KDA's aligned
// (its 4-element vector stores).
TEST_F(CudaLinearChunked, HeadDim128RaggedBf16StatesAndOddOutputStride) {
  for (bool kda : {false, true}) {
    ChunkedCase c = ragged(kda, 128);
    c.state = DType::bf16;
    c.out = kda ? DType::bf16 : DType::f16;
    c.out_pad = kda ? 0 : 3;
    check_chunked(c);
  }
}

// Per-token decays down to about e^-16 per channel: a 16-token block spans e^-250, far beyond
// fp32's range if the ratios were formed from e^{+-G} alone.
TEST_F(CudaLinearChunked, KdaStrongDecaysStayFinite) {
  ChunkedCase c = ragged(true, 64);
  c.a_lo = -6.f;
  c.a_hi = 12.f;
  check_chunked(c);
}

TEST_F(CudaLinearChunked, GroupedKeyHeads) {
  ChunkedCase c = ragged(false, 64);
  c.hk = 1;
  c.hv = 3;
  check_chunked(c);
}

TEST(CudaLinearChunkedArgs, RejectsWhatItDoesNotSupport) {
  cl::DeltaParams p{};
  p.step.num_reqs = 1;
  p.state.heads = 4;
  p.state.rows = p.state.cols = 64;
  p.key_heads = 2;
  p.state.conv_dim = 2 * 2 * 64 + 4 * 64;
  char dummy[16];
  EXPECT_EQ(cl::launch_delta_chunked(p, 64, 32, dummy, nullptr), cudaErrorInvalidValue)
      << "chunk 32";
  EXPECT_EQ(cl::delta_chunked_workspace(p, 64, 32), 0u);
  cl::DeltaParams q = p;
  q.state.rows = q.state.cols = 96;
  q.state.conv_dim = 2 * 2 * 96 + 4 * 96;
  EXPECT_EQ(cl::launch_delta_chunked(q, 64, kChunk, dummy, nullptr), cudaErrorInvalidValue)
      << "head dim 96";
  q = p;
  q.step.verify = 1;
  EXPECT_EQ(cl::launch_delta_chunked(q, 64, kChunk, dummy, nullptr), cudaErrorInvalidValue)
      << "verify step";
  q = p;
  q.state.conv_dim += 1;
  EXPECT_EQ(cl::launch_delta_chunked(q, 64, kChunk, dummy, nullptr), cudaErrorInvalidValue)
      << "conv_dim that does not match the heads";
}

// 8 requests x 8192 tokens, conv outputs of dtype `y_dtype`, bf16 gates and outputs, fp32 state
// with an initial state. Prints the median of 7 timed runs; FLOPs counted per (chunk, head) as the
// kernels do them: kk and qk 4 C^2 Dk, the substitution C^2 (Dk + Dv), W S^T, Qd S^T and the
// state update 6 C Dk Dv, qk u 2 C^2 Dv.
void time_shape(bool kda, int hk, int hv, int d, DType y_dtype) {
  constexpr int kReqs = 8, kLen = 8192;
  const int conv_dim = 2 * hk * d + hv * d, a_width = kda ? hv * d : hv;
  const int64_t rows = int64_t{kReqs} * kLen;
  // Random blocks of 4096 rows repeated over the step (generating 2-3 GB on the host is slow).
  constexpr int64_t kBlock = 4096;
  std::mt19937 rng(12345);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> ua(-4.1f, 1.3f), small(-0.3f, 0.3f);
  std::vector<float> y_blk(static_cast<size_t>(kBlock * conv_dim)), a_blk(kBlock * a_width);
  std::vector<float> b_blk(kBlock * hv);
  for (float& v : y_blk) v = normal(rng);
  for (float& v : a_blk) v = ua(rng);
  for (float& v : b_blk) v = normal(rng);
  const std::vector<uint8_t> a_raw = encode(a_blk, DType::bf16), b_raw = encode(b_blk, DType::bf16);
  const std::vector<uint8_t> y_raw = encode(y_blk, y_dtype);
  std::vector<float> A_log_h(hv), dt_bias_h(kda ? hv * d : hv);
  for (float& v : A_log_h) v = small(rng);
  for (float& v : dt_bias_h) v = small(rng);
  const int slots = kReqs + 1;
  const size_t state_bytes = static_cast<size_t>(slots) * hv * d * d * 4;
  // fp32 state, bf16 gates and outputs.
  ChunkedCase c;
  c.kda = kda;
  c.hk = hk;
  c.hv = hv;
  c.dk = c.dv = d;
  c.gates = c.out = DType::bf16;
  c.y = y_dtype;
  c.lens.assign(kReqs, kLen);
  DeviceCase dev(c, conv_dim, a_width, rows, state_bytes);
  dev.p.scale = 1.f / std::sqrt(static_cast<float>(d));
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    ASSERT_EQ(cudaMemcpy(dev.y.as<uint8_t>() + r0 * conv_dim * dtype_size(y_dtype), y_raw.data(),
                         y_raw.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev.a.as<uint8_t>() + r0 * a_width * 2, a_raw.data(), a_raw.size(),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev.b.as<uint8_t>() + r0 * hv * 2, b_raw.data(), b_raw.size(),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  dev.A_log.upload(A_log_h.data());
  dev.dt_bias.upload(dt_bias_h.data());
  ASSERT_EQ(cudaMemset(dev.state.ptr, 0, state_bytes), cudaSuccess);
  std::vector<cl::LinReq> reqs(kReqs);
  for (int r = 0; r < kReqs; ++r) {
    reqs[r].slot = r + 1;
    reqs[r].token_start = r * kLen;
    reqs[r].tokens = kLen;
    reqs[r].has_initial_state = 1;
  }
  dev.reqs.upload(reqs.data());
  const cl::DeltaParams& p = dev.p;
  const size_t ws_bytes = cl::delta_chunked_workspace(p, rows, kChunk);
  DeviceMemory ws(ws_bytes);
  cudaEvent_t e0, e1;
  ASSERT_EQ(cudaEventCreate(&e0), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&e1), cudaSuccess);
  std::vector<float> ms;
  for (int it = 0; it < 10; ++it) {
    ASSERT_EQ(cudaEventRecord(e0), cudaSuccess);
    ASSERT_EQ(cl::launch_delta_chunked(p, rows, kChunk, ws.ptr, nullptr), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(e1), cudaSuccess);
    ASSERT_EQ(cudaEventSynchronize(e1), cudaSuccess);
    float t = 0;
    ASSERT_EQ(cudaEventElapsedTime(&t, e0, e1), cudaSuccess);
    if (it >= 3) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double C = kChunk, chunk_heads = static_cast<double>(rows) / kChunk * hv;
  const double flops =
      chunk_heads * (4 * C * C * d + C * C * 2 * d + 6 * C * d * d + 2 * C * C * d);
  std::printf(
      "[ timing ] %s %dx%d hk=%d hv=%d d=%d y=%s: median %.3f ms (min %.3f, max %.3f), "
      "%.1f TFLOP/s, workspace %.2f GiB\n",
      kda ? "kda" : "gdn", kReqs, kLen, hk, hv, d, dtype_name(y_dtype).data(), med, ms.front(),
      ms.back(), flops / (med * 1e-3) / 1e12, ws_bytes / double(1 << 30));
  std::vector<uint16_t> probe(4096);
  ASSERT_EQ(cudaMemcpy(probe.data(), dev.out.ptr, probe.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  int nan = 0;
  for (uint16_t v : probe) nan += std::isnan(bf16_to_float(v));
  EXPECT_EQ(nan, 0) << "the timed runs produced NaN outputs";
}

TEST_F(CudaLinearChunked, TimingAt8x8192) {
  for (DType y : {DType::f32, DType::bf16}) {
    time_shape(false, 16, 32, 128, y);  // Qwen3-Next GDN
    time_shape(true, 32, 32, 128, y);   // Kimi-Linear KDA
  }
}

#else

TEST(CudaLinearChunked, SkippedWithoutCuda) {
  GTEST_SKIP() << "attnrt was built without CUDA: " << query_cuda().reason;
}

#endif

}  // namespace
}  // namespace attnrt
