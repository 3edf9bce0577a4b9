// MLA extend in the MHA form with a chunked prefix (docs/mla.md): which form a step runs, the
// plan of its prefix chunks, and the arguments of the two calls. The reference engine calls these
// MHA_CHUNKED_KV (`forward_normal_chunked_kv_*`, `prefix_chunk_*` of its ForwardBatch).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/tensor.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

class ReqToTokenPool;
struct Options;

// absorbed: q [T, Hq, kv_lora_rank + rope] against the latent rows (AttnArgs, forward()).
// mha: q / k [T, Hq, qk_nope + rope], v [T, Hq, mha_v_head_dim] of the extend tokens, then the
//      prefix in chunks that the model decompresses (MlaMhaArgs, MlaChunkArgs).
enum class MlaForm : uint8_t { absorbed, mha };
std::string_view mla_form_name(MlaForm form);

// The reference engine's rule: EXTEND and MIXED steps run the MHA form when the step's prefixes sum
// to 0, or to at least options.chunked_prefix_cache_threshold while
// options.disable_chunked_prefix_cache is off; every other step (DECODE, TARGET_VERIFY,
// DRAFT_EXTEND, short prefixes) runs absorbed. `mha_served`: the backend serving the step runs
// the MHA form for the model's MLA layers (else absorbed, whatever the lengths).
MlaForm choose_mla_form(ForwardMode mode, const StepLayout& layout, const Options& options,
                        bool mha_served);

// The dims of an MLA layer's MHA form: q / k head dim (qk_nope + qk_rope) and v head dim.
struct MlaMhaDims {
  int qk = 0, v = 0;
};
MlaMhaDims mla_mha_dims(const LayerSpec& layer);

// One prefix chunk: for request i the prefix positions [starts[i], starts[i] + lens[i]), keys
// cu_seqlens[i] .. cu_seqlens[i + 1] of the chunk, in request order; slots are their full-pool
// slots (req_to_token of the request's row).
struct PrefixChunk {
  int64_t num_tokens = 0;
  std::vector<int32_t> starts;      // [bs]
  std::vector<int32_t> lens;        // [bs]; 0 where the request's prefix ended before the chunk
  std::vector<int64_t> cu_seqlens;  // [bs + 1]
  std::vector<int32_t> slots;       // [num_tokens]
};

// chunk_len = max_chunk_capacity / bs prefix positions per request per chunk; chunk c covers
// positions [c * chunk_len, (c + 1) * chunk_len) of every prefix; ceil(max prefix / chunk_len)
// chunks (none when every prefix is empty).
struct PrefixChunkPlan {
  int64_t chunk_len = 0;
  std::vector<PrefixChunk> chunks;
  int num_chunks() const { return static_cast<int>(chunks.size()); }
};

// Throws attnrt::Error when capacity < 1 or, with a prefix, capacity < the step's request count
// (a chunk would hold no key of some request), naming the option.
PrefixChunkPlan plan_prefix_chunks(const ForwardBatch& batch, const StepLayout& layout,
                                   const ReqToTokenPool& req_to_token, int64_t capacity);

// The causal part of an MHA-form step for one MLA layer: the extend tokens attend to themselves,
// causally within each request (query t of a request sees its extend tokens 0 .. t). Any float
// dtype (fp8 excluded), host or device as the backend reads.
//   q, k   [T, Hq, qk_nope_head_dim + qk_rope_head_dim]
//   v      [T, Hq, mha_v_head_dim]
//   out    [T, Hq, mha_v_head_dim]
//   lse    [T, Hq] fp32, natural log; required when the step has prefix chunks (they merge into it)
//   latent [T, 1, kv_lora_rank + qk_rope_head_dim]: the step's latent rows, stored in the layer's
//          latent pool at out_cache_loc when save_kv (later steps and the prefix chunks read them)
struct MlaMhaArgs {
  TensorView q, k, v, out, lse, latent;
  bool save_kv = true;
};

// One prefix chunk of an MHA-form step (after the causal part of the same layer): the extend
// tokens' queries against the chunk's decompressed keys, no mask (every prefix key precedes every
// query of its request); the result is merged into out / lse, which hold the running result.
//   q        [T, Hq, qk_nope_head_dim + qk_rope_head_dim] (the causal part's q)
//   k        [n, Hq, qk_nope_head_dim + qk_rope_head_dim], n = the chunk's num_tokens
//   v        [n, Hq, mha_v_head_dim]
//   out, lse as in MlaMhaArgs, read and written
struct MlaChunkArgs {
  TensorView q, k, v, out, lse;
};

}  // namespace attnrt
