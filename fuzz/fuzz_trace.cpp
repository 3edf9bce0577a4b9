// A serving trace as `attnrt run --trace FILE` reads it; a trace that parses must survive the round
// trip through to_jsonl unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "attnrt/core/error.h"
#include "tools/sim/trace.h"

namespace {

bool same(const attnrt::sim::TraceRequest& a, const attnrt::sim::TraceRequest& b) {
  return a.id == b.id && a.arrival_step == b.arrival_step && a.prompt_len == b.prompt_len &&
         a.output_len == b.output_len && a.shared_prefix == b.shared_prefix &&
         a.shared_prefix_len == b.shared_prefix_len;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  attnrt::sim::Trace trace;
  try {
    trace = attnrt::sim::parse_trace(text, "fuzz.jsonl");
  } catch (const attnrt::Error&) {
    return 0;
  }
  const attnrt::sim::Trace again = attnrt::sim::parse_trace(to_jsonl(trace), "round trip");
  bool equal = again.requests.size() == trace.requests.size();
  for (size_t i = 0; equal && i < trace.requests.size(); ++i) {
    equal = same(trace.requests[i], again.requests[i]);
  }
  if (!equal) {
    std::fprintf(stderr, "to_jsonl round trip changed the trace:\n%s\n", to_jsonl(trace).c_str());
    std::abort();
  }
  return 0;
}
