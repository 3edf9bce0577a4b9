#include "bench/harness/report.h"

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "bench/harness/git_commit.h"

namespace attnrt::bench {

namespace {

using nlohmann::json;

std::string trim(std::string s) {
  size_t b = s.find_first_not_of(" \t");
  size_t e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

json timing_json(const TimingStats& t, double unit) {
  return {{"median", t.median * unit}, {"min", t.min * unit}, {"max", t.max * unit},
          {"p10", t.p10 * unit},       {"p90", t.p90 * unit}, {"repeats", t.repeats}};
}

json shape_json(const Workload& w) {
  json j = {{"kind", workload_kind_name(w.kind)},
            {"batch", w.batch},
            {"prefix_len", w.prefix_len},
            {"new_tokens", w.new_tokens},
            {"kv_len", w.kv_len()},
            {"q_heads", w.q_heads},
            {"kv_heads", w.kv_heads},
            {"head_dim", w.head_dim},
            {"page_size", w.page_size},
            {"kv_dtype", dtype_name(w.kv_dtype)},
            {"shape", w.shape()}};
  if (w.is_mla()) {
    j["layer"] = "mla";
    j["kv_lora_rank"] = w.kv_lora_rank;
    j["v_head_dim"] = w.v_head_dim();
  }
  if (is_verify(w.kind)) {
    j["topk"] = w.topk;
    j["tree_parents"] = verify_parents(w);
  }
  return j;
}

json check_json(const CheckResult& c) {
  return {{"method", c.method},
          {"rows_checked", c.rows_checked},
          {"max_rel_err", c.max_rel_err},
          {"tolerance", c.tolerance},
          {"passed", c.passed}};
}

json linear_shape_json(const LinearWorkload& w) {
  const LinearWidths x = linear_widths(w);
  return {{"kind", layer_kind_name(w.kind)},
          {"mode", linear_mode_name(w.mode)},
          {"model", w.model},
          {"batch", w.batch},
          {"prefix_len", w.prefix_len},
          {"new_tokens", w.new_tokens},
          {"num_k_heads", w.spec.num_k_heads},
          {"num_v_heads", w.spec.num_v_heads},
          {"head_k_dim", w.spec.head_k_dim},
          {"head_v_dim", w.spec.head_v_dim},
          {"d_state", w.spec.d_state},
          {"n_groups", w.spec.n_groups},
          {"conv_kernel", w.spec.conv_kernel},
          {"chunk_size", w.spec.chunk_size},
          {"conv_dim", x.conv_dim},
          {"act_dtype", dtype_name(w.act_dtype)},
          {"state_dtype", dtype_name(w.state_dtype)},
          {"shape", w.shape()}};
}

json dsa_shape_json(const DsaWorkload& w) {
  return {{"kind", w.prefill ? "prefill" : "decode"},
          {"part", w.prefill ? "prefill" : std::string(dsa_part_name(w.part))},
          {"batch", w.batch},
          {"prefix_len", w.prefix_len()},
          {"new_tokens", w.new_tokens()},
          {"kv_len", w.kv_len},
          {"q_heads", w.q_heads},
          {"kv_lora_rank", w.kv_lora_rank},
          {"rope_dim", w.rope_dim},
          {"head_dim", w.latent_dim()},
          {"index_n_heads", w.index_heads},
          {"index_head_dim", w.index_head_dim},
          {"index_topk", w.index_topk},
          {"page_size", w.page_size},
          {"kv_dtype", "bf16"},
          {"layer", "dsa"},
          {"shape", w.shape()}};
}

json ceiling_json(const Ceiling& c, const char* unit) {
  if (!c.available()) return {{"available", false}, {"reason", c.unavailable}};
  return {{"available", true}, {"value", c.value}, {"unit", unit}, {"method", c.method}};
}

std::string si(double v, const char* unit) {
  if (v >= 1e12) return fmt::format("{:.2f} T{}", v / 1e12, unit);
  if (v >= 1e9) return fmt::format("{:.2f} G{}", v / 1e9, unit);
  return fmt::format("{:.1f} M{}", v / 1e6, unit);
}

std::string ms(double seconds) {
  double m = seconds * 1e3;
  if (m >= 100) return fmt::format("{:.0f}", m);
  if (m >= 10) return fmt::format("{:.1f}", m);
  return fmt::format("{:.2f}", m);
}

// The fields an attention row and a linear row share; `shape` turns the row's workload into JSON.
template <typename Row, typename ShapeJson>
json row_json(const Row& row, ShapeJson shape, const Ceilings& ceilings) {
  json x;
  x["name"] = row.workload.name;
  x["status"] = row.status;
  if (!row.error.empty()) x[row.status == "n/a" ? "reason" : "error"] = row.error;
  x["standard"] = shape(row.standard);
  x["shape"] = shape(row.workload);
  x["scaled"] = !row.workload.scale_note.empty();
  if (!row.workload.scale_note.empty()) x["scale_note"] = row.workload.scale_note;
  x["counted"] = {{"bytes", row.bytes}, {"flops", row.flops}};
  x["bound"] = row.bound == Bound::memory ? "memory" : "compute";
  x["notes"] = row.notes;
  if (row.check.rows_checked > 0) x["check"] = check_json(row.check);
  if (row.time.repeats > 0) {
    x["time_ms"] = timing_json(row.time, 1e3);
    x["metric"] = row.metric_unit();
    x["rate"] = row.rate;
    x["ceiling"] = row.bound == Bound::memory ? "memory" : ceilings.compute_name();
    x["pct_of_ceiling"] = row.pct_of_ceiling;
  }
  return x;
}

}  // namespace

MachineInfo describe_machine() {
  MachineInfo m;
  m.logical_cpus = static_cast<int>(std::thread::hardware_concurrency());
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, physical_id;
  std::set<std::string> cores;
  while (std::getline(cpuinfo, line)) {
    size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = trim(line.substr(0, colon)), value = trim(line.substr(colon + 1));
    if (key == "model name" && m.cpu_model.empty()) m.cpu_model = value;
    if (key == "physical id") physical_id = value;
    if (key == "core id") cores.insert(physical_id + "/" + value);
  }
  m.physical_cores = cores.empty() ? m.logical_cpus : static_cast<int>(cores.size());
  if (m.cpu_model.empty()) m.cpu_model = "unknown";
  std::ifstream meminfo("/proc/meminfo");
  while (std::getline(meminfo, line)) {
    if (line.rfind("MemTotal:", 0) == 0) {
      m.memory_gib = std::strtod(line.c_str() + 9, nullptr) / (1024.0 * 1024.0);
    }
  }
  m.simd_target = cpu_simd_target();
  const CudaDeviceInfo& cuda = query_cuda();
  m.cuda = cuda.usable ? fmt::format("{} (sm_{}{}, {} SMs)", cuda.name, cuda.cc_major,
                                     cuda.cc_minor, cuda.sm_count)
                       : fmt::format("none: {}", cuda.reason);
  return m;
}

std::string build_commit() { return ATTNRT_GIT_COMMIT; }

RunInfo make_run_info(std::string command, double scale, std::string preset) {
  RunInfo info;
  info.command = std::move(command);
  info.scale = scale;
  info.preset = std::move(preset);
  info.created = fmt::format("{:%Y-%m-%dT%H:%M:%SZ}", fmt::gmtime(std::time(nullptr)));
  info.machine = describe_machine();
  info.commit = build_commit();
  return info;
}

json to_json(const BenchResult& r, const RunInfo& info) {
  json j;
  j["schema"] = "attnrt-bench/1";
  j["implementation"] = "attnrt";
  j["commit"] = info.commit;
  j["created"] = info.created;
  j["command"] = info.command;
  j["machine"] = {
      {"cpu_model", info.machine.cpu_model},           {"logical_cpus", info.machine.logical_cpus},
      {"physical_cores", info.machine.physical_cores}, {"memory_gib", info.machine.memory_gib},
      {"simd_target", info.machine.simd_target},       {"cuda", info.machine.cuda}};
  j["backend"] = r.backend;
  if (!r.backend_simd_target.empty()) j["backend_simd_target"] = r.backend_simd_target;
  j["threads"] = r.threads;
  j["timer"] = r.timer_method;
  j["repeats"] = r.repeats;
  j["warmup"] = r.warmup;
  j["scale"] = {{"factor", info.scale}, {"preset", info.preset}};
  j["ceilings"] = {{"device", device_name(r.ceilings.device)},
                   {"threads", r.ceilings.threads},
                   {"simd_target", r.ceilings.simd_target},
                   {"memory", ceiling_json(r.ceilings.memory, "GB/s")},
                   {"fp32", ceiling_json(r.ceilings.fp32, "GFLOP/s")},
                   {"bf16", ceiling_json(r.ceilings.bf16, "GFLOP/s")},
                   {"gather_random", ceiling_json(r.ceilings.gather_random, "GB/s")},
                   {"gather_ordered", ceiling_json(r.ceilings.gather_ordered, "GB/s")},
                   {"compute", r.ceilings.compute_name()}};
  json rows = json::array();
  for (const RowResult& row : r.rows) {
    json x = row_json(row, shape_json, r.ceilings);
    if (row.time.repeats > 0) x["plan_us"] = timing_json(row.plan, 1e6);
    if (row.decode_workload) {
      x["decode"] = {{"shape", shape_json(*row.decode_workload)},
                     {"time_ms", timing_json(row.decode_time, 1e3)},
                     {"ratio", row.decode_ratio}};
    }
    if (row.reference) {
      const ReferenceResult& ref = *row.reference;
      x["reference"] = {{"shape", shape_json(ref.workload)},
                        {"scaled", !(ref.workload == row.workload)},
                        {"time_ms", timing_json(ref.time, 1e3)},
                        {"work_per_second", ref.work_per_second},
                        {"speedup", ref.speedup},
                        {"check", check_json(ref.check)},
                        {"note", ref.note}};
    }
    rows.push_back(std::move(x));
  }
  // Linear-attention rows share the array, marked by "suite" (their SHAPE differs).
  for (const LinearRowResult& row : r.linear_rows) {
    json x = row_json(row, linear_shape_json, r.ceilings);
    x["suite"] = "linear";
    if (row.time.repeats > 0) x["tokens_per_s"] = row.tokens_per_second;
    rows.push_back(std::move(x));
  }
  // DSA rows too, marked by "suite" (their SHAPE differs).
  for (const DsaRowResult& row : r.dsa_rows) {
    json x = row_json(row, dsa_shape_json, r.ceilings);
    x["suite"] = "dsa";
    if (row.selected_checked > 0) {
      x["selection"] = {{"selected_checked", row.selected_checked},
                        {"mismatches", row.selection_mismatches}};
    }
    if (row.dense_workload) {
      x["dense"] = {{"name", row.dense_workload->name},
                    {"shape", shape_json(*row.dense_workload)},
                    {"time_ms", timing_json(row.dense_time, 1e3)}};
    }
    if (row.time.repeats > 0) {
      x["figure"] = {{"name", row.figure_name},
                     {"value", row.figure},
                     {"target", row.target.value},
                     {"target_is", row.target.at_most ? "at_most" : "at_least"},
                     {"met", row.target_met}};
    }
    rows.push_back(std::move(x));
  }
  j["rows"] = std::move(rows);
  if (!r.plans.empty()) {
    json plans = json::array();
    for (const PlanTiming& p : r.plans) {
      json x = {{"name", p.workload.name}, {"shape", shape_json(p.workload)}};
      if (!p.stream.empty()) x["stream"] = p.stream;
      if (p.error.empty()) {
        x["plan_us"] = timing_json(p.time, 1e6);
        if (p.parts) {
          x["parts_us"] = {{"capture", timing_json(p.parts->capture, 1e6)},
                           {"staging", timing_json(p.parts->staging, 1e6)},
                           {"prepare", timing_json(p.parts->prepare, 1e6)},
                           {"write", timing_json(p.parts->write, 1e6)},
                           {"copy", timing_json(p.parts->copy, 1e6)}};
        }
      } else {
        x["error"] = p.error;
      }
      plans.push_back(std::move(x));
    }
    j["plan_bs256"] = std::move(plans);
    if (!r.host_sync.empty()) j["host_sync"] = r.host_sync;
  }
  if (r.graph) {
    const GraphOverhead& g = *r.graph;
    json x = {{"shape", g.shape}, {"layers", g.layers}};
    if (g.error.empty()) {
      x["eager_issue_us"] = timing_json(g.eager_issue, 1e6);
      x["graph_issue_us"] = timing_json(g.graph_issue, 1e6);
      x["eager_step_us"] = timing_json(g.eager_step, 1e6);
      x["graph_step_us"] = timing_json(g.graph_step, 1e6);
      x["saved_per_step_us"] = (g.eager_step.median - g.graph_step.median) * 1e6;
    } else {
      x["error"] = g.error;
    }
    j["graph_replay"] = std::move(x);
  }
  return j;
}

void write_json(const std::string& path, const BenchResult& result, const RunInfo& info) {
  std::ofstream out(path);
  ATTNRT_CHECK(out.good(), "--json {}: cannot open the file for writing (does the folder exist?)",
               path);
  out << to_json(result, info).dump(2) << "\n";
  ATTNRT_CHECK(out.good(), "--json {}: writing failed (disk full?)", path);
}

// Each timed fp8 row beside the 16-bit row of the same shape in the same run: the time ratio,
// which is the ratio of tokens per second (their GB/s count different bytes, so they do not
// compare). Issue targets for fp8 are stated this way (e.g. ">= 1.6x bf16 on memory-bound rows").
static std::vector<std::string> fp8_against_16_bit(const BenchResult& r) {
  auto timed = [](const RowResult& x) { return x.status == "ok" && x.time.repeats > 0; };
  std::vector<std::string> lines;
  for (const RowResult& a : r.rows) {
    if (!timed(a) || !is_fp8(a.workload.kv_dtype)) continue;
    for (const RowResult& b : r.rows) {
      if (!timed(b) || is_fp8(b.workload.kv_dtype)) continue;
      Workload same = a.workload;
      same.name = b.workload.name;
      same.kv_dtype = b.workload.kv_dtype;
      same.fp8_prefill = b.workload.fp8_prefill;
      same.scale_note = b.workload.scale_note;
      if (!(same == b.workload)) continue;
      lines.push_back(fmt::format("  {:<34} {:>6.2f}x {} ({} against {} ms)", a.workload.name,
                                  b.time.median / a.time.median, b.workload.name,
                                  ms(a.time.median), ms(b.time.median)));
    }
  }
  return lines;
}

std::string format_report(const BenchResult& r, const RunInfo& info) {
  std::ostringstream s;
  const Ceilings& c = r.ceilings;
  s << fmt::format("attnrt bench  backend {}{}  threads {}  commit {}\n", r.backend,
                   r.backend_simd_target.empty() ? "" : fmt::format(" ({})", r.backend_simd_target),
                   r.threads, info.commit);
  s << fmt::format("machine: {} ({} cores / {} threads, {:.1f} GiB), SIMD {}, CUDA: {}\n",
                   info.machine.cpu_model, info.machine.physical_cores, info.machine.logical_cpus,
                   info.machine.memory_gib, info.machine.simd_target, info.machine.cuda);
  auto ceiling_line = [&s](const char* what, const Ceiling& x, const char* unit) {
    if (x.available()) {
      s << fmt::format("  {:<7} {:>9.1f} {:<8} {}\n", what, x.value, unit, x.method);
    } else {
      s << fmt::format("  {:<7} {:>9} {:<8} {}\n", what, "n/a", "", x.unavailable);
    }
  };
  s << "ceilings (measured now):\n";
  ceiling_line("memory", c.memory, "GB/s");
  ceiling_line("fp32", c.fp32, "GFLOP/s");
  ceiling_line("bf16", c.bf16, "GFLOP/s");
  // The page-1 gather probe (GPU): informational, no row is judged against it.
  if (c.gather_random.available()) ceiling_line("gather", c.gather_random, "GB/s");
  if (c.gather_ordered.available()) ceiling_line("ordered", c.gather_ordered, "GB/s");
  const bool mla = std::any_of(r.rows.begin(), r.rows.end(),
                               [](const RowResult& row) { return row.workload.is_mla(); });
  s << fmt::format("  decode/verify rows are judged against memory, prefill/extend{} against {}\n",
                   mla ? " and MLA rows of >= 64 q heads" : "", c.compute_name());
  if (!info.preset.empty() || info.scale != 1.0) {
    s << fmt::format(
        "SCALED RUN ({}): rows marked * are smaller than their standard definition; the "
        "notes say how\n",
        info.preset.empty() ? fmt::format("--scale {:g}", info.scale)
                            : fmt::format("--preset {}", info.preset));
  }
  s << "\n";
  // Column widths: the longest row name and shape, at least 30 and 22 (the MLA rows' fp8 and tree
  // shapes are longer).
  size_t nw = 30, sw = 22;
  for (const RowResult& row : r.rows) {
    nw = std::max(nw, row.workload.name.size() + 1);
    sw = std::max(sw, row.workload.shape().size());
    if (row.decode_workload) sw = std::max(sw, row.decode_workload->shape().size());
  }
  if (!r.rows.empty()) {
    s << fmt::format("{:<{}} {:<{}} {:>9} {:>17} {:>10} {:>13} {:>7} {:>9} {:>9} {:>8}\n", "row",
                     nw, "shape", sw, "ms", "p10..p90 ms", "counted", "rate", "% ceil", "vs ref",
                     "plan us", "check");
  }
  std::vector<std::string> notes;
  for (const RowResult& row : r.rows) {
    const Workload& w = row.workload;
    std::string name = w.name + (w.scale_note.empty() ? "" : "*");
    if (row.status == "error") {
      s << fmt::format("{:<{}} {:<{}} ERROR: {}\n", name, nw, w.shape(), sw, row.error);
      continue;
    }
    if (row.status == "n/a") {
      s << fmt::format("{:<{}} {:<{}} n/a: {}\n", name, nw, w.shape(), sw, row.error);
      continue;
    }
    std::string counted = row.bound == Bound::memory ? si(row.bytes, "B") : si(row.flops, "FLOP");
    std::string check = row.check.rows_checked == 0 ? "-"
                        : row.status == "ok"        ? fmt::format("{:.1e}", row.check.max_rel_err)
                                                    : "FAIL";
    if (row.time.repeats == 0) {
      s << fmt::format("{:<{}} {:<{}} {:>9} {:>17} {:>10} {:>13} {:>7} {:>9} {:>9} {:>8}\n", name,
                       nw, w.shape(), sw, "-", "-", counted, "-", "-", "-", "-", check);
    } else {
      std::string vs_ref = row.reference ? fmt::format("{:.1f}x", row.reference->speedup) : "-";
      s << fmt::format("{:<{}} {:<{}} {:>9} {:>17} {:>10} {:>13} {:>7} {:>9} {:>9.1f} {:>8}\n",
                       name, nw, w.shape(), sw, ms(row.time.median),
                       fmt::format("{}..{}", ms(row.time.p10), ms(row.time.p90)), counted,
                       fmt::format("{:.1f} {}", row.rate, row.metric_unit()),
                       fmt::format("{:.0f}%", row.pct_of_ceiling), vs_ref, row.plan.median * 1e6,
                       check);
    }
    if (row.decode_workload) {
      s << fmt::format("{:<{}} {:<{}} {:>9} {:>17}   verify / decode = {:.2f}x\n",
                       "  (decode at same prefix)", nw, row.decode_workload->shape(), sw,
                       ms(row.decode_time.median),
                       fmt::format("{}..{}", ms(row.decode_time.p10), ms(row.decode_time.p90)),
                       row.decode_ratio);
    }
    std::vector<std::string> parts;
    if (!w.scale_note.empty()) parts.push_back(w.scale_note);
    if (row.reference && !(row.reference->workload == w)) {
      parts.push_back(fmt::format("reference on {}", row.reference->workload.shape()));
    }
    parts.insert(parts.end(), row.notes.begin(), row.notes.end());
    if (!parts.empty()) notes.push_back(fmt::format("{}: {}", w.name, fmt::join(parts, "; ")));
  }
  if (const std::vector<std::string> fp8 = fp8_against_16_bit(r); !fp8.empty()) {
    s << "\nfp8 KV rows against the 16-bit row of the same shape (time ratio = tokens/s ratio; "
         "their GB/s count different bytes):\n";
    for (const std::string& line : fp8) s << line << "\n";
  }
  if (!r.linear_rows.empty()) {
    if (!r.rows.empty()) s << "\n";
    s << fmt::format("{:<24} {:<30} {:>9} {:>17} {:>10} {:>16} {:>7} {:>12} {:>8}\n", "linear row",
                     "shape", "ms", "p10..p90 ms", "counted", "rate", "% ceil", "tokens/s",
                     "check");
  }
  for (const LinearRowResult& row : r.linear_rows) {
    const LinearWorkload& w = row.workload;
    const std::string name = w.name + (w.scale_note.empty() ? "" : "*");
    const std::string shape = fmt::format("{} {}", layer_kind_name(w.kind), w.shape());
    if (row.status == "error") {
      s << fmt::format("{:<24} {:<30} ERROR: {}\n", name, shape, row.error);
      continue;
    }
    const std::string counted =
        row.bound == Bound::memory ? si(row.bytes, "B") : si(row.flops, "FLOP");
    const std::string check =
        row.status == "ok" ? fmt::format("{:.1e}", row.check.max_rel_err) : "FAIL";
    if (row.time.repeats == 0) {
      s << fmt::format("{:<24} {:<30} {:>9} {:>17} {:>10} {:>16} {:>7} {:>12} {:>8}\n", name, shape,
                       "-", "-", counted, "-", "-", "-", check);
    } else {
      const std::string rate = row.bound == Bound::memory
                                   ? fmt::format("{:.1f} GB/s", row.rate)
                                   : fmt::format("{:.3f} TFLOP/s", row.rate / 1e3);
      s << fmt::format("{:<24} {:<30} {:>9} {:>17} {:>10} {:>16} {:>7} {:>12.4g} {:>8}\n", name,
                       shape, ms(row.time.median),
                       fmt::format("{}..{}", ms(row.time.p10), ms(row.time.p90)), counted, rate,
                       fmt::format("{:.0f}%", row.pct_of_ceiling), row.tokens_per_second, check);
    }
    std::vector<std::string> parts;
    if (!w.scale_note.empty()) parts.push_back(w.scale_note);
    parts.insert(parts.end(), row.notes.begin(), row.notes.end());
    if (!parts.empty()) notes.push_back(fmt::format("{}: {}", w.name, fmt::join(parts, "; ")));
  }
  if (!r.linear_rows.empty()) {
    s << "linear rows: one layer's forward_linear per call (decode: one more DECODE step of the "
         "batch; extend: from empty states);\n  decode counts state + conv window read and "
         "written, inputs read, outputs written (GB/s vs memory); extend counts the chunked "
         "form's FLOPs (docs/bench.md)\n";
  }
  if (!r.dsa_rows.empty()) {
    if (!r.rows.empty() || !r.linear_rows.empty()) s << "\n";
    s << fmt::format("{:<24} {:<34} {:>9} {:>17} {:>10} {:>16} {:>7} {:>9} {:>26} {:>8}\n",
                     "dsa row", "shape", "ms", "p10..p90 ms", "counted", "rate", "% ceil",
                     "dense ms", "figure (target)", "check");
  }
  for (const DsaRowResult& row : r.dsa_rows) {
    const DsaWorkload& w = row.workload;
    const std::string name = w.name + (w.scale_note.empty() ? "" : "*");
    if (row.status == "error" || row.status == "n/a") {
      s << fmt::format("{:<24} {:<34} {}: {}\n", name, w.shape(),
                       row.status == "error" ? "ERROR" : "n/a", row.error);
      continue;
    }
    const std::string counted =
        row.bound == Bound::memory ? si(row.bytes, "B") : si(row.flops, "FLOP");
    const std::string check =
        row.status == "ok" ? fmt::format("{:.1e}", row.check.max_rel_err) : "FAIL";
    if (row.time.repeats == 0) {
      s << fmt::format("{:<24} {:<34} {:>9} {:>17} {:>10} {:>16} {:>7} {:>9} {:>26} {:>8}\n", name,
                       w.shape(), "-", "-", counted, "-", "-", "-", "-", check);
    } else {
      const std::string figure = fmt::format("{:.3g} {} {:g}{}", row.figure,
                                             row.target.at_most ? "<=" : ">=", row.target.value,
                                             row.target_met ? "" : " MISS");
      s << fmt::format("{:<24} {:<34} {:>9} {:>17} {:>10} {:>16} {:>7} {:>9} {:>26} {:>8}\n", name,
                       w.shape(), ms(row.time.median),
                       fmt::format("{}..{}", ms(row.time.p10), ms(row.time.p90)), counted,
                       fmt::format("{:.1f} {}", row.rate, row.metric_unit()),
                       fmt::format("{:.0f}%", row.pct_of_ceiling),
                       row.dense_workload ? ms(row.dense_time.median) : "-", figure, check);
    }
    std::vector<std::string> parts;
    if (!w.scale_note.empty()) parts.push_back(w.scale_note);
    if (row.dense_workload) {
      parts.push_back(fmt::format("figure: {}; dense = {} ({})", row.figure_name,
                                  row.dense_workload->name, row.dense_workload->shape()));
    } else if (row.time.repeats > 0) {
      parts.push_back("figure: " + row.figure_name);
    }
    parts.insert(parts.end(), row.notes.begin(), row.notes.end());
    notes.push_back(fmt::format("{}: {}", w.name, fmt::join(parts, "; ")));
  }
  if (!r.dsa_rows.empty()) {
    s << "dsa rows: decode = one DSA layer's step (index keys stored, scores, top-k, sparse MLA); "
         "index = step minus sparse alone;\n  sparse = the MLA decode over the step's selection; "
         "each beside the dense MLA row of the same shape (docs/workloads.md \"DSA rows\")\n";
  }
  if (!notes.empty()) {
    s << "\nnotes:\n";
    for (const std::string& n : notes) s << "  " << n << "\n";
  }
  const bool any_reference = std::any_of(
      r.rows.begin(), r.rows.end(), [](const RowResult& x) { return x.reference.has_value(); });
  if (any_reference) {
    s << "\nvs ref: attention work per second of the backend on the row / that of the float64 "
         "reference backend,\n        which runs the shape the notes name when the row is too "
         "large for it\n";
  }
  s << fmt::format("{}timing: median of {} repeats after {} warm-up calls{}; {}\n",
                   any_reference ? "" : "\n", r.repeats, r.warmup,
                   r.repeats < 10 ? " (fewer than the 10 docs/workloads.md asks for)" : "",
                   r.timer_method);
  if (!r.plans.empty()) {
    s << "\nhost plan per step at batch 256 (each plan followed by its step, GPU drained outside "
         "the timed region"
      << (r.host_sync.empty() ? std::string() : "; the host waits: " + r.host_sync)
      << (r.plans[0].stream.empty()    ? std::string()
          : r.plans[0].stream == "own" ? std::string("; on the KV cache's own stream")
                                       : std::string("; on the legacy default stream"))
      << "):\n";
    for (const PlanTiming& p : r.plans) {
      if (p.error.empty()) {
        s << fmt::format("  {:<34} {:>8.2f} us  (p10..p90 {:.2f}..{:.2f})\n", p.workload.name,
                         p.time.median * 1e6, p.time.p10 * 1e6, p.time.p90 * 1e6);
        if (p.parts) {
          const PlanParts& q = *p.parts;
          s << fmt::format(
              "  {} parts: capture {:.2f} us, staging {:.2f}, prepare {:.2f}, write {:.2f}, copy "
              "{:.2f} (medians; p90 {:.2f} / {:.2f} / {:.2f} / {:.2f} / {:.2f})\n",
              p.workload.name, q.capture.median * 1e6, q.staging.median * 1e6,
              q.prepare.median * 1e6, q.write.median * 1e6, q.copy.median * 1e6,
              q.capture.p90 * 1e6, q.staging.p90 * 1e6, q.prepare.p90 * 1e6, q.write.p90 * 1e6,
              q.copy.p90 * 1e6);
        }
      } else {
        s << fmt::format("  {:<34} ERROR: {}\n", p.workload.name, p.error);
      }
    }
  }
  if (r.graph) {
    const GraphOverhead& g = *r.graph;
    s << fmt::format("\ngraph replay, {}:\n", g.shape);
    if (g.error.empty()) {
      const double saved = (g.eager_step.median - g.graph_step.median) * 1e6;
      s << fmt::format(
          "  eager: issue {:.1f} us, step {:.1f} us | graph: issue {:.1f} us, step {:.1f} us | "
          "launch overhead saved {:.1f} us per step ({:.2f} us per layer); medians of {}\n",
          g.eager_issue.median * 1e6, g.eager_step.median * 1e6, g.graph_issue.median * 1e6,
          g.graph_step.median * 1e6, saved, saved / std::max(g.layers, 1), g.graph_step.repeats);
    } else {
      s << fmt::format("  ERROR: {}\n", g.error);
    }
  }
  return s.str();
}

}  // namespace attnrt::bench
