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

struct Group {
  std::string title;
  const char* colour;
  std::vector<const RowResult*> rows;
};

constexpr int kWidth = 1000;
constexpr int kLabelWidth = 250;  // row names
constexpr int kBarLeft = kLabelWidth + 10;
constexpr int kBarWidth = 520;    // 0 .. axis maximum
constexpr int kRowHeight = 22;
constexpr int kBarHeight = 15;

std::string bar_label(const RowResult& row) {
  if (row.status == "error") return "ERROR: " + row.error.substr(0, 90);
  if (row.status == "mismatch") return "FAILED correctness check: not timed";
  if (row.status == "n/a") return "n/a: " + row.error.substr(0, 90);
  std::string label = fmt::format("{:.0f}%: {:.1f} {}", row.pct_of_ceiling, row.rate,
                                  row.metric_unit());
  if (row.decode_workload) label += fmt::format(", {:.2f}x the decode time", row.decode_ratio);
  if (row.reference) label += fmt::format(", {:.0f}x reference", row.reference->speedup);
  return label;
}

bool converter_available() {
  return std::system("command -v rsvg-convert >/dev/null 2>&1") == 0;
}

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
  };
  double max_pct = 100;
  for (const RowResult& row : result.rows) {
    const Workload& w = row.workload;
    int g = w.kind == WorkloadKind::decode ? 0 : is_verify(w.kind) ? 2 : 1;
    groups[g].rows.push_back(&row);
    max_pct = std::max(max_pct, row.pct_of_ceiling);
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
    s << fmt::format("<text x=\"16\" y=\"{}\" font-size=\"14\" font-weight=\"bold\" fill=\"{}\">{}"
                     "</text>\n",
                     y + 20, g.colour, xml_escape(g.title));
    y += group_header;
    for (const RowResult* row : g.rows) {
      const Workload& w = row->workload;
      const bool scaled = !w.scale_note.empty();
      any_scaled = any_scaled || scaled;
      s << fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}{}</text>\n", kLabelWidth,
                       y + kBarHeight - 3, xml_escape(w.name), scaled ? " *" : "");
      const bool ok = row->status == "ok" && row->time.repeats > 0;
      double end = ok ? x_of(row->pct_of_ceiling) : kBarLeft;
      if (ok) {
        s << fmt::format(
            "<rect x=\"{}\" y=\"{}\" width=\"{:.1f}\" height=\"{}\" fill=\"{}\"><title>{}</title>"
            "</rect>\n",
            kBarLeft, y, end - kBarLeft, kBarHeight, g.colour,
            xml_escape(fmt::format("{} ({}): {}", w.name, w.shape(), bar_label(*row))));
      }
      s << fmt::format("<text x=\"{:.1f}\" y=\"{}\" fill=\"{}\">{}</text>\n", end + 6,
                       y + kBarHeight - 3, ok ? "#222" : "#c0392b", xml_escape(bar_label(*row)));
      y += kRowHeight;
    }
  }
  y += 18;
  s << fmt::format("<text x=\"16\" y=\"{}\" fill=\"#444\">Bars: achieved rate / ceiling. The dashed "
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
