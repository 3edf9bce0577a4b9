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
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/options.h"
#include "attnrt/backend/selection.h"
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
};

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

 private:
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
  std::vector<int> layer_index_;  // layer id -> index in model_.layers, -1 if absent
};

}  // namespace attnrt
