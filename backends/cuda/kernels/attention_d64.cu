#include "backends/cuda/kernels/attention_launch.cuh"

namespace attnrt::cuda {

AttnCtaEntry mma_attention_entry_d64(AttnCta cta, bool fp16, KvKind kv) {
  return mma_attention_entry<64>(cta, fp16, kv);
}

}  // namespace attnrt::cuda
