// The linear-attention rows of `attnrt bench --suite linear`: row definitions against the model
// presets, the byte and FLOP counts worked out by hand for small layers, selection, scaling and the
// cpu-small preset, and tiny rows run end to end on the cpu backend (checked against reference).
// Nothing here asserts how fast anything ran.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "attnrt/core/error.h"
#include "attnrt/model/model_spec.h"
#include "bench/harness/linear_workload.h"
#include "bench/harness/report.h"
#include "bench/harness/runner.h"
#include "tests/test_bench_util.h"
#include "tests/test_util.h"

using namespace attnrt;
using namespace attnrt::bench;

namespace {

using attnrt::test::by_name;

// The first layer of `kind` in a model preset.
LinearSpec preset_spec(const std::string& model, LayerKind kind) {
  for (const LayerSpec& l : model_preset(model).layers) {
    if (l.kind == kind) return l.linear;
  }
  throw std::runtime_error("no such layer in " + model);
}

// A tiny row of `kind`: 2 value heads of 3, a conv kernel of 2, chunks of 4; the kind's own dims
// are the caller's.
LinearWorkload tiny_row(const char* name, LayerKind kind, LinearMode mode, int batch) {
  LinearWorkload w;
  w.name = name;
  w.kind = kind;
  w.mode = mode;
  w.batch = batch;
  w.spec = {.num_v_heads = 2, .head_v_dim = 3, .conv_kernel = 2, .chunk_size = 4};
  return w;
}

LinearWorkload tiny_gdn(LinearMode mode, int batch, int tokens) {
  LinearWorkload w = tiny_row("tiny-gdn", LayerKind::gdn, mode, batch);
  w.new_tokens = mode == LinearMode::decode ? 1 : tokens;
  w.prefix_len = mode == LinearMode::decode ? 16 : 0;
  w.spec.num_k_heads = 1;
  w.spec.head_k_dim = 2;
  return w;
}

LinearWorkload tiny_mamba2(int tokens) {
  LinearWorkload w = tiny_row("tiny-mamba2", LayerKind::mamba2, LinearMode::extend, 1);
  w.new_tokens = tokens;
  w.spec.d_state = 4;
  w.spec.n_groups = 1;
  return w;
}

}  // namespace

// The row shaped as FlashInfer's published GDN prefill figure: chosen by its name or its group,
// never by "all", a mode or a kind; the served model's GDN layer with 2 key / 8 value heads; and
// FlashInfer's FLOP count (4 x tokens x value heads x Dk x Dv) for GDN / KDA extend rows only.
TEST(BenchLinearWorkload, FlashInferComparisonRowIsChosenByNameOrGroup) {
  const std::vector<LinearWorkload> by_group = select_linear_workloads("flashinfer-gdn");
  ASSERT_EQ(by_group.size(), 1u);
  const LinearWorkload& w = by_group[0];
  EXPECT_EQ(w.name, "gdn-extend-1x65536-h2v8");
  EXPECT_EQ(w.kind, LayerKind::gdn);
  EXPECT_EQ(w.mode, LinearMode::extend);
  EXPECT_EQ(w.batch, 1);
  EXPECT_EQ(w.new_tokens, 65536);
  EXPECT_EQ(w.spec.num_k_heads, 2);
  EXPECT_EQ(w.spec.num_v_heads, 8);
  EXPECT_EQ(w.spec.head_k_dim, 128);
  EXPECT_EQ(w.spec.head_v_dim, 128);
  EXPECT_EQ(select_linear_workloads("gdn-extend-1x65536-h2v8").size(), 1u);
  EXPECT_TRUE(is_linear_selector("flashinfer-gdn"));
  for (const char* sel : {"all", "extend", "gdn"}) {
    for (const LinearWorkload& x : select_linear_workloads(sel))
      EXPECT_NE(x.name, w.name) << sel;
  }
  // FlashInfer's published row: 4 x 65536 x 8 x 128 x 128 FLOPs in 0.399 ms is 86.1 TFLOP/s.
  EXPECT_DOUBLE_EQ(linear_flashinfer_flops(w), 4.0 * 65536 * 8 * 128 * 128);
  const std::optional<FlashInferFigure> published = flashinfer_published(w);
  ASSERT_TRUE(published.has_value());
  EXPECT_NEAR(linear_flashinfer_flops(w) / (published->ms * 1e-3) / 1e12, 86.1, 0.1);
  const std::vector<LinearWorkload> rows = linear_standard_workloads();
  // Its fused kernel's row at the served model's shape (16 / 32 heads, 8 x 8192): 0.820 ms,
  // 167.6 TFLOP/s; no figure for KDA, Mamba2 or shapes it does not publish.
  const std::optional<FlashInferFigure> standard =
      flashinfer_published(by_name(rows, "gdn-extend-8x8192"));
  ASSERT_TRUE(standard.has_value());
  EXPECT_NEAR(4.0 * 65536 * 32 * 128 * 128 / (standard->ms * 1e-3) / 1e12, 167.6, 0.1);
  EXPECT_FALSE(flashinfer_published(by_name(rows, "kda-extend-8x8192")).has_value());
  EXPECT_FALSE(flashinfer_published(by_name(rows, "gdn-decode-64")).has_value());
  LinearWorkload other = by_name(rows, "gdn-extend-8x8192");
  other.batch = 4;
  EXPECT_FALSE(flashinfer_published(other).has_value());
  EXPECT_DOUBLE_EQ(linear_flashinfer_flops(by_name(rows, "gdn-extend-8x8192")),
                   4.0 * 65536 * 32 * 128 * 128);
  EXPECT_GT(linear_flashinfer_flops(by_name(rows, "kda-extend-8x8192")), 0);
  EXPECT_EQ(linear_flashinfer_flops(by_name(rows, "mamba2-extend-8x8192")), 0);
  EXPECT_EQ(linear_flashinfer_flops(by_name(rows, "gdn-decode-64")), 0);
}

TEST(BenchLinearWorkload, StandardRowsAreTheServedModelsLayers) {
  const std::vector<LinearWorkload> rows = linear_standard_workloads();
  const std::vector<std::string> names = {
      "gdn-decode-64",     "gdn-decode-256",    "mamba2-decode-64",     "mamba2-decode-256",
      "gdn-extend-8x8192", "kda-extend-8x8192", "mamba2-extend-8x8192", "mamba2-extend-1x8192"};
  ASSERT_EQ(rows.size(), names.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const LinearWorkload& w = rows[i];
    SCOPED_TRACE(w.name);
    EXPECT_EQ(w.name, names[i]);
    EXPECT_EQ(w.act_dtype, DType::bf16);
    EXPECT_EQ(w.state_dtype, DType::f32);
    EXPECT_TRUE(w.scale_note.empty());
    test::expect_same_linear_dims(w.spec, preset_spec(w.model, w.kind));
    if (w.mode == LinearMode::decode) {
      EXPECT_EQ(w.new_tokens, 1);
      EXPECT_GT(w.prefix_len, 0) << "a decode step reads a state built by earlier tokens";
      EXPECT_EQ(w.bound(), Bound::memory);
    } else {
      EXPECT_EQ(w.prefix_len, 0) << "extend rows start from empty states";
      EXPECT_EQ(w.new_tokens, 8192);
      EXPECT_EQ(w.bound(), Bound::compute);
    }
  }
  EXPECT_EQ(by_name(rows, "gdn-decode-256").model, "qwen3-next-80b");
  EXPECT_EQ(by_name(rows, "gdn-decode-256").batch, 256);
  EXPECT_EQ(by_name(rows, "kda-extend-8x8192").model, "kimi-linear-48b");
  EXPECT_EQ(by_name(rows, "kda-extend-8x8192").batch, 8);
  EXPECT_EQ(by_name(rows, "mamba2-extend-1x8192").model, "nemotron-h-8b");
  EXPECT_EQ(by_name(rows, "mamba2-extend-1x8192").batch, 1);
  EXPECT_EQ(by_name(rows, "mamba2-decode-64").spec.chunk_size, 128);
}

TEST(BenchLinearWorkload, CountsFollowTheDocumentedFormulasOnSmallLayers) {
  // gdn, 1 key head, 2 value heads, Dk 2, Dv 3, chunk 4; 6 tokens = a chunk of 4 and one of 2.
  //   c = 4: key head 4*16*2 = 128; value head 2*16*2 + 4*16*3 + 6*4*2*3 + 64/3 = 421 1/3
  //   c = 2: key head 4*4*2 = 32;   value head 2*4*2 + 4*4*3 + 6*2*2*3 + 8/3 = 138 2/3
  const LinearWorkload e = tiny_gdn(LinearMode::extend, 1, 6);
  EXPECT_NEAR(linear_counted_flops(e), 128 + 2 * (421.0 + 1.0 / 3) + 32 + 2 * (138.0 + 2.0 / 3),
              1e-9);
  EXPECT_NEAR(linear_counted_flops(e), 1280, 1e-9);
  const LinearWidths x = linear_widths(e);
  EXPECT_EQ(x.conv_dim, 2 * 1 * 2 + 2 * 3);
  EXPECT_EQ(x.a, 2);
  EXPECT_EQ(x.b, 2);
  EXPECT_EQ(x.out, 6);
  EXPECT_EQ(x.state_elems, 2 * 3 * 2);
  EXPECT_EQ(x.conv_elems, 1 * 10);
  // From empty states: state + window written (4 * 22), 6 tokens of bf16 inputs and outputs
  // (2 * (10 + 2 + 2 + 6) each), fp32 conv weight, A_log, dt_bias (4 * (20 + 2 + 2)).
  EXPECT_DOUBLE_EQ(linear_counted_bytes(e), 88 + 6 * 40 + 96);

  // Decode, 3 requests: state and window read and written, one token each; c = 1:
  // 4*2 + 2 * (2*2 + 4*3 + 6*2*3 + 1/3) per request.
  const LinearWorkload d = tiny_gdn(LinearMode::decode, 3, 1);
  EXPECT_DOUBLE_EQ(linear_counted_bytes(d), 3 * 2 * 88 + 3 * 40 + 96);
  EXPECT_NEAR(linear_counted_flops(d), 3 * (8 + 2 * (52.0 + 1.0 / 3)), 1e-9);

  // mamba2, 2 heads of P 3, N 4, one group, one chunk of 4: per head 2*16*3 + 4*4*4*3 + 2*4*3,
  // per group 2*16*4. Bytes: state [2, 3, 4] + window 14 written, 4 tokens of x|B|C (14) + dt (2)
  // + out (6) in bf16, conv weight and bias (14 * 3), A_log, dt_bias, D.
  const LinearWorkload m = tiny_mamba2(4);
  EXPECT_DOUBLE_EQ(linear_counted_flops(m), 2 * (96 + 192 + 24) + 128);
  EXPECT_EQ(linear_widths(m).conv_dim, 14);
  EXPECT_EQ(linear_widths(m).b, 0);
  EXPECT_DOUBLE_EQ(linear_counted_bytes(m), 4 * (24 + 14) + 4 * 2 * (14 + 2 + 6) + 4 * (42 + 6));

  // kda: per-channel decay input a [T, H, Dk] and dt_bias [H, Dk].
  LinearWorkload k = e;
  k.kind = LayerKind::kda;
  k.spec.num_k_heads = k.spec.num_v_heads = 2;
  EXPECT_EQ(linear_widths(k).a, 2 * 2);
  EXPECT_EQ(linear_widths(k).conv_dim, 2 * 2 * 2 + 2 * 3);
  EXPECT_EQ(linear_widths(k).param_elems, 14 * 2 + 2 + 4);

  // The standard GDN decode row: 2 MiB of fp32 state and 96 KiB of window per request.
  const LinearWorkload g = by_name(linear_standard_workloads(), "gdn-decode-64");
  EXPECT_EQ(linear_widths(g).state_elems * 4, 2 << 20);
  EXPECT_EQ(linear_widths(g).conv_elems * 4, 96 << 10);
}

TEST(BenchLinearWorkload, SelectorsScalingAndPreset) {
  EXPECT_EQ(select_linear_workloads("all").size(), 8u);
  EXPECT_EQ(select_linear_workloads("decode").size(), 4u);
  EXPECT_EQ(select_linear_workloads("gdn").size(), 3u);
  EXPECT_EQ(select_linear_workloads("mamba2,mamba2-extend-1x8192").size(), 4u);
  EXPECT_EQ(select_linear_workloads("kda-extend-8x8192").front().kind, LayerKind::kda);
  EXPECT_TRUE(is_linear_selector("extend"));
  EXPECT_FALSE(is_linear_selector("prefill"));
  EXPECT_FALSE(is_linear_selector("decode-16x4096"));
  test::expect_error([] { select_linear_workloads("gdn-decode-7"); },
                     {"unknown linear workload 'gdn-decode-7'", "gdn-decode-64"});

  const LinearWorkload ext = by_name(linear_standard_workloads(), "gdn-extend-8x8192");
  const LinearWorkload s = scale_linear_workload(ext, 0.01);
  EXPECT_EQ(s.batch, 1);
  EXPECT_EQ(s.new_tokens, 80);
  EXPECT_EQ(s.name, ext.name);
  EXPECT_EQ(s.spec.num_v_heads, 32);
  EXPECT_NE(s.scale_note.find("8 x 8192"), std::string::npos) << s.scale_note;
  EXPECT_EQ(scale_linear_workload(ext, 1.0), ext);
  const LinearWorkload dec =
      scale_linear_workload(by_name(linear_standard_workloads(), "mamba2-decode-256"), 0.5);
  EXPECT_EQ(dec.batch, 128);
  EXPECT_EQ(dec.new_tokens, 1);

  const std::vector<LinearWorkload> small =
      apply_linear_preset(linear_standard_workloads(), "cpu-small");
  for (const LinearWorkload& w : small) {
    SCOPED_TRACE(w.name);
    EXPECT_LE(linear_counted_bytes(w), 1.25 * double(1ull << 30));
    EXPECT_LE(linear_counted_flops(w), 5e10);
  }
  EXPECT_TRUE(by_name(small, "gdn-decode-64").scale_note.empty());
  EXPECT_FALSE(by_name(small, "kda-extend-8x8192").scale_note.empty());
  test::expect_error([] { apply_linear_preset(linear_standard_workloads(), "gpu-huge"); },
                     {"cpu-small"});
}

TEST(BenchLinearRun, TinyRowsRunOnCpuCheckedAgainstReference) {
  BenchConfig config = test::tiny_bench_config("cpu");
  LinearWorkload kda = tiny_gdn(LinearMode::extend, 2, 40);
  kda.name = "tiny-kda";
  kda.kind = LayerKind::kda;
  kda.spec.num_k_heads = kda.spec.num_v_heads = 2;
  config.linear_workloads = {tiny_gdn(LinearMode::decode, 3, 1),
                             tiny_gdn(LinearMode::extend, 2, 21), kda, tiny_mamba2(37)};
  config.check_max_work = 1e3;  // extend rows check a prefix of their tokens only
  const BenchResult r = run_bench(config);
  ASSERT_EQ(r.linear_rows.size(), 4u);
  EXPECT_TRUE(r.rows.empty());
  EXPECT_TRUE(r.all_passed());
  for (const LinearRowResult& row : r.linear_rows) {
    SCOPED_TRACE(row.workload.name);
    EXPECT_EQ(row.status, "ok") << row.error;
    EXPECT_TRUE(row.check.passed) << row.check.max_rel_err;
    EXPECT_GT(row.check.rows_checked, 0);
    EXPECT_EQ(row.time.repeats, 2);
    EXPECT_GT(row.rate, 0);
    EXPECT_GT(row.tokens_per_second, 0);
    EXPECT_EQ(row.bytes, linear_counted_bytes(row.workload));
  }
  // Decode: both sampled requests (first and last); extend: a prefix of the tokens of each.
  EXPECT_EQ(r.linear_rows[0].check.rows_checked, 2);
  EXPECT_LT(r.linear_rows[1].check.rows_checked, 2 * 21);

  const nlohmann::json j = to_json(r, make_run_info("test", 1.0, ""));
  ASSERT_EQ(j["rows"].size(), 4u);
  EXPECT_EQ(j["rows"][0]["suite"], "linear");
  EXPECT_EQ(j["rows"][0]["shape"]["kind"], "gdn");
  EXPECT_EQ(j["rows"][0]["shape"]["mode"], "decode");
  EXPECT_EQ(j["rows"][3]["shape"]["d_state"], 4);
  EXPECT_GT(j["rows"][2]["tokens_per_s"].get<double>(), 0);
  const std::string table = format_report(r, make_run_info("test", 1.0, ""));
  EXPECT_NE(table.find("tiny-mamba2"), std::string::npos) << table;
  EXPECT_NE(table.find("TFLOP/s"), std::string::npos) << table;
}
