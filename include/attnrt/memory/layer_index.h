// Global layer id -> index into a pool's own list of layers (the pools hold a subset of a model's
// layers, in the order they were added).
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

namespace attnrt {

class LayerIndex {
 public:
  // The next index for `layer_id`; throws attnrt::Error (prefixed with `owner`) for a negative id or
  // one added before.
  int add(int layer_id, std::string_view owner);
  bool holds(int layer_id) const {
    return layer_id >= 0 && static_cast<size_t>(layer_id) < index_.size() && index_[layer_id] >= 0;
  }
  // Throws attnrt::Error (prefixed with `owner`) when the layer is not held.
  int at(int layer_id, std::string_view owner) const;
  int size() const { return count_; }

 private:
  std::vector<int> index_;  // -1 = not held
  int count_ = 0;
};

}  // namespace attnrt
