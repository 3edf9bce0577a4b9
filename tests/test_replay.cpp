// Replay cases: a step captured from live pools and replayed on fresh ones gives the same output,
// bit for bit, with the backend that ran it.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "tests/test_util.h"
#include "attnrt/runtime/attention_runtime.h"
#include "src/model/layer_builders.h"
#include "tools/io/case_file.h"

using namespace attnrt;

namespace {

using attnrt::test::expect_error;
using attnrt::test::random_buffer;

// Three differently shaped layers: MQA full, a sliding-window layer (so the model is SWA-hybrid
// and the capture reads through the full->SWA slot map), and a layer with v_head_dim != head_dim,
// custom scaling, a soft-cap and sinks.
ModelSpec test_model(DType act) {
  ModelSpec m;
  m.name = "replay-test";
  m.dtype = act;
  m.max_context_len = 512;
  LayerSpec a;
  a.layer_id = 0;
  a.num_q_heads = 4;
  a.num_kv_heads = 1;
  a.head_dim = 32;
  a.v_head_dim = 32;
  LayerSpec b = a;
  b.layer_id = 1;
  b.kind = LayerKind::swa;
  b.num_kv_heads = 2;
  b.sliding_window = 7;
  LayerSpec c = a;
  c.layer_id = 2;
  c.num_q_heads = 6;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.v_head_dim = 24;
  c.scaling = 0.3f;
  c.logit_cap = 5.f;
  c.has_sinks = true;
  m.layers = {a, b, c};
  return m;
}

bool same_bytes(const HostBuffer& a, const HostBuffer& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

// A small engine: pools, allocator, request rows and the reference backend; runs every KV layer
// of a step with fresh random q/k/v and keeps the call of one layer.
class Engine {
 public:
  Engine(ModelSpec model, int page_size, DType kv_dtype, uint32_t seed)
      : model_(std::move(model)), rng_(seed) {
    options_.attention_backend = "reference";
    options_.page_size = page_size;
    options_.kv_cache_dtype = std::string(dtype_name(kv_dtype));
    KVCacheConfig cfg;
    cfg.full_slots = 64 * page_size + 256;
    cfg.swa_slots = cfg.full_slots;
    cfg.page_size = page_size;
    cfg.dtype = kv_dtype;
    storage_ = make_host_kv_storage(model_, cfg);
    req_to_token_ = std::make_unique<ReqToTokenPool>(8, model_.max_context_len);
    BackendContext ctx;
    ctx.model = &model_;
    ctx.options = &options_;
    ctx.kv_cache = storage_.cache.get();
    ctx.req_to_token = req_to_token_.get();
    backend_ = Registry::global().get("reference").factory(ctx);
  }

  void set_scales(float k_scale, float v_scale) {
    for (const auto& l : model_.layers) storage_.cache->set_kv_scales(l.layer_id, k_scale, v_scale);
  }

  int new_request() {
    const int row = req_to_token_->alloc();
    slots_[row] = {};
    return row;
  }

  // Allocates slots for `extend` new tokens of each request after its current tokens and writes
  // them into req_to_token; returns them request-major (the step's out_cache_loc).
  std::vector<int64_t> allocate(const std::vector<int64_t>& rows,
                                const std::vector<int32_t>& extend) {
    std::vector<int32_t> prefix, seq;
    std::vector<int64_t> last;
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& s = slots_[static_cast<int>(rows[i])];
      prefix.push_back(static_cast<int32_t>(s.size()));
      seq.push_back(static_cast<int32_t>(s.size()) + extend[i]);
      last.push_back(s.empty() ? -1 : s.back());
    }
    std::vector<int64_t> out = storage_.allocator->alloc_extend(prefix, seq, last);
    size_t at = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      auto& s = slots_[static_cast<int>(rows[i])];
      std::vector<int64_t> mine(out.begin() + at, out.begin() + at + extend[i]);
      req_to_token_->write(static_cast<int>(rows[i]), static_cast<int>(s.size()), mine);
      s.insert(s.end(), mine.begin(), mine.end());
      at += extend[i];
    }
    return out;
  }

  // An EXTEND step of `new_tokens` tokens after `prefix` for each of `rows`, its slots allocated.
  ForwardBatch extend(const std::vector<int64_t>& rows, const std::vector<int32_t>& prefix,
                      const std::vector<int32_t>& new_tokens) {
    ForwardBatch b = make_extend_batch(rows, prefix, new_tokens);
    b.out_cache_loc = allocate(rows, new_tokens);
    return b;
  }

  int32_t len(int64_t row) const {
    return static_cast<int32_t>(slots_.at(static_cast<int>(row)).size());
  }

  struct Call {
    HostBuffer q, k, v, out, lse;
    std::vector<float> sinks;
    AttnArgs args;
  };

  // Runs the step on every KV layer; returns the call of `keep_layer`. With save_kv false that
  // layer's K/V are stored first and the call passes no k/v (cross-layer sharing).
  Call run(const ForwardBatch& batch, int keep_layer, bool save_kv = true) {
    storage_.cache->begin_step(batch);
    backend_->init_forward_metadata(batch);
    const int64_t t = batch.num_tokens();
    Call kept;
    for (const auto& l : model_.layers) {
      Call call;
      call.q = random_buffer(model_.dtype, {t, l.num_q_heads, l.head_dim}, rng_);
      call.k = random_buffer(model_.dtype, {t, l.num_kv_heads, l.head_dim}, rng_);
      call.v = random_buffer(model_.dtype, {t, l.num_kv_heads, l.v_head_dim}, rng_);
      call.out = HostBuffer(model_.dtype, {t, l.num_q_heads, l.v_head_dim});
      call.lse = HostBuffer(DType::f32, {t, l.num_q_heads});
      call.args.q = call.q.view();
      call.args.k = call.k.view();
      call.args.v = call.v.view();
      call.args.out = call.out.view();
      call.args.lse = call.lse.view();
      if (l.has_sinks) {
        std::normal_distribution<float> dist(0.f, 1.f);
        for (int h = 0; h < l.num_q_heads; ++h) call.sinks.push_back(dist(rng_));
        call.args.sinks = call.sinks.data();
      }
      if (l.layer_id == keep_layer && !save_kv) {
        storage_.cache->store_step_kv(l.layer_id, call.args.k, call.args.v);
        call.args.k = TensorView();
        call.args.v = TensorView();
        call.args.save_kv = false;
      }
      backend_->forward(call.args, l, batch);
      if (l.layer_id == keep_layer) kept = std::move(call);
    }
    // The views point into the buffers, which moved with the Call; refresh them.
    kept.args.q = kept.q.view();
    kept.args.out = kept.out.view();
    kept.args.lse = kept.lse.view();
    if (kept.args.save_kv) {
      kept.args.k = kept.k.view();
      kept.args.v = kept.v.view();
    }
    if (!kept.sinks.empty()) kept.args.sinks = kept.sinks.data();
    return kept;
  }

  const ModelSpec& model() const { return model_; }
  const Options& options() const { return options_; }
  const ReqToTokenPool& req_to_token() const { return *req_to_token_; }
  const KVCache& cache() const { return *storage_.cache; }
  std::mt19937& rng() { return rng_; }

 private:
  ModelSpec model_;
  Options options_;
  KVStorage storage_;
  std::unique_ptr<ReqToTokenPool> req_to_token_;
  std::unique_ptr<AttentionBackend> backend_;
  std::map<int, std::vector<int64_t>> slots_;
  std::mt19937 rng_;
};

class ReplayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("attnrt_replay_" + std::to_string(std::random_device{}()));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes the kept call as a case, reads it back and replays it with the reference backend:
  // out and lse must equal the direct run's bit for bit.
  void check_round_trip(Engine& e, const ForwardBatch& batch, int layer, const Engine::Call& call) {
    const std::string dir = dir_.string();
    write_step_case(dir, e.model(), layer, e.options(), batch, e.req_to_token(), e.cache(),
                    call.args, "reference");
    const Case c = read_case(dir);
    EXPECT_EQ(c.layer.layer_id, layer);
    EXPECT_EQ(c.batch.mode, batch.mode);
    EXPECT_EQ(c.batch.out_cache_loc, batch.out_cache_loc);
    EXPECT_EQ(c.batch.positions, batch.positions);
    EXPECT_EQ(c.batch.spec_info.has_value(), batch.spec_info.has_value());
    if (batch.spec_info) EXPECT_EQ(c.batch.spec_info->parents, batch.spec_info->parents);
    EXPECT_EQ(c.backend, "reference");
    EXPECT_EQ(c.save_kv, call.args.save_kv);
    ASSERT_TRUE(c.expected_out.has_value());

    const ReplayResult r = replay_case(c, "reference", /*want_lse=*/true);
    EXPECT_TRUE(same_bytes(r.out, call.out)) << "replayed output differs from the direct run";
    EXPECT_TRUE(same_bytes(r.lse, call.lse)) << "replayed lse differs from the direct run";
    // expected_out is the direct output widened to float32.
    const float* want = c.expected_out->as<float>();
    for (int64_t i = 0; i < r.out.numel(); ++i) {
      ASSERT_EQ(load_as_float(r.out.data(), r.out.dtype(), static_cast<size_t>(i)), want[i]) << i;
    }

    write_replay_result(dir, r);
    const NpyArray out = read_npy((dir_ / "out.npy").string());
    EXPECT_EQ(out.bytes, c.expected_out->bytes);
    EXPECT_TRUE(std::filesystem::exists(dir_ / "lse.npy"));
  }

  std::filesystem::path dir_;
};

std::vector<int32_t> random_lens(std::mt19937& rng, int n, int lo, int hi) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(std::uniform_int_distribution<int>(lo, hi)(rng));
  return v;
}

}  // namespace

TEST_F(ReplayTest, ExtendWithPrefixReplaysBitExactOnEveryLayer) {
  for (int layer = 0; layer < 3; ++layer) {
    SCOPED_TRACE(layer);
    Engine e(test_model(DType::bf16), 16, DType::bf16, 100 + layer);
    std::vector<int64_t> rows = {e.new_request(), e.new_request(), e.new_request()};
    const auto prefix = random_lens(e.rng(), 3, 1, 40);
    ForwardBatch prefill = e.extend(rows, {0, 0, 0}, prefix);
    e.run(prefill, layer);

    const auto extend = random_lens(e.rng(), 3, 1, 12);
    ForwardBatch step = e.extend(rows, prefix, extend);
    const Engine::Call call = e.run(step, layer);
    check_round_trip(e, step, layer, call);
  }
}

// An MLA layer's MHA-form dims and the MLA form's options survive write_case / read_case, and the
// case still replays (absorbed) bit for bit.
TEST_F(ReplayTest, MlaCaseKeepsItsMhaFormDimsAndOptions) {
  LayerSpec layer = layer_builders::mla_layer(0, 4, 512, 64);
  layer.qk_nope_head_dim = 128;
  layer.mha_v_head_dim = 96;
  const ModelSpec model = test::make_model("mla", DType::f32, 64, {layer});
  Options o;
  o.attention_backend = "reference";
  o.page_size = 16;
  o.disable_chunked_prefix_cache = true;
  o.chunked_prefix_cache_threshold = 4096;
  o.max_chunk_capacity = 1024;
  AttentionRuntime rt(model, o, test::host_config(2, 64, 16));
  const auto [row, slots] = test::new_request(rt, 5);
  ForwardBatch batch = make_extend_batch({row}, {0}, {5});
  batch.out_cache_loc = slots;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  HostBuffer q(DType::f32, {5, 4, 576}), k(DType::f32, {5, 1, 576}), out(DType::f32, {5, 4, 512});
  for (HostBuffer* b : {&q, &k}) {
    for (int64_t i = 0; i < b->numel(); ++i) b->ptr<float>()[i] = normal(rng);
  }
  AttnArgs args;
  args.q = q.view();
  args.k = k.view();
  args.out = out.view();
  rt.begin_step(batch);
  rt.forward(0, args);
  write_step_case(dir_.string(), model, 0, o, batch, rt.req_to_token(), rt.kv_cache(), args,
                  "reference");
  rt.end_step();

  const Case c = read_case(dir_.string());
  EXPECT_EQ(c.layer.kind, LayerKind::mla);
  EXPECT_EQ(c.layer.kv_lora_rank, 512);
  EXPECT_EQ(c.layer.qk_rope_head_dim, 64);
  EXPECT_EQ(c.layer.qk_nope_head_dim, 128);
  EXPECT_EQ(c.layer.mha_v_head_dim, 96);
  EXPECT_TRUE(c.layer.has_mha_form());
  EXPECT_TRUE(c.options.disable_chunked_prefix_cache);
  EXPECT_EQ(c.options.chunked_prefix_cache_threshold, 4096);
  EXPECT_EQ(c.options.max_chunk_capacity, 1024);
  const ReplayResult r = replay_case(c, "reference");
  EXPECT_TRUE(same_bytes(r.out, out)) << "replayed output differs from the direct run";
}

TEST_F(ReplayTest, DecodeWithFp8ScaledCacheReplaysBitExact) {
  Engine e(test_model(DType::f16), 1, DType::e4m3, 7);
  e.set_scales(0.5f, 2.f);
  std::vector<int64_t> rows = {e.new_request(), e.new_request()};
  const auto prefix = random_lens(e.rng(), 2, 3, 30);
  ForwardBatch prefill = e.extend(rows, {0, 0}, prefix);
  e.run(prefill, 1);

  ForwardBatch step = make_decode_batch(rows, {prefix[0] + 1, prefix[1] + 1});
  step.out_cache_loc = e.allocate(rows, {1, 1});
  const Engine::Call call = e.run(step, 1);
  check_round_trip(e, step, 1, call);
  const Case c = read_case(dir_.string());
  EXPECT_EQ(c.kv_dtype, DType::e4m3);
  EXPECT_EQ(c.k_scale, 0.5f);
  EXPECT_EQ(c.v_scale, 2.f);
}

TEST_F(ReplayTest, TreeVerifyKeepsSpecInfo) {
  Engine e(test_model(DType::bf16), 4, DType::bf16, 21);
  std::vector<int64_t> rows = {e.new_request(), e.new_request()};
  const auto prefix = random_lens(e.rng(), 2, 5, 25);
  ForwardBatch prefill = e.extend(rows, {0, 0}, prefix);
  e.run(prefill, 2);

  SpecInfo spec;
  spec.draft_token_num = 4;
  spec.topk = 2;
  spec.parents = {-1, 0, 0, 1, -1, 0, 1, 1};
  ForwardBatch step = make_verify_batch(rows, prefix, spec);
  step.out_cache_loc = e.allocate(rows, {4, 4});
  const Engine::Call call = e.run(step, 2);
  check_round_trip(e, step, 2, call);
}

TEST_F(ReplayTest, StepWithoutKvReadsThePoolRows) {
  Engine e(test_model(DType::bf16), 2, DType::bf16, 33);
  std::vector<int64_t> rows = {e.new_request()};
  ForwardBatch prefill = e.extend(rows, {0}, {9});
  e.run(prefill, 0);
  ForwardBatch step = e.extend(rows, {9}, {5});
  const Engine::Call call = e.run(step, 0, /*save_kv=*/false);
  check_round_trip(e, step, 0, call);
  EXPECT_FALSE(std::filesystem::exists(dir_ / "k.npy"));
}

TEST_F(ReplayTest, BadCasesNameTheFileAndField) {
  Engine e(test_model(DType::bf16), 1, DType::bf16, 5);
  std::vector<int64_t> rows = {e.new_request()};
  ForwardBatch step = e.extend(rows, {0}, {6});
  const Engine::Call call = e.run(step, 0);
  const std::string dir = dir_.string();
  write_step_case(dir, e.model(), 0, e.options(), step, e.req_to_token(), e.cache(), call.args,
                  "reference");

  expect_error([&] { replay_case(read_case(dir), "no-such-backend"); },
               {"unknown attention backend 'no-such-backend'"});
  expect_error([&] { read_case((dir_ / "nowhere").string()); }, {"does not exist"});

  // A K cache whose rows do not match the layer.
  const NpyArray good_k = read_npy((dir_ / "k_cache.npy").string());
  std::vector<int64_t> shape = good_k.shape;
  shape[2] += 1;
  const std::vector<uint16_t> wider(static_cast<size_t>(shape[0] * shape[1] * shape[2]), 0x3f80);
  write_npy((dir_ / "k_cache.npy").string(), DType::bf16, shape, wider.data());
  expect_error([&] { read_case(dir); }, {"k_cache.npy: shape"});
  write_npy((dir_ / "k_cache.npy").string(), good_k);

  // Fields of case.json, each edit made to the good text.
  const std::string json_path = (dir_ / "case.json").string();
  const std::string text = test::read_text(json_path);
  struct Edit {
    const char *from, *to, *expect;
  };
  const Edit edits[] = {
      {"\"version\": 1", "\"version\": 9", "case format version 9 is not supported"},
      {"\"num_q_heads\": 4", "\"num_q_heads\": \"four\"",
       "field 'layer.num_q_heads' has the wrong type"},
      {"\"kind\": \"full\"", "\"kind\": \"dense\"", "layer.kind 'dense'"},
      {"\"mode\": \"EXTEND\"", "\"mode\": \"SIDEWAYS\"", "SIDEWAYS"},
      {"\"save_kv\": true", "\"save_kv_typo\": true", "missing field 'save_kv'"},
      {"{", "{{", "case.json: malformed JSON"},
      // Issue 21 (fuzz_case): the JSON parser's out_of_range escaped as another exception type.
      {"\"version\": 1", "\"version\": 1e999", "case.json: malformed JSON"},
      // Issue 21 (fuzz_case, long run): a "format" that is not a string made nlohmann's value()
      // throw type_error, which escaped as another exception type.
      {"\"format\": \"attnrt-case\"", "\"format\": {\"x\": 1}", "not an attnrt case"},
      // Issue 21 (fuzz_case, second long run): a float past int64 read as an integer field was
      // converted by a plain cast (UBSan: undefined behaviour); whole numbers in range only.
      {"\"num_q_heads\": 4", "\"num_q_heads\": 1.3e58", "expected whole numbers"},
      {"\"num_q_heads\": 4", "\"num_q_heads\": 4.5", "expected whole numbers"},
      {"\"num_q_heads\": 4", "\"num_q_heads\": 4294967296", "expected whole numbers"},
      // Issue 21 (fuzz_case, third long run): the same cast in the elements of an integer array.
      {"\"seq_lens\": [", "\"seq_lens\": [1e300, ", "expected whole numbers"},
  };
  for (const Edit& edit : edits) {
    std::string t = text;
    const size_t at = t.find(edit.from);
    EXPECT_NE(at, std::string::npos) << edit.from;
    if (at != std::string::npos) t.replace(at, std::strlen(edit.from), edit.to);
    std::ofstream(json_path, std::ios::trunc) << t;
    expect_error([&] { read_case(dir); }, {edit.expect});
  }
  std::ofstream(json_path, std::ios::trunc) << text;
  EXPECT_NO_THROW(read_case(dir));
}

TEST_F(ReplayTest, CaptureRejectsLinearAndMissingLayers) {
  Engine e(test_model(DType::bf16), 1, DType::bf16, 9);
  std::vector<int64_t> rows = {e.new_request()};
  ForwardBatch step = e.extend(rows, {0}, {3});
  const Engine::Call call = e.run(step, 0);
  try {
    capture_case(e.model(), 5, e.options(), step, e.req_to_token(), e.cache(), call.args);
    ADD_FAILURE() << "expected attnrt::Error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("layer 5 does not exist"), std::string::npos)
        << err.what();
  }
}

// `attnrt replay` end to end; ctest passes the CLI's path in ATTNRT_CLI.
TEST_F(ReplayTest, CliReplaysACaseAndReportsBitExact) {
  const char* cli = std::getenv("ATTNRT_CLI");
  if (cli == nullptr) GTEST_SKIP() << "ATTNRT_CLI is not set (run through ctest)";
  Engine e(test_model(DType::bf16), 4, DType::bf16, 77);
  std::vector<int64_t> rows = {e.new_request(), e.new_request()};
  ForwardBatch prefill = e.extend(rows, {0, 0}, {11, 6});
  e.run(prefill, 1);
  ForwardBatch step = make_decode_batch(rows, {12, 7});
  step.out_cache_loc = e.allocate(rows, {1, 1});
  const Engine::Call call = e.run(step, 1);
  const std::string dir = (dir_ / "case").string(), out = (dir_ / "replayed").string();
  write_step_case(dir, e.model(), 1, e.options(), step, e.req_to_token(), e.cache(), call.args,
                  "reference");

  auto run = [&](const std::string& args, std::string& output) {
    const std::string cmd = fmt::format("'{}' {} > '{}/log' 2>&1", cli, args, dir_.string());
    const int status = std::system(cmd.c_str());
    std::ifstream in(dir_ / "log");
    output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  std::string output;
  ASSERT_EQ(run(fmt::format("replay '{}' --lse --out '{}'", dir, out), output), 0) << output;
  EXPECT_NE(output.find("vs recorded output (reference): bit-exact"), std::string::npos) << output;
  const NpyArray replayed = read_npy(out + "/out.npy");
  EXPECT_EQ(replayed.bytes, read_case(dir).expected_out->bytes);
  EXPECT_TRUE(std::filesystem::exists(out + "/lse.npy"));

  EXPECT_EQ(run(fmt::format("replay '{}/missing'", dir_.string()), output), 2) << output;
  EXPECT_NE(output.find("does not exist"), std::string::npos) << output;
  EXPECT_EQ(run(fmt::format("replay '{}' --backend nope", dir), output), 2) << output;
  EXPECT_NE(output.find("unknown attention backend 'nope'"), std::string::npos) << output;
}
