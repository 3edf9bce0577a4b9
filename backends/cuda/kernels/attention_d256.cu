#include "backends/cuda/kernels/attention_launch.cuh"

namespace attnrt::cuda {

AttnCtaEntry mma_attention_entry_d256(AttnCta cta, bool fp16, KvKind kv) {
  return mma_attention_entry<256>(cta, fp16, kv);
}

}  // namespace attnrt::cuda
