#include "attnrt/backend/registry.h"

#include <fmt/ranges.h>

#include "attnrt/core/error.h"

namespace attnrt {

Registry& Registry::global() {
  static Registry* registry = [] {
    auto* r = new Registry();
    register_builtin_backends(*r);
    return r;
  }();
  return *registry;
}

void claim_every_feature(BackendCaps& caps) {
  caps.spec_topk1 = true;
  caps.spec_topk_gt1 = true;
  caps.sliding_window = true;
  caps.softcap = true;
  caps.sinks = true;
  caps.non_causal = true;
  caps.mla = true;
  caps.linear_kinds = {LayerKind::gdn, LayerKind::mamba2, LayerKind::kda};
}

void Registry::add(BackendEntry entry) {
  ATTNRT_CHECK(find(entry.name) == nullptr, "backend '{}' is registered twice", entry.name);
  if (entry.device == nullptr) entry.device = host_device_services();
  entries_.push_back(std::move(entry));
}

void Registry::remove(const std::string& name) {
  get(name);  // throws for an unknown name, listing the registered ones
  std::erase_if(entries_, [&](const BackendEntry& e) { return e.name == name; });
}

const DeviceServices* Registry::device_services(DeviceKind kind) const {
  for (const auto& e : entries_) {
    if (e.device->kind() == kind) return e.device.get();
  }
  return nullptr;
}

const BackendEntry* Registry::find(const std::string& name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

const BackendEntry& Registry::get(const std::string& name) const {
  if (const BackendEntry* e = find(name)) return *e;
  fail("unknown attention backend '{}': registered backends are {}", name,
       fmt::join(names(), ", "));
}

std::vector<std::string> Registry::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.name);
  return out;
}

}  // namespace attnrt
