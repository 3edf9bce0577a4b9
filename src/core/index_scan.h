// Branch-free scans over the index arrays of a step (slots, positions), compiled for every Highway
// target and dispatched at run time (index_scan.cpp): the per-token half of the step checks. Each
// only answers whether everything passes; the checked loops beside them name the first failure.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attnrt {

// True when 0 <= x[i] < bound for every i < n.
bool all_in_range(const int64_t* x, size_t n, int64_t bound);

// True when x[i] == y[i] + d for every i < n.
bool all_offset(const int64_t* x, const int32_t* y, int64_t d, size_t n);

// True when, for every run r < runs, x[start[r] + t] == base[r] + t for t in [0, len[r]).
bool all_count_up(const int64_t* x, const int64_t* start, const int32_t* base, const int32_t* len,
                  size_t runs);

}  // namespace attnrt
