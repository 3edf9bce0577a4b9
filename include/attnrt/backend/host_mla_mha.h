// The MHA form of MLA (docs/mla.md), the part every backend shares: the step's form and
// prefix-chunk plan, the checks of each call, and the order of the calls (a layer's prefix chunks
// after its causal part, each chunk once). The host-memory backends (reference, cpu) take host
// tensors only; a GPU backend constructs it with `device_tensors` (then a call's tensors may live
// on the GPU too; where, and in which dtypes, its own checks say). Every message starts with "<backend> backend:"
// and names the value and what is allowed; a rejected call changes nothing.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/mla_mha.h"
#include "attnrt/memory/kv_cache.h"

namespace attnrt {

class HostMlaMhaSteps {
 public:
  explicit HostMlaMhaSteps(bool device_tensors = false) : device_tensors_(device_tensors) {}

  // In init_forward_metadata, after the layout: the form (choose_mla_form, served when the model
  // has an MLA layer with an MHA form) and, for the MHA form, the prefix-chunk plan.
  void plan(std::string_view backend, const BackendContext& ctx, const ForwardBatch& batch,
            const StepLayout& layout);
  MlaForm form() const { return form_; }
  const PrefixChunkPlan& chunks() const { return chunks_; }

  // The checks of a causal call, before anything is stored; `planned` as for
  // check_host_attn_call. Returns the layer's KV view (its latent pool).
  KVLayerView check_causal(std::string_view backend, const BackendContext& ctx, bool planned,
                           const MlaMhaArgs& args, const LayerSpec& layer,
                           const ForwardBatch& batch) const;
  // After the causal part of `layer_id` ran: its chunks may follow.
  void causal_done(int layer_id);
  // The checks of a chunk call: chunk in range, the causal part of this layer ran and this chunk
  // did not yet, the tensors.
  void check_chunk(std::string_view backend, bool planned, int chunk, const MlaChunkArgs& args,
                   const LayerSpec& layer, const ForwardBatch& batch) const;
  void chunk_done(int chunk) { done_[chunk] = 1; }
  // A step without MLA layers in the MHA form (absorbed, no chunks).
  void reset();

 private:
  bool device_tensors_ = false;
  MlaForm form_ = MlaForm::absorbed;
  PrefixChunkPlan chunks_;
  int layer_ = -1;             // the layer whose causal part ran last (-1: none this step)
  std::vector<uint8_t> done_;  // [chunks] merged into layer_'s result
};

}  // namespace attnrt
