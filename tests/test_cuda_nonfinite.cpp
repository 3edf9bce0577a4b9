// The NaN rule of docs/backends.md on the cuda backend, against reference (tests/non_finite_case.h):
// a NaN in a q row, or in the K or V row of a key a row attends to, makes that row NaN, and every
// other row stays finite and right. Infinities are not held to the rule on cuda (docs/backends.md
// says what they give), so only NaN cases run here.
#include <gtest/gtest.h>

#include "attnrt/core/device.h"
#include "tests/non_finite_case.h"
#include "tests/test_cuda_util.h"

namespace attnrt {
namespace {

TEST(CudaNonFinite, NanInQOrAnAttendedKeyMakesThoseRowsNanAsOnReference) {
  SKIP_WITHOUT_GPU();
  test::check_non_finite("cuda", {DType::bf16}, /*infinities=*/false);
}

}  // namespace
}  // namespace attnrt
