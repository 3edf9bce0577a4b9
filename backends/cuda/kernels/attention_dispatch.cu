// dispatch.h's table as entry points: launch_attention and attention_occupancy both resolve the
// key through attention_entry, so the occupancy the plan reads is that of the CTA that runs.
#include <cstdlib>
#include <string_view>

#include "backends/cuda/kernels/attention_generic.h"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/mla.h"
#include "backends/cuda/kernels/prefill.h"

namespace attnrt::cuda {

namespace {

int g_mla_cta = -1;  // -1: not read yet; else 0 (generic), 1 (both MLA CTAs), 64 (no keys-on-M)

int mla_cta_mode() {
  if (g_mla_cta < 0) {
    const char* v = std::getenv("ATTNRT_MLA_CTA");
    const std::string_view s = v != nullptr ? v : "";
    g_mla_cta = s == "0" ? 0 : s == "64" ? 64 : 1;
  }
  return g_mla_cta;
}

AttnCtaEntry attention_entry(const AttnKernelKey& key) {
  const AttnCta cta = effective_attention_cta(key);
  switch (cta) {
    case AttnCta::generic:
      return attention_generic_entry(key.fp16);
    case AttnCta::mla:
      return mla_attention_entry(key);
    case AttnCta::mla_keys_m:
      return mla_keys_m_entry(key);
    case AttnCta::prefill:
      return prefill_entry(key.head_dim, key.fp16, /*verify=*/false);
    case AttnCta::prefill_verify:
      return prefill_entry(key.head_dim, key.fp16, /*verify=*/true);
    case AttnCta::fp8_prefill:
      return prefill_fp8_entry(key.head_dim, key.fp16);
    case AttnCta::prefill_kv8:
      return prefill_kv8_entry(key.head_dim, key.fp16);
    default:
      break;
  }
  switch (key.head_dim) {
    case 64:
      return mma_attention_entry_d64(cta, key.fp16, key.kv);
    case 128:
      return mma_attention_entry_d128(cta, key.fp16, key.kv);
    case 256:
      return mma_attention_entry_d256(cta, key.fp16, key.kv);
    default:
      return {};
  }
}

}  // namespace

AttnCta effective_attention_cta(const AttnKernelKey& key) {
  const AttnCta cta = attention_cta(key);
  if (cta == AttnCta::prefill_kv8) return prefill_kv8_enabled() ? cta : AttnCta::mma_prefill;
  if (cta != AttnCta::mla && cta != AttnCta::mla_keys_m) return cta;
  if (!mla_cta_enabled()) return AttnCta::generic;
  return cta == AttnCta::mla_keys_m && !mla_keys_m_enabled() ? AttnCta::mla : cta;
}

bool mla_cta_enabled() { return mla_cta_mode() != 0; }
bool mla_keys_m_enabled() { return mla_cta_mode() == 1; }
void set_mla_cta(bool on) { g_mla_cta = on ? 1 : 0; }

cudaError_t launch_attention(const AttnParams& p, const AttnKernelKey& key, int num_items,
                             cudaStream_t stream, bool dependent) {
  if (num_items == 0) return cudaSuccess;
  const AttnCtaEntry entry = attention_entry(key);
  if (entry.launch == nullptr) return cudaErrorInvalidValue;
  return entry.launch(p, key, num_items, stream,
                      dependent && launches_as_dependent(effective_attention_cta(key)));
}

int attention_occupancy(const AttnKernelKey& key) {
  const AttnCtaEntry entry = attention_entry(key);
  return entry.occupancy != nullptr ? entry.occupancy(key) : 1;
}

}  // namespace attnrt::cuda
