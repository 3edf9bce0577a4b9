// Fault injection for tests: make the k-th allocation at a fault point fail, then check that the
// failure came out as an attnrt::Error and left every pool consistent (check_invariants()).
//
// Fault points sit where pools, caches and their scratch take host memory (host_alloc), where the
// allocators hand out slots, request rows and state slots (slot_alloc), and where the cuda backend
// takes GPU memory (device_alloc). An injector is explicit:
// a test creates one, arms it with fail_nth() and installs it with a FaultScope; no environment
// variable turns it on. With none installed a fault point costs one relaxed atomic load and a
// branch. Install an injector only while no other thread allocates from attnrt pools.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>

namespace attnrt {

enum class FaultSite : uint8_t {
  host_alloc,    // host memory of pools, caches and scratch (KV, index keys, linear states)
  slot_alloc,    // slots of an allocator (alloc_extend / alloc_decode), request rows, state slots
  device_alloc,  // GPU memory of the cuda backend's buffers and linear-state pool (CUDA builds)
};
inline constexpr int kNumFaultSites = 3;
std::string_view fault_site_name(FaultSite site);

class FaultInjector {
 public:
  // The k-th call (1-based) at `site` from now on fails; k = 0 disarms the site. Resets the site's
  // call count.
  void fail_nth(FaultSite site, int64_t k);
  // Calls seen at `site` since the last fail_nth (or since construction), and faults injected.
  int64_t calls(FaultSite site) const { return state(site).calls; }
  int64_t injected(FaultSite site) const { return state(site).injected; }

  // A fault point: counts the call; throws attnrt::Error naming `what`, the site and the call
  // number when it is the armed one.
  void on_call(FaultSite site, std::string_view what);

 private:
  struct Site {
    int64_t calls = 0, fail_at = 0, injected = 0;
  };
  const Site& state(FaultSite s) const { return sites_[static_cast<size_t>(s)]; }
  std::array<Site, kNumFaultSites> sites_{};
};

namespace detail {
extern std::atomic<FaultInjector*> g_fault_injector;
}

// Installs `injector` for its lifetime (the previous one, usually none, comes back after).
class FaultScope {
 public:
  explicit FaultScope(FaultInjector& injector)
      : previous_(detail::g_fault_injector.exchange(&injector)) {}
  ~FaultScope() { detail::g_fault_injector.store(previous_); }
  FaultScope(const FaultScope&) = delete;
  FaultScope& operator=(const FaultScope&) = delete;

 private:
  FaultInjector* previous_;
};

// The fault point itself, called before an allocation that may fail.
inline void fault_point(FaultSite site, std::string_view what) {
  FaultInjector* f = detail::g_fault_injector.load(std::memory_order_relaxed);
  if (f != nullptr) [[unlikely]]
    f->on_call(site, what);
}

}  // namespace attnrt
