// The linear-attention side of the cuda backend: gdn, kda and mamba2 layers on the GPU, with the
// LinearStatePool in GPU memory (backends/cuda/cuda_linear_state.h).
//
// Plan (init_forward_metadata): linear::make_step_plan, then ONE async upload of the requests'
// table (slot, rows, prefix flag) and the verify tree through pinned staging; nothing waits for
// the GPU. forward_linear: launch_conv (conv + SiLU into an fp32 scratch, window update or verify
// checkpoints), then the recurrence of the layer's kind (kernels/linear.h): token by token for
// DECODE, TARGET_VERIFY and requests of up to one chunk (64 tokens); an extend request longer than
// that goes to the chunked launcher of its kind where the layer's shape has one (delta rule:
// Dk = Dv = 64 or 128; SSD: head_dim 64, d_state 64 or 128).
// update_state_after_verify: launch_commit per layer.
//
// Data placement: LinearArgs tensors on the GPU are used in place (production). Host tensors are
// the correctness path (tests, the CLI): copied in, the output copied back, and the call
// synchronises the stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <string_view>

#include "attnrt/backend/linear_attn_backend.h"
#include "attnrt/linear/linear_step.h"
#include "backends/cuda/cuda_util.h"

namespace attnrt::cuda {

class CudaLinearStateMemory;

class CudaLinearBackend final : public LinearAttnBackend {
 public:
  // Throws attnrt::Error without a usable CUDA device, a pool in GPU memory, or for a linear layer
  // of the model outside what the kernels take (conv kernel <= 8, state columns <= 256, heads a
  // multiple of the key heads / groups).
  explicit CudaLinearBackend(const BackendContext& ctx);
  ~CudaLinearBackend() override;

  std::string_view name() const override { return "cuda"; }
  void init_forward_metadata(const ForwardBatch& batch) override;
  void forward_linear(const LinearArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;
  void update_state_after_verify(std::span<const int32_t> last_accepted) override;

  // The stream of every launch and copy: the state pool's (the CudaKVCache's in a runtime).
  cudaStream_t stream() const;
  const attnrt::linear::StepPlan& plan() const { return plan_; }

 private:
  void ensure(DeviceBuffer& buf, size_t bytes);

  CudaLinearStateMemory* memory_ = nullptr;
  // meta_ holds the request table, and when the step has requests longer than a chunk (split_)
  // two more: the short requests only and the long ones only (the others' tokens set to 0).
  bool split_ = false;
  size_t table_bytes_ = 0;
  size_t parents_off_ = 0;  // byte offset of the tree in meta_
  StagingRing staging_;
  DeviceBuffer meta_;       // the step's request tables (see split_), then the verify parents
  DeviceBuffer commit_;     // update_state_after_verify: slots (int64), then last_accepted (int32)
  DeviceBuffer y_;          // conv outputs [T, conv_dim]: fp32, or bf16 for 16-bit activations
  DeviceBuffer io_;         // host tensors of the call, staged
  DeviceBuffer workspace_;  // the chunked launchers' workspace
};

}  // namespace attnrt::cuda
