// AttentionRuntime: the one object an engine holds. Built from a ModelSpec and Options, it owns the
// pools and the chosen backend(s).
//   begin_step(batch)            validates the batch, prepares the pools, runs the plan once
//   forward(layer_id, args)      stores this step's k/v (when args.save_kv) and attends
//   end_step()
// The batch passed to begin_step must stay alive and unchanged until end_step (the plan and the KV
// cache's write slots point into it). Slots come from allocator(), request rows from
// req_to_token(); the engine writes req_to_token before begin_step (reference-semantics §2.2).
#pragma once

#include <memory>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/options.h"
#include "attnrt/backend/selection.h"
#include "attnrt/memory/kv_cache.h"
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

  void begin_step(const ForwardBatch& batch);
  void forward(int layer_id, const AttnArgs& args);
  void end_step();
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
  std::unique_ptr<AttentionBackend> backend_;
  const ForwardBatch* batch_ = nullptr;
  std::vector<int> layer_index_;  // layer id -> index in model_.layers, -1 if absent
};

}  // namespace attnrt
