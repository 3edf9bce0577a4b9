// Host-callable launchers of the DCP kernels (docs/dcp.md): a rank's rows gathered, its partial
// packed for the all-to-all, and the exact merge of the received partials. Dtype codes are
// attnrt::DType values (f32, f16, bf16).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attnrt::cuda {

// dst[e, h, :] = src[rows[e], h, :] for e < count; src strided (elements; last dim contiguous),
// dst contiguous [count, heads, dim], the same dtype.
struct DcpGatherParams {
  const void* src;
  int64_t src_stride_tok, src_stride_head;
  int32_t dtype;
  int32_t heads, dim;
  const int64_t* rows;
  int64_t count;
  void* dst;
};
cudaError_t launch_dcp_gather(const DcpGatherParams& p, cudaStream_t stream);

// The packed send buffer of a rank: block d (q heads [d*hq/n, (d+1)*hq/n)) = [T, heads(d), dv+1],
// a (row, head)'s dv outputs then its lse; a row without an entry (entry[t] < 0) is (0, -inf).
// out [entries, hq, dv] contiguous (dtype code), lse fp32 [entries, hq].
struct DcpPackParams {
  const void* out;
  int32_t out_dtype;
  const float* lse;
  const int64_t* entry;  // [T]: the row's entry, or -1
  int64_t tokens;
  int32_t hq, dv, ranks;
  float* send;
};
cudaError_t launch_dcp_pack(const DcpPackParams& p, cudaStream_t stream);

// The exact merge (docs/dcp.md) of the heads [h0, h0 + heads) of every row from the all-to-all's
// receive buffer: `ranks` blocks [T, heads, dv+1] in rank order, accumulated in double. out
// (dtype code, strides in elements, last dim contiguous) and lse (fp32, may be null) are indexed
// by the global head; sinks (device fp32 [hq], may be null) likewise.
struct DcpMergeParams {
  const float* recv;
  int32_t ranks;
  int64_t tokens;
  int32_t h0, heads, dv;
  const float* sinks;
  void* out;
  int32_t out_dtype;
  int64_t out_stride_tok, out_stride_head;
  float* lse;
  int64_t lse_stride_tok, lse_stride_head;
};
cudaError_t launch_dcp_merge(const DcpMergeParams& p, cudaStream_t stream);

}  // namespace attnrt::cuda
