// A one-line progress display on stderr for long subcommands (run, check). On a terminal it redraws
// a bar in place (at most ten times a second); when stderr is a file or a pipe it prints a plain
// line every few seconds instead, so logs stay readable; disabled, it prints nothing.
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

 private:
  using Clock = std::chrono::steady_clock;
  std::string label_;
  bool enabled_;
  bool tty_;
  bool drawn_ = false;
  Clock::time_point last_;
  Clock::duration interval_;
};

// "12.3k", "4.56M": compact counts for progress lines and tables.
std::string human_count(double value);

}  // namespace attnrt::cli
