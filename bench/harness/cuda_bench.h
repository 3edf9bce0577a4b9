// What `attnrt bench` needs from the GPU: its ceilings (device copy bandwidth counting bytes read
// and written; bf16 GEMM 8192^3 through cuBLAS, L2 flushed between repetitions; the page-1 row
// gather, at random slots and in order) and a timer of CUDA events, installed with bench::register_ceiling_probe / register_device_timer.
#pragma once

#include "bench/harness/ceilings.h"

namespace attnrt::cuda {

// Measures the ceilings of a CUDA device (WORKLOADS.md "Ceilings"). The GEMM loads cuBLAS at run
// time, so a machine without it still gets the copy figure and the reason for the missing one.
bench::Ceilings measure_gpu_ceilings(Device device, const bench::CeilingOptions& options);

// Installs the probe and the timer for DeviceKind::cuda. The timer records its events on the
// legacy default stream: the work it times must be issued there (or on a stream that synchronises
// with it).
void register_cuda_bench_probes();

}  // namespace attnrt::cuda
