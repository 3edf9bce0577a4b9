#include "tools/sim/step_inputs.h"

#include "attnrt/core/error.h"
#include "attnrt/memory/linear_state_pool.h"

namespace attnrt::sim {

FastRng::FastRng(uint64_t seed) {
  for (auto& w : s_) {
    seed += 0x9e3779b97f4a7c15ull;
    uint64_t z = seed;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    w = z ^ (z >> 31);
  }
}

uint64_t FastRng::next() {
  const uint64_t result = s_[0] + s_[3];
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = (s_[3] << 45) | (s_[3] >> 19);
  return result;
}

void fill_random(const TensorView& t, FastRng& rng, float scale) {
  const int64_t n = t.numel();
  switch (t.dtype) {
    case DType::f32: {
      float* p = t.ptr<float>();
      for (int64_t i = 0; i < n; ++i) p[i] = rng.symmetric(scale);
      break;
    }
    case DType::bf16: {
      auto* p = t.ptr<uint16_t>();
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(rng.symmetric(scale));
      break;
    }
    case DType::f16: {
      auto* p = t.ptr<uint16_t>();
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_fp16(rng.symmetric(scale));
      break;
    }
    default:
      fail("attnrt run: activations of dtype {} are not supported; use a model with fp32, fp16 "
           "or bf16 activations",
           dtype_name(t.dtype));
  }
}

TensorView cut(const HostBuffer& buf, int64_t rows, int heads, int dim) {
  return TensorView(buf.data(), buf.dtype(), {rows, heads, dim});
}

LinearWeights make_linear_weights(const LayerSpec& l, FastRng& rng) {
  const LinearStateShape sh = linear_state_shape(l);
  const int64_t heads = sh.heads;
  auto filled = [&](std::initializer_list<int64_t> shape, float center, float scale) {
    HostBuffer b(DType::f32, shape);
    for (int64_t i = 0; i < b.numel(); ++i) b.ptr<float>()[i] = center + rng.symmetric(scale);
    return b;
  };
  LinearWeights w;
  w.conv_w = filled({sh.conv_dim, l.linear.conv_kernel}, 0.f, 0.6f);
  w.conv_b = filled({sh.conv_dim}, 0.f, 0.3f);
  w.A_log = filled({heads}, -0.5f, 1.f);
  w.dt_bias = l.kind == LayerKind::kda ? filled({heads, l.linear.head_k_dim}, 0.f, 1.f)
                                       : filled({heads}, 0.f, 1.f);
  if (l.kind == LayerKind::mamba2) w.D = filled({heads}, 0.f, 1.f);
  return w;
}

LinearWidths linear_widths(const LayerSpec& l) {
  const LinearStateShape sh = linear_state_shape(l);
  LinearWidths w;
  w.mixed = sh.conv_dim;
  w.a = l.kind == LayerKind::kda ? int64_t{sh.heads} * l.linear.head_k_dim : sh.heads;
  w.b = l.kind == LayerKind::mamba2 ? 0 : sh.heads;
  w.out = int64_t{sh.heads} * sh.rows;
  return w;
}

LinearArgs linear_args(const LayerSpec& l, const LinearWeights& w, const LayerBuffers& buf,
                       int64_t T, DType dtype) {
  const LinearStateShape sh = linear_state_shape(l);
  LinearArgs a;
  a.mixed_qkv = TensorView(buf.mixed.data(), dtype, {T, sh.conv_dim});
  a.conv_weight = w.conv_w.view();
  a.conv_bias = w.conv_b.view();
  a.A_log = w.A_log.view();
  a.dt_bias = w.dt_bias.view();
  if (l.kind == LayerKind::kda) {
    a.a = TensorView(buf.gate_a.data(), dtype, {T, sh.heads, l.linear.head_k_dim});
  } else {
    a.a = TensorView(buf.gate_a.data(), dtype, {T, sh.heads});
  }
  if (l.kind == LayerKind::mamba2) {
    a.D = w.D.view();
  } else {
    a.b = TensorView(buf.gate_b.data(), dtype, {T, sh.heads});
  }
  a.out = TensorView(buf.out.data(), dtype, {T, sh.heads, sh.rows});
  return a;
}

}  // namespace attnrt::sim
