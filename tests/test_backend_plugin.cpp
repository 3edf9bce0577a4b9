// A backend added from outside src/: registered here with its own device services, it gets its
// pools from them through AttentionRuntime and passes the conformance suite, with no line of the
// library changed. Its math is the reference backend's (it delegates), so what is tested is the
// plumbing: registry entry -> device services -> pools -> plan -> forward.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/runtime/attention_runtime.h"
#include "tests/conformance/conformance.h"
#include "tests/test_util.h"

using namespace attnrt;

namespace {

constexpr const char* kName = "test_plugin";

// Host memory, but the plug-in's own: counts what it made, so a test sees the runtime asked it.
class PluginServices final : public DeviceServices {
 public:
  DeviceKind kind() const override { return DeviceKind::cpu; }
  CudaDeviceInfo probe() const override { return {}; }
  KVStorage make_kv_storage(const ModelSpec& model, const KVCacheConfig& config) const override {
    KVStorage s = make_host_kv_storage(model, config);
    ++kv_storages;
    last_cache = s.cache.get();
    return s;
  }
  std::unique_ptr<LinearStateMemory> make_linear_state_memory(const KVCache&) const override {
    ++linear_memories;
    return make_host_linear_state_memory();
  }
  mutable int kv_storages = 0, linear_memories = 0;
  mutable const KVCache* last_cache = nullptr;
};

// Plans and runs through a reference backend built on the same context.
class PluginBackend final : public AttentionBackend {
 public:
  explicit PluginBackend(const BackendContext& ctx)
      : AttentionBackend(ctx), inner_(Registry::global().get("reference").factory(ctx)) {}
  std::string_view name() const override { return kName; }
  void init_forward_metadata(const ForwardBatch& batch) override {
    ++plans;
    inner_->init_forward_metadata(batch);
  }
  void forward_decode(const AttnArgs& a, const LayerSpec& l, const ForwardBatch& b) override {
    inner_->forward_decode(a, l, b);
  }
  void forward_extend(const AttnArgs& a, const LayerSpec& l, const ForwardBatch& b) override {
    inner_->forward_extend(a, l, b);
  }
  static inline int plans = 0;

 private:
  std::unique_ptr<AttentionBackend> inner_;
};

class BackendPlugin : public testing::Test {
 protected:
  void SetUp() override {
    services = std::make_shared<PluginServices>();
    BackendEntry e;
    e.name = kName;
    e.summary = "a test's backend: the reference's math behind its own device services";
    e.caps = Registry::global().get("reference").caps;
    e.caps.linear_kinds.clear();
    e.auto_selectable = false;
    e.unavailable_reason = [] { return std::string(); };
    e.factory = [](const BackendContext& ctx) -> std::unique_ptr<AttentionBackend> {
      return std::make_unique<PluginBackend>(ctx);
    };
    e.device = services;
    Registry::global().add(std::move(e));
  }
  void TearDown() override { Registry::global().remove(kName); }

  std::shared_ptr<PluginServices> services;
};

TEST_F(BackendPlugin, PassesTheConformanceSuite) {
  const uint64_t seed = std::random_device{}();
  const conformance::ConformanceReport report =
      conformance::run_conformance(kName, 2, seed, {}, Registry::global());
  int run = 0;
  for (const conformance::FeatureReport& f : report.features) {
    EXPECT_EQ(f.failures, 0) << conformance::feature_name(f.feature) << " (seed " << seed
                             << "): " << f.first_failure;
    run += f.skipped ? 0 : 1;
  }
  EXPECT_TRUE(report.ok());
  // It claims the reference's attention features, so most of the suite runs.
  EXPECT_GE(run, static_cast<int>(report.features.size()) / 2);
}

// Two runtimes, one on the plug-in and one on the reference, fed the same random steps: the
// plug-in's runtime takes its pools from the plug-in's services and gives the same outputs.
TEST_F(BackendPlugin, RuntimeTakesItsPoolsFromTheBackendsServices) {
  const ModelSpec m =
      test::make_model("tiny-gqa", DType::f32, 128,
                       {test::attention_layer(0, 4, 2, 32), test::attention_layer(1, 4, 2, 32)});
  RuntimeConfig c;
  c.max_requests = 4;
  c.kv_slots = 512;
  c.max_num_tokens = 128;
  Options plugin_opts, ref_opts;
  plugin_opts.attention_backend = kName;
  ref_opts.attention_backend = "reference";
  AttentionRuntime plugin(m, plugin_opts, c), ref(m, ref_opts, c);
  EXPECT_EQ(services->kv_storages, 1);
  EXPECT_EQ(services->last_cache, &plugin.kv_cache());
  EXPECT_EQ(&kv_pool_services(plugin.selection()), services.get());
  const int plans_before = PluginBackend::plans;

  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<int64_t> rows;
  std::vector<int32_t> lens;
  std::vector<int64_t> last;
  for (int i = 0; i < 3; ++i) {
    rows.push_back(plugin.req_to_token().alloc());
    EXPECT_EQ(ref.req_to_token().alloc(), rows.back());
  }
  // A ragged prefill, then two decode steps.
  const std::vector<std::vector<int32_t>> steps = {{7, 19, 3}, {1, 1, 1}, {1, 1, 1}};
  std::vector<int32_t> prefix(rows.size(), 0);
  for (size_t s = 0; s < steps.size(); ++s) {
    const bool decode = s > 0;
    std::vector<int32_t> seq(rows.size());
    std::vector<int64_t> last_loc(rows.size(), -1);
    for (size_t i = 0; i < rows.size(); ++i) seq[i] = prefix[i] + steps[s][i];
    std::vector<int64_t> slots[2];
    AttentionRuntime* rts[2] = {&plugin, &ref};
    for (int r = 0; r < 2; ++r) {
      if (decode) {
        for (size_t i = 0; i < rows.size(); ++i)
          last_loc[i] = rts[r]->req_to_token().row_ptr(static_cast<int>(rows[i]))[prefix[i] - 1];
      }
      slots[r] = decode ? rts[r]->allocator().alloc_decode(seq, last_loc)
                        : rts[r]->allocator().alloc_extend(prefix, seq, last_loc);
      size_t at = 0;
      for (size_t i = 0; i < rows.size(); ++i) {
        const std::vector<int64_t> mine(slots[r].begin() + at, slots[r].begin() + at + steps[s][i]);
        rts[r]->req_to_token().write(static_cast<int>(rows[i]), prefix[i], mine);
        at += mine.size();
      }
    }
    ASSERT_EQ(slots[0], slots[1]);
    ForwardBatch batch = decode ? make_decode_batch(rows, seq)
                                : make_extend_batch(rows, prefix, steps[s]);
    batch.out_cache_loc = slots[0];
    const int64_t T = static_cast<int64_t>(slots[0].size());
    plugin.begin_step(batch);
    ref.begin_step(batch);
    for (const LayerSpec& l : m.layers) {
      const int64_t hq = l.num_q_heads, hkv = l.num_kv_heads, d = l.head_dim, dv = l.v_head_dim;
      std::vector<float> q(T * hq * d), k(T * hkv * d), v(T * hkv * dv);
      for (auto* x : {&q, &k, &v})
        for (float& e : *x) e = u(rng);
      std::vector<float> out[2] = {std::vector<float>(T * hq * dv, NAN),
                                   std::vector<float>(T * hq * dv, NAN)};
      for (int r = 0; r < 2; ++r) {
        AttnArgs a;
        a.q = TensorView(q.data(), DType::f32, {T, hq, d});
        a.k = TensorView(k.data(), DType::f32, {T, hkv, d});
        a.v = TensorView(v.data(), DType::f32, {T, hkv, dv});
        a.out = TensorView(out[r].data(), DType::f32, {T, hq, dv});
        rts[r]->forward(l.layer_id, a);
      }
      for (size_t e = 0; e < out[0].size(); ++e) {
        ASSERT_FALSE(std::isnan(out[0][e])) << "layer " << l.layer_id << " element " << e;
        ASSERT_EQ(out[0][e], out[1][e]) << "layer " << l.layer_id << " element " << e;
      }
    }
    plugin.end_step();
    ref.end_step();
    prefix = seq;
  }
  EXPECT_EQ(PluginBackend::plans - plans_before, static_cast<int>(steps.size()));
}

TEST_F(BackendPlugin, RemovedBackendIsUnknownAgain) {
  Registry::global().remove(kName);
  EXPECT_EQ(Registry::global().find(kName), nullptr);
  EXPECT_THROW(Registry::global().remove(kName), Error);
  SetUp();  // TearDown removes it again
  EXPECT_NE(Registry::global().find(kName), nullptr);
}

}  // namespace
