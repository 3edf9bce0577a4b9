// Machine ceilings measured in the same run as the workloads, so that "% of ceiling" compares a
// kernel with what this machine can do right now (docs/workloads.md "Ceilings").
//   CPU: multi-threaded streaming read (memory), register-resident FMA loop (fp32 compute) and, when
//        the CPU has AVX512-BF16, a register-resident bf16 dot loop.
//   GPU: device copy bandwidth (read + write) and bf16 GEMM rate, measured by cuda_bench.cpp, which
//        install_builtin_device_probes() installs with register_ceiling_probe(DeviceKind::cuda, ...);
//        and the read rate of 1152-byte rows (an MLA latent row in bf16) gathered at random slots
//        and in slot order: what page-1 reads of such rows can reach against page-64 ones.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "attnrt/core/tensor.h"

namespace attnrt::bench {

struct Ceiling {
  double value = 0;          // GB/s (memory) or GFLOP/s (compute); 0 when unavailable
  std::string method;        // what was measured, e.g. "streaming read of 1.00 GiB, 2 threads, best of 5"
  std::string unavailable;   // why there is no figure ("" when measured)
  bool available() const { return unavailable.empty() && value > 0; }
};

struct Ceilings {
  Device device;
  int threads = 0;          // threads the CPU probes ran on (the backend's thread count)
  std::string simd_target;  // the SIMD target the CPU probes dispatched to (e.g. "AVX3")
  Ceiling memory;           // the ceiling of memory-bound rows (decode, verify)
  Ceiling fp32;
  Ceiling bf16;
  // GPU only (informational, no row is judged against them): bytes read per second of
  // kGatherRowBytes-byte rows at random slots of a >= 1 GiB pool, and of the same rows in order.
  Ceiling gather_random;
  Ceiling gather_ordered;
  // The ceiling of compute-bound rows (bf16 attention): the higher of the bf16 dot and fp32 FMA
  // peaks, since a kernel may use either (bf16 dot is the faster one on Zen 4, fp32 FMA on some
  // Xeons that run vdpbf16ps on one port).
  bool bf16_is_compute() const { return bf16.available() && bf16.value >= fp32.value; }
  const Ceiling& compute() const { return bf16_is_compute() ? bf16 : fp32; }
  std::string compute_name() const { return bf16_is_compute() ? "bf16" : "fp32"; }
};

inline constexpr int kGatherRowBytes = 1152;  // 576 bf16 values: one MLA latent row

struct CeilingOptions {
  int threads = 0;                     // 0 = ATTNRT_NUM_THREADS, else every hardware thread
  size_t memory_bytes = size_t{1} << 30;  // streaming buffer (docs/workloads.md asks for >= 1 GiB)
  int passes = 5;                      // best of this many passes for each probe
  double compute_seconds = 0.1;        // length of one compute-probe pass
};

// Threads a CPU run uses: `requested` when > 0, else ATTNRT_NUM_THREADS when set, else all
// hardware threads. Throws attnrt::Error for a malformed ATTNRT_NUM_THREADS.
int resolve_threads(int requested);

// Measures the ceilings of `device`. CPU is built in; other kinds need a registered probe, else
// attnrt::Error says which kind has none.
Ceilings measure_ceilings(Device device, const CeilingOptions& options = {});

using CeilingProbe = std::function<Ceilings(Device, const CeilingOptions&)>;
void register_ceiling_probe(DeviceKind kind, CeilingProbe probe);

// The individual CPU probes (also used by tests with small sizes).
// Streaming read of `bytes` on `threads` threads; returns GB/s of the best pass.
double cpu_stream_read_gbps(size_t bytes, int threads, int passes);
// Register-resident fp32 FMA loop on `threads` threads; GFLOP/s of the best pass.
double cpu_fma_gflops(int threads, double seconds, int passes);
// Register-resident bf16 dot loop (AVX512-BF16 vdpbf16ps); 0 with `why_not` set when the CPU or
// the build cannot run it.
double cpu_bf16_dot_gflops(int threads, double seconds, int passes, std::string* why_not);
// Name of the best SIMD target Highway dispatches to on this CPU.
std::string cpu_simd_target();

}  // namespace attnrt::bench
