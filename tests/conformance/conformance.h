// The conformance harness: random cases per feature, each run on a backend and on `reference` over
// identical host pools and inputs, compared element by element. Used by the GoogleTest suite and by
// `attnrt check`.
//
// A case is fully described by a CaseSpec; make_case draws its values; materialize builds a fresh,
// identical set of pools from it (request rows, allocator, KV cache with the prefix KV stored
// through the pool, the step's ForwardBatch) as often as needed, so that every backend under test
// stores this step's k/v into pools of its own.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/options.h"
#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/tensor.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/model/model_spec.h"
#include "tests/conformance/linear_case.h"

namespace attnrt::conformance {

enum class Feature : uint8_t {
  decode,
  extend_prefix,
  mixed,
  verify_chain,
  verify_tree,
  draft_extend,
  swa,
  softcap,
  sinks,
  non_causal,
  gqa,
  mqa,
  page1,
  page16,
  page64,
  fp8_e4m3,
  fp8_e5m2,
  fp16,
  bf16,
  mla,                 // latent MLA layers: one kv head, V = the first kv_lora_rank K columns
  head_dim_other,      // head dims outside 64 / 128 / 256 (v_head_dim = head_dim)
  v_head_dim_differs,  // v_head_dim != head_dim
  dsa,                 // MLA layers with an indexer: DeepSeek sparse attention (docs/dsa.md)
  gdn,                 // linear-attention layers (docs/linear.md): Gated DeltaNet,
  mamba2,              // Mamba2,
  kda,                 // and Kimi delta attention
};

std::span<const Feature> all_features();
std::string_view feature_name(Feature f);
Feature parse_feature(std::string_view name);  // throws attnrt::Error listing the names
// "" when the caps claim everything the feature's cases need, else what is missing.
std::string unsupported_reason(const BackendCaps& caps, Feature f);

// Everything that defines a case except the random values.
struct CaseSpec {
  std::string label = "custom";  // the feature name for generated cases
  uint64_t seed = 0;             // draws the values (q/k/v, prefix KV, sinks) and the page scatter
  ForwardMode mode = ForwardMode::EXTEND;
  std::vector<LayerSpec> layers;  // layer_id = index; every layer is run in order
  DType act_dtype = DType::f32;   // q, k, v, out
  DType kv_dtype = DType::f32;
  int page_size = 1;
  // Per request: tokens already cached, and this step's query tokens (DECODE: 1; TARGET_VERIFY: the
  // block size; DRAFT_EXTEND: accept_length + 1; DRAFT_EXTEND_V2: the fixed width).
  std::vector<int32_t> prefix_lens, query_lens;
  SpecInfo spec;                  // TARGET_VERIFY: the draft tree of every request
  float k_scale = 1.f, v_scale = 1.f;
  float q_amplitude = 1.f;        // larger values push logits into the soft-cap's bend
  int scatter_pages = 4;          // pages taken and released before allocation: non-adjacent pages
  bool want_lse = false;          // also compare the log-sum-exp output
  int threads = 0;                // Options::num_threads of both backends (0: their default)

  std::string describe() const;   // one line with every parameter, enough to reproduce the case
};

struct LayerValues {
  // Already rounded to act_dtype. prefix_*: [sum(prefix_lens), Hkv, D] request-major; q/k/v/out
  // rows follow the step's token order.
  std::vector<float> prefix_k, prefix_v, q, k, v;
  std::vector<float> sinks;  // [Hq] when the layer has sinks
  // DSA layers: the indexer's inputs. index_q [T, Hi, Di], index_k [T, Di], index_w [T, Hi];
  // prefix_index_k [sum(prefix_lens), Di].
  std::vector<float> index_q, index_k, index_w, prefix_index_k;
};

struct ConformanceCase {
  CaseSpec spec;
  ModelSpec model;
  std::vector<LayerValues> values;  // one per layer
  // A linear-attention case instead (spec, model and values then unused).
  std::optional<LinearCase> linear;
  std::vector<Feature> features;  // every feature the case exercises (counted once per case)
};

// Draws the values of a case. Throws attnrt::Error for an inconsistent spec.
ConformanceCase make_case(CaseSpec spec);
// A random case: a random combination of the features `caps` claims (mode, page size, KV dtype,
// GQA / MQA ratio, window, soft-cap, sinks, non-causal, MLA, DSA, head dims; or one linear layer),
// small shapes mostly and a few bigger ones. With `focus`, that feature is always part of it.
ConformanceCase draw_case(uint64_t seed, const BackendCaps& caps,
                          std::optional<Feature> focus = std::nullopt);
// A random case exercising `feature` (draw_case with it as the focus).
ConformanceCase generate_case(Feature feature, uint64_t seed, const BackendCaps& caps);

// A fresh set of host pools for one run of a case.
struct CaseInstance {
  ModelSpec model;
  Options options;
  std::unique_ptr<ReqToTokenPool> req_to_token;
  KVStorage storage;
  ForwardBatch batch;  // out_cache_loc filled from the allocator
  // Per request: the full-pool slot of every position 0 .. prefix + query, as the allocator
  // returned them (independent of the request rows, for cross-checks).
  std::vector<std::vector<int64_t>> token_slots;

  // The context a backend under test receives: these host pools; `device` is where the backend
  // runs (a CUDA-only backend uploads from the host pools itself).
  BackendContext context(Device device) const;
};
std::unique_ptr<CaseInstance> materialize(const ConformanceCase& c);

struct RunOutput {
  std::vector<HostBuffer> out;  // per layer [T, Hq, Dv] in act_dtype
  std::vector<HostBuffer> lse;  // per layer [T, Hq] fp32 when the spec wants it
};
// Runs one step of the case with a backend created from `entry` on `instance`: begin_step on the
// cache, init_forward_metadata, then forward for every layer (storing this step's k/v). Outputs are
// poisoned with NaN first so that unwritten elements show.
RunOutput run_backend(const BackendEntry& entry, const ConformanceCase& c, CaseInstance& instance);

struct Tolerance {
  double abs = 0, rel = 0;  // |got - want| <= abs + rel * |want|
};
Tolerance tolerance_for(DType out_dtype);

struct CaseResult {
  bool ok = false;
  double max_abs_err = 0, max_rel_err = 0;
  std::string detail;  // the case, and for a failure the first bad element or the error thrown
};
// Runs `entry` and the reference on separate pools built from the same case and compares outputs.
CaseResult run_case(const BackendEntry& entry, const ConformanceCase& c,
                    const Registry& registry = Registry::global());
CaseResult run_case(const std::string& backend_name, const ConformanceCase& c,
                    const Registry& registry = Registry::global());

struct FeatureReport {
  Feature feature{};
  bool skipped = false;
  std::string skip_reason;
  int cases = 0, failures = 0;
  double max_abs_err = 0, max_rel_err = 0;
  std::string first_failure;  // detail of the first failing case
};
struct ConformanceReport {
  std::string backend;
  std::vector<FeatureReport> features;
  bool ok() const;  // no failures (skipped features do not count)
};
struct Progress {
  Feature feature{};
  int case_index = 0, cases = 0;
  const CaseResult* result = nullptr;  // null when the feature is skipped
  std::string_view skip_reason;
};
using ProgressFn = std::function<void(const Progress&)>;

// Every feature of all_features(): the ones the backend's caps claim get `cases_per_feature` cases
// with seeds derived from `seed`; the others are reported as skipped with the reason.
ConformanceReport run_conformance(const BackendEntry& entry, int cases_per_feature, uint64_t seed,
                                  const ProgressFn& progress = {},
                                  const Registry& registry = Registry::global());
ConformanceReport run_conformance(const std::string& backend_name, int cases_per_feature,
                                  uint64_t seed, const ProgressFn& progress = {},
                                  const Registry& registry = Registry::global());

}  // namespace attnrt::conformance
