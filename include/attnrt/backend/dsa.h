// DSA (DeepSeek sparse attention, docs/dsa.md): what every backend serving DSA layers shares —
// the checks of a call's indexer inputs, the fp8 rounding of the index queries, the score scale
// and the tie rule of the top-k selection.
#pragma once

#include <cstdint>
#include <string_view>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

// The scale of the index score: index_n_heads^-1/2 * index_head_dim^-1/2 (DeepSeek's
// weights * n_heads^-0.5 * softmax_scale).
double index_score_scale(const LayerSpec& layer);

// The index query of one head as the indexer uses it: rounded to fp8 e4m3 with a power-of-two
// scale (quantize_fp8_block) and read back, out[i] = code_i * scale.
void round_index_query(const float* q, int n, float* out);

// The selection order: a key ranks before another when its score is higher, or equal with a
// lower token index. Total over distinct indices, so the selected set is unique.
inline bool dsa_ranks_before(double score_a, int32_t index_a, double score_b, int32_t index_b) {
  return score_a > score_b || (score_a == score_b && index_a < index_b);
}

// The checks of args.indexer for one call, raised before anything is stored: a DSA layer needs
// q, weights and (when the latent rows are stored: save_kv with k) the index keys, of the shapes
// above, float, in host memory; topk, when given, int32 [T, index_topk] in host memory. Any other
// layer must leave args.indexer empty. Messages start with "<backend> backend:".
void check_host_indexer_args(std::string_view backend, const AttnArgs& args,
                             const LayerSpec& layer, int64_t num_tokens);
// The same checks with every indexer tensor on `device` (a GPU backend: where its q lives).
void check_indexer_args(std::string_view backend, const AttnArgs& args, const LayerSpec& layer,
                        int64_t num_tokens, DeviceKind device);

// CUDA graphs for a model with DSA layers (docs/cuda_graphs.md "DSA layers"): on unless
// ATTNRT_DSA_GRAPHS=0 is in the environment (read once, at the first call) or set_dsa_graphs(false)
// chose first. Off, AttentionRuntime keeps such a model's steps eager and says so in
// cuda_graphs_off_reason(). The switch is read when a runtime is built; set it before.
bool dsa_graphs_enabled();
void set_dsa_graphs(bool on);

}  // namespace attnrt
