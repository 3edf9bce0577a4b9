// The float64 math of src/linear against the formulas of reference-semantics §8.8 and §8.9 written
// out here in their textbook form (S as a Dk x Dv matrix, h as head_dim x d_state), and the chunked
// form against the sequential one (chunk sizes 1, 3, 8 and longer than the sequence, strong
// decays included). Tolerance 1e-10 relative: both sides are float64.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "attnrt/linear/linear_math.h"
#include "test_linear_util.h"

using namespace attnrt;
using namespace attnrt::testing_linear;

namespace {

using Mat = std::vector<std::vector<double>>;

Mat zeros(int r, int c) { return Mat(r, std::vector<double>(c, 0.0)); }

double silu_ref(double x) { return x / (1 + std::exp(-x)); }
double softplus_ref(double x) { return x > 20 ? x : std::log(1 + std::exp(x)); }

linear::LayerParams params_of(const LayerData& d) {
  LinearArgs args;
  const LinearStateShape& sh = d.shape;
  args.conv_weight = TensorView(const_cast<float*>(d.conv_w.data()), DType::f32,
                                {sh.conv_dim, d.layer.linear.conv_kernel});
  args.conv_bias = TensorView(const_cast<float*>(d.conv_b.data()), DType::f32, {sh.conv_dim});
  args.A_log = TensorView(const_cast<float*>(d.A_log.data()), DType::f32, {sh.heads});
  args.dt_bias = TensorView(const_cast<float*>(d.dt_bias.data()), DType::f32,
                            {static_cast<int64_t>(d.dt_bias.size())});
  if (!d.D.empty()) args.D = TensorView(const_cast<float*>(d.D.data()), DType::f32, {sh.heads});
  return linear::read_params(args, d.layer);
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Conv outputs of a stream from a zero window, by the formula of §8.8.
std::vector<double> conv_ref(const LayerData& d, const Tokens& in) {
  const int K = d.layer.linear.conv_kernel, dim = d.shape.conv_dim;
  std::vector<double> y(static_cast<size_t>(in.n * dim));
  for (int64_t t = 0; t < in.n; ++t) {
    for (int c = 0; c < dim; ++c) {
      double acc = d.conv_b[c];
      for (int j = 0; j < K; ++j) {
        const int64_t src = t - (K - 1) + j;  // w[:, K-1] multiplies the newest input
        if (src >= 0) acc += double(d.conv_w[c * K + j]) * in.x[src * dim + c];
      }
      y[t * dim + c] = silu_ref(acc);
    }
  }
  return y;
}

// The recurrence of §8.9 for one stream from a zero state: outputs [T, heads * rows].
std::vector<double> recurrence_ref(const LayerData& d, const Tokens& in,
                                   const std::vector<double>& y) {
  const LayerSpec& l = d.layer;
  const int heads = d.shape.heads, dim = d.shape.conv_dim;
  std::vector<double> out(static_cast<size_t>(in.n * heads * d.shape.rows));
  if (l.kind == LayerKind::mamba2) {
    const int P = l.linear.head_v_dim, N = l.linear.d_state, G = l.linear.n_groups;
    std::vector<Mat> h(heads, zeros(P, N));
    for (int64_t t = 0; t < in.n; ++t) {
      const double* yt = &y[t * dim];
      for (int hh = 0; hh < heads; ++hh) {
        const int g = hh / (heads / G);
        const double* x = yt + hh * P;
        const double* B = yt + heads * P + g * N;
        const double* C = yt + heads * P + G * N + g * N;
        const double dt = softplus_ref(double(in.a[t * heads + hh]) + d.dt_bias[hh]);
        const double A = -std::exp(double(d.A_log[hh]));
        for (int p = 0; p < P; ++p) {
          double yp = 0;
          for (int n = 0; n < N; ++n) {
            h[hh][p][n] = std::exp(dt * A) * h[hh][p][n] + dt * x[p] * B[n];
            yp += h[hh][p][n] * C[n];
          }
          out[(t * heads + hh) * P + p] = yp + d.D[hh] * x[p];
        }
      }
    }
    return out;
  }
  const int Hk = l.linear.num_k_heads, Dk = l.linear.head_k_dim, Dv = l.linear.head_v_dim;
  std::vector<Mat> S(heads, zeros(Dk, Dv));  // S in R^{Dk x Dv}
  for (int64_t t = 0; t < in.n; ++t) {
    const double* yt = &y[t * dim];
    for (int hh = 0; hh < heads; ++hh) {
      const int kh = hh / (heads / Hk);
      std::vector<double> q(yt + kh * Dk, yt + (kh + 1) * Dk);
      std::vector<double> k(yt + Hk * Dk + kh * Dk, yt + Hk * Dk + (kh + 1) * Dk);
      const double* v = yt + 2 * Hk * Dk + hh * Dv;
      double nq = 0, nk = 0;
      for (int c = 0; c < Dk; ++c) {
        nq += q[c] * q[c];
        nk += k[c] * k[c];
      }
      for (int c = 0; c < Dk; ++c) {
        q[c] = q[c] / std::sqrt(nq + 1e-6) / std::sqrt(double(Dk));
        k[c] = k[c] / std::sqrt(nk + 1e-6);
      }
      const double beta = 1 / (1 + std::exp(-double(in.b[t * heads + hh])));
      for (int c = 0; c < Dk; ++c) {
        const double a = l.kind == LayerKind::gdn
                             ? double(in.a[t * heads + hh]) + d.dt_bias[hh]
                             : double(in.a[(t * heads + hh) * Dk + c]) + d.dt_bias[hh * Dk + c];
        const double g = -std::exp(double(d.A_log[hh])) * softplus_ref(a);
        for (int e = 0; e < Dv; ++e) S[hh][c][e] *= std::exp(g);
      }
      for (int e = 0; e < Dv; ++e) {
        double stk = 0;  // (S^T k)[e]
        for (int c = 0; c < Dk; ++c) stk += S[hh][c][e] * k[c];
        const double u = beta * (v[e] - stk);
        for (int c = 0; c < Dk; ++c) S[hh][c][e] += k[c] * u;
      }
      for (int e = 0; e < Dv; ++e) {
        double o = 0;
        for (int c = 0; c < Dk; ++c) o += S[hh][c][e] * q[c];
        out[(t * heads + hh) * Dv + e] = o;
      }
    }
  }
  return out;
}

void expect_near_all(const std::vector<double>& got, const std::vector<double>& want,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst_err = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    worst_err =
        std::max(worst_err, std::abs(got[i] - want[i]) / (1e-12 + 1e-10 * std::abs(want[i])));
  }
  EXPECT_LE(worst_err, 1.0) << what << ": worst error " << worst_err << " x the tolerance";
}

class LinearMath : public testing::TestWithParam<LayerKind> {};

TEST_P(LinearMath, SequentialStepsFollowTheFormulas) {
  std::mt19937 rng(11 + static_cast<int>(GetParam()));
  const LayerData d(small_layer(GetParam()), rng);
  const linear::LayerParams p = params_of(d);
  const Tokens in = random_tokens(d, 9, rng);
  std::vector<double> window(static_cast<size_t>(d.shape.conv_elems()), 0.0);
  std::vector<double> state(static_cast<size_t>(d.shape.ssm_elems()), 0.0);
  std::vector<double> y(in.x.size()), out(static_cast<size_t>(in.n * d.out_width()));
  const std::vector<double> x = to_double(in.x), a = to_double(in.a), b = to_double(in.b);
  for (int64_t t = 0; t < in.n; ++t) {
    linear::conv_step(p, window, &x[t * d.shape.conv_dim], &y[t * d.shape.conv_dim]);
    linear::recurrent_step(p, state, &y[t * d.shape.conv_dim], &a[t * d.a_width],
                           b.empty() ? nullptr : &b[t * d.b_width], &out[t * d.out_width()]);
  }
  const std::vector<double> y_ref = conv_ref(d, in);
  expect_near_all(y, y_ref, "conv outputs");
  expect_near_all(out, recurrence_ref(d, in, y_ref), "recurrence outputs");
  // The window holds the last K - 1 inputs, oldest first.
  const int w = d.shape.conv_width, dim = d.shape.conv_dim;
  expect_near_all(window, std::vector<double>(x.end() - int64_t{w} * dim, x.end()), "conv window");
}

TEST_P(LinearMath, ChunkedFormEqualsSequentialForAnyChunkAndStrongDecay) {
  for (bool strong : {false, true}) {
    std::mt19937 rng(23 + static_cast<int>(GetParam()));
    LayerData d(small_layer(GetParam()), rng);
    // Strong decay: exp(A_log) ~ 20 and large gate inputs; a chunk's total decay underflows.
    if (strong) {
      for (float& e : d.A_log) e += 3.f;
    }
    const linear::LayerParams p = params_of(d);
    Tokens in = random_tokens(d, 19, rng);
    if (strong) {
      for (float& e : in.a) e += 4.f;
    }
    const std::vector<double> x = to_double(in.x), a = to_double(in.a), b = to_double(in.b);
    const double* bp = b.empty() ? nullptr : b.data();
    // A non-zero start state and window: continue a cached prefix.
    std::vector<double> window0(static_cast<size_t>(d.shape.conv_elems()));
    std::vector<double> state0(static_cast<size_t>(d.shape.ssm_elems()));
    std::uniform_real_distribution<double> u(-0.5, 0.5);
    for (double& e : window0) e = u(rng);
    for (double& e : state0) e = u(rng);

    std::vector<double> win_s = window0, st_s = state0, y_s(x.size());
    std::vector<double> out_s(static_cast<size_t>(in.n * d.out_width()));
    for (int64_t t = 0; t < in.n; ++t) {
      linear::conv_step(p, win_s, &x[t * d.shape.conv_dim], &y_s[t * d.shape.conv_dim]);
      linear::recurrent_step(p, st_s, &y_s[t * d.shape.conv_dim], &a[t * d.a_width],
                             bp ? bp + t * d.b_width : nullptr, &out_s[t * d.out_width()]);
    }
    for (int chunk : {1, 3, 8, 64}) {
      std::vector<double> win_c = window0, st_c = state0, y_c(x.size());
      std::vector<double> out_c(out_s.size());
      linear::conv_sequence(p, win_c, in.n, x.data(), y_c.data());
      linear::recurrent_chunked(p, st_c, in.n, y_c.data(), a.data(), bp, chunk, out_c.data());
      const std::string what = fmt::format("chunk {}{}", chunk, strong ? ", strong decay" : "");
      expect_near_all(y_c, y_s, what + ": conv outputs");
      expect_near_all(win_c, win_s, what + ": conv window");
      expect_near_all(out_c, out_s, what + ": outputs");
      expect_near_all(st_c, st_s, what + ": state");
      for (double e : st_c) ASSERT_TRUE(std::isfinite(e)) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, LinearMath,
                         testing::Values(LayerKind::gdn, LayerKind::kda, LayerKind::mamba2),
                         [](const auto& info) { return kind_label(info.param); });

TEST(LinearMathScalars, SoftplusSwitchesToIdentityAbove20) {
  EXPECT_DOUBLE_EQ(linear::softplus(25.0), 25.0);
  EXPECT_NEAR(linear::softplus(0.0), std::log(2.0), 1e-15);
  EXPECT_NEAR(linear::softplus(-30.0), std::exp(-30.0), 1e-25);
  EXPECT_NEAR(linear::sigmoid(0.3), 1 / (1 + std::exp(-0.3)), 1e-15);
  EXPECT_NEAR(linear::silu(-1.5), -1.5 / (1 + std::exp(1.5)), 1e-15);
}

TEST(LinearMathScalars, ChunkSizeMustBePositive) {
  std::mt19937 rng(3);
  const LayerData d(small_layer(LayerKind::gdn), rng);
  const linear::LayerParams p = params_of(d);
  std::vector<double> state(static_cast<size_t>(d.shape.ssm_elems()));
  expect_error(
      [&] { linear::recurrent_chunked(p, state, 0, nullptr, nullptr, nullptr, 0, nullptr); },
      {"chunk size 0 is invalid"});
}

}  // namespace
