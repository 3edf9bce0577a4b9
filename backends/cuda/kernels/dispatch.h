// Which CTA runs an attention launch: the one table that the plan's tile shape, the launch
// (launch_attention) and the occupancy query the plan's splits read (attention_occupancy) all go
// through, so that what is measured for the plan is what runs. Plain C++: the host plan includes
// it without CUDA.
//
// rows per request and KV head -> TileShape (choose_shape) -> AttnCta (attention_cta) -> the CTA's
// entry points (attention_dispatch.cu).
#pragma once

#include <cstdint>

#include "backends/cuda/kernels/attention_params.h"

namespace attnrt::cuda {

// MLA's absorbed form (DeepSeek-V3): qk columns (512 latent + 64 rope), V columns (the first 512 of
// the same latent row), and the query rows of the MLA CTA (mla_decode.cu).
inline constexpr int kMlaHeadDim = 576;
inline constexpr int kMlaVHeadDim = 512;
inline constexpr int kMlaTileRows = 64;
// MLA's MHA form (prefill / extend, docs/mla.md): q / k columns (128 nope + 64 rope) and v columns
// per q head, on the 128-row warp-specialised prefill CTA (prefill_mla_mha_entry).
inline constexpr int kMlaMhaHeadDim = 192;
inline constexpr int kMlaMhaVHeadDim = 128;

// Up to 16 (token, head-in-group) rows per request: decode tiles; 17..32 rows: one decode32 CTA;
// 33..64 rows: one verify CTA; more: prefill tiles. Each K/V tile is read once per request and KV
// head (16-bit KV at head dims 64 and 128 runs decode32 and verify on the 64-row warpgroup-MMA
// CTA). On the H200 at group 4 with 64 x 4096 prefixes: the 8-token chain (32 rows) took 0.596 ms
// on two decode CTAs (each streaming the K/V), 0.364 ms on the mma.sync decode32 CTA and 0.317 ms
// on the warpgroup-MMA one (decode 0.296 ms); the 16-token tree (64 rows) 0.807 / 0.518 / 0.467 ms
// on mma.sync verify CTAs and 0.321 ms on the warpgroup-MMA one.
//
// MLA layers (is_mla_dims) never take the prefill shape: the MLA CTA holds 64 rows, so longer
// requests are cut into 64-row verify items, each reading the request's latent tiles.
constexpr bool is_mla_dims(int head_dim, int v_head_dim) {
  return head_dim == kMlaHeadDim && v_head_dim == kMlaVHeadDim;
}
constexpr TileShape choose_shape(int max_qlen, int group, int head_dim) {
  const int64_t rows = static_cast<int64_t>(max_qlen) * group;
  return rows <= 16   ? TileShape::decode
         : rows <= 32 ? TileShape::decode32
         : rows <= 64 || head_dim == kMlaHeadDim ? TileShape::verify
                                                  : TileShape::prefill;
}

// Dims with tensor-core kernels (attention.cuh, decode_keys_m.cuh, prefill.cuh); every other
// shape (MLA's 576 / 512 among them) runs the generic SIMT kernel (attention_generic.cu).
constexpr bool has_tensor_core_kernel(int head_dim, int v_head_dim) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && v_head_dim == head_dim;
}

// Head dims of the 64-row warpgroup-MMA CTA (prefill.cuh) for verify and decode32 tiles.
constexpr bool prefill_verify_dim(int head_dim) { return head_dim == 64 || head_dim == 128; }

// Most rows of a decode work item that the keys-on-M CTA (decode_keys_m.cuh, head dims 64 and
// 128) takes: one decode token at GQA groups up to 8.
inline constexpr int kKeysMRows = 8;

// What picks the CTA of a launch.
struct AttnKernelKey {
  int head_dim = 0;
  int v_head_dim = 0;
  bool fp16 = false;  // q / out (and 16-bit KV) fp16, else bf16
  KvKind kv = KvKind::same_as_q;
  TileShape shape = TileShape::decode;
  int rows = 16;               // most (token, head-in-group) rows of a work item
  bool target_verify = false;  // a TARGET_VERIFY step (tree masks)
  // Prefill items over an e4m3 pool on the fp8 tensor cores (Options::fp8_prefill_attention).
  bool fp8_prefill = false;
};

// Whether the fp8 prefill CTA (prefill_fp8.cuh) takes a key's prefill items: asked for, e4m3 KV,
// head dim 128 (its one instantiation), no tree mask.
constexpr bool fp8_prefill_takes(const AttnKernelKey& k) {
  return k.fp8_prefill && k.kv == KvKind::e4m3 && k.head_dim == 128 && k.v_head_dim == 128 &&
         k.shape == TileShape::prefill && !k.target_verify;
}

// Whether the warp-specialised CTA over fp8 pages (prefill_ws.cuh with PrefillWsKv8Config) takes a
// key's prefill items: e4m3 or e5m2 KV, head dim 64, 128 or 256 (its instantiations, K and V of
// one width), no tree mask. It computes at 16-bit precision (f16 MMAs; K and V are exact in f16).
constexpr bool prefill_kv8_takes(const AttnKernelKey& k) {
  return (k.kv == KvKind::e4m3 || k.kv == KvKind::e5m2) &&
         (k.head_dim == 64 || k.head_dim == 128 || k.head_dim == 256) &&
         k.v_head_dim == k.head_dim && k.shape == TileShape::prefill && !k.target_verify;
}

enum class AttnCta : int32_t {
  generic,         // attention_generic.cu: dims without tensor-core kernels
  mla,             // mla_decode.cu: MLA's 576 / 512, bf16 q, bf16 or fp8 latent, 64 rows
  mla_keys_m,      // mla_keys_m.cu: the same for items of at most 16 rows, keys as the MMA's M
  prefill,         // prefill.cuh / prefill_ws.cuh: 128 rows, warpgroup MMAs, 16-bit KV, no tree
  prefill_verify,  // prefill.cuh: 64 rows, warpgroup MMAs, 16-bit KV (verify, decode32 tiles)
  keys_m,          // decode_keys_m.cuh: decode items of at most kKeysMRows rows
  decode,          // attention.cuh, mma.sync: the CTA of each tile shape
  decode32,
  verify,
  mma_prefill,
  fp8_prefill,  // prefill_fp8.cuh: 128 rows, fp8 warpgroup MMAs over an e4m3 pool (opt-in)
  prefill_kv8,  // prefill_ws.cuh over fp8 pages: 128 rows, f16 warpgroup MMAs, e4m3 / e5m2 KV
};

// The table. Prefill tiles: the warpgroup-MMA CTA for 16-bit KV in every mode but TARGET_VERIFY
// (its 128-row CTA carries no tree mask); for fp8 KV at head dims 64, 128, 256 (prefill_kv8_takes) the same
// warp-specialised CTA over fp8 pages, converting them to f16 (H100, prefill-1x16384 over an e4m3
// cache on the mma.sync CTA before it: 83 TFLOP/s, against 516 for the bf16 cache); else
// mma.sync. Verify and decode32 tiles: the 64-row warpgroup-MMA CTA for 16-bit KV at head dims 64
// and 128 (a decode32 item holds every row, at most 32, of its request from f0 = 0, so the 64-row
// CTA covers it with its rows past the request idle; H200, 64 x (4096 + 8) chain at group 4: 0.344
// ms on decode32, 0.317 ms there), else mma.sync. Decode tiles: the keys-on-M CTA at head dims 64
// and 128 when the items hold at most kKeysMRows rows (H200, 64 x 4096 at group 4, per step: bf16
// 277 -> 266 us, fp8 e4m3 280 -> 181 us), else mma.sync. MLA layers (bf16 q; bf16 or fp8 latent)
// run the keys-on-M MLA CTA on decode items (at most 16 rows: 16 heads or fewer) and the 64-row MLA
// CTA on the others (choose_shape gives them no prefill items). With fp8_prefill set, prefill
// items that fp8_prefill_takes run the fp8 CTA (q and P in e4m3: a documented tolerance, hence
// opt-in). ATTNRT_PREFILL_KV8=0 sends prefill_kv8's items to mma_prefill (attention_dispatch.cu's
// effective_attention_cta, which the launch and `info --explain` read).
constexpr AttnCta attention_cta(const AttnKernelKey& k) {
  if (is_mla_dims(k.head_dim, k.v_head_dim) && !k.fp16 && k.shape != TileShape::prefill)
    return k.shape == TileShape::decode ? AttnCta::mla_keys_m : AttnCta::mla;
  if (!has_tensor_core_kernel(k.head_dim, k.v_head_dim)) return AttnCta::generic;
  const bool fp8 = k.kv != KvKind::same_as_q;
  if (fp8_prefill_takes(k)) return AttnCta::fp8_prefill;
  if (prefill_kv8_takes(k)) return AttnCta::prefill_kv8;
  switch (k.shape) {
    case TileShape::prefill:
      return !fp8 && !k.target_verify ? AttnCta::prefill : AttnCta::mma_prefill;
    case TileShape::verify:
      return !fp8 && prefill_verify_dim(k.head_dim) ? AttnCta::prefill_verify : AttnCta::verify;
    case TileShape::decode32:
      return !fp8 && prefill_verify_dim(k.head_dim) ? AttnCta::prefill_verify : AttnCta::decode32;
    case TileShape::decode:
      break;
  }
  return k.head_dim <= 128 && k.rows <= kKeysMRows ? AttnCta::keys_m : AttnCta::decode;
}

// Whether a CTA may be launched as the dependent of the step's KV-store kernels (it reads only
// the work list, the requests and q before its wait): the mma.sync, keys-on-M and 64-row
// warpgroup-MMA CTAs. The 128-row prefill CTAs and the generic CTA are plain launches.
constexpr bool launches_as_dependent(AttnCta cta) {
  return cta != AttnCta::generic && cta != AttnCta::prefill && cta != AttnCta::fp8_prefill &&
         cta != AttnCta::prefill_kv8;
}

}  // namespace attnrt::cuda
