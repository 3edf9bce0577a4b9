// GPU-side delays and holds for tests and fault injection: they make the GPU fall behind the host,
// or keep one stream's later work back until another stream reaches a point, without the host
// waiting. They expose work that is ordered with the wrong stream, or not at all (docs/cuda_graphs.md,
// "What orders a host write before the GPU reads it"; tests/test_cuda_stream_order.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attnrt::cuda {

// One thread that spins for `ns` nanoseconds of the GPU's global timer on `stream`: the work
// enqueued behind it starts that much later, while the host goes on.
cudaError_t launch_gpu_delay(uint64_t ns, cudaStream_t stream);

// A gate in device memory: int32 words [state, released_by_signal]. gate_hold() enqueues on
// `stream` one thread that waits until gate_signal() (enqueued on another stream) opens the gate,
// or until `timeout_ns` have passed, and records which of the two ended the wait (word 1: 1 =
// signalled, 2 = timed out). The gate must be zeroed (cudaMemset) before the hold is enqueued. A
// device-wide synchronisation while a hold waits for a signal the host has not enqueued yet ends
// only at the timeout.
cudaError_t gate_hold(int32_t* gate, uint64_t timeout_ns, cudaStream_t stream);
cudaError_t gate_signal(int32_t* gate, cudaStream_t stream);

}  // namespace attnrt::cuda
