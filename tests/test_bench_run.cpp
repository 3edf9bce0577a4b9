// End-to-end bench runs at tiny scale on the reference backend: every kind of row is built in a
// permuted paged pool, checked against the float64 recomputation, timed and reported. Nothing here
// asserts how fast anything ran.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "attnrt/memory/kv_cache.h"
#include "backends/reference/reference_backend.h"
#include "bench/harness/chart.h"
#include "bench/harness/report.h"
#include "bench/harness/runner.h"
#include "tests/test_bench_util.h"
#include "tests/test_util.h"

using namespace attnrt;
using namespace attnrt::bench;
using attnrt::test::by_name;

namespace {

Workload tiny(WorkloadKind kind, int batch, int prefix, int new_tokens, int page, DType dtype,
              int topk = 1) {
  Workload w{.kind = kind,
             .batch = batch,
             .prefix_len = prefix,
             .new_tokens = new_tokens,
             .page_size = page,
             .kv_dtype = dtype,
             .topk = topk};
  w.name = fmt::format("tiny-{}-{}x{}+{}-p{}-{}", workload_kind_name(kind), batch, prefix,
                       new_tokens, page, dtype_name(dtype));
  return w;
}

BenchConfig tiny_config(const std::string& backend) {
  BenchConfig c = test::tiny_bench_config(backend);
  c.reference_repeats = 1;
  return c;
}

// The reference backend behind another name, with a hook after every output: the default MLA
// form (absorbed only, as the cuda backend serves MLA today) and, in PerturbedBackend, a kernel
// bug.
class WrappedReference : public AttentionBackend {
 public:
  WrappedReference(const BackendContext& ctx, std::string_view name)
      : AttentionBackend(ctx), name_(name), inner_(reference_backend_entry().factory(ctx)) {}
  std::string_view name() const override { return name_; }
  void init_forward_metadata(const ForwardBatch& batch) override {
    inner_->init_forward_metadata(batch);
  }
  void forward_decode(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override {
    inner_->forward_decode(args, layer, batch);
    after(args);
  }
  void forward_extend(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) override {
    inner_->forward_extend(args, layer, batch);
    after(args);
  }

 protected:
  virtual void after(const AttnArgs& args) { (void)args; }

 private:
  std::string_view name_;
  std::unique_ptr<AttentionBackend> inner_;
};

// One output element of the last query row pushed off by a large amount: what a kernel bug looks
// like to the bench.
class PerturbedBackend final : public WrappedReference {
 public:
  explicit PerturbedBackend(const BackendContext& ctx) : WrappedReference(ctx, "perturbed") {}

 private:
  void after(const AttnArgs& args) override {
    auto* out = args.out.ptr<uint16_t>();
    const int64_t last = args.out.numel() - 1;
    out[last] = float_to_bf16(bf16_to_float(out[last]) + 4.0f);
  }
};

// The MHA-form rows of mla_workloads() shrunk to a few heads and tokens (the latent and MHA dims
// stay DeepSeek-V3's); the extend's prefix still in 4 chunks, with boundaries inside pages.
std::vector<Workload> tiny_mla_mha_rows() {
  Workload prefill = by_name(mla_workloads(), "mla-prefill-1x16384");
  prefill.q_heads = 4;
  prefill.new_tokens = 40;
  Workload extend = by_name(mla_workloads(), "mla-extend-8x4096+512");
  extend.q_heads = 4;
  extend.batch = 3;
  extend.prefix_len = 200;
  extend.new_tokens = 24;
  return {prefill, extend};
}

}  // namespace

TEST(BenchRun, TinyRowsOfEveryKindRunEndToEndOnReference) {
  BenchConfig config = tiny_config("reference");
  config.workloads = {
      tiny(WorkloadKind::decode, 3, 39, 1, 16, DType::bf16),
      tiny(WorkloadKind::decode, 2, 32, 1, 1, DType::e4m3),
      tiny(WorkloadKind::prefill, 2, 0, 24, 16, DType::bf16),
      tiny(WorkloadKind::extend, 2, 20, 12, 16, DType::bf16),
      tiny(WorkloadKind::verify_chain, 2, 30, 4, 16, DType::bf16),
      tiny(WorkloadKind::verify_tree, 2, 30, 16, 16, DType::bf16, 4),
  };
  // Small enough that the first row's reference measurement runs on a scaled-down shape.
  config.reference_max_work = 1e6;
  BenchResult r = run_bench(config);
  ASSERT_EQ(r.rows.size(), config.workloads.size());
  EXPECT_TRUE(r.all_passed());
  EXPECT_TRUE(r.ceilings.memory.available());
  EXPECT_TRUE(r.ceilings.fp32.available());
  for (const RowResult& row : r.rows) {
    SCOPED_TRACE(row.workload.name);
    EXPECT_EQ(row.status, "ok") << row.error;
    EXPECT_TRUE(row.check.passed) << row.check.max_rel_err;
    EXPECT_EQ(row.check.rows_checked, row.workload.num_tokens()) << "tiny rows are checked in full";
    EXPECT_EQ(row.time.repeats, 2);
    EXPECT_EQ(row.plan.repeats, 2);
    EXPECT_GT(row.time.median, 0);
    EXPECT_GT(row.rate, 0);
    ASSERT_TRUE(row.reference.has_value());
    EXPECT_TRUE(row.reference->check.passed);
    EXPECT_GT(row.reference->speedup, 0);
    EXPECT_EQ(row.decode_workload.has_value(), is_verify(row.workload.kind));
    if (row.decode_workload) {
      EXPECT_EQ(row.decode_workload->kv_len(), row.workload.prefix_len);
      EXPECT_GT(row.decode_ratio, 0);
    }
  }
  EXPECT_LT(r.rows[0].reference->workload.batch, 3) << "reference ran scaled down";
  EXPECT_NE(r.rows[0].reference->note.find("too long"), std::string::npos);

  RunInfo info = make_run_info("test", 1.0, "");
  nlohmann::json j = to_json(r, info);
  EXPECT_EQ(j["rows"].size(), r.rows.size());
  EXPECT_EQ(j["rows"][1]["shape"]["kv_dtype"], "fp8_e4m3");
  EXPECT_EQ(j["rows"][1]["shape"]["page_size"], 1);
  EXPECT_FALSE(j["commit"].get<std::string>().empty());
  EXPECT_NE(render_svg(r, info).find("tiny-verify-tree"), std::string::npos);
}

// MLA rows (absorbed form, one latent head of 576 columns, V its first 512) run on the cpu backend
// and pass the float64 recomputation, decode and verify, bf16 and fp8, page 64 and page 1.
TEST(BenchRun, TinyMlaRowsRunOnCpuWithTheCheckPassing) {
  BenchConfig config = tiny_config("cpu");
  auto mla = [](Workload w, int q_heads) {
    w.q_heads = q_heads;
    w.kv_heads = 1;
    w.kv_lora_rank = 512;
    w.head_dim = 576;
    w.name = "mla-" + w.name;
    return w;
  };
  config.workloads = {
      mla(tiny(WorkloadKind::decode, 2, 79, 1, 64, DType::bf16), 16),
      mla(tiny(WorkloadKind::decode, 2, 40, 1, 1, DType::e4m3), 8),
      mla(tiny(WorkloadKind::verify_chain, 2, 64, 4, 64, DType::bf16), 8),
      mla(tiny(WorkloadKind::verify_tree, 1, 64, 16, 64, DType::bf16, 4), 4),
  };
  config.reference_max_work = 1e8;
  BenchResult r = run_bench(config);
  ASSERT_EQ(r.rows.size(), config.workloads.size());
  for (const RowResult& row : r.rows) {
    SCOPED_TRACE(row.workload.name);
    EXPECT_EQ(row.status, "ok") << row.error;
    EXPECT_TRUE(row.check.passed) << row.check.max_rel_err;
    EXPECT_NE(row.check.method.find("float64"), std::string::npos);
    EXPECT_GT(row.time.median, 0);
    EXPECT_DOUBLE_EQ(row.bytes, counted_bytes(row.workload));
    ASSERT_TRUE(row.reference.has_value());
    EXPECT_TRUE(row.reference->check.passed) << row.reference->check.max_rel_err;
    if (row.decode_workload) {
      EXPECT_TRUE(row.decode_workload->is_mla());
      EXPECT_GT(row.decode_ratio, 0);
    }
  }
  EXPECT_TRUE(r.all_passed());
  nlohmann::json j = to_json(r, make_run_info("test", 1.0, ""));
  EXPECT_EQ(j["rows"][0]["shape"]["layer"], "mla");
  EXPECT_EQ(j["rows"][0]["shape"]["v_head_dim"], 512);
}

// The MHA-form rows run through AttentionRuntime's MHA calls on the cpu backend: the causal part,
// 4 chunks gathered and merged, checked in float64 in the absorbed form from the latent pool and
// against the reference backend, then timed.
TEST(BenchRun, TinyMlaMhaRowsRunOnCpuWithTheCheckPassing) {
  BenchConfig config = tiny_config("cpu");
  config.workloads = tiny_mla_mha_rows();
  config.reference_max_work = 1e7;
  BenchResult r = run_bench(config);
  ASSERT_EQ(r.rows.size(), 2u);
  for (const RowResult& row : r.rows) {
    SCOPED_TRACE(row.workload.name);
    EXPECT_EQ(row.status, "ok") << row.error;
    EXPECT_TRUE(row.check.passed) << row.check.max_rel_err;
    EXPECT_EQ(row.check.rows_checked, row.workload.num_tokens()) << "tiny rows are checked in full";
    EXPECT_NE(row.check.method.find("absorbed form"), std::string::npos) << row.check.method;
    EXPECT_EQ(row.time.repeats, 2);
    EXPECT_GT(row.plan.median, 0);
    EXPECT_EQ(row.bound, Bound::compute);
    EXPECT_DOUBLE_EQ(row.flops, attention_work(row.workload));
    EXPECT_GT(row.rate, 0);
    ASSERT_TRUE(row.reference.has_value());
    EXPECT_TRUE(row.reference->check.passed) << row.reference->check.max_rel_err;
    EXPECT_GT(row.reference->speedup, 0);
  }
  EXPECT_NE(r.rows[1].notes.at(0).find("4 prefix chunks"), std::string::npos) << r.rows[1].notes[0];
  EXPECT_LT(r.rows[1].reference->workload.batch, 3) << "reference ran scaled down";
  EXPECT_TRUE(r.all_passed());
  const std::string text = format_report(r, make_run_info("test", 1.0, ""));
  EXPECT_NE(text.find("mha 4 chunks"), std::string::npos) << text;
}

// A backend that serves MLA extends only in the absorbed form (the cuda backend today) gets an
// n/a row, not a failure: the run still passes.
TEST(BenchRun, MlaMhaRowsAreNotApplicableOnAnAbsorbedOnlyBackend) {
  BackendEntry e = reference_backend_entry();
  e.name = "absorbed-only";
  e.auto_selectable = false;
  e.factory = [](const BackendContext& ctx) -> std::unique_ptr<AttentionBackend> {
    return std::make_unique<WrappedReference>(ctx, "absorbed-only");
  };
  Registry::global().add(std::move(e));
  BenchConfig config = tiny_config("absorbed-only");
  config.workloads = tiny_mla_mha_rows();
  BenchResult r = run_bench(config);
  Registry::global().remove("absorbed-only");
  ASSERT_EQ(r.rows.size(), 2u);
  for (const RowResult& row : r.rows) {
    EXPECT_EQ(row.status, "n/a") << row.error;
    EXPECT_EQ(row.error, "absorbed-only serves MLA extends in the absorbed form");
    EXPECT_EQ(row.time.repeats, 0);
  }
  EXPECT_TRUE(r.all_passed()) << "n/a rows do not fail the run";
  const RunInfo info = make_run_info("test", 1.0, "");
  EXPECT_NE(format_report(r, info).find("n/a: absorbed-only serves MLA extends in the absorbed form"),
            std::string::npos);
  EXPECT_EQ(to_json(r, info)["rows"][0]["status"], "n/a");
  EXPECT_NE(render_svg(r, info).find("n/a: absorbed-only"), std::string::npos);
}

TEST(BenchRun, WrongOutputIsReportedAndNotTimed) {
  Registry registry;
  registry.add(reference_backend_entry());
  BackendEntry perturbed = reference_backend_entry();
  perturbed.name = "perturbed";
  perturbed.factory = [](const BackendContext& ctx) {
    return std::make_unique<PerturbedBackend>(ctx);
  };
  registry.add(perturbed);

  BenchConfig config = tiny_config("perturbed");
  config.registry = &registry;
  config.compare_reference = false;
  Ceilings none;
  for (const Workload& w : {tiny(WorkloadKind::decode, 2, 40, 1, 16, DType::bf16),
                            tiny(WorkloadKind::verify_tree, 2, 24, 16, 16, DType::bf16, 4)}) {
    RowResult row = run_row(config, w, none);
    EXPECT_EQ(row.status, "mismatch") << w.name;
    EXPECT_FALSE(row.check.passed);
    EXPECT_GT(row.check.max_rel_err, row.check.tolerance);
    EXPECT_EQ(row.time.repeats, 0) << "a wrong result is never timed";
    ASSERT_FALSE(row.notes.empty());
    EXPECT_NE(row.notes[0].find("not timed"), std::string::npos) << row.notes[0];
  }

  // The unperturbed reference passes the same check on the same row.
  config.backend = "reference";
  EXPECT_EQ(run_row(config, tiny(WorkloadKind::decode, 2, 40, 1, 16, DType::bf16), none).status,
            "ok");
}

TEST(BenchRun, UnknownBackendIsARowErrorNamingIt) {
  BenchConfig config = tiny_config("no-such-backend");
  RowResult row = run_row(config, tiny(WorkloadKind::decode, 1, 15, 1, 16, DType::bf16), {});
  EXPECT_EQ(row.status, "error");
  EXPECT_NE(row.error.find("no-such-backend"), std::string::npos) << row.error;
}
