// The scans of index_scan.h for every Highway target, chosen at run time: int64 compares have no
// SSE2 form, so the baseline build would run them one element at a time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/core/index_scan.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "src/core/index_scan.h"

HWY_BEFORE_NAMESPACE();
namespace attnrt::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

bool AllInRange(const int64_t* HWY_RESTRICT x, size_t n, int64_t bound) {
  const hn::ScalableTag<int64_t> d;
  const size_t lanes = hn::Lanes(d);
  auto lo = hn::Set(d, 0), hi = hn::Set(d, bound - 1);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto v = hn::LoadU(d, x + i);
    lo = hn::Min(lo, v);
    hi = hn::Max(hi, v);
  }
  int64_t min = hn::GetLane(hn::MinOfLanes(d, lo)), max = hn::GetLane(hn::MaxOfLanes(d, hi));
  for (; i < n; ++i) {
    min = x[i] < min ? x[i] : min;
    max = x[i] > max ? x[i] : max;
  }
  return min >= 0 && max < bound;
}

bool AllOffset(const int64_t* HWY_RESTRICT x, const int32_t* HWY_RESTRICT y, int64_t d64,
               size_t n) {
  const hn::ScalableTag<int64_t> d;
  const hn::Rebind<int32_t, decltype(d)> d32;
  const size_t lanes = hn::Lanes(d);
  const auto off = hn::Set(d, d64);
  auto diff = hn::Zero(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto want = hn::Add(hn::PromoteTo(d, hn::LoadU(d32, y + i)), off);
    diff = hn::Or(diff, hn::Xor(hn::LoadU(d, x + i), want));
  }
  bool ok = hn::AllTrue(d, hn::Eq(diff, hn::Zero(d)));
  for (; i < n; ++i) ok &= x[i] == y[i] + d64;
  return ok;
}

bool AllCountUp(const int64_t* HWY_RESTRICT x, const int64_t* HWY_RESTRICT start,
                const int32_t* HWY_RESTRICT base, const int32_t* HWY_RESTRICT len, size_t runs) {
  const hn::ScalableTag<int64_t> d;
  const auto lanes = static_cast<int32_t>(hn::Lanes(d));
  const auto iota = hn::Iota(d, 0);
  auto diff = hn::Zero(d);
  int64_t tail = 0;
  for (size_t r = 0; r < runs; ++r) {
    const int64_t* row = x + start[r];
    const int64_t b = base[r];
    const int32_t q = len[r];
    int32_t t = 0;
    for (; t + lanes <= q; t += lanes) {
      diff = hn::Or(diff, hn::Xor(hn::LoadU(d, row + t), hn::Add(iota, hn::Set(d, b + t))));
    }
    for (; t < q; ++t) tail |= row[t] ^ (b + t);
  }
  return tail == 0 && hn::AllTrue(d, hn::Eq(diff, hn::Zero(d)));
}

}  // namespace attnrt::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attnrt {

HWY_EXPORT(AllInRange);
HWY_EXPORT(AllOffset);
HWY_EXPORT(AllCountUp);

bool all_in_range(const int64_t* x, size_t n, int64_t bound) {
  return HWY_DYNAMIC_DISPATCH(AllInRange)(x, n, bound);
}

bool all_offset(const int64_t* x, const int32_t* y, int64_t d, size_t n) {
  return HWY_DYNAMIC_DISPATCH(AllOffset)(x, y, d, n);
}

bool all_count_up(const int64_t* x, const int64_t* start, const int32_t* base, const int32_t* len,
                  size_t runs) {
  return HWY_DYNAMIC_DISPATCH(AllCountUp)(x, start, base, len, runs);
}

}  // namespace attnrt
#endif  // HWY_ONCE
