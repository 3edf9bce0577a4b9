#include "attnrt/linear/linear_math.h"

#include <algorithm>
#include <cmath>

#include "attnrt/core/error.h"

namespace attnrt::linear {

namespace {

std::vector<double> read_vector(const TensorView& t) {
  std::vector<double> out(static_cast<size_t>(t.empty() ? 0 : t.numel()));
  // Parameters are small and may be strided views; walk them element by element.
  for (int64_t i = 0; i < static_cast<int64_t>(out.size()); ++i) {
    int64_t offset = 0, rest = i;
    for (int d = t.ndim - 1; d >= 0; --d) {
      offset += (rest % t.shape[d]) * t.strides[d];
      rest /= t.shape[d];
    }
    out[static_cast<size_t>(i)] = load_as_float(t.data, t.dtype, static_cast<size_t>(offset));
  }
  return out;
}

// The per-token inputs of one delta-rule head (gdn / kda) after the conv: L2-normalised q (times
// the query scale) and k, v, the per-channel log decay g and beta.
struct DeltaToken {
  std::vector<double> q, k, g;
  const double* v = nullptr;
  double beta = 0;
};

void l2_normalise(std::vector<double>& x, double scale) {
  double ss = 0;
  for (double e : x) ss += e * e;
  const double f = scale / std::sqrt(ss + 1e-6);
  for (double& e : x) e *= f;
}

DeltaToken delta_token(const LayerParams& p, int h, const double* y, const double* a,
                       const double* b) {
  const int dk = p.key_dim, hk = p.key_heads, hv = p.shape.heads;
  const int kh = h / (hv / hk);
  DeltaToken t;
  t.q.assign(y + static_cast<int64_t>(kh) * dk, y + static_cast<int64_t>(kh + 1) * dk);
  const double* k = y + static_cast<int64_t>(hk) * dk + static_cast<int64_t>(kh) * dk;
  t.k.assign(k, k + dk);
  t.v = y + 2 * static_cast<int64_t>(hk) * dk + static_cast<int64_t>(h) * p.shape.rows;
  l2_normalise(t.q, p.scale);
  l2_normalise(t.k, 1.0);
  const double decay_rate = -std::exp(p.A_log[h]);
  t.g.resize(dk);
  if (p.kind == LayerKind::gdn) {
    std::fill(t.g.begin(), t.g.end(), decay_rate * softplus(a[h] + p.dt_bias[h]));
  } else {
    for (int c = 0; c < dk; ++c) {
      const int64_t i = static_cast<int64_t>(h) * dk + c;
      t.g[c] = decay_rate * softplus(a[i] + p.dt_bias[i]);
    }
  }
  t.beta = sigmoid(b[h]);
  return t;
}

// The per-token inputs of one Mamba2 head after the conv.
struct SsdToken {
  const double *x, *B, *C;
  double dt, log_decay;  // dt = softplus(dt + dt_bias); log_decay = dt * A
};

SsdToken ssd_token(const LayerParams& p, int h, const double* y, const double* a) {
  const int heads = p.shape.heads, hd = p.shape.rows, n = p.key_dim, groups = p.key_heads;
  const int grp = h / (heads / groups);
  const int64_t xw = static_cast<int64_t>(heads) * hd;
  SsdToken t;
  t.x = y + static_cast<int64_t>(h) * hd;
  t.B = y + xw + static_cast<int64_t>(grp) * n;
  t.C = y + xw + static_cast<int64_t>(groups) * n + static_cast<int64_t>(grp) * n;
  t.dt = softplus(a[h] + p.dt_bias[h]);
  t.log_decay = t.dt * -std::exp(p.A_log[h]);
  return t;
}

void delta_chunk(const LayerParams& p, int h, double* S, int64_t C, const double* y,
                 const double* a, const double* b, double* out) {
  const int dk = p.key_dim, dv = p.shape.rows;
  const int64_t yw = p.shape.conv_dim, aw = p.gate_a_width(), bw = p.gate_b_width();
  const int64_t ow = p.out_width();
  std::vector<DeltaToken> tok;
  tok.reserve(static_cast<size_t>(C));
  for (int64_t t = 0; t < C; ++t)
    tok.push_back(delta_token(p, h, y + t * yw, a + t * aw, b + t * bw));
  // Cumulative log decay per channel from the chunk start: G[t][c] = sum_{i <= t} g_i[c].
  std::vector<double> G(static_cast<size_t>(C * dk));
  for (int64_t t = 0; t < C; ++t) {
    for (int c = 0; c < dk; ++c) G[t * dk + c] = (t > 0 ? G[(t - 1) * dk + c] : 0.0) + tok[t].g[c];
  }
  // Decayed inner products of token t with an earlier token i <= t:
  //   kk[t][i] = sum_c k_t[c] k_i[c] exp(G_t[c] - G_i[c]), qk[t][i] likewise with q_t.
  // Differences of cumulative sums, never exp(G_t) / exp(G_i): a chunk's total decay can
  // underflow.
  std::vector<double> kk(static_cast<size_t>(C * C), 0.0), qk(static_cast<size_t>(C * C), 0.0);
  for (int64_t t = 0; t < C; ++t) {
    for (int64_t i = 0; i <= t; ++i) {
      double skk = 0, sqk = 0;
      if (p.kind == LayerKind::gdn) {  // one decay for every channel
        for (int c = 0; c < dk; ++c) {
          skk += tok[t].k[c] * tok[i].k[c];
          sqk += tok[t].q[c] * tok[i].k[c];
        }
        const double e = std::exp(G[t * dk] - G[i * dk]);
        skk *= e;
        sqk *= e;
      } else {
        for (int c = 0; c < dk; ++c) {
          const double e = std::exp(G[t * dk + c] - G[i * dk + c]) * tok[i].k[c];
          skk += tok[t].k[c] * e;
          sqk += tok[t].q[c] * e;
        }
      }
      kk[t * C + i] = skk;
      qk[t * C + i] = sqk;
    }
  }
  // The chunk's start state seen by token t: e^{G_t} (.) k_t and e^{G_t} (.) q_t against S0.
  std::vector<double> kd(static_cast<size_t>(C * dk)), qd(static_cast<size_t>(C * dk));
  for (int64_t t = 0; t < C; ++t) {
    for (int c = 0; c < dk; ++c) {
      const double e = std::exp(G[t * dk + c]);
      kd[t * dk + c] = e * tok[t].k[c];
      qd[t * dk + c] = e * tok[t].q[c];
    }
  }
  // u_t = beta_t (v_t - S0^T (e^{G_t} k_t) - sum_{i<t} kk[t][i] u_i): forward substitution, the
  // solve of (I + diag(beta) strict_lower(kk)) U = diag(beta) (V - K_decayed S0).
  std::vector<double> U(static_cast<size_t>(C * dv));
  for (int64_t t = 0; t < C; ++t) {
    double* o = out + t * ow + static_cast<int64_t>(h) * dv;
    for (int v = 0; v < dv; ++v) {
      const double* row = S + static_cast<int64_t>(v) * dk;
      double ks = 0, qs = 0;
      for (int c = 0; c < dk; ++c) {
        ks += row[c] * kd[t * dk + c];
        qs += row[c] * qd[t * dk + c];
      }
      double corr = 0;
      for (int64_t i = 0; i < t; ++i) corr += kk[t * C + i] * U[i * dv + v];
      U[t * dv + v] = tok[t].beta * (tok[t].v[v] - ks - corr);
      o[v] = qs;  // the S0 part; the chunk's own tokens (u_t included) follow
    }
    for (int v = 0; v < dv; ++v) {
      double acc = 0;
      for (int64_t i = 0; i <= t; ++i) acc += qk[t * C + i] * U[i * dv + v];
      o[v] += acc;
    }
  }
  // S_C[v][c] = e^{G_last[c]} S0[v][c] + sum_i e^{G_last[c] - G_i[c]} k_i[c] u_i[v].
  const double* Gl = &G[(C - 1) * dk];
  std::vector<double> kl(static_cast<size_t>(C * dk)), el(dk);
  for (int c = 0; c < dk; ++c) el[c] = std::exp(Gl[c]);
  for (int64_t i = 0; i < C; ++i) {
    for (int c = 0; c < dk; ++c) kl[i * dk + c] = std::exp(Gl[c] - G[i * dk + c]) * tok[i].k[c];
  }
  for (int v = 0; v < dv; ++v) {
    double* row = S + static_cast<int64_t>(v) * dk;
    for (int c = 0; c < dk; ++c) {
      double acc = el[c] * row[c];
      for (int64_t i = 0; i < C; ++i) acc += kl[i * dk + c] * U[i * dv + v];
      row[c] = acc;
    }
  }
}

void ssd_chunk(const LayerParams& p, int h, double* H, int64_t C, const double* y, const double* a,
               double* out) {
  const int hd = p.shape.rows, n = p.key_dim;
  const int64_t yw = p.shape.conv_dim, aw = p.gate_a_width(), ow = p.out_width();
  std::vector<SsdToken> tok;
  tok.reserve(static_cast<size_t>(C));
  for (int64_t t = 0; t < C; ++t) tok.push_back(ssd_token(p, h, y + t * yw, a + t * aw));
  std::vector<double> L(static_cast<size_t>(C));
  for (int64_t t = 0; t < C; ++t) L[t] = (t > 0 ? L[t - 1] : 0.0) + tok[t].log_decay;
  // y_t = e^{L_t} h0 C_t + sum_{i<=t} e^{L_t - L_i} dt_i (B_i . C_t) x_i + D x_t.
  for (int64_t t = 0; t < C; ++t) {
    std::vector<double> w(static_cast<size_t>(t + 1));
    for (int64_t i = 0; i <= t; ++i) {
      double bc = 0;
      for (int j = 0; j < n; ++j) bc += tok[i].B[j] * tok[t].C[j];
      w[i] = std::exp(L[t] - L[i]) * tok[i].dt * bc;
    }
    const double e = std::exp(L[t]);
    double* o = out + t * ow + static_cast<int64_t>(h) * hd;
    for (int q = 0; q < hd; ++q) {
      const double* row = H + static_cast<int64_t>(q) * n;
      double hc = 0;
      for (int j = 0; j < n; ++j) hc += row[j] * tok[t].C[j];
      double acc = e * hc;
      for (int64_t i = 0; i <= t; ++i) acc += w[i] * tok[i].x[q];
      o[q] = acc + p.D[h] * tok[t].x[q];
    }
  }
  // h_C = e^{L_last} h0 + sum_i e^{L_last - L_i} dt_i x_i B_i^T.
  const double Ll = L[C - 1];
  std::vector<double> f(static_cast<size_t>(C));
  for (int64_t i = 0; i < C; ++i) f[i] = std::exp(Ll - L[i]) * tok[i].dt;
  const double el = std::exp(Ll);
  for (int q = 0; q < hd; ++q) {
    double* row = H + static_cast<int64_t>(q) * n;
    for (int j = 0; j < n; ++j) {
      double acc = el * row[j];
      for (int64_t i = 0; i < C; ++i) acc += f[i] * tok[i].x[q] * tok[i].B[j];
      row[j] = acc;
    }
  }
}

}  // namespace

int LayerParams::gate_a_width() const {
  return kind == LayerKind::kda ? shape.heads * key_dim : shape.heads;
}

int LayerParams::gate_b_width() const { return kind == LayerKind::mamba2 ? 0 : shape.heads; }

double silu(double x) { return x / (1.0 + std::exp(-x)); }
double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

LayerParams read_params(const LinearArgs& args, const LayerSpec& layer) {
  LayerParams p;
  p.kind = layer.kind;
  p.shape = linear_state_shape(layer);
  p.kernel = layer.linear.conv_kernel;
  if (layer.kind == LayerKind::mamba2) {
    p.key_heads = layer.linear.n_groups;
    p.key_dim = layer.linear.d_state;
  } else {
    p.key_heads = layer.linear.num_k_heads;
    p.key_dim = layer.linear.head_k_dim;
    // In float64 unless the layer gives its own scale (LayerSpec::softmax_scale is fp32).
    p.scale = layer.scaling > 0.f ? layer.scaling : 1.0 / std::sqrt(double(p.key_dim));
  }
  p.conv_weight = read_vector(args.conv_weight);
  p.conv_bias = args.conv_bias.empty() ? std::vector<double>(p.shape.conv_dim, 0.0)
                                       : read_vector(args.conv_bias);
  p.A_log = read_vector(args.A_log);
  p.dt_bias = read_vector(args.dt_bias);
  if (layer.kind == LayerKind::mamba2) p.D = read_vector(args.D);
  return p;
}

void conv_step(const LayerParams& p, std::span<double> window, const double* x_t, double* y_t) {
  const int K = p.kernel, dim = p.shape.conv_dim;
  for (int c = 0; c < dim; ++c) {
    const double* w = &p.conv_weight[static_cast<size_t>(c) * K];
    double acc = p.conv_bias[c];
    for (int j = 0; j < K - 1; ++j) acc += w[j] * window[static_cast<size_t>(j) * dim + c];
    acc += w[K - 1] * x_t[c];
    y_t[c] = silu(acc);
  }
  if (K > 1) {
    std::copy(window.begin() + dim, window.end(), window.begin());
    std::copy(x_t, x_t + dim, window.end() - dim);
  }
}

void conv_sequence(const LayerParams& p, std::span<double> window, int64_t T, const double* x,
                   double* y) {
  const int K = p.kernel, dim = p.shape.conv_dim;
  // ctx = window ++ x: row r < K - 1 comes from the window, the rest from x.
  auto ctx = [&](int64_t r, int c) {
    return r < K - 1 ? window[static_cast<size_t>(r) * dim + c] : x[(r - (K - 1)) * dim + c];
  };
  for (int64_t t = 0; t < T; ++t) {
    for (int c = 0; c < dim; ++c) {
      double acc = p.conv_bias[c];
      for (int j = 0; j < K; ++j)
        acc += p.conv_weight[static_cast<size_t>(c) * K + j] * ctx(t + j, c);
      y[t * dim + c] = silu(acc);
    }
  }
  std::vector<double> next(window.size());
  for (int r = 0; r < K - 1; ++r) {
    for (int c = 0; c < dim; ++c) next[static_cast<size_t>(r) * dim + c] = ctx(T + r, c);
  }
  std::copy(next.begin(), next.end(), window.begin());
}

void recurrent_step(const LayerParams& p, std::span<double> state, const double* y_t,
                    const double* a_t, const double* b_t, double* out_t) {
  const int rows = p.shape.rows, cols = p.shape.cols;
  for (int h = 0; h < p.shape.heads; ++h) {
    double* S = state.data() + static_cast<int64_t>(h) * rows * cols;
    double* o = out_t + static_cast<int64_t>(h) * rows;
    if (p.kind == LayerKind::mamba2) {
      const SsdToken t = ssd_token(p, h, y_t, a_t);
      const double decay = std::exp(t.log_decay);
      for (int q = 0; q < rows; ++q) {
        double* row = S + static_cast<int64_t>(q) * cols;
        double acc = 0;
        for (int j = 0; j < cols; ++j) {
          row[j] = decay * row[j] + t.dt * t.x[q] * t.B[j];
          acc += row[j] * t.C[j];
        }
        o[q] = acc + p.D[h] * t.x[q];
      }
      continue;
    }
    const DeltaToken t = delta_token(p, h, y_t, a_t, b_t);
    for (int v = 0; v < rows; ++v) {
      double* row = S + static_cast<int64_t>(v) * cols;
      double ks = 0;
      for (int c = 0; c < cols; ++c) {
        row[c] *= std::exp(t.g[c]);
        ks += row[c] * t.k[c];
      }
      const double u = t.beta * (t.v[v] - ks);
      double acc = 0;
      for (int c = 0; c < cols; ++c) {
        row[c] += t.k[c] * u;
        acc += row[c] * t.q[c];
      }
      o[v] = acc;
    }
  }
}

void recurrent_chunked(const LayerParams& p, std::span<double> state, int64_t T, const double* y,
                       const double* a, const double* b, int chunk, double* out) {
  ATTNRT_CHECK(chunk >= 1, "recurrent_chunked: chunk size {} is invalid; it must be >= 1", chunk);
  const int64_t yw = p.shape.conv_dim, aw = p.gate_a_width(), bw = p.gate_b_width();
  const int64_t ow = p.out_width(), per_head = static_cast<int64_t>(p.shape.rows) * p.shape.cols;
  for (int64_t start = 0; start < T; start += chunk) {
    const int64_t C = std::min<int64_t>(chunk, T - start);
    for (int h = 0; h < p.shape.heads; ++h) {
      double* S = state.data() + h * per_head;
      if (p.kind == LayerKind::mamba2) {
        ssd_chunk(p, h, S, C, y + start * yw, a + start * aw, out + start * ow);
      } else {
        delta_chunk(p, h, S, C, y + start * yw, a + start * aw, b + start * bw, out + start * ow);
      }
    }
  }
}

}  // namespace attnrt::linear
