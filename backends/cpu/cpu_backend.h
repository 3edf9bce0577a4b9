// The cpu backend: SIMD (Highway, dynamic dispatch) and OpenMP attention for every full-attention
// mode, with the semantics of the reference backend (reference-semantics §8).
//
// The plan (init_forward_metadata) gathers every request's key slots, the verify tree masks and,
// per distinct layer shape, the work list (query tiles or single-query items, key ranges, key
// splits and their merges); forward only stores the step's K/V and runs the kernels.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/host_mla_mha.h"
#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "backends/cpu/dsa_select.h"
#include "backends/cpu/kernels/attention_plan.h"

namespace attnrt {

struct KVLayerView;

class CpuBackend final : public OnePathAttnBackend {
 public:
  explicit CpuBackend(const BackendContext& ctx);

  std::string_view name() const override { return "cpu"; }
  void init_forward_metadata(const ForwardBatch& batch) override;

  int num_threads() const { return num_threads_; }

  // The work list the current step's plan holds for a layer (for tests and logging): items and
  // merges; throws attnrt::Error when the layer is not part of the plan.
  struct WorkSummary {
    int64_t items = 0;
    int64_t merges = 0;          // rows whose keys were split over several items
    int64_t single_query = 0;    // items run by the single-query kernel
    int threads = 1;             // threads the layer runs on (as many as its work keeps busy)
  };
  WorkSummary work_summary(const LayerSpec& layer) const;

  // MLA in the MHA form (docs/mla.md), on the same kernels.
  MlaForm mla_form() const override { return mha_.form(); }
  const PrefixChunkPlan& prefix_chunk_plan() const override { return mha_.chunks(); }
  void forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                       const ForwardBatch& batch) override;
  void forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args, const LayerSpec& layer,
                                const ForwardBatch& batch) override;

 private:
  // Layers with the same key share one work list.
  struct VariantKey {
    int window = -1;
    bool causal = true;
    int q_heads = 0, kv_heads = 0, v_dim = 0;
    const int64_t* slot_map = nullptr;
    bool operator==(const VariantKey&) const = default;
  };
  struct Variant {
    VariantKey key;
    std::vector<int32_t> slots;  // translated key slots (SWA pools); empty = the full-pool slots
    std::vector<cpu::WorkItem> items;
    std::vector<cpu::MergeItem> merges;
    int64_t partial_floats = 0;
    int threads = 1;  // at most num_threads_, fewer for little work
  };

  // The MHA form's work: requests whose keys are rows of the call's own k / v (the causal part:
  // the step's tokens; a prefix chunk: the chunk's keys), and a work list per layer shape.
  struct MhaPart {
    std::vector<cpu::RequestInfo> reqs;
    std::vector<int32_t> slots;  // identity
    std::vector<Variant> variants;
  };

  static VariantKey key_of(const LayerSpec& layer, const KVLayerView& kv);
  Variant build_variant(const VariantKey& key, const KVLayerView& kv, int layer_id) const;
  Variant build_variant(const VariantKey& key, const KVLayerView& kv, int layer_id,
                        const std::vector<cpu::RequestInfo>& reqs,
                        const std::vector<int32_t>& slots) const;
  const Variant* find_variant(const VariantKey& key) const;
  bool planned_for(const ForwardBatch& batch) const;
  void attend(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch) override;
  // DSA layers (docs/dsa.md): stores the step's latent rows and index keys, selects every query
  // token's keys, then runs the single-query kernels over each token's selected keys.
  void attend_dsa(const AttnArgs& args, const LayerSpec& layer, const KVLayerView& kv,
                  cpu::LayerArgs& a);
  void run_variant(const cpu::LayerArgs& a, const Variant& var,
                   const std::vector<cpu::RequestInfo>& reqs, const std::vector<int32_t>& slots,
                   bool zero_slot_is_absent);
  void plan_mha(const ForwardBatch& batch, const StepLayout& layout);
  const Variant& mha_variant(MhaPart& part, const LayerSpec& layer, bool causal) const;
  void run_mha(MhaPart& part, const LayerSpec& layer, bool causal, const TensorView& q,
               const TensorView& k, const TensorView& v, const TensorView& out,
               const TensorView& lse);

  int num_threads_ = 1;
  int tile_rows_ = 0;
  int wide_tile_rows_ = 0;  // wide groups (kWideGroup q heads per kv head or more)

  // The plan of the current step.
  bool planned_ = false;
  ForwardMode mode_ = ForwardMode::IDLE;
  int64_t num_tokens_ = 0;
  std::vector<cpu::RequestInfo> reqs_;
  std::vector<int32_t> slots_;  // full-pool key slots of every request, request after request
  std::vector<int32_t> tree_depth_;
  std::vector<uint64_t> tree_mask_;
  int tree_words_ = 0;
  std::vector<Variant> variants_;
  std::vector<float> partial_;
  HostMlaMhaSteps mha_;
  MhaPart mha_causal_;
  std::vector<MhaPart> mha_chunks_;
  std::vector<uint8_t> chunk_out_;  // a chunk's output, in the dtype of out
  std::vector<float> chunk_lse_;
  std::vector<float> kv_f32_;       // k / v copied when their layout is not the kernels'
  cpu::DsaSelection dsa_;           // the selection of the last DSA layer call
};

// Threads the cpu backend runs: options->num_threads when > 0, else the environment variable
// ATTNRT_NUM_THREADS, else every core. Throws attnrt::Error for a malformed value.
int cpu_num_threads(const Options* options);

// Threads worth waking for `macs` multiply-adds of one call: one per 2M (about a tenth of a
// millisecond of a core), at least 1, at most `max_threads`. Small decode steps stay on one
// thread instead of fanning out to every core of a possibly shared machine.
int cpu_threads_for(int64_t macs, int max_threads);

// The SIMD target the kernels dispatch to on this CPU ("AVX3", "AVX2", "NEON", ...).
std::string cpu_simd_target();

// The registry entry "cpu": cpu device, any page size, every KV dtype, auto-selectable.
BackendEntry cpu_backend_entry();
void register_cpu_backend(Registry& registry);

}  // namespace attnrt
