#include "attnrt/runtime/attention_runtime.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>

#include "attnrt/backend/dsa.h"
#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "attnrt/core/error.h"

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
  ATTNRT_CHECK(c.cuda_graph_max_bs >= 1,
               "RuntimeConfig.cuda_graph_max_bs = {} is invalid; it must be >= 1 (turn graphs off "
               "with cuda_graphs = false)",
               c.cuda_graph_max_bs);
  for (size_t i = 0; i < c.cuda_graph_batch_sizes.size(); ++i) {
    const int b = c.cuda_graph_batch_sizes[i];
    ATTNRT_CHECK(b >= 1 && b <= c.max_requests && (i == 0 || b > c.cuda_graph_batch_sizes[i - 1]),
                 "RuntimeConfig.cuda_graph_batch_sizes[{}] = {} is invalid; the sizes must "
                 "increase and lie in [1, max_requests = {}]",
                 i, b, c.max_requests);
  }
}

// The layer `layer_id` of `model` (`index`: layer id -> index in model.layers, -1 if absent);
// `call` starts the message when the model has no such layer.
const LayerSpec& layer_of(const ModelSpec& model, const std::vector<int>& index, int layer_id,
                          const char* call) {
  ATTNRT_CHECK(
      layer_id >= 0 && static_cast<size_t>(layer_id) < index.size() && index[layer_id] >= 0,
      "{}: layer {} is not a layer of model '{}' ({} layers)", call, layer_id, model.name,
      model.layers.size());
  return model.layers[static_cast<size_t>(index[layer_id])];
}

// Batch sizes captured by default (reference-semantics §3.3: a replay pads to the smallest
// captured size >= its batch): fine steps for small batches, where padding costs the most
// relative to the work, then steps of 32.
std::vector<int> default_graph_buckets(int max_bs) {
  std::vector<int> b;
  for (int s : {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256}) {
    if (s <= max_bs) b.push_back(s);
  }
  for (int s = 288; s <= max_bs; s += 32) b.push_back(s);
  if (b.back() != max_bs) b.push_back(max_bs);
  return b;
}

}  // namespace

namespace {

// The entries of a selection: resolve_backends's, or the registry's for one filled by hand.
std::vector<const BackendEntry*> chosen_entries(const Selection& s) {
  if (s.prefill_entry != nullptr) return s.entries();
  std::vector<const BackendEntry*> out;
  for (const std::string* name : {&s.prefill, &s.decode, &s.linear_prefill, &s.linear_decode}) {
    if (!name->empty()) out.push_back(&Registry::global().get(*name));
  }
  return out;
}

}  // namespace

const DeviceServices& kv_pool_services(const Selection& s) {
  const DeviceKind kind = kv_pool_device(s);
  for (const BackendEntry* e : chosen_entries(s)) {
    if (e->device->kind() == kind) return *e->device;
  }
  const DeviceServices* services = Registry::global().device_services(kind);
  ATTNRT_CHECK(services != nullptr,
               "the chosen backends keep their pools on {}, which no registered backend serves",
               kind == DeviceKind::cpu ? "the host" : "a CUDA device");
  return *services;
}

DeviceKind kv_pool_device(const Selection& s) {
  bool cpu = true, cuda = true;
  for (const BackendEntry* e : chosen_entries(s)) {
    const auto& devices = e->caps.devices;
    cpu = cpu && std::find(devices.begin(), devices.end(), DeviceKind::cpu) != devices.end();
    cuda = cuda && std::find(devices.begin(), devices.end(), DeviceKind::cuda) != devices.end();
  }
  if (cpu) return DeviceKind::cpu;
  ATTNRT_CHECK(cuda,
               "backends '{}' (prefill) and '{}' (decode) share no device to hold the KV cache",
               s.prefill, s.decode);
  return DeviceKind::cuda;
}

AttentionRuntime::AttentionRuntime(ModelSpec model, Options options, RuntimeConfig config)
    : model_(std::move(model)), options_(std::move(options)), config_(config) {
  model_.validate();
  check_config(config_);
  ATTNRT_CHECK(options_.dcp_size == 1,
               "Options.dcp_size = {}: one AttentionRuntime is one rank; a group of {} ranks is a "
               "DcpAttention (docs/dcp.md)",
               options_.dcp_size, options_.dcp_size);
  selection_ = resolve_backends(options_, model_);
  for (const std::string& w : selection_.warnings) fmt::print(stderr, "attnrt: warning: {}\n", w);

  for (size_t i = 0; i < model_.layers.size(); ++i) {
    const int id = model_.layers[i].layer_id;
    if (static_cast<size_t>(id) >= layer_index_.size()) layer_index_.resize(id + 1, -1);
    layer_index_[id] = static_cast<int>(i);
  }

  // Slot ids are int32 (req_to_token, the plans), and the pool keeps one reserved page.
  const int64_t max_slots = std::numeric_limits<int32_t>::max() - int64_t{options_.page_size};
  ATTNRT_CHECK(config_.kv_slots <= max_slots,
               "RuntimeConfig.kv_slots = {} is too large: slot ids are int32 and the pool keeps "
               "one reserved page of {}; use at most {}",
               config_.kv_slots, options_.page_size, max_slots);
  // A pool too large for this host's memory is a configuration error, not a crash: the sizes
  // are named so that the caller can lower them.
  try {
    make_pools();
  } catch (const std::bad_alloc&) {
    fail("out of host memory making the pools of model '{}' ({} layers) with kv_slots = {}, "
         "max_requests = {}, max_context_len = {}; lower kv_slots or max_requests",
         model_.name, model_.layers.size(), config_.kv_slots, config_.max_requests,
         config_.max_context_len > 0 ? config_.max_context_len : model_.max_context_len);
  }

  BackendContext ctx;
  ctx.model = &model_;
  ctx.linear_state = linear_state_.get();
  ctx.options = &options_;
  ctx.kv_cache = kv_cache_.get();
  ctx.req_to_token = req_to_token_.get();
  ctx.device = kv_cache_->device();
  backend_ = create_backend(selection_, ctx);

  // CUDA graphs: decided once, with the reason when they are off.
  const std::string& verify_backend = selection_.backend_for(ForwardMode::TARGET_VERIFY);
  const int per_request = selection_.speculative() ? selection_.spec_num_draft_tokens : 1;
  const bool has_dsa = std::any_of(model_.layers.begin(), model_.layers.end(),
                                   [](const LayerSpec& l) { return l.has_indexer(); });
  if (!config_.cuda_graphs) {
    graph_off_reason_ = "RuntimeConfig::cuda_graphs is false";
  } else if (!built_with_cuda()) {
    graph_off_reason_ = "this build has no CUDA support";
  } else if (kv_cache_->device().kind != DeviceKind::cuda) {
    graph_off_reason_ = fmt::format("the KV cache is on the host (backends '{}' / '{}')",
                                    selection_.prefill, selection_.decode);
  } else if (!selection_.decode_entry->caps.cuda_graphs) {
    graph_off_reason_ =
        fmt::format("backend '{}' (DECODE) does not support CUDA graphs", selection_.decode);
  } else if (selection_.speculative() &&
             !selection_.entry_for(ForwardMode::TARGET_VERIFY)->caps.cuda_graphs) {
    graph_off_reason_ =
        fmt::format("backend '{}' (TARGET_VERIFY) does not support CUDA graphs", verify_backend);
  } else if (options_.deterministic && !selection_.decode_entry->caps.deterministic_graphs) {
    graph_off_reason_ = fmt::format(
        "deterministic mode splits each request by its own length, which backend '{}' (DECODE) "
        "cannot capture",
        selection_.decode);
  } else if (options_.deterministic && selection_.speculative() &&
             !selection_.entry_for(ForwardMode::TARGET_VERIFY)->caps.deterministic_graphs) {
    graph_off_reason_ = fmt::format(
        "deterministic mode splits each request by its own length, which backend '{}' "
        "(TARGET_VERIFY) cannot capture",
        verify_backend);
  } else if (has_dsa && !dsa_graphs_enabled()) {
    graph_off_reason_ =
        "the model has DSA layers (an indexer), which run eagerly: ATTNRT_DSA_GRAPHS=0 turns "
        "their CUDA graphs off (unset it, or set 1, to capture them)";
  } else if (has_dsa && !selection_.decode_entry->caps.dsa_graphs) {
    graph_off_reason_ = fmt::format(
        "the model has DSA layers (an indexer), which backend '{}' (DECODE) does not capture",
        selection_.decode);
  } else if (has_dsa && selection_.speculative() &&
             !selection_.entry_for(ForwardMode::TARGET_VERIFY)->caps.dsa_graphs) {
    graph_off_reason_ = fmt::format(
        "the model has DSA layers (an indexer), which backend '{}' (TARGET_VERIFY) does not "
        "capture",
        verify_backend);
  } else if (linear_state_ != nullptr) {
    graph_off_reason_ =
        "the model has linear-attention layers, which run eagerly: the captured graphs hold the "
        "attention layers only";
  }
  if (graph_off_reason_.empty()) {
    const int max_bs = std::min(config_.cuda_graph_max_bs, config_.max_requests);
    const std::vector<int> candidates = config_.cuda_graph_batch_sizes.empty()
                                            ? default_graph_buckets(max_bs)
                                            : config_.cuda_graph_batch_sizes;
    for (int b : candidates) {
      if (int64_t{b} * per_request <= config_.max_num_tokens) graph_buckets_.push_back(b);
    }
    if (graph_buckets_.empty()) {
      graph_off_reason_ = fmt::format(
          "no batch size to capture: a step of one request takes {} tokens, more than "
          "RuntimeConfig.max_num_tokens = {}",
          per_request, config_.max_num_tokens);
    }
    graph_verify_tokens_ = selection_.speculative() ? selection_.spec_num_draft_tokens : 0;
  }
}

// The request table, the KV pools and their slot allocator, and a hybrid model's linear state.
void AttentionRuntime::make_pools() {
  const int context =
      config_.max_context_len > 0 ? config_.max_context_len : model_.max_context_len;
  req_to_token_ = std::make_unique<ReqToTokenPool>(config_.max_requests, context);
  KVCacheConfig kv;
  kv.full_slots = config_.kv_slots;
  kv.swa_full_tokens_ratio = config_.swa_full_tokens_ratio;
  kv.page_size = options_.page_size;
  kv.dtype = selection_.kv_dtype;
  kv.max_num_tokens = config_.max_num_tokens;
  device_ = &kv_pool_services(selection_);
  KVStorage storage = device_->make_kv_storage(model_, kv);
  allocator_ = std::move(storage.allocator);
  kv_cache_ = std::move(storage.cache);

  if (model_.has_linear_layers()) {
    LinearStateConfig lc;
    lc.max_slots =
        config_.linear_state_slots > 0 ? config_.linear_state_slots : config_.max_requests;
    lc.max_request_rows = config_.max_requests;
    lc.ssm_dtype = config_.linear_state_dtype;
    lc.conv_dtype = config_.linear_conv_dtype;
    if (selection_.speculative()) {
      lc.verify_rows = config_.linear_verify_requests > 0 ? config_.linear_verify_requests
                                                          : config_.max_requests;
      lc.num_draft_tokens = selection_.spec_num_draft_tokens;
    }
    linear_state_ =
        std::make_unique<LinearStatePool>(model_, lc, device_->make_linear_state_memory(*kv_cache_));
  }

}

AttentionRuntime::~AttentionRuntime() = default;

void AttentionRuntime::check_step(const ForwardBatch& batch) const {
  StepLayout& layout = check_layout_;
  make_step_layout(batch, layout);
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
}

void AttentionRuntime::bind_kv_buffers(int layer_id, const TensorView& k, const TensorView& v) {
  const LayerSpec& layer = layer_of(model_, layer_index_, layer_id, "bind_kv_buffers");
  ATTNRT_CHECK(layer.uses_kv_cache(), "bind_kv_buffers: layer {} is a {} layer; it has no KV cache",
               layer_id, layer_kind_name(layer.kind));
  ATTNRT_CHECK(!stepped_,
               "bind_kv_buffers(layer {}): steps have run; bind the engine's buffers before the "
               "first step (steps and captured graphs keep the pool addresses they planned with)",
               layer_id);
  const KVLayerView pool = kv_cache_->layer(layer_id);
  const bool latent = layer.kind == LayerKind::mla;
  auto check = [&](const TensorView& t, const char* name, int dim) {
    ATTNRT_CHECK(!t.empty(), "bind_kv_buffers(layer {}): {} is empty", layer_id, name);
    ATTNRT_CHECK(t.device == pool.device,
                 "bind_kv_buffers(layer {}): {} is {}; the pools are on {}", layer_id, name,
                 t.describe(), device_name(pool.device));
    ATTNRT_CHECK(t.dtype == pool.dtype || (is_fp8(pool.dtype) && t.dtype == DType::u8),
                 "bind_kv_buffers(layer {}): {} is {}; the pool stores {}{}", layer_id, name,
                 t.describe(), dtype_name(pool.dtype), is_fp8(pool.dtype) ? " (or its uint8 bytes)" : "");
    ATTNRT_CHECK(t.ndim == 3 && t.shape[0] >= pool.num_rows && t.shape[1] == pool.kv_heads &&
                     t.shape[2] == dim && t.is_contiguous(),
                 "bind_kv_buffers(layer {}): {} is {}; it must be a contiguous [rows >= {}, {}, {}] "
                 "tensor (rows: kv_slots + the reserved page of the runtime)",
                 layer_id, name, t.describe(), pool.num_rows, pool.kv_heads, dim);
  };
  check(k, "k", pool.head_dim);
  if (latent) {
    ATTNRT_CHECK(v.empty() || v.data == k.data,
                 "bind_kv_buffers(mla layer {}): v is {}; an MLA layer has no V buffer: pass none "
                 "or a view of k's first kv_lora_rank columns",
                 layer_id, v.describe());
    kv_cache_->bind_layer_storage(layer_id, k.data, k.data);
  } else {
    check(v, "v", pool.v_head_dim);
    kv_cache_->bind_layer_storage(layer_id, k.data, v.data);
  }
}

void AttentionRuntime::begin_step(const ForwardBatch& batch) {
  batch_ = nullptr;
  stepped_ = true;
  check_step(batch);
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
  const LayerSpec& layer = layer_of(model_, layer_index_, layer_id, "forward");
  ATTNRT_CHECK(!is_linear_kind(layer.kind),
               "forward: layer {} is a {} layer; call forward_linear(layer, LinearArgs) for "
               "linear-attention layers",
               layer_id, layer_kind_name(layer.kind));
  backend_->forward(args, layer, *batch_);
}

namespace {

const LayerSpec& mla_layer_of(const ModelSpec& model, const std::vector<int>& index, int layer_id,
                              const char* call) {
  const LayerSpec& layer = layer_of(model, index, layer_id, call);
  ATTNRT_CHECK(layer.kind == LayerKind::mla,
               "{}: layer {} is a {} layer; the MHA form and prefix chunks are for mla layers",
               call, layer_id, layer_kind_name(layer.kind));
  return layer;
}

}  // namespace

MlaForm AttentionRuntime::mla_form() const {
  ATTNRT_CHECK(batch_ != nullptr, "mla_form: no step in progress; call begin_step first");
  return backend_->mla_form();
}

const PrefixChunkPlan& AttentionRuntime::prefix_chunk_plan() const {
  ATTNRT_CHECK(batch_ != nullptr, "prefix_chunk_plan: no step in progress; call begin_step first");
  return backend_->prefix_chunk_plan();
}

void AttentionRuntime::forward_mla_mha(int layer_id, const MlaMhaArgs& args) {
  ATTNRT_CHECK(batch_ != nullptr,
               "forward_mla_mha(layer {}) outside a step; call begin_step(batch) first", layer_id);
  backend_->forward_mla_mha(args, mla_layer_of(model_, layer_index_, layer_id, "forward_mla_mha"),
                            *batch_);
}

void AttentionRuntime::gather_prefix_chunk(int layer_id, int chunk, const TensorView& latent) {
  ATTNRT_CHECK(batch_ != nullptr,
               "gather_prefix_chunk(layer {}) outside a step; call begin_step(batch) first",
               layer_id);
  mla_layer_of(model_, layer_index_, layer_id, "gather_prefix_chunk");
  const PrefixChunkPlan& plan = backend_->prefix_chunk_plan();
  ATTNRT_CHECK(chunk >= 0 && chunk < plan.num_chunks(),
               "gather_prefix_chunk: chunk {}; this {} step has prefix chunks [0, {}) (form {})",
               chunk, forward_mode_name(batch_->mode), plan.num_chunks(),
               mla_form_name(backend_->mla_form()));
  backend_->gather_prefix_chunk(chunk, kv_cache_->layer(layer_id), layer_id, latent);
}

void AttentionRuntime::forward_mla_prefix_chunk(int layer_id, int chunk,
                                                const MlaChunkArgs& args) {
  ATTNRT_CHECK(batch_ != nullptr,
               "forward_mla_prefix_chunk(layer {}) outside a step; call begin_step(batch) first",
               layer_id);
  backend_->forward_mla_prefix_chunk(
      chunk, args, mla_layer_of(model_, layer_index_, layer_id, "forward_mla_prefix_chunk"),
      *batch_);
}

void AttentionRuntime::forward_linear(int layer_id, const LinearArgs& args) {
  ATTNRT_CHECK(batch_ != nullptr,
               "forward_linear(layer {}) outside a step; call begin_step(batch) first", layer_id);
  const LayerSpec& layer = layer_of(model_, layer_index_, layer_id, "forward_linear");
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

std::string AttentionRuntime::graph_unsupported(const ForwardBatch& batch) const {
  if (!cuda_graphs_enabled()) return "CUDA graphs are off: " + graph_off_reason_;
  if (batch.mode != ForwardMode::DECODE && batch.mode != ForwardMode::TARGET_VERIFY) {
    return fmt::format("{} steps are not captured (DECODE and TARGET_VERIFY are)",
                       forward_mode_name(batch.mode));
  }
  if (batch.batch_size < 1) return "the batch has no request";
  if (batch.batch_size > graph_buckets_.back()) {
    return fmt::format("the batch has {} requests, more than the largest captured size {}",
                       batch.batch_size, graph_buckets_.back());
  }
  if (is_target_verify(batch.mode)) {
    if (graph_verify_tokens_ == 0) {
      return "speculative decoding is off in the options, so no TARGET_VERIFY graph exists";
    }
    if (!batch.spec_info || batch.spec_info->draft_token_num != graph_verify_tokens_) {
      return fmt::format(
          "the verify block has {} tokens per request; graphs are captured for "
          "--speculative-num-draft-tokens {}",
          batch.spec_info ? batch.spec_info->draft_token_num : 0, graph_verify_tokens_);
    }
  }
  return {};
}

int AttentionRuntime::cuda_graph_bucket(const ForwardBatch& batch) const {
  if (!graph_unsupported(batch).empty()) return 0;
  return *std::lower_bound(graph_buckets_.begin(), graph_buckets_.end(), batch.batch_size);
}

GraphLayerIO AttentionRuntime::graph_io(int layer_id, int64_t tokens) {
  ATTNRT_CHECK(cuda_graphs_enabled(), "graph_io(layer {}): CUDA graphs are off: {}", layer_id,
               graph_off_reason_);
  ATTNRT_CHECK(engine_graph_max_bs_ == 0,
               "graph_io(layer {}): this runtime serves graphs an engine captures itself "
               "(init_cuda_graph_state was called), which use the engine's own tensors",
               layer_id);
  const LayerSpec& layer = layer_of(model_, layer_index_, layer_id, "graph_io");
  ATTNRT_CHECK(layer.uses_kv_cache() && !is_linear_kind(layer.kind),
               "graph_io: layer {} is a {} layer; graph steps hold attention layers only", layer_id,
               layer_kind_name(layer.kind));
  return graph_runner().io(layer, tokens);
}

void AttentionRuntime::forward_step_graph(const ForwardBatch& batch) {
  batch_ = nullptr;
  stepped_ = true;
  const int bucket = cuda_graph_bucket(batch);
  ATTNRT_CHECK(bucket > 0,
               "forward_step_graph: this {} step cannot run as a CUDA graph: {}; run it with "
               "begin_step / forward / end_step",
               forward_mode_name(batch.mode), graph_unsupported(batch));
  check_step(batch);
  ATTNRT_CHECK(engine_graph_max_bs_ == 0,
               "forward_step_graph: this runtime serves graphs an engine captures itself "
               "(init_cuda_graph_state was called); replay them with begin_replay_step");
  graph_runner().run(batch, bucket);
  last_mode_ = batch.mode;
  verify_committed_ = false;
}

int AttentionRuntime::cuda_graphs_captured() const { return graphs_ ? graphs_->captured() : 0; }

StepGraphRunner& AttentionRuntime::graph_runner() {
  if (!graphs_) {
    graphs_ = device_->make_graph_runner(model_, *backend_, *kv_cache_, graph_buckets_,
                                         graph_verify_tokens_);
  }
  return *graphs_;
}

void AttentionRuntime::init_cuda_graph_state(int max_bs, int max_num_tokens) {
  ATTNRT_CHECK(cuda_graphs_enabled(), "init_cuda_graph_state: CUDA graphs are off: {}",
               graph_off_reason_);
  ATTNRT_CHECK(!graphs_,
               "init_cuda_graph_state: this runtime already runs its own graph steps "
               "(forward_step_graph / graph_io); an engine that captures its steps itself uses a "
               "runtime without them");
  ATTNRT_CHECK(max_bs >= 1 && max_bs <= config_.max_requests && max_num_tokens >= max_bs &&
                   max_num_tokens <= config_.max_num_tokens,
               "init_cuda_graph_state({}, {}): need 1 <= max_bs <= max_requests ({}) and max_bs "
               "<= max_num_tokens <= the runtime's max_num_tokens ({})",
               max_bs, max_num_tokens, config_.max_requests, config_.max_num_tokens);
  batch_ = nullptr;
  backend_->init_cuda_graph_state(max_bs, max_num_tokens);
  engine_graph_max_bs_ = max_bs;
  engine_graph_max_tokens_ = max_num_tokens;
}

namespace {

int graph_tokens_per_request(const ForwardBatch& batch) {
  return is_target_verify(batch.mode) && batch.spec_info ? batch.spec_info->draft_token_num : 1;
}

// The first checks of begin_capture_step and begin_replay_step (`call`): the graph state exists
// (`missing_state` says what to call first), and the step's mode is one a graph can hold.
void check_graph_step(const ForwardBatch& batch, int max_bs, const char* call,
                      const char* missing_state, const char* done) {
  ATTNRT_CHECK(max_bs > 0, "{}: {}", call, missing_state);
  ATTNRT_CHECK(is_decode(batch.mode) || is_target_verify(batch.mode),
               "{}: a {} step cannot be {}; DECODE and TARGET_VERIFY can", call,
               forward_mode_name(batch.mode), done);
}

}  // namespace

void AttentionRuntime::begin_capture_step(const ForwardBatch& batch, int bs) {
  batch_ = nullptr;
  stepped_ = true;
  check_graph_step(batch, engine_graph_max_bs_, "begin_capture_step",
                   "call init_cuda_graph_state(max_bs, max_num_tokens) first", "captured");
  ATTNRT_CHECK(!is_target_verify(batch.mode) || batch.spec_info,
               "begin_capture_step: a TARGET_VERIFY capture needs spec_info (draft_token_num, "
               "topk)");
  const int64_t tokens = int64_t{bs} * graph_tokens_per_request(batch);
  ATTNRT_CHECK(bs >= 1 && bs <= engine_graph_max_bs_ && tokens <= engine_graph_max_tokens_,
               "begin_capture_step: {} requests ({} tokens); init_cuda_graph_state allowed {} "
               "requests and {} tokens",
               bs, tokens, engine_graph_max_bs_, engine_graph_max_tokens_);
  ForwardBatch& cap = engine_graph_batch_;
  cap = ForwardBatch{};
  cap.mode = batch.mode;
  cap.dcp_partial = batch.dcp_partial;
  if (batch.spec_info) {
    SpecInfo spec;
    spec.draft_token_num = batch.spec_info->draft_token_num;
    spec.topk = batch.spec_info->topk;
    cap.spec_info = std::move(spec);
  }
  engine_graph_slots_.out_cache_loc.assign(static_cast<size_t>(tokens), 0);
  engine_graph_slots_.dcp_partial = batch.dcp_partial;
  kv_cache_->begin_step(engine_graph_slots_);
  backend_->init_forward_metadata_capture_cuda_graph(bs, static_cast<int>(tokens), cap);
  batch_ = &cap;
  last_mode_ = batch.mode;
  verify_committed_ = false;
}

void AttentionRuntime::begin_replay_step(const ForwardBatch& batch, int bs) {
  batch_ = nullptr;
  stepped_ = true;
  check_graph_step(batch, engine_graph_max_bs_, "begin_replay_step",
                   "call init_cuda_graph_state and capture the step first", "replayed");
  // No request at all pads every row (a DCP rank none of whose rows sees a key of its own).
  ATTNRT_CHECK(batch.batch_size >= 0 && batch.batch_size <= bs && bs >= 1 &&
                   bs <= engine_graph_max_bs_,
               "begin_replay_step: {} requests replayed at the captured size {}; need 0 <= "
               "requests <= captured size <= init_cuda_graph_state's max_bs ({})",
               batch.batch_size, bs, engine_graph_max_bs_);
  check_step(batch);
  const int64_t tokens = int64_t{bs} * graph_tokens_per_request(batch);
  engine_graph_slots_.out_cache_loc.assign(batch.out_cache_loc.begin(), batch.out_cache_loc.end());
  engine_graph_slots_.out_cache_loc.resize(static_cast<size_t>(tokens), 0);
  // A DCP rank's batch (docs/dcp.md): rows on the dummy slot 0 (queries that are no key here,
  // padded rows) store nothing.
  engine_graph_slots_.dcp_partial = batch.dcp_partial;
  kv_cache_->begin_step(engine_graph_slots_);
  backend_->init_forward_metadata_replay_cuda_graph(bs, batch.batch_size, batch);
  batch_ = &batch;
  last_mode_ = batch.mode;
  verify_committed_ = false;
}

void AttentionRuntime::synchronize() { kv_cache_->synchronize(); }

void AttentionRuntime::set_stream(void* stream) {
  if (kv_cache_->device().kind == DeviceKind::cpu || kv_cache_->stream_handle() == stream) return;
  backend_->set_stream(stream);
  // Backends that do not hold the cache (linear ones read its stream) leave it to this call.
  if (kv_cache_->stream_handle() != stream) kv_cache_->set_stream_handle(stream);
}

void* AttentionRuntime::stream() const { return kv_cache_->stream_handle(); }

void AttentionRuntime::copy_tensor(const TensorView& dst, const TensorView& src) {
  ATTNRT_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel() && dst.is_contiguous() &&
                   src.is_contiguous(),
               "copy_tensor: {} -> {}; the tensors need the same dtype and element count and "
               "contiguous rows",
               src.describe(), dst.describe());
  const size_t bytes = static_cast<size_t>(src.numel()) * dtype_size(src.dtype);
  if (bytes == 0) return;
  if (dst.device.kind == DeviceKind::cpu && src.device.kind == DeviceKind::cpu) {
    std::memmove(dst.data, src.data, bytes);
    return;
  }
  kv_cache_->copy(dst.data, src.data, bytes);
}

}  // namespace attnrt
