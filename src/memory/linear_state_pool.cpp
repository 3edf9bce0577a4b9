#include "attnrt/memory/linear_state_pool.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "attnrt/core/error.h"
#include "attnrt/core/fault_injection.h"

namespace attnrt {

namespace {

class HostLinearStateMemory final : public LinearStateMemory {
 public:
  Device device() const override { return Device::cpu(); }
  void* allocate_zeroed(size_t bytes) override {
    fault_point(FaultSite::host_alloc, "LinearStatePool host memory");
    void* p = std::calloc(bytes > 0 ? bytes : 1, 1);
    ATTNRT_CHECK(p != nullptr, "LinearStatePool: out of host memory allocating {} bytes", bytes);
    return p;
  }
  void release(void* p) override { std::free(p); }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  void copy(void* dst, const void* src, size_t bytes) override { std::memmove(dst, src, bytes); }
  void to_host(void* host_dst, const void* src, size_t bytes) override {
    std::memcpy(host_dst, src, bytes);
  }
  void from_host(void* dst, const void* host_src, size_t bytes) override {
    std::memcpy(dst, host_src, bytes);
  }
};

}  // namespace

std::unique_ptr<LinearStateMemory> make_host_linear_state_memory() {
  return std::make_unique<HostLinearStateMemory>();
}

LinearStateShape linear_state_shape(const LayerSpec& layer) {
  const LinearSpec& s = layer.linear;
  LinearStateShape shape;
  shape.conv_width = s.conv_kernel - 1;
  switch (layer.kind) {
    case LayerKind::gdn:
    case LayerKind::kda:
      shape.conv_dim = 2 * s.num_k_heads * s.head_k_dim + s.num_v_heads * s.head_v_dim;
      shape.heads = s.num_v_heads;
      shape.rows = s.head_v_dim;
      shape.cols = s.head_k_dim;
      return shape;
    case LayerKind::mamba2:
      shape.conv_dim = s.num_v_heads * s.head_v_dim + 2 * s.n_groups * s.d_state;
      shape.heads = s.num_v_heads;
      shape.rows = s.head_v_dim;
      shape.cols = s.d_state;
      return shape;
    default:
      fail("layer {} is a {} layer; only gdn, kda and mamba2 layers have a linear state",
           layer.layer_id, layer_kind_name(layer.kind));
  }
}

LinearStatePool::LinearStatePool(const ModelSpec& model, const LinearStateConfig& config,
                                 std::unique_ptr<LinearStateMemory> memory)
    : config_(config),
      memory_(memory != nullptr ? std::move(memory) : make_host_linear_state_memory()) {
  ATTNRT_CHECK(config.max_slots >= 1,
               "LinearStatePool: max_slots = {} is invalid; it needs at least one state slot (one "
               "per running request)",
               config.max_slots);
  ATTNRT_CHECK(config.max_request_rows >= 1,
               "LinearStatePool: max_request_rows = {} is invalid; it must be the number of "
               "request rows (>= 1)",
               config.max_request_rows);
  for (auto [what, t] :
       {std::pair{"ssm_dtype", config.ssm_dtype}, std::pair{"conv_dtype", config.conv_dtype}}) {
    ATTNRT_CHECK(t == DType::f32 || t == DType::bf16,
                 "LinearStatePool: {} = {} is not supported; use fp32 or bf16", what,
                 dtype_name(t));
  }
  ATTNRT_CHECK(config.verify_rows >= 0 && config.num_draft_tokens >= 0 &&
                   (config.verify_rows == 0) == (config.num_draft_tokens == 0),
               "LinearStatePool: verify_rows = {} and num_draft_tokens = {}; give both (> 0) for "
               "speculative decoding or neither",
               config.verify_rows, config.num_draft_tokens);
  const int64_t rows = static_cast<int64_t>(config.max_slots) + 1;
  for (const LayerSpec& l : model.layers) {
    if (!is_linear_kind(l.kind)) continue;
    Layer layer;
    layer.view.layer_id = l.layer_id;
    layer.view.kind = l.kind;
    layer.view.shape = linear_state_shape(l);
    ATTNRT_CHECK(layer.view.shape.conv_width >= 0 && layer.view.shape.ssm_elems() > 0 &&
                     layer.view.shape.conv_dim > 0,
                 "LinearStatePool: model '{}' layer {} ({}) has an empty state (conv_dim {}, "
                 "state {}x{}x{}); validate the model first",
                 model.name, l.layer_id, layer_kind_name(l.kind), layer.view.shape.conv_dim,
                 layer.view.shape.heads, layer.view.shape.rows, layer.view.shape.cols);
    layer.view.conv_dtype = config.conv_dtype;
    layer.view.ssm_dtype = config.ssm_dtype;
    const LinearStateShape& sh = layer.view.shape;
    layer.conv_bytes = static_cast<size_t>(sh.conv_elems()) * dtype_size(config.conv_dtype);
    layer.ssm_bytes = static_cast<size_t>(sh.ssm_elems()) * dtype_size(config.ssm_dtype);
    LinearStateMemory* mem = memory_.get();
    layer.conv = Allocation(mem, layer.conv_bytes * rows);
    layer.ssm = Allocation(mem, layer.ssm_bytes * rows);
    layer.view.conv = layer.conv.ptr;
    layer.view.ssm = layer.ssm.ptr;
    if (config.verify_rows > 0) {
      const size_t checkpoints =
          static_cast<size_t>(config.verify_rows) * static_cast<size_t>(config.num_draft_tokens);
      layer.inter_conv = Allocation(mem, layer.conv_bytes * checkpoints);
      layer.inter_ssm = Allocation(mem, layer.ssm_bytes * checkpoints);
      layer.view.inter_conv = layer.inter_conv.ptr;
      layer.view.inter_ssm = layer.inter_ssm.ptr;
    }
    index_.add(l.layer_id, "LinearStatePool");
    layer_ids_.push_back(l.layer_id);
    layers_.push_back(std::move(layer));
  }
  ATTNRT_CHECK(!layers_.empty(),
               "LinearStatePool: model '{}' has no linear-attention layers (gdn, kda, mamba2); it "
               "needs no state pool",
               model.name);
  in_use_.assign(static_cast<size_t>(rows), 0);
  in_use_[0] = 1;  // the reserved pad slot
  slot_row_.assign(static_cast<size_t>(rows), -1);
  row_slot_.assign(static_cast<size_t>(config.max_request_rows), -1);
  // Popped from the back: slot 1 is handed out first.
  for (int s = config.max_slots; s >= 1; --s) free_slots_.push_back(s);
  zero_slot(0);
}

LinearStatePool::~LinearStatePool() = default;

void LinearStatePool::zero_slot(int slot) {
  for (Layer& l : layers_) {
    memory_->zero(static_cast<char*>(l.view.conv) + l.conv_bytes * slot, l.conv_bytes);
    memory_->zero(static_cast<char*>(l.view.ssm) + l.ssm_bytes * slot, l.ssm_bytes);
  }
}

int LinearStatePool::alloc() {
  ATTNRT_CHECK(!free_slots_.empty(),
               "LinearStatePool: all {} linear-state slots are in use; allow more running "
               "requests (max_slots) or free finished requests first",
               config_.max_slots);
  fault_point(FaultSite::slot_alloc, "LinearStatePool::alloc");
  const int slot = free_slots_.back();
  free_slots_.pop_back();
  in_use_[slot] = 1;
  zero_slot(slot);
  return slot;
}

bool LinearStatePool::is_allocated(int slot) const {
  return slot >= 1 && slot <= config_.max_slots && in_use_[slot] != 0;
}

void LinearStatePool::check_invariants() const {
  const int n = config_.max_slots;
  ATTNRT_CHECK(in_use_[0] != 0 && slot_row_[0] < 0,
               "LinearStatePool invariant: slot 0 is reserved (in use, bound to no row); it is {} "
               "and bound to row {}",
               in_use_[0] != 0 ? "in use" : "free", slot_row_[0]);
  std::vector<uint8_t> listed(static_cast<size_t>(n) + 1, 0);
  for (size_t i = 0; i < free_slots_.size(); ++i) {
    const int slot = free_slots_[i];
    ATTNRT_CHECK(slot >= 1 && slot <= n,
                 "LinearStatePool invariant: free list entry {} is slot {}, outside 1..{}", i, slot,
                 n);
    ATTNRT_CHECK(listed[slot] == 0, "LinearStatePool invariant: slot {} is listed free twice",
                 slot);
    ATTNRT_CHECK(in_use_[slot] == 0,
                 "LinearStatePool invariant: slot {} is listed free but marked allocated", slot);
    listed[slot] = 1;
  }
  for (int slot = 1; slot <= n; ++slot) {
    ATTNRT_CHECK(listed[slot] != 0 || in_use_[slot] != 0,
                 "LinearStatePool invariant: slot {} is neither free nor allocated (lost from the "
                 "free list); free + allocated must be the {} slots",
                 slot, n);
    const int row = slot_row_[slot];
    if (row < 0) continue;
    ATTNRT_CHECK(in_use_[slot] != 0,
                 "LinearStatePool invariant: slot {} is free but bound to request row {}", slot,
                 row);
    ATTNRT_CHECK(row < config_.max_request_rows && row_slot_[row] == slot,
                 "LinearStatePool invariant: slot {} is bound to request row {}, but that row "
                 "holds slot {}",
                 slot, row, row < config_.max_request_rows ? row_slot_[row] : -1);
  }
  for (int row = 0; row < config_.max_request_rows; ++row) {
    const int slot = row_slot_[row];
    ATTNRT_CHECK(slot < 0 || (slot >= 1 && slot <= n && slot_row_[slot] == row),
                 "LinearStatePool invariant: request row {} holds slot {}, which is not bound back "
                 "to it (slots 1..{})",
                 row, slot, n);
  }
}

void LinearStatePool::check_invariants(std::span<const int> live_rows) const {
  check_invariants();
  std::vector<uint8_t> live(static_cast<size_t>(config_.max_request_rows), 0);
  for (int row : live_rows) {
    ATTNRT_CHECK(row >= 0 && row < config_.max_request_rows && slot_of(row) >= 1,
                 "LinearStatePool invariant: live request row {} holds no state slot (rows "
                 "0..{})",
                 row, config_.max_request_rows - 1);
    live[row] = 1;
  }
  for (int slot = 1; slot <= config_.max_slots; ++slot) {
    if (in_use_[slot] == 0) continue;
    const int row = slot_row_[slot];
    ATTNRT_CHECK(row >= 0 && live[row] != 0,
                 "LinearStatePool invariant: slot {} is allocated but {}: leaked", slot,
                 row < 0 ? std::string("bound to no request row")
                         : fmt::format("bound to row {}, which no live request holds", row));
  }
}

void LinearStatePool::check_slot(int slot, const char* what) const {
  ATTNRT_CHECK(slot >= 1 && slot <= config_.max_slots,
               "LinearStatePool::{}: slot {} is out of range 1..{} (slot 0 is reserved)", what,
               slot, config_.max_slots);
  ATTNRT_CHECK(in_use_[slot] != 0, "LinearStatePool::{}: slot {} is not allocated", what, slot);
}

void LinearStatePool::free(int slot) {
  ATTNRT_CHECK(slot >= 1 && slot <= config_.max_slots,
               "LinearStatePool::free: slot {} is out of range 1..{} (slot 0 is reserved)", slot,
               config_.max_slots);
  ATTNRT_CHECK(in_use_[slot] != 0, "LinearStatePool::free: slot {} is not allocated (freed twice?)",
               slot);
  ATTNRT_CHECK(slot_row_[slot] < 0,
               "LinearStatePool::free: slot {} is still bound to request row {}; unbind the row "
               "first (or use free_for)",
               slot, slot_row_[slot]);
  in_use_[slot] = 0;
  free_slots_.push_back(slot);
}

void LinearStatePool::copy(int src, int dst) {
  check_slot(src, "copy (source)");
  check_slot(dst, "copy (destination)");
  if (src == dst) return;
  for (Layer& l : layers_) {
    char* conv = static_cast<char*>(l.view.conv);
    char* ssm = static_cast<char*>(l.view.ssm);
    memory_->copy(conv + l.conv_bytes * dst, conv + l.conv_bytes * src, l.conv_bytes);
    memory_->copy(ssm + l.ssm_bytes * dst, ssm + l.ssm_bytes * src, l.ssm_bytes);
  }
}

void LinearStatePool::bind(int req_row, int slot) {
  ATTNRT_CHECK(req_row >= 0 && req_row < config_.max_request_rows,
               "LinearStatePool::bind: request row {} is out of range 0..{}", req_row,
               config_.max_request_rows - 1);
  check_slot(slot, "bind");
  ATTNRT_CHECK(row_slot_[req_row] < 0,
               "LinearStatePool::bind: request row {} already holds slot {}; unbind it first",
               req_row, row_slot_[req_row]);
  ATTNRT_CHECK(slot_row_[slot] < 0,
               "LinearStatePool::bind: slot {} is already bound to request row {}", slot,
               slot_row_[slot]);
  row_slot_[req_row] = slot;
  slot_row_[slot] = req_row;
}

void LinearStatePool::unbind(int req_row) {
  ATTNRT_CHECK(req_row >= 0 && req_row < config_.max_request_rows,
               "LinearStatePool::unbind: request row {} is out of range 0..{}", req_row,
               config_.max_request_rows - 1);
  const int slot = row_slot_[req_row];
  ATTNRT_CHECK(slot >= 0, "LinearStatePool::unbind: request row {} holds no slot", req_row);
  row_slot_[req_row] = -1;
  slot_row_[slot] = -1;
}

int LinearStatePool::slot_of(int req_row) const {
  if (req_row < 0 || req_row >= config_.max_request_rows) return -1;
  return row_slot_[req_row];
}

int LinearStatePool::alloc_for(int req_row) {
  ATTNRT_CHECK(req_row >= 0 && req_row < config_.max_request_rows,
               "LinearStatePool::alloc_for: request row {} is out of range 0..{}", req_row,
               config_.max_request_rows - 1);
  ATTNRT_CHECK(row_slot_[req_row] < 0,
               "LinearStatePool::alloc_for: request row {} already holds slot {}", req_row,
               row_slot_[req_row]);
  const int slot = alloc();
  bind(req_row, slot);
  return slot;
}

void LinearStatePool::free_for(int req_row) {
  const int slot = slot_of(req_row);
  ATTNRT_CHECK(slot >= 0, "LinearStatePool::free_for: request row {} holds no slot", req_row);
  unbind(req_row);
  free(slot);
}

bool LinearStatePool::holds(int layer_id) const { return index_.holds(layer_id); }

const LinearLayerState& LinearStatePool::layer(int layer_id) const { return find(layer_id).view; }

void LinearStatePool::commit_verify(std::span<const int64_t> slots,
                                    std::span<const int32_t> last_accepted) {
  ATTNRT_CHECK(has_checkpoints(),
               "LinearStatePool::commit_verify: the pool keeps no verify checkpoints (built with "
               "verify_rows = 0, i.e. without speculative decoding)");
  ATTNRT_CHECK(slots.size() == last_accepted.size(),
               "LinearStatePool::commit_verify: {} slots but {} accepted indices; give one per "
               "request of the verify step",
               slots.size(), last_accepted.size());
  ATTNRT_CHECK(slots.size() <= static_cast<size_t>(config_.verify_rows),
               "LinearStatePool::commit_verify: {} requests, but checkpoints exist for {} verify "
               "rows",
               slots.size(), config_.verify_rows);
  const int n = config_.num_draft_tokens;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (last_accepted[i] < 0) continue;
    ATTNRT_CHECK(last_accepted[i] < n,
                 "LinearStatePool::commit_verify: last accepted index {} of request {} is out of "
                 "range -1..{} (the verify block has {} tokens)",
                 last_accepted[i], i, n - 1, n);
    ATTNRT_CHECK(slots[i] >= 0 && slots[i] <= config_.max_slots,
                 "LinearStatePool::commit_verify: slot {} of request {} is out of range 0..{}",
                 slots[i], i, config_.max_slots);
  }
  for (Layer& l : layers_) {
    for (size_t i = 0; i < slots.size(); ++i) {
      const int t = last_accepted[i];
      if (t < 0) continue;
      const size_t checkpoint = i * static_cast<size_t>(n) + static_cast<size_t>(t);
      memory_->copy(static_cast<char*>(l.view.conv) + l.conv_bytes * slots[i],
                    static_cast<const char*>(l.view.inter_conv) + l.conv_bytes * checkpoint,
                    l.conv_bytes);
      memory_->copy(static_cast<char*>(l.view.ssm) + l.ssm_bytes * slots[i],
                    static_cast<const char*>(l.view.inter_ssm) + l.ssm_bytes * checkpoint,
                    l.ssm_bytes);
    }
  }
}

size_t LinearStatePool::bytes() const {
  const size_t rows = static_cast<size_t>(config_.max_slots) + 1;
  const size_t checkpoints =
      static_cast<size_t>(config_.verify_rows) * static_cast<size_t>(config_.num_draft_tokens);
  size_t total = 0;
  for (const Layer& l : layers_) total += (l.conv_bytes + l.ssm_bytes) * (rows + checkpoints);
  return total;
}

const LinearStatePool::Layer& LinearStatePool::find(int layer_id) const {
  ATTNRT_CHECK(holds(layer_id),
               "LinearStatePool: layer {} is not a linear-attention layer of this pool ({} linear "
               "layers)",
               layer_id, layers_.size());
  return layers_[static_cast<size_t>(index_.at(layer_id, "LinearStatePool"))];
}

void LinearStatePool::check_any_slot(int layer_id, int slot, const char* what) const {
  find(layer_id);
  ATTNRT_CHECK(slot >= 0 && slot <= config_.max_slots,
               "LinearStatePool::{}: slot {} is out of range 0..{}", what, slot, config_.max_slots);
}

void LinearStatePool::check_checkpoint(int layer_id, int row, int t, const char* what) const {
  find(layer_id);
  ATTNRT_CHECK(has_checkpoints(),
               "LinearStatePool::{}: the pool keeps no verify checkpoints (built with "
               "verify_rows = 0)",
               what);
  ATTNRT_CHECK(row >= 0 && row < config_.verify_rows && t >= 0 && t < config_.num_draft_tokens,
               "LinearStatePool::{}: checkpoint (row {}, token {}) is out of range: rows 0..{}, "
               "tokens 0..{}",
               what, row, t, config_.verify_rows - 1, config_.num_draft_tokens - 1);
}

void LinearStatePool::download_slot(int layer_id, int slot, void* conv, void* ssm) const {
  check_any_slot(layer_id, slot, "download_slot");
  const Layer& l = find(layer_id);
  memory_->to_host(conv, static_cast<const char*>(l.view.conv) + l.conv_bytes * slot, l.conv_bytes);
  memory_->to_host(ssm, static_cast<const char*>(l.view.ssm) + l.ssm_bytes * slot, l.ssm_bytes);
}

void LinearStatePool::upload_slot(int layer_id, int slot, const void* conv, const void* ssm) {
  check_any_slot(layer_id, slot, "upload_slot");
  const Layer& l = find(layer_id);
  memory_->from_host(static_cast<char*>(l.view.conv) + l.conv_bytes * slot, conv, l.conv_bytes);
  memory_->from_host(static_cast<char*>(l.view.ssm) + l.ssm_bytes * slot, ssm, l.ssm_bytes);
}

void LinearStatePool::download_checkpoint(int layer_id, int row, int t, void* conv,
                                          void* ssm) const {
  check_checkpoint(layer_id, row, t, "download_checkpoint");
  const Layer& l = find(layer_id);
  const size_t c = static_cast<size_t>(row) * config_.num_draft_tokens + t;
  memory_->to_host(conv, static_cast<const char*>(l.view.inter_conv) + l.conv_bytes * c,
                   l.conv_bytes);
  memory_->to_host(ssm, static_cast<const char*>(l.view.inter_ssm) + l.ssm_bytes * c, l.ssm_bytes);
}

void LinearStatePool::upload_checkpoint(int layer_id, int row, int t, const void* conv,
                                        const void* ssm) {
  check_checkpoint(layer_id, row, t, "upload_checkpoint");
  const Layer& l = find(layer_id);
  const size_t c = static_cast<size_t>(row) * config_.num_draft_tokens + t;
  memory_->from_host(static_cast<char*>(l.view.inter_conv) + l.conv_bytes * c, conv, l.conv_bytes);
  memory_->from_host(static_cast<char*>(l.view.inter_ssm) + l.ssm_bytes * c, ssm, l.ssm_bytes);
}

}  // namespace attnrt
