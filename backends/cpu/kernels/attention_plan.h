// Plain-old-data the cpu attention kernels read: the per-step plan (built once by
// CpuBackend::init_forward_metadata and shared by every layer) and the per-layer arguments.
// Nothing here depends on the SIMD target, so the plan can be built, logged and compared on the host.
#pragma once

#include <cstdint>

#include "attnrt/core/dtype.h"

namespace attnrt::cpu {

// One request of the step as the kernels see it. Query t of the request is row q_row + t of q/out
// and sits at position prefix + t (verify trees: prefix + depth(t)); its keys are
// slots[slot_offset + j] for j in [0, kv_len), key j at position j (tree drafts: prefix + depth).
struct RequestInfo {
  int64_t q_row = 0;
  int64_t slot_offset = 0;
  int32_t prefix = 0;
  int32_t qlen = 0;
  int32_t kv_len = 0;
  int32_t tree = -1;  // -1: no tree mask; else offset of the request's drafts in tree_depth
};

// The unit of parallel work, run once per kv head: queries [t0, t1) of a request, heads [g0, g1)
// of the GQA group (head h = kv_head * G + g), keys [k0, k1). A key range that is only part of the
// visible keys leaves an unnormalised partial state that a MergeItem combines.
struct WorkItem {
  int32_t req = 0;
  int32_t t0 = 0, t1 = 0;
  int32_t g0 = 0, g1 = 0;
  int32_t k0 = 0, k1 = 0;
  // The kernel: true = the tile kernel (query rows in the lanes, one task per kv head), false =
  // the single-query kernel (one task for every kv head).
  bool tile = true;
  // -1: the item sees every visible key and writes the output itself. Otherwise the offset (in
  // floats) of its partial state in KernelPlan::partial: per kv head h, at
  // h * rows * (Dv + 2): acc[rows][Dv], then m[rows], then l[rows]; rows = (t1 - t0) * (g1 - g0).
  int64_t part = -1;
};

// Items [first_item, first_item + num_items) cover the same rows with disjoint key ranges.
struct MergeItem {
  int32_t first_item = 0;
  int32_t num_items = 0;
};

struct KernelPlan {
  const RequestInfo* reqs = nullptr;
  const int32_t* slots = nullptr;  // key slots in this layer's pool
  const WorkItem* items = nullptr;
  int64_t num_items = 0;
  const MergeItem* merges = nullptr;
  int64_t num_merges = 0;
  // Verify trees: depth of every draft, and for every draft t the ancestor-or-self bit set over the
  // drafts of its request (tree_words 64-bit words per draft).
  const int32_t* tree_depth = nullptr;
  const uint64_t* tree_mask = nullptr;
  int tree_words = 0;
  // SWA pools: a translated slot 0 is a key the pool no longer holds (outside every window).
  bool zero_slot_is_absent = false;
  float* partial = nullptr;
  int num_threads = 1;
};

// Everything a layer's call changes. Tensor strides are in elements.
struct LayerArgs {
  const void* q = nullptr;  // [T, Hq, Dqk]
  DType q_dtype = DType::f32;
  int64_t q_stride[3] = {0, 0, 0};
  void* out = nullptr;      // [T, Hq, Dv]
  DType out_dtype = DType::f32;
  int64_t out_stride[3] = {0, 0, 0};
  float* lse = nullptr;     // optional [T, Hq]
  int64_t lse_stride[2] = {0, 0};
  const float* sinks = nullptr;  // optional [Hq]
  // Pool rows: K of slot s, kv head g at k_cache + s * k_row_stride + g * head_dim (elements).
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  DType kv_dtype = DType::bf16;
  int64_t k_row_stride = 0, v_row_stride = 0;
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0, v_head_dim = 0;
  float qk_scale = 1.f;  // softmax scaling times the K dequantisation scale
  float v_scale = 1.f;
  float softcap = 0.f;   // 0 = off
  int window = -1;       // -1 = off; key visible iff 0 <= pos_q - pos_k <= window
  bool causal = true;
};

}  // namespace attnrt::cpu
