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

// Where the speculative steps (TARGET_VERIFY, DRAFT_EXTEND) run: on the prefill or on the decode
// backend (the engine's speculative_attention_mode, "prefill" by default).
enum class SpeculativeAttentionMode : uint8_t { prefill, decode };
std::string_view speculative_attention_mode_name(SpeculativeAttentionMode m);
// "prefill" or "decode"; throws attnrt::Error naming the value and what each choice means.
SpeculativeAttentionMode parse_speculative_attention_mode(std::string_view name);

// The backend of a run that serves a step (reference-semantics §6.1): DECODE and IDLE go to the
// decode backend, TARGET_VERIFY and DRAFT_EXTEND where the speculative mode says, everything else
// (EXTEND, MIXED, DRAFT_EXTEND_V2) to the prefill backend. The one routing table: the hybrid
// wrappers, the runtime and the selection's explanations all read it.
enum class Phase : uint8_t { prefill, decode };
constexpr Phase phase_for(ForwardMode m, SpeculativeAttentionMode spec) {
  if (is_decode_or_idle(m)) return Phase::decode;
  if (is_target_verify(m) || is_draft_extend(m))
    return spec == SpeculativeAttentionMode::decode ? Phase::decode : Phase::prefill;
  return Phase::prefill;
}

}  // namespace attnrt
