#include "attnrt/memory/index_key_cache.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "attnrt/core/error.h"
#include "attnrt/core/fault_injection.h"

namespace attnrt {

float fp8_block_scale(float amax) {
  // A power of two, so x / scale is exact and every backend stores the same codes. The exponent
  // ceil(log2(v)) is taken exactly from v's binary form: log2f rounds values a few ulps above a
  // power of two down onto it, which gave half the scale and codes past 448 (and a GPU's log2f
  // may round differently from the host's).
  int e = 0;
  // v = m * 2^e, m in [0.5, 1)
  const float m = std::frexp(std::max(amax, 1e-4f) / kFp8E4m3Max, &e);
  return std::ldexp(1.f, m == 0.5f ? e - 1 : e);
}

float quantize_fp8_block(const float* x, int n, uint8_t* codes) {
  float amax = 1e-4f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = fp8_block_scale(amax);
  for (int i = 0; i < n; ++i) codes[i] = float_to_e4m3(x[i] / scale);
  return scale;
}

IndexKeyPool::IndexKeyPool(int64_t rows, int page_size, const std::vector<LayerSpec>& layers)
    : rows_(rows), page_size_(page_size) {
  ATTNRT_CHECK(page_size >= 1 && rows >= page_size && rows % page_size == 0,
               "IndexKeyPool: {} rows in pages of {}; the rows must be whole pages (>= 1)", rows,
               page_size);
  for (const LayerSpec& l : layers) {
    ATTNRT_CHECK(l.has_indexer() && l.indexer.index_head_dim > 0,
                 "IndexKeyPool: layer {} has no indexer; this pool holds DSA layers only",
                 l.layer_id);
    index_.add(l.layer_id, "IndexKeyPool");
    Layer& x = layers_.emplace_back();
    x.layer_id = l.layer_id;
    x.dim = l.indexer.index_head_dim;
    fault_point(FaultSite::host_alloc, "IndexKeyPool layer buffer");
    x.data.assign(static_cast<size_t>(rows) * (x.dim + 4), 0);
  }
}

IndexKeyView IndexKeyPool::view_of(const Layer& l) const {
  IndexKeyView v;
  v.data = const_cast<uint8_t*>(l.data.data());
  v.device = Device::cpu();
  v.num_rows = rows_;
  v.page_size = page_size_;
  v.dim = l.dim;
  return v;
}

IndexKeyView IndexKeyPool::layer(int layer_id) const {
  return view_of(layers_[static_cast<size_t>(index_.at(layer_id, "IndexKeyPool"))]);
}

void IndexKeyPool::store(int layer_id, std::span<const int64_t> loc, const TensorView& k) {
  IndexKeyView v = layer(layer_id);
  const auto tokens = static_cast<int64_t>(loc.size());
  ATTNRT_CHECK(k.data != nullptr && k.device.kind == DeviceKind::cpu && is_float(k.dtype) &&
                   !is_fp8(k.dtype) && k.ndim == 2 && k.shape[0] == tokens && k.shape[1] == v.dim,
               "index-key cache of layer {}: index k is {}; expected a float (fp32 / fp16 / bf16) "
               "[{}, {}] (tokens, index_head_dim) on cpu",
               layer_id, k.empty() ? std::string("empty") : k.describe(), tokens, v.dim);
  for (int64_t t = 0; t < tokens; ++t) {
    ATTNRT_CHECK(loc[t] >= 0 && loc[t] < rows_,
                 "index-key cache of layer {}: slot {} (token {}) is outside rows [0, {})",
                 layer_id, loc[t], t, rows_);
  }
  std::vector<float> row(static_cast<size_t>(v.dim));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int d = 0; d < v.dim; ++d) {
      row[d] = load_as_float(k.data, k.dtype, static_cast<size_t>(t * k.strides[0] + d * k.strides[1]));
    }
    const float scale = quantize_fp8_block(row.data(), v.dim, v.codes(loc[t]));
    std::memcpy(const_cast<uint8_t*>(v.scale_ptr(loc[t])), &scale, sizeof scale);
  }
}

void IndexKeyPool::copy_rows(std::span<const int> layers,
                             std::span<const std::pair<int64_t, int64_t>> moves) {
  for (const auto& [src, dst] : moves) {
    ATTNRT_CHECK(src > 0 && src < rows_ && dst > 0 && dst < rows_,
                 "index-key cache: moving slot {} to slot {}; slots are [1, {})", src, dst, rows_);
  }
  for (int layer_id : layers) {
    if (!holds(layer_id)) continue;
    const Layer& l = layers_[static_cast<size_t>(index_.at(layer_id, "IndexKeyPool"))];
    IndexKeyView v = view_of(l);
    std::vector<uint8_t> saved(moves.size() * (static_cast<size_t>(l.dim) + 4));
    for (size_t i = 0; i < moves.size(); ++i) {
      std::memcpy(&saved[i * (l.dim + 4)], v.codes(moves[i].first), l.dim);
      std::memcpy(&saved[i * (l.dim + 4) + l.dim], v.scale_ptr(moves[i].first), 4);
    }
    for (size_t i = 0; i < moves.size(); ++i) {
      std::memcpy(v.codes(moves[i].second), &saved[i * (l.dim + 4)], l.dim);
      std::memcpy(const_cast<uint8_t*>(v.scale_ptr(moves[i].second)), &saved[i * (l.dim + 4) + l.dim], 4);
    }
  }
}

size_t IndexKeyPool::bytes() const {
  size_t total = 0;
  for (const Layer& l : layers_) total += l.data.size();
  return total;
}

}  // namespace attnrt
