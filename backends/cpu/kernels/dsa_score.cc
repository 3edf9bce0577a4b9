// The index scores of DSA layers (dsa_score.h), compiled once per Highway target. Per query token
// the scores are a product [heads x dim] . [dim x keys] followed by relu and a weighted sum over
// heads, so they run as a register-blocked outer product: index heads in the vector lanes (the
// queries are stored transposed, [dim][heads], once per token), keys broadcast one element at a
// time from a small block dequantised to fp32 (12 keys on AVX-512: 2 head vectors x 12 keys = 24
// accumulators; 6 keys on 16-register targets). Every key block is dequantised once for all query
// tokens of the call (a block of prefill or chain-verify tokens sharing their candidates). The
// epilogue takes relu per lane, widens to fp64 and multiplies by the head weights with fp64 FMAs,
// so the sum over heads is fp64 as in the reference (docs/dsa.md); only the order of the fp32
// additions within a dot differs from the scalar loop it replaces.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attnrt/core/dtype.h"
#include "backends/cpu/kernels/dsa_score.h"
#include "backends/cpu/kernels/hwy_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/kernels/dsa_score.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "backends/cpu/kernels/kernel_common-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attnrt::cpu {
namespace HWY_NAMESPACE {

// Keys per register tile: with two head vectors, 24 accumulators of the 32 AVX-512 registers,
// 12 of 16 elsewhere (the rest hold the query vectors and the broadcast key element).
constexpr int kDsaKeys = HWY_TARGET <= HWY_AVX3 ? 12 : 6;
static_assert(kDsaHeadAlign % hn::MaxLanes(DF()) == 0, "padded heads fill whole vectors");

// kDsaKeys keys as fp32 rows, kf[kk * dim + d]: the e4m3 codes widened exactly (through fp16,
// value / 2^8; NaN codes stay NaN), times 2^8, times the key's scale: one rounding of the same
// product as e4m3_to_float(code) * scale. Tiles past n repeat the last key (their scores are
// dropped).
HWY_INLINE void DequantiseKeys(const IndexKeyView& keys, const int32_t* slots, int n, int dim,
                               float* kf) {
  const DF df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  const VF factor = hn::Set(df, KvElem<DType::e4m3>::kFactor);
  for (int kk = 0; kk < kDsaKeys; ++kk) {
    const int64_t slot = slots[std::min(kk, n - 1)];
    const uint8_t* codes = keys.codes(slot);
    const float ks = keys.scale(slot);
    const VF scale = hn::Set(df, ks);
    float* row = kf + static_cast<size_t>(kk) * dim;
    int d = 0;
    for (; d + lanes <= dim; d += lanes) {
      const VF v = KvElem<DType::e4m3>::Load(df, codes + d);
      hn::StoreU(hn::Mul(hn::Mul(v, factor), scale), df, row + d);
    }
    for (; d < dim; ++d) row[d] = e4m3_to_float(codes[d]) * ks;
  }
}

// The fp64 lanes the epilogue sums in: half as many as fp32 lanes (one on the scalar target).
#if HWY_TARGET == HWY_SCALAR
using DD = hn::Rebind<double, DF>;
#else
using DD = hn::Rebind<double, hn::Half<DF>>;
#endif

// sum + w[i] * r[i] for every fp32 lane i of r, in fp64 (exact products of the widened values).
HWY_INLINE hn::Vec<DD> AddWeighted(VF r, const double* w, hn::Vec<DD> sum) {
  const DD dd;
#if HWY_TARGET == HWY_SCALAR
  return hn::MulAdd(hn::LoadU(dd, w), hn::PromoteTo(dd, r), sum);
#else
  const hn::Half<DF> dh;
  sum = hn::MulAdd(hn::LoadU(dd, w), hn::PromoteTo(dd, hn::LowerHalf(dh, r)), sum);
  return hn::MulAdd(hn::LoadU(dd, w + hn::Lanes(dd)), hn::PromoteTo(dd, hn::UpperHalf(dh, r)),
                    sum);
#endif
}

// Adds sum_h w[h] * relu(<q[h], k_kk>) over kHV vectors of heads to tile[kk] for every key of the
// block. q points at the token's first head of the group in the [dim][heads] layout.
template <int kHV>
HWY_INLINE void ScoreTile(const float* q, int heads, const double* w, const float* kf, int dim,
                          double* tile) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF acc[kHV][kDsaKeys];
  for (int v = 0; v < kHV; ++v) {
    for (int kk = 0; kk < kDsaKeys; ++kk) acc[v][kk] = hn::Zero(df);
  }
  for (int d = 0; d < dim; ++d) {
    const float* qd = q + static_cast<size_t>(d) * heads;
    VF qv[kHV];
    for (int v = 0; v < kHV; ++v) qv[v] = hn::LoadU(df, qd + v * lanes);
    for (int kk = 0; kk < kDsaKeys; ++kk) {
      const VF k = hn::Set(df, kf[static_cast<size_t>(kk) * dim + d]);
      for (int v = 0; v < kHV; ++v) acc[v][kk] = hn::MulAdd(qv[v], k, acc[v][kk]);
    }
  }
  // Through memory: indexing the accumulators in the (rolled) loops below would keep them there
  // during the product too.
  HWY_ALIGN float dots[kHV * kDsaKeys * hn::MaxLanes(df)];
  for (int v = 0; v < kHV; ++v) {
    for (int kk = 0; kk < kDsaKeys; ++kk) {
      hn::Store(hn::Max(acc[v][kk], hn::Zero(df)), df, dots + (kk * kHV + v) * lanes);
    }
  }
  const DD dd;
  for (int kk = 0; kk < kDsaKeys; ++kk) {
    auto sum = hn::Zero(dd);
    for (int v = 0; v < kHV; ++v) {
      sum = AddWeighted(hn::Load(df, dots + (kk * kHV + v) * lanes), w + v * lanes, sum);
    }
    tile[kk] += hn::GetLane(hn::SumOfLanes(dd, sum));
  }
}

void IndexScores(const DsaQueries& q, const IndexKeyView& keys, const int32_t* slots, int64_t n,
                 double c, double* scores, int64_t stride) {
  const DF df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  const int vectors = q.heads / lanes;
  const int dim = q.dim;
  const size_t q_token = static_cast<size_t>(dim) * q.heads;
  auto kf = hwy::AllocateAligned<float>(static_cast<size_t>(kDsaKeys) * dim);
  for (int64_t m = 0; m < n; m += kDsaKeys) {
    const int nk = static_cast<int>(std::min<int64_t>(kDsaKeys, n - m));
    DequantiseKeys(keys, slots + m, nk, dim, kf.get());
    for (int t = 0; t < q.tokens; ++t) {
      const float* qt = q.q + t * q_token;
      const double* wt = q.w + static_cast<size_t>(t) * q.heads;
      double tile[kDsaKeys] = {};
      int v = 0;
      for (; v + 2 <= vectors; v += 2) {
        ScoreTile<2>(qt + v * lanes, q.heads, wt + v * lanes, kf.get(), dim, tile);
      }
      if (v < vectors) ScoreTile<1>(qt + v * lanes, q.heads, wt + v * lanes, kf.get(), dim, tile);
      double* out = scores + t * stride + m;
      for (int kk = 0; kk < nk; ++kk) out[kk] = c * tile[kk];
    }
  }
}

// round_index_query in vectors: x / scale (exact: scale is a power of two), rounded to the e4m3
// grid by adding and subtracting 2^(e + 20), e = max(floor(log2 |y|), -6), whose ulp is the grid
// step 2^(e - 3) around |y| (fp32 addition rounds to nearest even, as the e4m3 conversion does;
// e = -6 is the subnormal step), magnitudes from 448 up saturating at 448 as float_to_e4m3 does,
// the sign put back, times scale.
void RoundQueries(const float* q, int64_t head_stride, int index_heads, int dim, float* qt,
                  int heads) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const int lanes = static_cast<int>(hn::Lanes(df));
  HWY_ALIGN float row[hn::MaxLanes(DF())];
  for (int h = 0; h < index_heads; ++h) {
    const float* x = q + h * head_stride;
    VF vmax = hn::Zero(df);
    int d = 0;
    for (; d + lanes <= dim; d += lanes) vmax = hn::Max(vmax, hn::Abs(hn::LoadU(df, x + d)));
    float amax = hn::GetLane(hn::MaxOfLanes(df, vmax));
    for (; d < dim; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float scale = fp8_block_scale(amax);
    const VF vscale = hn::Set(df, scale), inv = hn::Set(df, 1.f / scale);
    const VF top = hn::Set(df, kFp8E4m3Max);
    const auto min_exp = hn::Set(du, 121u), bias = hn::Set(du, 20u);
    for (d = 0; d + lanes <= dim; d += lanes) {
      const VF y = hn::Mul(hn::LoadU(df, x + d), inv);
      const VF a = hn::Abs(y);
      const auto e = hn::Max(hn::ShiftRight<23>(hn::BitCast(du, a)), min_exp);
      const VF magic = hn::BitCast(df, hn::ShiftLeft<23>(hn::Add(e, bias)));
      VF r = hn::Sub(hn::Add(a, magic), magic);
      r = hn::IfThenElse(hn::Ge(a, top), top, r);
      hn::Store(hn::Mul(hn::CopySignToAbs(r, y), vscale), df, row);
      for (int i = 0; i < lanes; ++i) qt[static_cast<size_t>(d + i) * heads + h] = row[i];
    }
    for (; d < dim; ++d) {
      qt[static_cast<size_t>(d) * heads + h] = e4m3_to_float(float_to_e4m3(x[d] / scale)) * scale;
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace attnrt::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attnrt::cpu {

HWY_EXPORT(IndexScores);
HWY_EXPORT(RoundQueries);

void dsa_round_queries(const float* q, int64_t head_stride, int index_heads, int dim, float* qt,
                       int heads) {
  HWY_DYNAMIC_DISPATCH(RoundQueries)(q, head_stride, index_heads, dim, qt, heads);
}

void dsa_index_scores(const DsaQueries& q, const IndexKeyView& keys, const int32_t* slots,
                      int64_t n, double c, double* scores, int64_t stride) {
  HWY_DYNAMIC_DISPATCH(IndexScores)(q, keys, slots, n, c, scores, stride);
}

}  // namespace attnrt::cpu
#endif  // HWY_ONCE
