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
#include "attnrt/backend/host_mla_mha.h"
#include "attnrt/backend/registry.h"
#include "attnrt/memory/kv_cache.h"
#include "backends/cuda/cuda_dsa.h"
#include "backends/cuda/cuda_plan.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

class CudaKVCache;

class CudaBackend final : public OnePathAttnBackend {
 public:
  explicit CudaBackend(const BackendContext& ctx);
  ~CudaBackend() override;

  std::string_view name() const override { return "cuda"; }
  void init_forward_metadata(const ForwardBatch& batch) override;

  void init_cuda_graph_state(int max_bs, int max_num_tokens) override;
  void init_forward_metadata_capture_cuda_graph(int bs, int num_tokens,
                                                const ForwardBatch& batch) override;
  void init_forward_metadata_replay_cuda_graph(int bs, int raw_bs,
                                               const ForwardBatch& batch) override;
  int cuda_graph_seq_len_fill_value() const override { return 1; }

  // MLA's MHA form with a chunked prefix (docs/mla.md; cuda_mla_mha.cpp): the causal part and
  // each chunk on the warp-specialised prefill CTA at 192 / 128, the chunks merged into out / lse
  // by its epilogue, the chunks' latent rows gathered from the pool on the GPU. GPU tensors are used in
  // place; host tensors (bf16 / fp16, contiguous) go through staging and the call synchronises.
  MlaForm mla_form() const override { return mha_.form(); }
  const PrefixChunkPlan& prefix_chunk_plan() const override { return mha_.chunks(); }
  void forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                       const ForwardBatch& batch) override;
  void forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args, const LayerSpec& layer,
                                const ForwardBatch& batch) override;
  void gather_prefix_chunk(int chunk, const KVLayerView& kv, int layer_id,
                           const TensorView& latent) override;

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
  void attend(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch) override;

  // attend()'s steps and what they hand on.
  struct CallDims {
    int hq = 0, hkv = 0, d = 0, dv = 0;  // q / kv heads, head dims of K and V
    bool mla = false;
    int64_t tokens = 0, dev_tokens = 0;  // the batch's tokens; rows of the GPU tensors
    bool on_device = false;              // q, out and lse live on the GPU
  };
  struct LayerKv {
    KVLayerView view;
    bool cache_on_device = false;
    bool stored = false;      // this step's KV-store kernels are the last work on the stream
    const void* k = nullptr;  // the K / V rows and slot map the kernel reads (mirrors for a
    const void* v = nullptr;  // host cache)
    const int64_t* slot_map = nullptr;
  };
  struct DeviceIo {
    const void* q = nullptr;
    void* out = nullptr;
    float* lse = nullptr;
    const float* sinks = nullptr;
    int64_t q_tok = 0, q_head = 0, o_tok = 0, o_head = 0, lse_tok = 0;  // element strides
    size_t o_bytes = 0, l_bytes = 0;
    bool staged_sinks = false;  // host sinks copied into staging
  };
  CallDims check_call(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch,
                      const StepPlan& plan) const;
  LayerKv store_and_view_kv(const AttnArgs& args, const LayerSpec& layer, const CallDims& c);
  void mirror_host_layer(int layer_id, LayerKv& kv);
  DeviceIo stage_activations(const AttnArgs& args, const CallDims& c);
  const ClassPlan& class_plan(const StepPlan& plan, const LayerSpec& layer,
                              const CallDims& c) const;
  void ensure_partials(const ClassPlan& cls, const CallDims& c, LayerKv& kv);
  AttnParams attn_params(const LayerSpec& layer, const StepPlan& plan, const ClassPlan& cls,
                         const CallDims& c, const LayerKv& kv, const DeviceIo& io) const;
  void launch_step(const AttnParams& p, const AttnArgs& args, const StepPlan& plan,
                   const ClassPlan& cls, const CallDims& c, const LayerKv& kv, const DeviceIo& io);
  // The merge of the split-KV partials of `num_reqs` requests (p.reqs, at most `max_splits` splits
  // each) into the call's output.
  void merge_partials(const AttnParams& p, const CallDims& c, const DeviceIo& io, int num_reqs,
                      int max_splits, bool fp16, bool dependent);
  void finish_call(const AttnArgs& args, const CallDims& c, const DeviceIo& io, const LayerKv& kv);
  void ensure(DeviceBuffer& buf, size_t bytes, const char* what);

  // DSA layers (cuda_dsa.cpp): the indexer's selection on the GPU, then the MLA CTA over each
  // token's selected slots. The plan is built and uploaded by the step's first DSA call.
  void attend_dsa(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch,
                  const StepPlan& plan, const CallDims& c);
  struct DsaOffsets {
    // Byte offsets in dsa_meta_ / graph_dsa_meta_ (round_scored: graph steps only).
    size_t tokens = 0, scored = 0, round_scored = 0, reqs = 0, work = 0;
  };
  void upload_dsa_plan(const DsaHostPlan& dp, const DsaOffsets& o, DeviceBuffer& dst);
  // CUDA graphs of DSA layers (docs/cuda_graphs.md "DSA layers"): the fixed buffers, sized by
  // init_cuda_graph_state for its buckets (returns the split-KV partial rows the sparse MLA needs),
  // and each graph plan's DSA part, planned and uploaded with the step's plan (outside a capture).
  int64_t init_dsa_graph_state(int max_bs, int max_tokens, int per_req);
  void plan_dsa_graph(const ForwardBatch& batch, int padded_bs);
  bool dsa_served_ = false;  // the model has DSA layers
  bool fp8_prefill_ = false;  // Options::fp8_prefill_attention: AttnKernelKey::fp8_prefill
  // The DSA layers' shape (the first one's), for graph plans; dsa_graph_uniform_: every DSA layer
  // has it (same topk, q heads, head dims, KV dtype), which graph steps need (one plan per step).
  DsaShape dsa_graph_shape_;
  bool dsa_graph_uniform_ = true;
  bool dsa_graph_ready_ = false;   // init_cuda_graph_state sized the DSA graph buffers
  int64_t dsa_graph_context_ = 0;  // max_context_len of the request rows: the scored bound
  StepLayout dsa_graph_layout_;
  DsaHostPlan dsa_graph_plan_;
  DsaOffsets dsa_graph_offsets_;
  size_t dsa_graph_work_cap_ = 0, dsa_graph_round_cap_ = 0;
  DeviceBuffer graph_dsa_meta_, graph_dsa_scores_, graph_dsa_slots_;
  // Most fp32 scores held at once (ATTNRT_DSA_SCORE_BUDGET, default 2^26 = 256 MiB): tokens past
  // it are scored and selected in later rounds.
  int64_t dsa_score_budget_ = int64_t{1} << 26;
  bool dsa_planned_ = false;  // dsa_plan_ is this step's, uploaded
  DsaShape dsa_shape_;
  StepLayout dsa_layout_;
  DsaHostPlan dsa_plan_;
  DsaOffsets dsa_offsets_;
  StagingRing dsa_staging_;
  DeviceBuffer dsa_meta_, dsa_scores_, dsa_slots_, dsa_io_, dsa_key_mirror_;
  std::vector<float> dsa_host_in_;      // host indexer inputs as fp32 rows
  std::vector<int32_t> dsa_host_topk_;  // the selection, on its way to a host topk

  // The MHA form (cuda_mla_mha.cpp). Its device plan: the requests and (item, head) units of the
  // causal part and of each chunk, each chunk's latent slots; built on the host in init_forward_metadata of an MHA-form step and uploaded by
  // that step's first MHA-form call.
  struct MhaPart {
    size_t reqs_off = 0, work_off = 0;
    int num_items = 0;
  };
  struct MhaDevicePlan {
    std::vector<unsigned char> host;  // the bytes to upload
    bool uploaded = false;
    MhaPart causal;
    std::vector<MhaPart> chunks;
    std::vector<size_t> slots_off;  // per chunk: int64 latent slots
  };
  void plan_mla_mha(const ForwardBatch& batch);
  void upload_mha_plan();
  bool planned_mha_for(const ForwardBatch& batch) const;
  // One MHA-form attention launch over GPU tensors: the causal part, or (`chunk`) a prefix chunk
  // whose rows merge into out / lse.
  void launch_mla_mha(const LayerSpec& layer, const MhaPart& part, bool chunk, const void* q,
                      int64_t q_tok, int64_t q_head, const void* k, int64_t k_tok, const void* v,
                      int64_t v_tok, void* out, int64_t o_tok, int64_t o_head, float* lse,
                      int64_t lse_tok, int64_t kv_rows, bool fp16);

  bool mha_served_ = false;  // the model has MLA layers with an MHA form
  int mha_heads_ = 0;        // their q heads (the first one's)
  HostMlaMhaSteps mha_{/*device_tensors=*/true};
  MhaDevicePlan mha_plan_;
  ForwardMode mha_mode_ = ForwardMode::IDLE;
  int mha_bs_ = -1;
  int64_t mha_tokens_ = -1;
  DeviceBuffer mha_meta_, mha_scratch_;

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

// `attnrt info --explain` (cuda_explain.cpp): the CTA of each attention layer shape and phase.
std::vector<std::string> explain_cuda_kernels(const ModelSpec& model, const Options& options,
                                              DType kv);

}  // namespace attnrt::cuda

namespace attnrt {
void register_cuda_backend(Registry& registry);
}  // namespace attnrt
