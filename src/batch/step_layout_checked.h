// make_step_layout without its fused fast path: every check in turn, the first failure thrown.
// make_step_layout must give the same layout or the same error for every batch; the tests hold it
// to that on random bad batches.
#pragma once

#include "attnrt/batch/forward_batch.h"

namespace attnrt {

void make_step_layout_checked(const ForwardBatch& batch, StepLayout& layout);

}  // namespace attnrt
