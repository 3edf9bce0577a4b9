// Entry points of the cpu attention kernels. Each call dispatches, through Highway, to the best
// SIMD target the running CPU supports (chosen once, at the first call).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/cpu/kernels/attention_plan.h"

namespace attnrt::cpu {

// Runs every work item of the plan for every kv head of the layer, then merges split items.
void run_attention(const LayerArgs& args, const KernelPlan& plan);

// Query rows (tokens x heads of one GQA group) one multi-token work item holds at most: the tile
// height the blocked kernel is built for on this CPU.
int tile_rows();
// The same for the items of wide GQA groups (many q heads per kv head, e.g. MLA): heads of one or
// more tokens in tiles of up to this many rows.
int wide_tile_rows();

// The SIMD targets this build has kernels for that this CPU runs, best first, as
// ATTNRT_CPU_SIMD names them ("avx3", "avx2", "sse4", ...).
std::vector<std::string> simd_target_names();
// Applies ATTNRT_CPU_SIMD (docs/backends.md): the kernels dispatch to that target instead of the
// best one, to test or compare the narrower paths. attnrt::Error naming the targets when it is not
// one of simd_target_names(). Called before the first dispatch (CpuBackend, simd_target_name).
void choose_simd_target();

// Name of the SIMD target in use ("AVX3", "AVX2", "NEON", ...), "+BF16" when the bf16
// dot-product kernels run (AVX-512 BF16 present and issuing about as fast as FMA); "none (why)"
// when ATTNRT_CPU_SIMD names no target here.
std::string simd_target_name();

// Converts n stored KV elements (bf16, fp16, fp32, fp8 e4m3 / e5m2) to float with the same
// in-register conversion the kernels use.
void convert_to_float(DType dtype, const void* src, int64_t n, float* dst);

// Converts n fp8 codes (e4m3 / e5m2) to the bf16 words the single-query dot-product kernels
// multiply: the value divided by kernel_load_factor(dtype), exactly (NaN codes give a NaN). Returns
// false, writing nothing, where those kernels do not run (no AVX-512 BF16 with VBMI, or vdpbf16ps
// slower than FMA).
bool widen_fp8_to_bf16(DType dtype, const uint8_t* src, int64_t n, uint16_t* dst);

// How much larger the stored values are than what the kernels multiply (folded into the scales).
float kernel_load_factor(DType dtype);

}  // namespace attnrt::cpu
