#include "backends/reference/linear_backend.h"

#include <algorithm>
#include <vector>

#include "attnrt/core/error.h"
#include "attnrt/linear/linear_math.h"
#include "attnrt/memory/linear_state_pool.h"

namespace attnrt {

namespace {

void load(const void* base, DType t, int64_t offset, int64_t n, double* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_as_float(base, t, static_cast<size_t>(offset + i));
}

void store(void* base, DType t, int64_t offset, int64_t n, const double* src) {
  for (int64_t i = 0; i < n; ++i) {
    store_from_float(base, t, static_cast<size_t>(offset + i), static_cast<float>(src[i]));
  }
}

// Rows [start, start + n) of a per-token tensor (token dim strided, the rest contiguous).
std::vector<double> load_tokens(const TensorView& t, int64_t start, int64_t n) {
  if (t.empty()) return {};
  const int64_t width = t.numel() / std::max<int64_t>(t.shape[0], 1);
  std::vector<double> out(static_cast<size_t>(n * width));
  for (int64_t r = 0; r < n; ++r)
    load(t.data, t.dtype, (start + r) * t.strides[0], width, &out[r * width]);
  return out;
}

}  // namespace

ReferenceLinearBackend::ReferenceLinearBackend(const BackendContext& ctx)
    : LinearAttnBackend(ctx) {}

void ReferenceLinearBackend::forward_linear(const LinearArgs& args, const LayerSpec& layer,
                                            const ForwardBatch& batch) {
  if (!begin_layer(args, layer, batch)) return;
  LinearStatePool& states = pool();
  const LinearLayerState& st = states.layer(layer.layer_id);
  const linear::LayerParams p = linear::read_params(args, layer);
  const LinearStateShape& sh = st.shape;
  const int64_t aw = p.gate_a_width(), bw = p.gate_b_width(), ow = p.out_width();
  const int n = plan_.draft_tokens;
  for (size_t i = 0; i < plan_.reqs.size(); ++i) {
    const linear::RequestWork& w = plan_.reqs[i];
    if (w.tokens == 0) continue;
    std::vector<double> window(static_cast<size_t>(sh.conv_elems()), 0.0);
    std::vector<double> state(static_cast<size_t>(sh.ssm_elems()), 0.0);
    if (w.has_initial_state) {
      load(st.conv, st.conv_dtype, st.conv_offset(w.slot), sh.conv_elems(), window.data());
      load(st.ssm, st.ssm_dtype, st.ssm_offset(w.slot), sh.ssm_elems(), state.data());
    }
    const std::vector<double> x = load_tokens(args.mixed_qkv, w.token_start, w.tokens);
    const std::vector<double> a = load_tokens(args.a, w.token_start, w.tokens);
    const std::vector<double> b = load_tokens(args.b, w.token_start, w.tokens);
    std::vector<double> y(x.size()), out(static_cast<size_t>(w.tokens * ow));
    const double* bp = b.empty() ? nullptr : b.data();
    if (plan_.verify) {
      // Token t starts from its parent's checkpoint (the root from the slot), as stored, so that
      // the committed state is bit-for-bit what sequential decoding in the pool's dtype gives.
      const int32_t* parents = &plan_.parents[i * static_cast<size_t>(n)];
      const std::vector<double> window0 = window, state0 = state;
      for (int t = 0; t < w.tokens; ++t) {
        if (parents[t] < 0) {
          window = window0;
          state = state0;
        } else {
          load(st.inter_conv, st.conv_dtype, st.inter_conv_offset(i, parents[t], n),
               sh.conv_elems(), window.data());
          load(st.inter_ssm, st.ssm_dtype, st.inter_ssm_offset(i, parents[t], n), sh.ssm_elems(),
               state.data());
        }
        linear::conv_step(p, window, &x[t * sh.conv_dim], &y[t * sh.conv_dim]);
        linear::recurrent_step(p, state, &y[t * sh.conv_dim], &a[t * aw],
                               bp ? bp + t * bw : nullptr, &out[t * ow]);
        store(st.inter_conv, st.conv_dtype, st.inter_conv_offset(i, t, n), sh.conv_elems(),
              window.data());
        store(st.inter_ssm, st.ssm_dtype, st.inter_ssm_offset(i, t, n), sh.ssm_elems(),
              state.data());
      }
    } else {
      const int chunk = extend_chunk_ > 0 ? extend_chunk_ : layer.linear.chunk_size;
      if (is_decode(batch.mode) || extend_chunk_ < 0) {
        for (int t = 0; t < w.tokens; ++t) {
          linear::conv_step(p, window, &x[t * sh.conv_dim], &y[t * sh.conv_dim]);
          linear::recurrent_step(p, state, &y[t * sh.conv_dim], &a[t * aw],
                                 bp ? bp + t * bw : nullptr, &out[t * ow]);
        }
      } else {
        linear::conv_sequence(p, window, w.tokens, x.data(), y.data());
        linear::recurrent_chunked(p, state, w.tokens, y.data(), a.data(), bp, chunk, out.data());
      }
      store(st.conv, st.conv_dtype, st.conv_offset(w.slot), sh.conv_elems(), window.data());
      store(st.ssm, st.ssm_dtype, st.ssm_offset(w.slot), sh.ssm_elems(), state.data());
    }
    for (int t = 0; t < w.tokens; ++t) {
      store(args.out.data, args.out.dtype, (w.token_start + t) * args.out.strides[0], ow,
            &out[t * ow]);
    }
  }
}

}  // namespace attnrt
