// Pieces of the float checks every attention row runs before it is timed: which query rows are
// sampled, the relative error of one output vector, and the comparison of two whole outputs.
// Private to the bench runners.
#pragma once

#include <cstdint>
#include <vector>

#include "attnrt/core/tensor.h"
#include "bench/harness/runner.h"
#include "bench/harness/workload.h"

namespace attnrt::bench {

// Relative L2 error of one bf16 output vector against the expected one (infinite when it holds a
// NaN or an infinity).
double rel_err(const uint16_t* got, const double* want, int n);

// The query rows of a step of `tokens` rows to recompute when each costs `per_row_work` FLOPs and
// the check may spend `max_work`: all of them when they fit, else the first and the last (the
// first query of a request sees the least, the last one the most) and the rest at random, 4 to
// 256 in all.
std::vector<int64_t> sample_query_rows(int64_t tokens, double per_row_work, double max_work,
                                       uint64_t seed);

// Every bf16 output vector of `got` against `want` ([tokens, q heads, v_head_dim] of `w`).
CheckResult compare_outputs(const HostBuffer& got, const HostBuffer& want, const Workload& w,
                            double tol);

// A row whose float check failed: status mismatch, and the note that it was not timed.
void mark_check_failed(RowResult& row);
// After row.reference was measured: a disagreement with the reference backend marks the row a
// mismatch, with a note naming the shape and the error.
void mark_reference_mismatch(RowResult& row);

}  // namespace attnrt::bench
