// A .npy file as `attnrt replay` reads it (parse_npy is read_npy without the file). An array that
// parses must hold exactly numel * dtype_size bytes and accept a contiguous view.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "attnrt/core/error.h"
#include "tools/io/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  try {
    const attnrt::NpyArray a = attnrt::parse_npy(file, "fuzz.npy");
    if (a.bytes.size() != static_cast<size_t>(a.numel()) * attnrt::dtype_size(a.dtype)) {
      std::abort();
    }
    const attnrt::TensorView v = a.view();
    if (v.numel() != a.numel()) std::abort();
  } catch (const attnrt::Error&) {
  }
  return 0;
}
