// A one-line progress display on stderr for long subcommands (run, check). On a terminal it redraws
// a bar in place (at most ten times a second); when stderr is a file or a pipe it prints a plain
// line every few seconds instead, so logs stay readable; disabled, it prints nothing. Both show the
// elapsed time and, once some units are done, the estimated time left (elapsed x remaining / done).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace attnrt::cli {

class ProgressBar {
 public:
  // `label` starts every line ("run", "check"). enabled = false silences it (--no-progress).
  ProgressBar(std::string label, bool enabled);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // `done` of about `total` units (total may be an estimate that changes), and a short free-form
  // detail such as "1.2k tok/s | DECODE".
  void update(int64_t done, int64_t total, std::string_view unit, std::string_view detail);
  // Clears the bar (terminal) so that the final report starts on a clean line.
  void finish();
  // Printed once, on its own line, the first time the estimated time left exceeds `threshold`
  // (e.g. which options make the run shorter). Never printed when the bar is disabled.
  void set_long_run_hint(std::string hint, std::chrono::seconds threshold);

 private:
  using Clock = std::chrono::steady_clock;
  std::string label_;
  bool enabled_;
  bool tty_;
  bool drawn_ = false;
  Clock::time_point start_;
  Clock::time_point last_;
  Clock::duration interval_;
  std::string hint_;
  std::chrono::seconds hint_threshold_{0};
  bool hint_shown_ = false;
};

// "45s", "3m07s", "1h02m": compact durations for progress lines.
std::string human_duration(double seconds);

// "12.3k", "4.56M": compact counts for progress lines and tables.
std::string human_count(double value);

}  // namespace attnrt::cli
