#include "bench/harness/ceilings.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "attnrt/core/error.h"
#include "bench/harness/ceiling_kernels.h"
#include "bench/harness/device_probes.h"

namespace attnrt::bench {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

PerDevice<CeilingProbe>& probes() {
  static PerDevice<CeilingProbe> p;
  return p;
}

// Runs `body(thread_index)` on `threads` threads at once and returns the wall time of the slowest.
template <typename Body>
double time_parallel(int threads, Body&& body) {
  double start = now_seconds();
#pragma omp parallel num_threads(threads)
  body(omp_get_thread_num());
  return now_seconds() - start;
}

// Iteration count that makes one thread's compute loop last about `seconds`.
template <typename Loop>
uint64_t calibrate(Loop&& loop, double seconds) {
  uint64_t iterations = 1 << 14;
  for (;;) {
    double start = now_seconds();
    loop(iterations);
    double took = now_seconds() - start;
    if (took > seconds / 8 || iterations > (uint64_t{1} << 40)) {
      return std::max<uint64_t>(1, static_cast<uint64_t>(iterations * seconds / took));
    }
    iterations *= 4;
  }
}

template <typename Loop>
double compute_peak_gflops(int threads, double seconds, int passes, Loop&& loop) {
  const uint64_t iterations = calibrate(loop, seconds);
  double best = 0;
  for (int pass = 0; pass < passes; ++pass) {
    std::vector<double> flops(threads, 0.0);
    double took = time_parallel(threads, [&](int t) { flops[t] = loop(iterations); });
    double total = 0;
    for (double f : flops) total += f;
    best = std::max(best, total / took / 1e9);
  }
  return best;
}

}  // namespace

int resolve_threads(int requested) {
  ATTNRT_CHECK(requested >= 0, "--threads {} is invalid: use a positive count, or 0 for all cores",
               requested);
  if (requested > 0) return requested;
  if (const char* env = std::getenv("ATTNRT_NUM_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    long n = std::strtol(env, &end, 10);
    ATTNRT_CHECK(end != env && *end == '\0' && n > 0 && n <= 4096,
                 "ATTNRT_NUM_THREADS='{}' is invalid: use a thread count from 1 to 4096", env);
    return static_cast<int>(n);
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

double cpu_stream_read_gbps(size_t bytes, int threads, int passes) {
  ATTNRT_CHECK(threads > 0 && passes > 0, "stream read probe needs threads > 0 and passes > 0");
  const size_t count = std::max<size_t>(bytes / sizeof(float), 1024);
  std::unique_ptr<float[]> data(new float[count]);
  // Each thread touches the part it later reads (first-touch places the pages on its NUMA node),
  // with non-zero values so no zero-page sharing can make the read look cheaper than it is.
  auto part = [&](int t) {
    size_t per = (count / threads) & ~size_t{63};
    size_t begin = per * t;
    size_t end = t == threads - 1 ? count : begin + per;
    return std::pair{begin, end};
  };
  time_parallel(threads, [&](int t) {
    auto [begin, end] = part(t);
    uint32_t x = 0x9e3779b9u ^ static_cast<uint32_t>(t);
    for (size_t i = begin; i < end; ++i) {
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      data[i] = 1.0f + static_cast<float>(x >> 8) * 0x1p-24f;
    }
  });
  double best = 0;
  std::vector<float> sums(threads);
  for (int pass = 0; pass < passes; ++pass) {
    double took = time_parallel(threads, [&](int t) {
      auto [begin, end] = part(t);
      sums[t] = stream_read_sum(data.get() + begin, end - begin);
    });
    best = std::max(best, static_cast<double>(count * sizeof(float)) / took / 1e9);
  }
  // A sum of values >= 1 cannot be below the count: proves the reads happened.
  double total = 0;
  for (float s : sums) total += s;
  ATTNRT_CHECK(total >= 0.5 * static_cast<double>(count), "stream read probe summed {} over {} values",
               total, count);
  return best;
}

double cpu_fma_gflops(int threads, double seconds, int passes) {
  return compute_peak_gflops(threads, seconds, passes, [](uint64_t iterations) {
    float sink = 0;
    double flops = fma_loop(iterations, 0.999f, 0.001f, &sink);
    // The converged value is b / (1 - a) = 1; anything else means the loop did not run as written.
    ATTNRT_CHECK(sink > 0, "FMA probe produced {}", sink);
    return flops;
  });
}

double cpu_bf16_dot_gflops(int threads, double seconds, int passes, std::string* why_not) {
  if (!bf16_dot_supported(why_not)) return 0;
  return compute_peak_gflops(threads, seconds, passes, [](uint64_t iterations) {
    float sink = 0;
    double flops = bf16_dot_loop(iterations, &sink);
    ATTNRT_CHECK(sink > 0, "bf16 dot probe produced {}", sink);
    return flops;
  });
}

std::string cpu_simd_target() { return dispatched_target_name(); }

void register_ceiling_probe(DeviceKind kind, CeilingProbe probe) {
  probes().set(kind, std::move(probe));
}

Ceilings measure_ceilings(Device device, const CeilingOptions& options) {
  if (device.kind != DeviceKind::cpu) {
    install_builtin_device_probes();
    const CeilingProbe probe = probes().get(device.kind);
    ATTNRT_CHECK(probe != nullptr,
                 "no ceiling probe for {}: GPU ceilings are measured by the CUDA backend, which "
                 "this build does not have; run the bench on a cpu backend",
                 device_name(device));
    return probe(device, options);
  }
  Ceilings c;
  c.device = device;
  c.threads = resolve_threads(options.threads);
  c.simd_target = cpu_simd_target();
  const double gib = static_cast<double>(options.memory_bytes) / double(1ull << 30);
  c.memory.value = cpu_stream_read_gbps(options.memory_bytes, c.threads, options.passes);
  c.memory.method = fmt::format("streaming read of {:.2f} GiB, {} threads, {} loads, best of {}",
                                gib, c.threads, c.simd_target, options.passes);
  c.fp32.value = cpu_fma_gflops(c.threads, options.compute_seconds, options.passes);
  c.fp32.method = fmt::format("fp32 FMA loop, 12 accumulators, {} threads, {}, best of {}",
                              c.threads, c.simd_target, options.passes);
  std::string why_not;
  c.bf16.value =
      cpu_bf16_dot_gflops(c.threads, options.compute_seconds, options.passes, &why_not);
  if (c.bf16.value > 0) {
    c.bf16.method = fmt::format("vdpbf16ps loop, 12 accumulators, {} threads, best of {}",
                                c.threads, options.passes);
  } else {
    c.bf16.unavailable = why_not;
  }
  c.gather_random.unavailable = c.gather_ordered.unavailable =
      "GPU only (the page-1 row gather of docs/workloads.md)";
  return c;
}

}  // namespace attnrt::bench
