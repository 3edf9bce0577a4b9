// Faults injected (docs/RELIABILITY.md): the pools' check_invariants() catch leaks, sharing and
// slots held while free; every injected allocation failure (host memory of pools and caches, slot /
// row / state-slot allocation in the middle of a scheduler step) comes out as an attnrt::Error and
// leaves every pool passing its invariants with the untouched requests unchanged; `attnrt run`
// aborts requests mid-prefill and mid-verify and retracts running requests under memory pressure
// without leaking; a short soak through the CLI.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "attnrt/core/error.h"
#include "attnrt/core/fault_injection.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/linear_state_pool.h"
#include "attnrt/memory/page_allocator.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/memory/token_allocator.h"
#include "attnrt/model/model_spec.h"
#include "tests/test_linear_util.h"
#include "tests/test_sim_util.h"
#include "tests/test_util.h"
#include "tools/sim/driver.h"
#include "tools/sim/scheduler.h"
#include "tools/sim/trace.h"

namespace attnrt {
namespace {

using test::expect_error;
using Phase = sim::RequestState::Phase;

// ---------------------------------------------------------------------------------------------
// check_invariants

TEST(PoolInvariants, PageAllocatorFindsLeakedSharedAndFreedPages) {
  PageAllocator pages(64, 4);  // 16 pages
  pages.check_invariants();
  pages.check_invariants(SlotOwners{});
  const std::vector<int32_t> zero{0, 0}, lens{6, 3};
  const std::vector<int64_t> none{-1, -1};
  const std::vector<int64_t> slots = pages.alloc_extend(zero, lens, none);  // pages 1, 2 | 3
  const SlotOwners owners{{slots[0], slots[4], slots[5]}, {slots[6], slots[7], slots[8]}};
  pages.check_invariants(owners);
  expect_error([&] { pages.check_invariants(SlotOwners{owners[0]}); },
               {"page 3", "in use but no owner holds it: leaked"});
  expect_error(
      [&] {
        pages.check_invariants(SlotOwners{owners[0], owners[1], {slots[1]}});
      },
      {"page 1", "held by owners 0 and 2"});
  pages.free(std::vector<int64_t>{slots[6]});
  expect_error([&] { pages.check_invariants(owners); },
               {"owner 1 holds slot", "in page 3, which is free"});
  expect_error([&] { pages.check_invariants(SlotOwners{{2}}); },
               {"slot 2", "not a usable slot (4..67)"});
}

TEST(PoolInvariants, SwaAllocatorChecksBothPoolsAndTheMapping) {
  SWATokenAllocator a(64, 32, 4);
  const std::vector<int32_t> zero{0}, len{7};
  const std::vector<int64_t> none{-1};
  const std::vector<int64_t> slots = a.alloc_extend(zero, len, none);
  a.check_invariants();
  a.check_invariants(SlotOwners{slots});
  expect_error([&] { a.check_invariants(SlotOwners{}); }, {"leaked"});
  // The first page's tokens left the window: its SWA page is released, the full page stays.
  a.free_swa(std::span<const int64_t>(slots.data(), 4));
  a.check_invariants(SlotOwners{slots});
  a.free(slots);
  a.check_invariants(SlotOwners{});
  EXPECT_EQ(a.available_size(), 32);
}

TEST(PoolInvariants, RequestRowsMustBeExactlyTheLiveOnes) {
  ReqToTokenPool rows(4, 16);
  const int a = rows.alloc(), b = rows.alloc();
  rows.check_invariants();
  const std::vector<int> live{a, b};
  rows.check_invariants(live);
  expect_error([&] { rows.check_invariants(std::vector<int>{a}); },
               {fmt::format("row {} is allocated but no live request holds it: leaked", b)});
  expect_error(
      [&] {
        rows.check_invariants(std::vector<int>{a, b, a});
      },
      {fmt::format("row {} is held by live requests 0 and 2", a)});
  expect_error(
      [&] {
        rows.check_invariants(std::vector<int>{a, b, 3});
      },
      {"live request 2 holds row 3, which is not an allocated row"});
}

TEST(PoolInvariants, LinearStateSlotsMustBeBoundToLiveRows) {
  const ModelSpec model = testing_linear::hybrid_linear_model("tiny-hybrid", 256);
  LinearStatePool pool(model, LinearStateConfig{.max_slots = 3, .max_request_rows = 4});
  pool.check_invariants(std::vector<int>{});
  const int s = pool.alloc_for(2);
  pool.check_invariants(std::vector<int>{2});
  expect_error(
      [&] { pool.check_invariants(std::vector<int>{}); },
      {fmt::format("slot {} is allocated but bound to row 2, which no live request", s), "leaked"});
  expect_error(
      [&] {
        pool.check_invariants(std::vector<int>{2, 1});
      },
      {"live request row 1 holds no state slot"});
  const int loose = pool.alloc();
  expect_error([&] { pool.check_invariants(std::vector<int>{2}); },
               {fmt::format("slot {} is allocated but bound to no request row: leaked", loose)});
  pool.free(loose);
  pool.free_for(2);
  pool.check_invariants(std::vector<int>{});
  EXPECT_EQ(pool.available(), 3);
}

// ---------------------------------------------------------------------------------------------
// Host memory of pools and caches

// Every host allocation of `build` fails in turn: each failure is an attnrt::Error naming the
// injected fault and the allocation, and `witness` (built before) still passes its invariants.
void fail_each_host_allocation(const std::function<void()>& build, const PageAllocator& witness,
                               int64_t min_points) {
  FaultInjector counter;
  {
    FaultScope scope(counter);
    build();
  }
  const int64_t points = counter.calls(FaultSite::host_alloc);
  EXPECT_GE(points, min_points);
  for (int64_t k = 1; k <= points; ++k) {
    SCOPED_TRACE(fmt::format("host allocation {} of {}", k, points));
    FaultInjector f;
    f.fail_nth(FaultSite::host_alloc, k);
    FaultScope scope(f);
    expect_error(build, {"injected fault:", fmt::format("fault site host_alloc, call {}", k)});
    EXPECT_EQ(f.injected(FaultSite::host_alloc), 1);
    witness.check_invariants();
  }
  build();  // no injector left installed: builds again
}

TEST(FaultInjection, EveryHostAllocationOfKvCachesFailsCleanly) {
  PageAllocator witness(64, 4);
  const std::vector<int64_t> held = witness.alloc_extend(
      std::vector<int32_t>{0}, std::vector<int32_t>{9}, std::vector<int64_t>{-1});
  LayerSpec swa = test::attention_layer(1, 4, 2, 16);
  swa.kind = LayerKind::swa;
  swa.sliding_window = 8;
  const ModelSpec gemma_like =
      test::make_model("swa-hybrid", DType::f32, 256, {test::attention_layer(0, 4, 2, 16), swa});
  ModelSpec dsa = model_preset("deepseek-v3.2");
  dsa.layers.resize(2);
  const KVCacheConfig kc{
      .full_slots = 64, .page_size = 4, .dtype = DType::f32, .max_num_tokens = 32};
  // MHA + SWA pools, the SWA write-slot scratch; MLA latent and DSA index-key pools.
  fail_each_host_allocation([&] { make_host_kv_storage(gemma_like, kc); }, witness, 3);
  fail_each_host_allocation([&] { make_host_kv_storage(dsa, kc); }, witness, 4);
  fail_each_host_allocation([] { ReqToTokenPool rows(4, 64); }, witness, 1);
  const ModelSpec hybrid = testing_linear::hybrid_linear_model("tiny-hybrid", 256);
  fail_each_host_allocation(
      [&] {
        LinearStatePool pool(
            hybrid,
            LinearStateConfig{
                .max_slots = 2, .max_request_rows = 2, .verify_rows = 2, .num_draft_tokens = 3});
      },
      witness, 12);
  witness.check_invariants(SlotOwners{held});
}

// ---------------------------------------------------------------------------------------------
// Slot allocation

TEST(FaultInjection, FailedSlotAllocationChangesNoAllocator) {
  const std::vector<int32_t> prefix{0, 0}, seq{5, 9};
  const std::vector<int64_t> none{-1, -1};
  PagedTokenAllocator paged(64, 4);
  SWATokenAllocator swa(64, 48, 4);
  for (TokenAllocator* a : std::vector<TokenAllocator*>{&paged, &swa}) {
    const std::vector<int64_t> held = a->alloc_extend(prefix, seq, none);
    const int64_t free_before = a->available_size();
    // The SWA allocator allocates twice (full pool, then SWA pool): a failure of the second
    // must give the first back.
    const int calls = a == &swa ? 2 : 1;
    for (int k = 1; k <= calls; ++k) {
      SCOPED_TRACE(fmt::format("{} allocator, call {}", a == &swa ? "SWA" : "paged", k));
      FaultInjector f;
      FaultScope scope(f);
      f.fail_nth(FaultSite::slot_alloc, k);
      expect_error([&] { a->alloc_extend(prefix, seq, none); },
                   {"injected fault: PageAllocator::alloc_extend failed"});
      EXPECT_EQ(a->available_size(), free_before);
      a->check_invariants(SlotOwners{held});
      f.fail_nth(FaultSite::slot_alloc, k);
      expect_error(
          [&] {
            a->alloc_decode(std::vector<int32_t>{6, 10}, std::vector<int64_t>{held[4], held[13]});
          },
          {"injected fault: PageAllocator::alloc_decode failed"});
      EXPECT_EQ(a->available_size(), free_before);
      a->check_invariants(SlotOwners{held});
    }
    a->free(held);
    a->check_invariants(SlotOwners{});
  }
}

TEST(FaultInjection, FailedRowAndStateSlotAllocationsChangeNothing) {
  ReqToTokenPool rows(3, 8);
  const int kept = rows.alloc();
  const ModelSpec hybrid = testing_linear::hybrid_linear_model("tiny-hybrid", 256);
  LinearStatePool states(hybrid, LinearStateConfig{.max_slots = 3, .max_request_rows = 3});
  states.alloc_for(kept);
  FaultInjector f;
  FaultScope scope(f);
  f.fail_nth(FaultSite::slot_alloc, 1);
  expect_error([&] { rows.alloc(); }, {"injected fault: ReqToTokenPool::alloc failed"});
  rows.check_invariants(std::vector<int>{kept});
  EXPECT_EQ(rows.available(), 2);
  f.fail_nth(FaultSite::slot_alloc, 1);
  expect_error([&] { states.alloc_for(1); }, {"injected fault: LinearStatePool::alloc failed"});
  states.check_invariants(std::vector<int>{kept});
  EXPECT_EQ(states.available(), 2);
  EXPECT_EQ(states.slot_of(1), -1);
}

// The scheduler's pools (bookkeeping only) for one model.
struct SimPools {
  ReqToTokenPool rows;
  PagedTokenAllocator alloc;
  SimPools(int max_requests, int ctx, int64_t slots, int page)
      : rows(max_requests, ctx), alloc(slots, page) {}
  sim::KvSpace space() { return sim::KvSpace{&rows, &alloc, nullptr, {}}; }
};

struct Committed {
  Phase phase;
  int prefilled, kv_len, draft_kv_len, generated, target_row, draft_row, retractions;
  bool operator==(const Committed&) const = default;
};
std::vector<Committed> committed(const sim::Scheduler& s) {
  std::vector<Committed> out;
  for (const sim::RequestState& r : s.requests()) {
    out.push_back({r.phase, r.prefilled, r.kv_len, r.draft_kv_len, r.generated, r.target_row,
                   r.draft_row, r.retractions});
  }
  return out;
}
// The requests whose committed state differs, except those the call retracted: a retraction
// decided before the failed allocation stands (the request is queued again, its pages freed).
std::vector<int> changed_untouched(const std::vector<Committed>& before,
                                   const std::vector<Committed>& after) {
  std::vector<int> changed;
  for (size_t i = 0; i < before.size(); ++i) {
    if (after[i].retractions != before[i].retractions) {
      EXPECT_EQ(after[i].phase, Phase::waiting);
      continue;
    }
    if (!(after[i] == before[i])) changed.push_back(static_cast<int>(i));
  }
  return changed;
}

// Runs `s` to the end; at every `every`-th step the k-th slot allocation (k = 1, 2 in turn) of
// next() fails, and, with speculation, of complete() too: each failure is an attnrt::Error, the
// pools pass their invariants, no request's committed state changed (but for retractions decided
// before the failure), and the retried call goes on.
// Returns the faults injected.
int run_with_slot_faults(sim::Scheduler& s, int every) {
  int injected = 0, step = 0;
  while (!s.done()) {
    ++step;
    if (step % every == 0) {
      const std::vector<Committed> before = committed(s);
      FaultInjector f;
      f.fail_nth(FaultSite::slot_alloc, 1 + (step / every) % 2);
      bool failed = false;
      {
        FaultScope scope(f);
        try {
          s.next();
        } catch (const Error& e) {
          failed = true;
          EXPECT_NE(std::string(e.what()).find("injected fault"), std::string::npos) << e.what();
        }
      }
      if (failed) {
        ++injected;
        s.check_invariants();
        EXPECT_TRUE(changed_untouched(before, committed(s)).empty())
            << "a failed next() changed a request, step " << step;
        s.next();
      }
    } else {
      s.next();
    }
    if (s.config().spec.enabled() && step % every == every / 2) {
      FaultInjector f;
      f.fail_nth(FaultSite::slot_alloc, 1);  // the draft step queued by complete()
      FaultScope scope(f);
      try {
        s.complete();
      } catch (const Error& e) {
        ++injected;
        EXPECT_NE(std::string(e.what()).find("injected fault"), std::string::npos) << e.what();
      }
    } else {
      s.complete();
    }
    s.check_invariants();
  }
  return injected;
}

sim::Trace pressure_trace(uint64_t seed, int n, int abort_every) {
  return sim::soak_trace(n, 4, 16, abort_every, seed);
}

TEST(FaultInjection, FailedAllocationsInTheMiddleOfStepsLeavePoolsConsistent) {
  for (bool spec : {false, true}) {
    for (bool retract : {false, true}) {
      SCOPED_TRACE(fmt::format("speculative {}, retract {}", spec, retract));
      sim::SchedulerConfig cfg;
      cfg.page_size = 4;
      cfg.max_running_requests = 4;
      cfg.chunked_prefill_size = 16;
      cfg.retract = retract;
      if (spec) cfg.spec = {.num_steps = 2, .topk = 2, .num_draft_tokens = 4};
      SimPools target(4, 256, 240, 4), draft(4, 256, 240, 4);
      sim::Scheduler s(pressure_trace(7, 200, 6), cfg, target.space(),
                       spec ? std::optional<sim::KvSpace>(draft.space()) : std::nullopt);
      EXPECT_GT(run_with_slot_faults(s, 5), 10);
      EXPECT_GT(s.aborts().total(), 0);
      for (const sim::RequestState& r : s.requests()) {
        const sim::TraceRequest& tr = s.trace().requests[r.trace_index];
        EXPECT_EQ(r.phase, Phase::finished) << tr.id;
        if (!r.aborted) EXPECT_EQ(r.generated, tr.output_len) << tr.id;
      }
      for (sim::ModelRole role : {sim::ModelRole::target, sim::ModelRole::draft}) {
        if (role == sim::ModelRole::draft && !spec) continue;
        const sim::PoolReport rep = s.finish_and_check_pools(role);
        EXPECT_TRUE(rep.ok) << rep.detail;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Aborts and retraction in the scheduler

sim::SchedulerConfig small_config(bool spec) {
  sim::SchedulerConfig cfg;
  cfg.page_size = 4;
  cfg.max_running_requests = 2;
  cfg.chunked_prefill_size = 16;
  if (spec) cfg.spec = {.num_steps = 3, .topk = 1, .num_draft_tokens = 4};
  return cfg;
}

// Drives `s` to the end checking the invariants after every step; returns the phase each request
// had when its abort took effect (by trace index; Phase::finished if none did).
std::vector<Phase> drive_checked(sim::Scheduler& s) {
  std::vector<Phase> at_abort(s.requests().size(), Phase::finished);
  while (!s.done()) {
    const std::vector<sim::RequestState> before = s.requests();
    s.next();
    s.complete();
    s.check_invariants();
    for (size_t i = 0; i < before.size(); ++i) {
      if (!before[i].aborted && s.requests()[i].aborted) at_abort[i] = before[i].phase;
    }
  }
  return at_abort;
}

TEST(SimAbort, MidPrefillBetweenChunksFreesEverythingItHeld) {
  // 'long' needs 4 chunks of 16; it is aborted at iteration 2, between its second and third
  // chunk. 'waits' never gets a row (one request at a time) and is aborted while queued.
  const sim::Trace t = sim::parse_trace(
      "{\"id\": \"long\", \"prompt_len\": 60, \"output_len\": 5, \"abort_step\": 2}\n"
      "{\"id\": \"waits\", \"prompt_len\": 8, \"output_len\": 50, \"abort_step\": 2}\n"
      "{\"id\": \"short\", \"arrival_step\": 1, \"prompt_len\": 8, \"output_len\": 3}\n",
      "aborts");
  sim::SchedulerConfig cfg = small_config(false);
  cfg.max_running_requests = 1;
  SimPools pools(2, 256, 256, 4);
  sim::Scheduler s(t, cfg, pools.space());
  const std::vector<Phase> at_abort = drive_checked(s);
  EXPECT_TRUE(s.requests()[0].aborted);
  EXPECT_EQ(at_abort[0], Phase::prefill);
  EXPECT_LT(s.requests()[0].prefilled, 60);
  EXPECT_GT(s.requests()[0].prefilled, 16);  // a chunk committed before the abort
  EXPECT_TRUE(s.requests()[1].aborted);
  EXPECT_FALSE(s.requests()[2].aborted);
  EXPECT_EQ(s.requests()[2].generated, 3);
  EXPECT_EQ(s.aborts().prefill, 1);
  EXPECT_EQ(s.aborts().total(), 2);
  const sim::PoolReport rep = s.finish_and_check_pools(sim::ModelRole::target);
  EXPECT_TRUE(rep.ok) << rep.detail;
}

TEST(SimAbort, MidVerifyBeforeAcceptanceFreesTheBlock) {
  // 'v' is prefilled at iteration 0 and verifies from iteration 1; it is aborted in the verify
  // step of iteration 3.
  const sim::Trace t = sim::parse_trace(
      "{\"id\": \"v\", \"prompt_len\": 10, \"output_len\": 40, \"abort_step\": 3}\n"
      "{\"id\": \"w\", \"prompt_len\": 12, \"output_len\": 9}\n",
      "verify-abort");
  SimPools target(2, 256, 256, 4), draft(2, 256, 256, 4);
  sim::Scheduler s(t, small_config(true), target.space(), draft.space());
  bool aborted_in_verify = false;
  while (!s.done()) {
    const sim::ScheduledStep& step = s.next();
    const bool verify = step.batch.mode == ForwardMode::TARGET_VERIFY;
    const auto pos = std::find(step.requests.begin(), step.requests.end(), 0);
    const bool v_in_step = pos != step.requests.end();
    const size_t row = static_cast<size_t>(pos - step.requests.begin());
    const sim::RequestState v_before = s.requests()[0];
    const bool was_aborted = v_before.aborted;
    s.complete();
    s.check_invariants();
    if (verify && v_in_step && !was_aborted && s.requests()[0].aborted) {
      aborted_in_verify = true;
      // Aborted before acceptance: no path sampled for it, nothing committed by the step.
      EXPECT_GE(v_before.accept_lengths.size(), 1u);
      EXPECT_TRUE(s.last_accepted_paths()[row].empty());
      EXPECT_EQ(s.requests()[0].accept_lengths.size(), v_before.accept_lengths.size());
      EXPECT_EQ(s.requests()[0].generated, v_before.generated);
    }
  }
  EXPECT_TRUE(aborted_in_verify);
  EXPECT_EQ(s.aborts().verify, 1);
  EXPECT_FALSE(s.requests()[1].aborted);
  EXPECT_EQ(s.requests()[1].generated, 9);
  for (sim::ModelRole role : {sim::ModelRole::target, sim::ModelRole::draft}) {
    const sim::PoolReport rep = s.finish_and_check_pools(role);
    EXPECT_TRUE(rep.ok) << rep.detail;
  }
}

TEST(SimAbort, AnOwnerAbortedBeforeItsPrefixIsCachedHandsThePrefixOn) {
  // 'owner' registers "sys" but is aborted mid-prefill; 'user' waited for the prefix and must
  // prefill it itself (becoming its owner) instead of waiting forever.
  const sim::Trace t = sim::parse_trace(
      "{\"id\": \"owner\", \"prompt_len\": 60, \"output_len\": 4, \"shared_prefix\": \"sys\", "
      "\"shared_prefix_len\": 40, \"abort_step\": 1}\n"
      "{\"id\": \"user\", \"prompt_len\": 50, \"output_len\": 4, \"shared_prefix\": \"sys\", "
      "\"shared_prefix_len\": 40}\n",
      "prefix-abort");
  SimPools pools(2, 256, 256, 4);
  sim::Scheduler s(t, small_config(false), pools.space());
  drive_checked(s);
  EXPECT_TRUE(s.requests()[0].aborted);
  EXPECT_EQ(s.requests()[1].generated, 4);
  const sim::PoolReport rep = s.finish_and_check_pools(sim::ModelRole::target);
  EXPECT_TRUE(rep.ok) << rep.detail;
  EXPECT_EQ(rep.prefixes, 1);  // registered by 'user'
}

TEST(SimInvariants, SchedulerFindsPagesAndRowsTakenOrFreedBehindItsBack) {
  const sim::Trace trace = sim::parse_trace(
      "{\"id\": \"a\", \"prompt_len\": 20, \"output_len\": 10}\n"
      "{\"id\": \"b\", \"prompt_len\": 9, \"output_len\": 10}\n",
      "two");
  SimPools pools(4, 256, 256, 4);
  sim::Scheduler s(trace, small_config(false), pools.space());
  while (s.requests()[0].phase != Phase::decode) {
    s.next();
    s.complete();
  }
  s.check_invariants();
  // A page nobody holds: leaked.
  const std::vector<int64_t> stray = pools.alloc.alloc_extend(
      std::vector<int32_t>{0}, std::vector<int32_t>{1}, std::vector<int64_t>{-1});
  expect_error([&] { s.check_invariants(); },
               {"the target model's pools after step", "is in use but no owner holds it: leaked"});
  pools.alloc.free(stray);
  s.check_invariants();
  // A page of a running request freed: the request holds a free page.
  const sim::RequestState& r = s.requests()[0];
  const int64_t slot = pools.rows.get(r.target_row, 0);
  pools.alloc.free(std::vector<int64_t>{slot});
  expect_error([&] { s.check_invariants(); }, {"owner 0 holds slot", "which is free"});
  // A request row nobody holds.
  SimPools fresh(4, 256, 256, 4);
  sim::Scheduler t(trace, small_config(false), fresh.space());
  t.next();
  t.complete();
  fresh.rows.alloc();
  expect_error([&] { t.check_invariants(); }, {"is allocated but no live request holds it"});
}

TEST(SimRetract, MemoryPressureRetractsNewestRequestsThatThenFinish) {
  for (bool spec : {false, true}) {
    SCOPED_TRACE(fmt::format("speculative {}", spec));
    sim::SchedulerConfig cfg = small_config(spec);
    cfg.max_running_requests = 4;
    cfg.retract = true;
    // Four requests of 24 + 40 tokens in 128 slots: all are admitted on their prompts and run
    // out while decoding.
    std::string text;
    for (int i = 0; i < 4; ++i) {
      text += fmt::format("{{\"id\": \"q{}\", \"prompt_len\": 24, \"output_len\": 40}}\n", i);
    }
    SimPools target(4, 256, 128, 4), draft(4, 256, 128, 4);
    sim::Scheduler s(sim::parse_trace(text, "pressure"), cfg, target.space(),
                     spec ? std::optional<sim::KvSpace>(draft.space()) : std::nullopt);
    drive_checked(s);
    EXPECT_GT(s.retractions(), 0);
    EXPECT_EQ(s.requests()[0].retractions, 0);  // the oldest is never retracted
    int64_t retracted = 0;
    for (const sim::RequestState& r : s.requests()) {
      EXPECT_EQ(r.generated, 40);
      retracted += r.retractions;
    }
    EXPECT_EQ(retracted, s.retractions());
    const sim::PoolReport rep = s.finish_and_check_pools(sim::ModelRole::target);
    EXPECT_TRUE(rep.ok) << rep.detail;
    // Without --retract, admission reserves each request's life and never retracts.
    cfg.retract = false;
    SimPools t2(4, 256, 128, 4), d2(4, 256, 128, 4);
    sim::Scheduler conservative(sim::parse_trace(text, "pressure"), cfg, t2.space(),
                                spec ? std::optional<sim::KvSpace>(d2.space()) : std::nullopt);
    drive_checked(conservative);
    EXPECT_EQ(conservative.retractions(), 0);
  }
}

TEST(SimTraceAbort, AbortStepParsesRoundTripsAndMustFollowArrival) {
  const sim::Trace t = sim::parse_trace(
      "{\"id\": \"a\", \"arrival_step\": 3, \"prompt_len\": 5, \"output_len\": 2, "
      "\"abort_step\": 3}\n{\"id\": \"b\", \"prompt_len\": 5, \"output_len\": 2}\n",
      "t");
  EXPECT_EQ(t.requests[0].abort_step, 3);
  EXPECT_EQ(t.requests[1].abort_step, -1);
  const sim::Trace back = sim::parse_trace(sim::to_jsonl(t), "t");
  EXPECT_EQ(back.requests[0].abort_step, 3);
  EXPECT_EQ(sim::to_jsonl(back), sim::to_jsonl(t));
  expect_error(
      [] {
        sim::parse_trace(
            "{\"arrival_step\": 4, \"prompt_len\": 5, \"output_len\": 2, "
            "\"abort_step\": 2}",
            "t");
      },
      {"line 1", "'abort_step' = 2 comes before arrival_step = 4"});
  expect_error(
      [] { sim::parse_trace("{\"prompt_len\": 5, \"output_len\": 2, \"abort_step\": -2}", "t"); },
      {"'abort_step' = -2", "[0, 2^30]"});
}

// ---------------------------------------------------------------------------------------------
// Whole runs

TEST(SimSoak, HybridRunWithAbortsAndRetractionsHoldsEveryInvariant) {
  const ModelSpec model = testing_linear::hybrid_linear_model("tiny-hybrid", 1024);
  Options o;
  o.attention_backend = "cpu";
  o.page_size = 4;
  // Arrivals paced for 8 running requests into 4 rows and 128 slots: requests queue, and the
  // running ones outgrow the pool.
  sim::RunConfig rc = test::small_run_config(128, 4, 3);
  rc.scheduler.chunked_prefill_size = 16;
  rc.scheduler.retract = true;
  rc.check_invariants_every = 1;
  const sim::RunReport r = sim::run_trace(model, o, sim::soak_trace(200, 8, 16, 3, 11), rc);
  EXPECT_TRUE(r.ok()) << sim::format_report(r);
  EXPECT_GT(r.aborts.total(), 0);
  EXPECT_GT(r.retractions, 0);
  EXPECT_GT(r.invariant_checks, 100);
  EXPECT_TRUE(r.linear_pool_ok) << r.linear_pool_detail;
  const std::string text = sim::format_report(r);
  EXPECT_NE(text.find(fmt::format("retractions: {}", r.retractions)), std::string::npos) << text;
}

TEST(SimSoak, DcpRanksTakeAVerifyAbort) {
  // 'v' is aborted in the verify step of iteration 3: the DCP ranks get no accepted path for it.
  const sim::Trace t = sim::parse_trace(
      "{\"id\": \"v\", \"prompt_len\": 10, \"output_len\": 40, \"abort_step\": 3}\n"
      "{\"id\": \"w\", \"prompt_len\": 12, \"output_len\": 9}\n",
      "dcp-abort");
  Options o = test::speculative_options("cpu", 1);
  o.dcp_size = 2;
  sim::RunConfig rc = test::small_run_config(512, 1, 5);
  rc.check_invariants_every = 1;
  const sim::RunReport r = sim::run_trace(test::make_model("tiny", DType::f32, 256,
                                                           {test::attention_layer(0, 4, 2, 16)}),
                                          o, t, rc);
  EXPECT_TRUE(r.ok()) << sim::format_report(r);
  EXPECT_EQ(r.aborts.verify, 1);
  EXPECT_EQ(r.aborts.total(), 1);
}

class SoakCli : public test::CliTest {};

TEST_F(SoakCli, ShortSoakEndsWithoutLeaksAndReportsItsRates) {
  const std::string json_path = (dir_ / "soak.json").string();
  const test::CommandResult r =
      run("run --no-progress --soak-steps 2000 --max-running-requests 8 --chunked-prefill-size 32 "
          "--max-total-tokens 640 --page-size 4 --check-every 64 --check-invariants 200 --json '" +
          json_path + "'");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("pool check (target): ok"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("all held"), std::string::npos) << r.out;
  std::ifstream in(json_path);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_TRUE(j["ok"].get<bool>());
  EXPECT_GE(j["steps"].get<int64_t>(), 2000);
  EXPECT_GT(j["aborts"]["total"].get<int64_t>(), 0);
  EXPECT_GT(j["retractions"].get<int64_t>(), 0);
  EXPECT_GT(j["invariant_checks"].get<int64_t>(), 10);
  EXPECT_GT(j["tokens_per_s_first_tenth"].get<double>(), 0);
  EXPECT_GT(j["tokens_per_s_last_tenth"].get<double>(), 0);
  const std::vector<double> tenths = j["tokens_per_s_by_tenth"].get<std::vector<double>>();
  ASSERT_EQ(tenths.size(), 10u);
  EXPECT_EQ(tenths.front(), j["tokens_per_s_first_tenth"].get<double>());
  EXPECT_EQ(tenths.back(), j["tokens_per_s_last_tenth"].get<double>());
  for (double t : tenths) EXPECT_GT(t, 0);
  EXPECT_GT(j["total"]["checked_steps"].get<int64_t>(), 0);
  const test::CommandResult both = run("run --soak-steps 10 --trace '" + json_path + "'");
  EXPECT_EQ(both.status, 2) << both.out << both.err;
  EXPECT_NE(both.err.find("--soak-steps 10 generates its own trace; drop --trace"),
            std::string::npos)
      << both.err;
}

}  // namespace
}  // namespace attnrt
