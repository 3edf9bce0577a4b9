// The figures an attention row and a linear-attention row derive the same way: which standard row
// it is, what it counts, and the rate and share of the ceiling its median time gives.
#pragma once

#include <fmt/format.h>

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
    // A row counted by its bytes can still be compute-bound on this machine: more FLOPs per byte
    // than its balance (compute ceiling / memory ceiling; MLA's 16-head rows on a CPU). Then the
    // share of the memory ceiling undersells it, and the note gives the share of compute.
    const Ceiling& c = ceilings.compute();
    if (row.flops > 0 && row.bytes > 0 && ceilings.memory.available() && c.available()) {
      const double intensity = row.flops / row.bytes, balance = c.value / ceilings.memory.value;
      if (intensity > balance) {
        const double gflops = row.flops / row.time.median / 1e9;
        row.notes.push_back(fmt::format(
            "compute-bound on this machine: {:.1f} FLOP per byte, above its balance of {:.1f} "
            "({} ceiling / memory ceiling): {:.1f} GFLOP/s, {:.0f}% of the {} ceiling (the % "
            "column is of memory)",
            intensity, balance, ceilings.compute_name(), gflops, 100 * gflops / c.value,
            ceilings.compute_name()));
      }
    }
  } else {
    row.rate = row.flops / row.time.median / 1e9;
    if (ceilings.compute().available()) {
      row.pct_of_ceiling = 100 * row.rate / ceilings.compute().value;
    }
  }
}

}  // namespace attnrt::bench
