// The cuda device's services (include/attnrt/backend/device_services.h): pools in GPU memory on
// the KV cache's stream, whole-step CUDA graphs, device tensors for the tools.
#pragma once

#include <cuda_runtime_api.h>

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

// Ends the capture on `stream` and instantiates what it recorded (the graph itself is freed);
// throws the device's error when the capture or the instantiation failed.
cudaGraphExec_t end_capture_and_instantiate(cudaStream_t stream);
// Ends a capture that failed (an exception inside it), discards what it recorded and clears the
// sticky error, so the stream can be used again.
void abandon_capture(cudaStream_t stream);

}  // namespace attnrt::cuda
