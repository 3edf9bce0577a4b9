// LinearStatePool: the conv window and the recurrent state of every linear-attention layer, one
// slot per running request, plus per-draft-token checkpoints for speculative verify
// (reference-semantics §4.7, §8.10).
//
// Layout per linear layer (attnrt's own, Open question 7):
//   conv        [size + 1, K - 1, conv_dim]   the last K - 1 conv inputs, oldest first; channels
//                                             contiguous so that one token's window row is a vector
//   ssm         [size + 1, heads, rows, cols] gdn/kda: [HV, Dv, Dk] (value-major, §4.7.2);
//                                             mamba2: [nheads, head_dim, d_state]
//   inter_conv  [verify_rows, N, K - 1, conv_dim]   window after each verify block token
//   inter_ssm   [verify_rows, N, heads, rows, cols] state after each verify block token
// Slot 0 is reserved (padded rows may write there); alloc() hands out 1..size, zero-filled. The
// checkpoints are indexed by the batch row of the verify step, not by slot.
//
// Placement: the bookkeeping (free slots, request-row bindings) is always on the host; the tensors
// live in a LinearStateMemory: host memory (make_host_linear_state_memory, the default) or GPU
// memory (backends/cuda, stream-ordered on the cuda backend's stream). The runtime puts the pool
// where the KV cache is. LinearLayerState's pointers are then device pointers; the download_* /
// upload_* functions give host access to one slot or checkpoint for tests and tooling.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "attnrt/core/tensor.h"
#include "attnrt/memory/layer_index.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

// The state geometry of one linear layer, derived from its LinearSpec.
struct LinearStateShape {
  int conv_dim = 0;    // channels of the causal conv (gdn/kda: q|k|v; mamba2: x|B|C)
  int conv_width = 0;  // K - 1 stored inputs
  int heads = 0;       // recurrent-state heads (gdn: value heads)
  int rows = 0;        // per head: Dv (gdn/kda) or head_dim (mamba2)
  int cols = 0;        // per head: Dk (gdn/kda) or d_state (mamba2)
  int64_t conv_elems() const { return static_cast<int64_t>(conv_width) * conv_dim; }
  int64_t ssm_elems() const { return static_cast<int64_t>(heads) * rows * cols; }
};
// Throws attnrt::Error when `layer` is not a linear layer.
LinearStateShape linear_state_shape(const LayerSpec& layer);

// Host views of one layer's tensors (see the layout above).
struct LinearLayerState {
  int layer_id = 0;
  LayerKind kind = LayerKind::gdn;
  LinearStateShape shape;
  DType conv_dtype = DType::f32, ssm_dtype = DType::f32;
  void* conv = nullptr;
  void* ssm = nullptr;
  void* inter_conv = nullptr;  // null without checkpoints
  void* inter_ssm = nullptr;

  // Element offsets of a slot's (or a checkpoint's) first element.
  int64_t conv_offset(int64_t slot) const { return slot * shape.conv_elems(); }
  int64_t ssm_offset(int64_t slot) const { return slot * shape.ssm_elems(); }
  int64_t inter_conv_offset(int64_t row, int t, int n) const {
    return (row * n + t) * shape.conv_elems();
  }
  int64_t inter_ssm_offset(int64_t row, int t, int n) const {
    return (row * n + t) * shape.ssm_elems();
  }
};

// Where a LinearStatePool's tensors live. Addresses are in the memory's own space (host or device);
// zero / copy are ordered with the kernels that use the pool (a GPU memory enqueues them on its
// stream and never waits for the GPU); to_host / from_host return once the data has arrived.
class LinearStateMemory {
 public:
  virtual ~LinearStateMemory() = default;
  virtual Device device() const = 0;
  virtual void* allocate_zeroed(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void from_host(void* dst, const void* host_src, size_t bytes) = 0;
};
std::unique_ptr<LinearStateMemory> make_host_linear_state_memory();

struct LinearStateConfig {
  int max_slots = 0;              // usable state slots (running requests); slot 0 comes on top
  int max_request_rows = 0;       // ReqToTokenPool rows that can be bound to slots
  DType ssm_dtype = DType::f32;   // recurrent state: fp32 or bf16
  DType conv_dtype = DType::f32;  // conv window: fp32 or bf16
  // Speculative decoding: the largest verify batch and its block size N (root included); 0 = no
  // checkpoints (TARGET_VERIFY is then rejected).
  int verify_rows = 0;
  int num_draft_tokens = 0;
};

class LinearStatePool {
 public:
  // Holds every linear layer of `model` in `memory` (null: host memory). Throws attnrt::Error for
  // a bad config or a model without linear layers.
  LinearStatePool(const ModelSpec& model, const LinearStateConfig& config,
                  std::unique_ptr<LinearStateMemory> memory = nullptr);
  ~LinearStatePool();
  LinearStatePool(const LinearStatePool&) = delete;
  LinearStatePool& operator=(const LinearStatePool&) = delete;

  // A free slot with every layer's conv window and state zeroed; throws when all are in use.
  int alloc();
  void free(int slot);  // throws on a slot that is not allocated (or bound to a request row)
  // Copies every layer's conv window and state of `src` into `dst` (prefix-cache fork).
  void copy(int src, int dst);
  int fork(int src) {
    const int dst = alloc();
    copy(src, dst);
    return dst;
  }
  bool is_allocated(int slot) const;
  // Throws attnrt::Error naming the first broken invariant and its slot or row: slot 0 is reserved;
  // the free slots are in 1..size, each listed once and none allocated; free + allocated == size;
  // the row -> slot and slot -> row bindings mirror each other and bind allocated slots only.
  // O(size + request rows).
  void check_invariants() const;
  // The same, and the rows bound to slots are exactly `live_rows` (every live request holds one
  // slot; an allocated slot of no live row is leaked).
  void check_invariants(std::span<const int> live_rows) const;
  int size() const { return config_.max_slots; }
  int available() const { return static_cast<int>(free_slots_.size()); }

  // Request row -> slot (HybridReqToTokenPool's mapping, §4.1). A row holds at most one slot and a
  // slot at most one row; the slot must be allocated.
  void bind(int req_row, int slot);
  void unbind(int req_row);
  int slot_of(int req_row) const;  // -1 when the row has no slot
  // alloc() + bind(), and unbind() + free(): what an engine does when a request starts / ends.
  int alloc_for(int req_row);
  void free_for(int req_row);

  bool holds(int layer_id) const;
  // Throws attnrt::Error naming the layer when it is not a linear layer of the model.
  const LinearLayerState& layer(int layer_id) const;
  const std::vector<int>& layer_ids() const { return layer_ids_; }

  bool has_checkpoints() const { return config_.verify_rows > 0; }
  int verify_rows() const { return config_.verify_rows; }
  int num_draft_tokens() const { return config_.num_draft_tokens; }
  // §8.10 for every linear layer: slot slots[i] takes verify row i's checkpoint last_accepted[i]
  // (conv window and state); rows with -1 are skipped. Validates everything before copying.
  void commit_verify(std::span<const int64_t> slots, std::span<const int32_t> last_accepted);

  const LinearStateConfig& config() const { return config_; }
  size_t bytes() const;
  Device device() const { return memory_->device(); }
  LinearStateMemory& memory() const { return *memory_; }

  // Host access to one layer's slot (any slot, 0 included) or verify checkpoint (request row
  // `row`, block token t): the conv window [K - 1, conv_dim] and the state [heads, rows, cols] in
  // the pool's dtypes, conv_elems() and ssm_elems() values. Returns once the copy is done.
  void download_slot(int layer_id, int slot, void* conv, void* ssm) const;
  void upload_slot(int layer_id, int slot, const void* conv, const void* ssm);
  void download_checkpoint(int layer_id, int row, int t, void* conv, void* ssm) const;
  void upload_checkpoint(int layer_id, int row, int t, const void* conv, const void* ssm);

 private:
  // One tensor of the pool, released into its memory when dropped.
  struct Allocation {
    LinearStateMemory* memory = nullptr;
    void* ptr = nullptr;
    Allocation() = default;
    Allocation(LinearStateMemory* m, size_t bytes) : memory(m), ptr(m->allocate_zeroed(bytes)) {}
    Allocation(Allocation&& o) noexcept : memory(o.memory), ptr(o.ptr) { o.ptr = nullptr; }
    Allocation& operator=(Allocation&& o) noexcept {
      if (this != &o) {
        reset();
        memory = o.memory;
        ptr = o.ptr;
        o.ptr = nullptr;
      }
      return *this;
    }
    ~Allocation() { reset(); }
    void reset() {
      if (ptr != nullptr) memory->release(ptr);
      ptr = nullptr;
    }
  };
  struct Layer {
    LinearLayerState view;
    size_t conv_bytes = 0, ssm_bytes = 0;  // one slot's (or checkpoint's)
    Allocation conv, ssm, inter_conv, inter_ssm;
  };
  void check_slot(int slot, const char* what) const;
  void check_any_slot(int layer_id, int slot, const char* what) const;
  void check_checkpoint(int layer_id, int row, int t, const char* what) const;
  const Layer& find(int layer_id) const;
  void zero_slot(int slot);

  LinearStateConfig config_;
  std::unique_ptr<LinearStateMemory> memory_;  // declared before layers_: outlives them
  std::vector<Layer> layers_;
  LayerIndex index_;  // layer id -> index in layers_ (linear layers only)
  std::vector<int> layer_ids_;
  std::vector<int> free_slots_;
  std::vector<uint8_t> in_use_;
  std::vector<int> row_slot_;  // request row -> slot, -1 = none
  std::vector<int> slot_row_;  // slot -> request row, -1 = none
};

}  // namespace attnrt
