// Shrinking benchmark rows (`--scale`, `--preset`), the same way for every suite. Private to the
// bench sources.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "attnrt/core/error.h"

namespace attnrt::bench {

// Scaled lengths stay multiples of the standard page so that page-16 and page-1 variants of a row
// keep identical token counts.
inline constexpr int kLengthQuantum = 16;

// `len` rounded to a multiple of kLengthQuantum, at least kLengthQuantum.
inline int round_length(double len) {
  int q = static_cast<int>(std::lround(len / kLengthQuantum)) * kLengthQuantum;
  return std::max(q, kLengthQuantum);
}

// Half of `len`, rounded down to a multiple of kLengthQuantum, at least kLengthQuantum.
inline int halve_length(int len) {
  return std::max(kLengthQuantum, (len / 2) / kLengthQuantum * kLengthQuantum);
}

// Row `w` scaled by `factor` in (0, 1] (else an attnrt::Error): the batch to batch x factor (at
// least 1), the lengths as `scale_lengths(row, factor)` sets them. Returns `w` itself when nothing
// changes, else the scaled row with a scale_note naming the factor and the original shape.
template <class W, class ScaleLengths>
W scale_row(const W& w, double factor, ScaleLengths scale_lengths) {
  ATTNRT_CHECK(factor > 0 && factor <= 1, "--scale {} is out of range: use a factor in (0, 1]",
               factor);
  if (factor == 1) return w;
  W s = w;
  s.batch = std::max(1, static_cast<int>(std::lround(w.batch * factor)));
  scale_lengths(s, factor);
  if (s == w) return w;
  s.scale_note = fmt::format("scaled x{:g} from {}", factor, w.shape());
  return s;
}

}  // namespace attnrt::bench
