// The serving simulation behind `attnrt run`: trace parsing, the scheduler's invariants on the
// built-in trace and on random traces (checked step by step against the pools), speculative verify
// / draft extend bookkeeping including the K/V moves of accepted tree paths, and whole runs of the
// step driver against the reference backend.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/memory/token_allocator.h"
#include "attnrt/model/model_spec.h"
#include "tools/io/case_file.h"
#include "tools/sim/driver.h"
#include "tools/sim/scheduler.h"
#include "tools/sim/trace.h"
#include "tests/test_sim_util.h"
#include "tests/test_util.h"
#include "tools/sim/driver.h"
#include "tools/sim/scheduler.h"
#include "tools/sim/trace.h"

namespace attnrt::sim {
namespace {

using attnrt::test::expect_error;

using Phase = RequestState::Phase;

// ---------------------------------------------------------------------------------------------
// Trace parsing

TEST(SimTrace, ParsesFieldsDefaultsAndBlankLines) {
  const Trace t = parse_trace(
      "{\"id\": \"a\", \"arrival_step\": 3, \"prompt_len\": 300, \"output_len\": 40, "
      "\"shared_prefix\": \"sys-a\", \"shared_prefix_len\": 128}\n"
      "\n"
      "  {\"prompt_len\": 5, \"output_len\": 1}\r\n",
      "t.jsonl");
  ASSERT_EQ(t.requests.size(), 2u);
  EXPECT_EQ(t.requests[0].id, "a");
  EXPECT_EQ(t.requests[0].arrival_step, 3);
  EXPECT_EQ(t.requests[0].prompt_len, 300);
  EXPECT_EQ(t.requests[0].output_len, 40);
  EXPECT_EQ(t.requests[0].shared_prefix, "sys-a");
  EXPECT_EQ(t.requests[0].shared_prefix_len, 128);
  EXPECT_EQ(t.requests[0].line, 1);
  // Defaults: id from the request index, arrival 0, no shared prefix.
  EXPECT_EQ(t.requests[1].id, "r1");
  EXPECT_EQ(t.requests[1].arrival_step, 0);
  EXPECT_EQ(t.requests[1].shared_prefix, "");
  EXPECT_EQ(t.requests[1].line, 3);
  EXPECT_EQ(t.total_prompt_tokens(), 305);
  EXPECT_EQ(t.total_output_tokens(), 41);
  EXPECT_EQ(t.last_arrival_step(), 3);
}

TEST(SimTrace, RoundTripsThroughJsonLines) {
  const Trace t = builtin_trace();
  const Trace back = parse_trace(to_jsonl(t), "round-trip");
  ASSERT_EQ(back.requests.size(), t.requests.size());
  for (size_t i = 0; i < t.requests.size(); ++i) {
    EXPECT_EQ(back.requests[i].id, t.requests[i].id);
    EXPECT_EQ(back.requests[i].arrival_step, t.requests[i].arrival_step);
    EXPECT_EQ(back.requests[i].prompt_len, t.requests[i].prompt_len);
    EXPECT_EQ(back.requests[i].output_len, t.requests[i].output_len);
    EXPECT_EQ(back.requests[i].shared_prefix, t.requests[i].shared_prefix);
    EXPECT_EQ(back.requests[i].shared_prefix_len, t.requests[i].shared_prefix_len);
  }
}

TEST(SimTrace, MalformedLinesNameLineAndField) {
  const std::string ok = "{\"prompt_len\": 4, \"output_len\": 2}\n";
  expect_error([&] { parse_trace(ok + "{\"prompt_len\": 4,", "bad.jsonl"); },
               {"bad.jsonl", "line 2", "not valid JSON"});
  expect_error([&] { parse_trace(ok + "{\"output_len\": 2}", "x"); },
               {"line 2", "'prompt_len'", "missing"});
  expect_error([&] { parse_trace("{\"prompt_len\": \"300\", \"output_len\": 2}", "x"); },
               {"line 1", "'prompt_len'", "integer", "\"300\""});
  expect_error([&] { parse_trace("{\"prompt_len\": 3.5, \"output_len\": 2}", "x"); },
               {"line 1", "'prompt_len'", "integer"});
  expect_error([&] { parse_trace("{\"prompt_len\": 0, \"output_len\": 2}", "x"); },
               {"line 1", "'prompt_len' = 0", "[1,"});
  expect_error(
      [&] { parse_trace("{\"prompt_len\": 4, \"output_len\": 2, \"arrival_step\": -1}", "x"); },
      {"'arrival_step' = -1", "[0,"});
  expect_error([&] { parse_trace("{\"prompt_len\": 4, \"output_len\": 2, \"promt\": 1}", "x"); },
               {"line 1", "unknown field 'promt'", "prompt_len"});
  expect_error([&] { parse_trace("[1, 2]", "x"); }, {"line 1", "JSON object"});
  expect_error([&] { parse_trace("{\"id\": 7, \"prompt_len\": 4, \"output_len\": 2}", "x"); },
               {"'id'", "string"});
  expect_error(
      [&] {
        parse_trace(
            "{\"prompt_len\": 4, \"output_len\": 2, \"shared_prefix\": \"s\", "
            "\"shared_prefix_len\": 4}",
            "x");
      },
      {"'shared_prefix_len' = 4", "smaller than prompt_len = 4"});
  expect_error(
      [&] { parse_trace("{\"prompt_len\": 4, \"output_len\": 2, \"shared_prefix_len\": 2}", "x"); },
      {"'shared_prefix_len'", "without 'shared_prefix'"});
  expect_error(
      [&] { parse_trace("{\"prompt_len\": 4, \"output_len\": 2, \"shared_prefix\": \"s\"}", "x"); },
      {"'shared_prefix_len'", "missing"});
  expect_error(
      [&] {
        parse_trace(
            "{\"id\": \"a\", \"prompt_len\": 4, \"output_len\": 2}\n"
            "{\"id\": \"a\", \"prompt_len\": 4, \"output_len\": 2}",
            "x");
      },
      {"line 2", "\"a\"", "already used on line 1"});
  expect_error(
      [&] {
        parse_trace(
            "{\"prompt_len\": 40, \"output_len\": 2, \"shared_prefix\": \"s\", "
            "\"shared_prefix_len\": 16}\n"
            "{\"prompt_len\": 40, \"output_len\": 2, \"shared_prefix\": \"s\", "
            "\"shared_prefix_len\": 32}",
            "x");
      },
      {"line 2", "= 32", "line 1 gives it 16"});
  expect_error([&] { parse_trace("\n  \n", "empty.jsonl"); }, {"empty.jsonl", "no requests"});
  expect_error([&] { load_trace("/nonexistent/trace.jsonl"); },
               {"/nonexistent/trace.jsonl", "cannot open"});
}

// Issue 21 (fuzz_hf_config, the same JSON parser): a number beyond a double's range threw an
// exception other than attnrt::Error out of parse_trace.
TEST(SimTrace, NumbersBeyondDoubleAreInvalidJson) {
  expect_error([] { parse_trace("{\"prompt_len\": 4, \"output_len\": 1e999}", "big.jsonl"); },
               {"big.jsonl", "line 1", "not valid JSON", "1e999"});
}

TEST(SimTrace, BuiltinTraceIsDeterministicAndMixed) {
  const Trace a = builtin_trace(), b = builtin_trace();
  EXPECT_EQ(to_jsonl(a), to_jsonl(b));
  EXPECT_GE(a.requests.size(), 24u);
  EXPECT_LE(a.requests.size(), 48u);
  std::set<std::string> prefixes;
  std::set<int> arrivals;
  int longest = 0, shortest = 1 << 30, with_prefix = 0;
  for (const TraceRequest& r : a.requests) {
    if (!r.shared_prefix.empty()) {
      prefixes.insert(r.shared_prefix);
      ++with_prefix;
    }
    arrivals.insert(r.arrival_step);
    longest = std::max(longest, r.prompt_len);
    shortest = std::min(shortest, r.prompt_len);
  }
  EXPECT_EQ(prefixes.size(), 2u);
  EXPECT_GE(with_prefix, 8);
  EXPECT_GT(arrivals.size(), 10u);  // staggered
  EXPECT_GT(*arrivals.begin(), 0);  // the engine starts idle
  EXPECT_GT(longest, 256);          // chunked at the default budget
  EXPECT_LT(shortest, 64);
}

// ---------------------------------------------------------------------------------------------
// Scheduler, bookkeeping only

struct Pools {
  ReqToTokenPool rows;
  PagedTokenAllocator alloc;
  Pools(int max_requests, int ctx, int64_t slots, int page)
      : rows(max_requests, ctx), alloc(slots, page) {}
  KvSpace space() { return KvSpace{&rows, &alloc, nullptr, {}}; }
};

struct Observed {
  std::map<ForwardMode, int> target_modes, draft_modes;
  int continuation_chunks = 0;   // EXTEND/MIXED rows continuing a request's own earlier chunk
  int shared_prefix_starts = 0;  // first chunks that start from a cached shared prefix
  int max_running = 0;
  int verify_rounds = 0;
};

// Drives the scheduler to the end, checking every step against the pools:
// - the batch is valid (make_step_layout accepts it) and its rows point at the step's slots;
// - new slots are distinct, keep slot % P == position % P, and belong to no live token or cached
//   prefix; - lengths follow the mode's conventions; - accepted verify paths are tree paths and the
//   draft extend that follows carries exactly the accepted lengths.
// (Fatal assertions need a void function: the result goes to `ob`.)
void drive_into(Scheduler& s, Pools& target, Pools* draft, int max_running, Observed& ob) {
  const Trace& trace = s.trace();
  const int P = s.config().page_size;
  std::set<int64_t> prefix_slots[2];
  std::map<int, int> accepted_of;  // trace index -> accepted drafts of the last verify
  bool expect_draft_extend = false;
  while (!s.done()) {
    const ScheduledStep& step = s.next();
    const ForwardBatch& b = step.batch;
    const bool is_draft = step.role == ModelRole::draft;
    Pools& pools = is_draft ? *draft : target;
    (is_draft ? ob.draft_modes : ob.target_modes)[b.mode]++;
    EXPECT_EQ(expect_draft_extend, is_draft && b.mode == ForwardMode::DRAFT_EXTEND)
        << "step " << step.index;
    StepLayout layout;
    ASSERT_NO_THROW(layout = make_step_layout(b)) << "step " << step.index;
    ASSERT_EQ(step.requests.size(), static_cast<size_t>(b.batch_size));

    // Live tokens of every admitted request and every cached prefix: no new slot may be one.
    std::set<int64_t> live = prefix_slots[is_draft];
    int running = 0;
    for (const RequestState& r : s.requests()) {
      const int row = is_draft ? r.draft_row : r.target_row;
      if (row < 0) continue;
      ++running;
      const int len = is_draft ? r.draft_kv_len : r.kv_len;
      for (int pos = 0; pos < len; ++pos) live.insert(pools.rows.get(row, pos));
      for (int pos = 0; pos < r.cached_prefix_len; ++pos)
        prefix_slots[is_draft].insert(pools.rows.get(row, pos));
    }
    ob.max_running = std::max(ob.max_running, running);
    EXPECT_LE(running, max_running);
    std::set<int64_t> fresh;
    for (int i = 0; i < b.batch_size; ++i) {
      const RequestState& r = s.requests()[step.requests[i]];
      const TraceRequest& tr = trace.requests[step.requests[i]];
      EXPECT_EQ(b.req_pool_indices[i], is_draft ? r.draft_row : r.target_row);
      const int committed = is_draft ? r.draft_kv_len : r.kv_len;
      EXPECT_EQ(layout.prefix_lens[i], committed) << "step " << step.index << " row " << i;
      for (int t = 0; t < layout.query_lens[i]; ++t) {
        const int64_t slot = b.out_cache_loc[layout.query_start[i] + t];
        const int pos = layout.prefix_lens[i] + t;
        EXPECT_EQ(pools.rows.get(static_cast<int>(b.req_pool_indices[i]), pos), slot);
        EXPECT_EQ(slot % P, pos % P) << "page invariant, step " << step.index;
        EXPECT_EQ(live.count(slot), 0u)
            << "slot " << slot << " handed out while live, step " << step.index;
        EXPECT_TRUE(fresh.insert(slot).second)
            << "slot " << slot << " twice in step " << step.index;
      }
      if (!is_draft && is_extend_without_speculative(b.mode) && r.phase == Phase::prefill) {
        if (layout.prefix_lens[i] > 0 && layout.prefix_lens[i] == r.cached_prefix_len) {
          ++ob.shared_prefix_starts;
        } else if (layout.prefix_lens[i] > 0) {
          ++ob.continuation_chunks;
        }
        EXPECT_LE(layout.prefix_lens[i] + layout.query_lens[i], tr.prompt_len);
      }
      if (b.mode == ForwardMode::DRAFT_EXTEND) {
        EXPECT_EQ(layout.query_lens[i], accepted_of.at(step.requests[i]) + 1);
      }
      if (b.mode == ForwardMode::TARGET_VERIFY) {
        EXPECT_EQ(layout.query_lens[i], s.config().spec.num_draft_tokens);
      }
    }
    int tokens = 0;
    for (int q : layout.query_lens) tokens += q;
    if (is_extend_without_speculative(b.mode) && !is_draft) {
      EXPECT_LE(tokens, std::max(s.config().chunked_prefill_size, b.batch_size));
    }

    // What the step's requests looked like before it is committed.
    std::vector<RequestState> before;
    for (int idx : step.requests) before.push_back(s.requests()[idx]);
    const ForwardMode mode = b.mode;
    std::vector<int> reqs = step.requests;
    std::optional<SpecInfo> spec = b.spec_info;
    s.complete();

    expect_draft_extend = false;
    if (mode == ForwardMode::TARGET_VERIFY) {
      ++ob.verify_rounds;
      const int N = s.config().spec.num_draft_tokens;
      for (size_t i = 0; i < reqs.size(); ++i) {
        const RequestState& r = s.requests()[reqs[i]];
        const TraceRequest& tr = trace.requests[reqs[i]];
        ASSERT_FALSE(r.accept_lengths.empty());
        const int a = r.accept_lengths.back();
        EXPECT_GE(a, 0);
        EXPECT_LE(a, N - 1);
        EXPECT_EQ(r.kv_len, before[i].kv_len + a + 1);
        EXPECT_EQ(r.generated, before[i].generated + a + 1);
        EXPECT_LE(r.generated, tr.output_len);
        const std::vector<int>& path = s.last_accepted_paths()[i];
        ASSERT_EQ(path.size(), static_cast<size_t>(a + 1));
        EXPECT_EQ(path[0], 0);
        for (size_t j = 1; j < path.size(); ++j) {
          EXPECT_EQ(spec->parents[i * N + path[j]], path[j - 1])
              << "accepted path is not a tree path";
        }
        accepted_of[reqs[i]] = a;
        if (r.phase != Phase::finished) expect_draft_extend = true;
      }
    }
    for (size_t i = 0; i < reqs.size(); ++i) {
      const RequestState& r = s.requests()[reqs[i]];
      const TraceRequest& tr = trace.requests[reqs[i]];
      if (r.phase == Phase::decode || r.phase == Phase::finished) {
        // The last generated token is never in the cache.
        EXPECT_EQ(r.kv_len, tr.prompt_len + r.generated - 1) << tr.id;
      }
      if (is_draft) EXPECT_EQ(r.draft_kv_len, r.kv_len) << tr.id;
    }
  }
}

Observed drive(Scheduler& s, Pools& target, Pools* draft, int max_running) {
  Observed ob;
  drive_into(s, target, draft, max_running, ob);
  return ob;
}

void expect_all_finished(const Scheduler& s) {
  for (const RequestState& r : s.requests()) {
    const TraceRequest& tr = s.trace().requests[r.trace_index];
    EXPECT_EQ(r.phase, Phase::finished) << tr.id;
    EXPECT_EQ(r.generated, tr.output_len) << tr.id;
    EXPECT_EQ(r.kv_len, tr.prompt_len + tr.output_len - 1) << tr.id;
    EXPECT_GE(r.admitted_iteration, tr.arrival_step) << tr.id;
    EXPECT_GE(r.finished_iteration, r.admitted_iteration) << tr.id;
  }
}

void expect_pools_clean(Scheduler& s, ModelRole role) {
  const PoolReport rep = s.finish_and_check_pools(role);
  EXPECT_TRUE(rep.ok) << rep.detail;
  EXPECT_EQ(rep.rows_in_use, 0);
  EXPECT_EQ(rep.free_slots + rep.prefix_slots, rep.total_slots);
  EXPECT_EQ(rep.free_after_release, rep.total_slots);
}

class SimSchedulerBuiltin : public ::testing::TestWithParam<int> {};

TEST_P(SimSchedulerBuiltin, EveryRequestCompletesEveryModeOccursNoLeak) {
  const int page = GetParam();
  SchedulerConfig cfg;
  cfg.page_size = page;
  cfg.max_running_requests = 16;
  cfg.chunked_prefill_size = 128;
  Pools pools(16, 4096, 8192, page);
  Scheduler s(builtin_trace(), cfg, pools.space());
  const Observed ob = drive(s, pools, nullptr, cfg.max_running_requests);
  expect_all_finished(s);
  for (ForwardMode m :
       {ForwardMode::EXTEND, ForwardMode::DECODE, ForwardMode::MIXED, ForwardMode::IDLE}) {
    EXPECT_GT(ob.target_modes.count(m), 0u) << forward_mode_name(m);
  }
  EXPECT_GT(ob.continuation_chunks, 0);   // chunked prefill continues with a cached prefix
  EXPECT_GT(ob.shared_prefix_starts, 0);  // shared system prompts come from the cache
  const PoolReport rep = s.finish_and_check_pools(ModelRole::target);
  EXPECT_TRUE(rep.ok) << rep.detail;
  // sys-a (96 tokens) and sys-b (48) in whole pages; a prefix shorter than a page is not cached.
  EXPECT_EQ(rep.prefixes, (96 >= page) + (48 >= page));
  EXPECT_EQ(rep.prefix_slots, 96 / page * page + 48 / page * page);
  EXPECT_EQ(rep.free_after_release, rep.total_slots);
}

INSTANTIATE_TEST_SUITE_P(PageSizes, SimSchedulerBuiltin, ::testing::Values(1, 16, 64));

TEST(SimScheduler, WithoutMixedChunkPrefillAndDecodeAlternate) {
  SchedulerConfig cfg;
  cfg.mixed_chunk = false;
  Pools pools(16, 4096, 8192, 1);
  Scheduler s(builtin_trace(), cfg, pools.space());
  const Observed ob = drive(s, pools, nullptr, cfg.max_running_requests);
  expect_all_finished(s);
  EXPECT_EQ(ob.target_modes.count(ForwardMode::MIXED), 0u);
  EXPECT_GT(ob.target_modes.count(ForwardMode::EXTEND), 0u);
  EXPECT_GT(ob.target_modes.count(ForwardMode::DECODE), 0u);
  expect_pools_clean(s, ModelRole::target);
}

Trace random_trace(std::mt19937& rng, int n) {
  std::string text;
  std::uniform_int_distribution<int> prompt(1, 200), output(1, 30), gap(0, 4), kind(0, 3);
  int arrival = 0;
  for (int i = 0; i < n; ++i) {
    arrival += gap(rng);
    const int k = kind(rng);
    int p = prompt(rng);
    std::string extra;
    if (k == 1 || k == 2) {
      const int len = k == 1 ? 40 : 17;
      p = std::max(p, len + 1);
      extra = fmt::format(", \"shared_prefix\": \"p{}\", \"shared_prefix_len\": {}", k, len);
    }
    text += fmt::format("{{\"arrival_step\": {}, \"prompt_len\": {}, \"output_len\": {}{}}}\n",
                        arrival, p, output(rng), extra);
  }
  return parse_trace(text, "random");
}

TEST(SimScheduler, RandomTracesKeepInvariants) {
  for (int seed = 0; seed < 12; ++seed) {
    SCOPED_TRACE(fmt::format("seed {}", seed));
    std::mt19937 rng(seed);
    const int page = std::array<int, 4>{1, 2, 4, 16}[seed % 4];
    SchedulerConfig cfg;
    cfg.page_size = page;
    cfg.max_running_requests = 1 + seed % 6;
    cfg.chunked_prefill_size = std::array<int, 3>{7, 32, 100}[seed % 3];
    cfg.mixed_chunk = seed % 2 == 0;
    // Small pools so that admission has to wait for memory.
    Pools pools(cfg.max_running_requests, 512, 600, page);
    Scheduler s(random_trace(rng, 25), cfg, pools.space());
    drive(s, pools, nullptr, cfg.max_running_requests);
    expect_all_finished(s);
    expect_pools_clean(s, ModelRole::target);
  }
}

TEST(SimScheduler, RejectsRequestsThatCanNeverFit) {
  SchedulerConfig cfg;
  Pools pools(4, 1024, 100, 1);
  const Trace t = parse_trace("{\"id\": \"big\", \"prompt_len\": 90, \"output_len\": 20}", "x");
  expect_error([&] { Scheduler(t, cfg, pools.space()); },
               {"'big'", "needs up to 109 KV slots", "has 100", "--max-total-tokens"});
  Pools narrow(4, 64, 1000, 1);
  expect_error([&] { Scheduler(t, cfg, narrow.space()); },
               {"'big'", "109 tokens", "context of 64"});
  cfg.page_size = 4;
  expect_error([&] { Scheduler(t, cfg, narrow.space()); },
               {"page size 4", "allocator's page size 1"});
}

TEST(SimScheduler, IdleUntilTheFirstArrival) {
  SchedulerConfig cfg;
  Pools pools(4, 256, 256, 1);
  Scheduler s(parse_trace("{\"arrival_step\": 3, \"prompt_len\": 10, \"output_len\": 2}", "x"), cfg,
              pools.space());
  std::vector<ForwardMode> modes;
  std::vector<int> iterations, indices;
  while (!s.done()) {
    const ScheduledStep& step = s.next();
    modes.push_back(step.batch.mode);
    iterations.push_back(step.iterations);
    indices.push_back(step.index);
    s.complete();
  }
  // Nothing runs and nothing waits before iteration 3: one IDLE step stands for all three.
  EXPECT_EQ(modes, (std::vector<ForwardMode>{ForwardMode::IDLE, ForwardMode::EXTEND,
                                             ForwardMode::DECODE}));
  EXPECT_EQ(iterations, (std::vector<int>{3, 1, 1}));
  EXPECT_EQ(indices, (std::vector<int>{0, 3, 4}));
  EXPECT_EQ(s.iteration(), 5);
  EXPECT_EQ(s.steps_planned(), 5);
  expect_error([&] { s.next(); }, {"after every request finished"});
}

// ---------------------------------------------------------------------------------------------
// Speculative decoding

struct SpecCase {
  int steps, topk, draft_tokens, page;
};

class SimSpec : public ::testing::TestWithParam<SpecCase> {};

TEST_P(SimSpec, VerifyAndDraftExtendRoundsRespectAcceptedLengths) {
  const SpecCase sc = GetParam();
  SchedulerConfig cfg;
  cfg.page_size = sc.page;
  cfg.spec.num_steps = sc.steps;
  cfg.spec.topk = sc.topk;
  cfg.spec.num_draft_tokens = sc.draft_tokens;
  cfg.seed = 7;
  Pools target(16, 4096, 8192, sc.page), draft(16, 4096, 8192, sc.page);
  Scheduler s(builtin_trace(), cfg, target.space(), draft.space());
  Observed ob = drive(s, target, &draft, cfg.max_running_requests);
  expect_all_finished(s);
  EXPECT_GT(ob.target_modes[ForwardMode::TARGET_VERIFY], 0);
  EXPECT_GT(ob.draft_modes[ForwardMode::DRAFT_EXTEND], 0);
  EXPECT_GT(ob.draft_modes[ForwardMode::EXTEND], 0);  // the draft model's own prefill
  EXPECT_EQ(ob.target_modes.count(ForwardMode::MIXED), 0u);
  EXPECT_EQ(ob.target_modes.count(ForwardMode::DECODE), 0u);
  // Acceptance is random but not degenerate: some rounds accept drafts, some reject all.
  int accepted = 0, rejected_all = 0;
  for (const RequestState& r : s.requests()) {
    for (int a : r.accept_lengths) (a > 0 ? accepted : rejected_all)++;
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected_all, 0);
  expect_pools_clean(s, ModelRole::target);
  expect_pools_clean(s, ModelRole::draft);
}

INSTANTIATE_TEST_SUITE_P(ChainsAndTrees, SimSpec,
                         ::testing::Values(SpecCase{3, 1, 4, 1}, SpecCase{3, 1, 4, 16},
                                           SpecCase{3, 2, 6, 1}, SpecCase{4, 3, 8, 4}));

// With a real host KV cache, the rows of an accepted tree path end at consecutive positions:
// position seq_len + j holds what block token path[j] stored.
TEST(SimSpec, AcceptedTreePathRowsAreMovedToConsecutivePositions) {
  const ModelSpec model =
      test::make_model("one-layer", DType::f32, 2048, {test::attention_layer(0, 2, 1, 8)});
  KVCacheConfig kc;
  kc.full_slots = 4096;
  kc.page_size = 4;
  kc.dtype = DType::f32;
  KVStorage storage = make_host_kv_storage(model, kc);
  KVStorage draft_storage = make_host_kv_storage(model, kc);
  ReqToTokenPool rows(8, 2048), draft_rows(8, 2048);

  SchedulerConfig cfg;
  cfg.page_size = 4;
  cfg.max_running_requests = 8;
  cfg.spec.num_steps = 3;
  cfg.spec.topk = 3;
  cfg.spec.num_draft_tokens = 7;
  cfg.spec.accept_prob = 0.9;
  Scheduler s(
      parse_trace(
          "{\"prompt_len\": 13, \"output_len\": 40}\n{\"prompt_len\": 6, \"output_len\": 30}\n"
          "{\"arrival_step\": 2, \"prompt_len\": 21, \"output_len\": 35}",
          "x"),
      cfg, KvSpace{&rows, storage.allocator.get(), storage.cache.get(), {0}},
      KvSpace{&draft_rows, draft_storage.allocator.get(), draft_storage.cache.get(), {0}});
  const KVLayerView view = storage.cache->layer(0);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> val(-1.f, 1.f);
  auto k_row = [&](int64_t slot) { return static_cast<float*>(view.k) + slot * view.k_row_stride; };
  auto v_row = [&](int64_t slot) { return static_cast<float*>(view.v) + slot * view.v_row_stride; };
  int moved_paths = 0;
  while (!s.done()) {
    const ScheduledStep& step = s.next();
    if (step.batch.mode != ForwardMode::TARGET_VERIFY) {
      s.complete();
      continue;
    }
    // Stand-in for the forward pass: each block token stores distinct K/V.
    const int N = cfg.spec.num_draft_tokens;
    std::vector<std::vector<float>> k_of(step.batch.out_cache_loc.size()), v_of(k_of.size());
    for (size_t t = 0; t < k_of.size(); ++t) {
      const int64_t slot = step.batch.out_cache_loc[t];
      for (int d = 0; d < 8; ++d) k_row(slot)[d] = val(rng), v_row(slot)[d] = val(rng);
      k_of[t].assign(k_row(slot), k_row(slot) + 8);
      v_of[t].assign(v_row(slot), v_row(slot) + 8);
    }
    std::vector<int> base;
    for (int idx : step.requests) base.push_back(s.requests()[idx].kv_len);
    const std::vector<int> reqs = step.requests;
    s.complete();
    for (size_t i = 0; i < reqs.size(); ++i) {
      const RequestState& r = s.requests()[reqs[i]];
      if (r.phase == Phase::finished) continue;  // its rows are free again
      const std::vector<int>& path = s.last_accepted_paths()[i];
      bool skipped_sibling = false;
      for (size_t j = 0; j < path.size(); ++j) {
        skipped_sibling |= path[j] != static_cast<int>(j);
        const int64_t slot = rows.get(r.target_row, base[i] + static_cast<int>(j));
        const size_t t = i * N + path[j];
        EXPECT_TRUE(std::equal(k_of[t].begin(), k_of[t].end(), k_row(slot))) << "K, position " << j;
        EXPECT_TRUE(std::equal(v_of[t].begin(), v_of[t].end(), v_row(slot))) << "V, position " << j;
      }
      moved_paths += skipped_sibling;
    }
  }
  EXPECT_GT(moved_paths, 0);  // some accepted paths went through a later sibling
  expect_pools_clean(s, ModelRole::target);
  expect_pools_clean(s, ModelRole::draft);
}

TEST(SimSpec, BadSpeculativeSettingsAreRejected) {
  Pools target(4, 256, 256, 1), draft(4, 256, 256, 1);
  const Trace t = parse_trace("{\"prompt_len\": 10, \"output_len\": 5}", "x");
  SchedulerConfig cfg;
  cfg.spec.num_steps = 3;
  cfg.spec.topk = 1;
  cfg.spec.num_draft_tokens = 6;
  expect_error([&] { Scheduler(t, cfg, target.space(), draft.space()); },
               {"--speculative-num-draft-tokens = 6", "num_steps + 1 = 4"});
  cfg.spec.topk = 2;
  cfg.spec.num_draft_tokens = 20;
  expect_error([&] { Scheduler(t, cfg, target.space(), draft.space()); }, {"at most 15 tokens"});
  cfg.spec.num_draft_tokens = 4;
  expect_error([&] { Scheduler(t, cfg, target.space()); }, {"draft model's pools"});

  Options o;
  o.speculative_eagle_topk = 2;
  expect_error([&] { complete_spec_options(o); }, {"without --speculative-num-steps"});
  o.speculative_num_steps = 3;
  expect_error([&] { complete_spec_options(o); }, {"--speculative-num-draft-tokens"});
  o.speculative_eagle_topk = 0;
  const Options filled = complete_spec_options(o);
  EXPECT_EQ(filled.speculative_eagle_topk, 1);
  EXPECT_EQ(filled.speculative_num_draft_tokens, 4);
}

}  // namespace
}  // namespace attnrt::sim

namespace attnrt::sim {
namespace {

// ---------------------------------------------------------------------------------------------
// The step driver on real runtimes: every step computed by the backend under test, a sample
// recomputed on reference; here the backend is reference itself, so any difference would be a
// driver fault (re-storing k/v, wrong batch, unwritten outputs), and the pools are checked too.

using attnrt::test::find_mode;

Trace small_trace() { return attnrt::test::four_request_trace("small"); }

RunConfig small_config() { return attnrt::test::small_run_config(1024, 3, 11); }

TEST(SimDriver, RunsEveryModeOnReferenceWithoutErrorOrLeak) {
  Options o;
  o.attention_backend = "reference";
  const Trace trace = small_trace();
  int progress_calls = 0;
  int64_t last_done = 0;
  const RunReport r =
      run_trace(model_preset("demo"), o, trace, small_config(), [&](const Progress& p) {
        ++progress_calls;
        EXPECT_EQ(p.steps_done, last_done + 1);
        EXPECT_GE(p.steps_estimate, p.steps_done);
        last_done = p.steps_done;
      });
  EXPECT_TRUE(r.ok()) << format_report(r);
  EXPECT_EQ(r.failure_count, 0);
  EXPECT_TRUE(r.target_pool.ok) << r.target_pool.detail;
  EXPECT_FALSE(r.draft_pool.has_value());
  for (ForwardMode m :
       {ForwardMode::EXTEND, ForwardMode::DECODE, ForwardMode::MIXED, ForwardMode::IDLE}) {
    const ModeStats* s = find_mode(r, ModelRole::target, m);
    ASSERT_NE(s, nullptr) << forward_mode_name(m);
    EXPECT_EQ(s->backend, "reference");
    if (m != ForwardMode::IDLE) EXPECT_GT(s->checked_steps, 0) << forward_mode_name(m);
  }
  const ModeStats total = r.totals();
  EXPECT_EQ(progress_calls, total.steps);
  // Every prompt token except the cached shared prefix (32 tokens reused by "c") is computed once,
  // and every output token but the one the prefill samples is decoded once.
  EXPECT_EQ(total.tokens, trace.total_prompt_tokens() - 32 + trace.total_output_tokens() -
                              static_cast<int64_t>(trace.requests.size()));
  EXPECT_EQ(r.target_pool.prefixes, 1);
  EXPECT_EQ(r.target_pool.prefix_slots, 32);

  const nlohmann::json j = report_to_json(r);
  EXPECT_TRUE(j["ok"].get<bool>());
  EXPECT_EQ(j["modes"].size(), r.modes.size());
  EXPECT_EQ(j["total"]["tokens"].get<int64_t>(), total.tokens);
  EXPECT_TRUE(j["pool_check"]["target"]["ok"].get<bool>());
  const std::string text = format_report(r);
  for (const char* part :
       {"EXTEND", "DECODE", "MIXED", "IDLE", "total", "pool check (target): ok"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << " missing from\n" << text;
  }
}

// deepseek-v3 (one layer, 128 heads) with every extend of a prefix in the MHA form and its prefix
// in many chunks: the cpu backend's MHA layers, checked against reference in the absorbed form.
TEST(SimDriver, DeepseekExtendsRunTheMhaFormWithPrefixChunks) {
  Options o;
  o.attention_backend = "cpu";
  o.num_threads = 2;
  o.chunked_prefix_cache_threshold = 1;
  o.max_chunk_capacity = 64;
  RunConfig rc = small_config();
  rc.layers = 1;
  rc.check_every = 1;
  const RunReport r = run_trace(model_preset("deepseek-v3"), o, small_trace(), rc);
  EXPECT_TRUE(r.ok()) << format_report(r);
  EXPECT_EQ(r.failure_count, 0) << format_report(r);
  int64_t mha = 0, chunks = 0;
  for (ForwardMode m : {ForwardMode::EXTEND, ForwardMode::MIXED}) {
    if (const ModeStats* s = find_mode(r, ModelRole::target, m)) {
      mha += s->mha_layers;
      chunks += s->prefix_chunks;
      EXPECT_GT(s->checked_steps, 0);
    }
  }
  EXPECT_GT(mha, 0);
  EXPECT_GT(chunks, mha);  // prefixes of more than 64 / 4 tokens take several chunks
  const ModeStats* decode = find_mode(r, ModelRole::target, ForwardMode::DECODE);
  ASSERT_NE(decode, nullptr);
  EXPECT_EQ(decode->mha_layers, 0);  // decode is always absorbed
  EXPECT_NE(format_report(r).find("MLA in the MHA form"), std::string::npos) << format_report(r);
}

// deepseek-v3.2 (DSA, docs/dsa.md): two layers on the cpu backend, every step with fresh random
// indexer inputs (index q, index k, weights), every step checked against reference (which
// recomputes the selection); without and with speculative decoding (a chain and a tree). Steps of a
// DSA model always run absorbed: no layer takes the MHA form. With the preset's index_topk (2048)
// every key of these short requests is selected; with index_topk 8 the selection is real.
TEST(SimDriver, DsaModelRunsOnCpuWithIndexerInputsAndPassesItsChecks) {
  for (const int index_topk : {0, 8}) {
    ModelSpec model = model_preset("deepseek-v3.2");
    if (index_topk > 0) {
      for (LayerSpec& l : model.layers) l.indexer.index_topk = index_topk;
    }
    for (const int topk : {0, 1, 2}) {
      if (index_topk == 0 && topk == 2) continue;  // the tree: with the real selection only
      SCOPED_TRACE(fmt::format("index_topk {}, speculative topk {}", index_topk, topk));
      Options o = topk > 0 ? attnrt::test::speculative_options("cpu", topk) : Options{};
      o.attention_backend = "cpu";
      o.num_threads = 2;
      RunConfig rc = small_config();
      rc.layers = 2;
      rc.check_every = 1;
      const RunReport r = run_trace(model, o, small_trace(), rc);
      EXPECT_TRUE(r.ok()) << format_report(r);
      EXPECT_EQ(r.failure_count, 0) << format_report(r);
      EXPECT_TRUE(r.target_pool.ok) << r.target_pool.detail;
      if (topk > 0) {
        ASSERT_TRUE(r.draft_pool.has_value());
        EXPECT_TRUE(r.draft_pool->ok) << r.draft_pool->detail;
        EXPECT_GT(r.verify_rounds, 0);
      }
      int64_t checked = 0;
      for (const ModeStats& m : r.modes) {
        EXPECT_EQ(m.mha_layers, 0) << forward_mode_name(m.mode);
        EXPECT_EQ(m.backend, "cpu") << forward_mode_name(m.mode);
        if (m.mode != ForwardMode::IDLE) EXPECT_GT(m.checked_steps, 0) << forward_mode_name(m.mode);
        checked += m.checked_rows;
      }
      EXPECT_GT(checked, 0);
      const ModeStats* verify = find_mode(r, ModelRole::target, ForwardMode::TARGET_VERIFY);
      EXPECT_EQ(verify != nullptr, topk > 0);
    }
  }
}

// --dump-step of a DSA model (deepseek-v3.2 with index_topk 8, so requests of more keys select)
// writes the indexer's inputs, the index-key cache rows the step reads and the recorded selection;
// replaying the case on cpu reproduces the recorded selection and output, reference selects the
// same keys, and the replay really reads the recorded index keys (scaled to zero, every score
// ties and the selection changes).
TEST(SimDriver, DsaStepDumpCarriesTheIndexerAndReplaysOnReferenceAndCpu) {
  ModelSpec model = model_preset("deepseek-v3.2");
  for (LayerSpec& l : model.layers) l.indexer.index_topk = 8;
  Options o;
  o.attention_backend = "cpu";
  o.num_threads = 2;
  RunConfig rc = small_config();
  rc.layers = 2;
  rc.dump_step = 4;
  rc.dump_dir = (std::filesystem::path(::testing::TempDir()) / "attnrt-dsa-case").string();
  std::filesystem::remove_all(rc.dump_dir);
  const RunReport r = run_trace(model, o, small_trace(), rc);
  ASSERT_TRUE(r.ok()) << format_report(r);
  ASSERT_FALSE(r.dump_written.empty()) << r.dump_error;

  const Case c = read_case(rc.dump_dir);
  ASSERT_TRUE(c.layer.has_indexer());
  EXPECT_EQ(c.layer.indexer.index_topk, 8);
  ASSERT_TRUE(c.indexer.has_value());
  ASSERT_TRUE(c.indexer->expected_topk.has_value());
  const int64_t t = c.num_tokens(), k = 8;
  EXPECT_EQ(c.indexer->q.shape, (std::vector<int64_t>{t, 64, 128}));
  EXPECT_EQ(c.indexer->weights.shape, (std::vector<int64_t>{t, 64}));
  EXPECT_EQ(c.indexer->key_codes.shape,
            (std::vector<int64_t>{static_cast<int64_t>(c.kv_slots.size()), 128}));
  // The selection is real: some token had more candidates than it keeps.
  const int32_t* recorded = c.indexer->expected_topk->as<int32_t>();
  int full_rows = 0;
  for (int64_t i = 0; i < t; ++i) full_rows += recorded[i * k + k - 1] >= 0;
  int max_kv = 0;
  for (const auto& row : c.req_to_token) max_kv = std::max<int>(max_kv, row.size());
  EXPECT_GT(max_kv, 2 * k);
  EXPECT_GT(full_rows, 0);

  auto same_selection = [&](const HostBuffer& topk) {
    return std::equal(recorded, recorded + t * k, topk.ptr<int32_t>());
  };
  const ReplayResult cpu = replay_case(c, "cpu");
  EXPECT_TRUE(same_selection(cpu.topk));
  ASSERT_TRUE(c.expected_out.has_value());
  const float* want = c.expected_out->as<float>();
  for (int64_t i = 0; i < cpu.out.numel(); ++i) {
    ASSERT_EQ(load_as_float(cpu.out.data(), cpu.out.dtype(), static_cast<size_t>(i)), want[i])
        << "cpu replays its own step bit for bit, value " << i;
  }
  const ReplayResult ref = replay_case(c, "reference");
  EXPECT_TRUE(same_selection(ref.topk));
  double worst = 0;
  for (int64_t i = 0; i < ref.out.numel(); ++i) {
    const double a = load_as_float(ref.out.data(), ref.out.dtype(), static_cast<size_t>(i));
    worst = std::max(worst, std::fabs(a - want[i]) / (0.02 + 0.02 * std::fabs(a)));
  }
  EXPECT_LE(worst, 1.0) << "reference against the recorded cpu output";

  Case zeroed = c;
  std::fill(zeroed.indexer->key_scales.bytes.begin(), zeroed.indexer->key_scales.bytes.end(), 0);
  EXPECT_FALSE(same_selection(replay_case(zeroed, "cpu").topk))
      << "with every index score 0 the lowest token indices are selected instead";
}

// An SWA-hybrid model (gemma3's first six layers: five sliding-window, one full) runs with its
// sliding-window layers in a pool of --swa-full-tokens-ratio x the full slots, and says so.
TEST(SimDriver, SwaHybridModelRunsWithItsSwaPoolRatio) {
  Options o;
  o.attention_backend = "reference";
  RunConfig rc = small_config();
  rc.layers = 6;
  rc.swa_full_tokens_ratio = 0.5;
  const RunReport r = run_trace(model_preset("gemma3-12b"), o, small_trace(), rc);
  EXPECT_TRUE(r.ok()) << format_report(r);
  EXPECT_TRUE(r.target_pool.ok) << r.target_pool.detail;
  EXPECT_EQ(r.swa_ratio, 0.5);
  EXPECT_NE(format_report(r).find("SWA pool 0.5 x the full slots"), std::string::npos)
      << format_report(r);
  EXPECT_EQ(report_to_json(r)["swa_full_tokens_ratio"].get<double>(), 0.5);
  // A model without sliding-window layers reports none.
  RunConfig two_layers = small_config();
  two_layers.layers = 2;
  const RunReport plain = run_trace(model_preset("llama3-8b"), o, small_trace(), two_layers);
  EXPECT_TRUE(plain.ok()) << format_report(plain);
  EXPECT_EQ(plain.swa_ratio, 0);
  EXPECT_TRUE(report_to_json(plain)["swa_full_tokens_ratio"].is_null());
}

// On the CPU a model whose attention layers are too costly together runs its first layers by
// default (a note says which, and how to run them all), its checks compare a sample of rows;
// --layers 0 runs every layer, and the dense presets stay whole.
TEST(SimDriver, HugeModelsRunTheirFirstLayersOnTheCpuByDefault) {
  EXPECT_EQ(default_cpu_layers(model_preset("deepseek-v3")), 4u);
  for (const char* name : {"demo", "llama3-8b", "qwen2.5-7b", "mistral-7b", "gemma3-12b"}) {
    const ModelSpec m = model_preset(name);
    EXPECT_EQ(default_cpu_layers(m), m.layers.size()) << name;
  }
  ModelSpec wide = model_preset("deepseek-v3");
  wide.layers.resize(10);
  Options o;
  o.attention_backend = "cpu";
  RunConfig rc = small_config();
  rc.check_every = 1;
  const Trace one = attnrt::test::one_request_trace();
  const RunReport cut = run_trace(wide, o, one, rc);
  EXPECT_TRUE(cut.ok()) << format_report(cut);
  ASSERT_FALSE(cut.notes.empty());
  EXPECT_NE(cut.notes[0].find("ran layers 0..3 of 10 (4 mla)"), std::string::npos) << cut.notes[0];
  EXPECT_NE(cut.notes[0].find("--layers 0 runs them all"), std::string::npos) << cut.notes[0];
  // 16 of 128 heads of every token.
  EXPECT_EQ(cut.totals().checked_rows * 8, cut.totals().checkable_rows);
  EXPECT_NE(format_report(cut).find("reference checks: "), std::string::npos);
  rc.layers = 0;
  rc.check_every = 0;
  const RunReport all = run_trace(wide, o, one, rc);
  EXPECT_TRUE(all.ok()) << format_report(all);
  for (const std::string& n : all.notes) EXPECT_EQ(n.find("ran layers"), std::string::npos) << n;
}

TEST(SimDriver, SpeculativeChainAndTreeRunVerifyAndDraftExtend) {
  for (int topk : {1, 2}) {
    SCOPED_TRACE(fmt::format("topk {}", topk));
    const Options o = attnrt::test::speculative_options("reference", topk);
    RunConfig rc = small_config();
    rc.scheduler.spec.accept_prob = 0.8;
    const RunReport r = run_trace(model_preset("demo"), o, small_trace(), rc);
    EXPECT_TRUE(r.ok()) << format_report(r);
    ASSERT_TRUE(r.draft_pool.has_value());
    EXPECT_TRUE(r.draft_pool->ok) << r.draft_pool->detail;
    ASSERT_NE(find_mode(r, ModelRole::target, ForwardMode::TARGET_VERIFY), nullptr);
    ASSERT_NE(find_mode(r, ModelRole::draft, ForwardMode::DRAFT_EXTEND), nullptr);
    ASSERT_NE(find_mode(r, ModelRole::draft, ForwardMode::EXTEND), nullptr);
    EXPECT_GT(find_mode(r, ModelRole::target, ForwardMode::TARGET_VERIFY)->checked_steps, 0);
    EXPECT_GT(find_mode(r, ModelRole::draft, ForwardMode::DRAFT_EXTEND)->checked_steps, 0);
    EXPECT_EQ(find_mode(r, ModelRole::target, ForwardMode::DECODE), nullptr);
    EXPECT_GT(r.verify_rounds, 0);
    EXPECT_GT(r.accepted_drafts, 0);
    // Each request-round keeps its accepted drafts and the bonus token: all outputs after the
    // first.
    const Trace t = small_trace();
    EXPECT_EQ(r.verify_rounds + r.accepted_drafts, t.total_output_tokens() - 4);
  }
}

TEST(SimDriver, RejectsWhatItCannotRun) {
  Options o;
  o.attention_backend = "reference";
  ModelSpec linear = model_preset("demo");
  linear.layers[1].kind = LayerKind::gdn;
  expect_error([&] { run_trace(linear, o, small_trace(), small_config()); }, {"layer 1", "gdn"});
  RunConfig rc = small_config();
  rc.check_every = -1;
  expect_error([&] { run_trace(model_preset("demo"), o, small_trace(), rc); },
               {"--check-every = -1"});
  rc = small_config();
  rc.max_total_tokens = 64;
  expect_error([&] { run_trace(model_preset("demo"), o, small_trace(), rc); }, {"'b'", "KV slots"});
  Options bad = o;
  bad.attention_backend = "no-such-backend";
  expect_error([&] { run_trace(model_preset("demo"), bad, small_trace(), small_config()); },
               {"no-such-backend"});
}

TEST(SimDriver, DraftModelIsTheFirstKvLayer) {
  const ModelSpec demo = model_preset("demo");
  const ModelSpec d = make_draft_model(demo);
  ASSERT_EQ(d.layers.size(), 1u);
  EXPECT_EQ(d.layers[0].layer_id, 0);
  EXPECT_EQ(d.layers[0].num_q_heads, demo.layers[0].num_q_heads);
  EXPECT_EQ(d.dtype, demo.dtype);
  EXPECT_NO_THROW(d.validate());
}

}  // namespace
}  // namespace attnrt::sim

namespace attnrt::sim {
namespace {

// A KV cache in memory the host cannot write: the scheduler must not touch its rows.
class DeviceOnlyCache final : public KVCache {
 public:
  KVLayerView layer(int layer_id) const override {
    ADD_FAILURE() << "the scheduler read layer " << layer_id << " of a device KV cache";
    return {};
  }
  void begin_step(const ForwardBatch&) override {}
  void store_step_kv(int, const TensorView&, const TensorView&) override {}
  Device device() const override { return Device::cuda(0); }
  DType dtype() const override { return DType::bf16; }
  int page_size() const override { return 1; }
};

// Chains never move rows (the accepted drafts already sit at consecutive positions); trees do, so a
// pool whose rows the scheduler cannot copy is rejected before the first step.
TEST(SimSpec, DevicePoolsWithoutRowCopiesRunChainsAndRejectTrees) {
  SchedulerConfig cfg;
  cfg.spec.num_steps = 3;
  cfg.spec.topk = 1;
  cfg.spec.num_draft_tokens = 4;
  cfg.spec.accept_prob = 0.9;
  DeviceOnlyCache cache;
  Pools target(16, 4096, 8192, 1), draft(16, 4096, 8192, 1);
  KvSpace space = target.space();
  space.kv_cache = &cache;
  space.kv_layers = {0};
  Scheduler s(builtin_trace(), cfg, space, draft.space());
  const Observed ob = drive(s, target, &draft, cfg.max_running_requests);
  expect_all_finished(s);
  EXPECT_GT(ob.verify_rounds, 0);
  expect_pools_clean(s, ModelRole::target);
  expect_pools_clean(s, ModelRole::draft);

  cfg.spec.topk = 3;
  cfg.spec.num_draft_tokens = 7;
  Pools tree(16, 4096, 8192, 1), tree_draft(16, 4096, 8192, 1);
  KvSpace tree_space = tree.space();
  tree_space.kv_cache = &cache;
  expect_error([&] { Scheduler(builtin_trace(), cfg, tree_space, tree_draft.space()); },
               {"--speculative-eagle-topk 3", "cuda", "no row copy"});
}

}  // namespace
}  // namespace attnrt::sim
