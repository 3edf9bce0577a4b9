// The process-wide state of programmatic dependent launches (dependent_launch.cuh): the switch
// (launch.h) and whether the launch attribute works here at all.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "backends/cuda/kernels/dependent_launch.cuh"

namespace attnrt::cuda {

namespace {

std::atomic<bool>& switch_state() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("ATTNRT_PDL");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }()};
  return on;
}

std::atomic<bool> attribute_works{true};

}  // namespace

bool dependent_launch_enabled() { return switch_state().load(std::memory_order_relaxed); }

void set_dependent_launch(bool on) { switch_state().store(on, std::memory_order_relaxed); }

int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices];  // 0: not read yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return 0;
  if (dev >= kMaxDevices) {
    int n = 0;
    return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess ? n : 0;
  }
  int n = counts[dev].load(std::memory_order_relaxed);
  if (n == 0 && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
    counts[dev].store(n, std::memory_order_relaxed);
  return n;
}

namespace detail {

bool dependent_launch_usable() { return attribute_works.load(std::memory_order_relaxed); }

void dependent_launch_failed() { attribute_works.store(false, std::memory_order_relaxed); }

}  // namespace detail

}  // namespace attnrt::cuda
