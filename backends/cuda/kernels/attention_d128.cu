#include "backends/cuda/kernels/attention_launch.cuh"

namespace attnrt::cuda {

AttnCtaEntry mma_attention_entry_d128(AttnCta cta, bool fp16, KvKind kv) {
  return mma_attention_entry<128>(cta, fp16, kv);
}

}  // namespace attnrt::cuda
