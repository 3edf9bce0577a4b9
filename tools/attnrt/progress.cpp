#include "tools/attnrt/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace attnrt::cli {

ProgressBar::ProgressBar(std::string label, bool enabled)
    : label_(std::move(label)),
      enabled_(enabled),
      tty_(isatty(fileno(stderr)) != 0),
      start_(Clock::now()),
      last_(start_),
      interval_(tty_ ? std::chrono::duration_cast<Clock::duration>(std::chrono::milliseconds(100))
                     : std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(5))) {}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::update(int64_t done, int64_t total, std::string_view unit,
                         std::string_view detail) {
  if (!enabled_) return;
  const Clock::time_point now = Clock::now();
  if (now - last_ < interval_) return;
  last_ = now;
  total = std::max(total, done);
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  // Time left from the pace so far; only once a few units are done and a few seconds have passed,
  // so that start-up costs do not dominate the estimate.
  double left = -1;
  if (done >= 2 && total > 0 && elapsed >= 2.0) {
    left = elapsed * static_cast<double>(total - done) / static_cast<double>(done);
  }
  const std::string times =
      left >= 0 ? fmt::format("{} elapsed, ~{} left", human_duration(elapsed), human_duration(left))
                : fmt::format("{} elapsed", human_duration(elapsed));
  if (!hint_shown_ && !hint_.empty() && left > static_cast<double>(hint_threshold_.count())) {
    hint_shown_ = true;
    if (drawn_) std::fputs("\r\033[K", stderr);
    std::fprintf(stderr, "%s: about %s left; %s\n", label_.c_str(), human_duration(left).c_str(),
                 hint_.c_str());
  }
  if (tty_) {
    constexpr int kWidth = 28;
    const int filled = total > 0 ? static_cast<int>(kWidth * done / total) : 0;
    const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    // \033[K clears what a longer previous line left behind.
    std::fprintf(stderr, "\r%s [%s] %lld/~%lld %.*s | %s | %.*s\033[K", label_.c_str(), bar.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total),
                 static_cast<int>(unit.size()), unit.data(), times.c_str(),
                 static_cast<int>(detail.size()), detail.data());
    drawn_ = true;
  } else {
    std::fprintf(stderr, "%s: %lld of ~%lld %.*s | %s | %.*s\n", label_.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total),
                 static_cast<int>(unit.size()), unit.data(), times.c_str(),
                 static_cast<int>(detail.size()), detail.data());
  }
  std::fflush(stderr);
}

void ProgressBar::set_long_run_hint(std::string hint, std::chrono::seconds threshold) {
  hint_ = std::move(hint);
  hint_threshold_ = threshold;
}

void ProgressBar::finish() {
  if (drawn_) {
    std::fputs("\r\033[K", stderr);
    std::fflush(stderr);
    drawn_ = false;
  }
}

std::string human_duration(double seconds) {
  const long long s = std::llround(std::max(0.0, seconds));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
}

std::string human_count(double value) {
  if (value >= 1e9) return fmt::format("{:.2f}G", value / 1e9);
  if (value >= 1e6) return fmt::format("{:.2f}M", value / 1e6);
  if (value >= 1e4) return fmt::format("{:.1f}k", value / 1e3);
  return fmt::format("{:.0f}", value);
}

}  // namespace attnrt::cli
