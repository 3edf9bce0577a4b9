// The backend registry: named factories with their capabilities; lazy creation.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/device_services.h"
#include "attnrt/core/dtype.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

struct BackendCaps {
  std::vector<DeviceKind> devices;
  std::vector<int> page_sizes;        // native page sizes; empty = any page size
  std::vector<DType> kv_dtypes;
  std::vector<int> head_dims;         // empty = any head dim
  bool full_attention = true;         // serves full / swa layers
  bool spec_topk1 = false;            // TARGET_VERIFY chain, DRAFT_EXTEND
  bool spec_topk_gt1 = false;         // TARGET_VERIFY tree
  bool sliding_window = false;
  bool softcap = false;
  bool sinks = false;
  bool mla = false;
  bool dsa = false;  // DSA layers (MLA with an indexer, docs/dsa.md)
  bool non_causal = false;
  bool cuda_graphs = false;
  // Its captured steps keep --deterministic's batch invariance (split counts from each request's
  // own length, the same as its eager steps), so deterministic mode may run them as graphs.
  bool deterministic_graphs = false;
  // Its captured steps hold DSA layers (docs/cuda_graphs.md "DSA layers"); used only while
  // dsa_graphs_enabled() (ATTNRT_DSA_GRAPHS=1).
  bool dsa_graphs = false;
  // It runs prefill tiles over an e4m3 KV cache on fp8 tensor cores when
  // Options::fp8_prefill_attention asks (q and P in e4m3).
  bool fp8_prefill_attention = false;
  std::vector<LayerKind> linear_kinds;  // gdn / mamba2 / kda served by this backend
};

// Claims every feature above for a backend that serves them all (the built-in ones do): the
// speculative chains and trees, sliding window, soft-cap, sinks, non-causal layers, MLA and the
// gdn / mamba2 / kda layers. Devices, page sizes, KV dtypes, head dims and CUDA graphs are left
// to the caller. A feature flag added to BackendCaps goes into this list only once all three
// built-in backends serve it; until then the backends that do set it after this call.
void claim_every_feature(BackendCaps& caps);

struct BackendEntry {
  std::string name;
  std::string summary;   // one line for `attnrt info`
  BackendCaps caps;
  // Never auto-selected when false (reference).
  bool auto_selectable = true;
  // "" when usable on this machine, else why not (no CUDA device, built without CUDA, ...).
  std::function<std::string()> unavailable_reason;
  std::function<std::unique_ptr<AttentionBackend>(const BackendContext&)> factory;
  // Creates the backend object that serves the linear-attention layers (its forward_linear), when
  // caps.linear_kinds is not empty. A separate object so that a backend chosen for one role only
  // plans that role's work.
  std::function<std::unique_ptr<AttentionBackend>(const BackendContext&)> linear_factory;
  // The services of the device the backend runs on: its pools, graphs and copies. Left empty, the
  // host's (host_device_services()).
  std::shared_ptr<const DeviceServices> device;
  // `attnrt info --explain`: a line per attention layer shape of `model` and phase naming the
  // kernel this backend runs for it and why, with the step's KV dtype `kv`. Empty: none given.
  std::function<std::vector<std::string>(const ModelSpec& model, const Options& options,
                                         DType kv)>
      explain_kernels;
};

// A BackendEntry::factory / linear_factory that creates a B.
template <class B>
std::function<std::unique_ptr<AttentionBackend>(const BackendContext&)> backend_factory() {
  return [](const BackendContext& ctx) -> std::unique_ptr<AttentionBackend> {
    return std::make_unique<B>(ctx);
  };
}

class Registry {
 public:
  static Registry& global();  // with the built-in backends registered
  // Throws attnrt::Error on a duplicate name. Entries keep their address for the registry's life.
  void add(BackendEntry entry);
  // Removes the entry `name` (one a test or a plug-in added). Removing any but the last entry
  // invalidates references to the others, and so Selections resolved before: remove an entry only
  // when no runtime built on the registry is alive. Throws attnrt::Error for an unknown name.
  void remove(const std::string& name);
  const BackendEntry* find(const std::string& name) const;
  // Throws attnrt::Error naming the value and listing the registered names.
  const BackendEntry& get(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::deque<BackendEntry>& entries() const { return entries_; }
  // The services of the first registered backend on `kind`; nullptr when none runs there (a build
  // without CUDA has no cuda device).
  const DeviceServices* device_services(DeviceKind kind) const;

 private:
  std::deque<BackendEntry> entries_;
};

// Registers reference, cpu and cuda (which registers nothing in a build without CUDA). Called once
// by Registry::global().
void register_builtin_backends(Registry& registry);

}  // namespace attnrt
