// Checks of one layer call shared by the host-memory backends (reference, cpu): layer kind, heads,
// dims, the q / k / v / out / lse tensors (shape, float dtype, host memory), sinks, and the layer's
// KV view. Every message starts with "<backend> backend:" and names the value and what is allowed.
#pragma once

#include <cstdint>
#include <string_view>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

void check_host_attn_args(std::string_view backend, const AttnArgs& args, const LayerSpec& layer,
                          int64_t num_tokens, const KVLayerView& kv);

}  // namespace attnrt
