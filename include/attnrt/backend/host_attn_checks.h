// Checks shared by the host-memory backends (reference, cpu): of a step's request rows, and of
// one layer call (the context's KV cache, the step's plan, layer kind, heads, dims, the q / k / v /
// out / lse tensors (shape, float dtype, host memory), sinks, and the layer's KV view). Every
// message starts with "<backend> backend:" and names the value and what is allowed.
#pragma once

#include <cstdint>
#include <limits>
#include <string_view>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

// A [d0, d1, d2] tensor of a float dtype in host memory (`dims` names the three dimensions).
void check_host_tensor(std::string_view backend, const char* what, const TensorView& t, int64_t d0,
                       int64_t d1, int64_t d2, const char* dims);

// The key slots of request i of the step: its row of the request pool (batch.req_pool_indices[i]),
// checked first: ctx holds the pool, the row exists and holds the request's kv_len keys (at most
// max_keys), and it already maps this step's slots (out_cache_loc) at the request's new positions
// (write before read, reference-semantics §2.2: keys are read through the row only).
const int32_t* checked_request_row(std::string_view backend, const BackendContext& ctx,
                                   const ForwardBatch& batch, const StepLayout& layout, int i,
                                   int64_t max_keys = std::numeric_limits<int64_t>::max());

// The checks at the start of a layer call, in this order: ctx holds a KV cache; the step was
// planned for this batch (`planned`: the backend holds a plan whose mode, request count and token
// count are the batch's); then the layer, the tensors of `args` and the layer's KV view. Returns
// that view.
KVLayerView check_host_attn_call(std::string_view backend, const BackendContext& ctx, bool planned,
                                 const AttnArgs& args, const LayerSpec& layer,
                                 const ForwardBatch& batch);

}  // namespace attnrt
