#include "tools/attnrt/cli_options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "attnrt/backend/registry.h"

namespace attnrt::cli {

void add_backend_options(CLI::App& cmd, Options& options) {
  const std::string names = fmt::format("{}", fmt::join(Registry::global().names(), ", "));
  CLI::Option_group* g = cmd.add_option_group(
      kBackendOptionGroup,
      "Which attention backends serve each phase, and how the KV cache is laid "
      "out (see docs/backends.md)");
  g->add_option("--attention-backend", options.attention_backend,
                fmt::format("Backend for every phase: {}, or dsa (alias nsa, deprecated): the "
                            "DSA router of models with an indexer. Unset: auto-select (cuda on a "
                            "Hopper GPU, else cpu; never reference; dsa for a model with an "
                            "indexer)",
                            names));
  g->add_option("--prefill-attention-backend", options.prefill_attention_backend,
                "Backend for EXTEND and MIXED steps (and verify/draft extend with "
                "--speculative-attention-mode prefill). Unset: --attention-backend. Differing "
                "prefill and decode backends enable the hybrid router");
  g->add_option("--decode-attention-backend", options.decode_attention_backend,
                "Backend for DECODE and IDLE steps (and verify/draft extend with "
                "--speculative-attention-mode decode). Unset: --attention-backend");
  g->add_option("--speculative-attention-mode", options.speculative_attention_mode,
                "Which phase backend runs TARGET_VERIFY and DRAFT_EXTEND steps: prefill or decode")
      ->check(CLI::IsMember({"prefill", "decode"}))
      ->capture_default_str();
  g->add_option("--page-size", options.page_size,
                "Tokens per KV-cache page; a cached prefix is reused in whole pages. 1 = token "
                "granularity. Must be a native page size of the chosen backends")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  g->add_option("--kv-cache-dtype", options.kv_cache_dtype,
                "KV cache element type: auto (the model's dtype), bf16, fp16, fp32, fp8_e4m3 or "
                "fp8_e5m2 (fp8 stores k/scale and v/scale with per-layer scales)")
      ->capture_default_str();
  g->add_option("--speculative-num-steps", options.speculative_num_steps,
                "Draft depth of speculative decoding (EAGLE-style); 0 = off")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  g->add_option("--speculative-eagle-topk", options.speculative_eagle_topk,
                "Draft branches per step: 1 = chain verify, > 1 = tree verify. Unset (0) with "
                "--speculative-num-steps: 1")
      ->check(CLI::NonNegativeNumber);
  g->add_option("--speculative-num-draft-tokens", options.speculative_num_draft_tokens,
                "Tokens per verify block, the root included. A chain needs exactly num_steps + 1 "
                "(the default when unset); a tree needs it set")
      ->check(CLI::NonNegativeNumber);
  g->add_option("--dsa-prefill-backend", options.dsa_prefill_backend,
                "DSA models (an indexer, e.g. deepseek-v3.2): backend for the prefill phase of "
                "--attention-backend dsa (alias nsa, deprecated), which is on by default for "
                "them. Unset: --prefill-attention-backend, else auto among the DSA backends");
  g->add_option("--dsa-decode-backend", options.dsa_decode_backend,
                "DSA models: backend for the decode phase of --attention-backend dsa. Unset: "
                "--decode-attention-backend, else auto among the DSA backends");
  g->add_option("--linear-attn-backend", options.linear_attn_backend,
                "Backend for the linear-attention layers (GDN, Mamba2, KDA) of hybrid models. "
                "Unset: auto-select");
  g->add_option("--linear-attn-prefill-backend", options.linear_attn_prefill_backend,
                "Linear-attention backend for prefill steps. Unset: --linear-attn-backend");
  g->add_option("--linear-attn-decode-backend", options.linear_attn_decode_backend,
                "Linear-attention backend for decode steps. Unset: --linear-attn-backend");
  g->add_option("--threads", options.num_threads,
                "Threads for the cpu backends; 0 = $ATTNRT_NUM_THREADS, else every core")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  g->add_flag("--deterministic", options.deterministic,
              "Fixed split sizes, so results do not depend on batch composition or thread count");
  g->add_flag("--disable-chunked-prefix-cache", options.disable_chunked_prefix_cache,
              "MLA models: EXTEND / MIXED steps with a cached prefix always run MLA absorbed (the "
              "MHA form only without prefixes); see docs/mla.md");
  g->add_option("--chunked-prefix-cache-threshold", options.chunked_prefix_cache_threshold,
                "MLA models: EXTEND / MIXED steps whose prefixes sum to at least this many tokens "
                "run the MHA form with the prefix in chunks (shorter ones: absorbed)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  g->add_option("--max-chunk-capacity", options.max_chunk_capacity,
                "MLA models, MHA form: prefix keys per chunk over all requests (each request gets "
                "capacity / requests positions of its prefix per chunk)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
}

bool backend_options_given(CLI::App& cmd) {
  CLI::App* group = cmd.get_option_group(kBackendOptionGroup);
  for (const CLI::Option* opt : group->get_options()) {
    if (opt->count() > 0) return true;
  }
  return false;
}

}  // namespace attnrt::cli
