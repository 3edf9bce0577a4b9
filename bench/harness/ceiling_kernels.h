// Single-thread loops behind the CPU ceiling probes (ceiling_kernels.cpp); ceilings.cpp runs them
// on every thread and times them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace attnrt::bench {

// Sum of `count` floats read with the widest vectors of this CPU.
float stream_read_sum(const float* data, size_t count);
// Runs a register-resident FMA loop; returns the FLOPs it executed. The result goes to *sink so
// the loop cannot be removed.
double fma_loop(uint64_t iterations, float a, float b, float* sink);
const char* dispatched_target_name();

bool bf16_dot_supported(std::string* why_not);
// Register-resident vdpbf16ps loop; returns the FLOPs it executed. Call only when supported.
double bf16_dot_loop(uint64_t iterations, float* sink);

}  // namespace attnrt::bench
