// The Highway targets every translation unit of the cpu attention kernels compiles for. Each unit
// includes this before hwy/foreach_target.h, so that all of them hold the same targets: the
// kernels of one unit call those of another for the target already chosen.
#pragma once

// Scalable-vector targets cannot hold vectors in arrays, which the register blocking relies on;
// Arm builds use NEON instead.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif
