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

std::string_view speculative_attention_mode_name(SpeculativeAttentionMode m) {
  return m == SpeculativeAttentionMode::decode ? "decode" : "prefill";
}

SpeculativeAttentionMode parse_speculative_attention_mode(std::string_view name) {
  if (name == "prefill") return SpeculativeAttentionMode::prefill;
  if (name == "decode") return SpeculativeAttentionMode::decode;
  fail("--speculative-attention-mode '{}' is not valid: use 'prefill' (verify and draft extend "
       "run on the prefill backend) or 'decode' (they run on the decode backend)",
       name);
}

}  // namespace attnrt
