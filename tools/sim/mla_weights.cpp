#include "tools/sim/mla_weights.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "attnrt/backend/selection.h"
#include "attnrt/core/error.h"

namespace attnrt::sim {

namespace {

void random_columns(int columns, int rank, std::mt19937_64& rng, std::vector<int32_t>& rows,
                    std::vector<float>& w) {
  std::uniform_int_distribution<int32_t> row(0, rank - 1);
  // Unit-variance outputs from unit-variance latent entries.
  std::normal_distribution<float> weight(0.f, 1.f / std::sqrt(float{MlaWeights::kNonzeros}));
  rows.resize(static_cast<size_t>(columns) * MlaWeights::kNonzeros);
  w.resize(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i] = row(rng);
    w[i] = weight(rng);
  }
}

void check_contiguous(const TensorView& t, const char* what, int64_t d0, int64_t d1, int64_t d2) {
  ATTNRT_CHECK(t.is_contiguous() && t.ndim == 3 && t.shape[0] == d0 && t.shape[1] == d1 &&
                   t.shape[2] == d2 && is_float(t.dtype),
               "MlaWeights: {} is {}; expected a contiguous float [{}, {}, {}]", what,
               t.describe(), d0, d1, d2);
}

}  // namespace

MlaWeights::MlaWeights(const LayerSpec& layer, uint64_t seed, int threads)
    : heads_(layer.num_q_heads),
      rank_(layer.kv_lora_rank),
      rope_(layer.qk_rope_head_dim),
      nope_(layer.qk_nope_head_dim),
      v_(layer.mha_v_head_dim),
      threads_(threads > 0 ? threads : std::max(1, omp_get_num_procs())) {
  ATTNRT_CHECK(layer.has_mha_form(), "MlaWeights: layer {} has no MHA form", layer.layer_id);
  std::mt19937_64 rng(seed);
  random_columns(heads_ * nope_, rank_, rng, uk_row_, uk_w_);
  random_columns(heads_ * v_, rank_, rng, uv_row_, uv_w_);
}

int MlaWeights::threads_for(int64_t work) const {
  return omp_threads_for(work, int64_t{1} << 20, threads_);
}

void MlaWeights::decompress(const TensorView& latent, const TensorView& k,
                            const TensorView& v) const {
  const int64_t n = latent.ndim == 3 ? latent.shape[0] : 0;
  check_contiguous(latent, "latent", n, 1, rank_ + rope_);
  check_contiguous(k, "k", n, heads_, nope_ + rope_);
  check_contiguous(v, "v", n, heads_, v_);
  const int row_dim = rank_ + rope_, kd = nope_ + rope_;
#pragma omp parallel for schedule(static) \
    num_threads(threads_for(n * heads_ * (nope_ + v_) * kNonzeros))
  for (int64_t t = 0; t < n; ++t) {
    std::vector<float> c(row_dim);
    for (int r = 0; r < row_dim; ++r) {
      c[r] = load_as_float(latent.data, latent.dtype, static_cast<size_t>(t * row_dim + r));
    }
    for (int h = 0; h < heads_; ++h) {
      const size_t kb = static_cast<size_t>((t * heads_ + h) * kd);
      for (int d = 0; d < nope_; ++d) {
        const size_t col = (static_cast<size_t>(h) * nope_ + d) * kNonzeros;
        float acc = 0.f;
        for (int i = 0; i < kNonzeros; ++i) acc += uk_w_[col + i] * c[uk_row_[col + i]];
        store_from_float(k.data, k.dtype, kb + d, acc);
      }
      for (int d = 0; d < rope_; ++d) store_from_float(k.data, k.dtype, kb + nope_ + d, c[rank_ + d]);
      const size_t vb = static_cast<size_t>((t * heads_ + h) * v_);
      for (int d = 0; d < v_; ++d) {
        const size_t col = (static_cast<size_t>(h) * v_ + d) * kNonzeros;
        float acc = 0.f;
        for (int i = 0; i < kNonzeros; ++i) acc += uv_w_[col + i] * c[uv_row_[col + i]];
        store_from_float(v.data, v.dtype, vb + d, acc);
      }
    }
  }
}

void MlaWeights::absorb_q(const TensorView& q, const TensorView& q_lat) const {
  const int64_t T = q.ndim == 3 ? q.shape[0] : 0;
  check_contiguous(q, "q", T, heads_, nope_ + rope_);
  check_contiguous(q_lat, "q_lat", T, heads_, rank_ + rope_);
  const int qd = nope_ + rope_, ld = rank_ + rope_;
#pragma omp parallel for schedule(static) num_threads(threads_for(T * heads_ * nope_ * kNonzeros))
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> acc(ld);
    for (int h = 0; h < heads_; ++h) {
      const size_t qb = static_cast<size_t>((t * heads_ + h) * qd);
      std::fill(acc.begin(), acc.end(), 0.f);
      // q_nope . k_nope = q_nope . (W_UK^T c) = (W_UK q_nope) . c
      for (int d = 0; d < nope_; ++d) {
        const float x = load_as_float(q.data, q.dtype, qb + d);
        const size_t col = (static_cast<size_t>(h) * nope_ + d) * kNonzeros;
        for (int i = 0; i < kNonzeros; ++i) acc[uk_row_[col + i]] += uk_w_[col + i] * x;
      }
      for (int d = 0; d < rope_; ++d) acc[rank_ + d] = load_as_float(q.data, q.dtype, qb + nope_ + d);
      const size_t lb = static_cast<size_t>((t * heads_ + h) * ld);
      for (int r = 0; r < ld; ++r) store_from_float(q_lat.data, q_lat.dtype, lb + r, acc[r]);
    }
  }
}

void MlaWeights::project_out(const TensorView& out_lat, const TensorView& out) const {
  const int64_t T = out_lat.ndim == 3 ? out_lat.shape[0] : 0;
  check_contiguous(out_lat, "out_lat", T, heads_, rank_);
  check_contiguous(out, "out", T, heads_, v_);
#pragma omp parallel for schedule(static) num_threads(threads_for(T * heads_ * v_ * kNonzeros))
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < heads_; ++h) {
      const size_t lb = static_cast<size_t>((t * heads_ + h) * rank_);
      for (int d = 0; d < v_; ++d) {
        const size_t col = (static_cast<size_t>(h) * v_ + d) * kNonzeros;
        float acc = 0.f;
        for (int i = 0; i < kNonzeros; ++i) {
          acc += uv_w_[col + i] * load_as_float(out_lat.data, out_lat.dtype, lb + uv_row_[col + i]);
        }
        store_from_float(out.data, out.dtype, static_cast<size_t>((t * heads_ + h) * v_ + d), acc);
      }
    }
  }
}

}  // namespace attnrt::sim
