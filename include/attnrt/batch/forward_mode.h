// ForwardMode and its predicates (reference-semantics §1).
#pragma once

#include <cstdint>
#include <string_view>

namespace attnrt {

enum class ForwardMode : uint8_t {
  EXTEND,
  DECODE,
  MIXED,
  IDLE,
  TARGET_VERIFY,
  DRAFT_EXTEND,
  DRAFT_EXTEND_V2,
};

std::string_view forward_mode_name(ForwardMode m);
ForwardMode parse_forward_mode(std::string_view name);  // throws attnrt::Error listing the names

constexpr bool is_extend(ForwardMode m, bool include_v2 = false) {
  return m == ForwardMode::EXTEND || m == ForwardMode::MIXED || m == ForwardMode::DRAFT_EXTEND ||
         m == ForwardMode::TARGET_VERIFY || (include_v2 && m == ForwardMode::DRAFT_EXTEND_V2);
}
constexpr bool is_prefill(ForwardMode m, bool include_v2 = false) { return is_extend(m, include_v2); }
constexpr bool is_decode(ForwardMode m) { return m == ForwardMode::DECODE; }
constexpr bool is_mixed(ForwardMode m) { return m == ForwardMode::MIXED; }
constexpr bool is_idle(ForwardMode m) { return m == ForwardMode::IDLE; }
constexpr bool is_decode_or_idle(ForwardMode m) { return is_decode(m) || is_idle(m); }
constexpr bool is_target_verify(ForwardMode m) { return m == ForwardMode::TARGET_VERIFY; }
constexpr bool is_draft_extend(ForwardMode m, bool include_v2 = false) {
  return m == ForwardMode::DRAFT_EXTEND || (include_v2 && m == ForwardMode::DRAFT_EXTEND_V2);
}
constexpr bool is_draft_extend_v2(ForwardMode m) { return m == ForwardMode::DRAFT_EXTEND_V2; }
constexpr bool is_extend_or_draft_extend_or_mixed(ForwardMode m, bool include_v2 = false) {
  return m == ForwardMode::EXTEND || m == ForwardMode::DRAFT_EXTEND || m == ForwardMode::MIXED ||
         (include_v2 && m == ForwardMode::DRAFT_EXTEND_V2);
}
constexpr bool is_extend_without_speculative(ForwardMode m) {
  return is_extend(m) && !is_target_verify(m) && !is_draft_extend(m);
}
constexpr bool is_cuda_graph(ForwardMode m) {
  return m == ForwardMode::DECODE || m == ForwardMode::TARGET_VERIFY || m == ForwardMode::IDLE;
}

}  // namespace attnrt
