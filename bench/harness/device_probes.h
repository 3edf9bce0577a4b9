// The device probes of the harness: GPU ceilings and the GPU timer, and where each device kind's
// are registered. They live here, not in the backends, so that the library an engine links
// carries no benchmark code.
#pragma once

#include <map>
#include <mutex>
#include <utility>

#include "attnrt/core/tensor.h"

namespace attnrt::bench {

// What each device kind registered (its ceiling probe, its timer maker); safe to use from several
// threads.
template <class T>
class PerDevice {
 public:
  void set(DeviceKind kind, T value) {
    std::lock_guard lock(mutex_);
    map_[kind] = std::move(value);
  }
  // What `kind` registered, else an empty T.
  T get(DeviceKind kind) const {
    std::lock_guard lock(mutex_);
    const auto it = map_.find(kind);
    return it != map_.end() ? it->second : T();
  }

 private:
  mutable std::mutex mutex_;
  std::map<DeviceKind, T> map_;
};

// Installs the probes of every device this build supports (register_ceiling_probe,
// register_device_timer) on the first call; later calls do nothing.
void install_builtin_device_probes();

}  // namespace attnrt::bench
