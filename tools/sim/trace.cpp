#include "tools/sim/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "attnrt/core/error.h"

namespace attnrt::sim {

namespace {

using json = nlohmann::json;

constexpr const char* kFields =
    "id, arrival_step, prompt_len, output_len, shared_prefix, shared_prefix_len, abort_step";

// Reads an integer field; `min` is the smallest allowed value.
int int_field(const json& obj, const char* name, int fallback, bool required, int min,
              std::string_view origin, int line) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) {
    ATTNRT_CHECK(!required,
                 "trace {} line {}: field '{}' is missing; it is required (an integer >= {})",
                 origin, line, name, min);
    return fallback;
  }
  ATTNRT_CHECK(it->is_number_integer(),
               "trace {} line {}: field '{}' must be an integer >= {}, got {}", origin, line, name,
               min, it->dump());
  const int64_t v = it->get<int64_t>();
  ATTNRT_CHECK(v >= min && v <= (int64_t{1} << 30),
               "trace {} line {}: field '{}' = {}; allowed: an integer in [{}, 2^30]", origin, line,
               name, v, min);
  return static_cast<int>(v);
}

std::string string_field(const json& obj, const char* name, std::string_view origin, int line) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return {};
  ATTNRT_CHECK(it->is_string(), "trace {} line {}: field '{}' must be a string, got {}", origin,
               line, name, it->dump());
  return it->get<std::string>();
}

// Cross-line rules: unique ids, one length per shared prefix name.
void check_consistency(const Trace& trace) {
  std::map<std::string, const TraceRequest*> ids;
  std::map<std::string, const TraceRequest*> prefixes;
  for (const TraceRequest& r : trace.requests) {
    auto [it, fresh] = ids.emplace(r.id, &r);
    ATTNRT_CHECK(fresh,
                 "trace {} line {}: field 'id' = \"{}\" was already used on line {}; ids must be "
                 "unique",
                 trace.origin, r.line, r.id, it->second->line);
    if (r.shared_prefix.empty()) continue;
    auto [p, first] = prefixes.emplace(r.shared_prefix, &r);
    ATTNRT_CHECK(
        first || p->second->shared_prefix_len == r.shared_prefix_len,
        "trace {} line {}: field 'shared_prefix_len' = {} for shared prefix \"{}\", but line "
        "{} gives it {}; every request naming a shared prefix must give the same length",
        trace.origin, r.line, r.shared_prefix_len, r.shared_prefix, p->second->line,
        p->second->shared_prefix_len);
  }
}

TraceRequest parse_line(const std::string& text, std::string_view origin, int line, size_t index) {
  json obj;
  try {
    obj = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999
    fail(
        "trace {} line {}: not valid JSON ({}); each line must be one JSON object such as "
        "{{\"id\": \"r0\", \"arrival_step\": 0, \"prompt_len\": 300, \"output_len\": 40}}",
        origin, line, e.what());
  }
  ATTNRT_CHECK(obj.is_object(), "trace {} line {}: expected a JSON object, got {}", origin, line,
               obj.dump());
  for (const auto& [key, value] : obj.items()) {
    static const std::vector<std::string> known = {
        "id",         "arrival_step",  "prompt_len",
        "output_len", "shared_prefix", "shared_prefix_len",
        "abort_step"};
    ATTNRT_CHECK(std::find(known.begin(), known.end(), key) != known.end(),
                 "trace {} line {}: unknown field '{}'; known fields: {}", origin, line, key,
                 kFields);
  }
  TraceRequest r;
  r.line = line;
  r.id = string_field(obj, "id", origin, line);
  if (r.id.empty()) r.id = fmt::format("r{}", index);
  r.arrival_step = int_field(obj, "arrival_step", 0, false, 0, origin, line);
  r.prompt_len = int_field(obj, "prompt_len", 0, true, 1, origin, line);
  r.output_len = int_field(obj, "output_len", 0, true, 1, origin, line);
  r.shared_prefix = string_field(obj, "shared_prefix", origin, line);
  const bool has_len = obj.contains("shared_prefix_len") && !obj["shared_prefix_len"].is_null();
  if (r.shared_prefix.empty()) {
    ATTNRT_CHECK(
        !has_len,
        "trace {} line {}: field 'shared_prefix_len' is given without 'shared_prefix'; name "
        "the shared prefix (e.g. \"shared_prefix\": \"sys-a\") or drop the length",
        origin, line);
  } else {
    r.shared_prefix_len = int_field(obj, "shared_prefix_len", 0, true, 1, origin, line);
    ATTNRT_CHECK(
        r.shared_prefix_len < r.prompt_len,
        "trace {} line {}: field 'shared_prefix_len' = {} must be smaller than prompt_len = "
        "{} (at least one prompt token is computed by the request itself)",
        origin, line, r.shared_prefix_len, r.prompt_len);
  }
  r.abort_step = int_field(obj, "abort_step", -1, false, 0, origin, line);
  ATTNRT_CHECK(r.abort_step < 0 || r.abort_step >= r.arrival_step,
               "trace {} line {}: field 'abort_step' = {} comes before arrival_step = {}; a "
               "request is aborted at or after its arrival",
               origin, line, r.abort_step, r.arrival_step);
  return r;
}

// splitmix64: the built-in trace must not depend on the standard library's distributions, whose
// output differs between implementations.
struct Mix {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int uniform(int lo, int hi) {
    return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
};

}  // namespace

int64_t Trace::total_prompt_tokens() const {
  int64_t n = 0;
  for (const auto& r : requests) n += r.prompt_len;
  return n;
}

int64_t Trace::total_output_tokens() const {
  int64_t n = 0;
  for (const auto& r : requests) n += r.output_len;
  return n;
}

int Trace::last_arrival_step() const {
  int s = 0;
  for (const auto& r : requests) s = std::max(s, r.arrival_step);
  return s;
}

Trace parse_trace(std::string_view text, std::string_view origin) {
  Trace trace;
  trace.origin = std::string(origin);
  std::istringstream in{std::string(text)};
  std::string line_text;
  int line = 0;
  while (std::getline(in, line_text)) {
    ++line;
    if (line_text.find_first_not_of(" \t\r") == std::string::npos) continue;
    trace.requests.push_back(parse_line(line_text, origin, line, trace.requests.size()));
  }
  ATTNRT_CHECK(!trace.requests.empty(),
               "trace {}: no requests (the file is empty or only blank lines)", origin);
  check_consistency(trace);
  return trace;
}

Trace load_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  ATTNRT_CHECK(in.good(), "trace {}: cannot open the file for reading", path);
  std::ostringstream text;
  text << in.rdbuf();
  return parse_trace(text.str(), path);
}

Trace builtin_trace() {
  Trace trace;
  trace.origin = "built-in";
  Mix rng{20240611};
  auto add = [&](int arrival, int prompt, int output, const char* prefix, int prefix_len) {
    TraceRequest r;
    r.id = fmt::format("r{}", trace.requests.size());
    r.arrival_step = arrival;
    r.prompt_len = prompt;
    r.output_len = output;
    if (prefix != nullptr) {
      r.shared_prefix = prefix;
      r.shared_prefix_len = prefix_len;
    }
    trace.requests.push_back(std::move(r));
  };
  // First wave: a request every one to three iterations. Every third request carries one of two
  // system prompts; one request in eight is long enough to be prefilled in several chunks.
  int arrival = 2;
  for (int i = 0; i < 28; ++i) {
    const bool long_prompt = i % 8 == 5;
    const int own = long_prompt ? rng.uniform(260, 360) : rng.uniform(8, 120);
    const int output = rng.uniform(4, 40);
    if (i % 3 == 1) {
      add(arrival, 96 + own, output, "sys-a", 96);
    } else if (i % 6 == 2) {
      add(arrival, 48 + own, output, "sys-b", 48);
    } else {
      add(arrival, own, output, nullptr, 0);
    }
    arrival += rng.uniform(1, 3);
  }
  // Late wave after a pause: arrives together, so its prefills are batched, and reuses the cached
  // system prompt long after the first wave registered it.
  const int late = arrival + 45;
  for (int i = 0; i < 6; ++i) {
    const int own = rng.uniform(16, 90);
    if (i % 2 == 0) {
      add(late, 96 + own, rng.uniform(6, 24), "sys-a", 96);
    } else {
      add(late, own, rng.uniform(6, 24), nullptr, 0);
    }
  }
  return trace;
}

Trace soak_trace(int steps, int max_running, int chunk, int abort_every, uint64_t seed) {
  ATTNRT_CHECK(steps >= 1 && max_running >= 1 && chunk >= 1 && abort_every >= 0,
               "soak trace: steps {}, max_running {}, chunk {}, abort_every {}; the first three "
               "must be >= 1 and abort_every >= 0",
               steps, max_running, chunk, abort_every);
  Trace trace;
  trace.origin = fmt::format("soak (seed {})", seed);
  Mix rng{seed};
  // A request lives about 30 iterations (a few prefill chunks, ~24 outputs): arrivals every
  // 60 / max_running iterations on average keep about max_running of them running.
  const int gap = std::max(1, 60 / max_running);
  for (int arrival = 0; arrival < steps; arrival += rng.uniform(0, 2 * gap)) {
    TraceRequest r;
    r.id = fmt::format("s{}", trace.requests.size());
    r.arrival_step = arrival;
    r.prompt_len = rng.uniform(1, 4 * chunk);
    r.output_len = rng.uniform(1, 48);
    if (rng.uniform(0, 7) == 0 && r.prompt_len > 16) {
      r.shared_prefix = fmt::format("sys-{}", rng.uniform(0, 3));
      r.shared_prefix_len = 16;
    }
    if (abort_every > 0 && rng.uniform(1, abort_every) == 1) {
      r.abort_step = arrival + rng.uniform(0, 60);
    }
    trace.requests.push_back(std::move(r));
  }
  return trace;
}

std::string to_jsonl(const Trace& trace) {
  std::string out;
  for (const TraceRequest& r : trace.requests) {
    json obj = {{"id", r.id},
                {"arrival_step", r.arrival_step},
                {"prompt_len", r.prompt_len},
                {"output_len", r.output_len}};
    if (!r.shared_prefix.empty()) {
      obj["shared_prefix"] = r.shared_prefix;
      obj["shared_prefix_len"] = r.shared_prefix_len;
    }
    if (r.abort_step >= 0) obj["abort_step"] = r.abort_step;
    out += obj.dump();
    out += '\n';
  }
  return out;
}

}  // namespace attnrt::sim
