// Host-side entry points of the prefill / extend CTAs (prefill.cuh, prefill_ws.cuh), compiled by
// nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

// Query rows per CTA; the plan's TileShape::prefill / TileShape::verify work items must use these
// strides.
inline constexpr int kPrefillTileRows = 128;
inline constexpr int kPrefillVerifyTileRows = 64;

// The entry points (launch.h) of the 128-row CTA (TileShape::prefill work items of non-tree steps,
// 16-bit KV: q/out and KV bf16, or all fp16; head dims 64, 128, 256) or, `verify`, of the 64-row
// CTA (TileShape::verify and TileShape::decode32 items of any mode, TARGET_VERIFY trees included,
// 16-bit KV, prefill_verify_dim head dims; a decode32 item is the only one of its request, f0 = 0,
// at most 32 rows: the 64-row CTA covers it). Empty for other head dims. The 128-row entry is
// the CTA prefill_ws_mode() says (read when the entry is asked for): kWsAuto (the default) the
// warp-specialised one of prefill_ws.cuh, in ping-pong at head dims 64 and 128 (faster there on
// every benchmark row; at 256 the ping-pong's two S tiles do not fit the registers), 0
// prefill_kernel, 1 the warp-specialised one without the ping-pong, 2 with it. The mode is
// ATTNRT_PREFILL_WS in the environment (-1, 0, 1, 2), read once at the first prefill launch unless
// set_prefill_ws_mode chose first.
AttnCtaEntry prefill_entry(int head_dim, bool fp16, bool verify);
// The fp8 prefill CTA: TileShape::prefill items of non-tree steps over an e4m3 KV pool, q / out
// bf16 or fp16, on fp8 tensor cores; head dim 128 (empty for others). Chosen by dispatch.h's table
// when AttnKernelKey::fp8_prefill is set (Options::fp8_prefill_attention). Which of the two CTAs
// runs is prefill_fp8_ws_enabled() (read when the entry is asked for): off (the default) the
// one-warpgroup CTA of prefill_fp8.cuh, on the warp-specialised one of prefill_fp8_ws.cuh
// (prefill_fp8_ws_entry). The switch is ATTNRT_PREFILL_FP8_WS in the environment (0, 1), read once
// at the first fp8 prefill launch unless set_prefill_fp8_ws chose first.
AttnCtaEntry prefill_fp8_entry(int head_dim, bool fp16);
AttnCtaEntry prefill_fp8_ws_entry(bool fp16);
bool prefill_fp8_ws_enabled();
void set_prefill_fp8_ws(bool on);
// The warp-specialised CTA over fp8 pages (prefill_kv8_ws.cu; prefill_ws.cuh's header comment):
// TileShape::prefill items of non-tree steps over an e4m3 or e5m2 KV pool, q / out bf16 or fp16,
// head dims 64, 128 and 256 (empty for others), computed at 16-bit precision (f16 MMAs: K and V exact, bf16 q scaled into f16 by a
// power of two). dispatch.h's table chooses it for those items unless Options::fp8_prefill_attention
// sends e4m3 ones to the fp8 CTA. prefill_kv8_enabled() (ATTNRT_PREFILL_KV8 in the environment, 0
// or 1, default 1, read once unless set_prefill_kv8 chose first) off: those items run on the
// mma.sync CTA as before it (attention_dispatch.cu).
AttnCtaEntry prefill_kv8_entry(int head_dim, bool fp16);
bool prefill_kv8_enabled();
void set_prefill_kv8(bool on);
// prefill_kernel's CTAs per head dim (prefill_d{64,128,256}.cu; no 64-row CTA at 256).
AttnCtaEntry prefill_kernel_entry_d64(bool fp16, bool verify);
AttnCtaEntry prefill_kernel_entry_d128(bool fp16, bool verify);
AttnCtaEntry prefill_kernel_entry_d256(bool fp16, bool verify);
// The warp-specialised CTA (prefill_ws.cu) for the same launches as the 128-row entry (ping_pong:
// the consumers' ping-pong schedule); empty for other head dims.
constexpr int kWsAuto = -1;
AttnCtaEntry prefill_ws_entry(int head_dim, bool fp16, bool ping_pong);
int prefill_ws_mode();
// The same CTA at MLA's MHA-form dims (q / k 192, v 128, one KV head per q head), for the
// MHA-form calls of the cuda backend (cuda_mla_mha.cpp): AttnParams::kv_ragged launches over the
// model's contiguous k / v tensors, (item, head) units (AttnParams::item_heads), whole tiles by TMA
// where the tensor maps can be encoded. ATTNRT_MLA_MHA_CTA=1 runs its consumers in ping-pong
// (0, the default: free-running; read once).
AttnCtaEntry prefill_mla_mha_entry(bool fp16);
// log2 of the keys per tile of that CTA (AttnParams::page_shift of its kv_ragged launches).
int mla_mha_tile_shift();
void set_prefill_ws_mode(int mode);

// The warp-specialised CTA's TMA producer (prefill_ws.cuh): K/V pages loaded by tensor-map copies
// instead of per-row cp.async, taken by the warp-specialised entry where prefill_tma_applies and
// the driver encodes the tensor maps, unless switched off: ATTNRT_PREFILL_TMA (1 = on, the default;
// 0 = the cp.async producer everywhere), read once at the first prefill launch unless
// set_prefill_tma chose first.
bool prefill_tma_enabled();
// Persistent warp-specialised CTAs where a step has enough units (ATTNRT_PREFILL_WS_PERSISTENT,
// default 1, read once).
bool prefill_ws_persistent();
void set_prefill_tma(bool on);
// Host checks of a launch of the warp-specialised CTA (no driver call): 16-bit KV without an SWA
// slot map (its slots are not contiguous within a page), pages of at least 8 slots, p.kv_rows known
// and below 2^31, K / V base and row strides 16-byte aligned, and a TMA instantiation for the CTA
// (head dims 64 and 128 in ping-pong, 256 without: the default's choices).
bool prefill_tma_applies(const AttnParams& p, int head_dim, bool ping_pong);
// Whether prefill_ws_entry(head_dim, fp16, ping_pong)'s launch of p takes the TMA producer:
// switched on, applies, and the driver encoded the tensor maps (encoded once per pool and box, then
// reused).
bool prefill_ws_uses_tma(const AttnParams& p, int head_dim, bool fp16, bool ping_pong);
// Host checks of Q by TMA in that producer (no driver call): the rows of p.q known, the GQA group a
// power of two up to the 128-row tile (so a tile is whole tokens of one group), q and its strides
// 16-byte aligned.
bool prefill_q_tma_applies(const AttnParams& p);
// Whether that launch takes the TMA producer with Q by TMA too (prefill_ws_uses_tma, Q's checks,
// and the driver encoded q's map).
bool prefill_ws_q_by_tma(const AttnParams& p, int head_dim, bool fp16, bool ping_pong);

// The warp-specialised fp8 CTA's TMA producer (prefill_fp8_ws.cuh), taken by prefill_fp8_ws_entry's
// launch where prefill_tma_enabled, prefill_fp8_tma_applies and the driver encodes the maps (else
// its cp.async producer). Host checks (no driver call): an e4m3 pool without an SWA slot map, pages
// of at least 8 slots, p.kv_rows known and below 2^31, K / V base and row strides 16-byte aligned
// (rows of bytes), head dim 128.
inline constexpr int kFp8TmaHeadDim = 128;
struct WsTensorMaps;
bool prefill_fp8_tma_applies(const AttnParams& p);
// The tensor maps of that launch (prefill_ws_sync.cuh): the K and V pools as bytes {128, kv heads,
// slots}, boxes of min(page, 128) slots, and q's 16-bit map where prefill_q_tma_applies
// (maps->q_tma); false (the cp.async producer) where it does not take the TMA producer.
bool prefill_fp8_tma_maps(const AttnParams& p, bool fp16, WsTensorMaps* maps);
// Whether that launch takes the TMA producer, and Q by TMA with it.
bool prefill_fp8_ws_uses_tma(const AttnParams& p, bool fp16);
bool prefill_fp8_ws_q_by_tma(const AttnParams& p, bool fp16);

}  // namespace attnrt::cuda
