#include "bench/harness/row_check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace attnrt::bench {

double rel_err(const uint16_t* got, const double* want, int n) {
  double num = 0, den = 0;
  for (int e = 0; e < n; ++e) {
    double g = bf16_to_float(got[e]);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - want[e]) * (g - want[e]);
    den += want[e] * want[e];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

std::vector<int64_t> sample_query_rows(int64_t tokens, double per_row_work, double max_work,
                                       uint64_t seed) {
  const double per_row = std::max(1.0, per_row_work);
  const int64_t want = std::clamp<int64_t>(static_cast<int64_t>(max_work / per_row), 4, 256);
  std::vector<int64_t> rows;
  if (want >= tokens) {
    rows.resize(tokens);
    std::iota(rows.begin(), rows.end(), 0);
    return rows;
  }
  rows = {0, tokens - 1};
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> pick(0, tokens - 1);
  while (static_cast<int64_t>(rows.size()) < want) rows.push_back(pick(rng));
  return rows;
}

CheckResult compare_outputs(const HostBuffer& got, const HostBuffer& want, const Workload& w,
                            double tol) {
  const int dim = w.v_head_dim();
  const int64_t vectors = w.num_tokens() * w.q_heads;
  std::vector<double> ref(dim);
  double worst = 0;
  for (int64_t i = 0; i < vectors; ++i) {
    const uint16_t* wv = want.ptr<uint16_t>() + i * dim;
    for (int e = 0; e < dim; ++e) ref[e] = bf16_to_float(wv[e]);
    worst = std::max(worst, rel_err(got.ptr<uint16_t>() + i * dim, ref.data(), dim));
  }
  CheckResult c;
  c.method = fmt::format("every output of {} against the reference backend", w.shape());
  c.rows_checked = static_cast<int>(w.num_tokens());
  c.max_rel_err = worst;
  c.tolerance = tol;
  c.passed = worst <= tol;
  return c;
}

void mark_check_failed(RowResult& row) {
  row.status = "mismatch";
  row.notes.push_back(fmt::format("not timed: output differs from the float64 recomputation "
                                  "(relative error {:.3g} > {:.3g})",
                                  row.check.max_rel_err, row.check.tolerance));
}

void mark_reference_mismatch(RowResult& row) {
  if (!row.reference || row.reference->check.passed) return;
  row.status = "mismatch";
  row.notes.push_back(fmt::format("output differs from the reference backend on {} "
                                  "(relative error {:.3g} > {:.3g})",
                                  row.reference->workload.shape(), row.reference->check.max_rel_err,
                                  row.reference->check.tolerance));
}

}  // namespace attnrt::bench
