// The cuda device's services (include/attnrt/backend/device_services.h): pools in GPU memory on
// the KV cache's stream, whole-step CUDA graphs, device tensors for the tools.
#pragma once

#include <memory>
#include <vector>

#include "attnrt/backend/device_services.h"

namespace attnrt::cuda {

std::shared_ptr<const DeviceServices> cuda_device_services();

// The StepGraphRunner over `cache`, which must be a CudaKVCache.
std::unique_ptr<StepGraphRunner> make_cuda_graph_runner(const ModelSpec& model,
                                                        AttentionBackend& backend, KVCache& cache,
                                                        std::vector<int> buckets,
                                                        int verify_tokens);

}  // namespace attnrt::cuda
