// Built-in model presets. Dimensions come from each model's published HuggingFace config.json (the
// repository is named above each preset); sliding windows are stored as W = hf_window - 1 (§8.5).
#include <fmt/ranges.h>

#include <cmath>

#include "attnrt/core/error.h"
#include "attnrt/model/model_spec.h"
#include "src/model/layer_builders.h"

namespace attnrt {

namespace {

using layer_builders::attention_layer;
using layer_builders::linear_layer;

ModelSpec named(std::string name, int max_context_len) {
  ModelSpec m;
  m.name = std::move(name);
  m.max_context_len = max_context_len;
  return m;
}

// An MLA layer in the latent form (layer_builders::mla_layer) with the softmax scale of the
// unabsorbed heads, (qk_nope + qk_rope)^-1/2, and the dims of its MHA form (v heads of 128 in
// both presets).
LayerSpec mla(int id, int q_heads, int kv_lora_rank, int qk_rope, int qk_nope) {
  LayerSpec l = layer_builders::mla_layer(id, q_heads, kv_lora_rank, qk_rope);
  l.scaling = 1.f / std::sqrt(static_cast<float>(qk_nope + qk_rope));
  l.qk_nope_head_dim = qk_nope;
  l.mha_v_head_dim = 128;
  return l;
}

ModelSpec llama3_8b() {
  // meta-llama/Meta-Llama-3-8B: num_hidden_layers 32, num_attention_heads 32,
  // num_key_value_heads 8, hidden_size 4096 (head_dim 128), max_position_embeddings 8192.
  ModelSpec m = named("llama3-8b", 8192);
  for (int i = 0; i < 32; ++i) m.layers.push_back(attention_layer(i, 32, 8, 128));
  return m;
}

ModelSpec qwen25_7b() {
  // Qwen/Qwen2.5-7B: num_hidden_layers 28, num_attention_heads 28, num_key_value_heads 4,
  // hidden_size 3584 (head_dim 128), use_sliding_window false, max_position_embeddings 131072.
  ModelSpec m = named("qwen2.5-7b", 131072);
  for (int i = 0; i < 28; ++i) m.layers.push_back(attention_layer(i, 28, 4, 128));
  return m;
}

ModelSpec mistral_7b() {
  // mistralai/Mistral-7B-v0.1: num_hidden_layers 32, num_attention_heads 32,
  // num_key_value_heads 8, hidden_size 4096 (head_dim 128), sliding_window 4096 on every layer,
  // max_position_embeddings 32768.
  ModelSpec m = named("mistral-7b", 32768);
  for (int i = 0; i < 32; ++i) m.layers.push_back(attention_layer(i, 32, 8, 128, 4096 - 1));
  return m;
}

ModelSpec gemma3_12b() {
  // google/gemma-3-12b-it text_config: num_hidden_layers 48, num_attention_heads 16,
  // num_key_value_heads 8, head_dim 256, sliding_window 1024, sliding_window_pattern 6 (layer i is
  // global iff (i + 1) % 6 == 0), query_pre_attn_scalar 256, attn_logit_softcapping null,
  // max_position_embeddings 131072.
  ModelSpec m = named("gemma3-12b", 131072);
  for (int i = 0; i < 48; ++i) {
    const bool global = (i + 1) % 6 == 0;
    LayerSpec l = attention_layer(i, 16, 8, 256, global ? -1 : 1024 - 1);
    l.scaling = 1.f / std::sqrt(256.f);
    m.layers.push_back(l);
  }
  return m;
}

ModelSpec deepseek_v3() {
  // deepseek-ai/DeepSeek-V3: num_hidden_layers 61 (every layer MLA), num_attention_heads 128,
  // kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128,
  // max_position_embeddings 163840; rope_scaling YaRN with factor 40 and mscale_all_dim 1, whose
  // mscale = 0.1 * ln(40) + 1 enters the softmax scale squared (DeepSeek's reference code and
  // transformers' yarn_apply_mscale): 192^-1/2 * mscale^2 = 0.13523.
  ModelSpec m = named("deepseek-v3", 163840);
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  for (int i = 0; i < 61; ++i) {
    LayerSpec l = mla(i, 128, 512, 64, 128);
    l.scaling = static_cast<float>(l.scaling * mscale * mscale);
    m.layers.push_back(l);
  }
  return m;
}

ModelSpec deepseek_v32() {
  // deepseek-ai/DeepSeek-V3.2-Exp: the attention of DeepSeek-V3 (above) with an indexer on every
  // layer (DSA): index_topk 2048, index_n_heads 64, index_head_dim 128.
  ModelSpec m = deepseek_v3();
  m.name = "deepseek-v3.2";
  for (LayerSpec& l : m.layers) {
    l.indexer = {.index_topk = 2048, .index_n_heads = 64, .index_head_dim = 128};
  }
  return m;
}

ModelSpec qwen3_next_80b() {
  // Qwen/Qwen3-Next-80B-A3B-Instruct: num_hidden_layers 48, full_attention_interval 4 (layers
  // 3, 7, ..., 47 are full attention), num_attention_heads 16, num_key_value_heads 2, head_dim 256;
  // Gated DeltaNet elsewhere: linear_num_key_heads 16, linear_num_value_heads 32,
  // linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4;
  // max_position_embeddings 262144. Chunk 64 is the FLA chunk of the GDN prefill kernel.
  ModelSpec m = named("qwen3-next-80b", 262144);
  const LinearSpec gdn{.num_k_heads = 16,
                       .num_v_heads = 32,
                       .head_k_dim = 128,
                       .head_v_dim = 128,
                       .conv_kernel = 4,
                       .chunk_size = 64};
  for (int i = 0; i < 48; ++i) {
    m.layers.push_back((i + 1) % 4 == 0 ? attention_layer(i, 16, 2, 256)
                                        : linear_layer(i, LayerKind::gdn, gdn));
  }
  return m;
}

ModelSpec kimi_linear_48b() {
  // moonshotai/Kimi-Linear-48B-A3B-Instruct: num_hidden_layers 27; linear_attn_config lists layers
  // 1-based: full_attn_layers [4, 8, 12, 16, 20, 24, 27] (0-based 3, 7, ..., 23, 26), every other
  // layer KDA with num_heads 32, head_dim 128, short_conv_kernel_size 4. The full layers are MLA
  // with num_attention_heads 32, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128
  // (mla_use_nope: the rope columns exist but carry no rotation, which does not change the
  // attention math here). model_max_length 1048576.
  ModelSpec m = named("kimi-linear-48b", 1048576);
  const LinearSpec kda{.num_k_heads = 32,
                       .num_v_heads = 32,
                       .head_k_dim = 128,
                       .head_v_dim = 128,
                       .conv_kernel = 4,
                       .chunk_size = 64};
  for (int i = 0; i < 27; ++i) {
    const int one_based = i + 1;
    const bool full = one_based % 4 == 0 || one_based == 27;
    m.layers.push_back(full ? mla(i, 32, 512, 64, 128) : linear_layer(i, LayerKind::kda, kda));
  }
  return m;
}

ModelSpec nemotron_h_8b() {
  // nvidia/Nemotron-H-8B-Base-8K: hybrid_override_pattern below (52 blocks: 'M' Mamba2, '*'
  // attention, '-' MLP-only); num_attention_heads 32, num_key_value_heads 8, attention_head_dim
  // 128; mamba_num_heads 128, mamba_head_dim 64, ssm_state_size 128, n_groups 8, conv_kernel 4,
  // chunk_size 128; max_position_embeddings 8192.
  // The 24 MLP-only blocks hold no attention state, so they are not layers here: the model has the
  // 28 mixer layers (24 Mamba2 + 4 attention) in pattern order, numbered 0..27.
  static constexpr std::string_view kPattern =
      "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-";
  ModelSpec m = named("nemotron-h-8b", 8192);
  const LinearSpec mamba{.num_v_heads = 128,
                         .head_v_dim = 64,
                         .d_state = 128,
                         .n_groups = 8,
                         .conv_kernel = 4,
                         .chunk_size = 128};
  for (char c : kPattern) {
    const int id = static_cast<int>(m.layers.size());
    if (c == 'M') m.layers.push_back(linear_layer(id, LayerKind::mamba2, mamba));
    if (c == '*') m.layers.push_back(attention_layer(id, 32, 8, 128));
  }
  return m;
}

ModelSpec demo() {
  // Small enough for the CLI's default run on two cores; exercises full and sliding-window layers
  // (W = 64) and GQA 4.
  ModelSpec m = named("demo", 8192);
  m.layers = {attention_layer(0, 8, 2, 64), attention_layer(1, 8, 2, 64),
              attention_layer(2, 8, 2, 64, 64), attention_layer(3, 8, 2, 64)};
  return m;
}

struct Preset {
  std::string_view name;
  ModelSpec (*make)();
};

constexpr Preset kPresets[] = {
    {"demo", demo},
    {"llama3-8b", llama3_8b},
    {"qwen2.5-7b", qwen25_7b},
    {"mistral-7b", mistral_7b},
    {"gemma3-12b", gemma3_12b},
    {"deepseek-v3", deepseek_v3},
    {"deepseek-v3.2", deepseek_v32},
    {"qwen3-next-80b", qwen3_next_80b},
    {"kimi-linear-48b", kimi_linear_48b},
    {"nemotron-h-8b", nemotron_h_8b},
};

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

ModelSpec model_preset(std::string_view name) {
  for (const auto& p : kPresets) {
    if (p.name == name) return p.make();
  }
  fail("unknown model preset '{}': available presets are {}", name,
       fmt::join(preset_names(), ", "));
}

}  // namespace attnrt
