// Host-callable launchers of the prefill / extend kernel (prefill.cuh), compiled by nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include "backends/cuda/kernels/attention_params.h"

namespace attnrt::cuda {

// Query rows per CTA; the plan's TileShape::prefill / TileShape::verify work items must use these
// strides.
inline constexpr int kPrefillTileRows = 128;
inline constexpr int kPrefillVerifyTileRows = 64;

// Non-tree steps with 16-bit KV (q/out and KV bf16, or all fp16), head dims 64, 128, 256; the
// work list and split counts are those of a TileShape::prefill plan. Grid: (kv heads, num_items).
cudaError_t launch_prefill(const AttnParams& p, int head_dim, bool fp16, int num_items,
                           cudaStream_t stream);
cudaError_t launch_prefill_d64(const AttnParams& p, bool fp16, int num_items, cudaStream_t stream);
cudaError_t launch_prefill_d128(const AttnParams& p, bool fp16, int num_items, cudaStream_t stream);
cudaError_t launch_prefill_d256(const AttnParams& p, bool fp16, int num_items, cudaStream_t stream);

// The warp-specialised CTA of prefill_ws.cuh for the same launches (same arguments and results;
// ping_pong: the consumers' ping-pong schedule). launch_prefill takes the CTA prefill_ws_mode()
// says: kWsAuto (the default) the warp-specialised one, in ping-pong at head dims 64 and 128
// (faster there on every benchmark row; at 256 the ping-pong's two S tiles do not fit the
// registers), 0 the CTA of prefill.cuh, 1 the warp-specialised one without the ping-pong, 2 with
// it. The mode is ATTNRT_PREFILL_WS in the environment (-1, 0, 1, 2), read once at the first
// prefill launch unless set_prefill_ws_mode chose first.
constexpr int kWsAuto = -1;
cudaError_t launch_prefill_ws(const AttnParams& p, int head_dim, bool fp16, bool ping_pong,
                              int num_items, cudaStream_t stream);
int prefill_ws_mode();
void set_prefill_ws_mode(int mode);

// Steps of any mode (TARGET_VERIFY trees included) planned with TileShape::verify or
// TileShape::decode32 work items (a decode32 item is the only one of its request, f0 = 0, at most
// 32 rows: the 64-row CTA covers it), 16-bit KV, head dims 64 and 128 (prefill_verify_dim); other
// head dims and fp8 KV take the CTAs of attention.cuh. `dependent`: as launch_attention's
// (launch.h). Occupancy: resident CTAs per SM (occupancy API; at least 1).
constexpr bool prefill_verify_dim(int head_dim) { return head_dim == 64 || head_dim == 128; }
cudaError_t launch_prefill_verify(const AttnParams& p, int head_dim, bool fp16, int num_items,
                                  cudaStream_t stream, bool dependent);
int prefill_verify_occupancy(int head_dim, bool fp16);
cudaError_t launch_prefill_verify_d64(const AttnParams& p, bool fp16, int num_items,
                                      cudaStream_t stream, bool dependent);
cudaError_t launch_prefill_verify_d128(const AttnParams& p, bool fp16, int num_items,
                                       cudaStream_t stream, bool dependent);
int prefill_verify_occupancy_d64(bool fp16);
int prefill_verify_occupancy_d128(bool fp16);

}  // namespace attnrt::cuda
