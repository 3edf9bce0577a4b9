// The backend options as the CLI parses them (`attnrt run|info|check|bench`: one argument per input
// line, the flags of add_backend_options plus --model PRESET), then checked against the model by
// resolve_backends and by building an AttentionRuntime (small pools) from them.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attnrt/core/error.h"
#include "attnrt/runtime/attention_runtime.h"
#include "tools/attnrt/cli_options.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> args;
  size_t at = 0;
  while (at <= text.size() && args.size() < 64) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const std::string_view arg = text.substr(at, end - at);
    args.emplace_back(arg.substr(0, arg.find('\0')));  // a command line's arguments hold no NUL
    at = end + 1;
  }
  // Empty arguments are left out: CLI11 2.1.2 (Debian 12) takes an empty positional argument for
  // the name of a nameless option group and loops forever when an unknown option follows
  // (`attnrt run "" -x` hangs; docs/RELIABILITY.md), which would stop every run of this harness.
  std::vector<const char*> argv = {"attnrt"};
  for (const std::string& a : args) {
    if (!a.empty()) argv.push_back(a.c_str());
  }

  attnrt::Options options;
  std::string model_name = "demo";
  CLI::App app;
  app.add_option("--model", model_name);
  attnrt::cli::add_backend_options(app, options);
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
    return 0;  // the CLI's own answer to a malformed command line (main prints it, exits 1 or 2)
  }
  const std::vector<std::string> presets = attnrt::preset_names();
  if (std::find(presets.begin(), presets.end(), model_name) == presets.end()) return 0;
  try {
    attnrt::ModelSpec model = attnrt::model_preset(model_name);
    attnrt::resolve_backends(options, model);
    model.layers.resize(std::min<size_t>(model.layers.size(), 4));
    attnrt::RuntimeConfig config;
    config.max_requests = 2;
    config.kv_slots = 256;
    config.max_num_tokens = 64;
    config.max_context_len = 64;
    config.cuda_graphs = false;
    attnrt::AttentionRuntime rt(std::move(model), options, config);
  } catch (const attnrt::Error&) {
  }
  return 0;
}
