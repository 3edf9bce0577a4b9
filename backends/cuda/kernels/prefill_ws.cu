// The warp-specialised prefill CTA (prefill_ws.cuh): its run-time switches, the tensor maps of
// its TMA producer, and its instantiations (bf16 and fp16 at head dims 64, 128, 256, with and
// without the ping-pong, with the cp.async producer; with the TMA producer the default's choices
// only: 64 and 128 in ping-pong, 256 without), in one translation unit.
#include <cudaTypedefs.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <type_traits>

#include "attnrt/core/env.h"
#include "backends/cuda/kernels/mla.h"
#include "backends/cuda/kernels/prefill_ws.cuh"

namespace attnrt::cuda {
namespace {

// kWsUnread until the first read; then kWsAuto or a forced mode (0, 1, 2).
constexpr int kWsUnread = -2;
std::atomic<int> g_prefill_ws{kWsUnread};
// -1 until the first read; then 0 or 1.
std::atomic<int> g_prefill_tma{-1};

// The CTAs with a TMA-producer instantiation.
constexpr bool has_tma_variant(int head_dim, bool ping_pong) {
  return head_dim == 64 || head_dim == 128 ? ping_pong : head_dim == 256 && !ping_pong;
}

// cuTensorMapEncodeTiled through the runtime (the binary does not link the driver library; it
// must start where there is none), nullptr where the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // not sticky: the launch goes on with the cp.async producer
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// Everything one tensor map of a TMA producer encodes: a tensor of {dim, heads, rows} elements of
// `dtype` (16-bit, or UINT8 for the fp8 CTA's e4m3 pools; heads head_stride, rows row_stride
// elements apart), boxes of {128 bytes of elements (64 16-bit, 128 8-bit: one row of the 128-byte
// swizzle), box_heads, box_rows}. K and V: a pool, heads adjacent inside a row, one head a box.
// Q: the step's q, a GQA group of heads a box.
struct TensorMapKey {
  const void* base;
  int64_t rows, row_stride, head_stride;
  int32_t heads, dim, box_heads, box_rows;
  CUtensorMapDataType dtype;
  auto operator<=>(const TensorMapKey&) const = default;
};

CUtensorMapDataType map_dtype_16(bool fp16) {
  return fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// The encoded map of `key`, encoded once (a step's launches find their layer's maps here: a
// lookup instead of a driver call per launch); nullopt where the driver cannot encode it.
std::optional<CUtensorMap> tensor_map(const TensorMapKey& key) {
  // Two per layer and pool, one per q tensor; cleared when a process exceeds it.
  constexpr size_t kMaxMaps = 4096;
  static std::mutex mu;
  static std::map<TensorMapKey, CUtensorMap> maps;
  {
    const std::lock_guard lock(mu);
    const auto it = maps.find(key);
    if (it != maps.end()) return it->second;
  }
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return std::nullopt;
  CUtensorMap map;
  const int64_t elem_bytes = key.dtype == CU_TENSOR_MAP_DATA_TYPE_UINT8 ? 1 : 2;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(key.dim), static_cast<cuuint64_t>(key.heads),
                              static_cast<cuuint64_t>(key.rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(key.head_stride * elem_bytes),
                                 static_cast<cuuint64_t>(key.row_stride * elem_bytes)};  // bytes
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(128 / elem_bytes),
                             static_cast<cuuint32_t>(key.box_heads),
                             static_cast<cuuint32_t>(key.box_rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(&map, key.dtype, 3, const_cast<void*>(key.base), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return std::nullopt;
  const std::lock_guard lock(mu);
  if (maps.size() >= kMaxMaps) maps.clear();
  maps.emplace(key, map);
  return map;
}

// The K and V maps of a launch whose tiles hold `bn` keys (K rows of head_dim, V rows of
// v_head_dim per head; elements of kv, q's 16-bit type or UINT8 over an e4m3 pool), and its Q map
// where Q can come by TMA (q_tma): a unit's ROWS rows are
// whole tokens of one GQA group (group a power of two dividing ROWS; the items' f0 are multiples
// of ROWS), p.q_rows known, q and its strides 16-byte aligned. A box then holds ROWS / group
// tokens x group heads x 64 columns, in the rows' order (token major) and the tile's 128-byte
// swizzle; its tokens past the request are the next request's (rows the kernel computes but never
// stores; no 16-bit value makes them touch a stored row) and past q_rows zeros.
std::optional<WsTensorMaps> ws_tensor_maps(const AttnParams& p, int head_dim, int v_head_dim,
                                           int bn, bool fp16,
                                           std::optional<CUtensorMapDataType> kv = std::nullopt) {
  const int box_rows = std::min(1 << p.page_shift, bn);
  const CUtensorMapDataType kv_type = kv.value_or(map_dtype_16(fp16));
  const auto k = tensor_map(
      {p.k, p.kv_rows, p.k_row_stride, head_dim, p.num_kv_heads, head_dim, 1, box_rows, kv_type});
  const auto v = tensor_map({p.v, p.kv_rows, p.v_row_stride, v_head_dim, p.num_kv_heads, v_head_dim,
                             1, box_rows, kv_type});
  if (!k || !v) return std::nullopt;
  WsTensorMaps maps{};
  maps.k = *k;
  maps.v = *v;
  if (prefill_q_tma_applies(p)) {
    const int g = p.group;
    if (const auto q = tensor_map({p.q, p.q_rows, p.q_stride_tok, p.q_stride_head, p.num_q_heads,
                                   head_dim, g, kPrefillTileRows / g, map_dtype_16(fp16)})) {
      maps.q = *q;
      maps.q_tma = 1;
    }
  }
  return maps;
}

// The tensor maps of the TMA producer for this launch, or nullopt: the cp.async producer.
std::optional<WsTensorMaps> tma_maps(const AttnParams& p, int head_dim, bool fp16, bool ping_pong) {
  if (!prefill_tma_enabled() || !prefill_tma_applies(p, head_dim, ping_pong)) return std::nullopt;
  // Keys per tile of the CTAs with a TMA instantiation.
  const int bn = head_dim == 256 ? PrefillWsCfg<256, false>::kBN : PrefillWsCfg<128, true>::kBN;
  static_assert(PrefillWsCfg<64, true>::kBN == PrefillWsCfg<128, true>::kBN);
  return ws_tensor_maps(p, head_dim, head_dim, bn, fp16);
}

// The warp-specialised CTA for activations T at head dim D: the TMA producer where it has an
// instance and applies, else the cp.async one (the two take the same threads and shared memory).
template <typename T, int D, bool PP>
struct WsCta {
  using Cfg = PrefillWsCfg<D, PP>;
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey&, int num_items,
                            cudaStream_t stream, bool) {
    constexpr bool fp16 = std::is_same_v<T, __half>;
    if constexpr (has_tma_variant(D, PP)) {
      if (const auto maps = tma_maps(p, D, fp16, PP)) {
        if (maps->q_tma)
          return launch_prefill_ws_cfg<T, Cfg, true, true>(p, *maps, num_items,
                                                           prefill_ws_persistent(), stream);
        return launch_prefill_ws_cfg<T, Cfg, true>(p, *maps, num_items, prefill_ws_persistent(),
                                                   stream);
      }
    }
    return launch_prefill_ws_cfg<T, Cfg, false>(p, WsTensorMaps{}, num_items,
                                                prefill_ws_persistent(), stream);
  }
  static int occupancy(const AttnKernelKey&) {
    return resident_ctas<prefill_ws_kernel<T, Cfg, false>>(Cfg::kThreads, Cfg::kSmemBytes);
  }
};

template <int D, bool PP>
AttnCtaEntry ws_entry(bool fp16) {
  return fp16 ? AttnCtaEntry{&WsCta<__half, D, PP>::launch, &WsCta<__half, D, PP>::occupancy}
              : AttnCtaEntry{&WsCta<__nv_bfloat16, D, PP>::launch,
                             &WsCta<__nv_bfloat16, D, PP>::occupancy};
}

template <int D>
AttnCtaEntry ws_entry_dim(bool fp16, bool ping_pong) {
  return ping_pong ? ws_entry<D, true>(fp16) : ws_entry<D, false>(fp16);
}

// MLA's MHA form (p.kv_ragged: contiguous K / V rows per request): the TMA producer, whole tiles of
// the model's k / v tensors by tensor-map copies, where the maps can be encoded (16-byte aligned
// rows, the switch on), else the cp.async producer.
template <typename T, typename Cfg>
struct WsMlaCta {
  static cudaError_t launch(const AttnParams& p, const AttnKernelKey&, int num_items,
                            cudaStream_t stream, bool) {
    constexpr bool fp16 = std::is_same_v<T, __half>;
    const auto aligned = [](const void* ptr) {
      return ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
    };
    static_assert(Cfg::kBN == 128);
    if (prefill_tma_enabled() && p.kv_ragged && p.page_shift == 7 &&
        p.kv_rows > 0 && p.kv_rows <= INT_MAX && aligned(p.k) && aligned(p.v) &&
        p.k_row_stride % 8 == 0 && p.v_row_stride % 8 == 0) {
      if (const auto maps =
              ws_tensor_maps(p, Cfg::kHeadDim, Cfg::kVHeadDim, Cfg::kBN, fp16))
        return launch_prefill_ws_cfg<T, Cfg, true>(p, *maps, num_items, prefill_ws_persistent(),
                                                   stream);
    }
    return launch_prefill_ws_cfg<T, Cfg, false>(p, WsTensorMaps{}, num_items,
                                                prefill_ws_persistent(), stream);
  }
  static int occupancy(const AttnKernelKey&) {
    return resident_ctas<prefill_ws_kernel<T, Cfg, false>>(Cfg::kThreads, Cfg::kSmemBytes);
  }
};

}  // namespace

template <typename Cfg>
AttnCtaEntry mla_entry(bool fp16) {
  return fp16 ? AttnCtaEntry{&WsMlaCta<__half, Cfg>::launch, &WsMlaCta<__half, Cfg>::occupancy}
              : AttnCtaEntry{&WsMlaCta<__nv_bfloat16, Cfg>::launch,
                             &WsMlaCta<__nv_bfloat16, Cfg>::occupancy};
}

// The consumers' schedule of the MHA-form CTA: 0 (the default) free-running, 1 ping-pong. H200,
// TMA producer, tiles of 128 keys in 2 stages: mla-prefill-1x16384 561 TFLOP/s free-running, 499
// in ping-pong (a stage is held a tile longer there, and 2 stages are all that fit at 192 + 128
// columns); 64-key tiles in 4 stages: 488 and 512.
bool mla_mha_ping_pong() {
  static const bool pp =
      env_integer("ATTNRT_MLA_MHA_CTA", 0, 1, "cuda backend",
                  "0 (the MHA-form CTA's consumers free-running) or 1 (in ping-pong)")
          .value_or(0) != 0;
  return pp;
}

int mla_mha_tile_shift() { return 7; }

AttnCtaEntry prefill_mla_mha_entry(bool fp16) {
  return mla_mha_ping_pong() ? mla_entry<PrefillWsMlaCfg<128, 2, true>>(fp16)
                             : mla_entry<PrefillWsMlaCfg<128, 2, false>>(fp16);
}

int prefill_ws_mode() {
  int v = g_prefill_ws.load(std::memory_order_relaxed);
  if (v == kWsUnread) {
    const auto env = env_integer("ATTNRT_PREFILL_WS", kWsAuto, 2, "cuda backend",
                                 "-1 (the plan chooses), 0 (the default prefill CTA), 1 (the "
                                 "warp-specialised CTA) or 2 (it with the ping-pong schedule)");
    v = env ? static_cast<int>(*env) : kWsAuto;
    int expected = kWsUnread;
    // A concurrent set_prefill_ws_mode wins over the environment.
    if (!g_prefill_ws.compare_exchange_strong(expected, v)) v = expected;
  }
  return v;
}

void set_prefill_ws_mode(int mode) {
  g_prefill_ws.store(mode >= kWsAuto && mode <= 2 ? mode : kWsAuto);
}

bool prefill_ws_persistent() {
  static const bool on = env_integer("ATTNRT_PREFILL_WS_PERSISTENT", 0, 1, "cuda backend",
                                     "1 (one CTA per SM walks the work items) or 0 (one CTA per "
                                     "work item)")
                             .value_or(1) != 0;
  return on;
}

bool prefill_tma_enabled() {
  int v = g_prefill_tma.load(std::memory_order_relaxed);
  if (v < 0) {
    const auto env = env_integer("ATTNRT_PREFILL_TMA", 0, 1, "cuda backend",
                                 "1 (the prefill CTA loads whole K/V pages by tensor-map copies "
                                 "where it can) or 0 (cp.async copies everywhere)");
    v = env ? static_cast<int>(*env) : 1;
    int expected = -1;
    // A concurrent set_prefill_tma wins over the environment.
    if (!g_prefill_tma.compare_exchange_strong(expected, v)) v = expected;
  }
  return v != 0;
}

void set_prefill_tma(bool on) { g_prefill_tma.store(on ? 1 : 0); }

namespace {

// The pool conditions of both TMA producers: K / V rows of `dim` elements a head, 16 bytes being
// `chunk` elements (8 16-bit, 16 e4m3), no SWA slot map or tree mask, pages of 8 slots or more,
// the pool's rows known and below 2^31, the bases and row strides 16-byte aligned.
bool pool_tma_applies(const AttnParams& p, int dim, int chunk) {
  const auto aligned = [](const void* ptr) {
    return ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  };
  return p.slot_map == nullptr && p.tree == 0 && p.page_shift >= 3 && p.kv_rows > 0 &&
         p.kv_rows <= INT_MAX && p.num_kv_heads > 0 && aligned(p.k) && aligned(p.v) &&
         p.k_row_stride % chunk == 0 && p.v_row_stride % chunk == 0 &&
         p.k_row_stride >= int64_t{p.num_kv_heads} * dim &&
         p.v_row_stride >= int64_t{p.num_kv_heads} * dim;
}

}  // namespace

std::optional<CUtensorMap> mla_latent_tensor_map(const AttnParams& p, int box_rows) {
  const int page = 1 << p.page_shift;
  const bool applies = p.slot_map == nullptr && p.kv_kind == KvKind::same_as_q && box_rows > 0 &&
                       box_rows <= 256 && page % box_rows == 0 && p.kv_rows > 0 &&
                       p.kv_rows <= INT_MAX && p.num_kv_heads > 0 && p.k != nullptr &&
                       reinterpret_cast<uintptr_t>(p.k) % 16 == 0 && p.k_row_stride % 8 == 0 &&
                       p.k_row_stride >= int64_t{p.num_kv_heads} * kMlaHeadDim;
  if (!applies) return std::nullopt;
  return tensor_map({p.k, p.kv_rows, p.k_row_stride, kMlaHeadDim, p.num_kv_heads, kMlaHeadDim, 1,
                     box_rows, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16});
}

bool prefill_tma_applies(const AttnParams& p, int head_dim, bool ping_pong) {
  return has_tma_variant(head_dim, ping_pong) && p.kv_kind == KvKind::same_as_q &&
         pool_tma_applies(p, head_dim, 8);
}

bool prefill_q_tma_applies(const AttnParams& p) {
  const int g = p.group;
  return p.q_rows > 0 && p.q_rows <= INT_MAX && g > 0 && (g & (g - 1)) == 0 &&
         g <= kPrefillTileRows && g * int64_t{p.num_kv_heads} == p.num_q_heads &&
         reinterpret_cast<uintptr_t>(p.q) % 16 == 0 && p.q_stride_tok % 8 == 0 &&
         p.q_stride_head % 8 == 0;
}

bool prefill_ws_q_by_tma(const AttnParams& p, int head_dim, bool fp16, bool ping_pong) {
  const auto maps = tma_maps(p, head_dim, fp16, ping_pong);
  return maps && maps->q_tma != 0;
}

bool prefill_ws_uses_tma(const AttnParams& p, int head_dim, bool fp16, bool ping_pong) {
  return tma_maps(p, head_dim, fp16, ping_pong).has_value();
}

bool prefill_fp8_tma_applies(const AttnParams& p) {
  return p.kv_kind == KvKind::e4m3 && pool_tma_applies(p, kFp8TmaHeadDim, 16);
}

bool prefill_fp8_tma_maps(const AttnParams& p, bool fp16, WsTensorMaps* maps) {
  if (!prefill_tma_enabled() || !prefill_fp8_tma_applies(p)) return false;
  // The fp8 CTA's tiles: 128 keys (PrefillFp8WsConfig::kBN, not visible from this unit).
  const auto m =
      ws_tensor_maps(p, kFp8TmaHeadDim, kFp8TmaHeadDim, 128, fp16, CU_TENSOR_MAP_DATA_TYPE_UINT8);
  if (!m) return false;
  *maps = *m;
  return true;
}

bool prefill_fp8_ws_uses_tma(const AttnParams& p, bool fp16) {
  WsTensorMaps maps;
  return prefill_fp8_tma_maps(p, fp16, &maps);
}

bool prefill_fp8_ws_q_by_tma(const AttnParams& p, bool fp16) {
  WsTensorMaps maps;
  return prefill_fp8_tma_maps(p, fp16, &maps) && maps.q_tma != 0;
}

AttnCtaEntry prefill_ws_entry(int head_dim, bool fp16, bool ping_pong) {
  switch (head_dim) {
    case 64:
      return ws_entry_dim<64>(fp16, ping_pong);
    case 128:
      return ws_entry_dim<128>(fp16, ping_pong);
    case 256:
      return ws_entry_dim<256>(fp16, ping_pong);
    default:
      return {};
  }
}

}  // namespace attnrt::cuda
