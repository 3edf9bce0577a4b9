#include "bench/harness/timing.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string_view>

#include "attnrt/core/error.h"
#include "bench/harness/device_probes.h"

namespace attnrt::bench {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Linear interpolation between the order statistics around fraction q of a sorted sample.
double quantile(const std::vector<double>& sorted, double q) {
  double pos = q * static_cast<double>(sorted.size() - 1);
  size_t lo = static_cast<size_t>(pos);
  size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

class CpuTimer final : public DeviceTimer {
 public:
  CpuTimer() : flush_(2 * last_level_cache_bytes() / sizeof(uint64_t), 1) {}

  double time(const std::function<void()>& body) override {
    double start = now_seconds();
    body();
    return now_seconds() - start;
  }

  void flush_caches() override {
    // Read-modify-write so the lines are owned (and later evicted) by this buffer; the running
    // sum is kept so the loop cannot be dropped.
    uint64_t acc = sink_;
    for (uint64_t& x : flush_) {
      acc += x;
      x = acc;
    }
    sink_ = acc;
  }

  std::string method() const override {
    return fmt::format("steady_clock; {} MiB written between repetitions to evict the caches",
                       flush_.size() * sizeof(uint64_t) >> 20);
  }

 private:
  std::vector<uint64_t> flush_;
  uint64_t sink_ = 0;
};

PerDevice<std::function<std::unique_ptr<DeviceTimer>()>>& timers() {
  static PerDevice<std::function<std::unique_ptr<DeviceTimer>()>> t;
  return t;
}

}  // namespace

TimingStats TimingStats::from_samples(std::vector<double> seconds) {
  ATTNRT_CHECK(!seconds.empty(), "no timing samples: at least one repetition is needed");
  std::sort(seconds.begin(), seconds.end());
  TimingStats s;
  s.repeats = static_cast<int>(seconds.size());
  s.min = seconds.front();
  s.max = seconds.back();
  s.median = quantile(seconds, 0.5);
  s.p10 = quantile(seconds, 0.1);
  s.p90 = quantile(seconds, 0.9);
  return s;
}

size_t last_level_cache_bytes() {
  size_t best = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream in(fmt::format("/sys/devices/system/cpu/cpu0/cache/index{}/size", index));
    std::string text;
    if (!(in >> text) || text.empty()) continue;
    size_t value = std::strtoull(text.c_str(), nullptr, 10);
    char unit = text.back();
    if (unit == 'K') value <<= 10;
    if (unit == 'M') value <<= 20;
    best = std::max(best, value);
  }
  return best > 0 ? best : size_t{32} << 20;
}

GpuFlush gpu_flush_from_env() {
  const char* env = std::getenv("ATTNRT_BENCH_FLUSH");
  if (env == nullptr || *env == '\0') return GpuFlush::write;
  const std::string_view v(env);
  if (v == "clean") return GpuFlush::clean;
  ATTNRT_CHECK(v == "write", "bench: ATTNRT_BENCH_FLUSH={} is invalid; use write or clean", env);
  return GpuFlush::write;
}

const char* gpu_flush_name(GpuFlush flush) { return flush == GpuFlush::clean ? "clean" : "write"; }

std::unique_ptr<DeviceTimer> make_device_timer(Device device) {
  if (device.kind == DeviceKind::cpu) return std::make_unique<CpuTimer>();
  install_builtin_device_probes();
  const std::function<std::unique_ptr<DeviceTimer>()> make = timers().get(device.kind);
  ATTNRT_CHECK(make != nullptr,
               "no timer for {}: device timing is provided by the CUDA backend, which this build "
               "does not have",
               device_name(device));
  return make();
}

void register_device_timer(DeviceKind kind, std::function<std::unique_ptr<DeviceTimer>()> make) {
  timers().set(kind, std::move(make));
}

TimingStats time_repeated(DeviceTimer& timer, const std::function<void()>& body, int warmup,
                          int repeats) {
  ATTNRT_CHECK(repeats >= 1, "--repeats {} is invalid: use at least 1", repeats);
  for (int i = 0; i < warmup; ++i) body();
  std::vector<double> samples;
  samples.reserve(repeats);
  for (int i = 0; i < repeats; ++i) {
    timer.flush_caches();
    samples.push_back(timer.time(body));
  }
  return TimingStats::from_samples(std::move(samples));
}

TimingStats time_host_call(const std::function<void()>& body, int repeats) {
  ATTNRT_CHECK(repeats >= 1, "--repeats {} is invalid: use at least 1", repeats);
  body();
  // Size the batches so each lasts about a millisecond: long against the clock resolution, short
  // enough that a slow plan (a large batch) still finishes quickly.
  int per_batch = 1;
  for (;;) {
    double start = now_seconds();
    for (int i = 0; i < per_batch; ++i) body();
    if (now_seconds() - start > 1e-3 || per_batch >= (1 << 16)) break;
    per_batch *= 4;
  }
  std::vector<double> samples;
  for (int r = 0; r < repeats; ++r) {
    double start = now_seconds();
    for (int i = 0; i < per_batch; ++i) body();
    samples.push_back((now_seconds() - start) / per_batch);
  }
  return TimingStats::from_samples(std::move(samples));
}

}  // namespace attnrt::bench
