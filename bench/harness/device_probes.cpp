#include "bench/harness/device_probes.h"

#include <mutex>

#if defined(ATTNRT_HAS_CUDA)
#include "bench/harness/cuda_bench.h"
#endif

namespace attnrt::bench {

void install_builtin_device_probes() {
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(ATTNRT_HAS_CUDA)
    cuda::register_cuda_bench_probes();
#endif
  });
}

}  // namespace attnrt::bench
