// The cuda backend's registration in a build without CUDA (nvcc not found, or -DATTNRT_CUDA=OFF):
// nothing runs on the CUDA device, so query_cuda() says the build has none.
#include "attnrt/backend/registry.h"

namespace attnrt {

void register_cuda_backend(Registry&) {}

}  // namespace attnrt
