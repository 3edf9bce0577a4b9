// The cpu backend against the reference backend: random cases of every feature and targeted shapes
// (key splits over threads, page sizes, window edges, trees with siblings, head shapes that leave
// vector tails), each run with 1 and 2 threads; plus its fp8/bf16/fp16 widening, deterministic
// mode, strided tensors and the errors it reports.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/backend/registry.h"
#include "attnrt/backend/selection.h"
#include "attnrt/core/dtype.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/kernels/attention_kernels.h"
#include "tests/conformance/conformance.h"
#include "tests/test_util.h"

using namespace attnrt;
using namespace attnrt::conformance;

namespace {

// The registry entry of cpu with a fixed thread count (and deterministic mode); the options live
// as long as the process, as backends keep a pointer to them.
const BackendEntry& cpu_entry(int threads, bool deterministic = false) {
  struct Slot {
    Options options;
    BackendEntry entry;
  };
  static std::map<std::pair<int, bool>, std::unique_ptr<Slot>> slots;
  std::unique_ptr<Slot>& slot = slots[{threads, deterministic}];
  if (!slot) {
    slot = std::make_unique<Slot>();
    slot->options.num_threads = threads;
    slot->options.deterministic = deterministic;
    slot->entry = cpu_backend_entry();
    const Options* options = &slot->options;
    slot->entry.factory = [options](const BackendContext& ctx) -> std::unique_ptr<AttentionBackend> {
      BackendContext mine = ctx;
      mine.options = options;
      return std::make_unique<CpuBackend>(mine);
    };
  }
  return slot->entry;
}

LayerSpec make_layer(int q_heads, int kv_heads, int head_dim, int v_head_dim = 0) {
  return test::attention_layer(0, q_heads, kv_heads, head_dim, v_head_dim);
}

CaseSpec make_spec(std::string label, ForwardMode mode, std::vector<int32_t> prefix,
                   std::vector<int32_t> query, std::vector<LayerSpec> layers, uint64_t seed) {
  CaseSpec s;
  s.label = std::move(label);
  s.seed = seed;
  s.mode = mode;
  s.prefix_lens = std::move(prefix);
  s.query_lens = std::move(query);
  s.layers = std::move(layers);
  s.page_size = 16;
  return s;
}

// Verify trees: parents per request, request-major.
CaseSpec verify_spec(std::string label, std::vector<int32_t> prefix, int n_draft, int topk,
                     const std::vector<int32_t>& parents_of_one, std::vector<LayerSpec> layers,
                     uint64_t seed) {
  std::vector<int32_t> query(prefix.size(), n_draft);
  CaseSpec s = make_spec(std::move(label), ForwardMode::TARGET_VERIFY, prefix, query,
                         std::move(layers), seed);
  s.spec.draft_token_num = n_draft;
  s.spec.topk = topk;
  for (size_t i = 0; i < prefix.size(); ++i) {
    s.spec.parents.insert(s.spec.parents.end(), parents_of_one.begin(), parents_of_one.end());
  }
  return s;
}

void expect_matches_reference(const CaseSpec& spec) {
  const ConformanceCase c = make_case(spec);
  for (int threads : {1, 2}) {
    const CaseResult r = run_case(cpu_entry(threads), c);
    EXPECT_TRUE(r.ok) << threads << " thread(s): " << r.detail;
  }
}

// A backend bound to a fresh instance of the case, with the step planned.
struct Planned {
  std::unique_ptr<CaseInstance> instance;
  std::unique_ptr<CpuBackend> backend;
};
Planned plan_case(const ConformanceCase& c, int threads, bool deterministic = false) {
  Planned p;
  p.instance = materialize(c);
  p.instance->options.num_threads = threads;
  p.instance->options.deterministic = deterministic;
  p.backend = std::make_unique<CpuBackend>(p.instance->context(Device::cpu()));
  p.instance->storage.cache->begin_step(p.instance->batch);
  p.backend->init_forward_metadata(p.instance->batch);
  return p;
}

std::vector<uint8_t> bytes_of(const HostBuffer& b) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  return {p, p + b.bytes()};
}

// ------------------------------------------------------------------------------------------------

TEST(CpuBackend, RegistersAutoSelectableWithEveryFullAttentionFeature) {
  const BackendEntry& e = Registry::global().get("cpu");
  EXPECT_TRUE(e.auto_selectable);
  EXPECT_EQ(e.unavailable_reason(), "");
  EXPECT_EQ(e.caps.devices, std::vector<DeviceKind>{DeviceKind::cpu});
  EXPECT_TRUE(e.caps.page_sizes.empty());
  EXPECT_EQ(e.caps.kv_dtypes.size(), 5u);
  EXPECT_TRUE(e.caps.spec_topk1 && e.caps.spec_topk_gt1 && e.caps.sliding_window &&
              e.caps.softcap && e.caps.sinks && e.caps.non_causal);
  EXPECT_TRUE(e.caps.mla);
  EXPECT_FALSE(e.caps.cuda_graphs);
  const std::string target = cpu_simd_target();
  EXPECT_FALSE(target.empty());
  EXPECT_NE(e.summary.find(target), std::string::npos) << e.summary;
}

TEST(CpuBackend, WidensEveryFp8CodeLikeTheDtypeLibrary) {
  for (DType t : {DType::e4m3, DType::e5m2}) {
    // 256 codes plus a tail that is not a whole vector.
    std::vector<uint8_t> codes(256 + 7);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 97 + 13);
    std::iota(codes.begin(), codes.begin() + 256, 0);
    std::vector<float> got(codes.size());
    cpu::convert_to_float(t, codes.data(), static_cast<int64_t>(codes.size()), got.data());
    for (size_t i = 0; i < codes.size(); ++i) {
      const float want = t == DType::e4m3 ? e4m3_to_float(codes[i]) : e5m2_to_float(codes[i]);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got[i])) << dtype_name(t) << " code " << int{codes[i]};
      } else {
        EXPECT_EQ(std::memcmp(&want, &got[i], sizeof(float)), 0)
            << dtype_name(t) << " code " << int{codes[i]} << ": " << got[i] << " vs " << want;
      }
    }
  }
}

TEST(CpuBackend, WidensEveryFp8CodeToBf16ForTheDotKernels) {
  // Every fp8 value, subnormals included, is a bf16 normal: the words must be exact (vdpbf16ps
  // would read a bf16 subnormal as zero), NaN codes NaN. Codes in an order that crosses the two
  // byte tables and a tail that is not a whole vector.
  std::vector<uint8_t> codes(256 + 37);
  std::iota(codes.begin(), codes.begin() + 256, 0);
  std::shuffle(codes.begin(), codes.begin() + 256, std::mt19937(0xf8));
  for (size_t i = 256; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 97 + 13);
  for (DType t : {DType::e4m3, DType::e5m2}) {
    std::vector<uint16_t> got(codes.size(), 0xdead);
    if (!cpu::widen_fp8_to_bf16(t, codes.data(), static_cast<int64_t>(codes.size()), got.data())) {
      EXPECT_EQ(cpu_simd_target().find("+BF16"), std::string::npos)
          << "the bf16 dot kernels run, so the fp8 widening must too (AVX-512 VBMI present?)";
      EXPECT_EQ(got[0], 0xdead);
      continue;
    }
    const float factor = cpu::kernel_load_factor(t);
    int subnormals = 0;
    for (size_t i = 0; i < codes.size(); ++i) {
      const float want = t == DType::e4m3 ? e4m3_to_float(codes[i]) : e5m2_to_float(codes[i]);
      const uint16_t word = got[i];
      const float value = bf16_to_float(word);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(value)) << dtype_name(t) << " code " << int{codes[i]};
        continue;
      }
      EXPECT_EQ(value * factor, want) << dtype_name(t) << " code " << int{codes[i]};
      EXPECT_EQ(std::signbit(value), std::signbit(want))
          << dtype_name(t) << " code " << int{codes[i]};
      const bool bf16_subnormal = (word & 0x7f80) == 0 && (word & 0x7f) != 0;
      EXPECT_FALSE(bf16_subnormal) << dtype_name(t) << " code " << int{codes[i]};
      if (i < 256 && want != 0.f && (codes[i] & (t == DType::e4m3 ? 0x78 : 0x7c)) == 0) {
        ++subnormals;
      }
    }
    // Both signs of every nonzero subnormal mantissa were checked.
    EXPECT_EQ(subnormals, t == DType::e4m3 ? 14 : 6) << dtype_name(t);
  }
}

TEST(CpuBackend, WidensEveryBf16AndFp16Code) {
  std::vector<uint16_t> codes(65536 + 5);
  std::iota(codes.begin(), codes.begin() + 65536, 0);
  for (size_t i = 65536; i < codes.size(); ++i) codes[i] = static_cast<uint16_t>(i * 7919);
  std::vector<float> got(codes.size());
  for (DType t : {DType::bf16, DType::f16}) {
    cpu::convert_to_float(t, codes.data(), static_cast<int64_t>(codes.size()), got.data());
    int bad = 0;
    for (size_t i = 0; i < codes.size(); ++i) {
      const float want = t == DType::bf16 ? bf16_to_float(codes[i]) : fp16_to_float(codes[i]);
      const bool same = std::isnan(want) ? std::isnan(got[i])
                                         : std::memcmp(&want, &got[i], sizeof(float)) == 0;
      if (!same && ++bad <= 3) {
        ADD_FAILURE() << dtype_name(t) << " code " << codes[i] << ": " << got[i] << " vs " << want;
      }
    }
    EXPECT_EQ(bad, 0) << dtype_name(t);
  }
}

TEST(CpuBackend, MatchesReferenceOnRandomCasesOfEveryFeatureWithOneAndTwoThreads) {
  const BackendCaps& caps = Registry::global().get("cpu").caps;
  for (Feature f : all_features()) {
    ASSERT_EQ(unsupported_reason(caps, f), "") << feature_name(f);
    for (uint64_t seed = 0; seed < 4; ++seed) {
      const ConformanceCase c = generate_case(f, 0x6a11ull * 131 + seed, caps);
      for (int threads : {1, 2}) {
        const CaseResult r = run_case(cpu_entry(threads), c);
        EXPECT_TRUE(r.ok) << threads << " thread(s): " << r.detail;
      }
    }
  }
}

TEST(CpuBackend, LongDecodeIsSplitOverThreadsAndMergedByLogSumExp) {
  // One KV head, so that only a key split can occupy a second thread; sinks and lse go through
  // the merge as well.
  LayerSpec layer = make_layer(8, 1, 128);
  layer.has_sinks = true;
  for (DType kv : {DType::f32, DType::bf16, DType::e4m3}) {
    CaseSpec s = make_spec("long-decode", ForwardMode::DECODE, {3000, 700, 1}, {1, 1, 1},
                           {layer}, 0xdec0de + static_cast<int>(kv));
    s.kv_dtype = kv;
    s.want_lse = true;
    if (kv == DType::e4m3) s.k_scale = 0.5f, s.v_scale = 1.75f;
    const ConformanceCase c = make_case(s);
    const Planned two = plan_case(c, 2);
    EXPECT_GT(two.backend->work_summary(c.model.layers[0]).merges, 0) << "no key split planned";
    const Planned one = plan_case(c, 1);
    EXPECT_EQ(one.backend->work_summary(c.model.layers[0]).merges, 0);
    expect_matches_reference(s);
  }
}

TEST(CpuBackend, LongPrefixExtendAndVerifyAreSplitOverThreads) {
  const LayerSpec layer = make_layer(4, 1, 64);
  const CaseSpec extend =
      make_spec("long-extend", ForwardMode::EXTEND, {2100}, {8}, {layer}, 0xe87e4d);
  EXPECT_GT(plan_case(make_case(extend), 2).backend->work_summary(layer).merges, 0);
  expect_matches_reference(extend);

  const std::vector<int32_t> tree = {-1, 0, 0, 0, 1, 1, 2, 4};
  const CaseSpec verify = verify_spec("long-verify-tree", {2500, 40}, 8, 3, tree, {layer}, 0x7e5);
  EXPECT_GT(plan_case(make_case(verify), 2).backend->work_summary(layer).merges, 0);
  expect_matches_reference(verify);
}

TEST(CpuBackend, PageSizes1_16_64WithPrefixesOnAndOffPageBoundaries) {
  const LayerSpec layer = make_layer(8, 2, 64);
  for (int page : {1, 16, 64}) {
    for (ForwardMode mode : {ForwardMode::EXTEND, ForwardMode::DECODE, ForwardMode::MIXED}) {
      const std::vector<int32_t> prefix = {0, page, 2 * page - 1, 3 * page + 1, 5, 130};
      std::vector<int32_t> query = {9, 17, 1, 33, 2, 1};
      if (mode == ForwardMode::DECODE) query.assign(prefix.size(), 1);
      CaseSpec s = make_spec("pages", mode, prefix, query, {layer}, 0x9a6e + page);
      s.page_size = page;
      s.kv_dtype = s.act_dtype = DType::bf16;
      expect_matches_reference(s);
    }
  }
}

TEST(CpuBackend, SlidingWindowEdgesInHybridAndSingleSwaPools) {
  for (int window : {0, 1, 7, 32, 33}) {
    LayerSpec swa = make_layer(8, 2, 64);
    swa.kind = LayerKind::swa;
    swa.sliding_window = window;
    LayerSpec swa_mha = make_layer(4, 4, 64);
    swa_mha.kind = LayerKind::swa;
    swa_mha.sliding_window = window;
    // Windowed layers next to a full layer read the SWA pool of a hybrid cache through its slot
    // map; a model of windowed layers only has one plain pool.
    for (const std::vector<LayerSpec>& layers :
         {std::vector<LayerSpec>{swa, swa_mha, make_layer(4, 1, 64)},
          std::vector<LayerSpec>{swa, swa_mha}}) {
      expect_matches_reference(make_spec("window-extend", ForwardMode::EXTEND, {50, 0, 97},
                                         {70, 40, 3}, layers, 0x3d + window));
      expect_matches_reference(make_spec("window-decode", ForwardMode::DECODE, {50, 0, 97, 700},
                                         {1, 1, 1, 1}, layers, 0x3e + window));
      const std::vector<int32_t> tree = {-1, 0, 1, 2, 3, 0, 5, 6, 1, 8};
      expect_matches_reference(
          verify_spec("window-verify", {64, 5}, 10, 2, tree, layers, 0x3f + window));
    }
  }
}

TEST(CpuBackend, TreesWithSiblingsAndMoreThan64Drafts) {
  const std::vector<LayerSpec> layers = {make_layer(8, 2, 128), make_layer(6, 6, 64)};
  // Siblings at every level (topk 4): a sibling or cousin must stay invisible.
  const std::vector<int32_t> tree16 = {-1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 5, 5, 5};
  expect_matches_reference(verify_spec("tree16", {37, 0, 128}, 16, 4, tree16, layers, 0x16));
  // 70 drafts: the ancestor mask spans two 64-bit words.
  std::mt19937_64 rng(70);
  std::vector<int32_t> tree70(70, -1);
  for (int t = 1; t < 70; ++t) tree70[t] = std::uniform_int_distribution<int>(0, t - 1)(rng);
  expect_matches_reference(verify_spec("tree70", {21, 300}, 70, 4, tree70, layers, 0x70));
  // A chain given as parents runs the unmasked causal path and must agree too.
  std::vector<int32_t> chain(12);
  std::iota(chain.begin(), chain.end(), -1);
  expect_matches_reference(verify_spec("chain12", {80, 3}, 12, 1, chain, layers, 0xc4a1));
}

TEST(CpuBackend, HeadShapesGroupsAndVectorTails) {
  struct Shape {
    int hq, hkv, d, dv;
  };
  // Groups 1..40 (decomposed into 8/4/2/1 heads per pass, or split when wider than a tile) and
  // head dims that are not a whole number of vectors, with v_head_dim != head_dim.
  const std::vector<Shape> shapes = {{3, 3, 40, 40},  {6, 2, 72, 70},  {5, 1, 96, 64},
                                     {7, 1, 64, 80},  {8, 1, 256, 256}, {32, 1, 16, 24},
                                     {40, 1, 32, 32}, {12, 4, 8, 4}};
  uint64_t seed = 1;
  for (const Shape& sh : shapes) {
    const LayerSpec layer = make_layer(sh.hq, sh.hkv, sh.d, sh.dv);
    expect_matches_reference(make_spec("shape-extend", ForwardMode::EXTEND, {19, 0}, {23, 40},
                                       {layer}, seed++));
    expect_matches_reference(make_spec("shape-decode", ForwardMode::DECODE, {19, 600, 0},
                                       {1, 1, 1}, {layer}, seed++));
  }
}

TEST(CpuBackend, Bf16StepsWithOddShapesWindowsTreesAndSplits) {
  // All-bf16 steps run the bf16 dot-product kernels where the CPU has them: odd key counts per
  // block, value dims that leave pair and vector tails, SWA keys the pool dropped, tree masks,
  // soft-cap, single-query rows and key splits.
  struct Shape {
    int hq, hkv, d, dv;
  };
  const std::vector<Shape> shapes = {{8, 2, 72, 70}, {6, 1, 40, 24}, {32, 8, 128, 128}};
  const std::vector<int32_t> tree = {-1, 0, 0, 1, 2, 2, 3};
  uint64_t seed = 0xbf16;
  for (const Shape& sh : shapes) {
    LayerSpec full = make_layer(sh.hq, sh.hkv, sh.d, sh.dv);
    full.logit_cap = 20.f;
    LayerSpec swa = full;
    swa.kind = LayerKind::swa;
    swa.sliding_window = 37;
    std::vector<CaseSpec> specs = {
        make_spec("bf16-extend", ForwardMode::EXTEND, {0, 45, 1}, {67, 33, 99}, {swa, full},
                  seed++),
        make_spec("bf16-long", ForwardMode::EXTEND, {1500}, {9}, {full}, seed++),
        verify_spec("bf16-tree", {61, 0}, 7, 2, tree, {swa, full}, seed++),
        make_spec("bf16-decode", ForwardMode::DECODE, {0, 63, 64, 2900}, {1, 1, 1, 1},
                  {swa, full}, seed++),
        make_spec("bf16-mixed", ForwardMode::MIXED, {130, 7, 0}, {1, 20, 1}, {full}, seed++)};
    for (CaseSpec& s : specs) {
      s.kv_dtype = s.act_dtype = DType::bf16;
      s.q_amplitude = 2.f;
      s.want_lse = true;
      expect_matches_reference(s);
    }
  }
  // fp8 KV under bf16 activations (decode rows widened to bf16 for the dot kernels where head
  // dims are whole 64s, fp32 otherwise), scales that put many values among the fp8 subnormals;
  // groups of 4 and of 8 (two value passes), a head dim the dot kernels leave to fp32.
  const std::vector<LayerSpec> fp8_layers = {make_layer(8, 2, 64), make_layer(16, 2, 128, 64),
                                             make_layer(4, 1, 96)};
  for (DType kv : {DType::e4m3, DType::e5m2}) {
    for (float k_scale : {0.02f, 1.f, 3.f}) {
      CaseSpec s = make_spec("bf16-fp8", ForwardMode::MIXED, {0, 63, 64, 2900, 8}, {1, 1, 1, 1, 12},
                             fp8_layers, seed++);
      s.act_dtype = DType::bf16;
      s.kv_dtype = kv;
      s.k_scale = k_scale;
      s.v_scale = 1.f / k_scale;
      s.want_lse = true;
      expect_matches_reference(s);
    }
  }
}

TEST(CpuBackend, Bf16PrefillTilesWithoutSoftCap) {
  // Without a soft-cap, the bf16 tiles take a block's maxima from the score kernel and skip the
  // masking pass wherever no mask reaches the block: prompts long enough for many such blocks next
  // to causal, window and prefix edges; groups that fill the widest tile exactly (4), leave it
  // padding rows (3, 6) or give it one head (1); sinks, non-causal, lse, and an amplitude that
  // puts many probabilities far below their row's maximum.
  struct Shape {
    int hq, hkv, d, dv;
  };
  const std::vector<Shape> shapes = {{8, 2, 128, 128}, {9, 3, 64, 64}, {6, 1, 72, 70},
                                     {2, 2, 128, 128}};
  uint64_t seed = 0x64b1;
  for (const Shape& sh : shapes) {
    const LayerSpec full = make_layer(sh.hq, sh.hkv, sh.d, sh.dv);
    LayerSpec swa = full;
    swa.kind = LayerKind::swa;
    swa.sliding_window = 150;
    LayerSpec sinks = full;
    sinks.has_sinks = true;
    LayerSpec bidirectional = full;
    bidirectional.attn_type = AttnType::decoder_bidirectional;
    std::vector<CaseSpec> specs = {
        make_spec("bf16-prefill", ForwardMode::EXTEND, {0, 200, 70}, {300, 129, 64},
                  {swa, full}, seed++),
        make_spec("bf16-prefill-sinks", ForwardMode::EXTEND, {0, 33}, {257, 190}, {sinks},
                  seed++),
        make_spec("bf16-prefill-bidirectional", ForwardMode::EXTEND, {0, 100}, {200, 65},
                  {bidirectional}, seed++)};
    for (CaseSpec& s : specs) {
      s.kv_dtype = s.act_dtype = DType::bf16;
      s.q_amplitude = 4.f;
      s.want_lse = true;
      expect_matches_reference(s);
    }
  }
}

TEST(CpuBackend, EveryKvDtypeWithScalesInEveryMode) {
  LayerSpec layer = make_layer(8, 2, 64);
  layer.logit_cap = 8.f;
  const std::vector<int32_t> tree = {-1, 0, 0, 1, 1, 2};
  for (DType kv : {DType::f32, DType::f16, DType::bf16, DType::e4m3, DType::e5m2}) {
    std::vector<CaseSpec> specs = {
        make_spec("dtype-extend", ForwardMode::EXTEND, {33, 0}, {20, 7}, {layer}, 11),
        make_spec("dtype-decode", ForwardMode::DECODE, {33, 290}, {1, 1}, {layer}, 12),
        make_spec("dtype-mixed", ForwardMode::MIXED, {33, 290, 4}, {1, 1, 30}, {layer}, 13),
        make_spec("dtype-draft", ForwardMode::DRAFT_EXTEND, {40, 9}, {3, 1}, {layer}, 14),
        verify_spec("dtype-tree", {40, 9}, 6, 2, tree, {layer}, 15)};
    for (CaseSpec& s : specs) {
      s.kv_dtype = kv;
      s.act_dtype = kv == DType::f16 ? DType::f16 : kv == DType::bf16 ? DType::bf16 : DType::f32;
      if (is_fp8(kv)) s.k_scale = 0.3f, s.v_scale = 2.5f;
      s.q_amplitude = 2.f;
      s.want_lse = true;
      expect_matches_reference(s);
    }
  }
}

// MLA (§8.1): one latent kv head shared by every q head, scores over 576 dims, V = the first 512
// columns read through the pool's view of K; every mode, the bf16 dot kernels, fp8 with its scale,
// key splits over threads (the long decode and extend rows).
TEST(CpuBackend, MlaMatchesReferenceInEveryModeAndKvDtype) {
  LayerSpec mla = make_layer(16, 1, 576, 512);
  mla.kind = LayerKind::mla;
  mla.kv_lora_rank = 512;
  mla.qk_rope_head_dim = 64;
  mla.scaling = 1.f / std::sqrt(192.f);
  LayerSpec small = mla;
  small.num_q_heads = 4;
  small.head_dim = 192;
  small.v_head_dim = small.kv_lora_rank = 128;
  const std::vector<int32_t> tree = {-1, 0, 0, 1, 1, 2};
  for (DType kv : {DType::f32, DType::bf16, DType::e4m3, DType::e5m2}) {
    std::vector<CaseSpec> specs = {
        make_spec("mla-extend", ForwardMode::EXTEND, {33, 0}, {20, 7}, {mla, small}, 31),
        make_spec("mla-decode", ForwardMode::DECODE, {33, 700, 0}, {1, 1, 1}, {mla, small}, 32),
        make_spec("mla-mixed", ForwardMode::MIXED, {33, 290, 4}, {1, 1, 30}, {mla, small}, 33),
        make_spec("mla-draft", ForwardMode::DRAFT_EXTEND, {40, 9}, {3, 1}, {mla, small}, 34),
        make_spec("mla-draft-v2", ForwardMode::DRAFT_EXTEND_V2, {40, 9}, {3, 3}, {mla, small}, 35),
        verify_spec("mla-chain", {40, 9}, 4, 1, {-1, 0, 1, 2}, {mla, small}, 36),
        verify_spec("mla-tree", {40, 9}, 6, 2, tree, {mla, small}, 37)};
    for (CaseSpec& s : specs) {
      s.kv_dtype = kv;
      s.act_dtype = kv == DType::f32 ? DType::f32 : DType::bf16;
      if (is_fp8(kv)) s.k_scale = s.v_scale = 0.3f;
      s.want_lse = true;
      SCOPED_TRACE(s.describe());
      expect_matches_reference(s);
    }
  }
}

// Wide groups (16 and 128 q heads on one latent head) run every single query and extend as tiles
// of heads, V read from the widened K block: ragged lengths, page sizes 1 / 16 / 64, bf16 and
// fp8 latents, decode and extend rows in one step, key splits over threads; and the plan puts
// no item on the single-query kernel.
TEST(CpuBackend, MlaWideGroupsRunAsTilesOfHeadsAndMatchReference) {
  for (int heads : {16, 128}) {
    LayerSpec mla = make_layer(heads, 1, 576, 512);
    mla.kind = LayerKind::mla;
    mla.kv_lora_rank = 512;
    mla.qk_rope_head_dim = 64;
    mla.scaling = 1.f / std::sqrt(192.f);
    for (int page : {1, 16, 64}) {
      for (DType kv : {DType::bf16, DType::e4m3}) {
        CaseSpec s = make_spec("mla-wide", ForwardMode::MIXED, {0, page + 3, 5, 300},
                               {1, 1, 9, heads == 128 ? 2 : 17}, {mla}, 0x3a + page + heads);
        s.page_size = page;
        s.kv_dtype = kv;
        s.act_dtype = DType::bf16;
        if (is_fp8(kv)) s.k_scale = s.v_scale = 0.7f;
        SCOPED_TRACE(fmt::format("{} heads, page {}, {}", heads, page, dtype_name(kv)));
        EXPECT_EQ(plan_case(make_case(s), 2).backend->work_summary(mla).single_query, 0);
        expect_matches_reference(s);
      }
    }
  }
}

TEST(CpuBackend, NonCausalSeesTheWholeRequest) {
  LayerSpec layer = make_layer(4, 2, 64);
  layer.attn_type = AttnType::decoder_bidirectional;
  expect_matches_reference(
      make_spec("non-causal", ForwardMode::EXTEND, {0, 30, 300}, {45, 12, 2}, {layer}, 0xb1d));
}

TEST(CpuBackend, DeterministicModeIsBatchAndThreadInvariant) {
  const LayerSpec layer = make_layer(4, 1, 64);
  // Request 0 alone and in a batch with other requests, 1 and 2 threads: identical bits.
  CaseSpec batch_spec = make_spec("det-batch", ForwardMode::DECODE, {5000, 300, 2600}, {1, 1, 1},
                                  {layer}, 0xde7);
  const ConformanceCase batched = make_case(batch_spec);
  CaseSpec alone_spec = make_spec("det-alone", ForwardMode::DECODE, {5000}, {1}, {layer}, 0xde7);
  ConformanceCase alone = make_case(alone_spec);
  const int hkv = layer.num_kv_heads, hq = layer.num_q_heads, d = layer.head_dim;
  LayerValues& a = alone.values[0];
  const LayerValues& b = batched.values[0];
  a.prefix_k.assign(b.prefix_k.begin(), b.prefix_k.begin() + 5000 * hkv * d);
  a.prefix_v.assign(b.prefix_v.begin(), b.prefix_v.begin() + 5000 * hkv * d);
  a.q.assign(b.q.begin(), b.q.begin() + hq * d);
  a.k.assign(b.k.begin(), b.k.begin() + hkv * d);
  a.v.assign(b.v.begin(), b.v.begin() + hkv * d);

  auto first_row = [&](const ConformanceCase& c, int threads) {
    auto inst = materialize(c);
    const RunOutput out = run_backend(cpu_entry(threads, true), c, *inst);
    std::vector<uint8_t> bytes = bytes_of(out.out[0]);
    bytes.resize(static_cast<size_t>(hq) * d * dtype_size(c.spec.act_dtype));
    return bytes;
  };
  const std::vector<uint8_t> want = first_row(alone, 1);
  EXPECT_EQ(first_row(alone, 2), want);
  EXPECT_EQ(first_row(batched, 1), want);
  EXPECT_EQ(first_row(batched, 2), want);
  EXPECT_TRUE(run_case(cpu_entry(2, true), batched).ok);
}

TEST(CpuBackend, ReadsStridedTensorsAndStoredKvWithoutStepTensors) {
  const LayerSpec layer = make_layer(8, 2, 64);
  const ConformanceCase c =
      make_case(make_spec("strided", ForwardMode::EXTEND, {20, 3}, {17, 30}, {layer}, 0x5d));
  const int64_t t = 47, hq = 8, hkv = 2, d = 64;
  auto fill = [](HostBuffer& buf, const std::vector<float>& values, int64_t rows, int64_t cols,
                 int64_t stride) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < cols; ++k) {
        store_from_float(buf.data(), buf.dtype(), r * stride + k, values[r * cols + k]);
      }
    }
  };
  // q rows padded to 3 / 2 times their width (a slice of a fused qkv buffer), out likewise.
  HostBuffer q(DType::f32, {t, hq, 3 * d}), k(DType::f32, {t, hkv, d}), v(DType::f32, {t, hkv, d});
  fill(q, c.values[0].q, t * hq, d, 3 * d);
  fill(k, c.values[0].k, t * hkv, d, d);
  fill(v, c.values[0].v, t * hkv, d, d);
  HostBuffer out_wide(DType::f32, {t, hq, 2 * d});
  HostBuffer out_again(DType::f32, {t, hq, d});

  Planned p = plan_case(c, 2);
  AttnArgs args;
  args.q = q.view();
  args.q.shape[2] = d;
  args.k = k.view();
  args.v = v.view();
  args.out = out_wide.view();
  args.out.shape[2] = d;
  p.backend->forward(args, c.model.layers[0], p.instance->batch);
  // Again without k/v (already stored, as under cross-layer KV sharing): same result.
  args.k = TensorView();
  args.v = TensorView();
  args.out = out_again.view();
  p.backend->forward(args, c.model.layers[0], p.instance->batch);

  auto inst = materialize(c);
  const RunOutput want = run_backend(cpu_entry(2), c, *inst);
  const float* w = want.out[0].ptr<float>();
  for (int64_t r = 0; r < t * hq; ++r) {
    for (int64_t j = 0; j < d; ++j) {
      ASSERT_EQ(out_wide.ptr<float>()[r * 2 * d + j], w[r * d + j]) << "row " << r << " dim " << j;
      ASSERT_EQ(out_again.ptr<float>()[r * d + j], w[r * d + j]) << "row " << r << " dim " << j;
    }
  }
}

TEST(CpuBackend, IdleStepTouchesNothing) {
  const LayerSpec layer = make_layer(4, 2, 64);
  const ConformanceCase c =
      make_case(make_spec("idle-base", ForwardMode::EXTEND, {5}, {3}, {layer}, 0x1d1e));
  auto inst = materialize(c);
  inst->batch = make_idle_batch();
  CpuBackend backend(inst->context(Device::cpu()));
  backend.init_forward_metadata(inst->batch);
  float poison = std::nanf("");
  AttnArgs args;
  args.q = TensorView(&poison, DType::f32, {0, 4, 64});
  args.out = TensorView(&poison, DType::f32, {0, 4, 64});
  backend.forward(args, c.model.layers[0], inst->batch);
  EXPECT_TRUE(std::isnan(poison));
}

// ------------------------------------------------------------------------------------------------
// Errors.

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(CpuBackend, ThreadCountComesFromOptionsThenEnvironment) {
  Options o;
  o.num_threads = 3;
  EXPECT_EQ(cpu_num_threads(&o), 3);
  o.num_threads = 0;
  const char* saved = std::getenv("ATTNRT_NUM_THREADS");
  const std::string saved_value = saved ? saved : "";
  setenv("ATTNRT_NUM_THREADS", "5", 1);
  EXPECT_EQ(cpu_num_threads(&o), 5);
  setenv("ATTNRT_NUM_THREADS", "two", 1);
  EXPECT_NE(error_of([&] { cpu_num_threads(&o); }).find("ATTNRT_NUM_THREADS = 'two'"),
            std::string::npos);
  setenv("ATTNRT_NUM_THREADS", "0", 1);
  EXPECT_NE(error_of([&] { cpu_num_threads(&o); }).find("an integer in [1, "), std::string::npos);
  setenv("ATTNRT_NUM_THREADS", std::to_string(max_num_threads() + 1).c_str(), 1);
  EXPECT_NE(error_of([&] { cpu_num_threads(&o); }).find("four per hardware thread"),
            std::string::npos);
  unsetenv("ATTNRT_NUM_THREADS");
  EXPECT_GE(cpu_num_threads(&o), 1);
  if (saved) setenv("ATTNRT_NUM_THREADS", saved_value.c_str(), 1);
  o.num_threads = -2;
  EXPECT_NE(error_of([&] { cpu_num_threads(&o); }).find("num_threads = -2"), std::string::npos);
}

struct ErrorFixture {
  ConformanceCase c;
  Planned p;
  HostBuffer q, k, v, out;
  AttnArgs args;
  explicit ErrorFixture(LayerSpec layer)
      : c(make_case(make_spec("errors", ForwardMode::EXTEND, {6, 2}, {5, 4}, {layer}, 0xe4))),
        p(plan_case(c, 2)),
        q(DType::f32, {9, layer.num_q_heads, layer.head_dim}),
        k(DType::f32, {9, layer.num_kv_heads, layer.head_dim}),
        v(DType::f32, {9, layer.num_kv_heads, layer.head_dim}),
        out(DType::f32, {9, layer.num_q_heads, layer.head_dim}) {
    args.q = q.view();
    args.k = k.view();
    args.v = v.view();
    args.out = out.view();
  }
  std::string forward(const LayerSpec& layer) {
    return error_of([&] { p.backend->forward(args, layer, p.instance->batch); });
  }
  // Checksum of the layer's K and V pools: a rejected call must not store anything.
  uint64_t pool_checksum() const {
    const KVLayerView kv = p.instance->storage.cache->layer(0);
    const size_t bytes = static_cast<size_t>(kv.num_rows * kv.k_row_stride) * dtype_size(kv.dtype);
    uint64_t h = 1469598103934665603ull;
    for (const void* base : {kv.k, kv.v}) {
      const auto* b = static_cast<const uint8_t*>(base);
      for (size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
    }
    return h;
  }
};

TEST(CpuBackend, RejectsBadArgumentsBeforeStoringAnything) {
  const LayerSpec layer = make_layer(4, 2, 32);
  ErrorFixture f(layer);
  const uint64_t before = f.pool_checksum();

  HostBuffer bad_q(DType::f32, {9, 3, 32});
  f.args.q = bad_q.view();
  EXPECT_NE(f.forward(layer).find("cpu backend: q is fp32[9, 3, 32]"), std::string::npos)
      << f.forward(layer);
  f.args.q = f.q.view();

  f.args.v = TensorView();
  EXPECT_NE(f.forward(layer).find("pass both"), std::string::npos) << f.forward(layer);
  f.args.v = f.v.view();

  LayerSpec with_sinks = layer;
  with_sinks.has_sinks = true;
  EXPECT_NE(f.forward(with_sinks).find("has sinks but AttnArgs.sinks is null"), std::string::npos)
      << f.forward(with_sinks);

  LayerSpec windowed_non_causal = layer;
  windowed_non_causal.attn_type = AttnType::decoder_bidirectional;
  windowed_non_causal.sliding_window = 4;
  EXPECT_NE(f.forward(windowed_non_causal).find("non-causal with sliding_window 4"),
            std::string::npos);

  HostBuffer bad_lse(DType::f32, {9, 5});
  f.args.lse = bad_lse.view();
  EXPECT_NE(f.forward(layer).find("expected fp32[9, 4]"), std::string::npos) << f.forward(layer);
  f.args.lse = TensorView();

  LayerSpec mla = layer;
  mla.kind = LayerKind::mla;
  EXPECT_NE(f.forward(mla).find("mla layer 0 has 2 kv heads"), std::string::npos)
      << f.forward(mla);
  LayerSpec gdn = layer;
  gdn.kind = LayerKind::gdn;
  EXPECT_NE(f.forward(gdn).find("serves full, swa and mla layers"), std::string::npos)
      << f.forward(gdn);

  EXPECT_EQ(f.pool_checksum(), before);
}

TEST(CpuBackend, RejectsAForwardWithoutItsPlanAndABadRequestRow) {
  const LayerSpec layer = make_layer(4, 2, 32);
  ErrorFixture f(layer);
  // A plan for a different step.
  CpuBackend unplanned(f.p.instance->context(Device::cpu()));
  EXPECT_NE(error_of([&] { unplanned.forward(f.args, layer, f.p.instance->batch); })
                .find("without a matching init_forward_metadata"),
            std::string::npos);

  // A request row pointing past the pool: rejected by the plan, before any layer stores.
  const uint64_t before = f.pool_checksum();
  const int64_t row = f.p.instance->batch.req_pool_indices[0];
  const int64_t bad = f.p.instance->storage.cache->layer(0).num_rows + 5;
  f.p.instance->req_to_token->write(static_cast<int>(row), 1, std::span<const int64_t>(&bad, 1));
  const std::string e = error_of([&] { f.p.backend->init_forward_metadata(f.p.instance->batch); });
  EXPECT_NE(e.find(fmt::format("a request row holds slot {}", bad)), std::string::npos) << e;
  EXPECT_EQ(f.pool_checksum(), before);
}

}  // namespace
