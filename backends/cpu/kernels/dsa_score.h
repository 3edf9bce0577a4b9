// The index-score kernel of DSA layers on the cpu backend (docs/dsa.md "The index score"): the
// scores of a block of query tokens over candidate keys read from the index-key cache, as a
// register-blocked fp32 product, compiled once per Highway target and dispatched at run time.
#pragma once

#include <cstdint>

#include "attnrt/memory/index_key_cache.h"

namespace attnrt::cpu {

// Index heads are padded to a multiple of this in DsaQueries (the widest vector of fp32 lanes).
inline constexpr int kDsaHeadAlign = 16;

// The rounded index queries (round_index_query) of `tokens` query tokens, transposed:
// q[(t * dim + d) * heads + h] is head h, element d of token t; w[t * heads + h] its weight.
// `heads` is index_n_heads rounded up to kDsaHeadAlign; the padded heads hold zero queries and
// zero weights, so they add nothing.
struct DsaQueries {
  const float* q = nullptr;
  const double* w = nullptr;
  int tokens = 0;
  int heads = 0;
  int dim = 0;
};

// scores[t * stride + m] = c * sum_h w[t, h] * relu(<q[t, h], k_m>) for every token t of the block
// and candidate m < n, key k_m = the dequantised key of slot slots[m] (e4m3 code value times its
// scale, exact in fp32). Per head the dot is fp32, the sum over heads fp64.
void dsa_index_scores(const DsaQueries& q, const IndexKeyView& keys, const int32_t* slots,
                      int64_t n, double c, double* scores, int64_t stride);

// Token t's index queries, q[h * head_stride + d] (index_n_heads x dim), rounded as
// round_index_query rounds each head (the same floats), written transposed into qt
// (qt[d * heads + h], heads = index_n_heads padded as in DsaQueries; the padding is not written).
void dsa_round_queries(const float* q, int64_t head_stride, int index_heads, int dim, float* qt,
                       int heads);

}  // namespace attnrt::cpu
