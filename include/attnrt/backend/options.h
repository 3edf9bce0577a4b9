// Options that choose and configure attention backends (names follow the reference engine's flags).
#pragma once

#include <cstdint>
#include <string>

namespace attnrt {

struct Options {
  std::string attention_backend;          // "" = auto-select
  std::string prefill_attention_backend;  // "" = inherit attention_backend
  std::string decode_attention_backend;   // "" = inherit attention_backend
  std::string speculative_attention_mode = "prefill";  // prefill | decode
  int page_size = 1;
  std::string kv_cache_dtype = "auto";    // auto | bf16 | fp16 | fp32 | fp8_e4m3 | fp8_e5m2
  int speculative_num_steps = 0;          // 0 = speculative decoding off
  int speculative_eagle_topk = 0;         // 0 = unset
  int speculative_num_draft_tokens = 0;   // 0 = unset
  // DSA models (an indexer, docs/dsa.md): with attention_backend "dsa" (or "nsa", deprecated) or
  // unset, the backends of the two phases; "" = prefill / decode_attention_backend, else auto
  // among the backends that serve DSA.
  std::string dsa_prefill_backend;
  std::string dsa_decode_backend;
  std::string linear_attn_backend;        // "" = auto
  std::string linear_attn_prefill_backend;
  std::string linear_attn_decode_backend;
  int num_threads = 0;                    // cpu backends; 0 = ATTNRT_NUM_THREADS or all cores
  bool deterministic = false;             // fixed split sizes: batch-invariant results
  // Prefill tiles (EXTEND, MIXED, DRAFT_EXTEND) of attention layers over an fp8_e4m3 KV cache on
  // fp8 tensor cores: q and the softmax weights rounded to e4m3 (docs/backends.md gives the
  // tolerance). Needs --kv-cache-dtype fp8_e4m3 and a prefill backend that has such a kernel
  // (BackendCaps::fp8_prefill_attention: cuda).
  bool fp8_prefill_attention = false;
  // Decode context parallelism (docs/dcp.md): ranks that each hold 1/dcp_size of every request's
  // KV cache. One AttentionRuntime is one rank (1); a DcpAttention holds dcp_size of them.
  int dcp_size = 1;
  // MLA extend in the MHA form with a chunked prefix (docs/mla.md). An EXTEND / MIXED step runs
  // MLA layers in the MHA form when its prefixes sum to 0, or to at least
  // chunked_prefix_cache_threshold while disable_chunked_prefix_cache is off; else absorbed.
  // max_chunk_capacity bounds the prefix keys of one chunk (over all requests).
  bool disable_chunked_prefix_cache = false;
  int64_t chunked_prefix_cache_threshold = 8192;
  int64_t max_chunk_capacity = 128 * 1024;

  bool speculative() const { return speculative_num_steps > 0 || speculative_num_draft_tokens > 0; }
};

}  // namespace attnrt
