// A HuggingFace config.json as `attnrt run --model FILE` loads it: the loader, the model's checks
// and the tensor-parallel split.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "attnrt/core/error.h"
#include "attnrt/model/model_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const attnrt::ModelSpec model = attnrt::load_hf_config_text(text, "fuzz config.json");
    model.validate();
    attnrt::apply_tensor_parallel(model, 2).validate();
  } catch (const attnrt::Error&) {
  }
  return 0;
}
