#include "backends/cpu/dsa_select.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "attnrt/backend/dsa.h"

namespace attnrt::cpu {

namespace {

// The candidate keys of query t of request r (token indices, increasing): every key up to the
// query's own (chain verify and extends: prefix + t), or for a verify tree the prefix and the
// query's ancestors-or-self.
void candidates(const DsaStep& step, const RequestInfo& r, int32_t t, std::vector<int32_t>& out) {
  out.clear();
  if (r.tree < 0) {
    for (int32_t j = 0; j <= r.prefix + t; ++j) out.push_back(j);
    return;
  }
  for (int32_t j = 0; j < r.prefix; ++j) out.push_back(j);
  const uint64_t* bits = step.tree_mask + static_cast<size_t>(r.tree + t) * step.tree_words;
  for (int32_t u = 0; u < r.qlen; ++u) {
    if ((bits[u / 64] >> (u % 64)) & 1u) out.push_back(r.prefix + u);
  }
}

}  // namespace

void select_dsa_keys(const DsaStep& step, const LayerSpec& layer, const IndexerArgs& indexer,
                     const IndexKeyView& keys, DsaSelection& out) {
  const std::vector<RequestInfo>& reqs = *step.reqs;
  const IndexerSpec& ix = layer.indexer;
  const int di = ix.index_head_dim, hi = ix.index_n_heads, topk = ix.index_topk;
  int64_t tokens = 0;
  for (const RequestInfo& r : reqs) tokens = std::max(tokens, r.q_row + r.qlen);
  std::vector<std::vector<int32_t>> chosen(static_cast<size_t>(tokens));
  const float c = static_cast<float>(index_score_scale(layer));

  // Every query token of the step, as (request, token): the unit of parallel work.
  std::vector<std::pair<int32_t, int32_t>> work;
  for (size_t i = 0; i < reqs.size(); ++i) {
    for (int32_t t = 0; t < reqs[i].qlen; ++t) work.emplace_back(static_cast<int32_t>(i), t);
  }
  // The value of every e4m3 code, so a key is dequantised by lookups.
  float lut[256];
  for (int b = 0; b < 256; ++b) lut[b] = e4m3_to_float(static_cast<uint8_t>(b));
  const TensorView& q = indexer.q;
  const TensorView& wt = indexer.weights;

#pragma omp parallel num_threads(step.num_threads)
  {
    std::vector<int32_t> cand, order;
    std::vector<float> qd(static_cast<size_t>(hi) * di), qh(di), kf(di);
    std::vector<double> w(hi), scores;
#pragma omp for schedule(dynamic, 4)
    for (size_t n = 0; n < work.size(); ++n) {
      const RequestInfo& r = reqs[work[n].first];
      const int32_t t = work[n].second;
      const int64_t row = r.q_row + t;
      candidates(step, r, t, cand);
      std::vector<int32_t>& sel = chosen[static_cast<size_t>(row)];
      // Up to topk candidates: all are selected, no score needed.
      if (static_cast<int>(cand.size()) <= topk) {
        sel = cand;
        continue;
      }
      for (int h = 0; h < hi; ++h) {
        for (int d = 0; d < di; ++d) {
          qh[d] = load_as_float(q.data, q.dtype,
                                static_cast<size_t>(row * q.strides[0] + h * q.strides[1] +
                                                    d * q.strides[2]));
        }
        round_index_query(qh.data(), di, qd.data() + static_cast<size_t>(h) * di);
        w[h] = load_as_float(wt.data, wt.dtype,
                             static_cast<size_t>(row * wt.strides[0] + h * wt.strides[1]));
      }
      scores.resize(cand.size());
      for (size_t m = 0; m < cand.size(); ++m) {
        const int64_t s = (*step.slots)[r.slot_offset + cand[m]];
        const uint8_t* codes = keys.codes(s);
        const float ks = keys.scale(s);
        for (int d = 0; d < di; ++d) kf[d] = lut[codes[d]] * ks;
        double sum = 0.0;
        for (int h = 0; h < hi; ++h) {
          const float* qr = qd.data() + static_cast<size_t>(h) * di;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < di; ++d) dot += qr[d] * kf[d];
          sum += w[h] * std::max(dot, 0.f);
        }
        scores[m] = c * sum;
      }
      order.resize(cand.size());
      for (size_t m = 0; m < order.size(); ++m) order[m] = static_cast<int32_t>(m);
      std::nth_element(order.begin(), order.begin() + (topk - 1), order.end(),
                       [&](int32_t a, int32_t b) {
                         return dsa_ranks_before(scores[a], cand[a], scores[b], cand[b]);
                       });
      sel.resize(static_cast<size_t>(topk));
      for (int m = 0; m < topk; ++m) sel[m] = cand[order[m]];
      std::sort(sel.begin(), sel.end());
    }
  }

  out.reqs.assign(static_cast<size_t>(tokens), RequestInfo{});
  out.slots.clear();
  for (const RequestInfo& r : reqs) {
    for (int32_t t = 0; t < r.qlen; ++t) {
      const int64_t row = r.q_row + t;
      const std::vector<int32_t>& sel = chosen[static_cast<size_t>(row)];
      const auto n = static_cast<int32_t>(sel.size());
      out.reqs[row] = RequestInfo{.q_row = row,
                                  .slot_offset = static_cast<int64_t>(out.slots.size()),
                                  .prefix = n - 1,
                                  .qlen = 1,
                                  .kv_len = n};
      for (int32_t j : sel) out.slots.push_back((*step.slots)[r.slot_offset + j]);
      if (!indexer.topk.empty()) {
        const TensorView& o = indexer.topk;
        int32_t* dst = o.ptr<int32_t>() + row * o.strides[0];
        for (int32_t k = 0; k < topk; ++k) dst[k * o.strides[1]] = k < n ? sel[k] : -1;
      }
    }
  }
}

}  // namespace attnrt::cpu
