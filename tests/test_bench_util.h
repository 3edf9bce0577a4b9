// Pieces shared by the bench tests.
#pragma once

#include <cstddef>
#include <string>

#include "bench/harness/runner.h"

namespace attnrt::test {

// A bench run small enough for a test: 2 timed repeats after 1 warm-up on 2 threads, ceiling
// probes over 16 MiB and 5 ms.
inline bench::BenchConfig tiny_bench_config(const std::string& backend) {
  bench::BenchConfig c;
  c.backend = backend;
  c.repeats = 2;
  c.warmup = 1;
  c.threads = 2;
  c.ceiling_options.memory_bytes = size_t{16} << 20;
  c.ceiling_options.passes = 1;
  c.ceiling_options.compute_seconds = 0.005;
  return c;
}

}  // namespace attnrt::test
