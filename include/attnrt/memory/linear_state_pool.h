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
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attnrt/core/tensor.h"
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
  // Holds every linear layer of `model`. Throws attnrt::Error for a bad config or a model without
  // linear layers.
  LinearStatePool(const ModelSpec& model, const LinearStateConfig& config);

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
  Device device() const { return Device::cpu(); }

 private:
  struct Layer {
    LinearLayerState view;
    HostBuffer conv, ssm, inter_conv, inter_ssm;
  };
  void check_slot(int slot, const char* what) const;
  void zero_slot(int slot);

  LinearStateConfig config_;
  std::vector<Layer> layers_;
  std::vector<int> index_of_;  // layer id -> index in layers_, -1 if not a linear layer
  std::vector<int> layer_ids_;
  std::vector<int> free_slots_;
  std::vector<uint8_t> in_use_;
  std::vector<int> row_slot_;  // request row -> slot, -1 = none
  std::vector<int> slot_row_;  // slot -> request row, -1 = none
};

}  // namespace attnrt
