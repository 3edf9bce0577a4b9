// Host-callable launchers of the cuda backend's kernels (thin wrappers compiled by nvcc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/dispatch.h"

namespace attnrt::cuda {

// Programmatic dependent launches (kernels/dependent_launch.cuh): on unless the environment sets
// ATTNRT_PDL=0 when the process first asks; set_dependent_launch switches them for the whole
// process (A/B timing, tests). The `dependent` arguments below are the caller's promise about the
// operation just before the launch on `stream`; with it false, or PDL off, launches are plain.
bool dependent_launch_enabled();
void set_dependent_launch(bool on);

// One CTA's entry points: its launch over a (kv heads, num_items) grid and its resident CTAs per
// SM (occupancy API; at least 1). `dependent` as launch_attention's.
struct AttnCtaEntry {
  cudaError_t (*launch)(const AttnParams& p, const AttnKernelKey& key, int num_items,
                        cudaStream_t stream, bool dependent) = nullptr;
  int (*occupancy)(const AttnKernelKey& key) = nullptr;
};

// Launches `key`'s CTA (dispatch.h) over num_items work items, every kernel reading the same work
// list and writing the same partials. `dependent`: the launch just before on `stream` is a
// launch_store_kv kernel, the last of store kernels whose first one was a plain launch (dependent
// false). The kernel reads q, the work list and the requests before it waits for the stores:
// whatever wrote them must have come before that first store kernel on the stream. Everything
// else (pages, K/V) it reads after the wait. CTAs that are never dependents (dispatch.h's
// launches_as_dependent) are launched plainly. cudaErrorInvalidValue for keys no CTA takes.
cudaError_t launch_attention(const AttnParams& p, const AttnKernelKey& key, int num_items,
                             cudaStream_t stream, bool dependent);
// The CTA that runs `key`'s launches: dispatch.h's table, or what the environment's switches ask
// for instead (ATTNRT_MLA_CTA for MLA launches, mla.h; ATTNRT_PREFILL_KV8=0 for prefill tiles over
// fp8 pages, prefill.h). `attnrt info --explain` names this one.
AttnCta effective_attention_cta(const AttnKernelKey& key);
// Resident CTAs per SM of `key`'s CTA (occupancy API; at least 1).
int attention_occupancy(const AttnKernelKey& key);

// The mma.sync and keys-on-M CTAs of one head dim (attention_d{64,128,256}.cu, compiled in
// parallel): `cta` is one of keys_m, decode, decode32, verify, mma_prefill; empty otherwise.
AttnCtaEntry mma_attention_entry_d64(AttnCta cta, bool fp16, KvKind kv);
AttnCtaEntry mma_attention_entry_d128(AttnCta cta, bool fp16, KvKind kv);
AttnCtaEntry mma_attention_entry_d256(AttnCta cta, bool fp16, KvKind kv);

// Merges the split-KV partials of requests with num_splits > 1 (log-sum-exp, sinks, v_scale).
// `dependent`: the launch just before on `stream` is a kernel (the attention kernel that wrote the
// partials); the merge waits for it before its first access.
cudaError_t launch_merge(const MergeParams& p, bool fp16, cudaStream_t stream, bool dependent);

// Scatters rows src[t, h, :] to dst[loc[t] * dst_row_stride + h * dim ...], converting dtypes
// (codes: attnrt::DType values) after dividing by the layer's `scale` (as the host pools do).
struct StoreParams {
  const void* src;
  int64_t src_stride_tok, src_stride_head;
  int32_t src_dtype;
  void* dst;
  int64_t dst_row_stride;
  int32_t dst_dtype;
  const int64_t* loc;
  int64_t num_tokens;
  int32_t heads, dim;
  float scale;
};
// `dependent`: the launch just before on `stream` is another launch_store_kv kernel (the K store
// before the V store of one layer) writing a different pool; src must have been complete when that
// one was launched. The kernel stores before it waits, and waits before it exits.
cudaError_t launch_store_kv(const StoreParams& p, cudaStream_t stream, bool dependent);

// Copies `count` rows of `row_bytes` bytes: row i goes from src + src_rows[i] * src_stride to
// dst + dst_rows[i] * dst_stride (strides in bytes; a null index array stands for i itself). The
// rows run in parallel: no row may be both written and read by one launch.
struct CopyRowsParams {
  const void* src;
  int64_t src_stride;
  const int64_t* src_rows;
  void* dst;
  int64_t dst_stride;
  const int64_t* dst_rows;
  int64_t count;
  int64_t row_bytes;
};
cudaError_t launch_copy_rows(const CopyRowsParams& p, cudaStream_t stream);

// map[index[i]] = value[i] for i < count (the SWA cache's device full->SWA map, kept current with
// the step's translated write slots). Equal indices must carry equal values.
cudaError_t launch_scatter_slots(int64_t* map, const int64_t* index, const int64_t* value,
                                 int64_t count, cudaStream_t stream);

// DSA's index-key cache on the GPU (kernels/index_keys.cu; docs/dsa.md): rows of src [T, dim]
// (kBF16 / kF16 / kF32, rows src_stride_tok elements apart, contiguous within) quantised per token
// to fp8 e4m3 with a power-of-two scale, as quantize_fp8_block, and stored at slot loc[t] of the
// paged layout (pages of page_size slots: codes, then fp32 scales).
struct IndexKeyStoreParams {
  const void* src;
  int64_t src_stride_tok;
  int32_t src_dtype;
  const int64_t* loc;
  int64_t num_tokens;
  uint8_t* data;
  int32_t page_size, dim;
};
cudaError_t launch_store_index_keys(const IndexKeyStoreParams& p, cudaStream_t stream);
// Slot src_rows[i]'s key (codes and scale) moved to slot dst_rows[i], every source read before
// any destination is written (through scratch, count * (dim + 4) bytes).
struct IndexKeyMoveParams {
  uint8_t* data;
  int32_t page_size, dim;
  const int64_t* src_rows;
  const int64_t* dst_rows;
  int64_t count;
  uint8_t* scratch;
};
cudaError_t launch_move_index_keys(const IndexKeyMoveParams& p, cudaStream_t stream);

// MLA's MHA form (kernels/mla_mha.cu): the gather of a prefix chunk's latent rows.
// out[i, :dim] = pool row slots[i] x scale (through slot_map when set), any float pool dtype
// (fp8 included) to a bf16 / f16 / f32 output with rows out_stride elements apart.
struct GatherRowsParams {
  const void* src;
  int64_t src_row_stride;
  int32_t src_dtype;
  const int64_t* slots;
  const int64_t* slot_map;
  int64_t slot_map_rows;
  void* out;
  int64_t out_stride;
  int32_t out_dtype;
  int64_t count;
  int32_t dim;
  float scale;
};
cudaError_t launch_gather_rows(const GatherRowsParams& p, cudaStream_t stream);

}  // namespace attnrt::cuda
