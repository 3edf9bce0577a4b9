#include "tools/sim/scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "attnrt/core/dtype.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/memory/token_allocator.h"

namespace attnrt::sim {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Largest number of nodes of a draft tree of the given depth and branching (the root included).
int64_t max_tree_nodes(int depth, int topk) {
  int64_t total = 1, level = 1;
  for (int d = 0; d < depth && total < (int64_t{1} << 20); ++d) {
    level *= topk;
    total += level;
  }
  return total;
}

// Uniform double in [0, 1) from the raw engine: std:: distributions differ between standard
// libraries, and a run must replay identically from its seed everywhere.
double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }
size_t pick(std::mt19937_64& rng, size_t n) { return static_cast<size_t>(rng() % n); }

}  // namespace

std::string_view model_role_name(ModelRole r) {
  return r == ModelRole::target ? "target" : "draft";
}

void copy_kv_rows(KVCache& cache, const std::vector<int>& layers,
                  const std::vector<std::pair<int64_t, int64_t>>& moves) {
  // Host pools move rows in place; GPU pools with one gather and one scatter kernel per layer on
  // the cache's stream, ordered before the next step's kernels.
  if (!moves.empty()) cache.copy_rows(layers, moves);
}

Scheduler::Scheduler(Trace trace, SchedulerConfig config, KvSpace target,
                     std::optional<KvSpace> draft)
    : trace_(std::move(trace)), config_(config), rng_(config.seed) {
  ATTNRT_CHECK(target.req_to_token != nullptr && target.allocator != nullptr,
               "scheduler: the target model's request pool and allocator are required");
  ATTNRT_CHECK(config_.max_running_requests >= 1, "--max-running-requests = {}; must be >= 1",
               config_.max_running_requests);
  ATTNRT_CHECK(config_.chunked_prefill_size >= 1, "--chunked-prefill-size = {}; must be >= 1",
               config_.chunked_prefill_size);
  ATTNRT_CHECK(config_.page_size == target.allocator->page_size(),
               "scheduler: page size {} differs from the allocator's page size {}",
               config_.page_size, target.allocator->page_size());
  const SpecConfig& spec = config_.spec;
  if (spec.enabled()) {
    ATTNRT_CHECK(draft.has_value() && draft->req_to_token != nullptr && draft->allocator != nullptr,
                 "scheduler: speculative decoding needs the draft model's pools");
    ATTNRT_CHECK(draft->allocator->page_size() == config_.page_size,
                 "scheduler: the draft pool's page size {} differs from the target's {}",
                 draft->allocator->page_size(), config_.page_size);
    ATTNRT_CHECK(spec.topk >= 1, "--speculative-eagle-topk = {}; must be >= 1", spec.topk);
    ATTNRT_CHECK(spec.num_draft_tokens >= 2,
                 "--speculative-num-draft-tokens = {}; must be >= 2 (the root plus a draft)",
                 spec.num_draft_tokens);
    ATTNRT_CHECK(spec.topk > 1 || spec.num_draft_tokens == spec.num_steps + 1,
                 "--speculative-num-draft-tokens = {} with --speculative-eagle-topk 1 and "
                 "--speculative-num-steps {}; a chain has exactly num_steps + 1 = {} tokens",
                 spec.num_draft_tokens, spec.num_steps, spec.num_steps + 1);
    const int64_t max_nodes = max_tree_nodes(spec.num_steps, spec.topk);
    ATTNRT_CHECK(
        spec.num_draft_tokens <= max_nodes,
        "--speculative-num-draft-tokens = {}: a tree of depth {} (--speculative-num-steps) "
        "and branching {} (--speculative-eagle-topk) has at most {} tokens",
        spec.num_draft_tokens, spec.num_steps, spec.topk, max_nodes);
    ATTNRT_CHECK(spec.accept_prob >= 0.0 && spec.accept_prob <= 1.0,
                 "--accept-prob = {}; must be in [0, 1]", spec.accept_prob);
    draft_ = Space{*draft, draft->allocator->available_size()};
    ATTNRT_CHECK(spec.topk == 1 || target.kv_cache == nullptr || target.kv_cache->can_copy_rows(),
                 "speculative tree verify (--speculative-eagle-topk {}) moves the accepted K/V "
                 "rows inside the KV pool, and this pool on {} has no row copy; use a backend "
                 "whose pools live on the host or the cuda backend",
                 spec.topk, device_name(target.kv_cache->device()));
  }
  target_ = Space{target, target.allocator->available_size()};

  reqs_.resize(trace_.requests.size());
  for (size_t i = 0; i < reqs_.size(); ++i) {
    reqs_[i].trace_index = static_cast<int>(i);
    const TraceRequest& tr = trace_.requests[i];
    for (bool is_draft : {false, true}) {
      const Space* space = is_draft ? (draft_ ? &*draft_ : nullptr) : &target_;
      if (space == nullptr) continue;
      const int64_t need = lifetime_tokens(reqs_[i], is_draft);
      ATTNRT_CHECK(need <= space->kv.req_to_token->max_context_len(),
                   "request '{}' (trace line {}) reaches {} tokens (prompt {} + output {}{}), more "
                   "than the {} model's context of {}; shorten the request",
                   tr.id, tr.line, need, tr.prompt_len, tr.output_len,
                   spec.enabled() && !is_draft ? " + verify block" : "",
                   model_role_name(is_draft ? ModelRole::draft : ModelRole::target),
                   space->kv.req_to_token->max_context_len());
      const int64_t need_slots = ceil_div(need, config_.page_size) * config_.page_size;
      ATTNRT_CHECK(need_slots <= space->initial_free,
                   "request '{}' (trace line {}) needs up to {} KV slots (prompt {} + output {}{}, "
                   "in pages of {}) but {}; {} or shorten the request",
                   tr.id, tr.line, need_slots, tr.prompt_len, tr.output_len,
                   spec.enabled() && !is_draft ? " + verify block" : "", config_.page_size,
                   pool_size_text(*space, is_draft ? ModelRole::draft : ModelRole::target),
                   pool_size_fix(*space));
    }
  }
  arrival_order_.resize(reqs_.size());
  std::iota(arrival_order_.begin(), arrival_order_.end(), 0);
  std::stable_sort(arrival_order_.begin(), arrival_order_.end(), [&](int a, int b) {
    return trace_.requests[a].arrival_step < trace_.requests[b].arrival_step;
  });
  for (int idx : arrival_order_) {
    if (trace_.requests[idx].abort_step >= 0) abort_order_.push_back(idx);
  }
  std::stable_sort(abort_order_.begin(), abort_order_.end(), [&](int a, int b) {
    return trace_.requests[a].abort_step < trace_.requests[b].abort_step;
  });
}

bool Scheduler::done() const {
  if (step_open_ || pending_draft_ || draft_due_) return false;
  return std::all_of(reqs_.begin(), reqs_.end(), [](const RequestState& r) {
    return r.phase == RequestState::Phase::finished;
  });
}

int64_t Scheduler::lifetime_tokens(const RequestState& r, bool draft) const {
  const TraceRequest& tr = trace_.requests[r.trace_index];
  // The last output token is never fed back, so the cache ends at prompt + output - 1 tokens; the
  // target also holds a whole verify block on top of its committed tokens during a verify.
  int64_t n = int64_t{tr.prompt_len} + tr.output_len - 1;
  if (config_.spec.enabled() && !draft) n += config_.spec.num_draft_tokens;
  return n;
}

int Scheduler::shared_len(const TraceRequest& r) const {
  if (r.shared_prefix.empty()) return 0;
  // A cached prefix is reusable in whole pages only.
  return r.shared_prefix_len / config_.page_size * config_.page_size;
}

Scheduler::PrefixEntry* Scheduler::owned_prefix(int idx) {
  const TraceRequest& tr = trace_.requests[idx];
  if (tr.shared_prefix.empty()) return nullptr;
  // No entry exists when the shared part is shorter than a page.
  auto it = prefixes_.find(tr.shared_prefix);
  return it != prefixes_.end() && it->second.owner == idx ? &it->second : nullptr;
}

bool Scheduler::prefix_ready(const PrefixEntry& e) const {
  return e.target_ready && (!draft_ || e.draft_ready);
}

int64_t Scheduler::outstanding_pages(bool draft) const {
  const int P = config_.page_size;
  int64_t pages = 0;
  for (int idx : running_) {
    const RequestState& r = reqs_[idx];
    const int held = draft ? r.draft_kv_len : r.kv_len;
    pages += ceil_div(lifetime_tokens(r, draft), P) - ceil_div(held, P);
  }
  return pages;
}

bool Scheduler::can_admit(const RequestState& r, int prefix_len) const {
  const int P = config_.page_size;
  std::vector<int> decoding;
  if (config_.retract) {
    for (int idx : running_) {
      if (reqs_[idx].phase == RequestState::Phase::decode) decoding.push_back(idx);
    }
  }
  for (bool is_draft : {false, true}) {
    const Space* space = is_draft ? (draft_ ? &*draft_ : nullptr) : &target_;
    if (space == nullptr) continue;
    if (space->kv.req_to_token->available() == 0) return false;
    if (config_.retract) {
      // The prompt's pages on top of what prefilling requests are owed and the next decode round.
      const int64_t need = ceil_div(trace_.requests[r.trace_index].prompt_len, P) - prefix_len / P;
      if (free_pages(is_draft) - owed_prefill_pages(is_draft) -
              decode_round_pages(decoding, is_draft) <
          need)
        return false;
      continue;
    }
    const int64_t need = ceil_div(lifetime_tokens(r, is_draft), P) - prefix_len / P;
    const int64_t free_pages = space->kv.allocator->available_size() / P;
    if (free_pages - outstanding_pages(is_draft) < need) return false;
  }
  return true;
}

// The pool that bounds a request of `space`: an SWA-hybrid model has two, and the smaller one is
// named with how its size follows from the options.
std::string Scheduler::pool_size_text(const Space& space, ModelRole role) {
  const auto* hybrid = dynamic_cast<const SWATokenAllocator*>(space.kv.allocator);
  if (hybrid != nullptr && hybrid->swa().available_size() < hybrid->full().available_size()) {
    const int64_t full = hybrid->full().num_pages() * hybrid->page_size();
    const int64_t swa = hybrid->swa().num_pages() * hybrid->page_size();
    return fmt::format(
        "the {} model's SWA pool (the KV of its sliding-window layers) has {} free of {} slots: "
        "the full pool's {} slots (--max-total-tokens) x --swa-full-tokens-ratio {:.3g}, in whole "
        "pages",
        model_role_name(role), hybrid->swa().available_size(), swa, full,
        static_cast<double>(swa) / static_cast<double>(full));
  }
  const int64_t free = space.kv.allocator->available_size();
  if (hybrid != nullptr) {
    return fmt::format(
        "the {} model's full pool (the KV of its full-attention layers) has {} free slots "
        "(--max-total-tokens {} in whole pages)",
        model_role_name(role), free, hybrid->full().num_pages() * hybrid->page_size());
  }
  return fmt::format("the {} model's KV pool has {} free slots (--max-total-tokens)",
                     model_role_name(role), free);
}

std::string Scheduler::pool_size_fix(const Space& space) {
  return dynamic_cast<const SWATokenAllocator*>(space.kv.allocator) != nullptr
             ? "raise --max-total-tokens (or, for the SWA pool, --swa-full-tokens-ratio)"
             : "raise --max-total-tokens";
}

void Scheduler::admit_arrivals() {
  while (next_arrival_ < arrival_order_.size() &&
         trace_.requests[arrival_order_[next_arrival_]].arrival_step <= iteration_) {
    const int idx = arrival_order_[next_arrival_++];
    if (reqs_[idx].phase != RequestState::Phase::finished) waiting_.push_back(idx);
  }
}

int64_t Scheduler::free_pages(bool draft) const {
  const Space& space = draft ? *draft_ : target_;
  return space.kv.allocator->available_size() / config_.page_size;
}

int64_t Scheduler::owed_prefill_pages(bool draft) const {
  const int P = config_.page_size;
  int64_t pages = 0;
  for (int idx : running_) {
    const RequestState& r = reqs_[idx];
    if (r.phase != RequestState::Phase::prefill) continue;
    pages += ceil_div(trace_.requests[idx].prompt_len, P) -
             ceil_div(draft ? r.draft_kv_len : r.kv_len, P);
  }
  return pages;
}

int64_t Scheduler::decode_round_pages(const std::vector<int>& decoding, bool draft) const {
  const int P = config_.page_size;
  // A decode takes one token; a verify round holds the whole block, and the draft model then
  // catches up to at most as many tokens.
  const int step = config_.spec.enabled() ? config_.spec.num_draft_tokens : 1;
  int64_t pages = 0;
  for (int idx : decoding) {
    const RequestState& r = reqs_[idx];
    pages += ceil_div(r.kv_len + step, P) - ceil_div(draft ? r.draft_kv_len : r.kv_len, P);
  }
  return pages;
}

void Scheduler::retract_for_decode(std::vector<int>& decoding) {
  auto fits = [&] {
    for (bool is_draft : {false, true}) {
      if (is_draft && !draft_) continue;
      if (decode_round_pages(decoding, is_draft) + owed_prefill_pages(is_draft) >
          free_pages(is_draft))
        return false;
    }
    return true;
  };
  while (!fits()) {
    if (running_.size() <= 1) {
      const TraceRequest& tr = trace_.requests[running_.front()];
      fail(
          "out of KV cache: request '{}' (trace line {}) runs alone and its next decode round "
          "does not fit: {}; {}",
          tr.id, tr.line, pool_size_text(target_, ModelRole::target), pool_size_fix(target_));
    }
    // Newest first, as the reference engine retracts; the oldest always keeps running, so the run
    // makes progress.
    const int victim = running_.back();
    RequestState& r = reqs_[victim];
    release_request(victim, r.kv_len);
    running_.pop_back();
    reset_to_waiting(r);
    ++r.retractions;
    ++retractions_;
    waiting_.push_front(victim);
    decoding.erase(std::remove(decoding.begin(), decoding.end(), victim), decoding.end());
  }
}

void Scheduler::reset_to_waiting(RequestState& r) {
  r.phase = RequestState::Phase::waiting;
  r.prefilled = r.kv_len = r.draft_kv_len = r.generated = 0;
  r.target_row = r.draft_row = -1;
  r.cached_prefix_len = 0;
  r.admitted_iteration = -1;
}

std::vector<int64_t> Scheduler::extend_slots(Space& space, const std::vector<int64_t>& rows,
                                             const std::vector<int32_t>& prefix,
                                             const std::vector<int32_t>& extend) {
  std::vector<int32_t> seq(rows.size());
  std::vector<int64_t> last(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    seq[i] = prefix[i] + extend[i];
    last[i] =
        prefix[i] > 0 ? space.kv.req_to_token->get(static_cast<int>(rows[i]), prefix[i] - 1) : -1;
  }
  std::vector<int64_t> slots = space.kv.allocator->alloc_extend(prefix, seq, last);
  size_t off = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    space.kv.req_to_token->write(static_cast<int>(rows[i]), prefix[i],
                                 std::span<const int64_t>(slots.data() + off, extend[i]));
    off += extend[i];
  }
  return slots;
}

void Scheduler::free_positions(Space& space, int row, int from, int to) {
  // Pages are freed whole: only those that start at or after `from` (a page straddling `from` still
  // holds kept tokens, and the next extend fills it after last_loc).
  const int P = config_.page_size;
  std::vector<int64_t> slots;
  for (int pos = static_cast<int>(ceil_div(from, P)) * P; pos < to; pos += P) {
    slots.push_back(space.kv.req_to_token->get(row, pos));
  }
  if (!slots.empty()) space.kv.allocator->free(slots);
}

void Scheduler::set_step(ModelRole role, ForwardBatch batch, std::vector<int> reqs) {
  step_ = ScheduledStep{};
  step_.iteration = iteration_;
  step_.role = role;
  step_.batch = std::move(batch);
  step_.requests = std::move(reqs);
}

const ScheduledStep& Scheduler::next() {
  ATTNRT_CHECK(!step_open_, "scheduler: next() called again before complete() of step {}",
               step_.index);
  ATTNRT_CHECK(!done(), "scheduler: next() called after every request finished");
  if (draft_due_) queue_due_draft();
  if (pending_draft_) {
    step_ = std::move(*pending_draft_);
    pending_draft_.reset();
  } else {
    plan_target_step();
  }
  step_.index = step_count_;
  step_count_ += step_.iterations;
  step_open_ = true;
  return step_;
}

void Scheduler::plan_prefill(int budget, std::vector<int>& reqs, std::vector<int32_t>& prefix,
                             std::vector<int32_t>& extend) {
  // The request whose prompt was cut by the last step's budget continues first.
  for (int idx : running_) {
    if (budget <= 0) return;
    RequestState& r = reqs_[idx];
    if (r.phase != RequestState::Phase::prefill) continue;
    const int take = std::min(trace_.requests[idx].prompt_len - r.prefilled, budget);
    reqs.push_back(idx);
    prefix.push_back(r.prefilled);
    extend.push_back(take);
    budget -= take;
  }
  std::deque<int> still_waiting;
  while (!waiting_.empty()) {
    const int idx = waiting_.front();
    if (budget <= 0 || static_cast<int>(running_.size()) >= config_.max_running_requests) break;
    const TraceRequest& tr = trace_.requests[idx];
    RequestState& r = reqs_[idx];
    const int shared = shared_len(tr);
    int attach = 0;
    PrefixEntry* entry = nullptr;
    if (shared > 0) {
      auto it = prefixes_.find(tr.shared_prefix);
      if (it != prefixes_.end() && !prefix_ready(it->second)) {
        // Its owner is still prefilling the shared part: wait for the cache rather than computing
        // the same prefix twice; requests behind it may go ahead.
        still_waiting.push_back(idx);
        waiting_.pop_front();
        continue;
      }
      if (it != prefixes_.end()) {
        entry = &it->second;
        attach = entry->len;
      }
    }
    // First come, first served on memory: a request that does not fit stops admission.
    if (!can_admit(r, attach)) break;
    // Rows first: a failed allocation leaves the request queued and nothing allocated.
    const int target_row = target_.kv.req_to_token->alloc();
    if (draft_) {
      try {
        r.draft_row = draft_->kv.req_to_token->alloc();
      } catch (const Error&) {
        target_.kv.req_to_token->free(target_row);
        throw;
      }
    }
    r.target_row = target_row;
    waiting_.pop_front();
    if (shared > 0 && entry == nullptr) {
      PrefixEntry fresh;
      fresh.len = shared;
      fresh.owner = idx;
      prefixes_.emplace(tr.shared_prefix, std::move(fresh));
    }
    if (attach > 0) target_.kv.req_to_token->write(r.target_row, 0, entry->target_slots);
    if (draft_ && attach > 0) draft_->kv.req_to_token->write(r.draft_row, 0, entry->draft_slots);
    r.cached_prefix_len = attach;
    r.prefilled = r.kv_len = r.draft_kv_len = attach;
    r.phase = RequestState::Phase::prefill;
    r.admitted_iteration = iteration_;
    running_.push_back(idx);
    const int take = std::min(tr.prompt_len - attach, budget);
    reqs.push_back(idx);
    prefix.push_back(attach);
    extend.push_back(take);
    budget -= take;
  }
  for (auto it = still_waiting.rbegin(); it != still_waiting.rend(); ++it) waiting_.push_front(*it);
}

void Scheduler::plan_decode(const std::vector<int>& decoding) {
  std::vector<int64_t> rows, last;
  std::vector<int32_t> seq;
  for (int idx : decoding) {
    const RequestState& r = reqs_[idx];
    rows.push_back(r.target_row);
    seq.push_back(r.kv_len + 1);
    last.push_back(target_.kv.req_to_token->get(r.target_row, r.kv_len - 1));
  }
  std::vector<int64_t> slots = target_.kv.allocator->alloc_decode(seq, last);
  for (size_t i = 0; i < rows.size(); ++i) {
    target_.kv.req_to_token->write(static_cast<int>(rows[i]), seq[i] - 1,
                                   std::span<const int64_t>(&slots[i], 1));
  }
  ForwardBatch batch = make_decode_batch(rows, seq);
  batch.out_cache_loc = std::move(slots);
  set_step(ModelRole::target, std::move(batch), decoding);
}

SpecInfo Scheduler::make_spec(int batch_size) {
  const SpecConfig& sc = config_.spec;
  const int N = sc.num_draft_tokens;
  if (sc.topk == 1) return SpecInfo::chain(batch_size, N);
  SpecInfo spec;
  spec.draft_token_num = N;
  spec.topk = sc.topk;
  spec.parents.assign(static_cast<size_t>(batch_size) * N, -1);
  std::vector<int> depth(N), children(N), candidates;
  for (int b = 0; b < batch_size; ++b) {
    std::fill(depth.begin(), depth.end(), 0);
    std::fill(children.begin(), children.end(), 0);
    for (int t = 1; t < N; ++t) {
      candidates.clear();
      for (int u = 0; u < t; ++u) {
        if (depth[u] < sc.num_steps && children[u] < sc.topk) candidates.push_back(u);
      }
      // Never empty: N is at most the size of the complete tree (checked in the constructor).
      const int parent = candidates[pick(rng_, candidates.size())];
      spec.parents[static_cast<size_t>(b) * N + t] = parent;
      depth[t] = depth[parent] + 1;
      ++children[parent];
    }
  }
  return spec;
}

void Scheduler::plan_verify(const std::vector<int>& decoding) {
  const int N = config_.spec.num_draft_tokens;
  std::vector<int64_t> rows;
  std::vector<int32_t> seq, ext(decoding.size(), N);
  for (int idx : decoding) {
    rows.push_back(reqs_[idx].target_row);
    seq.push_back(reqs_[idx].kv_len);
  }
  std::vector<int64_t> slots = extend_slots(target_, rows, seq, ext);
  ForwardBatch batch = make_verify_batch(rows, seq, make_spec(static_cast<int>(rows.size())));
  batch.out_cache_loc = std::move(slots);
  set_step(ModelRole::target, std::move(batch), decoding);
}

void Scheduler::plan_target_step() {
  admit_arrivals();
  std::vector<int> decoding;
  for (int idx : running_) {
    if (reqs_[idx].phase == RequestState::Phase::decode) decoding.push_back(idx);
  }
  if (config_.retract && !decoding.empty()) retract_for_decode(decoding);
  // Admission and the step's slot allocation either both happen or neither: on a failed
  // allocation the requests admitted for this step give their rows back and queue again, so the
  // next call plans the same step. Retractions above stand.
  const size_t running_before = running_.size();
  const std::deque<int> waiting_before = waiting_;
  const bool last_before = last_was_prefill_;
  try {
    plan_batch(decoding);
  } catch (const Error&) {
    for (size_t k = running_before; k < running_.size(); ++k) {
      RequestState& r = reqs_[running_[k]];
      target_.kv.req_to_token->free(r.target_row);
      if (draft_) draft_->kv.req_to_token->free(r.draft_row);
      reset_to_waiting(r);
    }
    running_.resize(running_before);
    waiting_ = waiting_before;
    last_was_prefill_ = last_before;
    // Shared prefixes registered by requests that are queued again hold nothing yet.
    for (auto it = prefixes_.begin(); it != prefixes_.end();) {
      const bool unclaimed = !it->second.target_ready && !it->second.draft_ready &&
                             reqs_[it->second.owner].phase == RequestState::Phase::waiting;
      it = unclaimed ? prefixes_.erase(it) : std::next(it);
    }
    throw;
  }
}

void Scheduler::plan_batch(const std::vector<int>& decoding) {
  const bool spec = config_.spec.enabled();
  const bool mix = config_.mixed_chunk && !spec;
  auto decode_step = [&] {
    last_was_prefill_ = false;
    if (spec) {
      plan_verify(decoding);
    } else {
      plan_decode(decoding);
    }
  };
  // Without MIXED steps, prefill and decode steps alternate while both have work (prefill first),
  // so neither starves.
  const bool try_prefill = decoding.empty() || mix || !last_was_prefill_;
  int budget = config_.chunked_prefill_size;
  if (mix && !decoding.empty()) budget -= static_cast<int>(decoding.size());
  std::vector<int> reqs;
  std::vector<int32_t> prefix, extend;
  if (try_prefill && budget > 0) plan_prefill(budget, reqs, prefix, extend);

  if (reqs.empty()) {
    if (!decoding.empty()) return decode_step();
    if (!waiting_.empty()) {
      // Nothing runs, so every slot not held by the prefix cache is free: the head of the queue can
      // never be admitted.
      const TraceRequest& tr = trace_.requests[waiting_.front()];
      fail(
          "request '{}' (trace line {}) can never be admitted: it needs {} KV slots but {} while "
          "the shared-prefix cache holds the rest; {}",
          tr.id, tr.line, lifetime_tokens(reqs_[waiting_.front()], false),
          pool_size_text(target_, ModelRole::target), pool_size_fix(target_));
    }
    set_step(ModelRole::target, make_idle_batch(), {});
    if (running_.empty() && next_arrival_ < arrival_order_.size()) {
      const int arrival = trace_.requests[arrival_order_[next_arrival_]].arrival_step;
      step_.iterations = std::max(1, arrival - iteration_);
    }
    last_was_prefill_ = false;
    return;
  }
  last_was_prefill_ = true;
  std::vector<int64_t> rows;
  for (int idx : reqs) rows.push_back(reqs_[idx].target_row);
  ForwardMode mode = ForwardMode::EXTEND;
  if (mix && !decoding.empty()) {
    // Decodes ride along as extends of length 1 behind the prefill chunks.
    mode = ForwardMode::MIXED;
    for (int idx : decoding) {
      reqs.push_back(idx);
      rows.push_back(reqs_[idx].target_row);
      prefix.push_back(reqs_[idx].kv_len);
      extend.push_back(1);
    }
  }
  std::vector<int64_t> slots = extend_slots(target_, rows, prefix, extend);
  ForwardBatch batch = make_extend_batch(rows, prefix, extend, mode);
  batch.out_cache_loc = std::move(slots);
  set_step(ModelRole::target, std::move(batch), std::move(reqs));
}

void Scheduler::commit_prefill_row(int idx, int extend) {
  RequestState& r = reqs_[idx];
  const TraceRequest& tr = trace_.requests[idx];
  r.prefilled += extend;
  r.kv_len = r.prefilled;
  if (PrefixEntry* e = owned_prefix(idx); e != nullptr && !e->target_ready && r.kv_len >= e->len) {
    const int32_t* row = target_.kv.req_to_token->row_ptr(r.target_row);
    e->target_slots.assign(row, row + e->len);
    e->target_ready = true;
  }
  if (r.prefilled == tr.prompt_len) {
    r.generated = 1;  // the prefill's last position samples the first output token
    r.phase = RequestState::Phase::decode;
  }
}

std::vector<int> Scheduler::sample_path(const SpecInfo& spec, int request, int max_accept) {
  const int N = spec.draft_token_num;
  const int32_t* parents = spec.parents.data() + static_cast<size_t>(request) * N;
  std::vector<int> path{0}, children;
  while (static_cast<int>(path.size()) - 1 < max_accept) {
    children.clear();
    for (int u = path.back() + 1; u < N; ++u) {
      if (parents[u] == path.back()) children.push_back(u);
    }
    if (children.empty() || uniform01(rng_) >= config_.spec.accept_prob) break;
    // The target's token matches at most one sibling; which one is random.
    path.push_back(children[pick(rng_, children.size())]);
  }
  return path;
}

void Scheduler::commit_verify(const ScheduledStep& s) {
  const int N = config_.spec.num_draft_tokens;
  const SpecInfo& spec = *s.batch.spec_info;
  last_paths_.assign(s.requests.size(), {});
  std::vector<std::pair<int64_t, int64_t>> moves;
  for (size_t i = 0; i < s.requests.size(); ++i) {
    const RequestState& r = reqs_[s.requests[i]];
    if (r.aborted) continue;  // aborted before acceptance: no path, its block is freed
    const int remaining = trace_.requests[s.requests[i]].output_len - r.generated;
    // Accepted drafts plus the bonus token must not overshoot the requested output length.
    last_paths_[i] = sample_path(spec, static_cast<int>(i), std::min(N - 1, remaining - 1));
    const std::vector<int>& path = last_paths_[i];
    for (size_t j = 1; j < path.size(); ++j) {
      if (path[j] == static_cast<int>(j)) continue;
      // Tree paths skip siblings: move the accepted rows down to consecutive positions. Block
      // indices on a path increase, so each source is read before any move overwrites it.
      moves.emplace_back(
          target_.kv.req_to_token->get(r.target_row, r.kv_len + path[j]),
          target_.kv.req_to_token->get(r.target_row, r.kv_len + static_cast<int>(j)));
    }
  }
  if (!moves.empty() && target_.kv.kv_cache != nullptr) {
    copy_kv_rows(*target_.kv.kv_cache, target_.kv.kv_layers, moves);
  }
  std::vector<int> to_draft;
  for (size_t i = 0; i < s.requests.size(); ++i) {
    const int idx = s.requests[i];
    RequestState& r = reqs_[idx];
    if (r.aborted) continue;
    const std::vector<int>& path = last_paths_[i];
    const int accepted = static_cast<int>(path.size()) - 1;
    const int base = r.kv_len;
    r.kv_len = base + accepted + 1;
    free_positions(target_, r.target_row, r.kv_len, base + N);
    r.generated += accepted + 1;
    r.accept_lengths.push_back(accepted);
    if (r.generated >= trace_.requests[idx].output_len) {
      finish_request(idx);
    } else {
      to_draft.push_back(idx);
    }
  }
  if (!to_draft.empty()) draft_due_ = DraftDue{to_draft, true};
}

void Scheduler::queue_draft_step(const std::vector<int>& reqs, bool after_verify) {
  std::vector<int64_t> rows;
  std::vector<int32_t> prefix, extend, seq, accept;
  for (int idx : reqs) {
    const RequestState& r = reqs_[idx];
    rows.push_back(r.draft_row);
    prefix.push_back(r.draft_kv_len);
    extend.push_back(r.kv_len - r.draft_kv_len);
    seq.push_back(r.kv_len);
    accept.push_back(r.kv_len - r.draft_kv_len - 1);
  }
  std::vector<int64_t> slots = extend_slots(*draft_, rows, prefix, extend);
  ForwardBatch batch = after_verify ? make_draft_extend_batch(rows, seq, accept)
                                    : make_extend_batch(rows, prefix, extend, ForwardMode::EXTEND);
  batch.out_cache_loc = std::move(slots);
  ScheduledStep step;
  step.iteration = iteration_;
  step.role = ModelRole::draft;
  step.batch = std::move(batch);
  step.requests = reqs;
  pending_draft_ = std::move(step);
}

void Scheduler::commit_draft(const ScheduledStep& s) {
  for (int idx : s.requests) {
    RequestState& r = reqs_[idx];
    const TraceRequest& tr = trace_.requests[idx];
    r.draft_kv_len = r.kv_len;
    if (PrefixEntry* e = owned_prefix(idx);
        e != nullptr && !e->draft_ready && r.draft_kv_len >= e->len) {
      const int32_t* row = draft_->kv.req_to_token->row_ptr(r.draft_row);
      e->draft_slots.assign(row, row + e->len);
      e->draft_ready = true;
    }
    if (r.generated >= tr.output_len) finish_request(idx);
  }
}

void Scheduler::release_request(int idx, int target_held) {
  RequestState& r = reqs_[idx];
  int keep_target = r.cached_prefix_len, keep_draft = r.cached_prefix_len;
  if (PrefixEntry* e = owned_prefix(idx)) {
    if (prefix_ready(*e)) {
      // The owner's first pages now belong to the prefix cache.
      keep_target = keep_draft = e->len;
    } else {
      // Not registered in both models yet: nobody uses it, and its pages are the owner's.
      prefixes_.erase(trace_.requests[idx].shared_prefix);
    }
  }
  free_positions(target_, r.target_row, keep_target, target_held);
  target_.kv.req_to_token->free(r.target_row);
  r.target_row = -1;
  if (draft_) {
    free_positions(*draft_, r.draft_row, keep_draft, r.draft_kv_len);
    draft_->kv.req_to_token->free(r.draft_row);
    r.draft_row = -1;
  }
}

void Scheduler::finish_request(int idx) {
  RequestState& r = reqs_[idx];
  release_request(idx, r.kv_len);
  r.phase = RequestState::Phase::finished;
  r.finished_iteration = iteration_;
  running_.erase(std::find(running_.begin(), running_.end(), idx));
}

void Scheduler::abort_request(int idx, int target_held, int64_t& counter) {
  RequestState& r = reqs_[idx];
  release_request(idx, target_held);
  r.aborted = true;
  r.phase = RequestState::Phase::finished;
  r.finished_iteration = iteration_;
  running_.erase(std::find(running_.begin(), running_.end(), idx));
  ++counter;
}

void Scheduler::apply_aborts(const ScheduledStep& s) {
  const int64_t end = int64_t{iteration_} + s.iterations;  // the first iteration after the step
  auto due = [&](int idx) {
    const int a = trace_.requests[idx].abort_step;
    return a >= 0 && a < end;
  };
  if (next_abort_ == abort_order_.size() || !due(abort_order_[next_abort_])) return;
  const bool spec = config_.spec.enabled();
  // The step's own requests: what they hold includes the step's slots.
  for (size_t i = 0; i < s.requests.size(); ++i) {
    const int idx = s.requests[i];
    if (!due(idx)) continue;
    RequestState& r = reqs_[idx];
    switch (s.batch.mode) {
      case ForwardMode::TARGET_VERIFY:
        abort_request(idx, r.kv_len + config_.spec.num_draft_tokens, aborts_.verify);
        break;
      case ForwardMode::DECODE:
        abort_request(idx, r.kv_len + 1, aborts_.decode);
        break;
      default:
        if (r.phase == RequestState::Phase::prefill) {
          abort_request(idx, r.prefilled + s.batch.extend_seq_lens[i], aborts_.prefill);
        } else {
          abort_request(idx, r.kv_len + 1, aborts_.decode);
        }
    }
  }
  for (; next_abort_ < abort_order_.size() && due(abort_order_[next_abort_]); ++next_abort_) {
    const int idx = abort_order_[next_abort_];
    RequestState& r = reqs_[idx];
    switch (r.phase) {
      case RequestState::Phase::finished:
        break;  // done before its abort_step, or aborted in the step above
      case RequestState::Phase::waiting: {
        auto it = std::find(waiting_.begin(), waiting_.end(), idx);
        if (it != waiting_.end()) waiting_.erase(it);
        r.aborted = true;
        r.phase = RequestState::Phase::finished;
        r.finished_iteration = iteration_;
        ++aborts_.waiting;
        break;
      }
      case RequestState::Phase::prefill:
        abort_request(idx, r.kv_len, aborts_.prefill);
        break;
      case RequestState::Phase::decode:
        abort_request(idx, r.kv_len, spec ? aborts_.verify : aborts_.decode);
        break;
    }
  }
}

void Scheduler::queue_due_draft() {
  // queue_draft_step allocates before it changes anything: on failure the draft stays due.
  queue_draft_step(draft_due_->reqs, draft_due_->after_verify);
  draft_due_.reset();
}

std::vector<int> Scheduler::live_target_rows() const {
  std::vector<int> rows;
  rows.reserve(running_.size());
  for (int idx : running_) rows.push_back(reqs_[idx].target_row);
  return rows;
}

void Scheduler::check_invariants() const {
  ATTNRT_CHECK(!step_open_,
               "scheduler: check_invariants() called between next() and complete() of step {}; "
               "pools are checked between steps",
               step_.index);
  check_space(target_, ModelRole::target);
  if (draft_) check_space(*draft_, ModelRole::draft);
}

void Scheduler::check_space(const Space& space, ModelRole role) const {
  const bool draft = role == ModelRole::draft;
  std::vector<uint8_t> drafting(reqs_.size(), 0);  // requests with a queued draft step
  if (draft && pending_draft_) {
    for (int idx : pending_draft_->requests) drafting[static_cast<size_t>(idx)] = 1;
  }
  SlotOwners owners;
  std::vector<int> rows;
  for (int idx : running_) {
    const RequestState& r = reqs_[idx];
    const int row = draft ? r.draft_row : r.target_row;
    rows.push_back(row);
    const int held = !draft                               ? r.kv_len
                     : drafting[static_cast<size_t>(idx)] ? r.kv_len
                                                          : r.draft_kv_len;
    int keep = r.cached_prefix_len;
    const TraceRequest& tr = trace_.requests[idx];
    if (auto it = prefixes_.find(tr.shared_prefix);
        it != prefixes_.end() && it->second.owner == idx &&
        (draft ? it->second.draft_ready : it->second.target_ready)) {
      keep = it->second.len;
    }
    std::vector<int64_t>& slots = owners.emplace_back();
    if (row < 0 || row >= space.kv.req_to_token->size()) continue;  // the row check names it
    const int32_t* tokens = space.kv.req_to_token->row_ptr(row);
    slots.assign(tokens + keep, tokens + std::max(keep, held));
  }
  for (const auto& [name, e] : prefixes_) {
    if (draft ? e.draft_ready : e.target_ready)
      owners.push_back(draft ? e.draft_slots : e.target_slots);
  }
  try {
    space.kv.req_to_token->check_invariants(rows);
    space.kv.allocator->check_invariants(owners);
  } catch (const Error& e) {
    fail(
        "scheduler: the {} model's pools after step {}: {} (live requests and owners are "
        "numbered in admission order of the {} running requests, the cached shared prefixes "
        "after them)",
        model_role_name(role), step_count_, e.what(), running_.size());
  }
}

void Scheduler::complete() {
  ATTNRT_CHECK(step_open_, "scheduler: complete() called without a step from next()");
  step_open_ = false;
  const ScheduledStep& s = step_;
  if (s.role == ModelRole::draft) {
    commit_draft(s);
    return;
  }
  const bool spec = config_.spec.enabled();
  apply_aborts(s);
  switch (s.batch.mode) {
    case ForwardMode::IDLE:
      break;
    case ForwardMode::EXTEND:
    case ForwardMode::MIXED: {
      std::vector<int> prefilled;
      for (size_t i = 0; i < s.requests.size(); ++i) {
        const int idx = s.requests[i];
        RequestState& r = reqs_[idx];
        if (r.aborted) continue;
        if (r.phase == RequestState::Phase::prefill) {
          commit_prefill_row(idx, s.batch.extend_seq_lens[i]);
          prefilled.push_back(idx);
        } else {
          ++r.kv_len;
          ++r.generated;
        }
      }
      if (spec) {
        // The draft model computes its own K/V for the same prompt chunks; finishing waits for it
        // (it may register the draft half of a shared prefix).
        if (!prefilled.empty()) draft_due_ = DraftDue{prefilled, false};
      } else {
        for (int idx : s.requests) {
          if (reqs_[idx].aborted) continue;
          if (reqs_[idx].generated >= trace_.requests[idx].output_len) finish_request(idx);
        }
      }
      break;
    }
    case ForwardMode::DECODE:
      for (int idx : s.requests) {
        if (reqs_[idx].aborted) continue;
        ++reqs_[idx].kv_len;
        if (++reqs_[idx].generated >= trace_.requests[idx].output_len) finish_request(idx);
      }
      break;
    case ForwardMode::TARGET_VERIFY:
      commit_verify(s);
      break;
    default:
      fail("scheduler: cannot commit a target step in mode {}", forward_mode_name(s.batch.mode));
  }
  iteration_ += s.iterations;
  // The draft step's slots: a failed allocation leaves it due, and next() tries again.
  if (draft_due_) queue_due_draft();
}

int64_t Scheduler::estimate_remaining_steps() const {
  if (done()) return 0;
  const int chunk = config_.chunked_prefill_size;
  int64_t prefill_tokens = 0, longest_decode = 0, last_arrival = 0;
  for (const RequestState& r : reqs_) {
    if (r.phase == RequestState::Phase::finished) continue;
    const TraceRequest& tr = trace_.requests[r.trace_index];
    prefill_tokens += tr.prompt_len - std::max(r.prefilled, shared_len(tr));
    longest_decode = std::max<int64_t>(longest_decode, tr.output_len - std::max(r.generated, 1));
    last_arrival = std::max<int64_t>(last_arrival, tr.arrival_step);
  }
  int64_t iterations = ceil_div(prefill_tokens, chunk);
  if (config_.spec.enabled()) {
    // Expected tokens per verify round on a chain: 1 + p + p^2 + ... (the bonus token included).
    double per_round = 0, p = 1;
    for (int d = 0; d < config_.spec.num_draft_tokens; ++d, p *= config_.spec.accept_prob)
      per_round += p;
    iterations = 2 * (iterations + static_cast<int64_t>(longest_decode / per_round + 1));
  } else {
    iterations += longest_decode;
  }
  return std::max(iterations, last_arrival - iteration_ + 1);
}

PoolReport Scheduler::finish_and_check_pools(ModelRole role) {
  ATTNRT_CHECK(done(), "scheduler: pools are checked only after every request finished");
  ATTNRT_CHECK(role == ModelRole::target || draft_, "scheduler: this run has no draft model");
  Space& space = role == ModelRole::target ? target_ : *draft_;
  PoolReport rep;
  rep.total_slots = space.initial_free;
  rep.rows_in_use = space.kv.req_to_token->size() - space.kv.req_to_token->available();
  std::vector<int64_t> prefix_pages;
  for (auto& [name, e] : prefixes_) {
    const bool ready = role == ModelRole::target ? e.target_ready : e.draft_ready;
    if (!ready) continue;
    const std::vector<int64_t>& slots = role == ModelRole::target ? e.target_slots : e.draft_slots;
    ++rep.prefixes;
    rep.prefix_slots += static_cast<int64_t>(slots.size());
    for (size_t pos = 0; pos < slots.size(); pos += config_.page_size)
      prefix_pages.push_back(slots[pos]);
  }
  rep.free_slots = space.kv.allocator->available_size();
  if (!prefix_pages.empty()) space.kv.allocator->free(prefix_pages);
  for (auto& [name, e] : prefixes_) {
    if (role == ModelRole::target) {
      e.target_ready = false;
      e.target_slots.clear();
    } else {
      e.draft_ready = false;
      e.draft_slots.clear();
    }
  }
  rep.free_after_release = space.kv.allocator->available_size();
  std::vector<std::string> problems;
  if (rep.rows_in_use != 0)
    problems.push_back(fmt::format("{} request rows still allocated", rep.rows_in_use));
  if (rep.free_slots + rep.prefix_slots != rep.total_slots) {
    problems.push_back(fmt::format(
        "{} slots free + {} held by shared prefixes != {} total ({} leaked)", rep.free_slots,
        rep.prefix_slots, rep.total_slots, rep.total_slots - rep.free_slots - rep.prefix_slots));
  }
  if (rep.free_after_release != rep.total_slots) {
    problems.push_back(fmt::format("{} of {} slots free after releasing the shared prefixes",
                                   rep.free_after_release, rep.total_slots));
  }
  rep.ok = problems.empty();
  for (const auto& p : problems) rep.detail += (rep.detail.empty() ? "" : "; ") + p;
  return rep;
}

}  // namespace attnrt::sim
