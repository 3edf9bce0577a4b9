// ModelSpec: the attention-relevant part of a model, as an ordered list of LayerSpec.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "attnrt/core/dtype.h"

namespace attnrt {

enum class LayerKind : uint8_t { full, swa, mla, gdn, mamba2, kda };
std::string_view layer_kind_name(LayerKind k);
bool is_linear_kind(LayerKind k);  // gdn, mamba2, kda

enum class AttnType : uint8_t { decoder, decoder_bidirectional, encoder_only };

// Dimensions of a linear-attention layer (gdn, mamba2, kda). Unused fields stay 0.
struct LinearSpec {
  int num_k_heads = 0;   // GDN key heads / KDA heads / Mamba2 groups are in n_groups
  int num_v_heads = 0;   // GDN value heads / KDA heads / Mamba2 heads
  int head_k_dim = 0;    // GDN/KDA key dim
  int head_v_dim = 0;    // GDN/KDA value dim; Mamba2 head_dim
  int d_state = 0;       // Mamba2 state size
  int n_groups = 0;      // Mamba2 B/C groups
  int conv_kernel = 4;
  int chunk_size = 64;
};

// The indexer of a DSA layer (DeepSeek sparse attention, docs/dsa.md): per query token the
// index_topk keys of highest index score are the only keys its MLA attention reads. The indexer
// has its own per-token key cache (index_head_dim fp8 values and one fp32 scale per token) and
// index_n_heads query heads; its heads are not split by tensor parallelism (every rank selects).
// All zero: no indexer.
struct IndexerSpec {
  int index_topk = 0;
  int index_n_heads = 0;
  int index_head_dim = 0;
};

struct LayerSpec {
  int layer_id = 0;
  LayerKind kind = LayerKind::full;
  int num_q_heads = 0;   // per rank (after tensor-parallel split)
  int num_kv_heads = 0;  // per rank
  int head_dim = 0;      // qk head dim (MLA: kv_lora_rank + qk_rope_head_dim)
  int v_head_dim = 0;    // defaults to head_dim (MLA: kv_lora_rank)
  float scaling = 0.f;   // softmax scale; 0 = head_dim^-1/2
  float logit_cap = 0.f; // tanh soft-cap, 0 = off
  int sliding_window = -1;  // W: key j visible to query i iff 0 <= i - j <= W; -1 = off
  AttnType attn_type = AttnType::decoder;
  bool has_sinks = false;   // per-head learned sink logits enlarge the softmax denominator
  int kv_lora_rank = 0;     // MLA
  int qk_rope_head_dim = 0; // MLA
  // MLA in the MHA form (docs/mla.md): q/k heads of qk_nope_head_dim + qk_rope_head_dim, v heads
  // of mha_v_head_dim (the HF config's v_head_dim). 0 = unknown: the layer has the absorbed form
  // only.
  int qk_nope_head_dim = 0;
  int mha_v_head_dim = 0;
  LinearSpec linear;
  IndexerSpec indexer;  // DSA: an mla layer with index_topk > 0

  bool causal() const { return attn_type == AttnType::decoder; }
  float softmax_scale() const;
  bool uses_kv_cache() const { return !is_linear_kind(kind); }
  // An MLA layer whose MHA form is known (qk_nope_head_dim and mha_v_head_dim set). DSA layers
  // have none: the MHA form attends every key, a DSA layer only its selected ones.
  bool has_mha_form() const {
    return kind == LayerKind::mla && qk_nope_head_dim > 0 && mha_v_head_dim > 0 &&
           !has_indexer();
  }
  // A DSA layer: MLA attention over the keys its indexer selects (docs/dsa.md).
  bool has_indexer() const { return indexer.index_topk > 0; }
};

struct ModelSpec {
  std::string name;
  DType dtype = DType::bf16;  // activations (q/k/v/out)
  int max_context_len = 131072;
  int tp_size = 1;
  std::vector<LayerSpec> layers;

  std::vector<int> full_attention_layer_ids() const;  // layers with a KV cache
  bool has_kind(LayerKind k) const;
  bool has_linear_layers() const;
  bool has_sliding_window() const;
  bool has_indexer() const;  // some layer is a DSA layer
  // Throws attnrt::Error when a field is out of range or inconsistent (heads not divisible, ...).
  void validate() const;
};

// Built-in presets; names listed by preset_names(). Throws attnrt::Error for an unknown name.
ModelSpec model_preset(std::string_view name);
std::vector<std::string> preset_names();

// HuggingFace config.json (llama, mistral, qwen2, qwen3, gemma2, gemma3, ...). Throws attnrt::Error
// for a malformed file or an unknown model_type (the message lists the supported ones).
ModelSpec load_hf_config(const std::string& path);
ModelSpec load_hf_config_text(std::string_view json_text, std::string_view origin);

// A preset name or a path to a config.json.
ModelSpec resolve_model(std::string_view name_or_path);

// Splits heads across tp ranks; throws attnrt::Error when a head count does not divide.
ModelSpec apply_tensor_parallel(const ModelSpec& spec, int tp_size);

}  // namespace attnrt
