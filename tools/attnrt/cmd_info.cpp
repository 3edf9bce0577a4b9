// `attnrt info`: what this machine and build offer (CPU, CUDA device, every registered backend with
// its support matrix) and, for a model, which backend serves each phase and why.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <algorithm>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/backend/registry.h"
#include "attnrt/backend/selection.h"
#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/model/model_spec.h"
#include "attnrt/runtime/attention_runtime.h"
#include "attnrt/runtime/communicator.h"
#include "backends/cpu/cpu_backend.h"
#include "tools/attnrt/cli_options.h"
#include "tools/attnrt/commands.h"

#ifndef ATTNRT_VERSION
#error \
    "ATTNRT_VERSION must be defined by the build (CMakeLists.txt sets it from the project version)"
#endif

namespace attnrt::cli {

namespace {

// "2.28.7" when the NCCL library loads (GPU or not), else "".
std::string nccl_version_text() {
  if (!built_with_cuda()) return {};
  try {
    const int v = nccl_version();
    return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
  } catch (const Error&) {
    return {};
  }
}

using nlohmann::json;

struct InfoArgs {
  std::string model;
  bool explain = false;
  bool json = false;
  Options options;
};

struct CpuInfo {
  std::string model;
  unsigned logical_cores = 0;
  std::string simd_target;  // what the cpu backend's kernels dispatch to
};

// "model name" on x86; ARM kernels may only give "Hardware" or "CPU part".
CpuInfo query_cpu() {
  CpuInfo info;
  info.logical_cores = std::thread::hardware_concurrency();
  std::ifstream in("/proc/cpuinfo");
  std::string line, fallback;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
    std::string value = line.substr(line.find_first_not_of(" \t", colon + 1) == std::string::npos
                                        ? line.size()
                                        : line.find_first_not_of(" \t", colon + 1));
    if (key == "model name" && !value.empty()) {
      info.model = value;
      break;
    }
    if ((key == "Hardware" || key == "CPU part") && fallback.empty()) fallback = key + " " + value;
  }
  if (info.model.empty()) info.model = fallback.empty() ? "unknown CPU" : fallback;
  info.simd_target = cpu_simd_target();
  return info;
}

std::string yes_no(bool b) { return b ? "yes" : "-"; }

std::string devices_text(const std::vector<DeviceKind>& devices) {
  std::vector<std::string> out;
  for (DeviceKind d : devices) out.push_back(d == DeviceKind::cuda ? "cuda" : "cpu");
  return out.empty() ? "-" : fmt::format("{}", fmt::join(out, ","));
}

std::string ints_text(const std::vector<int>& v) {
  return v.empty() ? "any" : fmt::format("{}", fmt::join(v, ","));
}

std::string dtypes_text(const std::vector<DType>& v) {
  std::vector<std::string> out;
  for (DType t : v) out.emplace_back(dtype_name(t));
  return out.empty() ? "-" : fmt::format("{}", fmt::join(out, ","));
}

std::string kinds_text(const std::vector<LayerKind>& v) {
  std::vector<std::string> out;
  for (LayerKind k : v) out.emplace_back(layer_kind_name(k));
  return out.empty() ? "-" : fmt::format("{}", fmt::join(out, ","));
}

std::string gib(size_t bytes) { return fmt::format("{:.1f} GiB", bytes / double(1ull << 30)); }

std::string cuda_version(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

// ---------------------------------------------------------------------------------------------
// The support matrix: one row per capability, one column per backend.

struct MatrixRow {
  std::string label;
  std::string (*cell)(const BackendEntry&);
};

const std::vector<MatrixRow>& matrix_rows() {
  static const std::vector<MatrixRow> rows = {
      {"available here",
       [](const BackendEntry& e) {
         return std::string(e.unavailable_reason && !e.unavailable_reason().empty() ? "no" : "yes");
       }},
      {"auto-selectable", [](const BackendEntry& e) { return yes_no(e.auto_selectable); }},
      {"devices", [](const BackendEntry& e) { return devices_text(e.caps.devices); }},
      {"page sizes", [](const BackendEntry& e) { return ints_text(e.caps.page_sizes); }},
      {"KV dtypes", [](const BackendEntry& e) { return dtypes_text(e.caps.kv_dtypes); }},
      {"head dims", [](const BackendEntry& e) { return ints_text(e.caps.head_dims); }},
      {"full attention", [](const BackendEntry& e) { return yes_no(e.caps.full_attention); }},
      {"spec topk=1", [](const BackendEntry& e) { return yes_no(e.caps.spec_topk1); }},
      {"spec topk>1", [](const BackendEntry& e) { return yes_no(e.caps.spec_topk_gt1); }},
      {"sliding window", [](const BackendEntry& e) { return yes_no(e.caps.sliding_window); }},
      {"softcap", [](const BackendEntry& e) { return yes_no(e.caps.softcap); }},
      {"sinks", [](const BackendEntry& e) { return yes_no(e.caps.sinks); }},
      {"MLA", [](const BackendEntry& e) { return yes_no(e.caps.mla); }},
      {"DSA", [](const BackendEntry& e) { return yes_no(e.caps.dsa); }},
      {"non-causal", [](const BackendEntry& e) { return yes_no(e.caps.non_causal); }},
      {"CUDA graphs", [](const BackendEntry& e) { return yes_no(e.caps.cuda_graphs); }},
      {"linear kinds", [](const BackendEntry& e) { return kinds_text(e.caps.linear_kinds); }},
  };
  return rows;
}

void print_matrix(const Registry& registry) {
  const auto& entries = registry.entries();
  size_t label_width = 0;
  for (const auto& row : matrix_rows()) label_width = std::max(label_width, row.label.size());
  std::vector<size_t> widths;
  for (const auto& e : entries) {
    size_t w = e.name.size();
    for (const auto& row : matrix_rows()) w = std::max(w, row.cell(e).size());
    widths.push_back(w);
  }
  auto print_row = [&](const std::string& label, auto&& cell) {
    std::string line = fmt::format("  {:<{}}", label, label_width);
    for (size_t i = 0; i < entries.size(); ++i) {
      line += fmt::format("  {:<{}}", cell(entries[i]), widths[i]);
    }
    fmt::print("{}\n", line.substr(0, line.find_last_not_of(' ') + 1));
  };
  print_row("", [](const BackendEntry& e) { return e.name; });
  for (const auto& row : matrix_rows()) print_row(row.label, row.cell);
}

json caps_json(const BackendCaps& c) {
  std::vector<std::string> devices, dtypes, kinds;
  for (DeviceKind d : c.devices) devices.push_back(d == DeviceKind::cuda ? "cuda" : "cpu");
  for (DType t : c.kv_dtypes) dtypes.emplace_back(dtype_name(t));
  for (LayerKind k : c.linear_kinds) kinds.emplace_back(layer_kind_name(k));
  return {{"devices", devices},
          {"page_sizes", c.page_sizes},
          {"kv_dtypes", dtypes},
          {"head_dims", c.head_dims},
          {"full_attention", c.full_attention},
          {"spec_topk1", c.spec_topk1},
          {"spec_topk_gt1", c.spec_topk_gt1},
          {"sliding_window", c.sliding_window},
          {"softcap", c.softcap},
          {"sinks", c.sinks},
          {"mla", c.mla},
          {"dsa", c.dsa},
          {"non_causal", c.non_causal},
          {"cuda_graphs", c.cuda_graphs},
          {"deterministic_graphs", c.deterministic_graphs},
          {"dsa_graphs", c.dsa_graphs},
          {"linear_kinds", kinds}};
}

// ---------------------------------------------------------------------------------------------
// Model summary.

struct ModelSummary {
  std::map<std::string, int> kinds;   // layer kind -> count
  std::map<std::string, int> shapes;  // "32 q / 8 kv heads, head_dim 128" -> count
  std::map<int, int> windows;         // W -> count
  std::map<std::string, int> linear;  // linear-layer shape -> count
  int softcap_layers = 0, sink_layers = 0, non_causal_layers = 0;
};

ModelSummary summarize(const ModelSpec& m) {
  ModelSummary s;
  for (const LayerSpec& l : m.layers) {
    s.kinds[std::string(layer_kind_name(l.kind))]++;
    if (is_linear_kind(l.kind)) {
      const LinearSpec& x = l.linear;
      std::string shape =
          l.kind == LayerKind::mamba2
              ? fmt::format(
                    "mamba2: {} heads x head_dim {}, d_state {}, {} groups, conv {}, "
                    "chunk {}",
                    x.num_v_heads, x.head_v_dim, x.d_state, x.n_groups, x.conv_kernel, x.chunk_size)
              : fmt::format("{}: {} key / {} value heads, key dim {}, value dim {}, conv {}",
                            layer_kind_name(l.kind), x.num_k_heads, x.num_v_heads, x.head_k_dim,
                            x.head_v_dim, x.conv_kernel);
      s.linear[shape]++;
      continue;
    }
    std::string shape = fmt::format("{}: {} q / {} kv heads, head_dim {}, v_head_dim {}",
                                    layer_kind_name(l.kind), l.num_q_heads, l.num_kv_heads,
                                    l.head_dim, l.v_head_dim > 0 ? l.v_head_dim : l.head_dim);
    if (l.kind == LayerKind::mla) {
      shape += fmt::format(" (kv_lora_rank {}, rope dim {})", l.kv_lora_rank, l.qk_rope_head_dim);
    }
    if (l.has_indexer()) {
      shape += fmt::format("; DSA indexer {} heads x {}, top {} keys per query token",
                           l.indexer.index_n_heads, l.indexer.index_head_dim,
                           l.indexer.index_topk);
    }
    s.shapes[shape]++;
    if (l.sliding_window >= 0) s.windows[l.sliding_window]++;
    if (l.logit_cap > 0.f) s.softcap_layers++;
    if (l.has_sinks) s.sink_layers++;
    if (!l.causal()) s.non_causal_layers++;
  }
  return s;
}

void print_model(const ModelSpec& m) {
  ModelSummary s = summarize(m);
  std::vector<std::string> kinds;
  for (const auto& [k, n] : s.kinds) kinds.push_back(fmt::format("{} {}", n, k));
  fmt::print("\nModel {} ({}, tensor parallel {}, max context {}): {} layers: {}\n", m.name,
             dtype_name(m.dtype), m.tp_size, m.max_context_len, m.layers.size(),
             fmt::join(kinds, ", "));
  for (const auto& [shape, n] : s.shapes) fmt::print("  {} layer(s) {}\n", n, shape);
  for (const auto& [shape, n] : s.linear) fmt::print("  {} layer(s) {}\n", n, shape);
  for (const auto& [w, n] : s.windows) {
    fmt::print(
        "  {} layer(s) with a sliding window: a query sees the previous {} tokens and "
        "itself\n",
        n, w);
  }
  if (s.softcap_layers) fmt::print("  {} layer(s) with logit soft-capping\n", s.softcap_layers);
  if (s.sink_layers) fmt::print("  {} layer(s) with attention sinks\n", s.sink_layers);
  if (s.non_causal_layers) fmt::print("  {} non-causal layer(s)\n", s.non_causal_layers);
}

json model_json(const ModelSpec& m) {
  ModelSummary s = summarize(m);
  json windows = json::object();
  for (const auto& [w, n] : s.windows) windows[std::to_string(w)] = n;
  return {{"name", m.name},
          {"dtype", std::string(dtype_name(m.dtype))},
          {"tp_size", m.tp_size},
          {"max_context_len", m.max_context_len},
          {"num_layers", m.layers.size()},
          {"layers_by_kind", s.kinds},
          {"attention_shapes", s.shapes},
          {"linear_shapes", s.linear},
          {"sliding_windows", windows},
          {"softcap_layers", s.softcap_layers},
          {"sink_layers", s.sink_layers},
          {"non_causal_layers", s.non_causal_layers}};
}

void print_selection(const Selection& sel, const Options& o, const ModelSpec& model,
                     bool explain) {
  fmt::print("\nBackends for this run:\n");
  fmt::print("  prefill         {}\n", sel.prefill);
  fmt::print("  decode          {}\n", sel.decode);
  if (!sel.linear_prefill.empty()) {
    fmt::print("  linear prefill  {}\n", sel.linear_prefill);
    fmt::print("  linear decode   {}\n", sel.linear_decode);
  }
  fmt::print("  hybrid router   {}\n", sel.hybrid() ? "yes (prefill and decode differ)" : "no");
  fmt::print("  KV cache        {}, page size {}\n", dtype_name(sel.kv_dtype), o.page_size);
  if (is_swa_hybrid(model)) {
    fmt::print(
        "  SWA pool        sliding-window layers in a pool of their own in {} memory\n"
        "                  (0.8 x the full slots unless `attnrt run --swa-full-tokens-ratio`)\n",
        kv_pool_device(sel) == DeviceKind::cpu ? "host" : "GPU");
  }
  if (sel.speculative()) {
    fmt::print("  speculative     topk {}, {} tokens per verify block, verify on the {} backend\n",
               sel.spec_topk, sel.spec_num_draft_tokens, o.speculative_attention_mode);
  } else {
    fmt::print("  speculative     off\n");
  }
  if (explain) {
    fmt::print("\nWhy:\n");
    for (const auto& r : sel.reasons) fmt::print("  {}\n", r);
    // The kernels each chosen backend runs, where it says.
    std::vector<std::string> named;
    for (const std::string& b : {sel.prefill, sel.decode}) {
      if (b.empty() || std::find(named.begin(), named.end(), b) != named.end()) continue;
      named.push_back(b);
      const BackendEntry* e = Registry::global().find(b);
      if (e == nullptr || !e->explain_kernels) continue;
      fmt::print("\nKernels ({}):\n", b);
      for (const auto& line : e->explain_kernels(model, o, sel.kv_dtype))
        fmt::print("  {}\n", line);
    }
  } else {
    fmt::print("\n(--explain prints why each backend was chosen)\n");
  }
}

void run_info(CLI::App& cmd, const InfoArgs& args) {
  const Registry& registry = Registry::global();
  const CpuInfo cpu = query_cpu();
  const CudaDeviceInfo& cuda = query_cuda();

  // Backend options without --model ask about the default model; say so.
  std::string model_name = args.model;
  bool default_model = false;
  if (model_name.empty() && backend_options_given(cmd)) {
    model_name = "demo";
    default_model = true;
  }
  std::unique_ptr<ModelSpec> model;
  std::unique_ptr<Selection> selection;
  if (!model_name.empty()) {
    model = std::make_unique<ModelSpec>(resolve_model(model_name));
    model->validate();
    selection = std::make_unique<Selection>(resolve_backends(args.options, *model, registry));
  }

  if (args.json) {
    json out;
    out["version"] = ATTNRT_VERSION;
    out["build"] = {{"cuda_compiled_in", built_with_cuda()}};
    out["cpu"] = {{"model", cpu.model},
                  {"logical_cores", cpu.logical_cores},
                  {"simd_target", cpu.simd_target}};
    out["cuda"] = {{"usable", cuda.usable},
                   {"reason", cuda.reason},
                   {"name", cuda.name},
                   {"device_count", cuda.device_count},
                   {"compute_capability", fmt::format("{}.{}", cuda.cc_major, cuda.cc_minor)},
                   {"sm_count", cuda.sm_count},
                   {"total_memory_bytes", cuda.total_memory},
                   {"driver_version", cuda.driver_version},
                   {"gpus", cuda.gpus},
                   {"links", cuda.links},
                   {"runtime_version", cuda.runtime_version}};
    out["nccl"] = {{"version", nccl_version_text()}, {"unavailable_reason", nccl_unavailable_reason()}};
    json backends = json::array();
    for (const BackendEntry& e : registry.entries()) {
      std::string reason = e.unavailable_reason ? e.unavailable_reason() : "";
      backends.push_back({{"name", e.name},
                          {"summary", e.summary},
                          {"available", reason.empty()},
                          {"unavailable_reason", reason},
                          {"auto_selectable", e.auto_selectable},
                          {"caps", caps_json(e.caps)}});
    }
    out["backends"] = backends;
    if (model) {
      out["model"] = model_json(*model);
      out["model"]["default"] = default_model;
      out["selection"] = {{"prefill", selection->prefill},
                          {"decode", selection->decode},
                          {"linear_prefill", selection->linear_prefill},
                          {"linear_decode", selection->linear_decode},
                          {"hybrid", selection->hybrid()},
                          {"kv_dtype", std::string(dtype_name(selection->kv_dtype))},
                          {"page_size", args.options.page_size},
                          {"speculative_attention_mode", args.options.speculative_attention_mode},
                          {"spec_topk", selection->spec_topk},
                          {"spec_num_draft_tokens", selection->spec_num_draft_tokens},
                          {"reasons", selection->reasons}};
    }
    fmt::print("{}\n", out.dump(2));
    return;
  }

  fmt::print("attnrt {} (CUDA support {})\n", ATTNRT_VERSION,
             built_with_cuda() ? "compiled in" : "not compiled in");
  fmt::print("CPU:   {}, {} logical cores{}\n", cpu.model, cpu.logical_cores,
             cpu.simd_target.empty() ? "" : fmt::format(", SIMD target {}", cpu.simd_target));
  if (cuda.usable) {
    fmt::print(
        "CUDA:  {} (compute capability {}.{}, {} SMs, {}), {} device(s), driver {}, runtime "
        "{}\n",
        cuda.name, cuda.cc_major, cuda.cc_minor, cuda.sm_count, gib(cuda.total_memory),
        cuda.device_count, cuda_version(cuda.driver_version), cuda_version(cuda.runtime_version));
    for (const std::string& g : cuda.gpus) fmt::print("  GPU {}\n", g);
    if (cuda.device_count > 1) {
      for (const std::string& l : cuda.links) fmt::print("  link {}\n", l);
    } else {
      fmt::print("  links: one GPU, no peers (--dcp-size and --tp-size > 1 need more)\n");
    }
  } else {
    fmt::print("CUDA:  no usable device: {}\n", cuda.reason);
  }
  if (const std::string why = nccl_unavailable_reason(); why.empty()) {
    fmt::print("NCCL:  {} (DCP ranks across GPUs, docs/dcp.md)\n", nccl_version_text());
  } else if (built_with_cuda()) {
    fmt::print("NCCL:  {}not usable: {}\n",
               nccl_version_text().empty() ? "" : nccl_version_text() + " loaded, ", why);
  }

  fmt::print("\nBackends:\n");
  for (const BackendEntry& e : registry.entries()) {
    std::string reason = e.unavailable_reason ? e.unavailable_reason() : "";
    fmt::print("  {:<10} {}{}\n", e.name, e.summary,
               reason.empty() ? "" : fmt::format(" [not available here: {}]", reason));
  }
  fmt::print("\nSupport matrix:\n");
  print_matrix(registry);

  if (model) {
    print_model(*model);
    if (default_model) {
      fmt::print("  (the default model; pass --model to check the options against another)\n");
    }
    print_selection(*selection, args.options, *model, args.explain);
  } else {
    fmt::print(
        "\nPass --model PRESET|config.json to see which backend would serve each phase "
        "(presets: {}).\n",
        fmt::join(preset_names(), ", "));
  }
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto args = std::make_shared<InfoArgs>();
  auto* cmd = app.add_subcommand(
      "info",
      "Show the machine (CPU, CUDA device), every registered backend with its support matrix and "
      "whether it is usable here; with --model, which backend would serve each phase. Backend "
      "options are checked as a run would check them: an unsupported combination prints why and "
      "exits non-zero.");
  cmd->add_option("--model", args->model,
                  "A preset name or a HuggingFace config.json: print its attention layers and the "
                  "backend chosen for each phase");
  cmd->add_flag("--explain", args->explain,
                "With --model: print why each backend was chosen (auto-selection reasons)");
  cmd->add_flag("--json", args->json, "Print everything as one JSON document instead of text");
  add_backend_options(*cmd, args->options);
  cmd->callback([cmd, args] { run_info(*cmd, *args); });
}

}  // namespace attnrt::cli
