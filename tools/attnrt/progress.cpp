#include "tools/attnrt/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace attnrt::cli {

ProgressBar::ProgressBar(std::string label, bool enabled)
    : label_(std::move(label)),
      enabled_(enabled),
      tty_(isatty(fileno(stderr)) != 0),
      last_(Clock::now()),
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
  if (tty_) {
    constexpr int kWidth = 28;
    const int filled = total > 0 ? static_cast<int>(kWidth * done / total) : 0;
    const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    // \033[K clears what a longer previous line left behind.
    std::fprintf(stderr, "\r%s [%s] %lld/~%lld %.*s | %.*s\033[K", label_.c_str(), bar.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total),
                 static_cast<int>(unit.size()), unit.data(), static_cast<int>(detail.size()),
                 detail.data());
    drawn_ = true;
  } else {
    std::fprintf(stderr, "%s: %lld of ~%lld %.*s | %.*s\n", label_.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total),
                 static_cast<int>(unit.size()), unit.data(), static_cast<int>(detail.size()),
                 detail.data());
  }
  std::fflush(stderr);
}

void ProgressBar::finish() {
  if (drawn_) {
    std::fputs("\r\033[K", stderr);
    std::fflush(stderr);
    drawn_ = false;
  }
}

std::string human_count(double value) {
  if (value >= 1e9) return fmt::format("{:.2f}G", value / 1e9);
  if (value >= 1e6) return fmt::format("{:.2f}M", value / 1e6);
  if (value >= 1e4) return fmt::format("{:.1f}k", value / 1e3);
  return fmt::format("{:.0f}", value);
}

}  // namespace attnrt::cli
