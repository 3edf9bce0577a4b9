// Shared pieces of the linear-attention tests: small layers of each kind, random parameters and
// per-token inputs, and a harness that runs steps of one linear layer on a backend's linear side
// over its own LinearStatePool.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/linear_state_pool.h"
#include "tests/test_util.h"

namespace attnrt::testing_linear {

using attnrt::test::expect_error;

// Small layers with ragged dims (vector tails) and a chunk of 8, so that a few dozen tokens cross
// several chunk boundaries.
inline LayerSpec small_layer(LayerKind kind, int layer_id = 0) {
  LayerSpec l;
  l.layer_id = layer_id;
  l.kind = kind;
  LinearSpec& s = l.linear;
  s.conv_kernel = 4;
  s.chunk_size = 8;
  switch (kind) {
    case LayerKind::gdn:
      s.num_k_heads = 2;
      s.num_v_heads = 4;
      s.head_k_dim = 20;
      s.head_v_dim = 12;
      break;
    case LayerKind::kda:
      s.num_k_heads = s.num_v_heads = 3;
      s.head_k_dim = 20;
      s.head_v_dim = 12;
      break;
    default:  // mamba2
      s.num_v_heads = 4;
      s.head_v_dim = 12;
      s.d_state = 20;
      s.n_groups = 2;
      break;
  }
  return l;
}

inline std::string kind_label(LayerKind k) { return std::string(layer_kind_name(k)); }

// gdn, full attention (4 query and 2 KV heads of 16), mamba2 and kda layers, in fp32.
inline ModelSpec hybrid_linear_model(const std::string& name, int max_context_len) {
  return test::make_model(name, DType::f32, max_context_len,
                          {small_layer(LayerKind::gdn, 0), test::attention_layer(1, 4, 2, 16),
                           small_layer(LayerKind::mamba2, 2), small_layer(LayerKind::kda, 3)});
}

// One layer's parameters (fp32, as LinearArgs wants them).
struct LayerData {
  LayerSpec layer;
  LinearStateShape shape;
  std::vector<float> conv_w, conv_b, A_log, dt_bias, D;
  int a_width = 0, b_width = 0;

  LayerData(const LayerSpec& l, std::mt19937& rng) : layer(l), shape(linear_state_shape(l)) {
    auto fill = [&](std::vector<float>& v, size_t n, float lo, float hi) {
      std::uniform_real_distribution<float> d(lo, hi);
      v.resize(n);
      for (float& e : v) e = d(rng);
    };
    const int K = l.linear.conv_kernel;
    fill(conv_w, static_cast<size_t>(shape.conv_dim) * K, -0.6f, 0.6f);
    fill(conv_b, static_cast<size_t>(shape.conv_dim), -0.3f, 0.3f);
    fill(A_log, static_cast<size_t>(shape.heads), -1.5f, 0.5f);
    const bool kda = l.kind == LayerKind::kda;
    fill(dt_bias, static_cast<size_t>(shape.heads) * (kda ? l.linear.head_k_dim : 1), -1.f, 1.f);
    if (l.kind == LayerKind::mamba2) fill(D, static_cast<size_t>(shape.heads), -1.f, 1.f);
    a_width = kda ? shape.heads * l.linear.head_k_dim : shape.heads;
    b_width = l.kind == LayerKind::mamba2 ? 0 : shape.heads;
  }
  int out_width() const { return shape.heads * shape.rows; }
};

// Per-token inputs of a stream of tokens.
struct Tokens {
  std::vector<float> x, a, b;  // [n, conv_dim], [n, a_width], [n, b_width]
  int64_t n = 0;
};

inline Tokens random_tokens(const LayerData& d, int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> ux(-1.f, 1.f), ug(-2.5f, 2.5f);
  Tokens t;
  t.n = n;
  t.x.resize(static_cast<size_t>(n * d.shape.conv_dim));
  t.a.resize(static_cast<size_t>(n * d.a_width));
  t.b.resize(static_cast<size_t>(n * d.b_width));
  for (float& e : t.x) e = ux(rng);
  for (float& e : t.a) e = ug(rng);
  for (float& e : t.b) e = ug(rng);
  return t;
}

// Tokens [begin, end) of `t`.
inline Tokens slice(const Tokens& t, const LayerData& d, int64_t begin, int64_t end) {
  Tokens s;
  s.n = end - begin;
  auto cut = [&](const std::vector<float>& v, int w) {
    return std::vector<float>(v.begin() + begin * w, v.begin() + end * w);
  };
  s.x = cut(t.x, d.shape.conv_dim);
  s.a = cut(t.a, d.a_width);
  s.b = cut(t.b, d.b_width);
  return s;
}

inline void append(Tokens& dst, const Tokens& src) {
  dst.x.insert(dst.x.end(), src.x.begin(), src.x.end());
  dst.a.insert(dst.a.end(), src.a.begin(), src.a.end());
  dst.b.insert(dst.b.end(), src.b.begin(), src.b.end());
  dst.n += src.n;
}

// Fills the step's out_cache_loc with distinct dummy slots (the linear layers do not read them).
inline ForwardBatch with_slots(ForwardBatch b) {
  int64_t tokens = 0;
  if (is_target_verify(b.mode)) {
    tokens = int64_t{b.batch_size} * b.spec_info->draft_token_num;
  } else if (is_decode(b.mode)) {
    tokens = b.batch_size;
  } else {
    for (int32_t e : b.extend_seq_lens) tokens += e;
  }
  b.out_cache_loc.resize(static_cast<size_t>(tokens));
  for (size_t i = 0; i < b.out_cache_loc.size(); ++i)
    b.out_cache_loc[i] = static_cast<int64_t>(i) + 1;
  return b;
}

// One linear layer on one backend's linear side.
class Harness {
 public:
  // `memory`: where the pool's tensors live (null: host memory).
  Harness(const LayerData& data, const std::string& backend, int slots = 8, int verify_rows = 0,
          int draft_tokens = 0, DType state_dtype = DType::f32,
          std::unique_ptr<LinearStateMemory> memory = nullptr)
      : data_(data) {
    model_ = test::make_model("tiny-linear", DType::f32, 4096, {data.layer});
    const LinearStateConfig c{.max_slots = slots,
                              .max_request_rows = slots,
                              .ssm_dtype = state_dtype,
                              .conv_dtype = state_dtype,
                              .verify_rows = verify_rows,
                              .num_draft_tokens = draft_tokens};
    pool_ = std::make_unique<LinearStatePool>(model_, c, std::move(memory));
    BackendContext ctx;
    ctx.model = &model_;
    ctx.options = &options_;
    ctx.linear_state = pool_.get();
    backend_ = Registry::global().get(backend).linear_factory(ctx);
  }

  LinearStatePool& pool() { return *pool_; }
  AttentionBackend& backend() { return *backend_; }
  const LayerData& data() const { return data_; }

  // Runs one step; returns the outputs [T, heads * rows].
  std::vector<float> run(const ForwardBatch& batch, const Tokens& in) {
    backend_->init_forward_metadata(batch);
    return run_layer(batch, in);
  }

  std::vector<float> run_layer(const ForwardBatch& batch, const Tokens& in) {
    // NaN first: every output element must be written.
    std::vector<float> out(static_cast<size_t>(in.n * data_.out_width()), std::nanf(""));
    backend_->forward_linear(args(in, out), data_.layer, batch);
    return out;
  }

  LinearArgs args(const Tokens& in, std::vector<float>& out) {
    const int64_t T = in.n;
    const LinearStateShape& sh = data_.shape;
    const LayerSpec& l = data_.layer;
    LinearArgs a;
    x_ = in.x;
    ga_ = in.a;
    gb_ = in.b;
    a.mixed_qkv = TensorView(x_.data(), DType::f32, {T, sh.conv_dim});
    a.conv_weight = TensorView(const_cast<float*>(data_.conv_w.data()), DType::f32,
                               {sh.conv_dim, l.linear.conv_kernel});
    a.conv_bias = TensorView(const_cast<float*>(data_.conv_b.data()), DType::f32, {sh.conv_dim});
    a.A_log = TensorView(const_cast<float*>(data_.A_log.data()), DType::f32, {sh.heads});
    if (l.kind == LayerKind::kda) {
      a.a = TensorView(ga_.data(), DType::f32, {T, sh.heads, l.linear.head_k_dim});
      a.dt_bias = TensorView(const_cast<float*>(data_.dt_bias.data()), DType::f32,
                             {sh.heads, l.linear.head_k_dim});
    } else {
      a.a = TensorView(ga_.data(), DType::f32, {T, sh.heads});
      a.dt_bias = TensorView(const_cast<float*>(data_.dt_bias.data()), DType::f32, {sh.heads});
    }
    if (l.kind == LayerKind::mamba2) {
      a.D = TensorView(const_cast<float*>(data_.D.data()), DType::f32, {sh.heads});
    } else {
      a.b = TensorView(gb_.data(), DType::f32, {T, sh.heads});
    }
    a.out = TensorView(out.data(), DType::f32, {T, sh.heads, sh.rows});
    return a;
  }

  // Conv window then recurrent state of a slot (or of verify checkpoint (row, t)), as floats.
  std::vector<float> state(int slot) const {
    std::vector<uint8_t> conv, ssm;
    raw_buffers(conv, ssm);
    pool_->download_slot(data_.layer.layer_id, slot, conv.data(), ssm.data());
    return as_floats(conv, ssm);
  }
  std::vector<float> checkpoint(int row, int t) const {
    std::vector<uint8_t> conv, ssm;
    raw_buffers(conv, ssm);
    pool_->download_checkpoint(data_.layer.layer_id, row, t, conv.data(), ssm.data());
    return as_floats(conv, ssm);
  }
  // Writes a slot's conv window and state from floats laid out as state() returns them.
  void set_state(int slot, const std::vector<float>& values) {
    const LinearLayerState& st = pool_->layer(data_.layer.layer_id);
    std::vector<uint8_t> conv, ssm;
    raw_buffers(conv, ssm);
    const int64_t nc = st.shape.conv_elems(), ns = st.shape.ssm_elems();
    EXPECT_EQ(static_cast<int64_t>(values.size()), nc + ns);
    for (int64_t i = 0; i < nc; ++i) store_float(conv.data(), st.conv_dtype, i, values[i]);
    for (int64_t i = 0; i < ns; ++i) store_float(ssm.data(), st.ssm_dtype, i, values[nc + i]);
    pool_->upload_slot(data_.layer.layer_id, slot, conv.data(), ssm.data());
  }

 private:
  void raw_buffers(std::vector<uint8_t>& conv, std::vector<uint8_t>& ssm) const {
    const LinearLayerState& st = pool_->layer(data_.layer.layer_id);
    conv.resize(static_cast<size_t>(st.shape.conv_elems()) * dtype_size(st.conv_dtype));
    ssm.resize(static_cast<size_t>(st.shape.ssm_elems()) * dtype_size(st.ssm_dtype));
  }
  std::vector<float> as_floats(const std::vector<uint8_t>& conv,
                               const std::vector<uint8_t>& ssm) const {
    const LinearLayerState& st = pool_->layer(data_.layer.layer_id);
    std::vector<float> s;
    for (int64_t i = 0; i < st.shape.conv_elems(); ++i)
      s.push_back(load_as_float(conv.data(), st.conv_dtype, static_cast<size_t>(i)));
    for (int64_t i = 0; i < st.shape.ssm_elems(); ++i)
      s.push_back(load_as_float(ssm.data(), st.ssm_dtype, static_cast<size_t>(i)));
    return s;
  }
  static void store_float(void* base, DType t, int64_t i, float v) {
    if (t == DType::f32) {
      static_cast<float*>(base)[i] = v;
    } else {
      static_cast<uint16_t*>(base)[i] = float_to_bf16(v);
    }
  }

  LayerData data_;
  ModelSpec model_;
  Options options_;
  std::unique_ptr<LinearStatePool> pool_;
  std::unique_ptr<AttentionBackend> backend_;
  std::vector<float> x_, ga_, gb_;
};

// max |a - b| / (atol + rtol |b|) over the elements: <= 1 passes.
inline double worst(const std::vector<float>& a, const std::vector<float>& b, double atol,
                    double rtol) {
  EXPECT_EQ(a.size(), b.size());
  double w = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    w = std::max(w, std::abs(double(a[i]) - b[i]) / (atol + rtol * std::abs(double(b[i]))));
  }
  return w;
}

}  // namespace attnrt::testing_linear
