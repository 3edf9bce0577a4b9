#include "tools/sim/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

namespace attnrt::sim {

std::string error_text(double e) {
  if (std::isinf(e)) return "inf";
  return fmt::format("{:.2e}", e);
}

ModeStats RunReport::totals() const {
  ModeStats t;
  for (const ModeStats& m : modes) {
    t.steps += m.steps;
    t.tokens += m.tokens;
    t.seconds += m.seconds;
    t.checked_steps += m.checked_steps;
    t.checked_rows += m.checked_rows;
    t.checkable_rows += m.checkable_rows;
    t.graph_steps += m.graph_steps;
    t.mha_layers += m.mha_layers;
    t.prefix_chunks += m.prefix_chunks;
    t.max_abs_err = std::max(t.max_abs_err, m.max_abs_err);
    t.max_rel_err = std::max(t.max_rel_err, m.max_rel_err);
  }
  return t;
}

bool RunReport::ok() const {
  return failure_count == 0 && target_pool.ok && (!draft_pool || draft_pool->ok) &&
         linear_pool_ok && dump_error.empty();
}

namespace {

// What the reference checks compared, when they compared a sample.
std::string sample_line(const RunReport& r) {
  const ModeStats t = r.totals();
  if (t.checked_rows == 0 || t.checked_rows == t.checkable_rows) return "";
  auto limit = [](int n, const char* what) {
    return n > 0 ? fmt::format("at most {} {}", n, what) : fmt::format("every {}", what);
  };
  return fmt::format(
      "reference checks: {} of the checked attention layers' {} output rows (token x head) "
      "recomputed ({:.1f}%): per checked layer {} (each request's first and last, the rest drawn "
      "by the seed) x {} (evenly spread, starting elsewhere on each check, so every head is "
      "covered); --check-rows all checks every row",
      t.checked_rows, t.checkable_rows, 100.0 * t.checked_rows / t.checkable_rows,
      limit(r.check_rows.max_tokens, "query rows"), limit(r.check_rows.max_heads, "heads"));
}

std::string mode_label(const ModeStats& m) {
  return m.role == ModelRole::target ? std::string(forward_mode_name(m.mode))
                                     : fmt::format("{} (draft)", forward_mode_name(m.mode));
}

std::string pool_line(const char* name, const PoolReport& p) {
  if (p.ok) {
    return fmt::format(
        "pool check ({}): ok: all {} request slots free again; {} shared prefix{} held "
        "{} slots until released at the end",
        name, p.total_slots, p.prefixes, p.prefixes == 1 ? "" : "es", p.prefix_slots);
  }
  return fmt::format("pool check ({}): LEAK: {}", name, p.detail);
}

nlohmann::json pool_json(const PoolReport& p) {
  return {{"ok", p.ok},
          {"total_slots", p.total_slots},
          {"free_slots", p.free_slots},
          {"prefix_slots", p.prefix_slots},
          {"prefixes", p.prefixes},
          {"rows_in_use", p.rows_in_use},
          {"free_after_release", p.free_after_release},
          {"detail", p.detail}};
}

}  // namespace

std::string format_report(const RunReport& r) {
  std::string out;
  out += fmt::format(
      "model {} | trace {} ({} requests, {} prompt + {} output tokens) | {} iterations\n", r.model,
      r.trace_origin, r.requests, r.prompt_tokens, r.output_tokens, r.iterations);
  out += fmt::format("backends: prefill {}, decode {}", r.prefill_backend, r.decode_backend);
  if (!r.linear_prefill_backend.empty()) {
    out += fmt::format(", linear prefill {}, linear decode {}", r.linear_prefill_backend,
                       r.linear_decode_backend);
  }
  out += fmt::format(" | kv {} | page size {}", r.kv_dtype, r.page_size);
  if (r.swa_ratio > 0) out += fmt::format(" | SWA pool {:g} x the full slots", r.swa_ratio);
  if (r.spec.enabled()) {
    out += fmt::format(
        " | speculative: {} steps, topk {}, {} draft tokens; {:.2f} drafts accepted per "
        "request and round ({} request-rounds)",
        r.spec.num_steps, r.spec.topk, r.spec.num_draft_tokens,
        r.verify_rounds > 0 ? static_cast<double>(r.accepted_drafts) / r.verify_rounds : 0.0,
        r.verify_rounds);
  }
  out += "\n";
  for (const std::string& note : r.notes) out += "note: " + note + "\n";
  out += "\n";
  const std::string head =
      fmt::format("{:<22} {:>7} {:>9} {:>10} {:>11} {:>8} {:>10} {:>10}  {}\n", "mode", "steps",
                  "tokens", "time (ms)", "tokens/s", "checked", "max abs", "max rel", "backend");
  out += head;
  out += std::string(head.size() - 1, '-') + "\n";
  auto row = [&](const std::string& label, const ModeStats& m) {
    const bool checked = m.checked_steps > 0;
    out += fmt::format("{:<22} {:>7} {:>9} {:>10.1f} {:>11.0f} {:>8} {:>10} {:>10}  {}\n", label,
                       m.steps, m.tokens, m.seconds * 1e3, m.tokens_per_second(), m.checked_steps,
                       checked ? error_text(m.max_abs_err) : "-",
                       checked ? error_text(m.max_rel_err) : "-", m.backend);
  };
  for (const ModeStats& m : r.modes) row(mode_label(m), m);
  out += std::string(head.size() - 1, '-') + "\n";
  row("total", r.totals());
  out += fmt::format(
      "\nwall time {:.2f} s (attention {:.2f} s; the rest is data generation, "
      "reference checks and scheduling); tolerance {:g} + {:g}*|reference|\n",
      r.wall_seconds, r.totals().seconds, r.tolerance.atol, r.tolerance.rtol);
  for (const ModeStats& m : r.modes) {
    if (m.mha_layers == 0) continue;
    out += fmt::format("{}: MLA in the MHA form in {} layer calls, {} prefix chunks merged\n",
                       mode_label(m), m.mha_layers, m.prefix_chunks);
  }
  if (!r.check_note.empty()) out += r.check_note + "\n";
  const std::string sampled = sample_line(r);
  if (!sampled.empty()) out += sampled + "\n";
  out += pool_line("target", r.target_pool) + "\n";
  if (r.draft_pool) out += pool_line("draft", *r.draft_pool) + "\n";
  if (r.linear_slots > 0) {
    out += r.linear_pool_ok
               ? fmt::format("linear state check (target): ok: all {} state slots free again\n",
                             r.linear_slots)
               : fmt::format("linear state check (target): LEAK: {}\n", r.linear_pool_detail);
  }
  if (r.aborts.total() > 0 || r.retractions > 0) {
    out += fmt::format(
        "aborts: {} (waiting {}, mid-prefill {}, decode {}, verify {}) | retractions: {}\n",
        r.aborts.total(), r.aborts.waiting, r.aborts.prefill, r.aborts.decode, r.aborts.verify,
        r.retractions);
  }
  out += fmt::format("pool invariants: checked {} time{}, all held\n", r.invariant_checks,
                     r.invariant_checks == 1 ? "" : "s");
  if (r.first_tenth_tokens_per_s > 0 || r.last_tenth_tokens_per_s > 0) {
    out += fmt::format(
        "target tokens/s (wall, whole step loop): first tenth of the {} steps {:.0f}, last "
        "tenth {:.0f}; by tenth {:.0f}\n",
        r.steps, r.first_tenth_tokens_per_s, r.last_tenth_tokens_per_s,
        fmt::join(r.tenth_tokens_per_s, " "));
  }
  if (!r.dump_written.empty()) out += fmt::format("step case written to {}\n", r.dump_written);
  if (!r.dump_error.empty()) out += fmt::format("no step case written: {}\n", r.dump_error);
  if (r.failure_count > 0) {
    out += fmt::format(
        "\nFAILED: {} checked layer outputs beyond tolerance or unwritten; first ones:\n",
        r.failure_count);
    for (const CheckFailure& f : r.failures) out += "  " + f.what + "\n";
  }
  return out;
}

nlohmann::json report_to_json(const RunReport& r) {
  using json = nlohmann::json;
  auto mode_json = [](const ModeStats& m) {
    json j = {{"model", model_role_name(m.role)},
              {"mode", forward_mode_name(m.mode)},
              {"backend", m.backend},
              {"steps", m.steps},
              {"tokens", m.tokens},
              {"time_ms", m.seconds * 1e3},
              {"tokens_per_s", m.tokens_per_second()},
              {"checked_steps", m.checked_steps},
              {"checked_rows", m.checked_rows},
              {"checkable_rows", m.checkable_rows},
              {"graph_steps", m.graph_steps},
              {"mla_mha_layers", m.mha_layers},
              {"prefix_chunks", m.prefix_chunks}};
    // JSON has no infinity: an unwritten output is reported as null error (and as a failure).
    auto err = [](double e) { return std::isfinite(e) ? json(e) : json(nullptr); };
    j["max_abs_err"] = m.checked_steps > 0 ? err(m.max_abs_err) : json(nullptr);
    j["max_rel_err"] = m.checked_steps > 0 ? err(m.max_rel_err) : json(nullptr);
    return j;
  };
  json modes = json::array();
  for (const ModeStats& m : r.modes) modes.push_back(mode_json(m));
  json total = mode_json(r.totals());
  total.erase("model");
  total.erase("mode");
  total.erase("backend");
  json failures = json::array();
  for (const CheckFailure& f : r.failures) {
    failures.push_back({{"step", f.step},
                        {"model", model_role_name(f.role)},
                        {"mode", forward_mode_name(f.mode)},
                        {"layer", f.layer},
                        {"token", f.token},
                        {"head", f.head},
                        {"column", f.column},
                        {"message", f.what}});
  }
  json j = {{"model", r.model},
            {"trace",
             {{"origin", r.trace_origin},
              {"requests", r.requests},
              {"prompt_tokens", r.prompt_tokens},
              {"output_tokens", r.output_tokens}}},
            {"backends", {{"prefill", r.prefill_backend}, {"decode", r.decode_backend}}},
            {"kv_dtype", r.kv_dtype},
            {"page_size", r.page_size},
            {"swa_full_tokens_ratio", r.swa_ratio > 0 ? json(r.swa_ratio) : json()},
            {"iterations", r.iterations},
            {"wall_s", r.wall_seconds},
            {"tolerance", {{"atol", r.tolerance.atol}, {"rtol", r.tolerance.rtol}}},
            {"modes", modes},
            {"total", total},
            {"pool_check", {{"target", pool_json(r.target_pool)}}},
            {"failure_count", r.failure_count},
            {"failures", failures},
            {"ok", r.ok()}};
  if (r.draft_pool) j["pool_check"]["draft"] = pool_json(*r.draft_pool);
  if (r.linear_slots > 0) {
    j["backends"]["linear_prefill"] = r.linear_prefill_backend;
    j["backends"]["linear_decode"] = r.linear_decode_backend;
    j["pool_check"]["linear_state"] = {
        {"ok", r.linear_pool_ok}, {"slots", r.linear_slots}, {"detail", r.linear_pool_detail}};
  }
  if (!r.notes.empty()) j["notes"] = r.notes;
  j["aborts"] = {{"waiting", r.aborts.waiting},
                 {"prefill", r.aborts.prefill},
                 {"decode", r.aborts.decode},
                 {"verify", r.aborts.verify},
                 {"total", r.aborts.total()}};
  j["retractions"] = r.retractions;
  j["invariant_checks"] = r.invariant_checks;
  j["steps"] = r.steps;
  j["tokens_per_s_first_tenth"] = r.first_tenth_tokens_per_s;
  j["tokens_per_s_last_tenth"] = r.last_tenth_tokens_per_s;
  j["tokens_per_s_by_tenth"] = r.tenth_tokens_per_s;
  if (r.spec.enabled()) {
    j["speculative"] = {{"num_steps", r.spec.num_steps},
                        {"topk", r.spec.topk},
                        {"num_draft_tokens", r.spec.num_draft_tokens},
                        {"accept_prob", r.spec.accept_prob},
                        {"verify_rounds", r.verify_rounds},
                        {"accepted_drafts", r.accepted_drafts}};
  }
  if (!r.dump_written.empty()) j["dump"] = r.dump_written;
  if (!r.dump_error.empty()) j["dump_error"] = r.dump_error;
  if (!r.check_note.empty()) j["check_note"] = r.check_note;
  j["check_rows"] = {{"max_tokens", r.check_rows.max_tokens},
                     {"max_heads", r.check_rows.max_heads}};
  return j;
}

}  // namespace attnrt::sim
