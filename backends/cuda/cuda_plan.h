// The cuda backend's per-step host plan, with no CUDA in it: from the ForwardBatch and the
// ReqToTokenPool it derives the requests, the split-KV counts and CTA work list of every layer
// class, the tree masks and the (incremental) page tables, and writes them in the byte layout the
// kernels read (attention_params.h) into a caller-given buffer. The backend acquires pinned
// staging, calls prepare() and write() on it and issues one copy; tests and bench/plan_bench.cpp
// run it without a GPU.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/merge_limits.h"

namespace attnrt::cuda {

// Split-KV policy. A request is split when the step's CTAs would not fill the GPU; a split never
// gets fewer keys than the minimum chunk (the merge costs a partial write and read per split).
// 128 splits: one request with one KV head (MLA, DSA) fills the 132 SMs of an H100 / H200 at 256
// keys a split, where 64 left half of them idle (mla-decode-h16-1x32768 at 26% of copy).
constexpr int kMaxSplits = 128;
static_assert(kMaxSplits <= kMergeMaxSplits, "the merge kernel must combine every split");
constexpr int kMinChunkDecode = 256;
constexpr int kMinChunkPrefill = 1024;
// Deterministic mode: splits depend on the request's own length only, so a request's output does
// not change with the rest of the batch. Keys per split: 1024 for 16-row decode tiles; 8192 for
// tiles of 32 and 64 rows (verify, wide groups), whose split partials are 2-4x larger per key
// and whose batches fill the GPU without splits: on the H200, verify-chain-64x4096+8 (32-row
// tiles) took 0.37 / 0.34 / 0.33 ms at 1024 / 2048 / 4096 keys per split against 0.29 ms unsplit,
// where decode-64x4096 lost 3% at 1024.
constexpr int kDeterministicChunk = 1024;
constexpr int kDeterministicWideChunk = 8192;
// Deterministic mode's most splits of a request: requests past 64 x 1024 keys take longer chunks
// (a batch-invariant graph state reserves partials for this many splits of every request).
constexpr int kMaxDeterministicSplits = 64;
static_assert(kMaxDeterministicSplits <= kMaxSplits);

// The tile shapes deterministic mode splits: decode and verify tiles (a prefill-shaped tile, of
// more than 64 query rows, is never split in that mode).
constexpr bool deterministic_split_shape(TileShape shape) { return shape != TileShape::prefill; }
constexpr int deterministic_chunk(TileShape shape) {
  return shape == TileShape::decode ? kDeterministicChunk : kDeterministicWideChunk;
}

// Deterministic mode's split count of a decode- or verify-shaped request of kv_len keys: its own
// length by the shape's chunk, 1 to kMaxDeterministicSplits.
// Eager and graph steps use the same rule, so a request's output is the same whatever batch it is
// in and whether it runs captured or not.
constexpr int32_t deterministic_splits(int64_t kv_len, TileShape shape = TileShape::decode) {
  const int64_t chunk = deterministic_chunk(shape);
  const int64_t s = (kv_len + chunk - 1) / chunk;
  return static_cast<int32_t>(s < 1                         ? 1
                              : s > kMaxDeterministicSplits ? kMaxDeterministicSplits
                                                            : s);
}
constexpr int kCtasPerSm = 4;

// One GQA group size of the model's KV layers: its CTA shape, split counts and work list.
struct ClassPlan {
  int group = 1;
  int head_dim = 128;
  TileShape shape = TileShape::decode;
  int item_rows = 16;                 // most query rows of a work item (AttnParams::item_rows)
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
  bool steady = false;        // the requests came from the steady-decode pass
  std::vector<ClassPlan> classes;
};

// What the plan needs to know of the model and the GPU, fixed at backend construction.
struct PlannerConfig {
  std::vector<int> groups;                      // distinct GQA group sizes of the KV layers
  std::vector<int> head_dims;                   // head dim per class
  std::vector<std::array<int, kNumTileShapes>> occupancy;    // resident CTAs per SM, per class and TileShape
  int num_kv_heads_max = 1;
  int sm_count = 132;
  bool deterministic = false;
  // Keys per split of decode-shaped steps when > 0 (rounded up to whole key tiles), instead of the
  // wave model's choice: for measuring the split policy (ATTNRT_KV_CHUNK, read by the backend).
  // Graph steps and the deterministic mode keep their own rules.
  int kv_chunk = 0;
  // The steady-decode pass (HostPlanner::prepare): off, every step takes the general pass over
  // its requests (the same bytes; for tests and A/B timing).
  bool steady_decode = true;
  // Per class: when > 0, the work list of a prefill-shaped class whose requests span more than
  // one query tile is written in sections of consecutive requests whose key counts (kv_len) add
  // up to at most this many (a request longer than that is a section of its own), each section
  // heaviest tiles first as the whole list is otherwise. The persistent CTAs take the list in
  // order, so the units running at once then share the K / V of fewer requests, which an
  // L2-sized section keeps in L2 (the backend sets 24 MiB of K / V, or half the L2 where less;
  // ATTNRT_PREFILL_SECTION_MB overrides it; 0 or missing: one section).
  std::vector<int64_t> section_keys;
};

// Fixed offsets of graph steps: the captured kernels were given these buffers.
struct GraphLayout {
  int max_bs = 0;
  size_t reqs_cap = 0, work_cap = 0, tree_cap = 0;  // entries per class / per step
  size_t meta_bytes = 0;                            // size of the graph metadata buffer
  // Deterministic mode (batch-invariant graphs): the work items each (request, query tile) of a
  // decode- or verify-shaped class gets, deterministic_splits(max_context_len), fixed so that the
  // captured grid holds every replay. A request of fewer splits leaves its items past num_splits empty,
  // and the kernels return at once on those (item.split >= num_splits). 0: not deterministic.
  int det_splits = 0;
};

// Split counts every request of layer class `c` gets in a graph step (they depend on the batch
// size only, so that a captured graph stays valid for any lengths).
int graph_splits(const PlannerConfig& cfg, size_t c, TileShape shape, int bs, int tokens_per_req);

class HostPlanner {
 public:
  explicit HostPlanner(PlannerConfig config);

  // Keeps committed page ids of every pool row across steps (the device row table of `rows` x
  // `pages_per_row` entries exists).
  void enable_row_table(int rows, int64_t pages_per_row);
  bool row_table_enabled() const { return pages_per_row_ > 0; }

  // Bytes prepare() writes at its `dst`: the first class's requests, which lie at offset 0 of
  // every step's layout.
  static size_t prepare_bytes(const ForwardBatch& batch, int padded_bs);
  // Phase one of a step: checks the batch and lays the step out (plan().bytes), writing the
  // requests at `dst` (prepare_bytes(), the start of the step's bytes) as it derives them: a
  // request is written once, where the upload reads it. `padded_bs` > batch_size pads with fill
  // requests (graph replay); `graph` = null for an eager step. `graph_replay`: the kernels of this
  // graph plan run (a capture's do not). `capturing`: the stream captures an eager step (whole
  // page tables, no commits).
  const StepPlan& prepare(const ForwardBatch& batch, const ReqToTokenPool* pool, int page_size,
                          int padded_bs, const GraphLayout* graph, bool graph_replay,
                          bool capturing, void* dst);
  // Phase two: writes the rest of the prepared step's plan().bytes bytes at `dst` (the batch and
  // the pool given to prepare must be unchanged). `dst` is prepare's, or a larger buffer when that
  // one could not hold the step (the requests are then copied over; prepare's must still exist).
  void write(void* dst);
  // A kernel of the current plan was launched: its commits are the row table's state from the
  // next plan on.
  void launched() { commits_launched_ = true; }

  const StepPlan& plan() const { return plan_; }
  const PlannerConfig& config() const { return config_; }

 private:
  // Query tiles and splits of a class's requests: one value for all when the lengths allow
  // (> 0), else per request in class_tiles_ / splits_ (0).
  struct ClassWork {
    int32_t tiles = 0;
    int32_t splits = 0;
    int32_t pad_splits = 0;  // > 0: items per (request, tile), whatever its own split count
  };
  // What the plan reads of a layer class every step, in one cache line: the config's values
  // (copied at construction) and the class's work. A plan starts cold in serving, where each
  // separate array read per class costs a miss.
  struct alignas(64) ClassState {
    int32_t group;
    int32_t head_dim;
    std::array<int32_t, kNumTileShapes> occupancy;
    ClassWork work;
  };
  struct Stats {
    int32_t tokens = 0, min_q = INT32_MAX, max_q = 0;
    uint32_t min_kv = UINT32_MAX, max_kv = 0;
    int64_t sum_kv = 0;
    int64_t pages = 0;  // page ids the step uploads when it is incremental
  };
  // Per pool row: what the device row table holds (its generation and committed page count), the
  // commit of the last plan the row was in, and the duplicate-row check's stamp (== stamp_: the
  // row is in the step already). One cache line read per request: the plan starts cold in serving
  // (after a GPU drain), where each distinct array touched per request costs a miss.
  // `checked`: the pool's generation_epoch() when `gen` was last found current (while the epoch
  // holds, the row's generation is not read again).
  // `pending` (>= 0): the page count the last plan's kernels store back. It becomes `known` when
  // the row is next planned, since by then that plan's kernels were launched: the commits of a
  // plan whose kernels never ran are dropped by the next prepare() (drop_commits).
  struct RowState {
    uint64_t gen;
    uint64_t checked;
    int32_t known;
    uint32_t stamp;
    int32_t pending;
    int32_t pad;
  };
  static constexpr RowState kUnknownRow{~uint64_t{0}, 0, 0, 0, -1, 0};
  template <bool kDecode, bool kTrack, bool kCommit, typename Derive>
  void scan(const ForwardBatch& batch, Derive derive);
  template <bool kDecode, typename Derive>
  void scan(const ForwardBatch& batch, Derive derive);
  // The steady decode step: the same requests in the same rows as the last plan (see prepare()).
  bool steady_decode(const ForwardBatch& batch, const ReqToTokenPool* pool, int page,
                     const GraphLayout* graph, bool graph_replay, bool capturing) const;
  // Its pass over the requests; false (nothing of the plan's state changed but kv_last_, which is
  // not read before the next steady pass fills it) when a request fails a check, which the
  // general pass then reports.
  bool scan_steady_decode(const ForwardBatch& batch);
  // Writes the steady state back into the row states, which are current again. `launched`: the
  // last plan's kernels ran, so its commits are its rows' known pages (else the commits of the
  // plan before it are).
  void release_steady(bool launched);
  // Throws the error of request i, which failed scan()'s checks.
  [[noreturn, gnu::cold, gnu::noinline]] void reject_request(const ForwardBatch& batch, int i,
                                                             int32_t prefix, int32_t qlen) const;
  void derive_requests(const ForwardBatch& batch, bool steady);
  void plan_class(size_t c, int bs);
  uint32_t choose_chunk(size_t c, int bs, int64_t cap, int64_t base);
  // The work items of requests [i0, i1) of class c, heaviest tiles first, then request, then
  // split; returns the number written. It may store past them up to `end` (the end of the
  // class's list), where later items go.
  int64_t write_work_ragged(size_t c, WorkItem* items, const WorkItem* end, int i0, int i1) const;
  // The work items of class c request by request, split by split, the tiles of a split side by
  // side (heaviest first); returns the number written (it may store past them up to `end`).
  int64_t write_work_request_major(size_t c, WorkItem* items, const WorkItem* end) const;
  // No kernel stores the commits of the rows row_of_[0, n).
  void drop_commits(int n);

  PlannerConfig config_;
  StepPlan plan_;
  // The step being planned (prepare -> write).
  const ForwardBatch* batch_ = nullptr;
  const ReqToTokenPool* pool_ = nullptr;
  const GraphLayout* graph_ = nullptr;
  bool commit_ = false;
  int raw_bs_ = 0;
  int n_draft_ = 0;
  int pad_qlen_ = 1;
  int shift_ = 0;
  bool track_ = false;   // pages held by the row table are looked up (the step may be incremental)
  bool commit_if_incremental_ = false;
  bool tree_ = false;
  Stats stats_;
  // The step's requests in the kernels' layout at prepare's `dst`, as if the step were
  // incremental (the rare step that is not gets its page fields redone), with one split each.
  ReqInfo* info_ = nullptr;
  // Scratch reused every step (no allocation once grown): the requests' pool rows and key lengths.
  // kv_last_: the key lengths of the plan before (kept for the steady pass, see below).
  std::vector<int32_t> row_of_, kv_, kv_last_;
  // Every request of the DECODE step misses only its token's page, whose id write() takes from
  // out_cache_loc (the scan checked each slot's offset in its page).
  bool token_pages_ = false;
  std::vector<ClassState> classes_;
  std::vector<int32_t> splits_, class_tiles_;  // [class][request] where not uniform
  uint32_t stamp_ = 0;  // duplicate-row check (RowState::stamp)
  // Incremental page tables: per pool row, what the device row table holds. A plan's commits
  // (pages its kernels store back) become that state once a kernel of the plan was launched.
  int64_t pages_per_row_ = 0;
  std::vector<RowState> rows_;  // [pool rows], also without a row table (the stamps)
  int num_commits_ = 0;         // the last plan's requests with a pending commit: row_of_[0, n)
  bool commits_launched_ = false;
  // Steady decode. A decode step whose requests are the last committing DECODE plan's, in the
  // same rows and order, in the same pool generation epoch, after that plan's kernels ran, needs
  // of the row states only each request's committed page count, which is its key length in that
  // plan over the page size: a DECODE plan commits kv_len >> page_shift pages of every request
  // (the pages before its prefix it already knew, and the page its token completes). So kv_
  // (the last plan's lengths) stands in for RowState::pending of row row_of_[i], and after a
  // steady pass kv_last_ for RowState::known, for requests [0, steady_n_) (steady_n_ > 0: they
  // are current). steady_ahead_: a steady pass left the row states behind until
  // release_steady().
  int steady_n_ = 0;
  bool steady_ahead_ = false;
  const ReqToTokenPool* steady_pool_ = nullptr;
  uint64_t steady_epoch_ = 0;
  int steady_page_ = 0;
};

}  // namespace attnrt::cuda
