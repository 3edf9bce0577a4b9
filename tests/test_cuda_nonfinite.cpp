// The NaN rule of docs/backends.md on the cuda backend, against reference (tests/non_finite_case.h):
// a NaN in a q row or in the K row of a key a row attends to makes that row NaN; a NaN in such a
// key's V row makes the row's element of that dim NaN (the others stay finite: cuda keeps V's NaN
// in its own dim); every other row stays finite and right. Infinities are not held to the rule on
// cuda (docs/backends.md says what they give), so only NaN cases run here.
#include <gtest/gtest.h>

#include "attnrt/core/device.h"
#include "tests/non_finite_case.h"
#include "tests/test_cuda_util.h"

namespace attnrt {
namespace {

TEST(CudaNonFinite, NanInQOrAnAttendedKeyReachesThoseRowsAsOnReference) {
  SKIP_WITHOUT_GPU();
  test::check_non_finite("cuda", {DType::bf16}, /*infinities=*/false, test::VNanRow::own_dim);
}

}  // namespace
}  // namespace attnrt
