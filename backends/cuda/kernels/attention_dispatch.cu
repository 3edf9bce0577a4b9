// dispatch.h's table as entry points: launch_attention and attention_occupancy both resolve the
// key through attention_entry, so the occupancy the plan reads is that of the CTA that runs.
#include "backends/cuda/kernels/attention_generic.h"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/prefill.h"

namespace attnrt::cuda {

namespace {

AttnCtaEntry attention_entry(const AttnKernelKey& key) {
  const AttnCta cta = attention_cta(key);
  switch (cta) {
    case AttnCta::generic:
      return attention_generic_entry(key.fp16);
    case AttnCta::prefill:
      return prefill_entry(key.head_dim, key.fp16, /*verify=*/false);
    case AttnCta::prefill_verify:
      return prefill_entry(key.head_dim, key.fp16, /*verify=*/true);
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

cudaError_t launch_attention(const AttnParams& p, const AttnKernelKey& key, int num_items,
                             cudaStream_t stream, bool dependent) {
  if (num_items == 0) return cudaSuccess;
  const AttnCtaEntry entry = attention_entry(key);
  if (entry.launch == nullptr) return cudaErrorInvalidValue;
  return entry.launch(p, key, num_items, stream,
                      dependent && launches_as_dependent(attention_cta(key)));
}

int attention_occupancy(const AttnKernelKey& key) {
  const AttnCtaEntry entry = attention_entry(key);
  return entry.occupancy != nullptr ? entry.occupancy(key) : 1;
}

}  // namespace attnrt::cuda
