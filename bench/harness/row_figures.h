// The figures an attention row and a linear-attention row derive the same way: which standard row
// it is, what it counts, and the rate and share of the ceiling its median time gives.
#pragma once

#include <vector>

#include "bench/harness/ceilings.h"
#include "bench/harness/workload.h"

namespace attnrt::bench {

// Starts `row` for workload `w`: its standard form (the row of `standard` with the same name, else
// `w` itself), its counted bytes and FLOPs, and its bound.
template <class Result, class W>
void start_row(Result& row, const W& w, const std::vector<W>& standard, double bytes,
               double flops) {
  row.workload = w;
  row.standard = w;
  for (const W& s : standard) {
    if (s.name == w.name) row.standard = s;
  }
  row.bytes = bytes;
  row.flops = flops;
  row.bound = w.bound();
}

// Sets row.rate from row.time.median: GB/s for a memory-bound row, else GFLOP/s; and
// row.pct_of_ceiling, that rate against the matching ceiling when it was measured.
template <class Result>
void set_rate(Result& row, const Ceilings& ceilings) {
  if (row.bound == Bound::memory) {
    row.rate = row.bytes / row.time.median / 1e9;
    if (ceilings.memory.available()) row.pct_of_ceiling = 100 * row.rate / ceilings.memory.value;
  } else {
    row.rate = row.flops / row.time.median / 1e9;
    if (ceilings.compute().available()) {
      row.pct_of_ceiling = 100 * row.rate / ceilings.compute().value;
    }
  }
}

}  // namespace attnrt::bench
