#include "bench/harness/chart.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include "attnrt/core/error.h"

namespace attnrt::bench {

namespace {

std::string xml_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// One bar: a row of any suite (attention, linear, DSA) as the chart draws it.
struct Bar {
  std::string name;
  bool scaled = false;
  bool ok = false;  // timed and correct: a bar at pct; else only the label, in red
  double pct = 0;
  std::string label;    // beside the bar
  std::string tooltip;  // the bar's <title>
};

struct Group {
  std::string title;
  const char* colour;
  std::vector<Bar> rows;
};

constexpr int kWidth = 1000;
constexpr int kLabelWidth = 250;  // row names
constexpr int kBarLeft = kLabelWidth + 10;
constexpr int kBarWidth = 520;  // 0 .. axis maximum
constexpr int kRowHeight = 22;
constexpr int kBarHeight = 15;

// The label of a row that did not produce a bar; "" when it did (status ok and timed).
std::string failed_label(const std::string& status, const std::string& error, bool timed) {
  if (status == "error") return "ERROR: " + error.substr(0, 90);
  if (status == "mismatch") return "FAILED correctness check: not timed";
  if (status == "n/a") return "n/a: " + error.substr(0, 90);
  if (!timed) return "not timed";
  return "";
}

// Rows of every suite as bars: name, bar, label and tooltip, with the fields all rows share.
template <typename Row>
Bar bar_of(const Row& row, const std::string& name, const std::string& shape, bool scaled,
           std::string extra) {
  Bar b{.name = name, .scaled = scaled};
  b.label = failed_label(row.status, row.error, row.time.repeats > 0);
  b.ok = b.label.empty();
  if (b.ok) {
    b.pct = row.pct_of_ceiling;
    b.label =
        fmt::format("{:.0f}%: {:.1f} {}{}", row.pct_of_ceiling, row.rate, row.metric_unit(), extra);
  }
  b.tooltip = fmt::format("{} ({}): {}", name, shape, b.label);
  return b;
}

Bar attention_bar(const RowResult& row) {
  std::string extra;
  if (row.decode_workload) extra += fmt::format(", {:.2f}x the decode time", row.decode_ratio);
  if (row.reference) extra += fmt::format(", {:.0f}x reference", row.reference->speedup);
  const Workload& w = row.workload;
  return bar_of(row, w.name, w.shape(), !w.scale_note.empty(), extra);
}

Bar linear_bar(const LinearRowResult& row) {
  const LinearWorkload& w = row.workload;
  return bar_of(row, w.name, w.shape(), !w.scale_note.empty(),
                row.tokens_per_second > 0 ? fmt::format(", {:.3g} tokens/s", row.tokens_per_second)
                                          : std::string());
}

// A DSA row's bar is its rate against the ceiling; the label adds its figure against the dense
// MLA row and the target (docs/workloads.md "DSA rows").
Bar dsa_bar(const DsaRowResult& row) {
  const DsaWorkload& w = row.workload;
  std::string extra;
  if (!row.figure_name.empty()) {
    extra = fmt::format("; {} {:.3g} ({} {:g}: {})", row.figure_name, row.figure,
                        row.target.at_most ? "target <=" : "target >=", row.target.value,
                        row.target_met ? "met" : "MISS");
  }
  return bar_of(row, w.name, w.shape(), !w.scale_note.empty(), extra);
}

bool converter_available() { return std::system("command -v rsvg-convert >/dev/null 2>&1") == 0; }

}  // namespace

std::string render_svg(const BenchResult& result, const RunInfo& info) {
  const Ceilings& c = result.ceilings;
  std::vector<Group> groups = {
      {"decode: % of streaming-read bandwidth", "#3b75af", {}},
      {fmt::format("prefill / extend: % of {} peak",
                   c.compute_name() == "bf16" ? "bf16 dot" : "fp32 FMA"),
       "#e08a2c",
       {}},
      {"speculative verify: % of streaming-read bandwidth", "#4f9a5a", {}},
      {"linear layers, decode: % of streaming-read bandwidth", "#7b5ea7", {}},
      {fmt::format("linear layers, extend: % of {} peak",
                   c.compute_name() == "bf16" ? "bf16 dot" : "fp32 FMA"),
       "#a0527a",
       {}},
      {"DSA layer (DeepSeek-V3.2): index part % of streaming-read bandwidth, the rest % of the "
       "compute peak",
       "#2a8c8c",
       {}},
  };
  for (const RowResult& row : result.rows) {
    const Workload& w = row.workload;
    const int g = w.kind == WorkloadKind::decode ? 0 : is_verify(w.kind) ? 2 : 1;
    groups[g].rows.push_back(attention_bar(row));
  }
  for (const LinearRowResult& row : result.linear_rows) {
    groups[row.workload.mode == LinearMode::decode ? 3 : 4].rows.push_back(linear_bar(row));
  }
  for (const DsaRowResult& row : result.dsa_rows) groups[5].rows.push_back(dsa_bar(row));
  double max_pct = 100;
  for (const Group& g : groups) {
    for (const Bar& b : g.rows) max_pct = std::max(max_pct, b.ok ? b.pct : 0.0);
  }
  // The axis ends at the next 25% step above the largest bar (at least 100%, at most 200%: a bar
  // beyond that is drawn clipped with its value in the label).
  const double axis = std::min(200.0, std::ceil(max_pct / 25.0) * 25.0);
  auto x_of = [axis](double pct) { return kBarLeft + kBarWidth * std::clamp(pct, 0.0, axis) / axis; };

  int rows_total = 0, groups_used = 0;
  for (const Group& g : groups) {
    if (g.rows.empty()) continue;
    rows_total += static_cast<int>(g.rows.size());
    ++groups_used;
  }
  const int header = 100, group_header = 30, footer = 60;
  const int height = header + groups_used * group_header + rows_total * kRowHeight + footer;

  std::ostringstream s;
  s << fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n",
      kWidth, height);
  s << fmt::format("<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"white\"/>\n", kWidth,
                   height);
  s << fmt::format(
      "<text x=\"16\" y=\"26\" font-size=\"17\" font-weight=\"bold\">attnrt bench: {} backend, "
      "{} threads, achieved vs measured ceiling</text>\n",
      xml_escape(result.backend), result.threads);
  s << fmt::format("<text x=\"16\" y=\"46\" fill=\"#444\">{} | commit {} | {}</text>\n",
                   xml_escape(info.machine.cpu_model), xml_escape(info.commit),
                   xml_escape(info.created));
  auto ceiling_text = [](const char* what, const Ceiling& x, const char* unit) {
    return x.available() ? fmt::format("{} {:.1f} {}", what, x.value, unit)
                         : fmt::format("{} n/a", what);
  };
  s << fmt::format("<text x=\"16\" y=\"64\" fill=\"#444\">ceilings measured in this run: {}; {}; "
                   "{}</text>\n",
                   ceiling_text("read", c.memory, "GB/s"), ceiling_text("fp32 FMA", c.fp32, "GFLOP/s"),
                   ceiling_text("bf16 dot", c.bf16, "GFLOP/s"));

  // Axis ticks and the 100% line run through every group.
  const int plot_top = header - 14, plot_bottom = height - footer + 4;
  for (double t = 0; t <= axis + 1e-9; t += 25) {
    double x = x_of(t);
    bool hundred = t == 100;
    s << fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"{3}\" "
        "stroke-width=\"{4}\"{5}/>\n",
        x, plot_top, plot_bottom, hundred ? "#c0392b" : "#dddddd", hundred ? 1.5 : 1,
        hundred ? " stroke-dasharray=\"5,3\"" : "");
    s << fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\" fill=\"{}\">{:.0f}%</text>\n",
                     x, plot_top - 4, hundred ? "#c0392b" : "#666", t);
  }

  int y = header;
  bool any_scaled = false;
  for (const Group& g : groups) {
    if (g.rows.empty()) continue;
    s << fmt::format(
        "<text x=\"16\" y=\"{}\" font-size=\"14\" font-weight=\"bold\" fill=\"{}\">{}"
        "</text>\n",
        y + 20, g.colour, xml_escape(g.title));
    y += group_header;
    for (const Bar& b : g.rows) {
      any_scaled = any_scaled || b.scaled;
      s << fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}{}</text>\n", kLabelWidth,
                       y + kBarHeight - 3, xml_escape(b.name), b.scaled ? " *" : "");
      const double end = b.ok ? x_of(b.pct) : kBarLeft;
      if (b.ok) {
        s << fmt::format(
            "<rect x=\"{}\" y=\"{}\" width=\"{:.1f}\" height=\"{}\" fill=\"{}\"><title>{}</title>"
            "</rect>\n",
            kBarLeft, y, end - kBarLeft, kBarHeight, g.colour, xml_escape(b.tooltip));
      }
      s << fmt::format("<text x=\"{:.1f}\" y=\"{}\" fill=\"{}\">{}</text>\n", end + 6,
                       y + kBarHeight - 3, b.ok ? "#222" : "#c0392b", xml_escape(b.label));
      y += kRowHeight;
    }
  }
  y += 18;
  s << fmt::format(
      "<text x=\"16\" y=\"{}\" fill=\"#444\">Bars: achieved rate / ceiling. The dashed "
      "line is 100%. Decode only reads, so it may pass 100% of a read probe.</text>\n",
      y);
  if (any_scaled) {
    s << fmt::format("<text x=\"16\" y=\"{}\" fill=\"#444\">* scaled down from the docs/workloads.md "
                     "shape for this machine; the JSON and the table say how.</text>\n",
                     y + 18);
  }
  s << "</svg>\n";
  return s.str();
}

ChartFormat chart_format_for(const std::string& path) {
  auto ends_with = [&path](std::string_view ext) {
    return path.size() >= ext.size() &&
           std::equal(ext.rbegin(), ext.rend(), path.rbegin(),
                      [](char a, char b) { return a == std::tolower(static_cast<unsigned char>(b)); });
  };
  if (ends_with(".svg")) return ChartFormat::svg;
  if (ends_with(".png")) {
    ATTNRT_CHECK(converter_available(),
                 "--plot {}: PNG needs rsvg-convert (package librsvg2-bin), which is not "
                 "installed; write an SVG instead (--plot {}.svg) or install it",
                 path, path.substr(0, path.size() - 4));
    return ChartFormat::png;
  }
  fail("--plot {}: unknown chart format; use a file name ending in .svg (or .png with "
       "rsvg-convert installed)",
       path);
}

void write_chart(const std::string& path, const BenchResult& result, const RunInfo& info) {
  const ChartFormat format = chart_format_for(path);
  const std::string svg = render_svg(result, info);
  const std::string svg_path = format == ChartFormat::svg ? path : path + ".tmp.svg";
  {
    std::ofstream out(svg_path);
    ATTNRT_CHECK(out.good(), "--plot {}: cannot open the file for writing (does the folder exist?)",
                 svg_path);
    out << svg;
    ATTNRT_CHECK(out.good(), "--plot {}: writing failed", svg_path);
  }
  if (format == ChartFormat::png) {
    // Paths are passed single-quoted; a quote inside a path would break out of them.
    ATTNRT_CHECK(path.find('\'') == std::string::npos,
                 "--plot {}: a PNG path may not contain a single quote", path);
    const std::string cmd = fmt::format("rsvg-convert -o '{}' '{}'", path, svg_path);
    const int rc = std::system(cmd.c_str());
    std::remove(svg_path.c_str());
    ATTNRT_CHECK(rc == 0, "--plot {}: rsvg-convert failed (exit status {})", path, rc);
  }
}

}  // namespace attnrt::bench
