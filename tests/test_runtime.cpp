// AttentionRuntime end to end: requests allocated, extended, decoded and released through the
// runtime's own pools, every layer's output compared with attention computed here from the k/v
// history (rounded to the KV dtype), plus the errors of misuse.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/runtime/attention_runtime.h"
#include "tests/test_util.h"

using namespace attnrt;

namespace {

using attnrt::test::expect_error;

constexpr int kHq = 4, kHkv = 2, kD = 16, kWindow = 3;

LayerSpec attn_layer(int id, LayerKind kind, int window) {
  LayerSpec l = test::attention_layer(id, kHq, kHkv, kD);
  l.kind = kind;
  l.sliding_window = window;
  return l;
}

// Full, sliding-window, full: an SWA-hybrid model, so the runtime builds both pools.
ModelSpec hybrid_model() {
  return test::make_model(
      "tiny-swa-hybrid", DType::f32, 128,
      {attn_layer(0, LayerKind::full, -1), attn_layer(1, LayerKind::swa, kWindow),
       attn_layer(2, LayerKind::full, -1)});
}

struct RuntimeCase {
  std::string backend;
  int page_size;
  std::string kv_dtype;
};

std::string case_name(const testing::TestParamInfo<RuntimeCase>& info) {
  return info.param.backend + "_page" + std::to_string(info.param.page_size) + "_" +
         info.param.kv_dtype;
}

// One request as the engine sees it: its row, its slots, and per layer the keys/values it has
// written so far (already rounded to the KV dtype, as the pool holds them).
struct Request {
  int row = -1;
  std::vector<int64_t> slots;
  std::map<int, std::vector<float>> k, v;  // layer -> [len, Hkv, D]
  int64_t swa_released = 0;                // leading tokens whose SWA slots were freed
};

class RuntimeEndToEnd : public testing::TestWithParam<RuntimeCase> {
 protected:
  void SetUp() override {
    Options o;
    o.attention_backend = GetParam().backend;
    o.page_size = GetParam().page_size;
    o.kv_cache_dtype = GetParam().kv_dtype;
    RuntimeConfig c;
    c.max_requests = 4;
    c.kv_slots = 40 * GetParam().page_size + 64;
    c.max_num_tokens = 64;
    c.swa_full_tokens_ratio = 0.75;
    rt = std::make_unique<AttentionRuntime>(hybrid_model(), o, c);
  }

  std::vector<float> random_values(int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (float& e : x) e = u(rng);
    return x;
  }

  float stored(float x) {
    uint8_t tmp[4];
    const DType t = rt->kv_cache().dtype();
    store_from_float(tmp, t, 0, x);
    return load_as_float(tmp, t, 0);
  }

  // Runs one step over `reqs` with `new_tokens[i]` new tokens each (decode when all are 1 and
  // `decode` is set), checking every layer's output.
  void step(const std::vector<int>& ids, const std::vector<int32_t>& new_tokens, bool decode) {
    std::vector<int64_t> rows, last;
    std::vector<int32_t> prefix, seq;
    for (size_t i = 0; i < ids.size(); ++i) {
      Request& r = reqs[ids[i]];
      if (r.row < 0) r.row = rt->req_to_token().alloc();
      rows.push_back(r.row);
      prefix.push_back(static_cast<int32_t>(r.slots.size()));
      seq.push_back(prefix.back() + new_tokens[i]);
      last.push_back(r.slots.empty() ? -1 : r.slots.back());
    }
    std::vector<int64_t> slots = decode ? rt->allocator().alloc_decode(seq, last)
                                        : rt->allocator().alloc_extend(prefix, seq, last);
    ForwardBatch batch =
        decode ? make_decode_batch(rows, seq) : make_extend_batch(rows, prefix, new_tokens);
    batch.out_cache_loc = slots;
    size_t at = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      Request& r = reqs[ids[i]];
      std::vector<int64_t> mine(slots.begin() + at, slots.begin() + at + new_tokens[i]);
      rt->req_to_token().write(r.row, prefix[i], mine);
      r.slots.insert(r.slots.end(), mine.begin(), mine.end());
      at += mine.size();
    }
    const int64_t T = static_cast<int64_t>(slots.size());
    rt->begin_step(batch);
    for (const LayerSpec& layer : rt->model().layers) {
      std::vector<float> q = random_values(T * kHq * kD), k = random_values(T * kHkv * kD),
                         v = random_values(T * kHkv * kD), out(T * kHq * kD, NAN);
      AttnArgs args;
      args.q = TensorView(q.data(), DType::f32, {T, kHq, kD});
      args.k = TensorView(k.data(), DType::f32, {T, kHkv, kD});
      args.v = TensorView(v.data(), DType::f32, {T, kHkv, kD});
      args.out = TensorView(out.data(), DType::f32, {T, kHq, kD});
      rt->forward(layer.layer_id, args);
      // Expected: the history plus this step's tokens, causal, within the window if any.
      int64_t row0 = 0;
      for (size_t i = 0; i < ids.size(); ++i) {
        Request& r = reqs[ids[i]];
        auto& hk = r.k[layer.layer_id];
        auto& hv = r.v[layer.layer_id];
        for (int64_t t = 0; t < new_tokens[i] * kHkv * kD; ++t) {
          hk.push_back(stored(k[(row0 * kHkv * kD) + t]));
          hv.push_back(stored(v[(row0 * kHkv * kD) + t]));
        }
        for (int t = 0; t < new_tokens[i]; ++t) {
          const int64_t pos = prefix[i] + t, qrow = row0 + t;
          const int64_t first =
              layer.sliding_window >= 0 ? std::max<int64_t>(0, pos - layer.sliding_window) : 0;
          for (int h = 0; h < kHq; ++h) {
            const int kh = h / (kHq / kHkv);
            std::vector<double> w;
            double mx = -INFINITY;
            for (int64_t j = first; j <= pos; ++j) {
              double dot = 0;
              for (int d = 0; d < kD; ++d)
                dot += static_cast<double>(q[(qrow * kHq + h) * kD + d]) *
                       hk[(j * kHkv + kh) * kD + d];
              w.push_back(dot / std::sqrt(static_cast<double>(kD)));
              mx = std::max(mx, w.back());
            }
            double sum = 0;
            for (double& e : w) sum += (e = std::exp(e - mx));
            for (int d = 0; d < kD; ++d) {
              double o = 0;
              for (int64_t j = first; j <= pos; ++j)
                o += w[j - first] * hv[(j * kHkv + kh) * kD + d];
              o /= sum;
              const float got = out[(qrow * kHq + h) * kD + d];
              ASSERT_NEAR(got, o, 2e-3 + 2e-3 * std::abs(o))
                  << "layer " << layer.layer_id << " request " << ids[i] << " position " << pos
                  << " head " << h << " dim " << d;
            }
          }
        }
        row0 += new_tokens[i];
      }
    }
    EXPECT_EQ(&rt->current_batch(), &batch);
    rt->end_step();
  }

  // Releases the SWA slots of whole pages that no future query of request `id` can see.
  void release_window(int id) {
    Request& r = reqs[id];
    const int64_t P = rt->allocator().page_size();
    const int64_t len = static_cast<int64_t>(r.slots.size());
    const int64_t upto = std::max<int64_t>(0, (len - kWindow) / P * P);
    if (upto <= r.swa_released) return;
    const int64_t before = rt->allocator().available_size();
    rt->allocator().free_swa({r.slots.begin() + r.swa_released, r.slots.begin() + upto});
    EXPECT_GE(rt->allocator().available_size(), before);
    r.swa_released = upto;
  }

  std::mt19937_64 rng{12345};
  std::unique_ptr<AttentionRuntime> rt;
  std::map<int, Request> reqs;
};

TEST_P(RuntimeEndToEnd, PrefillDecodeAndPrefixExtendMatchDirectAttention) {
  EXPECT_EQ(rt->kv_cache().page_size(), GetParam().page_size);
  EXPECT_TRUE(rt->kv_cache().layer(1).is_swa);
  EXPECT_FALSE(rt->kv_cache().layer(0).is_swa);
  const int64_t total = rt->allocator().available_size();
  step({0, 1, 2}, {5, 9, 3}, false);
  step({0, 1, 2}, {1, 1, 1}, true);
  step({0, 2}, {4, 6}, false);
  for (int i = 0; i < 4; ++i) {
    for (int id : {0, 1, 2}) release_window(id);
    step({2, 0, 1}, {1, 1, 1}, true);
  }
  step({3, 1}, {7, 2}, false);
  step({3, 0, 1, 2}, {1, 1, 1, 1}, true);
  for (auto& [id, r] : reqs) {
    rt->allocator().free(r.slots);
    rt->req_to_token().free(r.row);
  }
  EXPECT_EQ(rt->allocator().available_size(), total);
  EXPECT_EQ(rt->req_to_token().available(), 4);
}

INSTANTIATE_TEST_SUITE_P(Backends, RuntimeEndToEnd,
                         testing::Values(RuntimeCase{"reference", 1, "fp32"},
                                         RuntimeCase{"reference", 4, "fp8_e4m3"},
                                         RuntimeCase{"cpu", 1, "bf16"},
                                         RuntimeCase{"cpu", 16, "fp32"},
                                         RuntimeCase{"cpu", 2, "fp8_e5m2"}),
                         case_name);

class RuntimeErrors : public testing::Test {
 protected:
  RuntimeErrors() {
    Options o;
    o.attention_backend = "reference";
    RuntimeConfig c;
    c.max_requests = 2;
    c.kv_slots = 256;
    c.max_num_tokens = 16;
    c.max_context_len = 32;
    rt = std::make_unique<AttentionRuntime>(hybrid_model(), o, c);
  }
  std::unique_ptr<AttentionRuntime> rt;
};

TEST_F(RuntimeErrors, MisuseIsReportedWithWhatToDo) {
  std::vector<float> buf(4 * kHq * kD, 0.5f);
  AttnArgs args;
  args.q = TensorView(buf.data(), DType::f32, {1, kHq, kD});
  expect_error([&] { rt->forward(0, args); }, {"forward(layer 0) outside a step", "begin_step"});
  expect_error([&] { rt->current_batch(); }, {"no step in progress"});

  const int row = rt->req_to_token().alloc();
  std::vector<int32_t> p{0}, s{3};
  std::vector<int64_t> l{-1};
  auto slots = rt->allocator().alloc_extend(p, s, l);
  rt->req_to_token().write(row, 0, slots);
  ForwardBatch unallocated = make_extend_batch({1}, {0}, {3});
  unallocated.out_cache_loc = slots;
  expect_error([&] { rt->begin_step(unallocated); },
               {"req_pool_indices[0] = 1 is not an allocated request row"});
  ForwardBatch big = make_extend_batch({row}, {0}, {20});
  big.out_cache_loc.assign(20, 0);
  expect_error([&] { rt->begin_step(big); }, {"20 tokens", "max_num_tokens = 16"});
  ForwardBatch too_long = make_extend_batch({row}, {30}, {3});
  too_long.out_cache_loc = slots;
  expect_error([&] { rt->begin_step(too_long); }, {"33 tokens", "max_context_len = 32"});
  ForwardBatch bad_slot = make_extend_batch({row}, {0}, {3});
  bad_slot.out_cache_loc = {slots[0], 100000, slots[2]};
  expect_error([&] { rt->begin_step(bad_slot); }, {"out_cache_loc[1] = 100000"});

  ForwardBatch ok = make_extend_batch({row}, {0}, {3});
  ok.out_cache_loc = slots;
  rt->begin_step(ok);
  expect_error([&] { rt->forward(7, args); },
               {"layer 7 is not a layer of model 'tiny-swa-hybrid'"});
  rt->end_step();
  expect_error([&] { rt->current_batch(); }, {"no step in progress"});
}

TEST(RuntimeConstruction, RejectsBadModelsAndConfigs) {
  Options o;
  o.attention_backend = "reference";
  RuntimeConfig c;
  c.max_requests = 0;
  expect_error([&] { AttentionRuntime(hybrid_model(), o, c); }, {"max_requests = 0"});
  c = RuntimeConfig{};
  c.kv_slots = 64;
  c.swa_full_tokens_ratio = 0.01;
  expect_error([&] { AttentionRuntime(hybrid_model(), o, c); }, {"SWA pool", "give it more slots"});
  ModelSpec broken = hybrid_model();
  broken.layers[2].v_head_dim = 0;
  expect_error([&] { AttentionRuntime(broken, o, RuntimeConfig{}); }, {"v_head_dim"});
  Options unknown = o;
  unknown.attention_backend = "no-such-backend";
  expect_error([&] { AttentionRuntime(hybrid_model(), unknown, RuntimeConfig{}); },
               {"no-such-backend"});
}

// Slot ids are int32: a pool past them is refused by its size before anything is allocated (it
// used to reach the page allocator's free list and end in std::bad_alloc).
TEST(RuntimeConstruction, KvSlotsBeyondInt32SlotIdsAreRefusedBeforeAllocating) {
  Options o;
  o.attention_backend = "reference";
  o.page_size = 16;
  RuntimeConfig c;
  c.kv_slots = int64_t{1} << 40;
  expect_error([&] { AttentionRuntime(hybrid_model(), o, c); },
               {"kv_slots = 1099511627776", "int32", "use at most 2147483631"});
}

TEST(SpecInfoChain, MoreBlockTokensThanAStepHoldsAreRefused) {
  EXPECT_EQ(SpecInfo::chain(2, 3).parents, (std::vector<int32_t>{-1, 0, 1, -1, 0, 1}));
  expect_error([] { SpecInfo::chain(65536, 65536); },
               {"batch_size = 65536", "num_draft_tokens = 65536", "2^31 - 1"});
}

}  // namespace
