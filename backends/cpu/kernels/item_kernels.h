// The two item kernels of run_attention(), each in a translation unit of its own with its own
// dynamic dispatch (decode_kernel.cc, tile_kernel.cc). `args` holds the scales with the K/V type's
// load factor already folded in; `dot`: q, K/V and the output are such that the bf16 dot-product
// form may run (the kernel still checks the dims it needs).
#pragma once

#include "backends/cpu/kernels/attention_plan.h"

namespace attnrt::cpu {

// A single-query item, for every kv head in one pass over the keys.
void run_decode_item(const LayerArgs& args, const KernelPlan& plan, const WorkItem& item, bool dot);

// A multi-query item (query rows in the lanes) for one kv head.
void run_tile_item(const LayerArgs& args, const KernelPlan& plan, const WorkItem& item, int kv_head,
                   bool dot);

}  // namespace attnrt::cpu
