// `attnrt info --explain` for the cuda backend: which CTA (kernels/dispatch.h's table) serves each
// attention layer shape of a model in each phase, and why. Host code only: the same table the
// plan and the launches read, so what is printed is what runs.
#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/model/model_spec.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/dsa.h"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/mla.h"
#include "backends/cuda/kernels/prefill.h"

namespace attnrt::cuda {

namespace {

KvKind kv_kind(DType kv) {
  return kv == DType::e4m3 ? KvKind::e4m3 : kv == DType::e5m2 ? KvKind::e5m2 : KvKind::same_as_q;
}

// The CTA's name and what makes the table choose it for `k`.
std::string describe(AttnCta cta, const AttnKernelKey& k, int rows) {
  const bool fp8 = k.kv != KvKind::same_as_q;
  switch (cta) {
    case AttnCta::generic:
      return fmt::format(
          "generic SIMT kernel (attention_generic.cu): no tensor-core kernel for head_dim {} / "
          "v_head_dim {}{}",
          k.head_dim, k.v_head_dim,
          is_mla_dims(k.head_dim, k.v_head_dim) ? " with fp16 activations" : "");
    case AttnCta::mla: {
      const bool pairs = mla_cta_enabled() && mla_pairs_enabled();
      const int fp8_max_page = mla_pairs_fp8_max_page();
      if (pairs && (!fp8 || fp8_max_page >= 128))
        return fmt::format(
            "paired-tile MLA CTA (mla_pairs.cu): 64-key tiles of the latent cache in pairs, each "
            "warpgroup scoring a whole tile and holding half of the 512 output columns, so one "
            "warpgroup's softmax runs under the other's MMAs; 64 (token, head) rows a CTA ({} rows "
            "a request), split-KV when the batch leaves SMs idle, the next tile's page ids through "
            "shared memory at pages of up to {} slots [ATTNRT_MLA_PAIRS_IDS_MAX_PAGE]{} - MLA's "
            "576 / 512 dims with bf16 q{} [ATTNRT_MLA_PAIRS=0: mla_decode.cu's CTA instead]",
            rows, mla_pairs_ids_max_page(),
            !fp8 && mla_pairs_mc_enabled()
                ? ", and at 128 heads and pages of 32 slots or more a token's two CTAs in a "
                  "cluster, each tile's TMA boxes multicast to both [ATTNRT_MLA_MC=1]"
                : "",
            fp8 ? ", the fp8 latent's raw rows converted in place by the warpgroup that scores a "
                  "tile [ATTNRT_MLA_FP8_PAIRS_MAX_PAGE]"
                : " and latent");
      return fmt::format(
          "MLA CTA (mla_decode.cu): warpgroup MMAs over 64-key tiles of the latent cache{}, 64 "
          "(token, head) rows a CTA ({} rows a request), split-KV when the batch leaves SMs idle "
          "- MLA's 576 / 512 dims with bf16 q{}{}",
          fp8 ? " converted from fp8 in shared memory" : "", rows,
          fp8 && pairs && fp8_max_page > 0
              ? fmt::format(
                    "; at pages of up to {} slot(s) the paired-tile MLA CTA (mla_pairs.cu) "
                    "instead, the raw fp8 rows converted in place by the warpgroup that scores a "
                    "tile [ATTNRT_MLA_FP8_PAIRS_MAX_PAGE]",
                    fp8_max_page)
              : std::string(),
          mla_cta_enabled() ? "" : " [ATTNRT_MLA_CTA=0: the generic kernel runs instead]");
    }
    case AttnCta::mla_keys_m:
      return fmt::format(
          "keys-on-M MLA CTA (mla_keys_m.cu): 64 latent keys as the MMA's rows against the "
          "request's {} (token, head) rows{} - MLA items of at most 16 rows, so no MMA row is "
          "padding",
          rows,
          fp8 ? ", fp8 rows converted to f16 in registers (ldmatrix) as the MMAs' A operand" : "");
    case AttnCta::prefill:
      return fmt::format(
          "warp-specialised prefill CTA (prefill_ws.cuh): 128 rows, a copy producer and warpgroup "
          "MMAs - 16-bit KV and {} rows a request",
          rows);
    case AttnCta::fp8_prefill:
      return prefill_fp8_ws_enabled()
                 ? fmt::format(
                       "warp-specialised fp8 prefill CTA (prefill_fp8_ws.cuh): 128 rows, a copy "
                       "producer (TMA boxes of whole pages where the pool allows: "
                       "ATTNRT_PREFILL_TMA) that also transposes V, two consumer warpgroups with "
                       "q and the "
                       "softmax weights in e4m3 on fp8 warpgroup MMAs against the e4m3 K / V - "
                       "--fp8-prefill-attention (ATTNRT_PREFILL_FP8_WS=0: the one-warpgroup one), {} "
                       "rows a request",
                       rows)
                 : fmt::format(
                       "fp8 prefill CTA (prefill_fp8.cuh): 128 rows, one warpgroup, q and the "
                       "softmax weights in e4m3 on fp8 warpgroup MMAs against the e4m3 K / V (V "
                       "transposed in shared memory) - --fp8-prefill-attention with "
                       "ATTNRT_PREFILL_FP8_WS=0, {} rows a request",
                       rows);
    case AttnCta::prefill_kv8:
      return fmt::format(
          "warp-specialised prefill CTA over fp8 pages (prefill_ws.cuh): 128 rows, a copy producer "
          "that converts the {} K / V tiles to f16 (exact), the 16-bit CTA's consumers on f16 "
          "warpgroup MMAs (bf16 q scaled into f16 by a power of two) - {} rows a request, head "
          "dim {} (ATTNRT_PREFILL_KV8=0: the mma.sync CTA)",
          k.kv == KvKind::e5m2 ? "e5m2" : "e4m3", rows, k.head_dim);
    case AttnCta::prefill_verify:
      return fmt::format(
          "64-row warpgroup-MMA CTA (prefill.cuh): the request's {} rows read each K/V tile once - "
          "16-bit KV at head dim {}",
          rows, k.head_dim);
    case AttnCta::keys_m:
      return fmt::format(
          "keys-on-M decode CTA (decode_keys_m.cuh): keys as the MMA's rows - {} rows a request, "
          "head dim {}{}",
          rows, k.head_dim, fp8 ? ", fp8 KV dequantised in registers" : "");
    case AttnCta::decode:
    case AttnCta::decode32:
    case AttnCta::verify:
    case AttnCta::mma_prefill:
      return fmt::format(
          "mma.sync CTA (attention.cuh, {}-row tiles) - {} rows a request{}", tile_rows(k.shape),
          rows,
          attention_cta(k) == AttnCta::prefill_kv8
              ? ", fp8 KV [ATTNRT_PREFILL_KV8=0: not the warp-specialised CTA over fp8 pages]"
          : fp8 ? ", fp8 KV (the warpgroup-MMA CTAs take 16-bit KV, and fp8 pages only for prefill "
                  "tiles at head dims 64, 128 and 256)"
                : "");
  }
  return "?";
}

}  // namespace

std::vector<std::string> explain_cuda_kernels(const ModelSpec& model, const Options& options,
                                              DType kv) {
  std::vector<std::string> out;
  std::set<std::tuple<int, int, int, int, int>> seen;
  const bool fp16 = model.dtype == DType::f16;
  const int draft = options.speculative_num_draft_tokens > 0 ? options.speculative_num_draft_tokens
                    : options.speculative_num_steps > 0      ? options.speculative_num_steps + 1
                                                             : 0;
  for (const LayerSpec& l : model.layers) {
    if (!l.uses_kv_cache() || l.num_kv_heads <= 0) continue;
    const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
    const int group = l.num_q_heads / l.num_kv_heads;
    const int kind = l.has_indexer() ? -1 : static_cast<int>(l.kind);
    if (!seen.emplace(kind, l.num_q_heads, l.num_kv_heads, l.head_dim, dv).second) continue;
    out.push_back(fmt::format("{} layers ({} q / {} kv heads, head_dim {} / {}):",
                              layer_kind_name(l.kind), l.num_q_heads, l.num_kv_heads, l.head_dim,
                              dv));
    struct Phase {
      const char* name;
      int qlen;
      bool verify;
    };
    // DSA layers run every mode as one-query requests over each token's selected keys.
    std::vector<Phase> phases = {{l.has_indexer() ? "dsa" : "decode", 1, false}};
    if (draft > 0 && !l.has_indexer()) phases.push_back({"verify", draft, true});
    if (!l.has_indexer()) phases.push_back({"extend", 512, false});
    for (const Phase& ph : phases) {
      const TileShape shape = choose_shape(ph.qlen, group, l.head_dim);
      const AttnKernelKey key{.head_dim = l.head_dim,
                              .v_head_dim = dv,
                              .fp16 = fp16,
                              .kv = kv_kind(kv),
                              .shape = shape,
                              .rows = std::min(ph.qlen * group, tile_rows(shape)),
                              .target_verify = ph.verify,
                              .fp8_prefill = options.fp8_prefill_attention};
      const AttnCta cta = effective_attention_cta(key);
      if (l.has_indexer()) {
        const bool mma = dsa_indexer() == DsaIndexer::mma &&
                         dsa_mma_takes(l.indexer.index_n_heads, l.indexer.index_head_dim);
        out.push_back(fmt::format(
            "  {:<7} every mode: the indexer (dsa.cu: fp8-rounded index scores on {}, a "
            "radix top-{} per token), then each token one query over its selected keys on the {}",
            ph.name, mma ? "tensor cores" : dsa_indexer() == DsaIndexer::mma
                           ? "CUDA cores (index dims the tensor-core kernel does not take)"
                           : "CUDA cores [ATTNRT_DSA_INDEXER=cuda_core]",
            l.indexer.index_topk, describe(cta, key, ph.qlen * group)));
        continue;
      }
      out.push_back(fmt::format("  {:<7} {}", ph.name, describe(cta, key, ph.qlen * group)));
    }
    if (l.kind == LayerKind::mla && l.has_mha_form()) {
      const MlaMhaDims d = mla_mha_dims(l);
      const bool served = d.qk == kMlaMhaHeadDim && d.v == kMlaMhaVHeadDim;
      out.push_back(fmt::format(
          "  {:<7} {}", "mha",
          served ? fmt::format(
                       "MHA form (EXTEND / MIXED without a prefix, or with prefixes summing to "
                       ">= {} tokens): warp-specialised prefill CTA (prefill_ws.cuh) at q / k "
                       "{}, v {}, k / v read in place by TMA, prefix chunks of <= {} keys merged "
                       "in its epilogue (docs/mla.md)",
                       options.chunked_prefix_cache_threshold, d.qk, d.v,
                       options.max_chunk_capacity)
                 : fmt::format("MHA form of q / k {}, v {}: no cuda kernel (it takes {} / {}); "
                               "use the cpu or reference backend",
                               d.qk, d.v, kMlaMhaHeadDim, kMlaMhaVHeadDim)));
    }
  }
  return out;
}

}  // namespace attnrt::cuda
