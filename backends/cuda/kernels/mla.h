// The absorbed-form MLA CTA (mla_decode.cu): DeepSeek-V3's latent cache on warpgroup MMAs.
#pragma once

#include <cuda.h>

#include <optional>

#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

// Entry points of the MLA CTA for `key` (bf16 q / out, bf16, e4m3 or e5m2 latent cache, head dims
// 576 / 512;
// every tile shape the plan gives MLA layers: decode, decode32, verify); empty for other keys.
AttnCtaEntry mla_attention_entry(const AttnKernelKey& key);
// The paired-tile MLA CTA (mla_pairs.cu) over a bf16 or fp8 latent for the items
// mla_attention_entry takes; empty for other keys. mla_attention_entry returns it unless
// ATTNRT_MLA_PAIRS=0 (read once).
AttnCtaEntry mla_pairs_entry(const AttnKernelKey& key);
bool mla_pairs_enabled();
void set_mla_pairs(bool on);
// The tensor map of a bf16 latent pool ({576, kv heads, slots}, boxes of 64 columns x box_rows
// slots, 128-byte swizzle; prefill_ws.cu encodes it): no slot map, 16-byte aligned rows, pages a
// multiple of box_rows. nullopt elsewhere, or where the driver cannot encode it.
std::optional<CUtensorMap> mla_latent_tensor_map(const AttnParams& p, int box_rows);
// The paired-tile CTA's two-CTA clusters at 128 heads (mla_pairs_mc_kernel): off unless
// ATTNRT_MLA_MC=1 (read once) or set_mla_pairs_mc (tests).
bool mla_pairs_mc_enabled();
void set_mla_pairs_mc(bool on);
// The largest page size at which an fp8 latent takes the paired-tile CTA (mla_decode.cu's CTA
// above): ATTNRT_MLA_FP8_PAIRS_MAX_PAGE, 128 (every page size) unless set (read once).
int mla_pairs_fp8_max_page();
// The largest page size at which the paired-tile CTA takes its page ids through shared memory
// (above it, in registers): ATTNRT_MLA_PAIRS_IDS_MAX_PAGE, 16 unless set (read once), or
// set_mla_pairs_ids_max_page (tests).
int mla_pairs_ids_max_page();
void set_mla_pairs_ids_max_page(int slots);
// The keys-on-M MLA CTA (mla_keys_m.cu) for items of at most 16 rows (the decode tile shape);
// empty for keys it does not take.
AttnCtaEntry mla_keys_m_entry(const AttnKernelKey& key);

// Whether the launches dispatch.h gives the MLA CTAs run them (the default) or the generic kernel
// instead (same plan, same partials: an A/B of the two in one binary): ATTNRT_MLA_CTA=0 in the
// environment, read once at the first launch unless set_mla_cta chose first. ATTNRT_MLA_CTA=64
// keeps the 64-row CTA for the decode items the keys-on-M CTA would take.
bool mla_cta_enabled();
bool mla_keys_m_enabled();
void set_mla_cta(bool on);

}  // namespace attnrt::cuda
