// The index-key cache of DSA layers (docs/dsa.md "The index-key cache"): per slot one key of
// index_head_dim fp8 e4m3 codes and one fp32 scale, in the slot space of the latent pool (the same
// out_cache_loc and req_to_token). Paged as DeepGEMM's paged index kernels read it: page p of
// P = page_size slots is P * D code bytes (slot after slot) followed by P fp32 scales.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "attnrt/core/tensor.h"
#include "attnrt/memory/layer_index.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

// The largest finite e4m3 value: a block's scale maps its largest magnitude at most here.
inline constexpr float kFp8E4m3Max = 448.f;

// One block of n values as fp8 e4m3 codes with one power-of-two scale (the "ue8m0" scale format
// of DeepSeek's act_quant): scale = 2^ceil(log2(max(amax, 1e-4) / 448)), codes[i] =
// e4m3(x[i] / scale) (exact division, round to nearest even). Returns the scale; the value a
// reader sees is e4m3_to_float(codes[i]) * scale. NaN or infinite inputs are the caller's error.
float quantize_fp8_block(const float* x, int n, uint8_t* codes);
// The scale quantize_fp8_block takes for a block whose largest magnitude is amax.
float fp8_block_scale(float amax);

// What a backend reads for one DSA layer.
struct IndexKeyView {
  uint8_t* data = nullptr;  // pages * page_size * (dim + 4) bytes
  Device device;
  int64_t num_rows = 0;  // slots, including the reserved page
  int page_size = 1;
  int dim = 0;  // index_head_dim

  int64_t page_bytes() const { return static_cast<int64_t>(page_size) * (dim + 4); }
  const uint8_t* codes(int64_t slot) const {
    return data + (slot / page_size) * page_bytes() + (slot % page_size) * dim;
  }
  uint8_t* codes(int64_t slot) { return const_cast<uint8_t*>(std::as_const(*this).codes(slot)); }
  float scale(int64_t slot) const {
    float s;
    std::memcpy(&s, scale_ptr(slot), sizeof s);
    return s;
  }
  const uint8_t* scale_ptr(int64_t slot) const {
    return data + (slot / page_size) * page_bytes() + static_cast<int64_t>(page_size) * dim +
           (slot % page_size) * 4;
  }
};

// The host index-key cache of a model's DSA layers, every layer with rows slots (a multiple of
// page_size). Zeroed at creation: never-written slots read as key 0 with scale 0.
class IndexKeyPool {
 public:
  IndexKeyPool(int64_t rows, int page_size, const std::vector<LayerSpec>& layers);

  bool holds(int layer_id) const { return index_.holds(layer_id); }
  IndexKeyView layer(int layer_id) const;
  // Quantises k [T, index_head_dim] (fp32 / fp16 / bf16, any strides, host memory) token by token
  // and writes rows loc (slots of this pool). Checks k and every slot before writing anything.
  void store(int layer_id, std::span<const int64_t> loc, const TensorView& k);
  // Moves the keys of slots `from` to `to` in those of `layers` this pool holds (accepted drafts
  // compacted after a verify); every source is read before any destination is written.
  void copy_rows(std::span<const int> layers, std::span<const std::pair<int64_t, int64_t>> moves);
  size_t bytes() const;

 private:
  struct Layer {
    int layer_id = 0;
    int dim = 0;
    std::vector<uint8_t> data;
  };
  IndexKeyView view_of(const Layer& l) const;
  int64_t rows_;
  int page_size_;
  std::vector<Layer> layers_;
  LayerIndex index_;
};

}  // namespace attnrt
