#include "attnrt/core/fault_injection.h"

#include "attnrt/core/error.h"

namespace attnrt {

namespace detail {
std::atomic<FaultInjector*> g_fault_injector{nullptr};
}

std::string_view fault_site_name(FaultSite site) {
  switch (site) {
    case FaultSite::host_alloc:
      return "host_alloc";
    case FaultSite::slot_alloc:
      return "slot_alloc";
    case FaultSite::device_alloc:
      return "device_alloc";
  }
  return "unknown";
}

void FaultInjector::fail_nth(FaultSite site, int64_t k) {
  ATTNRT_CHECK(k >= 0,
               "FaultInjector::fail_nth({}, {}): k is the 1-based call to fail, or 0 for none",
               fault_site_name(site), k);
  Site& s = sites_[static_cast<size_t>(site)];
  s.calls = 0;
  s.fail_at = k;
}

void FaultInjector::on_call(FaultSite site, std::string_view what) {
  Site& s = sites_[static_cast<size_t>(site)];
  ++s.calls;
  if (s.fail_at == 0 || s.calls != s.fail_at) return;
  ++s.injected;
  fail(
      "injected fault: {} failed (fault site {}, call {} armed by FaultInjector::fail_nth); "
      "nothing was allocated",
      what, fault_site_name(site), s.calls);
}

}  // namespace attnrt
