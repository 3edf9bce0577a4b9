// Decode context parallelism (docs/dcp.md): token g of a request lives on rank g mod n; each rank
// attends its share, the partials (output | lse) are exchanged by one all-to-all per layer and
// merged exactly, in rank order.
//   DcpRank       one rank: its AttentionRuntime, its batch derived from the global one, its
//   partial
//                 and its merge (the unit a process per GPU would hold)
//   DcpAttention  n simulated ranks in one process over an InProcessCommunicator, with the
//                 interface of one runtime: begin_step(global batch), forward(layer, args),
//                 end_step
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "attnrt/runtime/attention_runtime.h"
#include "attnrt/runtime/communicator.h"

namespace attnrt {

class DcpDeviceRank;  // src/runtime/dcp_device.h

inline constexpr int kMaxDcpSize = 64;

// Of a request's first x tokens, how many rank r of n holds.
inline int32_t dcp_local_count(int64_t x, int r, int n) {
  return static_cast<int32_t>((x + n - 1 - r) / n);
}
// Rank d of n merges q heads [dcp_head_begin(d), dcp_head_begin(d + 1)).
inline int dcp_head_begin(int d, int num_q_heads, int n) {
  return static_cast<int>(int64_t{d} * num_q_heads / n);
}

// Throws attnrt::Error when options.dcp_size is out of range or a layer of the model cannot be
// split by context (non-causal, DSA indexer, linear attention), naming the layer, the value and
// what is allowed. dcp_size 1 accepts every model.
void validate_dcp(const ModelSpec& model, const Options& options);

// The exact merge of one (row, head): parts[r] = rank r's packed partial [dv outputs | lse], in
// rank order; sink = the layer's sink logit of the head, if any. Writes the merged output to out[0,
// dv) and returns the merged lse. Ranks with lse = -inf contribute nothing; when every part is
// empty (and no sink) the output is 0 and the lse -inf.
float dcp_merge(std::span<const float* const> parts, int dv, std::optional<float> sink, float* out);

// The device buffers of one rank's CUDA-graph steps (docs/dcp.md "CUDA graphs"): sized for steps of
// up to `tokens` query rows over every layer of `model` (the largest of each), allocated once by
// DcpRank::init_cuda_graph_state at fixed addresses and never grown. Activations are counted at
// the model's dtype (at least 2 bytes: the cuda kernels take bf16 / fp16).
struct DcpGraphSizes {
  int64_t tokens = 0;
  size_t gather[3] = {0, 0, 0};  // the entries' q, k, v rows [tokens, H, D] (MLA: no v)
  size_t out = 0;                // the partial output [tokens, Hq, Dv]
  size_t lse = 0;                // its lse, fp32 [tokens, Hq]
  size_t send = 0;               // the packed partials of every head, fp32 [tokens, Hq, Dv + 1]
  size_t recv = 0;               // n blocks of this rank's heads, fp32 [n, tokens, heads, Dv + 1]
  size_t index = 0;              // one entry list: [tokens entries' rows | tokens rows' entries]
  int parts = 0;                 // entry lists: one per sliding window of the layers
  // Everything above, the entry list once per part.
  size_t total() const;
};
// Throws attnrt::Error for tokens < 1, n out of [1, kMaxDcpSize] or a rank outside [0, n).
DcpGraphSizes dcp_graph_sizes(const ModelSpec& model, int n, int rank, int64_t tokens);

// The entry list a rank's device work reads (docs/dcp.md "Each rank's batch"): `rows` (the global
// query row of each entry) padded with row 0 to `entries` entries, then for each of the step's
// `tokens` rows its entry, or -1 for a row without one (padded entries belong to no row); into
// out[0, entries + tokens). An eager step's list has entries = rows.size(); a graph step's
// entries = tokens = the captured rows. Throws attnrt::Error when rows.size() > entries or a row
// is outside [0, tokens).
void dcp_entry_list(std::span<const int64_t> rows, int64_t entries, int64_t tokens, int64_t* out);

class DcpRank {
 public:
  // The rank's runtime is built from `model` without sinks (they are added in the merge), with
  // `options` (dcp_size = 1 on the rank) and `config` per rank; its req_to_token has a row per
  // request row (max_requests, the request's local columns) and max_num_tokens key-list rows (one
  // per query row of a step), max_context_len / n (+ the verify block) wide.
  // A rank on GPU pools starts on its device communicator's stream for this rank (the legacy
  // default one unless the communicator was made with another; set_stream moves it).
  // `comm` moves the partials: host buffers (in_process) for host tensors, device buffers
  // (device_in_process, nccl) for GPU tensors; a rank with a device communicator takes host
  // tensors too when `host_comm` (host buffers, the same group) is given.
  DcpRank(int rank, const ModelSpec& model, const Options& options, const RuntimeConfig& config,
          Communicator& comm, Communicator* host_comm = nullptr);
  ~DcpRank();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The rank's runtimes, one per sliding window of the model's layers (in the order the layers
  // first use them): a step's key lists differ between windows. local_row: the slots of request row
  // `row` in part `part`'s pool, in column order.
  int num_parts() const { return static_cast<int>(parts_.size()); }
  AttentionRuntime& runtime(int part = 0);
  const std::vector<int32_t>& local_row(int row, int part = 0) const;
  void set_kv_scales(int layer_id, float k_scale, float v_scale);
  // GPU pools: the CUDA stream (a cudaStream_t; nullptr = the legacy default stream) that every
  // later part runtime, the rank's gather / pack / merge and its exchange (the communicator's
  // rank, Communicator::set_stream) run on, ordered after what the old stream still has queued.
  // An engine passes its own stream (the Python package: torch's current one, per step); GPU
  // tensors given to forward are then read and written in that stream's order, as by one
  // runtime, and nothing waits on the host. Host pools ignore it (stream() stays nullptr).
  void set_stream(void* stream);
  void* stream() const { return stream_; }
  // Releases the request's slots on this rank; the row starts empty again.
  void free_request(int row);
  // See DcpAttention::reserve_prefix.
  void reserve_prefix(int row, int32_t tokens);
  // The pool row of request row `row` in part `part`'s req_to_token: it holds the request's local
  // columns (written when an entry reads them, docs/dcp.md "Each rank's batch").
  int request_row(int row, int part = 0) const;
  // What the last begin_step built, over every part: entries that read their request's own row
  // (a row prefix, nothing copied), entries that read a key-list row, and the slot ids written
  // into req_to_token (key lists, and the columns request rows did not hold yet).
  struct StepCounts {
    int64_t direct = 0, listed = 0, copied = 0;
  };
  const StepCounts& step_counts() const { return counts_; }
  // The batch the last begin_step gave part `part`'s runtime (decode-shaped entries over
  // request rows and key-list rows of its req_to_token, marked dcp_partial; IDLE when none).
  const ForwardBatch& part_batch(int part = 0) const { return parts_.at(part).batch; }
  // false: every entry reads a key-list row (a copy of its keys), as before request rows were
  // read directly; for tests comparing the two. Default true.
  void set_direct_rows(bool on) { direct_rows_ = on; }

  // The errors begin_step would give, before anything changes: rows of the group, the prefix
  // stored, the step within max_num_tokens.
  void check_step(const ForwardBatch& batch, const StepLayout& layout) const;
  // Derives the rank's batch from the global one (docs/dcp.md), allocates the local slots of the
  // tokens this rank owns and begins the rank runtime's step. `batch` must outlive end_step.
  void begin_step(const ForwardBatch& batch);
  // The rank's partial of layer `layer_id` for every global row (q, k, v of the global step; the
  // rank stores the k/v of the tokens it owns), packed and handed to the all-to-all. GPU tensors
  // (the rank's runtimes on the cuda backend): the rows are gathered, attended, packed and merged
  // in GPU memory on the rank runtime's stream (kernels/dcp.h).
  void forward(int layer_id, const AttnArgs& args);
  // forward() in its two halves (to time or overlap them): the partial, packed into the send
  // buffer; then the rank's all-to-all call.
  void partial(int layer_id, const AttnArgs& args);
  void exchange();
  // After the all-to-all has completed on every rank: the merged rows of this rank's heads, written
  // into args.out (and args.lse when given) at those heads; other heads are not touched.
  void merge(int layer_id, const AttnArgs& args);
  void end_step();
  // See DcpAttention::commit_verify.
  void commit_verify(const ForwardBatch& batch, std::span<const std::vector<int32_t>> accepted);
  // Waits for the rank's GPU work (its stream); nothing to wait for on the host.
  void synchronize();

  // CUDA graphs an engine captures itself (docs/dcp.md "CUDA graphs"; the calls of
  // AttentionRuntime's engine-captured graphs). The rank's batch is decode-shaped rows whatever
  // the global step's mode, so a graph depends on its number of query rows alone: one captured
  // at `tokens` rows replays any step (DECODE, TARGET_VERIFY chain or tree, EXTEND, MIXED,
  // DRAFT_EXTEND) of at most that many tokens.
  //   init_cuda_graph_state(max_num_tokens)  once, before any capture: every buffer a captured
  //                                  step touches (dcp_graph_sizes, the part runtimes' graph
  //                                  state), at fixed addresses
  //   begin_capture_step(tokens)     before capturing a step of `tokens` rows (outside the
  //                                  capture: it uploads the placeholder plan); then, inside it,
  //                                  forward + merge of every layer on the rank's stream with
  //                                  GPU tensors of `tokens` rows (q / k / v / out / lse: the
  //                                  engine's static tensors; sinks on the GPU), then end_step
  //   begin_replay_step(batch, tokens)  before every replay: the real step (at most `tokens`
  //                                  tokens; rows past them come out as 0, lse -inf or the
  //                                  sink's logit): its slots, key lists and entry lists,
  //                                  written into the fixed buffers by stream-ordered copies
  //                                  from pinned staging; then
  //                                  the graph's launch on the rank's stream, then end_step
  // Eager steps (begin_step) go on alongside, with buffers of their own. Throws attnrt::Error,
  // changing nothing, when graphs are off (cuda_graphs_off_reason()), for tokens beyond
  // init_cuda_graph_state's, a replayed step of more tokens than `tokens`, or the errors
  // begin_step gives; and inside a capture for what cannot be captured (a step begun with
  // begin_step, host tensors or sinks, a growing buffer), naming what to do instead.
  bool cuda_graphs_enabled() const { return graph_off_reason_.empty(); }
  const std::string& cuda_graphs_off_reason() const { return graph_off_reason_; }
  void init_cuda_graph_state(int max_num_tokens);
  int cuda_graph_max_tokens() const { return graph_max_tokens_; }
  void begin_capture_step(int tokens);
  void begin_replay_step(const ForwardBatch& batch, int tokens);
  // The rows of the step begun: the batch's tokens (eager), or the graph's `tokens`.
  int64_t step_rows() const { return num_tokens_; }

 private:
  int rank_, size_;
  ModelSpec model_;  // the global model (with sinks)
  Communicator* comm_;
  Communicator* host_comm_;
  void* stream_ = nullptr;                 // GPU pools: the stream everything of the rank runs on
  std::unique_ptr<DcpDeviceRank> device_;  // GPU tensors: buffers and kernels, made when first used
  void forward_device(int layer_id, const AttnArgs& args);
  // The exchange partial() prepared (host or device buffers).
  Communicator* exchange_comm_ = nullptr;
  std::span<const float> exchange_send_;
  std::span<float> exchange_recv_;
  std::vector<int64_t> send_counts_, recv_counts_;
  void merge_device(int layer_id, const AttnArgs& args);
  Communicator& host_communicator();
  // The layers of one sliding window (-1: none) on this rank, with a runtime of their own.
  struct Part {
    int window = -1;
    std::vector<int> layer_ids;  // the model's ids; the part's runtime numbers them 0, 1, ...
    std::unique_ptr<AttentionRuntime> runtime;
    std::vector<std::vector<int32_t>> local;  // per request row: the slots of its columns
    // Per request row: its pool row; how many leading columns of it equal `local` (an entry whose
    // keys are columns [0, count) reads it); how many were written since the pool row's last
    // generation change (a column below that which changes needs a new one: the cuda plan keeps
    // a row's pages while its generation holds).
    std::vector<int> req_rows;
    std::vector<int32_t> row_valid, row_written;
    std::vector<int> scratch_rows;            // key lists of the step's query rows
    ForwardBatch batch;                       // the step's decode-shaped entries
    std::vector<int64_t> rows;                // global query row of each entry
  };
  std::vector<Part> parts_;
  std::pair<Part*, int> part_of(int layer_id);  // the part and the layer's id in its runtime
  // The part's batch of the step (slots of the new tokens it owns, key lists, entries).
  void build_part(Part& part, const ForwardBatch& batch, const StepLayout& layout);
  // CUDA graphs: why they are off ("" when on), init_cuda_graph_state's rows (0: not called), the
  // rows of the graph step begun (0: an eager step) and whether it is being captured.
  std::string graph_off_reason_;
  int graph_max_tokens_ = 0;
  int64_t graph_tokens_ = 0;
  void check_graph_tokens(const char* call, int64_t tokens) const;
  DcpDeviceRank& device();
  // Makes columns [0, count) of request row `row`'s pool row equal its local columns.
  void sync_request_row(Part& part, int row, int32_t count);
  // cuda ranks with page_size > 1 read key lists as pages: a tree verify step is an error.
  void check_pages(const ForwardBatch& batch) const;
  bool direct_rows_ = true;
  StepCounts counts_;
  std::vector<int64_t> slots_;  // a list being written into req_to_token
  int64_t num_tokens_ = 0;
  bool in_step_ = false;
  // Per layer call: gathered inputs, the partial, the packed send / recv buffers.
  std::vector<float> q_, k_, v_, out_, lse_, send_, recv_;
};

class DcpAttention {
 public:
  // options.dcp_size ranks (validate_dcp), each a DcpRank with `config`. Ranks on the `cuda`
  // backend share the current GPU (one runtime each, all on one stream: the legacy default one
  // until set_stream), exchange device partials through a device_in_process communicator and host
  // ones through an in_process one: a simulation of the group on one GPU (correctness, not speed;
  // docs/dcp.md).
  DcpAttention(ModelSpec model, Options options, const RuntimeConfig& config = {});

  int size() const { return static_cast<int>(ranks_.size()); }
  const ModelSpec& model() const { return model_; }
  const Options& options() const { return options_; }
  DcpRank& rank(int r);
  Communicator& communicator() { return *comm_; }

  // Request rows are the engine's ids in [0, config.max_requests) (e.g. its own req_to_token
  // rows); a row starts empty, steps store its tokens, free_request releases them on every rank
  // when the request ends.
  void free_request(int row);
  // The first `tokens` tokens of request row `row` count as stored: their slots are allocated on
  // their owners (columns as a prefill would give them), their K/V left as the pools hold them.
  // For benchmarks (a long context without its prefill) and engines that write the pools
  // themselves.
  void reserve_prefix(int row, int32_t tokens);
  // fp8 scales of a layer, on every rank.
  void set_kv_scales(int layer_id, float k_scale, float v_scale);
  // DcpRank::set_direct_rows on every rank (tests).
  void set_direct_rows(bool on);
  // DcpRank::set_stream on every rank: the whole group (its ranks one after another, the exchange
  // between them) runs on `stream`. Host ranks ignore it.
  void set_stream(void* stream);
  void* stream() const { return ranks_.front()->stream(); }

  // The global batch as one runtime would take it; its out_cache_loc values are not read (the
  // group allocates each new token's slot on its owner), its length must be the step's tokens.
  void begin_step(const ForwardBatch& batch);
  // q, k, v, out (and optionally lse) as for one runtime (host tensors, any float dtype; or, with
  // cuda ranks, GPU tensors of fp32 / fp16 / bf16, all on the GPU; MLA: the absorbed form). GPU
  // tensors are read and written in the order of the group's stream (set_stream), as one
  // runtime's are: the host does not wait.
  void forward(int layer_id, const AttnArgs& args);
  void end_step();
  // After a TARGET_VERIFY step, before the next begin_step: request i of `batch` (that step)
  // keeps the block tokens accepted[i] (block indices by depth, the root 0 first); the one at
  // depth k is moved to the column of position seq_len + k on its owner (KV rows copied, as
  // one runtime's engine compacts a tree path). The next step's lengths then release the rest.
  // A chain needs no commit. Throws attnrt::Error for a path that is not one of the tree.
  void commit_verify(const ForwardBatch& batch, std::span<const std::vector<int32_t>> accepted);

  // CUDA graphs an engine captures itself (DcpRank's, docs/dcp.md "CUDA graphs"), on every rank:
  // the group's steps of up to `tokens` query rows captured on its stream (set_stream: a capture
  // needs a stream other than the legacy default one, and every rank on it) and replayed there.
  // forward then takes GPU tensors of `tokens` rows (sinks on the GPU). Off (with the reason) for
  // host ranks and with RuntimeConfig::cuda_graphs false.
  bool cuda_graphs_enabled() const { return ranks_.front()->cuda_graphs_enabled(); }
  const std::string& cuda_graphs_off_reason() const {
    return ranks_.front()->cuda_graphs_off_reason();
  }
  void init_cuda_graph_state(int max_num_tokens);
  void begin_capture_step(int tokens);
  void begin_replay_step(const ForwardBatch& batch, int tokens);

 private:
  ModelSpec model_;
  Options options_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Communicator> host_comm_;  // cuda ranks: the exchange of host tensors
  std::vector<std::unique_ptr<DcpRank>> ranks_;
  int max_context_len_ = 0;
  int64_t step_rows_ = -1;  // the rows forward() takes in the step begun (-1: none)
  void check_batch(const ForwardBatch& batch, const StepLayout& layout) const;
};

}  // namespace attnrt
