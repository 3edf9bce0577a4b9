// Option validation, the inheritance rule, auto-selection, and construction of the (possibly
// hybrid) backend for a run (reference-semantics §5, §6, §9; attnrt turns every silent rewrite into
// an error or an explained auto-choice).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/options.h"
#include "attnrt/backend/registry.h"
#include "attnrt/core/device.h"
#include "attnrt/core/dtype.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

// The largest page size (Options::page_size): a page is the unit of prefix reuse and of the
// backends' page tables, and pages beyond this only waste the tail of every request.
inline constexpr int kMaxPageSize = 1024;

// The most threads a cpu backend takes (Options::num_threads, ATTNRT_NUM_THREADS): four per
// hardware thread of this machine; more only oversubscribe the cores.
int max_num_threads();

// Threads a host backend (cpu, reference) runs: options->num_threads when > 0, else the
// environment variable ATTNRT_NUM_THREADS, else `every_core` (the caller's count of the cores it
// may use, e.g. omp_get_num_procs()). Throws attnrt::Error naming `who` for a count outside
// [0, max_num_threads()] or a malformed variable.
int host_num_threads(const Options* options, std::string_view who, int every_core);

// Threads worth waking for `work` units of one call (multiply-adds, loads): one per
// `work_per_thread`, at least 1, at most `max_threads`, so a small call stays on the calling
// thread instead of fanning out over a possibly shared machine.
int host_threads_for(int64_t work, int64_t work_per_thread, int max_threads);
// The same, also within the calling thread's OpenMP limit (omp_get_max_threads()), for a loop that
// passes it as an explicit num_threads clause: `attnrt check --jobs N` runs each case on one
// thread by omp_set_num_threads(1), which the clause would otherwise override.
int omp_threads_for(int64_t work, int64_t work_per_thread, int max_threads);

struct Selection {
  std::string prefill;  // full-attention backend for EXTEND / MIXED (and verify in prefill mode)
  std::string decode;   // full-attention backend for DECODE / IDLE (and verify in decode mode)
  std::string linear_prefill;  // "" when the model has no linear layers
  std::string linear_decode;
  DType kv_dtype = DType::bf16;
  // Speculative decoding as resolved from the options (0 when off): topk 1 when
  // --speculative-eagle-topk is unset, draft tokens num_steps + 1 for a chain when unset.
  int spec_topk = 0;
  int spec_num_draft_tokens = 0;
  SpeculativeAttentionMode spec_mode = SpeculativeAttentionMode::prefill;
  // The registry entries of the four names, resolved once by resolve_backends (nullptr for an
  // empty name, and in a Selection filled by hand: create_backend then looks the names up).
  const BackendEntry* prefill_entry = nullptr;
  const BackendEntry* decode_entry = nullptr;
  const BackendEntry* linear_prefill_entry = nullptr;
  const BackendEntry* linear_decode_entry = nullptr;
  bool hybrid() const { return prefill != decode; }
  bool speculative() const { return spec_topk > 0; }
  // The full-attention backend that serves a step of `mode` (phase_for).
  const std::string& backend_for(ForwardMode mode) const {
    return phase_for(mode, spec_mode) == Phase::decode ? decode : prefill;
  }
  const BackendEntry* entry_for(ForwardMode mode) const {
    return phase_for(mode, spec_mode) == Phase::decode ? decode_entry : prefill_entry;
  }
  // The chosen entries, attention first; those not resolved are left out.
  std::vector<const BackendEntry*> entries() const;
  std::vector<std::string> reasons;  // one line per choice: what was chosen and why
  // DSA is on: the model has an indexer and the phases run the DSA backends of
  // --dsa-prefill-backend / --dsa-decode-backend (docs/dsa.md).
  bool dsa = false;
  // Options that still work but should change (a deprecated name); the runtime prints them.
  std::vector<std::string> warnings;
};

// Validates the options against the model, the machine and the backends' caps before anything is
// allocated. Throws attnrt::Error naming the option, the value, what is supported and what to use.
Selection resolve_backends(const Options& options, const ModelSpec& model,
                           const Registry& registry = Registry::global());
// Same, with the CUDA device described by `cuda` instead of query_cuda() (tests, "what if"
// queries).
Selection resolve_backends(const Options& options, const ModelSpec& model, const Registry& registry,
                           const CudaDeviceInfo& cuda);

// Builds the backend for a resolved selection: a single backend, or HybridAttnBackend when the
// phase backends differ; for a model with linear layers, that inside a HybridLinearAttnBackend
// whose linear side comes from the linear backends' linear factories (one object when the linear
// prefill and decode backends are the same). Only the chosen backends are created.
std::unique_ptr<AttentionBackend> create_backend(const Selection& selection,
                                                 const BackendContext& ctx,
                                                 const Registry& registry = Registry::global());

// When `name` is a backend of the reference serving engine that attnrt does not have, a sentence
// saying so and naming the attnrt backend that plays its role; "" for any other name.
std::string foreign_backend_note(const std::string& name);

// The same for the reference engine's DSA kernel backends (--nsa-prefill-backend /
// --nsa-decode-backend values: flashmla_sparse, flashmla_kv, fa3, ...), naming the attnrt
// backends in `dsa_backends` that serve DSA instead; "" for any other name.
std::string foreign_dsa_backend_note(const std::string& name,
                                     const std::vector<std::string>& dsa_backends);

}  // namespace attnrt
