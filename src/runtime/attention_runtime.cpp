#include "attnrt/runtime/attention_runtime.h"

#include <algorithm>
#include <cmath>

#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#if defined(ATTNRT_HAS_CUDA)
#include "backends/cuda/cuda_kv_cache.h"
#endif

namespace attnrt {

namespace {

void check_config(const RuntimeConfig& c) {
  ATTNRT_CHECK(c.max_requests >= 1,
               "RuntimeConfig.max_requests = {} is invalid; at least one request row is needed",
               c.max_requests);
  ATTNRT_CHECK(c.kv_slots >= 1, "RuntimeConfig.kv_slots = {} is invalid; it must be >= 1",
               c.kv_slots);
  ATTNRT_CHECK(c.max_num_tokens >= 1,
               "RuntimeConfig.max_num_tokens = {} is invalid; it must be >= 1", c.max_num_tokens);
  ATTNRT_CHECK(c.max_context_len >= 0,
               "RuntimeConfig.max_context_len = {} is invalid; use 0 (the model's) or a length",
               c.max_context_len);
  ATTNRT_CHECK(c.linear_state_slots >= 0 && c.linear_verify_requests >= 0,
               "RuntimeConfig.linear_state_slots = {} / linear_verify_requests = {} is invalid; "
               "use 0 (= max_requests) or a count",
               c.linear_state_slots, c.linear_verify_requests);
  ATTNRT_CHECK(c.swa_full_tokens_ratio > 0 && std::isfinite(c.swa_full_tokens_ratio),
               "RuntimeConfig.swa_full_tokens_ratio = {} is invalid; it must be > 0",
               c.swa_full_tokens_ratio);
}

// The device every chosen backend runs on, which is where the pools are built: the host when all
// of them run there, else a CUDA device (resolve_backends guarantees one common device).
DeviceKind pool_device(const Selection& s) {
  bool cpu = true, cuda = true;
  for (const std::string* name : {&s.prefill, &s.decode, &s.linear_prefill, &s.linear_decode}) {
    if (name->empty()) continue;
    const auto& devices = Registry::global().get(*name).caps.devices;
    cpu = cpu && std::find(devices.begin(), devices.end(), DeviceKind::cpu) != devices.end();
    cuda = cuda && std::find(devices.begin(), devices.end(), DeviceKind::cuda) != devices.end();
  }
  if (cpu) return DeviceKind::cpu;
  ATTNRT_CHECK(cuda,
               "backends '{}' (prefill) and '{}' (decode) share no device to hold the KV cache",
               s.prefill, s.decode);
  return DeviceKind::cuda;
}

KVStorage make_storage(DeviceKind device, const ModelSpec& model, const KVCacheConfig& config) {
  if (device == DeviceKind::cpu) return make_host_kv_storage(model, config);
#if defined(ATTNRT_HAS_CUDA)
  return cuda::make_cuda_kv_storage(model, config);
#else
  fail(
      "model '{}': the chosen backends run on CUDA only, but this build has no CUDA support; "
      "choose a CPU backend (see `attnrt info`)",
      model.name);
#endif
}

}  // namespace

AttentionRuntime::AttentionRuntime(ModelSpec model, Options options, RuntimeConfig config)
    : model_(std::move(model)), options_(std::move(options)), config_(config) {
  model_.validate();
  check_config(config_);
  selection_ = resolve_backends(options_, model_);

  for (size_t i = 0; i < model_.layers.size(); ++i) {
    const int id = model_.layers[i].layer_id;
    if (static_cast<size_t>(id) >= layer_index_.size()) layer_index_.resize(id + 1, -1);
    layer_index_[id] = static_cast<int>(i);
  }

  const int context =
      config_.max_context_len > 0 ? config_.max_context_len : model_.max_context_len;
  req_to_token_ = std::make_unique<ReqToTokenPool>(config_.max_requests, context);
  KVCacheConfig kv;
  kv.full_slots = config_.kv_slots;
  kv.swa_full_tokens_ratio = config_.swa_full_tokens_ratio;
  kv.page_size = options_.page_size;
  kv.dtype = selection_.kv_dtype;
  kv.max_num_tokens = config_.max_num_tokens;
  KVStorage storage = make_storage(pool_device(selection_), model_, kv);
  allocator_ = std::move(storage.allocator);
  kv_cache_ = std::move(storage.cache);

  if (model_.has_linear_layers()) {
    ATTNRT_CHECK(kv_cache_->device().kind == DeviceKind::cpu,
                 "model '{}': the linear-attention state pool lives on the host, but the chosen "
                 "backends run on {}; choose CPU backends for every phase",
                 model_.name, device_name(kv_cache_->device()));
    LinearStateConfig lc;
    lc.max_slots = config_.linear_state_slots > 0 ? config_.linear_state_slots
                                                  : config_.max_requests;
    lc.max_request_rows = config_.max_requests;
    lc.ssm_dtype = config_.linear_state_dtype;
    lc.conv_dtype = config_.linear_conv_dtype;
    if (selection_.speculative()) {
      lc.verify_rows = config_.linear_verify_requests > 0 ? config_.linear_verify_requests
                                                          : config_.max_requests;
      lc.num_draft_tokens = selection_.spec_num_draft_tokens;
    }
    linear_state_ = std::make_unique<LinearStatePool>(model_, lc);
  }

  BackendContext ctx;
  ctx.model = &model_;
  ctx.linear_state = linear_state_.get();
  ctx.options = &options_;
  ctx.kv_cache = kv_cache_.get();
  ctx.req_to_token = req_to_token_.get();
  ctx.device = kv_cache_->device();
  backend_ = create_backend(selection_, ctx);
}

AttentionRuntime::~AttentionRuntime() = default;

void AttentionRuntime::begin_step(const ForwardBatch& batch) {
  batch_ = nullptr;
  const StepLayout layout = make_step_layout(batch);
  ATTNRT_CHECK(layout.num_tokens <= config_.max_num_tokens,
               "step has {} tokens, more than RuntimeConfig.max_num_tokens = {}; split the step "
               "or raise max_num_tokens",
               layout.num_tokens, config_.max_num_tokens);
  for (int i = 0; i < batch.batch_size; ++i) {
    const int64_t row = batch.req_pool_indices[i];
    ATTNRT_CHECK(row >= 0 && row < req_to_token_->size() &&
                     req_to_token_->is_allocated(static_cast<int>(row)),
                 "req_pool_indices[{}] = {} is not an allocated request row (rows 0..{}); get rows "
                 "from req_to_token().alloc()",
                 i, row, req_to_token_->size() - 1);
    ATTNRT_CHECK(layout.kv_len(i) <= req_to_token_->max_context_len(),
                 "request {} spans {} tokens, more than max_context_len = {}", i, layout.kv_len(i),
                 req_to_token_->max_context_len());
  }
  kv_cache_->begin_step(batch);
  backend_->init_forward_metadata(batch);
  batch_ = &batch;
  last_mode_ = batch.mode;
  verify_committed_ = false;
}

LinearStatePool& AttentionRuntime::linear_state() {
  ATTNRT_CHECK(linear_state_ != nullptr,
               "linear_state: model '{}' has no linear-attention layers, so the runtime keeps no "
               "linear state pool",
               model_.name);
  return *linear_state_;
}

void AttentionRuntime::forward(int layer_id, const AttnArgs& args) {
  ATTNRT_CHECK(batch_ != nullptr, "forward(layer {}) outside a step; call begin_step(batch) first",
               layer_id);
  ATTNRT_CHECK(layer_id >= 0 && static_cast<size_t>(layer_id) < layer_index_.size() &&
                   layer_index_[layer_id] >= 0,
               "forward: layer {} is not a layer of model '{}' ({} layers)", layer_id, model_.name,
               model_.layers.size());
  const LayerSpec& layer = model_.layers[static_cast<size_t>(layer_index_[layer_id])];
  ATTNRT_CHECK(!is_linear_kind(layer.kind),
               "forward: layer {} is a {} layer; call forward_linear(layer, LinearArgs) for "
               "linear-attention layers",
               layer_id, layer_kind_name(layer.kind));
  backend_->forward(args, layer, *batch_);
}

void AttentionRuntime::forward_linear(int layer_id, const LinearArgs& args) {
  ATTNRT_CHECK(batch_ != nullptr,
               "forward_linear(layer {}) outside a step; call begin_step(batch) first", layer_id);
  ATTNRT_CHECK(layer_id >= 0 && static_cast<size_t>(layer_id) < layer_index_.size() &&
                   layer_index_[layer_id] >= 0,
               "forward_linear: layer {} is not a layer of model '{}' ({} layers)", layer_id,
               model_.name, model_.layers.size());
  const LayerSpec& layer = model_.layers[static_cast<size_t>(layer_index_[layer_id])];
  ATTNRT_CHECK(is_linear_kind(layer.kind),
               "forward_linear: layer {} is a {} layer; call forward(layer, AttnArgs) for "
               "attention layers",
               layer_id, layer_kind_name(layer.kind));
  backend_->forward_linear(args, layer, *batch_);
}

void AttentionRuntime::update_state_after_verify(std::span<const int32_t> last_accepted) {
  ATTNRT_CHECK(linear_state_ != nullptr,
               "update_state_after_verify: model '{}' has no linear-attention layers; there is no "
               "state to commit",
               model_.name);
  ATTNRT_CHECK(is_target_verify(last_mode_) && !verify_committed_,
               "update_state_after_verify: the last step was {}{}; call it once after a "
               "TARGET_VERIFY step, before the next begin_step",
               forward_mode_name(last_mode_),
               is_target_verify(last_mode_) ? " and its state is already committed" : "");
  backend_->update_state_after_verify(last_accepted);
  verify_committed_ = true;
}

void AttentionRuntime::end_step() { batch_ = nullptr; }

const ForwardBatch& AttentionRuntime::current_batch() const {
  ATTNRT_CHECK(batch_ != nullptr, "current_batch: no step in progress; call begin_step first");
  return *batch_;
}

}  // namespace attnrt
