// The benchmark workloads: names and shapes as WORKLOADS.md lists them, the counting formulas,
// scaling and presets.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "bench/harness/workload.h"
#include "tests/test_util.h"

using namespace attnrt;
using namespace attnrt::bench;

namespace {

using attnrt::test::by_name;
using attnrt::test::expect_error;

// Visible (query, key) pairs of one request counted by brute force over the mask definitions of
// reference-semantics §8.2 / §8.4 (ancestry walked explicitly, not through verify_parents' levels).
double brute_force_pairs(const Workload& w) {
  std::vector<int32_t> parent = verify_parents(w);
  double pairs = 0;
  for (int t = 0; t < w.new_tokens; ++t) {
    for (int j = 0; j < w.kv_len(); ++j) {
      bool visible;
      if (j < w.prefix_len) {
        visible = true;
      } else if (w.kind == WorkloadKind::verify_tree) {
        int u = j - w.prefix_len;
        visible = false;
        for (int a = t; a != -1; a = parent[a]) visible = visible || a == u;
      } else {
        visible = j - w.prefix_len <= t;
      }
      pairs += visible;
    }
  }
  return pairs;
}

}  // namespace

TEST(BenchWorkload, StandardSetIsTheWorkloadsMdList) {
  std::vector<Workload> rows = standard_workloads();
  std::set<std::string> names;
  for (const Workload& w : rows) names.insert(w.name);
  EXPECT_EQ(names.size(), rows.size()) << "row names must be unique";
  const char* expected[] = {
      "decode-1x32768",       "decode-16x4096",      "decode-64x4096",
      "decode-128x8192",      "decode-256x2048",     "decode-32x32768",
      "decode-1x32768-p1",    "decode-16x4096-p1",   "decode-64x4096-p1",
      "decode-128x8192-p1",   "decode-256x2048-p1",  "decode-32x32768-p1",
      "decode-1x32768-fp8",   "decode-16x4096-fp8",  "decode-64x4096-fp8",
      "decode-128x8192-fp8",  "decode-256x2048-fp8", "decode-32x32768-fp8",
      "prefill-1x1024",       "prefill-1x4096",      "prefill-1x16384",
      "prefill-8x2048",       "prefill-1x8192-d64",  "prefill-1x8192-d256",
      "extend-8x2048+512",    "verify-chain-64x4096+8", "verify-tree-64x4096+16-topk4"};
  EXPECT_EQ(rows.size(), std::size(expected));
  for (const char* name : expected) EXPECT_TRUE(names.count(name)) << name;
  for (const Workload& w : rows) {
    EXPECT_EQ(w.q_heads, 32) << w.name;
    EXPECT_EQ(w.kv_heads, 8) << w.name;
    EXPECT_TRUE(w.scale_note.empty()) << w.name;
  }
  const Workload& d = by_name(rows, "decode-128x8192-p1");
  EXPECT_EQ(d.batch, 128);
  EXPECT_EQ(d.kv_len(), 8192);
  EXPECT_EQ(d.prefix_len, 8191);  // the new token is the 8192nd key
  EXPECT_EQ(d.page_size, 1);
  EXPECT_EQ(by_name(rows, "decode-16x4096-fp8").kv_dtype, DType::e4m3);
  EXPECT_EQ(by_name(rows, "prefill-1x8192-d256").head_dim, 256);
  const Workload& tree = by_name(rows, "verify-tree-64x4096+16-topk4");
  EXPECT_EQ(tree.prefix_len, 4096);
  EXPECT_EQ(tree.new_tokens, 16);
  EXPECT_EQ(tree.topk, 4);
  EXPECT_EQ(tree.shape(), "64x(4096+16, topk 4)");
  EXPECT_EQ(by_name(rows, "prefill-1x8192-d64").shape(), "1x8192 d64");
  EXPECT_EQ(by_name(rows, "decode-16x4096-fp8").shape(), "16x4096 fp8_e4m3");
}

TEST(BenchWorkload, CountsFollowTheWorkloadsMdFormulas) {
  std::vector<Workload> rows = standard_workloads();
  // decode B x L: B * L * Hkv * D * 2 (K and V) * bytes per element.
  EXPECT_DOUBLE_EQ(counted_bytes(by_name(rows, "decode-16x4096")), 16.0 * 4096 * 8 * 128 * 2 * 2);
  EXPECT_DOUBLE_EQ(counted_bytes(by_name(rows, "decode-32x32768")),
                   32.0 * 32768 * 8 * 128 * 2 * 2);  // the 4.3 GB row
  EXPECT_DOUBLE_EQ(counted_bytes(by_name(rows, "decode-16x4096-fp8")), 16.0 * 4096 * 8 * 128 * 2);
  EXPECT_DOUBLE_EQ(counted_bytes(by_name(rows, "decode-16x4096-p1")),
                   counted_bytes(by_name(rows, "decode-16x4096")));
  // prefill B x S: B * 4 * S^2 * Hq * D / 2.
  EXPECT_DOUBLE_EQ(counted_flops(by_name(rows, "prefill-1x4096")), 4.0 * 4096 * 4096 * 32 * 128 / 2);
  EXPECT_DOUBLE_EQ(counted_flops(by_name(rows, "prefill-8x2048")),
                   8 * 4.0 * 2048 * 2048 * 32 * 128 / 2);
  EXPECT_DOUBLE_EQ(counted_flops(by_name(rows, "prefill-1x8192-d64")), 4.0 * 8192 * 8192 * 32 * 64 / 2);
  // extend B x (P + E): B * 4 * Hq * D * (E * P + E^2 / 2).
  EXPECT_DOUBLE_EQ(counted_flops(by_name(rows, "extend-8x2048+512")),
                   8 * 4.0 * 32 * 128 * (512.0 * 2048 + 512.0 * 512 / 2));
  // Only the bound decides which ceiling a row is held against.
  EXPECT_EQ(by_name(rows, "decode-1x32768").bound(), Bound::memory);
  EXPECT_EQ(by_name(rows, "verify-chain-64x4096+8").bound(), Bound::memory);
  EXPECT_EQ(by_name(rows, "prefill-1x1024").bound(), Bound::compute);
  EXPECT_EQ(by_name(rows, "extend-8x2048+512").bound(), Bound::compute);
}

TEST(BenchWorkload, AttentionWorkCountsEveryVisiblePair) {
  std::vector<Workload> shapes;
  for (const Workload& w : standard_workloads()) {
    Workload small = w;
    small.batch = 3;
    small.prefix_len = w.kind == WorkloadKind::prefill ? 0 : 37;
    if (w.kind == WorkloadKind::prefill || w.kind == WorkloadKind::extend) small.new_tokens = 11;
    shapes.push_back(small);
  }
  for (const Workload& w : shapes) {
    EXPECT_DOUBLE_EQ(attention_work(w), 3 * 4.0 * w.q_heads * w.head_dim * brute_force_pairs(w))
        << w.name;
  }
}

TEST(BenchWorkload, VerifyParentsFormAValidDraftTree) {
  const Workload tree = by_name(standard_workloads(), "verify-tree-64x4096+16-topk4");
  std::vector<int32_t> p = verify_parents(tree);
  ASSERT_EQ(p.size(), 16u);
  EXPECT_EQ(p[0], -1);
  std::vector<int> children(16, 0), depth(16, 0);
  for (int t = 1; t < 16; ++t) {
    ASSERT_GE(p[t], 0) << t;
    ASSERT_LT(p[t], t) << "a parent precedes its child";
    ++children[p[t]];
    depth[t] = depth[p[t]] + 1;
  }
  for (int t = 0; t < 16; ++t) EXPECT_LE(children[t], 4) << "node " << t;
  EXPECT_EQ(children[0], 4);  // the first draft step expands the root into topk branches
  EXPECT_GT(*std::max_element(depth.begin(), depth.end()), 1) << "a tree, not a fan";
  EXPECT_EQ(verify_parents(tree), p) << "the same tree on every run";
  // The batch layer accepts it as a tree of topk 4.
  SpecInfo spec;
  spec.draft_token_num = 16;
  spec.topk = 4;
  spec.parents = p;
  ForwardBatch b = make_verify_batch({0}, {tree.prefix_len}, spec);
  EXPECT_EQ(b.positions.back(), tree.prefix_len + depth[15]);

  const Workload chain = by_name(standard_workloads(), "verify-chain-64x4096+8");
  std::vector<int32_t> c = verify_parents(chain);
  for (int t = 0; t < 8; ++t) EXPECT_EQ(c[t], t - 1);
  Workload d = decode_companion(chain);
  EXPECT_EQ(d.kind, WorkloadKind::decode);
  EXPECT_EQ(d.batch, 64);
  EXPECT_EQ(d.kv_len(), 4096);
}

TEST(BenchWorkload, ScalingShrinksBatchAndLengthsOnly) {
  const Workload w = by_name(standard_workloads(), "decode-16x4096");
  Workload s = scale_workload(w, 0.25);
  EXPECT_EQ(s.name, w.name);
  EXPECT_EQ(s.batch, 4);
  EXPECT_EQ(s.kv_len(), 1024);
  EXPECT_NE(s.scale_note.find("16x4096"), std::string::npos) << s.scale_note;
  EXPECT_EQ(scale_workload(w, 1.0), w);

  Workload v = scale_workload(by_name(standard_workloads(), "verify-tree-64x4096+16-topk4"), 0.1);
  EXPECT_EQ(v.new_tokens, 16) << "draft tokens are never scaled";
  EXPECT_EQ(v.topk, 4);
  EXPECT_EQ(v.prefix_len % 16, 0);
  Workload tiny = scale_workload(by_name(standard_workloads(), "prefill-1x1024"), 0.001);
  EXPECT_EQ(tiny.new_tokens, 16) << "lengths keep at least one page";
  EXPECT_EQ(tiny.batch, 1);

  expect_error([&] { scale_workload(w, 0); }, {"(0, 1]"});
  expect_error([&] { scale_workload(w, 1.5); }, {"--scale 1.5"});
}

TEST(BenchWorkload, PageSizeChangesThePoolOnlyAndSaysSo) {
  const Workload w = by_name(standard_workloads(), "prefill-1x4096");
  const Workload p = with_page_size(w, 128);
  EXPECT_EQ(p.page_size, 128);
  EXPECT_EQ(p.name, w.name);
  EXPECT_EQ(p.new_tokens, w.new_tokens);
  EXPECT_EQ(counted_flops(p), counted_flops(w));
  EXPECT_EQ(p.scale_note, "page 128 instead of 16");
  EXPECT_NE(p.shape().find("page 128"), std::string::npos) << p.shape();
  EXPECT_EQ(with_page_size(w, 16), w) << "the row's own page size changes nothing";
  const Workload s = with_page_size(scale_workload(w, 0.5), 1);
  EXPECT_NE(s.scale_note.find("scaled"), std::string::npos) << s.scale_note;
  EXPECT_NE(s.scale_note.find("; page 1 instead of 16"), std::string::npos) << s.scale_note;
  const Workload mla = with_page_size(by_name(mla_workloads(), "mla-decode-h16-1x32768"), 1);
  EXPECT_EQ(mla.scale_note, "page 1 instead of 64");
  expect_error([&] { with_page_size(w, 0); }, {"page size 0", "1 to 4096"});
  expect_error([&] { with_page_size(w, 8192); }, {"page size 8192"});
}

TEST(BenchWorkload, FitHalvesBatchBeforeLength) {
  const Workload w = by_name(standard_workloads(), "decode-128x8192");
  Workload f = fit_workload(w, counted_bytes(w) / 8, 1e30, "test");
  EXPECT_EQ(f.batch, 16);
  EXPECT_EQ(f.kv_len(), 8192);
  EXPECT_EQ(f.scale_note, "test from 128x8192");
  Workload g = fit_workload(w, counted_bytes(w) / 512, 1e30, "test");
  EXPECT_EQ(g.batch, 1);
  EXPECT_EQ(g.kv_len(), 2048);
  EXPECT_EQ(fit_workload(w, 1e30, 1e30, "test"), w);
}

TEST(BenchWorkload, CpuSmallPresetBoundsEveryRow) {
  std::vector<Workload> rows = apply_preset(standard_workloads(), "cpu-small");
  ASSERT_EQ(rows.size(), standard_workloads().size());
  for (const Workload& w : rows) {
    EXPECT_LE(counted_bytes(w), 1.25 * double(1ull << 30)) << w.name;
    EXPECT_LE(attention_work(w), 6e11) << w.name;
  }
  // The rows the performance targets name keep their full size.
  for (const char* name : {"decode-16x4096", "decode-64x4096", "prefill-1x4096",
                           "decode-16x4096-fp8", "verify-chain-64x4096+8"}) {
    EXPECT_TRUE(by_name(rows, name).scale_note.empty()) << name;
  }
  EXPECT_FALSE(by_name(rows, "decode-32x32768").scale_note.empty());
  expect_error([] { apply_preset(standard_workloads(), "gpu-huge"); }, {"cpu-small"});
}

TEST(BenchWorkload, SelectorsPickRowsAndRejectUnknownNames) {
  EXPECT_EQ(select_workloads("all").size(), standard_workloads().size());
  EXPECT_EQ(select_workloads("decode").size(), 18u);
  EXPECT_EQ(select_workloads("verify").size(), 2u);
  std::vector<Workload> two = select_workloads("prefill-1x4096,decode-16x4096,prefill-1x4096");
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0].name, "prefill-1x4096");
  // The message lists the valid names.
  expect_error([] { select_workloads("decode-3x3"); }, {"'decode-3x3'", "decode-16x4096"});
  expect_error([] { select_workloads(","); }, {"empty"});
}

// The groups beside the standard set: by name or group, never by "all" or a kind.
TEST(BenchWorkload, Fp8PrefillAndLongDecodeRowsAreChosenByNameOrGroup) {
  std::vector<Workload> fp8 = select_workloads("fp8-prefill");
  ASSERT_EQ(fp8.size(), 8u);
  for (const Workload& w : fp8) {
    EXPECT_EQ(w.fp8_prefill, w.name.ends_with("-fp8")) << w.name;
    EXPECT_EQ(w.kv_dtype, DType::e4m3) << w.name;
  }
  EXPECT_EQ(fp8[4].name, "prefill-1x16384-kvfp8");
  EXPECT_EQ(fp8[5].name, "extend-8x2048+512-kvfp8");
  EXPECT_EQ(fp8[6].name, "prefill-1x8192-d64-kvfp8");
  EXPECT_EQ(fp8[7].name, "prefill-1x8192-d256-kvfp8");
  EXPECT_EQ(fp8[6].head_dim, 64);
  EXPECT_EQ(fp8[7].head_dim, 256);
  std::vector<Workload> long_rows = select_workloads("long-decode");
  ASSERT_EQ(long_rows.size(), 2u);
  EXPECT_EQ(long_rows[0].name, "decode-1x131072");
  EXPECT_EQ(long_rows[1].name, "decode-4x131072");
  for (const Workload& w : long_rows) {
    EXPECT_EQ(w.kv_len(), 131072) << w.name;
    EXPECT_EQ(w.page_size, 16) << w.name;
    EXPECT_EQ(w.kv_dtype, DType::bf16) << w.name;
    EXPECT_TRUE(is_long_decode(w)) << w.name;
  }
  // 4 requests x 131072 keys x 8 KV heads x 128 x (K and V) x 2 bytes.
  EXPECT_DOUBLE_EQ(counted_bytes(long_rows[1]), 4.0 * 131072 * 8 * 128 * 2 * 2);
  EXPECT_EQ(select_workloads("decode-4x131072").size(), 1u);
  for (const Workload& w : select_workloads("decode")) EXPECT_FALSE(is_long_decode(w)) << w.name;
  for (const Workload& w : select_workloads("all")) {
    EXPECT_FALSE(is_long_decode(w)) << w.name;
    EXPECT_FALSE(w.fp8_prefill) << w.name;
  }
}

TEST(BenchWorkload, MlaSetIsTheWorkloadsMdList) {
  std::vector<Workload> rows = mla_workloads();
  std::vector<std::string> names;
  for (const Workload& w : rows) names.push_back(w.name);
  const std::vector<std::string> expected = {
      "mla-decode-h16-1x32768",        "mla-decode-h16-64x8192",
      "mla-decode-h128-64x4096",       "mla-decode-h128-128x8192",
      "mla-decode-h16-1x32768-fp8",    "mla-decode-h16-64x8192-fp8",
      "mla-decode-h128-64x4096-fp8",   "mla-decode-h128-128x8192-fp8",
      "mla-decode-h16-1x32768-p1",     "mla-decode-h16-64x8192-p1",
      "mla-decode-h128-64x4096-p1",    "mla-decode-h128-128x8192-p1",
      "mla-verify-chain-64x4096+4",    "mla-verify-tree-64x4096+16-topk4",
      "mla-prefill-1x16384",           "mla-extend-8x4096+512"};
  EXPECT_EQ(names, expected);
  for (const Workload& w : rows) {
    SCOPED_TRACE(w.name);
    EXPECT_TRUE(w.is_mla());
    EXPECT_EQ(w.kv_heads, 1) << "one latent KV head";
    EXPECT_EQ(w.head_dim, 576);
    EXPECT_EQ(w.is_mla_mha(), w.kind == WorkloadKind::prefill || w.kind == WorkloadKind::extend);
    EXPECT_EQ(w.qk_head_dim(), w.is_mla_mha() ? 192 : 576);
    EXPECT_EQ(w.v_head_dim(), w.is_mla_mha() ? 128 : 512);
    EXPECT_EQ(w.page_size, w.name.ends_with("-p1") ? 1 : 64);
    EXPECT_EQ(w.kv_dtype, w.name.ends_with("-fp8") ? DType::e4m3 : DType::bf16);
    EXPECT_EQ(w.bound(), w.q_heads == 128 ? Bound::compute : Bound::memory);
  }
  const Workload& d = by_name(rows, "mla-decode-h128-128x8192");
  EXPECT_EQ(d.q_heads, 128);
  EXPECT_EQ(d.batch, 128);
  EXPECT_EQ(d.kv_len(), 8192);
  EXPECT_EQ(d.shape(), "h128 128x8192 page 64");
  const Workload& tree = by_name(rows, "mla-verify-tree-64x4096+16-topk4");
  EXPECT_EQ(tree.q_heads, 128);
  EXPECT_EQ(tree.prefix_len, 4096);
  EXPECT_EQ(tree.new_tokens, 16);
  EXPECT_EQ(tree.topk, 4);
  // The decode row a verify row is divided by keeps the MLA layer and page.
  Workload dc = decode_companion(tree);
  EXPECT_TRUE(dc.is_mla());
  EXPECT_EQ(dc.q_heads, 128);
  EXPECT_EQ(dc.page_size, 64);
  EXPECT_EQ(dc.kv_len(), 4096);
  EXPECT_EQ(dc.name, "mla-decode-h128-64x4096");
  // The MHA form: 128 heads, q / k 128 nope + 64 rope, v 128; the extend's prefix in 4 chunks.
  const Workload& prefill = by_name(rows, "mla-prefill-1x16384");
  EXPECT_EQ(prefill.q_heads, 128);
  EXPECT_EQ(prefill.qk_nope_head_dim, 128);
  EXPECT_EQ(prefill.prefix_len, 0);
  EXPECT_EQ(prefill.new_tokens, 16384);
  EXPECT_EQ(prefill.prefix_chunks, 0);
  EXPECT_EQ(prefill.shape(), "h128 1x16384 mha page 64");
  const Workload& extend = by_name(rows, "mla-extend-8x4096+512");
  EXPECT_EQ(extend.batch, 8);
  EXPECT_EQ(extend.prefix_len, 4096);
  EXPECT_EQ(extend.new_tokens, 512);
  EXPECT_EQ(extend.prefix_chunks, 4);
  EXPECT_EQ(extend.shape(), "h128 8x(4096+512) mha 4 chunks page 64");
  EXPECT_EQ(extend.bound(), Bound::compute);
  // The attention suite is unchanged.
  for (const Workload& w : standard_workloads()) EXPECT_FALSE(w.is_mla()) << w.name;
}

TEST(BenchWorkload, MlaCountsFollowTheWorkloadsMdRule) {
  std::vector<Workload> rows = mla_workloads();
  // Bytes: the latent cache once per request (L x 576 x bytes) + bf16 q read + bf16 out written.
  const double q_out = 64.0 * 16 * (576 + 512) * 2;
  EXPECT_DOUBLE_EQ(counted_bytes(by_name(rows, "mla-decode-h16-64x8192")),
                   64.0 * 8192 * 576 * 2 + q_out);  // 604 MB + 2.2 MB
  EXPECT_DOUBLE_EQ(counted_bytes(by_name(rows, "mla-decode-h16-64x8192-fp8")),
                   64.0 * 8192 * 576 * 1 + q_out);
  EXPECT_DOUBLE_EQ(counted_bytes(by_name(rows, "mla-decode-h16-64x8192-p1")),
                   counted_bytes(by_name(rows, "mla-decode-h16-64x8192")));
  // FLOPs: 2 x Hq x L x (576 + 512) per query token.
  EXPECT_DOUBLE_EQ(counted_flops(by_name(rows, "mla-decode-h128-64x4096")),
                   64 * 2.0 * 128 * 4096 * (576 + 512));
  EXPECT_DOUBLE_EQ(attention_work(by_name(rows, "mla-decode-h128-64x4096")),
                   counted_flops(by_name(rows, "mla-decode-h128-64x4096")));
  // About 240 FLOP per byte of cache at 128 heads (228 with q and out counted), about 30 at 16.
  const Workload& h128 = by_name(rows, "mla-decode-h128-64x4096");
  EXPECT_NEAR(counted_flops(h128) / (64.0 * 4096 * 576 * 2), 242, 1);
  EXPECT_NEAR(counted_flops(h128) / counted_bytes(h128), 228, 1);
  const Workload& h16 = by_name(rows, "mla-decode-h16-64x8192");
  EXPECT_NEAR(counted_flops(h16) / counted_bytes(h16), 30, 1);
  // Verify: every query sees the prefix and its ancestors-or-self among the drafts.
  const Workload& chain = by_name(rows, "mla-verify-chain-64x4096+4");
  EXPECT_DOUBLE_EQ(counted_flops(chain), 64 * 2.0 * 128 * (576 + 512) * (4 * 4096 + 10));
  EXPECT_DOUBLE_EQ(counted_bytes(chain), 64.0 * 4100 * 576 * 2 + 64.0 * 4 * 128 * (576 + 512) * 2);
}

TEST(BenchWorkload, MlaMhaCountsFollowTheWorkloadsMdRule) {
  std::vector<Workload> rows = mla_workloads();
  // FLOPs: 2 x 128 heads x (192 + 128) per exact visible pair: the causal triangle S(S+1)/2 ...
  const Workload& prefill = by_name(rows, "mla-prefill-1x16384");
  EXPECT_DOUBLE_EQ(counted_flops(prefill), 2.0 * 128 * 320 * (16384.0 * 16385 / 2));  // 1.1e13
  EXPECT_DOUBLE_EQ(attention_work(prefill), counted_flops(prefill));
  // ... plus every prefix key for every new token.
  const Workload& extend = by_name(rows, "mla-extend-8x4096+512");
  EXPECT_DOUBLE_EQ(counted_flops(extend),
                   8 * 2.0 * 128 * 320 * (512.0 * 4096 + 512.0 * 513 / 2));  // 1.46e12
  // Bytes: per new token q, k, v read and out written (bf16) and its latent row stored; per
  // prefix token its latent row read and written by the gather and its decompressed k / v read.
  const double per_token = 128.0 * (192 + 192 + 128 + 128) * 2 + 576 * 2;
  const double per_prefix = 576.0 * 2 * 2 + 128.0 * (192 + 128) * 2;
  EXPECT_DOUBLE_EQ(counted_bytes(prefill), 16384 * per_token);
  EXPECT_DOUBLE_EQ(counted_bytes(extend), 8 * 512 * per_token + 8 * 4096 * per_prefix);
  EXPECT_EQ(prefill.bound(), Bound::compute);
}

TEST(BenchWorkload, MlaSelectorsAndPreset) {
  EXPECT_EQ(select_mla_workloads("all").size(), mla_workloads().size());
  EXPECT_EQ(select_mla_workloads("mla-decode").size(), 12u);
  EXPECT_EQ(select_mla_workloads("mla-verify").size(), 2u);
  EXPECT_EQ(select_mla_workloads("mla-verify-tree").size(), 1u);
  EXPECT_EQ(select_mla_workloads("decode").size(), 12u);
  std::vector<Workload> two =
      select_mla_workloads("mla-verify-chain-64x4096+4,mla-decode-h16-1x32768-fp8");
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[1].name, "mla-decode-h16-1x32768-fp8");
  EXPECT_EQ(select_mla_workloads("mla-prefill").size(), 1u);
  EXPECT_EQ(select_mla_workloads("extend")[0].name, "mla-extend-8x4096+512");
  expect_error([] { select_mla_workloads("mla-mixed"); },
               {"'mla-mixed'", "mla-decode-h16-1x32768", "mla-extend"});
  expect_error([] { select_workloads("mla-decode"); }, {"'mla-decode'"});

  std::vector<Workload> small = apply_preset(mla_workloads(), "cpu-small");
  ASSERT_EQ(small.size(), mla_workloads().size());
  for (const Workload& w : small) {
    EXPECT_LE(counted_bytes(w), 1.25 * double(1ull << 30)) << w.name;
    EXPECT_LE(attention_work(w), 6e11) << w.name;
    EXPECT_TRUE(w.is_mla()) << w.name;
  }
  // The decode rows fit whole (the largest reads 1.13 GiB and does 2.9e11 FLOPs); the tree's
  // 1.2e12 FLOPs halve its batch.
  EXPECT_TRUE(by_name(small, "mla-decode-h128-128x8192").scale_note.empty());
  EXPECT_EQ(by_name(small, "mla-verify-tree-64x4096+16-topk4").batch, 32);
  // The MHA rows: the prefill's 1.1e13 FLOPs shrink to 2048 tokens, the extend's 1.5e12 to batch
  // 2 at full lengths, still in 4 chunks.
  EXPECT_EQ(by_name(small, "mla-prefill-1x16384").new_tokens, 2048);
  const Workload& extend = by_name(small, "mla-extend-8x4096+512");
  EXPECT_EQ(extend.batch, 2);
  EXPECT_EQ(extend.prefix_len, 4096);
  EXPECT_EQ(extend.new_tokens, 512);
  EXPECT_EQ(extend.prefix_chunks, 4);
  EXPECT_TRUE(extend.is_mla_mha());
}
