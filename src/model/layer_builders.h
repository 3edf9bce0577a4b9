// LayerSpec builders shared by the model presets and the HuggingFace config reader, so that a
// preset and the config.json of the same model give the same layers.
#pragma once

#include "attnrt/model/model_spec.h"

namespace attnrt::layer_builders {

// A full-attention layer, or with window >= 0 a sliding-window one (W = window); v_head_dim =
// head_dim.
inline LayerSpec attention_layer(int id, int q_heads, int kv_heads, int head_dim,
                                 int window = -1) {
  LayerSpec l;
  l.layer_id = id;
  l.kind = window >= 0 ? LayerKind::swa : LayerKind::full;
  l.num_q_heads = q_heads;
  l.num_kv_heads = kv_heads;
  l.head_dim = head_dim;
  l.v_head_dim = head_dim;
  l.sliding_window = window;
  return l;
}

// The latent (absorbed) form of multi-head latent attention: one kv head holding
// [kv_lora_rank | rope] per token; V is the first kv_lora_rank columns. The softmax scale is left
// to the caller.
inline LayerSpec mla_layer(int id, int q_heads, int kv_lora_rank, int qk_rope_head_dim) {
  LayerSpec l;
  l.layer_id = id;
  l.kind = LayerKind::mla;
  l.num_q_heads = q_heads;
  l.num_kv_heads = 1;
  l.head_dim = kv_lora_rank + qk_rope_head_dim;
  l.v_head_dim = kv_lora_rank;
  l.kv_lora_rank = kv_lora_rank;
  l.qk_rope_head_dim = qk_rope_head_dim;
  return l;
}

// A linear-attention layer (gdn, mamba2 or kda) of the given dimensions.
inline LayerSpec linear_layer(int id, LayerKind kind, const LinearSpec& spec) {
  LayerSpec l;
  l.layer_id = id;
  l.kind = kind;
  l.linear = spec;
  return l;
}

}  // namespace attnrt::layer_builders
