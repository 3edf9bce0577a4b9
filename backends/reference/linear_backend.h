// The linear-attention side of the reference backend: the float64 math of src/linear run request
// by request, with the state in the LinearStatePool (reference-semantics §8.8 - §8.10). EXTEND-like
// modes use the chunked form (chunk = the layer's chunk_size), DECODE the sequential step,
// TARGET_VERIFY the sequential step from each token's parent state with a checkpoint per token
// (chain and tree, every kind).
#pragma once

#include <string_view>

#include "attnrt/backend/linear_attn_backend.h"

namespace attnrt {

class ReferenceLinearBackend final : public LinearAttnBackend {
 public:
  explicit ReferenceLinearBackend(const BackendContext& ctx);

  std::string_view name() const override { return "reference"; }
  void forward_linear(const LinearArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;

  // Extend form: chunked with the layer's chunk size (0, the default), chunked with `chunk`
  // tokens (> 0), or token by token (-1). Tests use it to hold the forms against each other.
  void set_extend_chunk(int chunk) { extend_chunk_ = chunk; }

 private:
  int extend_chunk_ = 0;
};

}  // namespace attnrt
