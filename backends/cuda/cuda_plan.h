// The cuda backend's per-step host plan, with no CUDA in it: from the ForwardBatch and the
// ReqToTokenPool it derives the requests, the split-KV counts and CTA work list of every layer
// class, the tree masks and the (incremental) page tables, and writes them in the byte layout the
// kernels read (attention_params.h) into a caller-given buffer. The backend acquires pinned
// staging, calls write() and issues one copy; tests and bench/plan_bench.cpp run it without a GPU.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "backends/cuda/kernels/attention_params.h"

namespace attnrt::cuda {

// Split-KV policy. A request is split when the step's CTAs would not fill the GPU; a split never
// gets fewer keys than the minimum chunk (the merge costs a partial write and read per split).
constexpr int kMaxSplits = 64;
constexpr int kMinChunkDecode = 256;
constexpr int kMinChunkPrefill = 1024;
// Deterministic mode: splits depend on the request's own length only, so a request's output does
// not change with the rest of the batch.
constexpr int kDeterministicChunk = 1024;
constexpr int kCtasPerSm = 4;

// Up to 32 (token, head-in-group) rows per request: decode tiles; 33..64 rows: one verify CTA;
// more: prefill tiles (see cuda_plan.cpp for the measurements behind the bounds).
TileShape choose_shape(int max_qlen, int group);

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
};

// What the plan needs to know of the model and the GPU, fixed at backend construction.
struct PlannerConfig {
  std::vector<int> groups;                      // distinct GQA group sizes of the KV layers
  std::vector<int> head_dims;                   // head dim per class
  std::vector<std::array<int, 3>> occupancy;    // resident CTAs per SM, per class and TileShape
  int num_kv_heads_max = 1;
  int sm_count = 132;
  bool deterministic = false;
};

// Fixed offsets of graph steps: the captured kernels were given these buffers.
struct GraphLayout {
  int max_bs = 0;
  size_t reqs_cap = 0, work_cap = 0, tree_cap = 0;  // entries per class / per step
  size_t meta_bytes = 0;                            // size of the graph metadata buffer
};

// Split counts every request of a graph step gets (they depend on the batch size only, so that a
// captured graph stays valid for any lengths).
int graph_splits(const PlannerConfig& cfg, int group, TileShape shape, int bs, int tokens_per_req);

class HostPlanner {
 public:
  explicit HostPlanner(PlannerConfig config);

  // Keeps committed page ids of every pool row across steps (the device row table of `rows` x
  // `pages_per_row` entries exists).
  void enable_row_table(int rows, int64_t pages_per_row);
  bool row_table_enabled() const { return pages_per_row_ > 0; }

  // Phase one of a step: checks the batch and lays the step out (plan().bytes). `padded_bs` >
  // batch_size pads with fill requests (graph replay); `graph` = null for an eager step.
  // `graph_replay`: the kernels of this graph plan run (a capture's do not). `capturing`: the
  // stream captures an eager step (whole page tables, no commits).
  const StepPlan& prepare(const ForwardBatch& batch, const ReqToTokenPool* pool, int page_size,
                          int padded_bs, const GraphLayout* graph, bool graph_replay,
                          bool capturing);
  // Phase two: writes the prepared step's plan().bytes bytes at `dst` (the batch and the pool
  // given to prepare must be unchanged).
  void write(void* dst);
  // A kernel of the current plan was launched: its commits are the row table's state from the
  // next plan on.
  void launched() { commits_launched_ = true; }

  const StepPlan& plan() const { return plan_; }
  const PlannerConfig& config() const { return config_; }

 private:
  struct Request {
    int64_t row;
    int32_t prefix, qlen, qo_start;
  };
  struct Commit {
    int32_t row;
    int32_t pages;
    uint64_t gen;
  };
  void derive_requests(const ForwardBatch& batch);
  void choose_splits(const ClassPlan& cp, int bs, int64_t cap, int32_t* splits);

  PlannerConfig config_;
  StepPlan plan_;
  // The step being planned (prepare -> write).
  const ForwardBatch* batch_ = nullptr;
  const ReqToTokenPool* pool_ = nullptr;
  const GraphLayout* graph_ = nullptr;
  bool commit_ = false;
  int raw_bs_ = 0;
  int n_draft_ = 0;
  // Scratch reused every step (no allocation once grown).
  std::vector<Request> reqs_;
  std::vector<int32_t> tiles_, splits_, class_tiles_, pt_start_, pt_known_;
  std::vector<uint32_t> row_stamp_;  // duplicate-row check: row_stamp_[row] == stamp_ seen
  uint32_t stamp_ = 0;
  // Incremental page tables: per pool row, which pool generation and how many committed pages
  // the device row table holds. A plan's commits (pages its kernels store back) become that state
  // once a kernel of the plan was launched.
  int64_t pages_per_row_ = 0;
  std::vector<uint64_t> row_gen_;
  std::vector<int32_t> row_known_;
  std::vector<Commit> commits_;
  bool commits_launched_ = false;
};

}  // namespace attnrt::cuda
