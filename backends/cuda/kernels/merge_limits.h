// The most split-KV chunks of one request that the merge kernel (merge_store.cu) combines: one
// weight per split in its shared memory. The planner's bound (cuda_plan.h's kMaxSplits) is checked
// against it. Plain C++: the host plan includes it without CUDA.
#pragma once

namespace attnrt::cuda {

inline constexpr int kMergeMaxSplits = 128;

}  // namespace attnrt::cuda
