// The chart of a bench run: per row a bar of the achieved fraction of the machine's ceiling
// against a 100% line, grouped decode / prefill & extend / verify, each bar labelled with its
// value. SVG written directly (no plotting dependency); PNG through rsvg-convert when installed.
#pragma once

#include <string>

#include "bench/harness/report.h"
#include "bench/harness/runner.h"

namespace attnrt::bench {

std::string render_svg(const BenchResult& result, const RunInfo& info);

enum class ChartFormat { svg, png };
// From the file name's extension; throws attnrt::Error for anything but .svg / .png, and for .png
// when no converter is installed (checked before a run so it does not fail at the end).
ChartFormat chart_format_for(const std::string& path);
// Writes the chart; throws attnrt::Error naming the file when it cannot.
void write_chart(const std::string& path, const BenchResult& result, const RunInfo& info);

}  // namespace attnrt::bench
