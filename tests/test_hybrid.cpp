// HybridAttnBackend routing (reference-semantics §6) and create_backend's construction rules, with
// two recording backends registered under different names in a test-local registry.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/hybrid_attn_backend.h"
#include "attnrt/backend/options.h"
#include "attnrt/backend/registry.h"
#include "attnrt/backend/selection.h"
#include "attnrt/core/error.h"

using namespace attnrt;

namespace {

struct Call {
  std::string backend;
  std::string method;
  ForwardMode mode = ForwardMode::IDLE;
  int a = 0, b = 0;
  bool operator==(const Call&) const = default;
};

std::ostream& operator<<(std::ostream& os, const Call& c) {
  return os << c.backend << "." << c.method << "(" << forward_mode_name(c.mode) << ", " << c.a
            << ", " << c.b << ")";
}

// Records every call it receives; does no attention math.
class Recorder final : public AttentionBackend {
 public:
  Recorder(const BackendContext& ctx, std::string name, std::vector<Call>* log, int fill)
      : AttentionBackend(ctx), name_(std::move(name)), log_(log), fill_(fill) {}

  std::string_view name() const override { return name_; }
  void init_forward_metadata(const ForwardBatch& batch) override {
    log_->push_back({name_, "init_forward_metadata", batch.mode});
  }
  void forward(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch) override {
    log_->push_back({name_, "forward", batch.mode});
    AttentionBackend::forward(args, layer, batch);
  }
  void forward_decode(const AttnArgs&, const LayerSpec&, const ForwardBatch& batch) override {
    log_->push_back({name_, "forward_decode", batch.mode});
  }
  void forward_extend(const AttnArgs&, const LayerSpec&, const ForwardBatch& batch) override {
    log_->push_back({name_, "forward_extend", batch.mode});
  }
  void init_cuda_graph_state(int max_bs, int max_num_tokens) override {
    log_->push_back({name_, "init_cuda_graph_state", ForwardMode::IDLE, max_bs, max_num_tokens});
  }
  void init_forward_metadata_capture_cuda_graph(int bs, int num_tokens,
                                                const ForwardBatch& batch) override {
    log_->push_back({name_, "capture", batch.mode, bs, num_tokens});
  }
  void init_forward_metadata_replay_cuda_graph(int bs, int raw_bs,
                                               const ForwardBatch& batch) override {
    log_->push_back({name_, "replay", batch.mode, bs, raw_bs});
  }
  int cuda_graph_seq_len_fill_value() const override { return fill_; }

 private:
  std::string name_;
  std::vector<Call>* log_;
  int fill_;
};

constexpr ForwardMode kAllModes[] = {ForwardMode::EXTEND,         ForwardMode::DECODE,
                                     ForwardMode::MIXED,          ForwardMode::IDLE,
                                     ForwardMode::TARGET_VERIFY,  ForwardMode::DRAFT_EXTEND,
                                     ForwardMode::DRAFT_EXTEND_V2};

// The mid-line table of §6.1, its rows grouped by answer: true = the decode backend serves the
// mode.
bool decode_serves(ForwardMode mode, bool spec_mode_decode) {
  switch (mode) {
    case ForwardMode::DECODE:
    case ForwardMode::IDLE:
      return true;
    case ForwardMode::TARGET_VERIFY:
    case ForwardMode::DRAFT_EXTEND:
      return spec_mode_decode;
    case ForwardMode::EXTEND:
    case ForwardMode::MIXED:
    case ForwardMode::DRAFT_EXTEND_V2:
      return false;
  }
  ADD_FAILURE() << "mode missing from the table";
  return false;
}

struct Fixture {
  std::vector<Call> log;
  Options options;
  BackendContext ctx;
  std::mt19937 rng{std::random_device{}()};

  explicit Fixture(const std::string& spec_mode, int spec_steps = 0) {
    options.speculative_attention_mode = spec_mode;
    options.speculative_num_steps = spec_steps;
    ctx.options = &options;
  }
  std::unique_ptr<HybridAttnBackend> make(int prefill_fill = 0, int decode_fill = 1) {
    return std::make_unique<HybridAttnBackend>(
        ctx, std::make_unique<Recorder>(ctx, "alpha", &log, prefill_fill),
        std::make_unique<Recorder>(ctx, "beta", &log, decode_fill));
  }
  int random(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
};

ForwardBatch batch_of(ForwardMode mode) {
  ForwardBatch b;
  b.mode = mode;
  return b;
}

}  // namespace

TEST(HybridAttnBackend, RoutesEveryModeByTheTableUnderBothSpeculativeModes) {
  for (const char* spec_mode : {"prefill", "decode"}) {
    const bool spec_decode = std::string(spec_mode) == "decode";
    Fixture f(spec_mode, /*spec_steps=*/3);
    auto hybrid = f.make();
    for (ForwardMode mode : kAllModes) {
      SCOPED_TRACE(fmt::format("mode {} with speculative_attention_mode {}",
                               forward_mode_name(mode), spec_mode));
      const std::string expected = decode_serves(mode, spec_decode) ? "beta" : "alpha";
      const ForwardBatch batch = batch_of(mode);
      EXPECT_EQ(&hybrid->select(mode), decode_serves(mode, spec_decode)
                                           ? &hybrid->decode_backend()
                                           : &hybrid->prefill_backend());

      f.log.clear();
      hybrid->init_forward_metadata(batch);
      EXPECT_EQ(f.log, (std::vector<Call>{{expected, "init_forward_metadata", mode}}));

      // forward goes to the selected backend, whose own dispatch then picks decode / extend
      // (IDLE: nothing).
      f.log.clear();
      hybrid->forward(AttnArgs{}, LayerSpec{}, batch);
      std::vector<Call> want = {{expected, "forward", mode}};
      if (mode == ForwardMode::DECODE) want.push_back({expected, "forward_decode", mode});
      if (mode != ForwardMode::DECODE && mode != ForwardMode::IDLE) {
        want.push_back({expected, "forward_extend", mode});
      }
      EXPECT_EQ(f.log, want);

      f.log.clear();
      hybrid->forward_extend(AttnArgs{}, LayerSpec{}, batch);
      EXPECT_EQ(f.log, (std::vector<Call>{{expected, "forward_extend", mode}}));

      // forward_decode always belongs to the decode backend, whatever the mode says.
      f.log.clear();
      hybrid->forward_decode(AttnArgs{}, LayerSpec{}, batch);
      EXPECT_EQ(f.log, (std::vector<Call>{{"beta", "forward_decode", mode}}));

      const int bs = f.random(1, 512), tokens = f.random(1, 4096), raw_bs = f.random(1, bs);
      f.log.clear();
      hybrid->init_forward_metadata_capture_cuda_graph(bs, tokens, batch);
      hybrid->init_forward_metadata_replay_cuda_graph(bs, raw_bs, batch);
      EXPECT_EQ(f.log, (std::vector<Call>{{expected, "capture", mode, bs, tokens},
                                          {expected, "replay", mode, bs, raw_bs}}));
    }
  }
}

TEST(HybridAttnBackend, GraphStateGoesToDecodeAlwaysAndToPrefillOnlyForVerifyInPrefillMode) {
  struct Case {
    const char* spec_mode;
    int spec_steps;
    bool prefill_too;
  };
  const Case cases[] = {
      {"prefill", 0, false}, {"decode", 0, false}, {"prefill", 4, true}, {"decode", 4, false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(
        fmt::format("speculative_attention_mode {}, num_steps {}", c.spec_mode, c.spec_steps));
    Fixture f(c.spec_mode, c.spec_steps);
    auto hybrid = f.make();
    const int max_bs = f.random(1, 256), max_tokens = max_bs * f.random(1, 16);
    hybrid->init_cuda_graph_state(max_bs, max_tokens);
    std::vector<Call> want = {
        {"beta", "init_cuda_graph_state", ForwardMode::IDLE, max_bs, max_tokens}};
    if (c.prefill_too) {
      want.push_back({"alpha", "init_cuda_graph_state", ForwardMode::IDLE, max_bs, max_tokens});
    }
    EXPECT_EQ(f.log, want);
  }
}

TEST(HybridAttnBackend, FillValueIsTheDecodeBackends) {
  Fixture f("prefill");
  const int a = f.random(0, 1000);
  const int b = a + f.random(1, 1000);
  EXPECT_EQ(f.make(a, b)->cuda_graph_seq_len_fill_value(), b);
  EXPECT_EQ(f.make(b, a)->cuda_graph_seq_len_fill_value(), a);
}

TEST(HybridAttnBackend, RejectsMissingOptionsOrBackendsAndABadSpeculativeMode) {
  std::vector<Call> log;
  BackendContext no_options;
  try {
    HybridAttnBackend h(no_options, std::make_unique<Recorder>(no_options, "alpha", &log, 1),
                        std::make_unique<Recorder>(no_options, "beta", &log, 1));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("BackendContext::options is null"), std::string::npos)
        << e.what();
  }
  Options options;
  options.speculative_attention_mode = "verify";
  BackendContext ctx;
  ctx.options = &options;
  try {
    HybridAttnBackend h(ctx, std::make_unique<Recorder>(ctx, "alpha", &log, 1),
                        std::make_unique<Recorder>(ctx, "beta", &log, 1));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--speculative-attention-mode 'verify'"),
              std::string::npos)
        << e.what();
  }
  options.speculative_attention_mode = "decode";
  try {
    HybridAttnBackend h(ctx, std::make_unique<Recorder>(ctx, "alpha", &log, 1), nullptr);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("decode null"), std::string::npos) << e.what();
  }
}

namespace {

// A registry whose factories count their calls; "reference" must never be built here.
struct CountingRegistry {
  Registry registry;
  std::vector<Call> log;
  std::map<std::string, int> created;

  CountingRegistry() {
    for (const char* name : {"alpha", "beta", "reference"}) {
      BackendEntry e;
      e.name = name;
      e.summary = "test recorder";
      e.caps.devices = {DeviceKind::cpu};
      e.caps.kv_dtypes = {DType::bf16};
      e.auto_selectable = std::string(name) != "reference";
      e.factory = [this, n = std::string(name)](const BackendContext& ctx) {
        created[n]++;
        return std::make_unique<Recorder>(ctx, n, &log, 1);
      };
      registry.add(std::move(e));
    }
  }
};

}  // namespace

TEST(CreateBackend, BuildsOnlyTheChosenBackendsAndWrapsDifferingPhases) {
  CountingRegistry r;
  Options options;
  options.speculative_attention_mode = "decode";
  BackendContext ctx;
  ctx.options = &options;

  Selection same;
  same.prefill = same.decode = "alpha";
  auto single = create_backend(same, ctx, r.registry);
  EXPECT_EQ(single->name(), "alpha");
  EXPECT_EQ(dynamic_cast<HybridAttnBackend*>(single.get()), nullptr);
  EXPECT_EQ(r.created, (std::map<std::string, int>{{"alpha", 1}}));

  Selection split;
  split.prefill = "beta";
  split.decode = "alpha";
  auto built = create_backend(split, ctx, r.registry);
  auto* hybrid = dynamic_cast<HybridAttnBackend*>(built.get());
  ASSERT_NE(hybrid, nullptr);
  EXPECT_EQ(hybrid->prefill_backend().name(), "beta");
  EXPECT_EQ(hybrid->decode_backend().name(), "alpha");
  // Verify goes to the decode backend under the context's speculative_attention_mode.
  EXPECT_EQ(hybrid->select(ForwardMode::TARGET_VERIFY).name(), "alpha");
  EXPECT_EQ(r.created, (std::map<std::string, int>{{"alpha", 2}, {"beta", 1}}));
}

TEST(CreateBackend, RejectsUnresolvedUnknownAndLinearSelections) {
  CountingRegistry r;
  Options options;
  BackendContext ctx;
  ctx.options = &options;
  auto expect_error = [&](const Selection& sel, const std::string& needle) {
    try {
      create_backend(sel, ctx, r.registry);
      ADD_FAILURE() << "expected an error containing: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(Selection{}, "call resolve_backends first");
  Selection unknown;
  unknown.prefill = unknown.decode = "gamma";
  expect_error(unknown, "unknown attention backend 'gamma'");
  Selection linear;
  linear.prefill = linear.decode = "alpha";
  linear.linear_prefill = linear.linear_decode = "beta";
  expect_error(linear, "HybridLinearAttnBackend");
  EXPECT_TRUE(r.created.empty());
}
