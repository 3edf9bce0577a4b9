#include "attnrt/backend/dsa.h"

#include <cmath>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "attnrt/core/env.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/index_key_cache.h"

namespace attnrt {

double index_score_scale(const LayerSpec& layer) {
  return 1.0 / std::sqrt(static_cast<double>(layer.indexer.index_n_heads) *
                         static_cast<double>(layer.indexer.index_head_dim));
}

void round_index_query(const float* q, int n, float* out) {
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  const float scale = quantize_fp8_block(q, n, codes.data());
  for (int i = 0; i < n; ++i) out[i] = e4m3_to_float(codes[i]) * scale;
}

namespace {

std::string shape_of(const TensorView& t) { return t.empty() ? "empty" : t.describe(); }

const char* memory_of(DeviceKind device) {
  return device == DeviceKind::cpu ? "in host memory" : "in GPU memory";
}

void check_float(std::string_view backend, DeviceKind device, const char* what, const TensorView& t,
                 int ndim, const int64_t* dims, const char* names) {
  bool ok = t.data != nullptr && t.device.kind == device && is_float(t.dtype) && !is_fp8(t.dtype) &&
            t.ndim == ndim;
  for (int i = 0; ok && i < ndim; ++i) ok = t.shape[i] == dims[i];
  ATTNRT_CHECK(ok,
               "{} backend: indexer {} is {}; expected a float (fp32 / fp16 / bf16) [{}] = [{}] "
               "{}",
               backend, what, shape_of(t), names,
               ndim == 3 ? fmt::format("{}, {}, {}", dims[0], dims[1], dims[2])
                         : fmt::format("{}, {}", dims[0], dims[1]),
               memory_of(device));
}

}  // namespace

void check_host_indexer_args(std::string_view backend, const AttnArgs& args,
                             const LayerSpec& layer, int64_t num_tokens) {
  check_indexer_args(backend, args, layer, num_tokens, DeviceKind::cpu);
}

void check_indexer_args(std::string_view backend, const AttnArgs& args, const LayerSpec& layer,
                        int64_t num_tokens, DeviceKind device) {
  const IndexerArgs& ix = args.indexer;
  if (!layer.has_indexer()) {
    ATTNRT_CHECK(ix.empty(),
                 "{} backend: layer {} has no indexer (index_topk 0) but AttnArgs.indexer is set "
                 "(q {}, k {}, weights {}, topk {}); leave it empty for layers without DSA",
                 backend, layer.layer_id, shape_of(ix.q), shape_of(ix.k), shape_of(ix.weights),
                 shape_of(ix.topk));
    return;
  }
  const IndexerSpec& s = layer.indexer;
  const int64_t q_dims[] = {num_tokens, s.index_n_heads, s.index_head_dim};
  check_float(backend, device, "q", ix.q, 3, q_dims, "tokens, index_n_heads, index_head_dim");
  const int64_t w_dims[] = {num_tokens, s.index_n_heads};
  check_float(backend, device, "weights", ix.weights, 2, w_dims, "tokens, index_n_heads");
  const bool stores = args.save_kv && !args.k.empty();
  if (stores || !ix.k.empty()) {
    ATTNRT_CHECK(stores,
                 "{} backend: layer {}: indexer k is {} but the call stores no latent rows ({}); "
                 "the index keys are stored with the latent rows only",
                 backend, layer.layer_id, shape_of(ix.k),
                 args.save_kv ? "k is empty" : "save_kv is false");
    const int64_t k_dims[] = {num_tokens, s.index_head_dim};
    check_float(backend, device, "k", ix.k, 2, k_dims, "tokens, index_head_dim");
  }
  if (!ix.topk.empty()) {
    ATTNRT_CHECK(ix.topk.device.kind == device && ix.topk.dtype == DType::i32 &&
                     ix.topk.ndim == 2 && ix.topk.shape[0] == num_tokens &&
                     ix.topk.shape[1] == s.index_topk,
                 "{} backend: indexer topk is {}; expected int32[{}, {}] (tokens, index_topk) {}",
                 backend, ix.topk.describe(), num_tokens, s.index_topk, memory_of(device));
  }
}

namespace {
int g_dsa_graphs = -1;  // -1: not read yet; else 0 / 1
}  // namespace

bool dsa_graphs_enabled() {
  if (g_dsa_graphs < 0) {
    g_dsa_graphs = static_cast<int>(
        env_integer("ATTNRT_DSA_GRAPHS", 0, 1, "DSA CUDA graphs",
                    "1 (capture DSA layers in DECODE / TARGET_VERIFY graphs) or 0")
            .value_or(1));
  }
  return g_dsa_graphs == 1;
}

void set_dsa_graphs(bool on) { g_dsa_graphs = on ? 1 : 0; }

}  // namespace attnrt
