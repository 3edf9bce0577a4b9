// The `cuda` backend: paged full attention on NVIDIA GPUs (sm_90a), every full-attention mode.
//
// Plan (init_forward_metadata, host C++): per request the query rows, prefix and key count, the page
// table (page ids read from ReqToTokenPool), the tree masks of a TARGET_VERIFY tree, and per layer
// class (GQA group size) the split-KV counts and the CTA work list. Everything goes to the GPU in
// ONE cudaMemcpyAsync from pinned staging; nothing in the plan or in forward waits for the GPU
// when the tensors and the KV cache live on the GPU.
//
// Data placement: AttnArgs tensors on the GPU are used in place. Host tensors (the conformance
// harness, the CLI) are the correctness path: q is copied in, out/lse copied back, and the call
// synchronises its stream. A host KVCache is mirrored to the GPU layer by layer on every forward
// (whole pools: slow, for correctness runs only); a CudaKVCache is read in place.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/registry.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

class CudaKVCache;

// One GQA group size of the model's KV layers: its CTA shape, split counts and work list.
struct ClassPlan {
  int group = 1;
  int head_dim = 128;
  TileShape shape = TileShape::decode;
  size_t reqs_off = 0, work_off = 0;  // byte offsets in the step's metadata buffer
  int num_items = 0;
  int64_t part_rows = 0;              // partial rows of the requests with more than one split
  int max_splits = 1;
};

struct StepPlan {
  bool valid = false;
  ForwardMode mode = ForwardMode::IDLE;
  int bs = 0;                 // requests (padded size under graphs)
  int64_t num_tokens = 0;
  int page_shift = 0;
  bool tree = false;
  size_t tree_mask_off = 0, tree_depth_off = 0, pt_off = 0;
  size_t bytes = 0;           // bytes uploaded this step
  bool incremental = false;   // committed pages read from the persistent row table
  std::vector<ClassPlan> classes;
  std::vector<ReqInfo> reqs;  // class 0's requests (host copy, for tests and logging)
};

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
  void set_stream(cudaStream_t stream);
  const StepPlan& plan() const { return plan_; }

 private:
  struct Request {
    int64_t row;
    int32_t prefix, qlen, qo_start;
  };
  void build_plan(const ForwardBatch& batch, int padded_bs, bool graph);
  void derive_requests(const ForwardBatch& batch);
  void choose_splits(const ClassPlan& cp, int bs, int64_t cap, int32_t* splits);
  void init_row_table();
  int graph_splits(int group, TileShape shape, int bs, int tokens_per_req) const;
  void run(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch);
  void ensure(DeviceBuffer& buf, size_t bytes, const char* what);

  CudaKVCache* device_cache_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  int sm_count_ = 132;
  std::vector<int> groups_;  // distinct GQA group sizes of the model's KV layers
  int num_kv_heads_max_ = 1;
  int64_t max_q_heads_x_dv_ = 0;

  std::vector<int> class_dims_;                   // head dim per class
  std::vector<std::array<int, 3>> class_occupancy_;  // CTAs per SM per class and TileShape

  StepPlan plan_;
  // Plan scratch reused every step (no allocation once grown).
  std::vector<Request> reqs_;
  std::vector<int32_t> tiles_, splits_, class_tiles_, pt_start_, pt_known_;
  std::vector<uint32_t> row_stamp_;  // duplicate-row check: row_stamp_[row] == stamp_ seen
  uint32_t stamp_ = 0;
  // Incremental page tables: per pool row, the committed page ids on the device, and which pool
  // generation and how many pages of the row they hold. A plan's commits (pages its kernels store
  // back) become that state once a kernel of the plan was launched.
  DeviceBuffer row_table_;
  bool row_table_ready_ = false;
  int64_t pages_per_row_ = 0;
  std::vector<uint64_t> row_gen_;
  std::vector<int32_t> row_known_;
  struct Commit {
    int32_t row;
    int32_t pages;
    uint64_t gen;
  };
  std::vector<Commit> commits_;
  bool commits_launched_ = false;
  bool graph_replay_ = false;
  StagingRing staging_;
  DeviceBuffer meta_;       // eager steps' metadata
  DeviceBuffer partials_;   // split-KV partial outputs and lse
  // Graph state: fixed-address buffers sized for the largest captured step.
  bool graph_ready_ = false;
  bool graph_step_ = false;  // the current plan lives in the graph buffers
  int graph_max_bs_ = 0, graph_max_tokens_ = 0;
  DeviceBuffer graph_meta_, graph_partials_;
  size_t graph_reqs_cap_ = 0, graph_work_cap_ = 0, graph_tree_cap_ = 0;
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
