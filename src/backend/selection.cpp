#include "attnrt/backend/selection.h"

#include <omp.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdlib>
#include <string>
#include <optional>
#include <string_view>
#include <thread>

#include "attnrt/backend/hybrid_attn_backend.h"
#include "attnrt/backend/hybrid_linear_attn_backend.h"
#include "attnrt/core/error.h"

namespace attnrt {

namespace {

// ---------------------------------------------------------------------------------------------
// Backends of the reference engine that attnrt does not have, and which attnrt backend plays their
// role. Users arrive with these names in their launch scripts; "unknown backend" would not help
// them.

enum class ForeignRole { nvidia_gpu, cpu, gpu_or_cpu, other_hardware, linear_kernels };

struct ForeignBackend {
  std::string_view name;
  std::string_view what;
  ForeignRole role;
};

constexpr std::array<ForeignBackend, 19> kForeignBackends{{
    {"flashinfer", "FlashInfer paged-attention kernels for NVIDIA GPUs", ForeignRole::nvidia_gpu},
    {"triton", "Triton kernels for GPUs", ForeignRole::nvidia_gpu},
    {"fa3", "FlashAttention-3 kernels for Hopper GPUs", ForeignRole::nvidia_gpu},
    {"fa4", "FlashAttention-4 kernels for Blackwell GPUs", ForeignRole::nvidia_gpu},
    {"flashmla", "FlashMLA decode kernels for Hopper GPUs", ForeignRole::nvidia_gpu},
    {"cutlass_mla", "CUTLASS MLA kernels for Blackwell GPUs", ForeignRole::nvidia_gpu},
    {"trtllm_mha", "TensorRT-LLM attention kernels for Blackwell GPUs", ForeignRole::nvidia_gpu},
    {"trtllm_mla", "TensorRT-LLM MLA kernels for Blackwell GPUs", ForeignRole::nvidia_gpu},
    {"tokenspeed_mla", "MLA kernels for Blackwell GPUs", ForeignRole::nvidia_gpu},
    {"cutedsl_mla", "CuTe-DSL MLA kernels for Blackwell GPUs", ForeignRole::nvidia_gpu},
    {"dual_chunk_flash_attn", "dual-chunk attention for long-context Qwen models",
     ForeignRole::nvidia_gpu},
    {"torch_native", "PyTorch scaled_dot_product_attention", ForeignRole::gpu_or_cpu},
    {"flex_attention", "PyTorch FlexAttention", ForeignRole::gpu_or_cpu},
    {"intel_amx", "Intel AMX kernels for Xeon CPUs", ForeignRole::cpu},
    {"aiter", "AMD ROCm kernels", ForeignRole::other_hardware},
    {"wave", "AMD ROCm Wave kernels", ForeignRole::other_hardware},
    {"ascend", "Huawei Ascend NPU kernels", ForeignRole::other_hardware},
    {"intel_xpu", "Intel GPU kernels", ForeignRole::other_hardware},
    {"cutedsl", "CuTe-DSL linear-attention kernels", ForeignRole::linear_kernels},
}};

// The reference engine's DSA kernel backends (its --nsa-prefill-backend / --nsa-decode-backend).
constexpr std::array<std::pair<std::string_view, std::string_view>, 9> kForeignDsaBackends{{
    {"flashmla_sparse", "FlashMLA's sparse MLA kernels (bf16 latent, prefill)"},
    {"flashmla_kv", "FlashMLA's sparse decode kernels over the fp8 latent cache"},
    {"flashmla_auto", "the choice between flashmla_sparse and flashmla_kv"},
    {"flashmla_prefill", "FlashMLA's sparse prefill kernels (older name)"},
    {"flashmla_decode", "FlashMLA's sparse decode kernels (older name)"},
    {"fa3", "FlashAttention-3 over the selected keys"},
    {"tilelang", "TileLang sparse MLA kernels"},
    {"aiter", "AMD ROCm sparse MLA kernels"},
    {"trtllm", "TensorRT-LLM sparse MLA kernels for Blackwell"},
}};

const ForeignBackend* find_foreign(const std::string& name) {
  for (const auto& f : kForeignBackends) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Formatting helpers for messages.

std::string join_or(const std::vector<std::string>& items) {
  if (items.empty()) return "";
  if (items.size() == 1) return items[0];
  std::string out;
  for (size_t i = 0; i + 1 < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out + " or " + items.back();
}

std::string describe_layers(const std::vector<int>& ids, size_t total) {
  constexpr size_t kShown = 6;
  std::vector<int> shown(ids.begin(), ids.begin() + std::min(ids.size(), kShown));
  return fmt::format("{} of {} layers: {}{}", ids.size(), total, fmt::join(shown, ", "),
                     ids.size() > kShown ? ", ..." : "");
}

std::string dtype_list(const std::vector<DType>& dtypes) {
  std::vector<std::string> names;
  for (DType t : dtypes) names.emplace_back(dtype_name(t));
  return fmt::format("{}", fmt::join(names, ", "));
}

std::string device_list(const std::vector<DeviceKind>& devices) {
  std::vector<std::string> names;
  for (DeviceKind d : devices) names.push_back(d == DeviceKind::cuda ? "cuda" : "cpu");
  return fmt::format("{}", fmt::join(names, ", "));
}

template <typename T>
bool contains(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// ---------------------------------------------------------------------------------------------
// What the model needs from a full-attention backend, gathered once.

struct ModelNeeds {
  std::string model_name;
  size_t num_layers = 0;
  std::vector<int> attention_layers;  // layers with a KV cache
  std::vector<int> window_layers, softcap_layers, sink_layers, mla_layers, non_causal_layers;
  std::vector<int> dsa_layers;
  int dsa_topk = 0;  // index_topk of the first DSA layer
  // (layer kind, layer ids) for each linear kind the model has, in LayerKind order.
  std::vector<std::pair<LayerKind, std::vector<int>>> linear;

  explicit ModelNeeds(const ModelSpec& model)
      : model_name(model.name), num_layers(model.layers.size()) {
    for (const LayerSpec& l : model.layers) {
      if (is_linear_kind(l.kind)) {
        auto it = std::find_if(linear.begin(), linear.end(),
                               [&](const auto& e) { return e.first == l.kind; });
        if (it == linear.end()) {
          linear.push_back({l.kind, {}});
          it = linear.end() - 1;
        }
        it->second.push_back(l.layer_id);
        continue;
      }
      attention_layers.push_back(l.layer_id);
      if (l.sliding_window >= 0) window_layers.push_back(l.layer_id);
      if (l.logit_cap > 0.f) softcap_layers.push_back(l.layer_id);
      if (l.has_sinks) sink_layers.push_back(l.layer_id);
      if (l.kind == LayerKind::mla) mla_layers.push_back(l.layer_id);
      if (l.has_indexer()) {
        if (dsa_layers.empty()) dsa_topk = l.indexer.index_topk;
        dsa_layers.push_back(l.layer_id);
      }
      if (!l.causal()) non_causal_layers.push_back(l.layer_id);
    }
    std::sort(linear.begin(), linear.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
  }
};

// What a backend must support to serve one role (a full-attention phase or a linear phase).
struct Requirements {
  bool full = true;  // serves the attention layers (false: serves the linear layers)
  int page_size = 1;
  DType kv_dtype = DType::bf16;
  std::string kv_dtype_text;  // as the user wrote it, for messages
  int spec_topk = 0;          // > 0: this role serves TARGET_VERIFY / DRAFT_EXTEND
  std::string spec_reason;    // why it serves verify (which mode), for messages
};

// Why a backend cannot serve a role: `text` is a clause that follows "backend 'x' ...", `kind`
// says which option could fix it.
struct Problem {
  enum Kind { model, page_size, kv_dtype, speculative } kind;
  std::string text;
};

Problem problem(Problem::Kind kind, std::string text) { return Problem{kind, std::move(text)}; }

// The first reason why `entry` cannot serve `req` for this model; nullopt when it can.
// Availability on this machine is checked separately.
std::optional<Problem> first_problem(const BackendEntry& entry, const Requirements& req,
                                     const ModelNeeds& needs, const ModelSpec& model) {
  const BackendCaps& caps = entry.caps;
  if (req.full) {
    if (!needs.attention_layers.empty() && !caps.full_attention) {
      return problem(
          Problem::model,
          fmt::format("serves only linear-attention layers, but model '{}' has attention layers "
                      "({})",
                      needs.model_name, describe_layers(needs.attention_layers, needs.num_layers)));
    }
    if (!caps.page_sizes.empty() && !contains(caps.page_sizes, req.page_size)) {
      return problem(Problem::page_size,
                     fmt::format("does not support --page-size {} (its native page sizes are {})",
                                 req.page_size, fmt::join(caps.page_sizes, ", ")));
    }
    if (!contains(caps.kv_dtypes, req.kv_dtype)) {
      return problem(
          Problem::kv_dtype,
          fmt::format("does not support --kv-cache-dtype {} (its KV cache dtypes are {})",
                      req.kv_dtype_text, dtype_list(caps.kv_dtypes)));
    }
    struct Feature {
      const std::vector<int>& layers;
      bool supported;
      std::string_view what;
    };
    const Feature features[] = {
        {needs.window_layers, caps.sliding_window, "sliding-window attention"},
        {needs.softcap_layers, caps.softcap, "logit soft-capping"},
        {needs.sink_layers, caps.sinks, "attention sinks"},
        {needs.mla_layers, caps.mla, "MLA (multi-head latent attention)"},
        {needs.dsa_layers, caps.dsa, "DSA (DeepSeek sparse attention: indexer and top-k)"},
        {needs.non_causal_layers, caps.non_causal, "non-causal (bidirectional) attention"},
    };
    for (const Feature& f : features) {
      if (!f.layers.empty() && !f.supported) {
        return problem(Problem::model,
                       fmt::format("does not support {}, which model '{}' uses ({})", f.what,
                                   needs.model_name, describe_layers(f.layers, needs.num_layers)));
      }
    }
    if (!caps.head_dims.empty()) {
      for (const LayerSpec& l : model.layers) {
        if (is_linear_kind(l.kind)) continue;
        const int dims[] = {l.head_dim, l.v_head_dim > 0 ? l.v_head_dim : l.head_dim};
        for (int d : dims) {
          if (!contains(caps.head_dims, d)) {
            return problem(
                Problem::model,
                fmt::format("does not support head dim {} (model '{}' layer {}); its head dims "
                            "are {}",
                            d, needs.model_name, l.layer_id, fmt::join(caps.head_dims, ", ")));
          }
        }
      }
    }
  } else {
    for (const auto& [kind, layers] : needs.linear) {
      if (!contains(caps.linear_kinds, kind)) {
        return problem(Problem::model,
                       fmt::format("does not serve {} layers, which model '{}' has ({})",
                                   layer_kind_name(kind), needs.model_name,
                                   describe_layers(layers, needs.num_layers)));
      }
    }
  }
  if (req.spec_topk == 1 && !caps.spec_topk1) {
    return problem(
        Problem::speculative,
        fmt::format("does not support chain verify (--speculative-eagle-topk 1), which it would "
                    "serve {}",
                    req.spec_reason));
  }
  if (req.spec_topk > 1 && !caps.spec_topk_gt1) {
    return problem(
        Problem::speculative,
        fmt::format("does not support tree verify (--speculative-eagle-topk {}), which it would "
                    "serve {}",
                    req.spec_topk, req.spec_reason));
  }
  return std::nullopt;
}

std::string unavailable_reason(const BackendEntry& entry) {
  return entry.unavailable_reason ? entry.unavailable_reason() : std::string();
}

// Registered backends, available here, that could serve `req` in place of `except`; the
// auto-selectable ones first (reference, the slow oracle, last).
std::vector<std::string> alternatives(const Registry& registry, const Requirements& req,
                                      const ModelNeeds& needs, const ModelSpec& model,
                                      const std::string& except) {
  std::vector<std::string> first, last;
  for (const BackendEntry& e : registry.entries()) {
    if (e.name == except || !unavailable_reason(e).empty()) continue;
    if (first_problem(e, req, needs, model)) continue;
    (e.auto_selectable ? first : last).push_back(e.name);
  }
  first.insert(first.end(), last.begin(), last.end());
  return first;
}

// ---------------------------------------------------------------------------------------------
// One role to fill: the full-attention prefill/decode phases or the linear prefill/decode phases.

struct Role {
  std::string_view phase;  // "prefill" / "decode" / "linear prefill" / "linear decode"
  std::string name;        // resolved backend
  std::string flag;        // the option the name came from ("" = auto-selected)
  Requirements req;
};

[[noreturn]] void fail_unknown(const Registry& registry, const std::string& flag,
                               const std::string& name) {
  if (name == "dsa" || name == "nsa") {
    fail("{} {}: '{}' routes the two phases of a DSA model to their backends; name it with "
         "--attention-backend {} and choose the phases' backends with --dsa-prefill-backend / "
         "--dsa-decode-backend",
         flag, name, name, name);
  }
  std::string note = foreign_backend_note(name);
  if (note.empty()) {
    // A DSA kernel name of the reference engine given where a whole backend is named.
    std::vector<std::string> dsa_names;
    for (const BackendEntry& e : registry.entries()) {
      if (e.caps.dsa && unavailable_reason(e).empty()) dsa_names.push_back(e.name);
    }
    note = foreign_dsa_backend_note(name, dsa_names);
    if (!note.empty()) {
      fail("{} {}: {} The DSA phases' backends are chosen with --dsa-prefill-backend / "
           "--dsa-decode-backend (with --attention-backend dsa or unset).",
           flag, name, note);
    }
  }
  if (!note.empty()) {
    fail("{} {}: {} Registered attnrt backends: {}.", flag, name, note,
         fmt::join(registry.names(), ", "));
  }
  fail("{} {}: unknown attention backend; registered backends are {}", flag, name,
       fmt::join(registry.names(), ", "));
}

// Checks an explicitly named backend for its role; throws an error that names the option, the
// value, what the backend lacks and which registered backends would do.
void check_explicit(const Registry& registry, const Role& role, const ModelNeeds& needs,
                    const ModelSpec& model, const std::vector<std::string>& extra_fixes) {
  const BackendEntry* entry = registry.find(role.name);
  if (!entry) fail_unknown(registry, role.flag, role.name);
  std::string why;
  std::vector<std::string> fixes;
  std::string reason = unavailable_reason(*entry);
  if (!reason.empty()) {
    why = fmt::format("is not available on this machine: {}", reason);
  } else if (auto p = first_problem(*entry, role.req, needs, model)) {
    why = p->text;
    if (p->kind == Problem::page_size) {
      std::vector<std::string> sizes;
      for (int s : entry->caps.page_sizes) sizes.push_back(std::to_string(s));
      fixes.push_back(fmt::format("--page-size {}", join_or(sizes)));
    } else if (p->kind == Problem::kv_dtype) {
      std::vector<std::string> dtypes;
      for (DType t : entry->caps.kv_dtypes) dtypes.emplace_back(dtype_name(t));
      fixes.push_back(fmt::format("--kv-cache-dtype {}", join_or(dtypes)));
    } else if (p->kind == Problem::speculative) {
      fixes.insert(fixes.end(), extra_fixes.begin(), extra_fixes.end());
    }
  } else {
    return;
  }
  std::vector<std::string> alts = alternatives(registry, role.req, needs, model, role.name);
  if (!alts.empty()) fixes.push_back(fmt::format("{} {}", role.flag, join_or(alts)));
  if (fixes.empty()) {
    fail(
        "{} {}: backend '{}' {} (it would serve the {} phase). No registered backend available "
        "here can serve it instead (registered: {}).",
        role.flag, role.name, role.name, why, role.phase, fmt::join(registry.names(), ", "));
  }
  fail("{} {}: backend '{}' {} (it would serve the {} phase). Use instead: {}.", role.flag,
       role.name, role.name, why, role.phase, fmt::join(fixes, "; or "));
}

// Auto-selection for the roles in `roles` (all of which inherit the same unset option): the first
// of cuda (on a usable compute capability 9.x device), cpu, then any other auto-selectable backend,
// that is available here and serves every role. Never reference. `devices` (when given: the
// devices the attention layers' backends share) limits the candidates to those running there,
// since the KV cache and the linear state pool live on one device. Appends one reason per role.
std::string auto_select(const Registry& registry, const std::vector<Role*>& roles,
                        const ModelNeeds& needs, const ModelSpec& model, const CudaDeviceInfo& cuda,
                        std::vector<std::string>& reasons,
                        const std::vector<DeviceKind>* devices = nullptr) {
  std::vector<std::string> order = {"cuda", "cpu"};
  for (const BackendEntry& e : registry.entries()) {
    if (e.auto_selectable && !contains(order, e.name)) order.push_back(e.name);
  }
  std::vector<std::string> rejected;  // "<name>: <why not>", in order
  std::string chosen;
  for (const std::string& name : order) {
    const BackendEntry* entry = registry.find(name);
    std::string why_not;
    if (name == "cuda" && !cuda.usable) {
      why_not = fmt::format("no usable CUDA device ({})", cuda.reason);
    } else if (name == "cuda" && cuda.cc_major != 9) {
      why_not = fmt::format(
          "CUDA device {} has compute capability {}.{}; the cuda backend targets "
          "9.x (Hopper)",
          cuda.name, cuda.cc_major, cuda.cc_minor);
    } else if (!entry) {
      why_not = "not registered in this build";
    } else if (!entry->auto_selectable) {
      why_not = "never auto-selected";
    } else if (std::string r = unavailable_reason(*entry); !r.empty()) {
      why_not = fmt::format("not available ({})", r);
    } else if (devices != nullptr &&
               std::none_of(devices->begin(), devices->end(),
                            [&](DeviceKind d) { return contains(entry->caps.devices, d); })) {
      why_not = fmt::format(
          "runs on {}, but the attention layers' backends run on {} (the KV cache and the "
          "state pool live on one device)",
          device_list(entry->caps.devices), device_list(*devices));
    } else {
      for (const Role* role : roles) {
        if (auto p = first_problem(*entry, role->req, needs, model)) {
          why_not = p->text;
          break;
        }
      }
    }
    if (why_not.empty()) {
      chosen = name;
      break;
    }
    rejected.push_back(fmt::format("{}: {}", name, why_not));
  }
  std::vector<std::string> phases;
  for (const Role* role : roles) phases.emplace_back(role->phase);
  const bool linear = !roles.front()->req.full;
  std::string reference_note =
      registry.find("reference")
          ? fmt::format(
                "; reference is never auto-selected (it is the slow correctness oracle: "
                "name it with {} to use it)",
                linear ? "--linear-attn-backend" : "--attention-backend")
          : "";
  if (chosen.empty()) {
    fail("no backend can be auto-selected for the {} phase{} of model '{}': {}{}",
         fmt::join(phases, " and "), phases.size() > 1 ? "s" : "", needs.model_name,
         fmt::join(rejected, "; "), reference_note);
  }
  std::string because;
  if (chosen == "cuda") {
    because = fmt::format(
        "CUDA device {} (compute capability {}.{}) and cuda supports everything "
        "the run needs",
        cuda.name, cuda.cc_major, cuda.cc_minor);
  } else {
    because = rejected.empty() ? fmt::format("{} supports everything the run needs", chosen)
                               : fmt::format("{}", fmt::join(rejected, "; "));
  }
  for (Role* role : roles) {
    role->name = chosen;
    reasons.push_back(
        fmt::format("{}: {} (auto) — {}{}", role->phase, chosen, because, reference_note));
  }
  return chosen;
}

// Resolves one pair of phase options by the rule of reference-semantics §5.2 and fills the two
// roles (auto-selecting when a phase inherits an unset backend).
void resolve_pair(const Registry& registry, const std::string& common_flag,
                  const std::string& common, const std::string& prefill_flag,
                  const std::string& prefill, const std::string& decode_flag,
                  const std::string& decode, Role& prefill_role, Role& decode_role,
                  const ModelNeeds& needs, const ModelSpec& model, const CudaDeviceInfo& cuda,
                  std::vector<std::string>& reasons,
                  const std::vector<DeviceKind>* devices = nullptr) {
  std::string base = common;
  std::string base_flag = common_flag;
  if (!prefill.empty() && prefill == decode) {
    base = prefill;
    base_flag = prefill_flag;
  }
  prefill_role.name = prefill.empty() ? base : prefill;
  prefill_role.flag = prefill.empty() ? base_flag : prefill_flag;
  decode_role.name = decode.empty() ? base : decode;
  decode_role.flag = decode.empty() ? base_flag : decode_flag;
  if (base.empty()) {
    std::vector<Role*> inheriting;
    if (prefill.empty()) inheriting.push_back(&prefill_role);
    if (decode.empty()) inheriting.push_back(&decode_role);
    if (!inheriting.empty())
      auto_select(registry, inheriting, needs, model, cuda, reasons, devices);
    for (Role* r : inheriting) r->flag.clear();
  }
  for (Role* r : {&prefill_role, &decode_role}) {
    if (!r->flag.empty())
      reasons.push_back(fmt::format("{}: {} — set by {}", r->phase, r->name, r->flag));
  }
}

// The phase options of the attention layers after the DSA rule (docs/dsa.md "Options"): a model
// with an indexer runs DSA when --attention-backend is dsa, nsa (deprecated) or unset, its phases
// then taken from --dsa-prefill-backend / --dsa-decode-backend (else the phase options, else
// auto among the backends that serve DSA). Records the choice in sel.reasons, sel.dsa and
// sel.warnings; throws for a DSA name without an indexer, for DSA options beside another named
// backend, and for the reference engine's DSA kernel names.
struct DsaPhases {
  std::string common, prefill, decode;
  std::string prefill_flag = "--prefill-attention-backend";
  std::string decode_flag = "--decode-attention-backend";
};

DsaPhases resolve_dsa(const Options& o, const ModelNeeds& needs, const Registry& registry,
                      Selection& sel) {
  DsaPhases p{o.attention_backend, o.prefill_attention_backend, o.decode_attention_backend};
  const bool named = o.attention_backend == "dsa" || o.attention_backend == "nsa";
  if (o.attention_backend == "nsa") {
    sel.warnings.push_back(
        "--attention-backend nsa is deprecated: use --attention-backend dsa (the same DSA "
        "router)");
    sel.reasons.push_back("warning: " + sel.warnings.back());
  }
  const bool has_indexer = !needs.dsa_layers.empty();
  if (named) {
    ATTNRT_CHECK(has_indexer,
                 "--attention-backend {}: model '{}' has no indexer (no layer with index_topk), "
                 "so there is no sparse attention to route; leave --attention-backend unset or "
                 "name a backend ({})",
                 o.attention_backend, needs.model_name, fmt::join(registry.names(), ", "));
  }
  const std::pair<const char*, const std::string*> dsa_opts[] = {
      {"--dsa-prefill-backend", &o.dsa_prefill_backend},
      {"--dsa-decode-backend", &o.dsa_decode_backend}};
  std::vector<std::string> dsa_names;
  for (const BackendEntry& e : registry.entries()) {
    if (e.caps.dsa && unavailable_reason(e).empty()) dsa_names.push_back(e.name);
  }
  for (const auto& [flag, value] : dsa_opts) {
    if (value->empty()) continue;
    if (!registry.find(*value)) {
      const std::string note = foreign_dsa_backend_note(*value, dsa_names);
      if (!note.empty()) fail("{} {}: {}", flag, *value, note);
      fail_unknown(registry, flag, *value);
    }
    if (!has_indexer) {
      sel.reasons.push_back(fmt::format("{} {} has no effect: model '{}' has no indexer (DSA)",
                                        flag, *value, needs.model_name));
    } else if (!named && !o.attention_backend.empty()) {
      fail("{} {}: --attention-backend {} names the backend of every phase; choose the DSA "
           "phases' backends with --attention-backend dsa (or unset) instead",
           flag, *value, o.attention_backend);
    }
  }
  if (!has_indexer || (!named && !o.attention_backend.empty())) return p;
  sel.dsa = true;
  p.common.clear();
  if (!o.dsa_prefill_backend.empty()) {
    p.prefill = o.dsa_prefill_backend;
    p.prefill_flag = "--dsa-prefill-backend";
  }
  if (!o.dsa_decode_backend.empty()) {
    p.decode = o.dsa_decode_backend;
    p.decode_flag = "--dsa-decode-backend";
  }
  sel.reasons.push_back(fmt::format(
      "dsa: on ({}) — model '{}' has an indexer ({}; index_topk {}): every query token attends "
      "only to the keys its indexer selects (docs/dsa.md); the phases' backends come from "
      "--dsa-prefill-backend / --dsa-decode-backend, else the phase options, else auto among "
      "the backends that serve DSA ({})",
      named ? fmt::format("--attention-backend {}", o.attention_backend)
            : std::string("auto: --attention-backend unset"),
      needs.model_name, describe_layers(needs.dsa_layers, needs.num_layers),
      needs.dsa_topk, fmt::join(dsa_names, ", ")));
  return p;
}

int max_tree_draft_tokens(int steps, int topk) {
  // The draft stage scores topk candidates at its first step and topk*topk at every later one,
  // and the verify block keeps the best num_draft_tokens - 1 of them plus the root.
  return 1 + topk + (steps - 1) * topk * topk;
}

// Validates the speculative options (§9.2) and returns the resolved (topk, draft tokens).
std::pair<int, int> resolve_speculative(const Options& o, std::vector<std::string>& reasons) {
  ATTNRT_CHECK(o.speculative_num_steps >= 0,
               "--speculative-num-steps {} is negative: use 0 (off) or the draft depth (>= 1)",
               o.speculative_num_steps);
  ATTNRT_CHECK(o.speculative_eagle_topk >= 0,
               "--speculative-eagle-topk {} is negative: use 1 (chain) or more (tree), or leave "
               "it unset",
               o.speculative_eagle_topk);
  ATTNRT_CHECK(o.speculative_num_draft_tokens >= 0,
               "--speculative-num-draft-tokens {} is negative: leave it unset or give the verify "
               "block size (root included)",
               o.speculative_num_draft_tokens);
  if (o.speculative_num_steps == 0) {
    ATTNRT_CHECK(o.speculative_eagle_topk == 0,
                 "--speculative-eagle-topk {} is set but --speculative-num-steps is not: set "
                 "--speculative-num-steps (the draft depth) as well, or unset both",
                 o.speculative_eagle_topk);
    ATTNRT_CHECK(o.speculative_num_draft_tokens == 0,
                 "--speculative-num-draft-tokens {} is set but --speculative-num-steps is not: set "
                 "--speculative-num-steps (the draft depth) as well, or unset both",
                 o.speculative_num_draft_tokens);
    return {0, 0};
  }
  const int steps = o.speculative_num_steps;
  const int topk = o.speculative_eagle_topk == 0 ? 1 : o.speculative_eagle_topk;
  int drafts = o.speculative_num_draft_tokens;
  if (topk == 1) {
    ATTNRT_CHECK(
        drafts == 0 || drafts == steps + 1,
        "--speculative-num-draft-tokens {} does not fit a chain (--speculative-eagle-topk "
        "1) of --speculative-num-steps {}: a chain verifies num_steps + 1 = {} tokens (the "
        "drafts plus the root). attnrt does not rewrite it: pass {} or leave it unset",
        drafts, steps, steps + 1, steps + 1);
    drafts = steps + 1;
  } else {
    const int max_drafts = max_tree_draft_tokens(steps, topk);
    ATTNRT_CHECK(drafts != 0,
                 "--speculative-eagle-topk {} (tree verify) needs --speculative-num-draft-tokens "
                 "(the verify block size, root included): between 2 and {} for "
                 "--speculative-num-steps {}",
                 topk, max_drafts, steps);
    ATTNRT_CHECK(drafts >= 2 && drafts <= max_drafts,
                 "--speculative-num-draft-tokens {} is out of range for a tree of "
                 "--speculative-eagle-topk {} and --speculative-num-steps {}: allowed 2..{} (the "
                 "root plus at most topk + (num_steps - 1) * topk^2 = {} drafted candidates)",
                 drafts, topk, steps, max_drafts, max_drafts - 1);
  }
  reasons.push_back(fmt::format(
      "speculative: {} verify, topk {}{}, {} draft steps, {} tokens per verify block{}",
      topk == 1 ? "chain" : "tree", topk, o.speculative_eagle_topk == 0 ? " (default)" : "", steps,
      drafts,
      o.speculative_num_draft_tokens == 0 ? " (num_steps + 1, the default for a chain)" : ""));
  return {topk, drafts};
}

DType resolve_kv_dtype(const Options& o, const ModelSpec& model,
                       std::vector<std::string>& reasons) {
  if (o.kv_cache_dtype == "auto") {
    reasons.push_back(
        fmt::format("kv cache dtype: {} (auto = the model's dtype)", dtype_name(model.dtype)));
    return model.dtype;
  }
  DType t;
  try {
    t = parse_dtype(o.kv_cache_dtype);
  } catch (const Error& e) {
    fail("--kv-cache-dtype {}: {} (or auto = the model's dtype)", o.kv_cache_dtype, e.what());
  }
  reasons.push_back(fmt::format("kv cache dtype: {} (set by --kv-cache-dtype)", dtype_name(t)));
  return t;
}

// All roles must share a device: the pools live in one place.
void check_devices(const Registry& registry, const std::vector<const Role*>& roles) {
  std::vector<DeviceKind> common = {DeviceKind::cpu, DeviceKind::cuda};
  for (const Role* r : roles) {
    const auto& devices = registry.get(r->name).caps.devices;
    std::erase_if(common, [&](DeviceKind d) { return !contains(devices, d); });
  }
  if (!common.empty()) return;
  std::vector<std::string> parts;
  for (const Role* r : roles) {
    parts.push_back(fmt::format("{} backend '{}' ({}) runs on {}", r->phase, r->name,
                                r->flag.empty() ? "auto-selected" : r->flag,
                                device_list(registry.get(r->name).caps.devices)));
  }
  fail(
      "the chosen backends do not share a device, but the KV cache and state pools live on one: "
      "{}. Choose backends of the same device for every phase.",
      fmt::join(parts, "; "));
}

// --fp8-prefill-attention: an e4m3 KV cache and a prefill backend with the fp8 prefill kernel.
// Refused rather than ignored: a user who asks for fp8 tensor cores and would silently get the
// 16-bit path would misread every measurement.
void check_fp8_prefill(const Registry& registry, const Selection& sel,
                       const std::string& kv_dtype_text, std::vector<std::string>& reasons) {
  ATTNRT_CHECK(sel.kv_dtype == DType::e4m3,
               "--fp8-prefill-attention: the KV cache dtype is {} (--kv-cache-dtype {}); the fp8 "
               "prefill kernels read an fp8_e4m3 KV cache: add --kv-cache-dtype fp8_e4m3, or drop "
               "--fp8-prefill-attention",
               dtype_name(sel.kv_dtype), kv_dtype_text);
  std::vector<std::string> capable;
  for (const BackendEntry& e : registry.entries())
    if (e.caps.fp8_prefill_attention) capable.push_back(e.name);
  ATTNRT_CHECK(registry.get(sel.prefill).caps.fp8_prefill_attention,
               "--fp8-prefill-attention: prefill backend '{}' has no fp8 prefill kernel; backends "
               "that have one: {}. Use --prefill-attention-backend {} (on a Hopper GPU), or drop "
               "--fp8-prefill-attention",
               sel.prefill, capable.empty() ? std::string("none") : join_or(capable),
               capable.empty() ? std::string("cuda") : capable.front());
  reasons.push_back(fmt::format(
      "fp8 prefill: prefill tiles of attention layers at head dim 128 on {}'s fp8 tensor cores (q "
      "and the softmax weights in e4m3; set by --fp8-prefill-attention)",
      sel.prefill));
}

}  // namespace

std::string foreign_dsa_backend_note(const std::string& name,
                                     const std::vector<std::string>& dsa_backends) {
  for (const auto& [foreign, what] : kForeignDsaBackends) {
    if (foreign != name) continue;
    return fmt::format(
        "'{}' is a DSA kernel backend of the reference serving engine ({}), not of attnrt. In "
        "attnrt the DSA phases run on attnrt backends that serve DSA: cuda on NVIDIA GPUs (its "
        "own indexer, top-k and sparse MLA kernels), cpu and reference anywhere; usable here: "
        "{}. Leave the option unset to auto-select.",
        name, what, dsa_backends.empty() ? std::string("none") : join_or(dsa_backends));
  }
  return "";
}

std::string foreign_backend_note(const std::string& name) {
  const ForeignBackend* f = find_foreign(name);
  if (!f) return "";
  std::string_view role;
  switch (f->role) {
    case ForeignRole::nvidia_gpu:
      role =
          "In attnrt the cuda backend plays that role on NVIDIA GPUs (cpu on machines without "
          "one).";
      break;
    case ForeignRole::gpu_or_cpu:
      role =
          "In attnrt the cuda backend plays that role on NVIDIA GPUs and the cpu backend on "
          "CPUs.";
      break;
    case ForeignRole::cpu:
      role = "In attnrt the cpu backend plays that role.";
      break;
    case ForeignRole::other_hardware:
      role = "attnrt has no backend for that hardware: use cpu (or cuda on NVIDIA GPUs).";
      break;
    case ForeignRole::linear_kernels:
      role =
          "In attnrt the linear-attention layers are served by the cuda backend on NVIDIA GPUs "
          "and the cpu backend on CPUs.";
      break;
  }
  return fmt::format(
      "'{}' is a backend of the reference serving engine ({}), not of attnrt. {} "
      "Leave the option unset to auto-select.",
      name, f->what, role);
}

int max_num_threads() {
  return 4 * std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

int host_threads_for(int64_t work, int64_t work_per_thread, int max_threads) {
  return static_cast<int>(
      std::clamp<int64_t>(work / work_per_thread, 1, std::max(1, max_threads)));
}

int omp_threads_for(int64_t work, int64_t work_per_thread, int max_threads) {
  return host_threads_for(work, work_per_thread, std::min(max_threads, omp_get_max_threads()));
}

int host_num_threads(const Options* options, std::string_view who, int every_core) {
  if (options != nullptr) {
    ATTNRT_CHECK(options->num_threads >= 0 && options->num_threads <= max_num_threads(),
                 "{}: num_threads = {}; use a thread count in [1, {}] (four per hardware "
                 "thread), or 0 for ATTNRT_NUM_THREADS / every core",
                 who, options->num_threads, max_num_threads());
    if (options->num_threads > 0) return options->num_threads;
  }
  if (const char* env = std::getenv("ATTNRT_NUM_THREADS"); env != nullptr && *env != '\0') {
    const std::string text(env);
    int value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    ATTNRT_CHECK(ec == std::errc() && end == text.data() + text.size() && value > 0 &&
                     value <= max_num_threads(),
                 "ATTNRT_NUM_THREADS = '{}'; expected an integer in [1, {}] (threads of the host "
                 "backends, cpu and reference; four per hardware thread at most), or unset it to "
                 "use every core",
                 text, max_num_threads());
    return value;
  }
  return std::max(1, every_core);
}

Selection resolve_backends(const Options& options, const ModelSpec& model,
                           const Registry& registry) {
  return resolve_backends(options, model, registry, query_cuda());
}

Selection resolve_backends(const Options& o, const ModelSpec& model, const Registry& registry,
                           const CudaDeviceInfo& cuda) {
  Selection sel;
  sel.spec_mode = parse_speculative_attention_mode(o.speculative_attention_mode);
  ATTNRT_CHECK(o.page_size >= 1 && o.page_size <= kMaxPageSize,
               "--page-size {} is not valid: use an integer in [1, {}] (1 = token granularity)",
               o.page_size, kMaxPageSize);
  ATTNRT_CHECK(o.num_threads >= 0 && o.num_threads <= max_num_threads(),
               "--threads {} is not valid: use 0 (automatic) or a thread count in [1, {}] (four "
               "per hardware thread of this machine)",
               o.num_threads, max_num_threads());
  const ModelNeeds needs(model);
  std::vector<std::string> setup_reasons;
  sel.kv_dtype = resolve_kv_dtype(o, model, setup_reasons);
  std::tie(sel.spec_topk, sel.spec_num_draft_tokens) = resolve_speculative(o, setup_reasons);
  const bool verify_on_decode =
      phase_for(ForwardMode::TARGET_VERIFY, sel.spec_mode) == Phase::decode;

  Requirements base;
  base.page_size = o.page_size;
  base.kv_dtype = sel.kv_dtype;
  base.kv_dtype_text = o.kv_cache_dtype == "auto"
                           ? fmt::format("auto (= {})", dtype_name(model.dtype))
                           : o.kv_cache_dtype;
  auto make_role = [&](std::string_view phase, bool full, bool serves_verify) {
    Role r{phase, "", "", base};
    r.req.full = full;
    if (serves_verify && sel.spec_topk > 0) {
      r.req.spec_topk = sel.spec_topk;
      r.req.spec_reason = fmt::format("as the {} backend under --speculative-attention-mode {}",
                                      phase, o.speculative_attention_mode);
    }
    return r;
  };
  Role prefill = make_role("prefill", true, !verify_on_decode);
  Role decode = make_role("decode", true, verify_on_decode);
  const DsaPhases phases = resolve_dsa(o, needs, registry, sel);
  resolve_pair(registry, "--attention-backend", phases.common, phases.prefill_flag, phases.prefill,
               phases.decode_flag, phases.decode, prefill, decode, needs, model, cuda,
               sel.reasons);

  // Verify problems can also be fixed by moving verify to the other phase.
  auto verify_fixes = [&](const Role& other, const Role& self) {
    std::vector<std::string> fixes;
    if (sel.spec_topk == 0 || self.req.spec_topk == 0) return fixes;
    const BackendEntry* e = registry.find(other.name);
    Requirements moved = other.req;
    moved.spec_topk = sel.spec_topk;
    if (e && unavailable_reason(*e).empty() && !first_problem(*e, moved, needs, model)) {
      fixes.push_back(fmt::format("--speculative-attention-mode {} ({} backend '{}' supports it)",
                                  verify_on_decode ? "prefill" : "decode", other.phase,
                                  other.name));
    }
    return fixes;
  };
  for (auto [role, other] : {std::pair{&prefill, &decode}, std::pair{&decode, &prefill}}) {
    if (!role->flag.empty())
      check_explicit(registry, *role, needs, model, verify_fixes(*other, *role));
  }
  sel.prefill = prefill.name;
  sel.decode = decode.name;
  std::vector<const Role*> roles = {&prefill, &decode};

  Role linear_prefill = make_role("linear prefill", false, !verify_on_decode);
  Role linear_decode = make_role("linear decode", false, verify_on_decode);
  if (!needs.linear.empty()) {
    bool any_serves = false;
    for (const BackendEntry& e : registry.entries()) {
      bool all = true;
      for (const auto& [kind, layers] : needs.linear)
        all = all && contains(e.caps.linear_kinds, kind);
      any_serves = any_serves || all;
    }
    if (!any_serves) {
      std::vector<std::string> kinds;
      for (const auto& [kind, layers] : needs.linear) {
        kinds.push_back(fmt::format("{} ({})", layer_kind_name(kind),
                                    describe_layers(layers, needs.num_layers)));
      }
      fail(
          "model '{}' has linear-attention layers: {}. No registered backend serves {} "
          "(registered: {}).",
          needs.model_name, fmt::join(kinds, "; "),
          needs.linear.size() == 1 ? "that kind" : "all of these kinds",
          fmt::join(registry.names(), ", "));
    }
    // Auto-selected linear backends run where the attention layers' backends do.
    std::vector<DeviceKind> full_devices = {DeviceKind::cpu, DeviceKind::cuda};
    for (const Role* r : {&prefill, &decode}) {
      if (const BackendEntry* e = registry.find(r->name)) {
        std::erase_if(full_devices, [&](DeviceKind d) { return !contains(e->caps.devices, d); });
      }
    }
    resolve_pair(registry, "--linear-attn-backend", o.linear_attn_backend,
                 "--linear-attn-prefill-backend", o.linear_attn_prefill_backend,
                 "--linear-attn-decode-backend", o.linear_attn_decode_backend, linear_prefill,
                 linear_decode, needs, model, cuda, sel.reasons,
                 full_devices.empty() ? nullptr : &full_devices);
    for (auto [role, other] :
         {std::pair{&linear_prefill, &linear_decode}, std::pair{&linear_decode, &linear_prefill}}) {
      if (!role->flag.empty()) {
        check_explicit(registry, *role, needs, model, verify_fixes(*other, *role));
      }
    }
    sel.linear_prefill = linear_prefill.name;
    sel.linear_decode = linear_decode.name;
    roles.push_back(&linear_prefill);
    roles.push_back(&linear_decode);
  } else {
    const std::pair<const char*, const std::string*> linear_opts[] = {
        {"--linear-attn-backend", &o.linear_attn_backend},
        {"--linear-attn-prefill-backend", &o.linear_attn_prefill_backend},
        {"--linear-attn-decode-backend", &o.linear_attn_decode_backend}};
    for (const auto& [flag, value] : linear_opts) {
      if (value->empty()) continue;
      if (!registry.find(*value)) fail_unknown(registry, flag, *value);
      sel.reasons.push_back(
          fmt::format("{} {} has no effect: model '{}' has no linear-attention "
                      "layers",
                      flag, *value, needs.model_name));
    }
  }
  check_devices(registry, roles);
  if (o.fp8_prefill_attention) check_fp8_prefill(registry, sel, base.kv_dtype_text, sel.reasons);

  if (sel.hybrid()) {
    sel.reasons.push_back(fmt::format(
        "hybrid: prefill and decode backends differ, so HybridAttnBackend routes DECODE and IDLE "
        "to "
        "{}, EXTEND, MIXED and DRAFT_EXTEND_V2 to {}, and TARGET_VERIFY and DRAFT_EXTEND to {} "
        "(--speculative-attention-mode {})",
        sel.decode, sel.prefill, verify_on_decode ? sel.decode : sel.prefill,
        o.speculative_attention_mode));
  }
  if (!needs.linear.empty()) {
    // Which layers each backend serves: HybridLinearAttnBackend routes by layer id.
    auto phases = [](const std::string& p, const std::string& d, const char* prefix) {
      return p == d ? fmt::format("{} ({}prefill and decode)", p, prefix)
                    : fmt::format("{} ({}prefill) / {} ({}decode)", p, prefix, d, prefix);
    };
    std::vector<std::string> linear_parts;
    for (const auto& [kind, layers] : needs.linear) {
      linear_parts.push_back(
          fmt::format("{} {}", layer_kind_name(kind), describe_layers(layers, needs.num_layers)));
    }
    std::string full_part =
        needs.attention_layers.empty()
            ? std::string("no attention layers")
            : fmt::format("attention {} to {}",
                          describe_layers(needs.attention_layers, needs.num_layers),
                          phases(sel.prefill, sel.decode, ""));
    sel.reasons.push_back(fmt::format(
        "layers: HybridLinearAttnBackend routes {}; {} to {}{}", full_part,
        fmt::join(linear_parts, "; "), phases(sel.linear_prefill, sel.linear_decode, "linear "),
        sel.speculative()
            ? fmt::format("; TARGET_VERIFY and the state commit after it run on the linear {} "
                          "backend",
                          verify_on_decode ? "decode" : "prefill")
            : std::string()));
  }
  sel.reasons.insert(sel.reasons.end(), setup_reasons.begin(), setup_reasons.end());
  auto entry = [&](const std::string& name) { return name.empty() ? nullptr : &registry.get(name); };
  sel.prefill_entry = entry(sel.prefill);
  sel.decode_entry = entry(sel.decode);
  sel.linear_prefill_entry = entry(sel.linear_prefill);
  sel.linear_decode_entry = entry(sel.linear_decode);
  return sel;
}

std::vector<const BackendEntry*> Selection::entries() const {
  std::vector<const BackendEntry*> out;
  for (const BackendEntry* e : {prefill_entry, decode_entry, linear_prefill_entry,
                                linear_decode_entry}) {
    if (e != nullptr) out.push_back(e);
  }
  return out;
}

std::unique_ptr<AttentionBackend> create_backend(const Selection& selection,
                                                 const BackendContext& ctx,
                                                 const Registry& registry) {
  ATTNRT_CHECK(!selection.prefill.empty() && !selection.decode.empty(),
               "create_backend needs a resolved selection (prefill '{}', decode '{}'): call "
               "resolve_backends first",
               selection.prefill, selection.decode);
  ATTNRT_CHECK(selection.linear_prefill.empty() == selection.linear_decode.empty(),
               "create_backend: linear prefill backend '{}' and linear decode backend '{}'; a "
               "resolved selection names both or neither",
               selection.linear_prefill, selection.linear_decode);
  const bool linear = !selection.linear_prefill.empty();
  // The selection's own entries when resolve_backends filled them, else the registry's.
  auto resolved = [&](const std::string& name) -> const BackendEntry& {
    for (const BackendEntry* e : selection.entries()) {
      if (e->name == name) return *e;
    }
    return registry.get(name);
  };
  // Every factory is checked before anything is created: construction may be expensive.
  for (const std::string* name : {&selection.prefill, &selection.decode}) resolved(*name);
  if (linear) {
    for (const std::string* name : {&selection.linear_prefill, &selection.linear_decode}) {
      const BackendEntry& entry = resolved(*name);
      ATTNRT_CHECK(static_cast<bool>(entry.linear_factory),
                   "backend '{}' was chosen for the linear-attention layers but is registered "
                   "without a linear factory, so HybridLinearAttnBackend cannot route those "
                   "layers to it",
                   *name);
    }
  }
  auto make = [&](const std::string& name, bool for_linear) {
    const BackendEntry& entry = resolved(name);
    const auto& factory = for_linear ? entry.linear_factory : entry.factory;
    ATTNRT_CHECK(static_cast<bool>(factory), "backend '{}' is registered without a {}factory",
                 name, for_linear ? "linear " : "");
    std::unique_ptr<AttentionBackend> backend = factory(ctx);
    ATTNRT_CHECK(backend != nullptr, "the {}factory of backend '{}' returned no backend",
                 for_linear ? "linear " : "", name);
    return backend;
  };
  std::unique_ptr<AttentionBackend> full =
      selection.hybrid() ? std::make_unique<HybridAttnBackend>(ctx, make(selection.prefill, false),
                                                               make(selection.decode, false))
                         : make(selection.prefill, false);
  if (!linear) return full;
  std::unique_ptr<AttentionBackend> linear_decode =
      selection.linear_decode != selection.linear_prefill ? make(selection.linear_decode, true)
                                                          : nullptr;
  return std::make_unique<HybridLinearAttnBackend>(
      ctx, std::move(full), make(selection.linear_prefill, true), std::move(linear_decode));
}

}  // namespace attnrt
