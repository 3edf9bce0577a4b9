// The cuda backend's registration in a build without CUDA (nvcc not found, or -DATTNRT_CUDA=OFF):
// nothing runs on the CUDA device, so query_cuda() says the build has none.
#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"
#include "attnrt/runtime/communicator.h"
#include "src/runtime/dcp_device.h"

namespace attnrt {

void register_cuda_backend(Registry&) {}

}  // namespace attnrt

namespace attnrt {

std::string nccl_unavailable_reason() {
  return "this attnrt is built without CUDA (nvcc not found, or -DATTNRT_CUDA=OFF), so it has no "
         "NCCL communicator";
}

int nccl_version() { fail("NCCL: {}", nccl_unavailable_reason()); }

NcclUniqueId nccl_unique_id() { fail("NCCL: {}", nccl_unavailable_reason()); }

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId&, int, int, int, void*) {
  fail("NCCL: {}", nccl_unavailable_reason());
}

std::vector<std::unique_ptr<Communicator>> make_nccl_group(std::span<const int>,
                                                           std::span<void* const>) {
  fail("NCCL: {}", nccl_unavailable_reason());
}

std::unique_ptr<Communicator> wrap_nccl_comm(void*, void*) {
  fail("NCCL: {}", nccl_unavailable_reason());
}

std::unique_ptr<Communicator> make_device_in_process_communicator(int, std::span<void* const>) {
  fail("communicator 'device_in_process': this attnrt is built without CUDA (nvcc not found, or "
       "-DATTNRT_CUDA=OFF); simulated ranks run on host buffers ('in_process')");
}

std::unique_ptr<DcpDeviceRank> make_dcp_device_rank(void*) {
  fail("DcpAttention: GPU tensors need a build with CUDA (nvcc not found, or -DATTNRT_CUDA=OFF)");
}

}  // namespace attnrt
