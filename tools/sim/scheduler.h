// The serving scheduler of `attnrt run`: turns a trace into forward steps the way an engine does,
// and does the engine's memory bookkeeping in the pools (request rows, KV slots, shared-prefix
// cache, speculative accept/compact/free). It computes no attention: the step driver (sim/driver.h)
// runs each planned step through an AttentionRuntime.
//
// Life of a request: waits until its arrival iteration, is admitted when a request row is free and
// the KV pool can hold its whole life (prompt + output, + the verify block with speculation), is
// prefilled in chunks under a per-step token budget (a continuation chunk is an EXTEND with a
// cached prefix; requests naming a registered shared prefix start from it), then decodes (DECODE,
// or the decode half of a MIXED step, or TARGET_VERIFY + DRAFT_EXTEND rounds with speculation)
// until it has produced output_len tokens, and releases everything it holds.
//
// Aborts: a request whose trace record gives abort_step is dropped by the first target step that
// completes at or after that iteration. A request of that step loses the step's work (a prefill
// chunk, a decode token, or a verify block before acceptance) and everything it holds; a waiting
// one leaves the queue. With SchedulerConfig::retract, admission reserves only what a request's
// prompt needs, and when a decode round does not fit, running requests are retracted as the
// reference engine does (newest first, never the oldest): their KV, rows and linear state are
// freed and they go back to the head of the queue, to be prefilled again from their prompt.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "tools/sim/trace.h"

namespace attnrt {
class KVCache;
class ReqToTokenPool;
class TokenAllocator;
}  // namespace attnrt

namespace attnrt::sim {

// One model's memory: request rows, the slot allocator and (optionally) the KV data, which the
// scheduler touches only to compact accepted tree paths after a verify.
struct KvSpace {
  ReqToTokenPool* req_to_token = nullptr;
  TokenAllocator* allocator = nullptr;
  KVCache* kv_cache = nullptr;  // nullptr: bookkeeping only (no K/V rows are moved)
  std::vector<int> kv_layers;   // layer ids held by kv_cache (rows are moved in every one)
};

// Copies K/V rows src -> dst (full-pool slots) in every listed layer, in order, so a chain of moves
// towards lower positions is safe. SWA layers translate through their slot map. Host caches copy
// at once; a GPU cache (CudaKVCache) enqueues the copies on its stream.
void copy_kv_rows(KVCache& cache, const std::vector<int>& layers,
                  const std::vector<std::pair<int64_t, int64_t>>& moves);

struct SpecConfig {
  int num_steps = 0;         // draft depth; 0 = speculative decoding off
  int topk = 1;              // 1 = chain, > 1 = tree
  int num_draft_tokens = 0;  // N per request, the root included
  double accept_prob =
      0.7;  // chance that the draft token on the accepted path at each depth is right
  bool enabled() const { return num_steps > 0; }
};

struct SchedulerConfig {
  int max_running_requests = 16;
  int chunked_prefill_size = 128;  // prefill tokens per step (in MIXED steps, decodes count too)
  bool mixed_chunk = true;         // MIXED steps (ignored with speculation, as engines do)
  // Admit on the prompt's pages (not the whole life) and retract running requests when a decode
  // round does not fit (see above); false: admission reserves each request's whole life.
  bool retract = false;
  int page_size = 1;               // must equal the allocator's
  SpecConfig spec;
  uint64_t seed = 1;  // acceptance sampling and tree shapes
};

enum class ModelRole : uint8_t { target, draft };
std::string_view model_role_name(ModelRole r);

// A planned forward step. Its slots are allocated and written to req_to_token before it is
// returned.
struct ScheduledStep {
  int index = 0;      // 0-based over every step of the run (target and draft)
  int iteration = 0;  // the target iteration it belongs to (draft steps follow their target step)
  // Iterations (and step indices) it stands for: 1, except an IDLE step while nothing runs and
  // nothing waits, which covers the whole gap until the next arrival (the idle iterations in
  // between would all be the same no-op, so a trace with long pauses runs in one step per pause).
  int iterations = 1;
  ModelRole role = ModelRole::target;
  ForwardBatch batch;
  std::vector<int> requests;  // trace index of each batch row
};

struct RequestState {
  int trace_index = 0;
  enum class Phase : uint8_t { waiting, prefill, decode, finished } phase = Phase::waiting;
  int prefilled = 0;  // prompt tokens whose K/V are in the target cache (a cached prefix included)
  int kv_len = 0;     // target-cache tokens (committed)
  int draft_kv_len = 0;  // draft-cache tokens (speculation only)
  int generated = 0;     // output tokens produced so far
  int target_row = -1, draft_row = -1;
  int cached_prefix_len = 0;  // tokens reused from a registered shared prefix
  int admitted_iteration = -1, finished_iteration = -1;
  bool aborted = false;             // finished by its abort_step, not by producing its output
  int retractions = 0;              // times it was retracted and queued again
  std::vector<int> accept_lengths;  // per verify round (accepted drafts, root/bonus excluded)
};

struct PoolReport {
  bool ok = true;
  int64_t total_slots = 0;   // usable slots of the pool
  int64_t free_slots = 0;    // free at the end, shared prefixes still cached
  int64_t prefix_slots = 0;  // held by the shared-prefix cache at the end
  int prefixes = 0;
  int rows_in_use = 0;             // request rows still allocated (0 when nothing leaked)
  int64_t free_after_release = 0;  // free after the shared prefixes were released too
  std::string detail;              // what leaked, when !ok
};

// Aborts by what the request was doing when its abort_step came.
struct AbortCounts {
  int64_t waiting = 0;  // queued (never admitted, or retracted)
  int64_t prefill = 0;  // admitted, prompt not complete (between chunks or in a chunk's step)
  int64_t decode = 0;   // decoding, in or between DECODE / MIXED steps
  int64_t verify = 0;   // in a TARGET_VERIFY step, before acceptance (or between verify rounds)
  int64_t total() const { return waiting + prefill + decode + verify; }
};

class Scheduler {
 public:
  // `draft` is required when config.spec is enabled (the draft model's own pools).
  Scheduler(Trace trace, SchedulerConfig config, KvSpace target,
            std::optional<KvSpace> draft = std::nullopt);

  bool done() const;
  // Plans the next step and allocates its slots. Call complete() after running it. A failed
  // allocation (attnrt::Error) leaves no request admitted by the call and no slot allocated for it,
  // so calling next() again plans the same step; requests it retracted stay queued.
  const ScheduledStep& next();
  // Commits the step returned by next(): lengths advance, verify acceptance is sampled (accepted
  // tree paths are moved to consecutive slots, rejected slots freed), finished requests release
  // everything, aborts due by the end of the step take effect. With speculation it then allocates
  // the draft step's slots; if that fails (attnrt::Error) the step stays committed and the draft
  // step is allocated by the next call of next().
  void complete();

  // Pools and request tables of every model: each allocator's, request pool's check_invariants with
  // the holders the scheduler knows (every running request's own pages, each cached prefix, the
  // pages of a queued draft step). Throws attnrt::Error naming the model, the invariant and the
  // slot or row. Between steps only (not between next() and complete()).
  void check_invariants() const;
  // The target request rows of the running requests (the live rows of a linear-state pool).
  std::vector<int> live_target_rows() const;

  const AbortCounts& aborts() const { return aborts_; }
  int64_t retractions() const { return retractions_; }

  // When done(): checks that every request row and every slot is free except those of the cached
  // shared prefixes, then releases the prefixes and checks again. One report per model.
  PoolReport finish_and_check_pools(ModelRole role);

  const Trace& trace() const { return trace_; }
  const SchedulerConfig& config() const { return config_; }
  const std::vector<RequestState>& requests() const { return reqs_; }
  int iteration() const { return iteration_; }
  int steps_planned() const { return step_count_; }
  // A rough number of steps still to come (for progress bars).
  int64_t estimate_remaining_steps() const;
  // The accepted path (block indices, root first) of each request of the last verify step.
  const std::vector<std::vector<int>>& last_accepted_paths() const { return last_paths_; }

 private:
  struct PrefixEntry {
    int len = 0;     // page-aligned length that is shared
    int owner = -1;  // trace index of the request that prefills it
    bool target_ready = false, draft_ready = false;
    std::vector<int64_t> target_slots, draft_slots;
  };
  struct Space {
    KvSpace kv;
    int64_t initial_free = 0;
  };

  // "the target model's SWA pool ... has N slots: ..." and the options that raise it.
  static std::string pool_size_text(const Space& space, ModelRole role);
  static std::string pool_size_fix(const Space& space);
  void plan_target_step();
  // The step after admission of arrivals and retraction; allocates its slots.
  void plan_batch(const std::vector<int>& decoding);
  void admit_arrivals();
  bool can_admit(const RequestState& r, int prefix_len) const;
  int64_t outstanding_pages(bool draft) const;
  int64_t lifetime_tokens(const RequestState& r, bool draft) const;
  int shared_len(const TraceRequest& r) const;

  // Continues the chunked request, then admits waiting ones, within `budget` tokens. Appends to
  // reqs/prefix/extend; allocates nothing.
  void plan_prefill(int budget, std::vector<int>& reqs, std::vector<int32_t>& prefix,
                    std::vector<int32_t>& extend);
  void plan_verify(const std::vector<int>& decoding);
  void plan_decode(const std::vector<int>& decoding);
  void commit_prefill_row(int idx, int extend);
  void commit_verify(const ScheduledStep& s);
  void commit_draft(const ScheduledStep& s);
  void finish_request(int idx);
  // Frees what request `idx` holds beyond the prefix cache: target positions up to target_held,
  // draft positions up to its draft_kv_len, and both rows. A prefix it owns that is not ready yet
  // is dropped (its waiters become owners later).
  void release_request(int idx, int target_held);
  void reset_to_waiting(RequestState& r);
  // Aborts due by the end of the target step `s` (its requests first: they lose the step's work).
  void apply_aborts(const ScheduledStep& s);
  void abort_request(int idx, int target_held, int64_t& counter);
  // retract mode: retracts running requests (newest first, never the oldest) until the next decode
  // round of `decoding` fits with what prefilling requests are owed; removes them from `decoding`.
  void retract_for_decode(std::vector<int>& decoding);
  int64_t owed_prefill_pages(bool draft) const;
  int64_t decode_round_pages(const std::vector<int>& decoding, bool draft) const;
  int64_t free_pages(bool draft) const;
  void queue_due_draft();
  void check_space(const Space& space, ModelRole role) const;
  void queue_draft_step(const std::vector<int>& reqs, bool after_verify);
  bool prefix_ready(const PrefixEntry& e) const;
  PrefixEntry* owned_prefix(int idx);  // the entry request `idx` prefills, if it owns one

  std::vector<int64_t> extend_slots(Space& space, const std::vector<int64_t>& rows,
                                    const std::vector<int32_t>& prefix,
                                    const std::vector<int32_t>& extend);
  void free_positions(Space& space, int row, int from, int to);
  void set_step(ModelRole role, ForwardBatch batch, std::vector<int> reqs);
  SpecInfo make_spec(int batch_size);
  std::vector<int> sample_path(const SpecInfo& spec, int request, int max_accept);
  void move_kv_rows(const std::vector<std::pair<int64_t, int64_t>>& moves);

  Trace trace_;
  SchedulerConfig config_;
  Space target_;
  std::optional<Space> draft_;
  std::vector<RequestState> reqs_;
  std::vector<int> arrival_order_;  // trace indices sorted by (arrival_step, line order)
  size_t next_arrival_ = 0;
  std::deque<int> waiting_;
  std::vector<int> running_;  // admitted, not finished, in admission order
  std::map<std::string, PrefixEntry> prefixes_;
  int iteration_ = 0;
  bool last_was_prefill_ = false;
  ScheduledStep step_;
  int step_count_ = 0;
  bool step_open_ = false;
  std::optional<ScheduledStep> pending_draft_;
  // A draft step whose slots could not be allocated yet (complete() queues it; next() retries).
  struct DraftDue {
    std::vector<int> reqs;
    bool after_verify = false;
  };
  std::optional<DraftDue> draft_due_;
  std::vector<int> abort_order_;  // trace indices with an abort_step, by abort_step
  size_t next_abort_ = 0;
  AbortCounts aborts_;
  int64_t retractions_ = 0;
  std::vector<std::vector<int>> last_paths_;
  std::mt19937_64 rng_;
};

}  // namespace attnrt::sim
