// The `cuda` backend: paged full attention on NVIDIA GPUs (sm_90a), every full-attention mode.
//
// Plan (init_forward_metadata): HostPlanner (cuda_plan.h, plain C++) lays out per request the query
// rows, prefix and key count, the page table (page ids read from ReqToTokenPool), the tree masks
// of a TARGET_VERIFY tree, and per layer class (GQA group size) the split-KV counts and the CTA
// work list, straight into pinned staging; everything goes to the GPU in ONE cudaMemcpyAsync.
// Nothing in the plan or in forward waits for the GPU when the tensors and the KV cache live on
// the GPU.
//
// Data placement: AttnArgs tensors on the GPU are used in place. Host tensors (the conformance
// harness, the CLI) are the correctness path: q is copied in, out/lse copied back, and the call
// synchronises its stream. A host KVCache is mirrored to the GPU layer by layer on every forward
// (whole pools: slow, for correctness runs only); a CudaKVCache is read in place.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/registry.h"
#include "backends/cuda/cuda_plan.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

class CudaKVCache;

class CudaBackend final : public AttentionBackend {
 public:
  explicit CudaBackend(const BackendContext& ctx);
  ~CudaBackend() override;

  std::string_view name() const override { return "cuda"; }
  void init_forward_metadata(const ForwardBatch& batch) override;
  void forward_decode(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;
  void forward_extend(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override;

  void init_cuda_graph_state(int max_bs, int max_num_tokens) override;
  void init_forward_metadata_capture_cuda_graph(int bs, int num_tokens,
                                                const ForwardBatch& batch) override;
  void init_forward_metadata_replay_cuda_graph(int bs, int raw_bs,
                                               const ForwardBatch& batch) override;
  int cuda_graph_seq_len_fill_value() const override { return 1; }

  // The stream every launch and copy of this backend goes to (the CudaKVCache's when the context
  // holds one, else a stream of its own). set_stream also moves a CudaKVCache to that stream.
  cudaStream_t stream() const { return stream_; }
  void set_stream(void* stream) override;
  const StepPlan& plan() const { return planner_->plan(); }

  // Host seconds of the last plan's phases (init_forward_metadata and the graph hooks), kept when
  // set_plan_timing(true) asked for them: the stream's capture query, the staging slot's acquire
  // (its wait for the copy that last read it), the planner's prepare (with the metadata buffer's
  // size check), the planner's write into the slot (with its growth, on the first step of a size)
  // and the copy's issue (with every 16th step's event record). Off, a plan reads no clock.
  struct PlanParts {
    double capture = 0, prepare = 0, staging = 0, write = 0, copy = 0;
  };
  bool set_plan_timing(bool on) override {
    plan_timing_ = on;
    return true;
  }
  const PlanParts& last_plan_parts() const { return plan_parts_; }
  std::array<double, 5> plan_part_seconds() const override {
    const PlanParts& p = plan_parts_;
    return {p.capture, p.staging, p.prepare, p.write, p.copy};
  }

 private:
  void build_plan(const ForwardBatch& batch, int padded_bs, bool graph);
  void init_row_table();
  void run(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch);
  void ensure(DeviceBuffer& buf, size_t bytes, const char* what);

  CudaKVCache* device_cache_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaStream_t own_stream_ = nullptr;  // created here (no GPU cache); destroyed here
  int64_t max_q_heads_x_dv_ = 0;

  // The plan's host part and its state across steps (committed pages per pool row).
  std::unique_ptr<HostPlanner> planner_;
  // Incremental page tables: per pool row, the committed page ids on the device (the planner knows
  // which rows hold how many).
  DeviceBuffer row_table_;
  bool row_table_ready_ = false;
  bool graph_replay_ = false;
  StagingRing staging_;
  // Least bytes a plan's upload copies (ATTNRT_PLAN_COPY_MIN_BYTES; 0 = the plan's own size). On
  // the H200 host a cudaMemcpyAsync of a 17 KiB plan (decode at batch 256) costs 7-8 us of host
  // time, one of 64 KiB 2-3 us (smaller copies appear to be written into the command stream by the
  // CPU), for ~2 us more of DMA on the GPU: 64 KiB by default.
  size_t copy_min_bytes_ = size_t{64} << 10;
  bool plan_timing_ = false;
  PlanParts plan_parts_;
  DeviceBuffer meta_;       // eager steps' metadata
  DeviceBuffer sched_;      // AttnParams::sched
  DeviceBuffer partials_;   // split-KV partial outputs and lse
  // Graph state: fixed-address buffers sized for the largest captured step.
  bool graph_ready_ = false;
  bool graph_step_ = false;  // the current plan lives in the graph buffers
  int graph_max_tokens_ = 0;
  DeviceBuffer graph_meta_, graph_partials_;
  GraphLayout graph_layout_;
  // Host-path scratch: q, out, lse, sinks, mirrored host KV layers.
  DeviceBuffer io_;
  struct Mirror {
    DeviceBuffer k, v, map;
  };
  std::vector<Mirror> mirrors_;
};

BackendEntry cuda_backend_entry();

}  // namespace attnrt::cuda

namespace attnrt {
void register_cuda_backend(Registry& registry);
}  // namespace attnrt
