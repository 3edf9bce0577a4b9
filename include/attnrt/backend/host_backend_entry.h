// The registry entry of a host-memory backend (reference, cpu). The cpu backend keeps the
// semantics and the features of the reference (reference-semantics §8), so their entries differ
// only in name, summary, auto-selection and the classes they create.
#pragma once

#include <string>
#include <utility>

#include "attnrt/backend/registry.h"

namespace attnrt {

// The cpu device, any page size and head dim, every KV dtype, every feature (claim_every_feature,
// and DSA),
// no CUDA graphs, always available. Full serves the full-attention layers, Linear the linear ones.
template <class Full, class Linear>
BackendEntry host_backend_entry(std::string name, std::string summary, bool auto_selectable) {
  BackendEntry e;
  e.name = std::move(name);
  e.summary = std::move(summary);
  e.caps.devices = {DeviceKind::cpu};
  e.caps.kv_dtypes = {DType::f32, DType::f16, DType::bf16, DType::e4m3, DType::e5m2};
  claim_every_feature(e.caps);
  e.caps.dsa = true;
  e.caps.cuda_graphs = false;
  e.auto_selectable = auto_selectable;
  e.unavailable_reason = [] { return std::string(); };
  e.factory = backend_factory<Full>();
  e.linear_factory = backend_factory<Linear>();
  return e;
}

}  // namespace attnrt
