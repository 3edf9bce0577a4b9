// The linear-attention side of the cpu backend: gdn, kda and mamba2 layers in fp32 with the SIMD
// kernels of linear_kernels.h, threads over requests x channel blocks (conv) and requests x heads
// (recurrence). EXTEND-like modes run the chunked form (chunk = the layer's chunk_size) from the
// cached prefix state; DECODE one recurrent step per request and head, state read and written in
// place; TARGET_VERIFY (chain and tree, every kind) one step per block token from its parent's
// checkpoint, the committed state untouched until update_state_after_verify.
#pragma once

#include <string_view>
#include <vector>

#include "attnrt/backend/linear_attn_backend.h"

namespace attnrt {

struct LinearLayerState;

class CpuLinearBackend final : public LinearAttnBackend {
 public:
  explicit CpuLinearBackend(const BackendContext& ctx);

  std::string_view name() const override { return "cpu"; }
  void forward_linear(const LinearArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;

  int num_threads() const { return num_threads_; }

 private:
  void run_conv(const LayerSpec& layer, const LinearLayerState& st);
  void run_recurrence(const LayerSpec& layer, const LinearLayerState& st, const LinearArgs& args);

  int num_threads_ = 1;
  // Per-layer working buffers, reused across layers and steps: inputs, conv outputs and outputs in
  // fp32, and the transposed conv weights.
  std::vector<float> x_, a_, b_, y_, o_, wt_, bias_;
};

}  // namespace attnrt
