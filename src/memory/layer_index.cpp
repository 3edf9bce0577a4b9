#include "attnrt/memory/layer_index.h"

#include "attnrt/core/error.h"

namespace attnrt {

int LayerIndex::add(int layer_id, std::string_view owner) {
  ATTNRT_CHECK(layer_id >= 0, "{}: layer id {} is invalid; ids are >= 0", owner, layer_id);
  if (static_cast<size_t>(layer_id) >= index_.size()) index_.resize(layer_id + 1, -1);
  ATTNRT_CHECK(index_[layer_id] < 0, "{}: layer {} is given twice", owner, layer_id);
  index_[layer_id] = count_;
  return count_++;
}

int LayerIndex::at(int layer_id, std::string_view owner) const {
  ATTNRT_CHECK(holds(layer_id), "{}: layer {} is not held by this pool", owner, layer_id);
  return index_[static_cast<size_t>(layer_id)];
}

}  // namespace attnrt
