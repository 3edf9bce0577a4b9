// SIMD attention kernels of the cpu backend, compiled once per Highway target (foreach_target) and
// chosen at run time (HWY_DYNAMIC_DISPATCH). This file holds the entry points of
// attention_kernels.h: the work loop over a plan's items and merges (OpenMP), the log-sum-exp merge
// of split key ranges, and the conversions the tests use.
//
// Two kernels share one work list:
// - single-query items (decode, the decode rows of MIXED) keep head_dim in the vector lanes: each
//   K/V row is loaded and widened once, in registers, and used by every query head of its GQA
//   group (decode_kernel.cc; fp8 rows on the dot-product path: fp8_dot-inl.h);
// - multi-query items (extend, verify, draft extend) are flash-style tiles that put query rows
//   (tokens x heads of a group) in the lanes: S^T = K Q^T and O^T += V^T P^T are register-blocked
//   outer products, the online softmax runs lane-wise with no horizontal reductions, and each
//   block of K/V rows is widened to fp32 once for the whole tile (tile_kernel.cc).
// Both accumulate in fp32 and produce an unnormalised state (acc, running max m, sum l) that is
// either finished in place or merged across key splits by log-sum-exp. What they share (loading
// K/V, scratch, finishing rows, the bf16 dot-product probe) is in kernel_common-inl.h.

#include <omp.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "attnrt/core/error.h"
#include "backends/cpu/kernels/attention_kernels.h"
#include "backends/cpu/kernels/item_kernels.h"
#include "backends/cpu/kernels/hwy_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/kernels/attention_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "backends/cpu/kernels/kernel_common-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attnrt::cpu {
namespace HWY_NAMESPACE {

// ------------------------------------------------------------------------------------------------
// Merging the partial states of a split row set by log-sum-exp.

void MergeRows(const LayerArgs& a, const KernelPlan& p, const MergeItem& mi, int kv_head) {
  const WorkItem& first = p.items[mi.first_item];
  const RequestInfo& r = p.reqs[first.req];
  const int ng = first.g1 - first.g0;
  const int nrows = (first.t1 - first.t0) * ng;
  const int group = a.num_q_heads / a.num_kv_heads;
  const RowMap rows{r.q_row, first.t0, first.g0, ng, group, kv_head};
  const int vdim = a.v_head_dim;
  float* acc = t_scratch.get(static_cast<size_t>(vdim));
  for (int i = 0; i < nrows; ++i) {
    float m = kNegInf;
    for (int s = 0; s < mi.num_items; ++s) {
      m = std::max(m, Part(a, p, p.items[mi.first_item + s], kv_head).m[i]);
    }
    std::fill(acc, acc + vdim, 0.f);
    float l = 0.f;
    if (m != kNegInf) {
      for (int s = 0; s < mi.num_items; ++s) {
        const PartView part = Part(a, p, p.items[mi.first_item + s], kv_head);
        if (part.m[i] == kNegInf) continue;
        const float w = std::exp(part.m[i] - m);
        l += w * part.l[i];
        const float* src = part.acc + static_cast<int64_t>(i) * vdim;
        for (int d = 0; d < vdim; ++d) acc[d] += w * src[d];
      }
    }
    WriteRow(a, rows, i, acc, 1, m, l);
  }
}

// ------------------------------------------------------------------------------------------------
// The work loop: every item for every kv head, then the merges, on OpenMP threads.

void RunItem(const LayerArgs& a, const KernelPlan& p, const WorkItem& it, int kv_head, bool dot) {
  if (!it.tile) {
    // One task covers every kv head (see decode_kernel.cc); the plan counts it that way.
    if (kv_head != 0) return;
    run_decode_item(a, p, it, dot);
    return;
  }
  run_tile_item(a, p, it, kv_head, dot);
}

template <DType DT>
void RunAll(const LayerArgs& args, const KernelPlan& p) {
  LayerArgs a = args;
  a.qk_scale *= kLoadFactor<DT>;
  a.v_scale *= kLoadFactor<DT>;
  // bf16 dot products where q, K/V and the output are all bf16: the output's rounding dominates
  // the bf16 probabilities' error.
  // fp8 K/V: the single-query kernel widens them to bf16 (exactly) for the same dot products.
  const bool bf16_io = a.q_dtype == DType::bf16 && a.out_dtype == DType::bf16;
  const bool dot = bf16_io && ((DT == DType::bf16 && a.head_dim % 2 == 0 && HasBf16Dot()) ||
                               ((DT == DType::e4m3 || DT == DType::e5m2) && HasFp8Dot()));
  const int64_t heads = a.num_kv_heads;
  const int64_t work = p.num_items * heads;
  const int64_t merges = p.num_merges * heads;
#pragma omp parallel num_threads(p.num_threads) if (p.num_threads > 1 && work > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < work; ++w) {
      RunItem(a, p, p.items[w / heads], static_cast<int>(w % heads), dot);
    }
#pragma omp for schedule(dynamic, 4)
    for (int64_t w = 0; w < merges; ++w) {
      MergeRows(a, p, p.merges[w / heads], static_cast<int>(w % heads));
    }
  }
}

void RunAttention(const LayerArgs& a, const KernelPlan& p) {
  WithKvType(a.kv_dtype, [&](auto kv) { RunAll<decltype(kv)::value>(a, p); });
}

int TileRows() { return kWideTile * static_cast<int>(hn::Lanes(DF())); }

int WideTileRows() { return kLatentTile * static_cast<int>(hn::Lanes(DF())); }

std::string TargetName() {
  std::string name = hwy::TargetName(HWY_TARGET);
  if (HasBf16Dot()) name += "+BF16";
  return name;
}

void ConvertToFloat(DType dtype, const void* src, int64_t n, float* dst) {
  const int count = static_cast<int>(n);
  if (dtype == DType::e4m3) {
    ConvertRow<DType::e4m3>(static_cast<const uint8_t*>(src), count, dst);
    for (int i = 0; i < count; ++i) dst[i] *= kLoadFactor<DType::e4m3>;
    return;
  }
  switch (dtype) {
    case DType::f32: return ConvertRow<DType::f32>(static_cast<const float*>(src), count, dst);
    case DType::f16:
      return ConvertRow<DType::f16>(static_cast<const hwy::float16_t*>(src), count, dst);
    case DType::bf16:
      return ConvertRow<DType::bf16>(static_cast<const hwy::bfloat16_t*>(src), count, dst);
    case DType::e5m2: return ConvertRow<DType::e5m2>(static_cast<const uint8_t*>(src), count, dst);
    default: break;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace attnrt::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attnrt::cpu {

HWY_EXPORT(RunAttention);
HWY_EXPORT(TileRows);
HWY_EXPORT(WideTileRows);
HWY_EXPORT(TargetName);
HWY_EXPORT(ConvertToFloat);

void run_attention(const LayerArgs& args, const KernelPlan& plan) {
  HWY_DYNAMIC_DISPATCH(RunAttention)(args, plan);
}

int tile_rows() { return HWY_DYNAMIC_DISPATCH(TileRows)(); }

int wide_tile_rows() { return HWY_DYNAMIC_DISPATCH(WideTileRows)(); }

std::vector<std::string> simd_target_names() {
  std::vector<std::string> names;
  for (const int64_t t : hwy::SupportedAndGeneratedTargets()) {
    std::string n = hwy::TargetName(t);
    std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
    names.push_back(std::move(n));
  }
  return names;
}

void choose_simd_target() {
  // Once per process, before the first dispatch reads the choice (a failed choice is not kept:
  // every later call raises the same error).
  static const bool chosen = [] {
    const char* v = std::getenv("ATTNRT_CPU_SIMD");
    if (v == nullptr || *v == '\0') return true;
    std::string want = v;
    std::transform(want.begin(), want.end(), want.begin(),
                   [](unsigned char c) { return std::tolower(c); });
    const std::vector<std::string> names = simd_target_names();
    const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
    for (size_t i = 0; i < names.size(); ++i) {
      // Highway takes the lowest target bit it may: disabling every bit below this one leaves it.
      if (names[i] == want) {
        hwy::DisableTargets(targets[i] - 1);
        return true;
      }
    }
    fail("cpu backend: ATTNRT_CPU_SIMD={} is not a SIMD target of this build on this CPU; use one "
         "of {} (or unset it for the best: {})",
         v, fmt::join(names, ", "), names.empty() ? "none" : names.front());
  }();
  (void)chosen;
}

std::string simd_target_name() {
  try {
    choose_simd_target();
  } catch (const Error& e) {
    return std::string("none (") + e.what() + ")";  // a backend being built raises it
  }
  return HWY_DYNAMIC_DISPATCH(TargetName)();
}

void convert_to_float(DType dtype, const void* src, int64_t n, float* dst) {
  HWY_DYNAMIC_DISPATCH(ConvertToFloat)(dtype, src, n, dst);
}

// Every target folds the same factor (KvElem<e4m3>::kFactor), so the static target's value holds.
float kernel_load_factor(DType dtype) {
  return dtype == DType::e4m3 ? HWY_NAMESPACE::kLoadFactor<DType::e4m3> : 1.f;
}

}  // namespace attnrt::cpu
#endif  // HWY_ONCE
