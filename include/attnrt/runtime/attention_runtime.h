// AttentionRuntime: the one object an engine holds. Built from a ModelSpec and Options, it owns the
// pools and the chosen backend(s).
//   begin_step(batch)            validates the batch, prepares the pools, runs the plan once
//   forward(layer_id, args)      stores this step's k/v (when args.save_kv) and attends
//   forward_linear(layer_id, a)  linear-attention layers (hybrid models): conv + recurrence
//   end_step()
// Hybrid models (gdn / kda / mamba2 layers) also own a LinearStatePool: the engine gives every
// request a state slot when it starts (linear_state().alloc_for(row)) and frees it when it ends;
// after a TARGET_VERIFY step it calls update_state_after_verify with the accepted lengths.
// The batch passed to begin_step must stay alive and unchanged until end_step (the plan and the KV
// cache's write slots point into it). Slots come from allocator(), request rows from
// req_to_token(); the engine writes req_to_token before begin_step (reference-semantics §2.2).
// On a GPU, DECODE and TARGET_VERIFY steps can also run as CUDA graphs (forward_step_graph, see
// docs/cuda_graphs.md).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/device_services.h"
#include "attnrt/backend/options.h"
#include "attnrt/backend/selection.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/linear_state_pool.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/memory/token_allocator.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

struct RuntimeConfig {
  int max_requests = 256;
  int64_t kv_slots = 1 << 16;  // usable token slots of the full KV pool
  double swa_full_tokens_ratio = 0.8;
  int max_num_tokens = 8192;  // largest step (tokens)
  int max_context_len = 0;    // columns of req_to_token; 0 = the model's max_context_len
  // Hybrid models: linear-state slots (0 = max_requests), the largest verify batch that keeps
  // per-token checkpoints (0 = max_requests; only with speculative decoding), and the dtypes of
  // the recurrent state and the conv window (fp32 or bf16).
  int linear_state_slots = 0;
  int linear_verify_requests = 0;
  DType linear_state_dtype = DType::f32;
  DType linear_conv_dtype = DType::f32;
  // CUDA graphs for DECODE and TARGET_VERIFY steps (docs/cuda_graphs.md): used when the backends
  // serving those modes support them and the KV cache is on the GPU (cuda_graphs_off_reason() says
  // why not otherwise); false turns them off. Captured batch sizes: cuda_graph_batch_sizes
  // (increasing), or when empty 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256 up to
  // min(cuda_graph_max_bs, max_requests), that bound included; a size whose padded step exceeds
  // max_num_tokens is left out.
  bool cuda_graphs = true;
  int cuda_graph_max_bs = 256;
  std::vector<int> cuda_graph_batch_sizes;
};

// The device a runtime with this selection keeps its pools on (KV caches, linear state): the host
// when every chosen backend runs there, else a CUDA device (resolve_backends guarantees one common
// device).
DeviceKind kv_pool_device(const Selection& s);
// The services of that device: those of the chosen backends' registry entries.
const DeviceServices& kv_pool_services(const Selection& s);

class AttentionRuntime {
 public:
  AttentionRuntime(ModelSpec model, Options options, RuntimeConfig config = {});
  ~AttentionRuntime();

  const ModelSpec& model() const { return model_; }
  const Options& options() const { return options_; }
  const Selection& selection() const { return selection_; }
  ReqToTokenPool& req_to_token() { return *req_to_token_; }
  TokenAllocator& allocator() { return *allocator_; }
  KVCache& kv_cache() { return *kv_cache_; }
  AttentionBackend& backend() { return *backend_; }
  bool has_linear_layers() const { return linear_state_ != nullptr; }
  // Throws attnrt::Error when the model has no linear-attention layers.
  LinearStatePool& linear_state();

  void begin_step(const ForwardBatch& batch);
  void forward(int layer_id, const AttnArgs& args);
  void forward_linear(int layer_id, const LinearArgs& args);
  void end_step();
  // §8.10, after a TARGET_VERIFY step and before the next begin_step: request i of that step keeps
  // the state after its block token last_accepted[i] (chain: accepted drafts; tree: the deepest
  // accepted node; -1: unchanged).
  void update_state_after_verify(std::span<const int32_t> last_accepted);
  // Throws attnrt::Error outside begin_step .. end_step.
  const ForwardBatch& current_batch() const;

  // MLA in the MHA form with a chunked prefix (docs/mla.md). Per step, between begin_step and
  // end_step: mla_form() says which form the step's MLA layers run in (the reference engine's
  // rule, choose_mla_form). Absorbed: forward(layer, AttnArgs) as always. MHA, per MLA layer:
  //   forward_mla_mha(layer, args)            the extend tokens, causal per request; stores
  //                                           args.latent in the layer's pool (save_kv)
  //   for c in 0 .. prefix_chunk_plan().num_chunks():
  //     gather_prefix_chunk(layer, c, latent) the chunk's latent rows, [n, 1, rank + rope]
  //     (decompress them into k [n, Hq, nope + rope], v [n, Hq, mha_v])
  //     forward_mla_prefix_chunk(layer, c, args)  merges the chunk into args.out / args.lse
  // Each throws attnrt::Error outside a step, for a layer that is not MLA, and for the backend's
  // errors (form, order, shapes), changing nothing then.
  MlaForm mla_form() const;
  const PrefixChunkPlan& prefix_chunk_plan() const;
  void forward_mla_mha(int layer_id, const MlaMhaArgs& args);
  void gather_prefix_chunk(int layer_id, int chunk, const TensorView& latent);
  void forward_mla_prefix_chunk(int layer_id, int chunk, const MlaChunkArgs& args);

  // CUDA graphs (docs/cuda_graphs.md). A graph step runs every attention layer of the model for one
  // DECODE or TARGET_VERIFY batch from the static tensors of graph_io, instead of begin_step /
  // forward / end_step:
  //   write graph_io(layer, T).q / k / v of every attention layer (T = batch.num_tokens()), with
  //                                work on the runtime's stream (the GPU KV cache's; copy_tensor
  //                                does) or work that completed before the call: the graph runs on
  //                                that stream and waits for nothing else
  //   forward_step_graph(batch)    the plan (host) and one graph launch; never waits for the GPU
  //   read graph_io(layer, T).out  after synchronize(), or from work ordered after it on the GPU
  // The first step of a (mode, batch-size bucket, chain or tree) captures its graph; later steps
  // replay it with their own lengths, padded to the bucket (padded rows write the dummy slot 0).
  bool cuda_graphs_enabled() const { return graph_off_reason_.empty(); }
  const std::string& cuda_graphs_off_reason() const { return graph_off_reason_; }
  const std::vector<int>& cuda_graph_batch_sizes() const { return graph_buckets_; }
  // The captured batch size `batch` replays at: the smallest bucket >= batch.batch_size; 0 when
  // the step runs eagerly (graphs off, a mode other than DECODE / TARGET_VERIFY, no requests, more
  // requests than the largest bucket, a verify block of a size other than the options').
  int cuda_graph_bucket(const ForwardBatch& batch) const;
  // The first `tokens` rows of layer `layer_id`'s static tensors (allocated at the first call).
  // Throws attnrt::Error when graphs are off, for a layer without a KV cache, or for more tokens
  // than the largest bucket holds.
  GraphLayerIO graph_io(int layer_id, int64_t tokens);
  // Throws attnrt::Error (before touching the pools) when cuda_graph_bucket(batch) is 0, naming
  // why, or for the batch errors begin_step reports.
  void forward_step_graph(const ForwardBatch& batch);
  // Graphs captured so far (one per mode, bucket and chain / tree).
  int cuda_graphs_captured() const;

  // CUDA graphs an engine captures itself, its whole step at once (torch.cuda.graph around its
  // GEMMs and every layer's forward), the reference engine's contract (§3.3):
  //   init_cuda_graph_state(max_bs, max_num_tokens)  once, before any capture
  //   begin_capture_step(batch, bs)   before capturing a step of `bs` requests: batch gives the
  //                                   mode and, for TARGET_VERIFY, spec_info (draft_token_num,
  //                                   chain or tree); its lengths are not read. The forward()
  //                                   calls then made on the capturing stream record kernels that
  //                                   read only fixed buffers (the plan's, the write slots', the
  //                                   engine's own q / k / v / out tensors)
  //   begin_replay_step(batch, bs)    before every replay: the real batch (batch_size <= bs
  //                                   requests, padded to bs here; padded rows write slot 0;
  //                                   batch_size 0 pads every row)
  //   end_step()                      after either
  // Throws attnrt::Error when graphs are off (cuda_graphs_off_reason()), for a mode other than
  // DECODE / TARGET_VERIFY, for bs or tokens beyond init_cuda_graph_state's, and when this
  // runtime's own graph steps (forward_step_graph) are in use: one runtime serves one of the two.
  void init_cuda_graph_state(int max_bs, int max_num_tokens);
  void begin_capture_step(const ForwardBatch& batch, int bs);
  void begin_replay_step(const ForwardBatch& batch, int bs);
  int cuda_graph_seq_len_fill_value() const { return backend_->cuda_graph_seq_len_fill_value(); }
  // Waits until the GPU has finished the work issued so far (nothing to wait for on the CPU).
  void synchronize();
  // GPU pools: the CUDA stream (a cudaStream_t; nullptr = the legacy default stream) that every
  // later launch, copy and graph replay goes to, ordered after what the old stream still has
  // queued. An engine passes its framework's current stream (the Python package does, per step).
  // Nothing changes when it is already in use; host pools ignore it. stream() is the one in use
  // (nullptr for host pools).
  void set_stream(void* stream);
  void* stream() const;
  // An engine that owns its KV pools (reference-semantics §4.3, §4.5): layer `layer_id` stores and
  // reads K/V in the engine's tensors from now on, and the runtime's own buffers of that layer are
  // released. k / v: contiguous [rows, kv_heads, head_dim] / [rows, kv_heads, v_head_dim] with rows
  // >= the pool's rows (kv_slots + the reserved page), the pool's dtype (fp8: the dtype or uint8
  // bytes), on the pools' device; MLA layers: k [rows, 1, kv_lora_rank + qk_rope_head_dim] and v
  // empty or a view starting at k's data. Slots are the engine's: out_cache_loc and req_to_token
  // index these tensors directly. Only before the first step (graph captures included): later
  // steps and captured graphs keep the addresses they planned with. Throws attnrt::Error naming the
  // argument, its value and what is allowed; nothing changes then.
  void bind_kv_buffers(int layer_id, const TensorView& k, const TensorView& v);
  // Copies src into dst (same dtype and shape, contiguous; host or GPU on either side) and returns
  // once dst holds the data: for tests and tools whose data is on the host.
  void copy_tensor(const TensorView& dst, const TensorView& src);

 private:
  void make_pools();  // the constructor's pools (req_to_token, KV, linear state)
  void check_step(const ForwardBatch& batch) const;
  std::string graph_unsupported(const ForwardBatch& batch) const;
  StepGraphRunner& graph_runner();

  mutable StepLayout check_layout_;  // check_step's scratch, reused every step
  ModelSpec model_;
  Options options_;
  RuntimeConfig config_;
  Selection selection_;
  std::unique_ptr<ReqToTokenPool> req_to_token_;
  std::unique_ptr<TokenAllocator> allocator_;
  std::unique_ptr<KVCache> kv_cache_;
  std::unique_ptr<LinearStatePool> linear_state_;
  std::unique_ptr<AttentionBackend> backend_;
  const ForwardBatch* batch_ = nullptr;
  ForwardMode last_mode_ = ForwardMode::IDLE;  // of the last step begun
  bool verify_committed_ = true;
  bool stepped_ = false;  // a step (eager, captured or replayed) has begun: pool addresses are fixed
  std::vector<int> layer_index_;  // layer id -> index in model_.layers, -1 if absent
  std::string graph_off_reason_;  // "" when CUDA graphs are on
  std::vector<int> graph_buckets_;
  int graph_verify_tokens_ = 0;  // N of TARGET_VERIFY graphs (0: no speculative decoding)
  const DeviceServices* device_ = nullptr;  // where the pools live (kv_pool_services)
  std::unique_ptr<StepGraphRunner> graphs_;  // created at the first graph call (graph_runner())
  // Engine-captured graphs: the limits given to init_cuda_graph_state (0: not initialised), the
  // placeholder batch forward() sees during a capture, and the padded write slots of a step.
  int engine_graph_max_bs_ = 0;
  int engine_graph_max_tokens_ = 0;
  ForwardBatch engine_graph_batch_;
  ForwardBatch engine_graph_slots_;
};

}  // namespace attnrt
