// The reference backend: the correctness oracle every other backend is compared with
// (reference-semantics §8). Plain loops with float64 accumulation over per-token slots read through
// ReqToTokenPool rows; no performance work, every full-attention feature.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/host_mla_mha.h"
#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"

namespace attnrt {

class ReferenceBackend final : public OnePathAttnBackend {
 public:
  explicit ReferenceBackend(const BackendContext& ctx);

  std::string_view name() const override { return "reference"; }
  // Derives the layout, checks that every request row holds this step's out_cache_loc at its
  // query positions (the write-before-read rule) and gathers each request's full-pool key slots.
  void init_forward_metadata(const ForwardBatch& batch) override;

  // The plan of the current step (valid after init_forward_metadata).
  const StepLayout& layout() const { return plan_.layout; }

  // MLA in the MHA form (docs/mla.md): each part's softmax in float64, and the chunks' merge.
  MlaForm mla_form() const override { return mha_.form(); }
  const PrefixChunkPlan& prefix_chunk_plan() const override { return mha_.chunks(); }
  void forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                       const ForwardBatch& batch) override;
  void forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args, const LayerSpec& layer,
                                const ForwardBatch& batch) override;

  // Restricts the following forward calls to the query rows `tokens` (indices into the step's
  // tokens) and the q heads `heads`; every other output element is left as it was (`attnrt run`
  // checks a sample of rows this way). An empty list means all rows, or all heads.
  void set_sample(std::vector<int64_t> tokens, std::vector<int> heads);

  // Threads of its parallel loops: Options::num_threads, else ATTNRT_NUM_THREADS, else every core
  // (host_num_threads); a loop wakes one per 2^20 multiply-adds of its work, never more than the
  // calling thread's omp_get_max_threads(), so the small calls of `attnrt run`'s sampled checks
  // stay on the calling thread.
  int num_threads() const { return num_threads_; }

 private:
  struct Plan {
    StepLayout layout;
    ForwardMode mode = ForwardMode::IDLE;
    std::vector<int64_t> key_start;   // [bs + 1] offsets into key_slots
    std::vector<int64_t> key_slots;   // full-pool slot of every key of every request
    std::vector<int64_t> key_pos;     // position of every key (verify drafts: seq_len + depth)
    std::vector<int64_t> query_pos;   // [T]
    std::vector<int32_t> query_block; // [T] index of the query inside its request's new tokens
  };

  void attend(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch) override;
  bool planned_for(const ForwardBatch& batch) const;
  int threads_for(int64_t work) const;

  int num_threads_;
  Plan plan_;
  HostMlaMhaSteps mha_;
  bool planned_ = false;
  std::vector<int64_t> sample_tokens_;  // ascending; empty = every row
  std::vector<int> sample_heads_;       // empty = every head
};

// The registry entry "reference": cpu only, any page size, every KV dtype, never auto-selected.
BackendEntry reference_backend_entry();
void register_reference_backend(Registry& registry);

}  // namespace attnrt
