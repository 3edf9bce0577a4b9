// A replay case as `attnrt replay CASE_DIR` reads and runs it: case.json and its .npy files, packed
// into one input (pack_case.py), read by parse_case and, when it reads, replayed on `reference` and
// `cpu`.
//
// Input format: case.json's text, then for each further file a line "--- NAME" followed by the
// file's bytes up to the next "\n--- " (or the end).
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "attnrt/core/error.h"
#include "tools/io/case_file.h"

namespace {

std::map<std::string, std::string> unpack(std::string_view in) {
  constexpr std::string_view kMarker = "\n--- ";
  std::map<std::string, std::string> files;
  size_t end = in.find(kMarker);
  files["case.json"] = std::string(in.substr(0, end));
  while (end != std::string_view::npos) {
    const size_t name_at = end + kMarker.size();
    const size_t name_end = in.find('\n', name_at);
    if (name_end == std::string_view::npos) break;
    const std::string name(in.substr(name_at, name_end - name_at));
    end = in.find(kMarker, name_end);
    const size_t body_at = name_end + 1;
    files[name] = std::string(in.substr(body_at, end == std::string_view::npos
                                                       ? std::string_view::npos
                                                       : end - body_at));
  }
  return files;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::map<std::string, std::string> files =
      unpack(std::string_view(reinterpret_cast<const char*>(data), size));
  const attnrt::CaseFileReader read = [&](const std::string& name) -> std::optional<std::string> {
    auto it = files.find(name);
    if (it == files.end()) return std::nullopt;
    return it->second;
  };
  try {
    const attnrt::Case c = attnrt::parse_case(read, "fuzz-case");
    for (const char* backend : {"reference", "cpu"}) {
      try {
        attnrt::replay_case(c, backend);
      } catch (const attnrt::Error&) {
      }
    }
  } catch (const attnrt::Error&) {
  }
  return 0;
}
