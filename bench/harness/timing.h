// Timing of one benchmark call: warm-up, caches flushed between repetitions, median with spread.
// The clock is per device: steady_clock around a synchronous call on the CPU; for CUDA devices,
// install_builtin_device_probes() installs an event-based timer with register_device_timer.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "attnrt/core/tensor.h"

namespace attnrt::bench {

struct TimingStats {
  int repeats = 0;
  double median = 0, min = 0, max = 0, p10 = 0, p90 = 0;  // seconds
  // Throws attnrt::Error for an empty sample.
  static TimingStats from_samples(std::vector<double> seconds);
};

class DeviceTimer {
 public:
  virtual ~DeviceTimer() = default;
  // Seconds `body` takes on the device (the body is complete when this returns).
  virtual double time(const std::function<void()>& body) = 0;
  // Evicts what a previous repetition left in the caches, so each repetition reads from memory
  // as a real step (after the other layers ran) would. Not timed.
  virtual void flush_caches() = 0;
  virtual std::string method() const = 0;  // e.g. "steady_clock, 64 MiB cache flush"
};

// How a GPU timer evicts the L2 before each repetition, from ATTNRT_BENCH_FLUSH (docs/bench.md).
// write: a memset of a buffer of at least 4x the L2, which leaves the L2 full of dirty lines whose
// write-back the timed call then pays as it evicts them. clean: a read of that buffer, which leaves
// only clean lines, so the timed call's DRAM traffic is its own.
enum class GpuFlush { write, clean };
// ATTNRT_BENCH_FLUSH=write|clean; write when unset or empty. Throws attnrt::Error for any other
// value, naming the variable, the value and the allowed values.
GpuFlush gpu_flush_from_env();
const char* gpu_flush_name(GpuFlush flush);

// CPU timer; its flush streams through a buffer of twice the last-level cache.
std::unique_ptr<DeviceTimer> make_device_timer(Device device);
void register_device_timer(DeviceKind kind, std::function<std::unique_ptr<DeviceTimer>()> make);

// Bytes of this CPU's last-level cache (sysfs), or 32 MiB when it cannot be read.
size_t last_level_cache_bytes();

// `warmup` untimed calls, then `repeats` timed calls with a cache flush before each.
TimingStats time_repeated(DeviceTimer& timer, const std::function<void()>& body, int warmup,
                          int repeats);

// Host-side cost of a cheap call (e.g. a plan): runs it in batches long enough for the clock and
// returns the per-call seconds of each batch.
TimingStats time_host_call(const std::function<void()>& body, int repeats);

}  // namespace attnrt::bench
