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

// The warp-specialised CTA's TMA producer (prefill_ws.cuh): K/V pages loaded by tensor-map copies
// instead of per-row cp.async, taken by launch_prefill_ws where prefill_tma_applies and the
// driver encodes the tensor maps, unless switched off: ATTNRT_PREFILL_TMA (1 = on, the default;
// 0 = the cp.async producer everywhere), read once at the first prefill launch unless
// set_prefill_tma chose first.
bool prefill_tma_enabled();
// Persistent warp-specialised CTAs where a step has enough units (ATTNRT_PREFILL_WS_PERSISTENT,
// default 1, read once).
bool prefill_ws_persistent();
void set_prefill_tma(bool on);
// Host checks of a launch of launch_prefill_ws (no driver call): 16-bit KV without an SWA slot
// map (its slots are not contiguous within a page), pages of at least 8 slots, p.kv_rows known and
// below 2^31, K / V base and row strides 16-byte aligned, and a TMA instantiation for the CTA
// (head dims 64 and 128 in ping-pong, 256 without: the default's choices).
bool prefill_tma_applies(const AttnParams& p, int head_dim, bool ping_pong);
// Whether launch_prefill_ws(p, head_dim, fp16, ping_pong, ...) takes the TMA producer: switched
// on, applies, and the driver encoded the tensor maps (encoded once per pool and box, then reused).
bool prefill_ws_uses_tma(const AttnParams& p, int head_dim, bool fp16, bool ping_pong);

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
