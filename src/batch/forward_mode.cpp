#include "attnrt/batch/forward_mode.h"

#include <array>
#include <cctype>
#include <string>

#include "attnrt/core/error.h"

namespace attnrt {

namespace {

constexpr std::array<std::pair<ForwardMode, std::string_view>, 7> kModeNames{{
    {ForwardMode::EXTEND, "EXTEND"},
    {ForwardMode::DECODE, "DECODE"},
    {ForwardMode::MIXED, "MIXED"},
    {ForwardMode::IDLE, "IDLE"},
    {ForwardMode::TARGET_VERIFY, "TARGET_VERIFY"},
    {ForwardMode::DRAFT_EXTEND, "DRAFT_EXTEND"},
    {ForwardMode::DRAFT_EXTEND_V2, "DRAFT_EXTEND_V2"},
}};

}  // namespace

std::string_view forward_mode_name(ForwardMode m) {
  for (const auto& [mode, name] : kModeNames) {
    if (mode == m) return name;
  }
  return "?";
}

// Case-insensitive so that CLI users may type `decode` as well as the engine's `DECODE`.
ForwardMode parse_forward_mode(std::string_view name) {
  std::string upper(name);
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const auto& [mode, mode_name] : kModeNames) {
    if (mode_name == upper) return mode;
  }
  fail("unknown forward mode '{}': use one of EXTEND, DECODE, MIXED, IDLE, TARGET_VERIFY, "
       "DRAFT_EXTEND, DRAFT_EXTEND_V2 (case-insensitive)", name);
}

}  // namespace attnrt
