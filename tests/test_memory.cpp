// Pools and allocators (reference-semantics §4.1-§4.4): random alloc/free sequences checked against
// an independent model of what each request owns, exact round trips through the KV pools, and
// rejected calls that must leave everything as it was.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/page_allocator.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/memory/token_allocator.h"
#include "tests/test_util.h"

using namespace attnrt;

namespace {

using attnrt::test::expect_error;

// Everything observable about a PageAllocator's state.
struct AllocState {
  int64_t free_pages;
  std::vector<bool> in_use;
  bool operator==(const AllocState&) const = default;
};
AllocState state_of(const PageAllocator& a) {
  AllocState s{a.free_pages(), {}};
  for (int64_t p = 0; p <= a.num_pages(); ++p) s.in_use.push_back(a.page_in_use(p));
  return s;
}

// New pages a request takes, counted position by position (independent of ceil arithmetic).
int64_t pages_for(int64_t prefix, int64_t seq, int64_t P) {
  int64_t n = 0;
  for (int64_t pos = prefix; pos < seq; ++pos) n += pos % P == 0;
  return n;
}

// Checks what the live requests own against the allocator: every slot once, slot % P == pos % P,
// pages contiguous and owned by one request, and the in-use page count equal to the pages owned.
testing::AssertionResult check_ownership(const PageAllocator& a,
                                         const std::map<int, std::vector<int64_t>>& live) {
  const int64_t P = a.page_size();
  std::set<int64_t> slots;
  std::map<int64_t, int> owner;
  for (const auto& [id, toks] : live) {
    for (size_t pos = 0; pos < toks.size(); ++pos) {
      const int64_t s = toks[pos];
      if (s < P || s >= a.pool_rows())
        return testing::AssertionFailure() << "request " << id << " slot " << s << " out of range";
      if (s % P != static_cast<int64_t>(pos) % P)
        return testing::AssertionFailure() << "slot " << s << " at position " << pos;
      if (pos % P != 0 && s != toks[pos - 1] + 1)
        return testing::AssertionFailure() << "page not contiguous at position " << pos;
      if (!slots.insert(s).second)
        return testing::AssertionFailure() << "slot " << s << " handed out twice";
      auto [it, fresh] = owner.emplace(s / P, id);
      if (!fresh && it->second != id)
        return testing::AssertionFailure() << "page " << s / P << " shared by two requests";
      if (!a.page_in_use(s / P))
        return testing::AssertionFailure() << "owned page " << s / P << " marked free";
    }
  }
  if (static_cast<int64_t>(owner.size()) != a.num_pages() - a.free_pages())
    return testing::AssertionFailure()
           << owner.size() << " pages owned but " << a.num_pages() - a.free_pages() << " in use";
  return testing::AssertionSuccess();
}

// Drives a random workload: new requests, extensions of running ones, decode steps, frees, and
// requests that cannot fit. `alloc` must behave like PageAllocator for the full slots.
struct Workload {
  std::mt19937_64 rng;
  int64_t P;
  std::map<int, std::vector<int64_t>> live;
  int next_id = 0;

  Workload(uint64_t seed, int64_t page_size) : rng(seed), P(page_size) {}

  int64_t uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  }

  std::vector<int> pick_live(int max_n) {
    std::vector<int> ids;
    for (const auto& kv : live) ids.push_back(kv.first);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(std::min<size_t>(ids.size(), static_cast<size_t>(uniform(1, max_n))));
    return ids;
  }

  struct Extend {
    std::vector<int> ids;
    std::vector<int32_t> prefix, seq;
    std::vector<int64_t> last;
    int64_t pages = 0;
  };
  // Request `id` grown from `prefix` to `seq` tokens (its last slot `last`, -1: none yet).
  void add(Extend& e, int id, int32_t prefix, int32_t seq, int64_t last) const {
    e.ids.push_back(id);
    e.prefix.push_back(prefix);
    e.seq.push_back(seq);
    e.last.push_back(last);
    e.pages += pages_for(prefix, seq, P);
  }
  // Some new requests and some extensions of running ones; `oversize` asks for more pages than
  // free.
  Extend make_extend(int64_t free_pages, bool oversize) {
    Extend e;
    if (!live.empty() && uniform(0, 1)) {
      for (int id : pick_live(3)) {
        const auto& t = live[id];
        add(e, id, static_cast<int32_t>(t.size()),
            static_cast<int32_t>(t.size() + uniform(1, 2 * P)), t.back());
      }
    }
    for (int64_t n = uniform(e.ids.empty() ? 1 : 0, 2); n > 0; --n)
      add(e, next_id++, 0, static_cast<int32_t>(uniform(1, 3 * P)), -1);
    if (oversize) {
      const int64_t extra = (free_pages - e.pages + uniform(1, 3)) * P;
      if (extra > 0) add(e, next_id++, 0, static_cast<int32_t>(extra), -1);
    }
    return e;
  }
  // One more token for each of up to `max_n` running requests (a decode step).
  Extend make_decode(int max_n) {
    Extend d;
    for (int id : pick_live(max_n)) {
      const auto& t = live[id];
      add(d, id, static_cast<int32_t>(t.size()), static_cast<int32_t>(t.size() + 1), t.back());
    }
    return d;
  }
  void commit(const Extend& e, const std::vector<int64_t>& slots) {
    size_t k = 0;
    for (size_t i = 0; i < e.ids.size(); ++i) {
      auto& t = live[e.ids[i]];
      for (int32_t pos = e.prefix[i]; pos < e.seq[i]; ++pos) t.push_back(slots[k++]);
    }
    ASSERT_EQ(k, slots.size());
  }
};

class PageAllocatorProperty : public testing::TestWithParam<int> {};

TEST_P(PageAllocatorProperty, RandomSequencesKeepEverySlotOwnedOnceAndNothingLeaks) {
  const int P = GetParam();
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    Workload w(seed * 7919 + P, P);
    const int64_t pages = w.uniform(6, 40);
    PageAllocator a(pages * P + w.uniform(0, P - 1), P);  // a ragged size rounds down
    ASSERT_EQ(a.num_pages(), pages);
    ASSERT_EQ(a.pool_rows(), (pages + 1) * P);
    int exhausted = 0;
    for (int op = 0; op < 150; ++op) {
      const int64_t kind = w.uniform(0, 9);
      if (kind <= 4) {
        const bool oversize = w.uniform(0, 5) == 0;
        auto e = w.make_extend(a.free_pages(), oversize);
        if (e.pages > a.free_pages()) {
          const PageAllocator twin = a;
          const auto before = state_of(a);
          const int64_t tokens = std::accumulate(e.seq.begin(), e.seq.end(), int64_t{0}) -
                                 std::accumulate(e.prefix.begin(), e.prefix.end(), int64_t{0});
          expect_error([&] { a.alloc_extend(e.prefix, e.seq, e.last); },
                       {"out of KV cache", std::to_string(tokens) + " new slots",
                        std::to_string(a.available_size()) + " of", "larger KV pool"});
          ASSERT_EQ(state_of(a), before);
          ++exhausted;
          // The failed call left no trace: the same next call gives the same slots as a copy.
          if (a.free_pages() > 0) {
            std::vector<int32_t> p0{0}, s0{1};
            std::vector<int64_t> l0{-1};
            auto mine = a.alloc_extend(p0, s0, l0);
            auto theirs = PageAllocator(twin).alloc_extend(p0, s0, l0);
            ASSERT_EQ(mine, theirs);
            w.live[w.next_id++] = mine;
          }
        } else {
          const int64_t free_before = a.free_pages();
          auto slots = a.alloc_extend(e.prefix, e.seq, e.last);
          ASSERT_EQ(free_before - a.free_pages(), e.pages);
          w.commit(e, slots);
        }
      } else if (kind <= 7 && !w.live.empty()) {
        const Workload::Extend d = w.make_decode(4);
        if (d.pages > a.free_pages()) {
          const auto before = state_of(a);
          expect_error([&] { a.alloc_decode(d.seq, d.last); }, {"out of KV cache", "alloc_decode"});
          ASSERT_EQ(state_of(a), before);
          ++exhausted;
        } else {
          auto slots = a.alloc_decode(d.seq, d.last);
          ASSERT_EQ(slots.size(), d.ids.size());
          for (size_t i = 0; i < d.ids.size(); ++i) w.live[d.ids[i]].push_back(slots[i]);
        }
      } else if (!w.live.empty()) {
        const int id = w.pick_live(1)[0];
        auto slots = w.live[id];
        std::shuffle(slots.begin(), slots.end(), w.rng);
        const int64_t free_before = a.free_pages();
        a.free(slots);
        ASSERT_EQ(a.free_pages() - free_before,
                  pages_for(0, static_cast<int64_t>(slots.size()), P));
        w.live.erase(id);
        // Freeing the same slots again is a double free and changes nothing.
        const auto before = state_of(a);
        expect_error([&] { a.free(slots); }, {"not allocated"});
        ASSERT_EQ(state_of(a), before);
      }
      ASSERT_TRUE(check_ownership(a, w.live)) << "seed " << seed << " op " << op;
    }
    EXPECT_GT(exhausted, 0) << "the workload never hit exhaustion (seed " << seed << ")";
    for (const auto& [id, slots] : w.live) a.free(slots);
    EXPECT_EQ(a.free_pages(), a.num_pages());
    EXPECT_EQ(a.available_size(), a.num_pages() * P);
  }
}

INSTANTIATE_TEST_SUITE_P(PageSizes, PageAllocatorProperty, testing::Values(1, 2, 16, 64));

TEST(PageAllocator, ExtendFillsPartialPageThenWholePagesThenPartialPage) {
  PageAllocator a(16 * 4, 4);
  std::vector<int32_t> p{0}, s{6};
  std::vector<int64_t> l{-1};
  auto first = a.alloc_extend(p, s, l);
  EXPECT_EQ(first, (std::vector<int64_t>{4, 5, 6, 7, 8, 9}));
  // Prefix 6 ends at slot 9 (offset 1 of page 2): fill 10, 11, then page 3 whole, then one slot.
  p = {6};
  s = {13};
  l = {9};
  auto second = a.alloc_extend(p, s, l);
  EXPECT_EQ(second, (std::vector<int64_t>{10, 11, 12, 13, 14, 15, 16}));
  std::vector<int32_t> d{14};
  std::vector<int64_t> dl{16};
  EXPECT_EQ(a.alloc_decode(d, dl), (std::vector<int64_t>{17}));
}

TEST(PageAllocator, RejectsInconsistentLastLocationsWithoutChange) {
  const int P = 4;
  PageAllocator a(10 * P, P);
  std::vector<int32_t> p{0}, s{6};
  std::vector<int64_t> l{-1};
  auto slots = a.alloc_extend(p, s, l);  // slots 4..9, last = 9 at position 5
  const auto before = state_of(a);
  auto extend = [&](int32_t prefix, int32_t seq, int64_t last) {
    std::vector<int32_t> pp{prefix}, ss{seq};
    std::vector<int64_t> ll{last};
    a.alloc_extend(pp, ss, ll);
  };
  expect_error([&] { extend(6, 8, 10); }, {"last_locs[0] = 10", "does not fit a prefix of 6"});
  expect_error([&] { extend(6, 8, -1); }, {"ends inside a page", "last_loc -1"});
  expect_error([&] { extend(0, 3, 9); }, {"no prefix but last_loc 9"});
  expect_error([&] { extend(6, 8, 2); }, {"last_locs[0] = 2", "page 0 is reserved"});
  expect_error([&] { extend(2, 4, 29); }, {"page 7", "not allocated"});
  expect_error([&] { extend(7, 6, 9); }, {"prefix length 7", "sequence length 6"});
  {
    std::vector<int32_t> pp{6, 6}, ss{7, 7};
    std::vector<int64_t> ll{9, 9};
    expect_error([&] { a.alloc_extend(pp, ss, ll); }, {"requests 0 and 1 both continue page 2"});
    std::vector<int32_t> short_seq{7};
    expect_error([&] { a.alloc_extend(pp, short_seq, ll); }, {"2 prefix lengths, 1 sequence"});
  }
  std::vector<int32_t> zero{0};
  std::vector<int64_t> none{-1};
  expect_error([&] { a.alloc_decode(zero, none); }, {"seq_lens[0] = 0", ">= 1"});
  std::vector<int64_t> reserved{1};
  expect_error([&] { a.free(reserved); }, {"slots[0] = 1", "page 0 is reserved"});
  std::vector<int64_t> beyond{a.pool_rows()};
  expect_error([&] { a.free(beyond); }, {"not a usable slot"});
  EXPECT_EQ(state_of(a), before);
  a.free(slots);
  EXPECT_EQ(a.free_pages(), a.num_pages());
}

TEST(PageAllocator, RejectsSizesWithoutAWholePage) {
  expect_error([] { PageAllocator(15, 16); }, {"15 slots", "page of 16"});
  expect_error([] { PageAllocator(64, 0); }, {"page_size 0"});
}

TEST(ReqToTokenPool, RowsAllocateWriteAndFree) {
  ReqToTokenPool pool(3, 8);
  const int a = pool.alloc(), b = pool.alloc(), c = pool.alloc();
  EXPECT_EQ(std::set<int>({a, b, c}).size(), 3u);
  expect_error([&] { pool.alloc(); }, {"all 3 request rows are in use", "max_requests"});
  std::vector<int64_t> slots{5, 9, 11};
  pool.write(b, 2, slots);
  EXPECT_EQ(pool.get(b, 2), 5);
  EXPECT_EQ(pool.row_ptr(b)[4], 11);
  std::vector<int32_t> before(pool.data(), pool.data() + 3 * 8);
  std::vector<int64_t> bad{1, -4};
  expect_error([&] { pool.write(b, 0, bad); }, {"slots[1] = -4"});
  expect_error([&] { pool.write(b, 6, slots); }, {"[6, 9)", "max_context_len 8"});
  expect_error([&] { pool.write(7, 0, slots); }, {"row 7"});
  EXPECT_EQ(std::vector<int32_t>(pool.data(), pool.data() + 3 * 8), before);
  pool.free(b);
  EXPECT_FALSE(pool.is_allocated(b));
  expect_error([&] { pool.free(b); }, {"not allocated"});
  expect_error([&] { pool.write(b, 0, slots); }, {"not an allocated request row"});
  expect_error([&] { pool.free(-1); }, {"row -1"});
  EXPECT_EQ(pool.alloc(), b);
  EXPECT_EQ(pool.available(), 0);
}

LayerSpec attn_layer(int id, LayerKind kind, int kv_heads, int dim, int v_dim, int window = -1) {
  LayerSpec l;
  l.layer_id = id;
  l.kind = kind;
  l.num_q_heads = 2 * kv_heads;
  l.num_kv_heads = kv_heads;
  l.head_dim = dim;
  l.v_head_dim = v_dim;
  l.sliding_window = window;
  return l;
}

// A tensor of random values in `dtype` (magnitudes up to `range`).
HostBuffer random_tensor(std::mt19937_64& rng, DType dtype, std::initializer_list<int64_t> shape,
                         float range) {
  HostBuffer b(dtype, shape);
  std::uniform_real_distribution<float> u(-range, range);
  for (int64_t i = 0; i < b.numel(); ++i) store_from_float(b.data(), dtype, i, u(rng));
  return b;
}

uint64_t checksum(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull;
  return h;
}

// Raw bytes of element `index` of a buffer of `dtype`.
std::vector<uint8_t> element_bytes(const void* base, DType dtype, int64_t index) {
  const size_t n = dtype_size(dtype);
  const auto* p = static_cast<const uint8_t*>(base) + index * n;
  return {p, p + n};
}

// What the pool must hold for input element x: round(x / scale) in the storage dtype.
std::vector<uint8_t> expected_bytes(float x, float scale, DType dtype) {
  uint8_t tmp[4] = {};
  store_from_float(tmp, dtype, 0, x / scale);
  return {tmp, tmp + dtype_size(dtype)};
}

struct PoolCase {
  DType storage, input;
};

class MHAPoolRoundTrip : public testing::TestWithParam<PoolCase> {};

TEST_P(MHAPoolRoundTrip, StoresRoundedScaledValuesAndLeavesInputsAlone) {
  const auto [storage, input] = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(storage) * 31 + static_cast<uint64_t>(input));
  const int Hkv = 3, D = 20, Dv = 12, T = 9;
  const int64_t rows = 40;
  MHATokenToKVPool pool(rows, storage, {attn_layer(2, LayerKind::full, Hkv, D, Dv)});
  const float k_scale = is_fp8(storage) ? 0.37f : 1.f, v_scale = is_fp8(storage) ? 2.5f : 0.5f;
  pool.set_scales(2, k_scale, v_scale);
  // k is a column slice of a wider tensor (non-contiguous rows); v is contiguous. Values reach
  // beyond the fp8 range after scaling, which must saturate.
  HostBuffer wide = random_tensor(rng, input, {T, Hkv, 2 * D}, 300.f);
  TensorView k = wide.view();
  k.shape[2] = D;
  HostBuffer vb = random_tensor(rng, input, {T, Hkv, Dv}, 4.f);
  const TensorView v = vb.view();
  std::vector<int64_t> slots(rows);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin() + 1, slots.end(), rng);
  std::vector<int64_t> loc(slots.begin(), slots.begin() + T);  // includes the dummy slot 0
  const uint64_t k_sum = checksum(wide.data(), wide.bytes()),
                 v_sum = checksum(vb.data(), vb.bytes());
  pool.set_kv_buffer(2, loc, k, v);
  EXPECT_EQ(checksum(wide.data(), wide.bytes()), k_sum);
  EXPECT_EQ(checksum(vb.data(), vb.bytes()), v_sum);

  const KVLayerView view = pool.layer(2);
  EXPECT_EQ(view.dtype, storage);
  EXPECT_EQ(view.k_scale, k_scale);
  EXPECT_EQ(view.v_scale, v_scale);
  EXPECT_EQ(view.k_row_stride, Hkv * D);
  EXPECT_EQ(view.v_row_stride, Hkv * Dv);
  int saturated = 0;
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < Hkv; ++h) {
      for (int d = 0; d < D; ++d) {
        const float x = load_as_float(wide.data(), input, (t * Hkv + h) * 2 * D + d);
        saturated += is_fp8(storage) && std::abs(x / k_scale) > 448.f;
        ASSERT_EQ(element_bytes(view.k, storage, loc[t] * view.k_row_stride + h * D + d),
                  expected_bytes(x, k_scale, storage))
            << "token " << t << " head " << h << " dim " << d << " x " << x;
      }
      for (int d = 0; d < Dv; ++d) {
        const float x = load_as_float(vb.data(), input, (t * Hkv + h) * Dv + d);
        ASSERT_EQ(element_bytes(view.v, storage, loc[t] * view.v_row_stride + h * Dv + d),
                  expected_bytes(x, v_scale, storage));
      }
    }
  }
  if (storage == DType::e4m3) EXPECT_GT(saturated, 0);
  // Untouched rows stay zero.
  const int64_t untouched = slots[T];
  for (int64_t e = 0; e < view.k_row_stride; ++e)
    EXPECT_EQ(load_as_float(view.k, storage, untouched * view.k_row_stride + e), 0.f);
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, MHAPoolRoundTrip,
    testing::Values(PoolCase{DType::f32, DType::f32}, PoolCase{DType::bf16, DType::bf16},
                    PoolCase{DType::bf16, DType::f32}, PoolCase{DType::f16, DType::f32},
                    PoolCase{DType::f16, DType::bf16}, PoolCase{DType::e4m3, DType::bf16},
                    PoolCase{DType::e4m3, DType::f32}, PoolCase{DType::e5m2, DType::f16},
                    PoolCase{DType::f32, DType::e4m3}));

TEST(MHAPool, RejectsBadSlotsAndShapesWithThePoolUnchanged) {
  std::mt19937_64 rng(5);
  const int Hkv = 2, D = 8;
  const int64_t rows = 16;
  MHATokenToKVPool pool(rows, DType::bf16, {attn_layer(0, LayerKind::full, Hkv, D, D)});
  HostBuffer k = random_tensor(rng, DType::f32, {3, Hkv, D}, 1.f);
  HostBuffer v = random_tensor(rng, DType::f32, {3, Hkv, D}, 1.f);
  std::vector<int64_t> ok{3, 4, 5};
  pool.set_kv_buffer(0, ok, k.view(), v.view());
  const KVLayerView view = pool.layer(0);
  const size_t bytes = static_cast<size_t>(rows) * Hkv * D * 2;
  auto sums = [&] { return std::make_pair(checksum(view.k, bytes), checksum(view.v, bytes)); };
  const auto before = sums();
  HostBuffer k2 = random_tensor(rng, DType::f32, {3, Hkv, D}, 1.f);
  std::vector<int64_t> past_end{6, 7, rows};
  expect_error([&] { pool.set_kv_buffer(0, past_end, k2.view(), v.view()); },
               {"loc[2] = 16", "0..15"});
  std::vector<int64_t> negative{-1, 7, 8};
  expect_error([&] { pool.set_kv_buffer(0, negative, k2.view(), v.view()); }, {"loc[0] = -1"});
  HostBuffer wrong_heads = random_tensor(rng, DType::f32, {3, Hkv + 1, D}, 1.f);
  expect_error([&] { pool.set_kv_buffer(0, ok, wrong_heads.view(), v.view()); },
               {"k is fp32[3, 3, 8]", "expected [3, 2, 8]"});
  std::vector<int64_t> two{6, 7};
  expect_error([&] { pool.set_kv_buffer(0, two, k2.view(), v.view()); }, {"expected [2, 2, 8]"});
  TensorView on_gpu = v.view();
  on_gpu.device = Device::cuda(0);
  expect_error([&] { pool.set_kv_buffer(0, ok, k2.view(), on_gpu); }, {"cuda:0", "host tensors"});
  HostBuffer ints(DType::i32, {3, Hkv, D});
  expect_error([&] { pool.set_kv_buffer(0, ok, k2.view(), ints.view()); }, {"int32", "fp32, fp16"});
  expect_error([&] { pool.set_kv_buffer(1, ok, k2.view(), v.view()); }, {"layer 1 is not held"});
  expect_error([&] { pool.set_scales(0, 0.f, 1.f); }, {"k_scale 0", "finite and > 0"});
  EXPECT_EQ(sums(), before);
  EXPECT_EQ(view.k_scale, pool.layer(0).k_scale);
}

ModelSpec make_model(std::vector<LayerSpec> layers) {
  ModelSpec m;
  m.name = "test";
  m.layers = std::move(layers);
  return m;
}

ForwardBatch batch_with_slots(std::vector<int64_t> slots) {
  ForwardBatch b;
  b.mode = ForwardMode::EXTEND;
  b.out_cache_loc = std::move(slots);
  return b;
}

TEST(HostKVCache, GroupsLayersByShapeAndStoresThroughTheStepSlots) {
  std::mt19937_64 rng(11);
  LayerSpec lin;
  lin.layer_id = 1;
  lin.kind = LayerKind::gdn;
  auto model = make_model({attn_layer(0, LayerKind::full, 2, 16, 16), lin,
                           attn_layer(2, LayerKind::full, 4, 8, 6),
                           attn_layer(3, LayerKind::full, 2, 16, 16)});
  KVCacheConfig cfg;
  cfg.full_slots = 64;
  cfg.page_size = 4;
  cfg.dtype = DType::bf16;
  auto storage = make_host_kv_storage(model, cfg);
  KVCache& cache = *storage.cache;
  EXPECT_EQ(cache.page_size(), 4);
  EXPECT_EQ(cache.dtype(), DType::bf16);
  EXPECT_NE(dynamic_cast<PagedTokenAllocator*>(storage.allocator.get()), nullptr);
  expect_error([&] { cache.layer(1); }, {"layer 1 is a gdn layer", "no KV cache"});
  expect_error([&] { cache.layer(9); }, {"layer 9 does not exist"});
  EXPECT_EQ(cache.layer(2).kv_heads, 4);
  EXPECT_EQ(cache.layer(2).v_head_dim, 6);
  EXPECT_EQ(cache.layer(0).num_rows, 68);
  EXPECT_NE(cache.layer(0).k, cache.layer(3).k);

  HostBuffer k = random_tensor(rng, DType::f32, {5, 4, 8}, 2.f);
  HostBuffer v = random_tensor(rng, DType::f32, {5, 4, 6}, 2.f);
  expect_error([&] { cache.store_step_kv(2, k.view(), v.view()); }, {"call begin_step"});
  std::vector<int32_t> p{0}, s{5};
  std::vector<int64_t> l{-1};
  ForwardBatch batch = batch_with_slots(storage.allocator->alloc_extend(p, s, l));
  cache.begin_step(batch);
  const KVLayerView view = cache.layer(2);
  EXPECT_EQ(view.step_write_loc, batch.out_cache_loc.data());
  EXPECT_EQ(view.slot_map, nullptr);
  EXPECT_EQ(view.pool_slot(7), 7);
  cache.store_step_kv(2, k.view(), v.view());
  for (int t = 0; t < 5; ++t) {
    for (int e = 0; e < 4 * 8; ++e) {
      const float x = load_as_float(k.data(), DType::f32, t * 32 + e);
      EXPECT_EQ(load_as_float(view.k, DType::bf16, batch.out_cache_loc[t] * 32 + e),
                bf16_to_float(float_to_bf16(x)));
    }
  }
  HostBuffer k3 = random_tensor(rng, DType::f32, {4, 4, 8}, 2.f);
  expect_error([&] { cache.store_step_kv(2, k3.view(), v.view()); },
               {"k is fp32[4, 4, 8]", "step has 5 tokens"});
  cache.set_kv_scales(3, 0.25f, 4.f);
  EXPECT_EQ(cache.layer(3).k_scale, 0.25f);
  EXPECT_EQ(cache.layer(0).k_scale, 1.f);
}

TEST(HostKVCache, BeginStepRejectsBadSlotsNamingIndexAndValue) {
  auto model = make_model({attn_layer(0, LayerKind::full, 1, 8, 8)});
  KVCacheConfig cfg;
  cfg.full_slots = 32;
  auto cache = make_host_kv_cache(model, cfg);
  expect_error(
      [&] {
        cache->begin_step(batch_with_slots({3, 33, 5}));
      },
      {"out_cache_loc[1] = 33", "0..32"});
  expect_error([&] { cache->begin_step(batch_with_slots({3, -1})); }, {"out_cache_loc[1] = -1"});
  expect_error(
      [&] {
        cache->begin_step(batch_with_slots({4, 9, 2, 9}));
      },
      {"out_cache_loc[3] = 9 repeats out_cache_loc[1]"});
  // A rejected step leaves no step behind.
  HostBuffer k(DType::f32, {2, 1, 8}), v(DType::f32, {2, 1, 8});
  expect_error([&] { cache->store_step_kv(0, k.view(), v.view()); }, {"call begin_step"});
  // Padded tokens all write the dummy slot 0; the same slot may repeat across steps.
  cache->begin_step(batch_with_slots({7, 0, 0}));
  cache->begin_step(batch_with_slots({7, 8}));
}

LayerSpec mla_layer(int id, int rank, int rope) {
  LayerSpec l = attn_layer(id, LayerKind::mla, 1, rank + rope, rank);
  l.num_q_heads = 16;
  l.kv_lora_rank = rank;
  l.qk_rope_head_dim = rope;
  return l;
}

// reference-semantics §4.5: one latent row per slot, V a view of its first kv_lora_rank columns,
// the k rows stored (quantised with the layer's one scale), v never read.
TEST(HostKVCache, MlaLayersStoreOneLatentRowWithVAsAViewOfK) {
  for (DType dtype : {DType::bf16, DType::f32, DType::e4m3, DType::e5m2}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::mt19937_64 rng(31);
    LayerSpec kda;
    kda.layer_id = 1;
    kda.kind = LayerKind::kda;
    // A hybrid linear model: the KV cache holds the two mla layers only (§4.6).
    auto model = make_model({mla_layer(0, 512, 64), kda, mla_layer(2, 128, 64)});
    KVCacheConfig cfg;
    cfg.full_slots = 32;
    cfg.page_size = 4;
    cfg.dtype = dtype;
    auto storage = make_host_kv_storage(model, cfg);
    KVCache& cache = *storage.cache;
    auto* paged = dynamic_cast<PagedTokenAllocator*>(storage.allocator.get());
    ASSERT_NE(paged, nullptr);
    const int64_t rows = paged->pages().pool_rows();
    const float scale = is_fp8(dtype) ? 0.25f : 1.f;
    if (is_fp8(dtype)) cache.set_kv_scales(0, scale, scale);
    for (int id : {0, 2}) {
      const KVLayerView v = cache.layer(id);
      const int row = id == 0 ? 576 : 192, rank = id == 0 ? 512 : 128;
      EXPECT_EQ(v.kv_heads, 1);
      EXPECT_EQ(v.head_dim, row);
      EXPECT_EQ(v.v_head_dim, rank);
      EXPECT_EQ(v.v, v.k) << "V must be a view of the K rows, not a copy";
      EXPECT_EQ(v.k_row_stride, row);
      EXPECT_EQ(v.v_row_stride, row);
      EXPECT_EQ(v.num_rows, rows);
      EXPECT_EQ(v.dtype, dtype);
      EXPECT_EQ(v.k_scale, id == 0 ? scale : 1.f);
      EXPECT_EQ(v.v_scale, v.k_scale);
    }
    expect_error([&] { cache.layer(1); }, {"layer 1", "kda", "no KV cache"});

    const std::vector<int64_t> slots = {5, 0, 9};
    const ForwardBatch batch = batch_with_slots(slots);  // the cache keeps its out_cache_loc
    cache.begin_step(batch);
    HostBuffer k = random_tensor(rng, DType::f32, {3, 1, 576}, 4.f);
    HostBuffer v = random_tensor(rng, DType::f32, {3, 1, 512}, 4.f);  // not read
    cache.store_step_kv(0, k.view(), v.view());
    // v may be left out altogether.
    HostBuffer k2 = random_tensor(rng, DType::bf16, {3, 1, 192}, 4.f);
    cache.store_step_kv(2, k2.view(), TensorView());
    for (int id : {0, 2}) {
      const KVLayerView view = cache.layer(id);
      const HostBuffer& src = id == 0 ? k : k2;
      for (size_t t = 0; t < slots.size(); ++t) {
        for (int d = 0; d < view.head_dim; ++d) {
          const float x = load_as_float(src.data(), src.dtype(), t * view.head_dim + d);
          float want = x / view.k_scale;
          alignas(4) unsigned char b[4];
          store_from_float(b, dtype, 0, want);
          want = load_as_float(b, dtype, 0);
          const float got = load_as_float(view.k, dtype, slots[t] * view.k_row_stride + d);
          ASSERT_EQ(got, want) << "layer " << id << " token " << t << " dim " << d;
          // V column d of the same slot is the same stored element.
          if (d < view.v_head_dim) {
            ASSERT_EQ(load_as_float(view.v, dtype, slots[t] * view.v_row_stride + d), got);
          }
        }
      }
    }
    // Rows never written stay zero.
    EXPECT_EQ(load_as_float(cache.layer(0).k, dtype, 7 * 576 + 3), 0.f);
  }
}

TEST(HostKVCache, MlaLayersRejectTwoScalesAndWrongShapes) {
  auto model = make_model({mla_layer(0, 512, 64)});
  KVCacheConfig cfg;
  cfg.full_slots = 16;
  cfg.dtype = DType::e4m3;
  auto storage = make_host_kv_storage(model, cfg);
  expect_error([&] { storage.cache->set_kv_scales(0, 0.5f, 2.f); },
               {"k_scale 0.5 but v_scale 2", "mla", "v_scale = k_scale"});
  expect_error([&] { storage.cache->set_kv_scales(0, -1.f, -1.f); }, {"finite and > 0"});
  const ForwardBatch batch = batch_with_slots({3});
  storage.cache->begin_step(batch);
  HostBuffer k(DType::f32, {1, 1, 512});
  expect_error([&] { storage.cache->store_step_kv(0, k.view(), TensorView()); },
               {"k is", "expected [1, 1, 576]"});
  LayerSpec two_heads = mla_layer(0, 512, 64);
  two_heads.num_kv_heads = 2;
  expect_error([&] { MLATokenToKVPool(8, DType::bf16, {two_heads}); },
               {"layer 0", "one latent kv head"});
  expect_error([&] { MLATokenToKVPool(8, DType::bf16, {attn_layer(0, LayerKind::full, 1, 8, 8)}); },
               {"mla layers only"});
  expect_error([&] { MHATokenToKVPool(8, DType::bf16, {mla_layer(0, 512, 64)}); },
               {"full / sliding-window"});
}

TEST(HostKVCache, RejectsSwaHybridWithoutAllocator) {
  KVCacheConfig cfg;
  cfg.full_slots = 16;
  auto hybrid = make_model(
      {attn_layer(0, LayerKind::swa, 1, 8, 8, 16), attn_layer(1, LayerKind::full, 1, 8, 8)});
  EXPECT_TRUE(is_swa_hybrid(hybrid));
  expect_error([&] { make_host_kv_cache(hybrid, cfg); }, {"make_host_kv_storage"});
  cfg.dtype = DType::i64;
  expect_error([&] { make_host_kv_storage(hybrid, cfg); }, {"int64", "not a KV storage dtype"});
  // A model whose every layer has a window needs no second pool.
  auto all_swa = make_model(
      {attn_layer(0, LayerKind::full, 1, 8, 8, 4), attn_layer(1, LayerKind::swa, 1, 8, 8, 4)});
  EXPECT_FALSE(is_swa_hybrid(all_swa));
}

// SWA-hybrid storage: the live requests' full slots, their SWA slots through the shared mapping,
// and the pages released by free_swa, checked after every operation.
class SWAStorage : public testing::TestWithParam<int> {};

TEST_P(SWAStorage, MappingStaysConsistentThroughAllocFreeAndFreeSwa) {
  const int P = GetParam();
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    Workload w(seed * 104729 + P, P);
    KVCacheConfig cfg;
    cfg.page_size = P;
    cfg.full_slots = w.uniform(10, 30) * P;
    cfg.swa_full_tokens_ratio = 0.5;
    cfg.max_num_tokens = 1024;
    auto model = make_model(
        {attn_layer(0, LayerKind::full, 1, 4, 4), attn_layer(1, LayerKind::swa, 1, 4, 4, 3)});
    auto storage = make_host_kv_storage(model, cfg);
    auto* alloc = dynamic_cast<SWATokenAllocator*>(storage.allocator.get());
    ASSERT_NE(alloc, nullptr);
    const auto map = alloc->full_to_swa();
    const KVLayerView swa_view = storage.cache->layer(1);
    ASSERT_EQ(swa_view.slot_map, map->data());
    ASSERT_EQ(swa_view.slot_map_rows, alloc->full().pool_rows());
    ASSERT_EQ(static_cast<int64_t>(map->size()), alloc->full().pool_rows() + 1);
    EXPECT_EQ(swa_view.pool_slot(-1), -1);
    EXPECT_EQ(swa_view.num_rows, alloc->swa().pool_rows());
    EXPECT_EQ(alloc->swa().num_pages(), cfg.full_slots / 2 / P);
    std::map<int, int64_t> released;  // request -> leading pages whose SWA slots were freed
    int swa_exhausted = 0;

    auto check = [&]() -> testing::AssertionResult {
      auto r = check_ownership(alloc->full(), w.live);
      if (!r) return r;
      std::set<int64_t> swa_slots, swa_pages;
      std::set<int64_t> full_live;
      for (const auto& [id, toks] : w.live) {
        for (size_t pos = 0; pos < toks.size(); ++pos) {
          full_live.insert(toks[pos]);
          const int64_t s = (*map)[toks[pos]];
          const bool gone = static_cast<int64_t>(pos) / P < released[id];
          if (gone != (s == 0))
            return testing::AssertionFailure() << "position " << pos << " maps to " << s;
          if (gone) continue;
          if (s % P != static_cast<int64_t>(pos) % P || !swa_slots.insert(s).second)
            return testing::AssertionFailure() << "SWA slot " << s << " at position " << pos;
          if (pos % P != 0 && (*map)[toks[pos - 1]] != 0 && s != (*map)[toks[pos - 1]] + 1)
            return testing::AssertionFailure() << "SWA page not contiguous";
          swa_pages.insert(s / P);
        }
      }
      for (int64_t f = 0; f < alloc->full().pool_rows(); ++f) {
        if (!full_live.count(f) && (*map)[f] != 0)
          return testing::AssertionFailure() << "free full slot " << f << " still mapped";
      }
      if (map->back() != -1) return testing::AssertionFailure() << "last entry not -1";
      const auto& swa = alloc->swa();
      if (static_cast<int64_t>(swa_pages.size()) != swa.num_pages() - swa.free_pages())
        return testing::AssertionFailure() << "SWA pages leaked";
      if (alloc->available_size() != std::min(alloc->full().available_size(), swa.available_size()))
        return testing::AssertionFailure() << "available_size is not the minimum";
      return testing::AssertionSuccess();
    };

    for (int op = 0; op < 120; ++op) {
      const int64_t kind = w.uniform(0, 9);
      if (kind <= 4) {
        auto e = w.make_extend(alloc->swa().free_pages(), w.uniform(0, 4) == 0);
        const bool swa_short = e.pages > alloc->swa().free_pages();
        const bool full_short = e.pages > alloc->full().free_pages();
        if (swa_short || full_short) {
          const auto full_before = state_of(alloc->full()), swa_before = state_of(alloc->swa());
          const auto map_before = *map;
          expect_error([&] { alloc->alloc_extend(e.prefix, e.seq, e.last); },
                       {swa_short ? "out of SWA KV cache" : "out of KV cache"});
          ASSERT_EQ(state_of(alloc->full()), full_before);
          ASSERT_EQ(state_of(alloc->swa()), swa_before);
          ASSERT_EQ(*map, map_before);
          swa_exhausted += swa_short;
        } else {
          auto slots = alloc->alloc_extend(e.prefix, e.seq, e.last);
          w.commit(e, slots);
          // One step over the new tokens: the SWA layer's write slots are their mapped slots,
          // written into the same buffer every step.
          ForwardBatch batch = batch_with_slots(slots);
          storage.cache->begin_step(batch);
          const KVLayerView v1 = storage.cache->layer(1);
          ASSERT_EQ(v1.step_write_loc, swa_view.step_write_loc);
          for (size_t t = 0; t < slots.size(); ++t)
            ASSERT_EQ(v1.step_write_loc[t], (*map)[slots[t]]);
          ASSERT_EQ(storage.cache->layer(0).step_write_loc, batch.out_cache_loc.data());
        }
      } else if (kind <= 6 && !w.live.empty()) {
        // Release the SWA slots of whole pages that fell out of the window (never the last page).
        const int id = w.pick_live(1)[0];
        const auto& toks = w.live[id];
        const int64_t whole = static_cast<int64_t>(toks.size() - 1) / P;
        if (released[id] >= whole) continue;
        const int64_t upto = w.uniform(released[id] + 1, whole);
        std::vector<int64_t> gone(toks.begin() + released[id] * P, toks.begin() + upto * P);
        if (P > 1) {
          // Half a page is refused: the other tokens of the page still use it.
          std::vector<int64_t> half(gone.begin(), gone.begin() + P / 2);
          const auto swa_before = state_of(alloc->swa());
          expect_error([&] { alloc->free_swa(half); },
                       {"whole pages", "only " + std::to_string(P / 2)});
          ASSERT_EQ(state_of(alloc->swa()), swa_before);
        }
        const int64_t full_free = alloc->full().free_pages(), swa_free = alloc->swa().free_pages();
        const int64_t freed_pages = upto - released[id];
        alloc->free_swa(gone);
        EXPECT_EQ(alloc->full().free_pages(), full_free);
        EXPECT_EQ(alloc->swa().free_pages(), swa_free + freed_pages);
        released[id] = upto;
        // Releasing again is a no-op: those tokens have no SWA slot any more.
        alloc->free_swa(gone);
        EXPECT_EQ(alloc->swa().free_pages(), swa_free + freed_pages);
        // A step that writes a released token is refused.
        expect_error([&] { storage.cache->begin_step(batch_with_slots({gone.back()})); },
                     {"has no SWA slot"});
      } else if (kind <= 8 && !w.live.empty()) {
        const Workload::Extend d = w.make_decode(3);
        if (d.pages > alloc->swa().free_pages() || d.pages > alloc->full().free_pages()) continue;
        auto slots = alloc->alloc_decode(d.seq, d.last);
        for (size_t i = 0; i < d.ids.size(); ++i) w.live[d.ids[i]].push_back(slots[i]);
      } else if (!w.live.empty()) {
        const int id = w.pick_live(1)[0];
        alloc->free(w.live[id]);
        w.live.erase(id);
        released.erase(id);
      }
      ASSERT_TRUE(check()) << "seed " << seed << " op " << op;
    }
    EXPECT_GT(swa_exhausted, 0);
    for (const auto& [id, toks] : w.live) alloc->free(toks);
    EXPECT_EQ(alloc->full().free_pages(), alloc->full().num_pages());
    EXPECT_EQ(alloc->swa().free_pages(), alloc->swa().num_pages());
    EXPECT_TRUE(std::all_of(map->begin(), map->end() - 1, [](int64_t s) { return s == 0; }));
  }
}

INSTANTIATE_TEST_SUITE_P(PageSizes, SWAStorage, testing::Values(1, 2, 16, 64));

// The step checks the host and GPU caches share: a bad step names the entry and its value, and
// leaves the caller's SWA write-slot buffer as it was; a good one translates every slot.
TEST(StepSlotCheck, RejectsBadStepsBeforeWritingAndTranslatesGoodOnes) {
  SWATokenAllocator alloc(64, 32, 4);
  const std::vector<int32_t> zero{0}, len{10};
  const std::vector<int64_t> none{-1};
  const std::vector<int64_t> slots = alloc.alloc_extend(zero, len, none);
  const int64_t rows = alloc.full().pool_rows();
  StepSlotCheck check("CUDA KV cache", rows, alloc.full_to_swa());
  std::vector<int64_t> swa(4, -7);
  const std::vector<int64_t> untouched = swa;
  expect_error(
      [&] {
        check(std::vector<int64_t>{slots[0], rows}, swa.data());
      },
      {"CUDA KV cache: out_cache_loc[1] = " + std::to_string(rows),
       "outside the KV pool's slots 0.." + std::to_string(rows - 1)});
  expect_error(
      [&] {
        check(std::vector<int64_t>{slots[1], 0, slots[1]}, swa.data());
      },
      {"out_cache_loc[2] = " + std::to_string(slots[1]) + " repeats out_cache_loc[0]"});
  // The first page's tokens leave the window: they have no SWA slot any more.
  alloc.free_swa(std::span<const int64_t>(slots.data(), 4));
  expect_error(
      [&] {
        check(std::vector<int64_t>{slots[5], slots[2]}, swa.data());
      },
      {"out_cache_loc[1] = " + std::to_string(slots[2]), "has no SWA slot"});
  EXPECT_EQ(swa, untouched) << "a refused step wrote SWA slots";
  // Padded tokens may all write the dummy slot 0; the same slot may come back the next step.
  const std::vector<int64_t> loc = {slots[9], 0, slots[4], 0};
  check(loc, swa.data());
  check(loc, swa.data());
  const auto& map = *alloc.full_to_swa();
  EXPECT_EQ(swa, (std::vector<int64_t>{map[slots[9]], 0, map[slots[4]], 0}));
  EXPECT_NE(swa[0], 0);
  // Without a map there is nothing to translate and swa may be null.
  StepSlotCheck plain("KV cache", rows, nullptr);
  plain(std::vector<int64_t>{slots[0], slots[1]}, nullptr);
  expect_error([&] { plain(std::vector<int64_t>{-1}, nullptr); }, {"out_cache_loc[0] = -1"});
}

TEST(MakeTokenAllocator, SwaHybridModelsGetTheSwaAllocatorOthersThePagedOne) {
  KVCacheConfig cfg;
  cfg.full_slots = 64;
  cfg.page_size = 4;
  cfg.swa_full_tokens_ratio = 0.5;
  const auto hybrid = make_model(
      {attn_layer(0, LayerKind::full, 1, 8, 8), attn_layer(1, LayerKind::swa, 1, 8, 8, 3)});
  auto swa = make_token_allocator(hybrid, cfg);
  auto* s = dynamic_cast<SWATokenAllocator*>(swa.get());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->full().num_pages(), 16);
  EXPECT_EQ(s->swa().num_pages(), 8);
  cfg.swa_slots = 12;
  EXPECT_EQ(dynamic_cast<SWATokenAllocator&>(*make_token_allocator(hybrid, cfg)).swa().num_pages(),
            3);
  cfg.swa_slots = 2;
  expect_error([&] { make_token_allocator(hybrid, cfg); }, {"SWA pool gets 2 slots", "one page"});
  cfg.swa_slots = 0;
  const auto plain = make_model({attn_layer(0, LayerKind::full, 1, 8, 8)});
  EXPECT_NE(dynamic_cast<PagedTokenAllocator*>(make_token_allocator(plain, cfg).get()), nullptr);
  cfg.page_size = 0;
  expect_error([&] { make_token_allocator(plain, cfg); }, {"page_size 0"});
}

TEST(SWAStorage, StoresSwaLayersInTheSwaPoolAndFullLayersInTheFullPool) {
  std::mt19937_64 rng(3);
  const int P = 2;
  const KVCacheConfig cfg{
      .full_slots = 40, .swa_slots = 12, .page_size = P, .dtype = DType::f32, .max_num_tokens = 6};
  auto model = make_model(
      {attn_layer(0, LayerKind::full, 2, 4, 4), attn_layer(1, LayerKind::full, 2, 4, 4, 5)});
  auto storage = make_host_kv_storage(model, cfg);
  auto& alloc = *storage.allocator;
  std::vector<int32_t> p{0, 0}, s{3, 2};
  std::vector<int64_t> l{-1, -1};
  ForwardBatch batch = batch_with_slots(alloc.alloc_extend(p, s, l));
  storage.cache->begin_step(batch);
  HostBuffer k = random_tensor(rng, DType::f32, {5, 2, 4}, 1.f);
  HostBuffer v = random_tensor(rng, DType::f32, {5, 2, 4}, 1.f);
  storage.cache->store_step_kv(0, k.view(), v.view());
  storage.cache->store_step_kv(1, k.view(), v.view());
  const KVLayerView full = storage.cache->layer(0), swa = storage.cache->layer(1);
  EXPECT_FALSE(full.is_swa);
  EXPECT_TRUE(swa.is_swa);
  EXPECT_EQ(full.num_rows, 42);
  EXPECT_EQ(swa.num_rows, 14);
  for (int t = 0; t < 5; ++t) {
    const int64_t f = batch.out_cache_loc[t], w = swa.pool_slot(f);
    ASSERT_GT(w, 0);
    EXPECT_EQ(0, std::memcmp(static_cast<float*>(full.k) + f * 8, k.ptr<float>() + t * 8, 32));
    EXPECT_EQ(0, std::memcmp(static_cast<float*>(swa.k) + w * 8, k.ptr<float>() + t * 8, 32));
    EXPECT_EQ(0, std::memcmp(static_cast<float*>(swa.v) + w * 8, v.ptr<float>() + t * 8, 32));
  }
  // The SWA pool has 6 pages of 2; 3 are taken. Four more pages fit the full pool but not SWA.
  std::vector<int32_t> p2{0}, s2{8};
  std::vector<int64_t> l2{-1};
  expect_error([&] { alloc.alloc_extend(p2, s2, l2); },
               {"out of SWA KV cache", "8 new slots", "6 of 12 SWA slots", "free_swa"});
  EXPECT_EQ(alloc.available_size(), 6);
  std::vector<int64_t> big(7, 0);
  expect_error([&] { storage.cache->begin_step(batch_with_slots(big)); },
               {"7 tokens", "max_num_tokens = 6"});
}

}  // namespace

// The slot checks on random steps, some with a slot out of range, a repeat or a slot without an
// SWA slot (one problem or several): the error names the first bad entry as a walk in token order
// finds it, a refused step leaves the caller's SWA buffer as it was, and the next good step passes
// (a refused step's stamps do not count as repeats) and translates every slot.
TEST(StepSlotCheck, RandomStepsNameTheFirstBadSlotAndLeaveNoStaleStamps) {
  std::mt19937 rng(99);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const int64_t rows = 200;
  auto map = std::make_shared<std::vector<int64_t>>(rows + 1);
  for (int64_t s = 0; s < rows; ++s) (*map)[s] = s % 7 == 3 ? 0 : s + 1000;
  (*map)[rows] = -1;
  for (const bool swa : {false, true}) {
    StepSlotCheck check("KV cache", rows, swa ? map : nullptr);
    std::vector<int64_t> out(64, -7);
    int refused = 0;
    for (int iter = 0; iter < 5000; ++iter) {
      // A good step: distinct slots (mapped ones with a map), the dummy 0 possibly repeated.
      std::vector<int64_t> loc;
      for (int64_t s = 1; s < rows; ++s) {
        if ((!swa || (*map)[s] != 0) && pick(0, 9) == 0) loc.push_back(s);
      }
      for (int64_t z = pick(0, 2); z > 0; --z) loc.push_back(0);
      std::shuffle(loc.begin(), loc.end(), rng);
      loc.resize(std::min<size_t>(loc.size(), out.size()));
      for (int64_t e = pick(0, 2); e > 0 && !loc.empty(); --e) {
        int64_t& x = loc[pick(0, static_cast<int64_t>(loc.size()) - 1)];
        switch (pick(0, 3)) {
          case 0:
            x = pick(0, 1) ? -1 - pick(0, 5) : rows + pick(0, 5);
            break;
          case 1:
            x = loc[pick(0, static_cast<int64_t>(loc.size()) - 1)];
            break;
          case 2:
            x = 7 * pick(0, rows / 7 - 1) + 3;
            break;  // no SWA slot
          default:
            x = pick(0, rows - 1);
        }
      }
      // The first bad entry in token order, and what its message says.
      std::vector<std::string> want;
      std::map<int64_t, size_t> first;
      for (size_t i = 0; i < loc.size() && want.empty(); ++i) {
        const int64_t s = loc[i];
        const std::string at = fmt::format("out_cache_loc[{}] = {} ", i, s);
        if (s < 0 || s >= rows) {
          want = {"KV cache: " + at + "is outside the KV pool's slots 0..199"};
        } else if (s != 0 && first.count(s)) {
          want = {at + fmt::format("repeats out_cache_loc[{}]", first[s]), "only the dummy slot"};
        } else if (s != 0 && swa && (*map)[s] == 0) {
          want = {at + "has no SWA slot"};
        }
        first.emplace(s, i);
      }
      const std::vector<int64_t> before = out;
      if (!want.empty()) {
        ++refused;
        expect_error([&] { check(loc, out.data()); }, want);
        ASSERT_EQ(out, before) << "iteration " << iter << ": a refused step wrote SWA slots";
        continue;
      }
      ASSERT_NO_THROW(check(loc, out.data())) << "iteration " << iter;
      if (swa) {
        for (size_t i = 0; i < loc.size(); ++i) ASSERT_EQ(out[i], (*map)[loc[i]]);
      }
    }
    EXPECT_GT(refused, 1000);
    EXPECT_LT(refused, 4500);
  }
}
