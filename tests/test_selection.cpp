// resolve_backends: the inheritance rule (§5.2), auto-selection and its reasons (§5.3), and every
// rejection (§9) with the option, the value, what is supported and what to use instead. Backends
// are test-local registry entries with chosen caps; the CUDA device is described explicitly.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/registry.h"
#include "attnrt/backend/selection.h"
#include "attnrt/core/error.h"

using namespace attnrt;

namespace {

const std::vector<DType> kAllKv = {DType::f32, DType::f16, DType::bf16, DType::e4m3, DType::e5m2};

BackendEntry entry(std::string name, BackendCaps caps, bool auto_selectable = true,
                   std::string unavailable = "") {
  BackendEntry e;
  e.name = std::move(name);
  e.summary = "test entry";
  e.caps = std::move(caps);
  e.auto_selectable = auto_selectable;
  e.unavailable_reason = [unavailable] { return unavailable; };
  return e;
}

BackendCaps reference_caps() {
  BackendCaps c;
  c.devices = {DeviceKind::cpu};
  c.kv_dtypes = kAllKv;
  c.spec_topk1 = c.spec_topk_gt1 = c.sliding_window = c.softcap = c.sinks = c.mla = c.non_causal =
      true;
  return c;
}

BackendCaps cpu_caps() {
  BackendCaps c = reference_caps();
  c.mla = false;
  return c;
}

// A Hopper-style GPU backend: native pages, no e5m2, chain verify only, no sinks, fixed head dims.
BackendCaps cuda_caps() {
  BackendCaps c;
  c.devices = {DeviceKind::cuda};
  c.page_sizes = {1, 8, 16, 32, 64, 128};
  c.kv_dtypes = {DType::bf16, DType::f16, DType::e4m3};
  c.head_dims = {64, 128, 256, 512, 576};
  c.spec_topk1 = c.sliding_window = c.softcap = c.mla = c.non_causal = c.cuda_graphs = true;
  return c;
}

// Supports nothing beyond plain causal full attention.
BackendCaps basic_caps() {
  BackendCaps c;
  c.devices = {DeviceKind::cpu};
  c.kv_dtypes = {DType::bf16};
  return c;
}

struct Registries {
  // reference + cpu + cuda (+ basic): the usual line-up.
  static Registry standard(std::string cuda_unavailable = "") {
    Registry r;
    r.add(entry("reference", reference_caps(), /*auto_selectable=*/false));
    r.add(entry("cpu", cpu_caps()));
    r.add(entry("cuda", cuda_caps(), true, std::move(cuda_unavailable)));
    r.add(entry("basic", basic_caps(), /*auto_selectable=*/false));
    return r;
  }
};

CudaDeviceInfo no_gpu() {
  CudaDeviceInfo d;
  d.reason = "no CUDA driver is installed (libcuda.so not found)";
  return d;
}

// What the cuda entry reports on a machine without a GPU.
const std::string kNoCuda = "no usable CUDA device";

CudaDeviceInfo gpu(int major, int minor) {
  CudaDeviceInfo d;
  d.usable = true;
  d.name = major == 9 ? "NVIDIA H200" : "NVIDIA A100";
  d.device_count = 1;
  d.cc_major = major;
  d.cc_minor = minor;
  return d;
}

// Random small models: fresh shapes per test, so no check depends on one fixed layout.
class ModelMaker {
 public:
  ModelMaker() : seed_(std::random_device{}()), rng_(seed_) {}
  unsigned seed() const { return seed_; }
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  ModelSpec dense(int head_dim = 0) {
    ModelSpec m;
    m.name = fmt::format("random-{}", uniform(100, 999));
    m.dtype = DType::bf16;
    const int n = uniform(2, 12);
    const int kv = 1 << uniform(0, 3);
    const int q = kv * (1 << uniform(0, 3));
    const int d = head_dim ? head_dim : 64 << uniform(0, 2);
    for (int i = 0; i < n; ++i) {
      LayerSpec l;
      l.layer_id = i;
      l.num_q_heads = q;
      l.num_kv_heads = kv;
      l.head_dim = l.v_head_dim = d;
      m.layers.push_back(l);
    }
    return m;
  }
  // Random non-empty subset of layer ids.
  std::vector<int> some_layers(const ModelSpec& m) {
    std::vector<int> ids;
    while (ids.empty()) {
      for (const auto& l : m.layers) {
        if (uniform(0, 2) == 0) ids.push_back(l.layer_id);
      }
    }
    return ids;
  }

 private:
  unsigned seed_;
  std::mt19937 rng_;
};

std::string error_of(const Options& o, const ModelSpec& m, const Registry& r,
                     const CudaDeviceInfo& cuda) {
  try {
    resolve_backends(o, m, r, cuda);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A line-up on a machine; every call resolves on a fresh random dense model.
struct Machine {
  ModelMaker mk;
  Registry r;
  CudaDeviceInfo cuda;
  Selection resolve(const Options& o) { return resolve_backends(o, mk.dense(), r, cuda); }
  std::string error(const Options& o) { return error_of(o, mk.dense(), r, cuda); }
};

// The usual line-up without a GPU, and with an H200.
Machine without_gpu() { return {ModelMaker(), Registries::standard(kNoCuda), no_gpu()}; }
Machine with_hopper() { return {ModelMaker(), Registries::standard(), gpu(9, 0)}; }

// `s` serves the prefill phase with `prefill` and the decode phase with `decode`.
void expect_phases(const Selection& s, const std::string& prefill, const std::string& decode) {
  EXPECT_EQ(s.prefill, prefill);
  EXPECT_EQ(s.decode, decode);
}

bool has(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

bool any_reason(const Selection& s, const std::string& needle) {
  return std::any_of(s.reasons.begin(), s.reasons.end(),
                     [&](const std::string& r) { return has(r, needle); });
}

#define EXPECT_HAS(text, needle) EXPECT_PRED2(has, text, needle)

}  // namespace

// ------------------------------------------------------------------------------------------------
// Inheritance (§5.2)

TEST(Selection, PhasesInheritTheAttentionBackend) {
  const Selection s = without_gpu().resolve({.attention_backend = "basic"});
  expect_phases(s, "basic", "basic");
  EXPECT_FALSE(s.hybrid());
  EXPECT_TRUE(any_reason(s, "prefill: basic — set by --attention-backend"));
  EXPECT_TRUE(any_reason(s, "decode: basic — set by --attention-backend"));
}

TEST(Selection, EqualPhaseBackendsReplaceTheAttentionBackend) {
  const Selection s = without_gpu().resolve({.attention_backend = "basic",
                                             .prefill_attention_backend = "reference",
                                             .decode_attention_backend = "reference"});
  expect_phases(s, "reference", "reference");
  EXPECT_FALSE(s.hybrid());
}

TEST(Selection, OnePhaseOverrideMakesAHybridAndTheOtherInherits) {
  const Selection s =
      without_gpu().resolve({.attention_backend = "cpu", .decode_attention_backend = "reference"});
  expect_phases(s, "cpu", "reference");
  EXPECT_TRUE(s.hybrid());
  EXPECT_TRUE(any_reason(s, "decode: reference — set by --decode-attention-backend"));
  EXPECT_TRUE(any_reason(s, "HybridAttnBackend routes DECODE and IDLE to reference"));
}

TEST(Selection, UnsetAttentionBackendAutoSelectsOnlyTheInheritingPhase) {
  const Selection s = without_gpu().resolve({.prefill_attention_backend = "reference"});
  expect_phases(s, "reference", "cpu");
  EXPECT_TRUE(any_reason(s, "decode: cpu (auto)"));
  EXPECT_FALSE(any_reason(s, "prefill: cpu (auto)"));
}

TEST(Selection, BothPhasesExplicitNeedNoAutoSelection) {
  // Nothing here could be auto-selected; with both phases named none is attempted.
  ModelMaker mk;
  Registry r;
  r.add(entry("reference", reference_caps(), false));
  r.add(entry("basic", basic_caps(), false));
  Options o;
  o.prefill_attention_backend = "reference";
  o.decode_attention_backend = "basic";
  Selection s = resolve_backends(o, mk.dense(), r, no_gpu());
  expect_phases(s, "reference", "basic");
  EXPECT_FALSE(any_reason(s, "(auto)"));
}

// ------------------------------------------------------------------------------------------------
// Auto-selection (§5.3)

TEST(Selection, AutoPicksCpuWithoutAGpuAndSaysWhy) {
  Machine x = without_gpu();
  Selection s = x.resolve(Options{});
  expect_phases(s, "cpu", "cpu");
  ASSERT_GE(s.reasons.size(), 2u);
  EXPECT_HAS(s.reasons[0], "prefill: cpu (auto)");
  EXPECT_HAS(s.reasons[0], "no usable CUDA device (no CUDA driver is installed");
  EXPECT_HAS(s.reasons[0], "reference is never auto-selected");
  EXPECT_HAS(s.reasons[1], "decode: cpu (auto)");
}

TEST(Selection, AutoPicksCudaOnHopper) {
  Machine x = with_hopper();
  Selection s = x.resolve(Options{});
  expect_phases(s, "cuda", "cuda");
  EXPECT_TRUE(any_reason(s, "NVIDIA H200 (compute capability 9.0)"));
}

TEST(Selection, AutoSkipsCudaOffHopperWhenUnavailableOrIncapable) {
  ModelMaker mk;
  {
    Registry r = Registries::standard();
    Selection s = resolve_backends(Options{}, mk.dense(), r, gpu(8, 0));
    EXPECT_EQ(s.prefill, "cpu");
    EXPECT_TRUE(any_reason(s, "compute capability 8.0; the cuda backend targets 9.x"));
  }
  {
    Registry r = Registries::standard("CUDA driver 12020 is older than the runtime");
    Selection s = resolve_backends(Options{}, mk.dense(), r, gpu(9, 0));
    EXPECT_EQ(s.prefill, "cpu");
    EXPECT_TRUE(any_reason(s, "cuda: not available (CUDA driver 12020 is older"));
  }
  {
    // The model has sinks, which this cuda lacks.
    Registry r = Registries::standard();
    ModelSpec m = mk.dense();
    for (int id : mk.some_layers(m)) m.layers[id].has_sinks = true;
    Selection s = resolve_backends(Options{}, m, r, gpu(9, 0));
    EXPECT_EQ(s.prefill, "cpu");
    EXPECT_TRUE(any_reason(s, "cuda: does not support attention sinks"));
  }
  {
    // Tree verify on the prefill phase: cuda only does chains.
    Registry r = Registries::standard();
    Options o;
    o.speculative_num_steps = 2;
    o.speculative_eagle_topk = 2;
    o.speculative_num_draft_tokens = 4;
    Selection s = resolve_backends(o, mk.dense(), r, gpu(9, 0));
    EXPECT_EQ(s.prefill, "cpu");
    EXPECT_TRUE(any_reason(s, "cuda: does not support tree verify"));
  }
  {
    Registry r;
    r.add(entry("reference", reference_caps(), false));
    r.add(entry("cpu", cpu_caps()));
    Selection s = resolve_backends(Options{}, mk.dense(), r, gpu(9, 0));
    EXPECT_EQ(s.prefill, "cpu");
    EXPECT_TRUE(any_reason(s, "cuda: not registered in this build"));
  }
}

TEST(Selection, ReferenceIsNeverAutoSelectedEvenWhenItIsTheOnlyCapableBackend) {
  ModelMaker mk;
  Registry r;
  r.add(entry("reference", reference_caps(), false));
  r.add(entry("cpu", basic_caps()));
  ModelSpec m = mk.dense();
  std::vector<int> windowed = mk.some_layers(m);
  for (int id : windowed) m.layers[id].sliding_window = mk.uniform(1, 4096);
  std::string err = error_of(Options{}, m, r, no_gpu());
  EXPECT_HAS(err, "no backend can be auto-selected for the prefill and decode phases");
  EXPECT_HAS(err, "cuda: no usable CUDA device");
  EXPECT_HAS(err, fmt::format("cpu: does not support sliding-window attention, which model '{}' "
                              "uses ({} of {} layers",
                              m.name, windowed.size(), m.layers.size()));
  EXPECT_HAS(err, "reference is never auto-selected");
  EXPECT_HAS(err, "--attention-backend");
}

TEST(Selection, GlobalRegistryNeverAutoSelectsReference) {
  ModelMaker mk;
  try {
    Selection s = resolve_backends(Options{}, mk.dense(), Registry::global(), no_gpu());
    EXPECT_NE(s.prefill, "reference");
    EXPECT_NE(s.decode, "reference");
  } catch (const Error& e) {
    EXPECT_HAS(std::string(e.what()), "reference is never auto-selected");
  }
}

// ------------------------------------------------------------------------------------------------
// Rejections: option, value, what is supported, what to use instead.

TEST(Selection, RejectsAPageSizeTheBackendDoesNotHave) {
  Machine x = with_hopper();
  Options o;
  o.attention_backend = "cuda";
  o.page_size = 2 + 2 * x.mk.uniform(0, 2) + 1;  // odd, so never native
  std::string err = x.error(o);
  EXPECT_HAS(err, fmt::format("--attention-backend cuda: backend 'cuda' does not support "
                              "--page-size {} (its native page sizes are 1, 8, 16, 32, 64, 128)",
                              o.page_size));
  EXPECT_HAS(err,
             "Use instead: --page-size 1, 8, 16, 32, 64 or 128; or --attention-backend cpu, "
             "reference or basic");
}

TEST(Selection, RejectsAKvDtypeTheBackendDoesNotHave) {
  Machine x = with_hopper();
  Options o;
  o.attention_backend = "cuda";
  o.kv_cache_dtype = "fp8_e5m2";
  std::string err = x.error(o);
  EXPECT_HAS(err,
             "--attention-backend cuda: backend 'cuda' does not support --kv-cache-dtype "
             "fp8_e5m2 (its KV cache dtypes are bf16, fp16, fp8_e4m3)");
  EXPECT_HAS(err,
             "--kv-cache-dtype bf16, fp16 or fp8_e4m3; or --attention-backend cpu or reference");

  // auto resolves to the model's dtype, and that is what is checked.
  ModelSpec m = x.mk.dense();
  m.dtype = DType::f32;
  o.kv_cache_dtype = "auto";
  err = error_of(o, m, x.r, x.cuda);
  EXPECT_HAS(err, "--kv-cache-dtype auto (= fp32)");
  o.attention_backend = "cpu";
  EXPECT_EQ(resolve_backends(o, m, x.r, x.cuda).kv_dtype, DType::f32);
}

TEST(Selection, RejectsKvDtypeNamesThatAreNotCacheTypesAndAcceptsAliases) {
  Machine x = without_gpu();
  Options o;
  o.kv_cache_dtype = "fp4_e2m1";
  EXPECT_HAS(x.error(o), "--kv-cache-dtype fp4_e2m1:");
  o.kv_cache_dtype = "int32";
  EXPECT_HAS(x.error(o), "--kv-cache-dtype int32:");
  o.kv_cache_dtype = "e4m3";
  EXPECT_EQ(x.resolve(o).kv_dtype, DType::e4m3);
}

TEST(Selection, RejectsModelFeaturesTheBackendLacksAndNamesOneThatHasThem) {
  struct Feature {
    const char* what;
    void (*apply)(LayerSpec&, ModelMaker&);
  };
  const Feature features[] = {
      {"sliding-window attention",
       [](LayerSpec& l, ModelMaker& mk) { l.sliding_window = mk.uniform(0, 8191); }},
      {"logit soft-capping",
       [](LayerSpec& l, ModelMaker& mk) { l.logit_cap = float(mk.uniform(10, 50)); }},
      {"attention sinks", [](LayerSpec& l, ModelMaker&) { l.has_sinks = true; }},
      {"non-causal (bidirectional) attention",
       [](LayerSpec& l, ModelMaker& mk) {
         l.attn_type = mk.uniform(0, 1) ? AttnType::encoder_only : AttnType::decoder_bidirectional;
       }},
  };
  Registry r = Registries::standard(kNoCuda);
  for (const Feature& f : features) {
    ModelMaker mk;
    SCOPED_TRACE(fmt::format("{} (seed {})", f.what, mk.seed()));
    ModelSpec m = mk.dense();
    std::vector<int> ids = mk.some_layers(m);
    for (int id : ids) f.apply(m.layers[id], mk);
    Options o;
    o.decode_attention_backend = "basic";
    std::string err = error_of(o, m, r, no_gpu());
    EXPECT_HAS(err, fmt::format("--decode-attention-backend basic: backend 'basic' does not "
                                "support {}, which model '{}' uses ({} of {} layers: {}",
                                f.what, m.name, ids.size(), m.layers.size(), ids[0]));
    EXPECT_HAS(err, "(it would serve the decode phase)");
    EXPECT_HAS(err, "Use instead: --decode-attention-backend cpu or reference");
  }
}

TEST(Selection, RejectsMlaOnABackendWithoutItAndPointsToOneWithIt) {
  ModelMaker mk;
  ModelSpec m = mk.dense(576);
  for (auto& l : m.layers) {
    l.kind = LayerKind::mla;
    l.num_kv_heads = 1;
    l.v_head_dim = 512;
    l.kv_lora_rank = 512;
    l.qk_rope_head_dim = 64;
  }
  Registry r = Registries::standard();
  Options o;
  o.attention_backend = "cpu";
  std::string err = error_of(o, m, r, gpu(9, 0));
  EXPECT_HAS(err, "--attention-backend cpu: backend 'cpu' does not support MLA");
  EXPECT_HAS(err, "Use instead: --attention-backend cuda or reference");
  // Without a GPU cuda is not available, so only reference is offered.
  Registry no_cuda = Registries::standard("attnrt was built without CUDA");
  EXPECT_HAS(error_of(o, m, no_cuda, no_gpu()), "Use instead: --attention-backend reference.");
  o.attention_backend = "";
  EXPECT_EQ(resolve_backends(o, m, r, gpu(9, 0)).prefill, "cuda");
}

TEST(Selection, RejectsAHeadDimOutsideTheBackendsList) {
  ModelMaker mk;
  ModelSpec m = mk.dense(96);
  Registry r = Registries::standard();
  Options o;
  o.attention_backend = "cuda";
  std::string err = error_of(o, m, r, gpu(9, 0));
  EXPECT_HAS(err, fmt::format("does not support head dim 96 (model '{}' layer 0); its head dims "
                              "are 64, 128, 256, 512, 576",
                              m.name));
  EXPECT_HAS(err, "Use instead: --attention-backend cpu, reference or basic.");
}

TEST(Selection, RejectsAnUnavailableBackendAndOffersAnAvailableOne) {
  ModelMaker mk;
  Registry r = Registries::standard("attnrt was built without CUDA");
  Options o;
  o.prefill_attention_backend = "cuda";
  std::string err = error_of(o, mk.dense(), r, no_gpu());
  EXPECT_HAS(err,
             "--prefill-attention-backend cuda: backend 'cuda' is not available on this "
             "machine: attnrt was built without CUDA");
  EXPECT_HAS(err, "Use instead: --prefill-attention-backend cpu, reference or basic.");
}

TEST(Selection, RejectsUnknownAndForeignBackendNames) {
  Machine x = without_gpu();
  Options o;
  o.decode_attention_backend = "nosuch";
  EXPECT_HAS(x.error(o),
             "--decode-attention-backend nosuch: unknown attention backend; registered backends "
             "are reference, cpu, cuda, basic");

  const std::pair<const char*, const char*> foreign[] = {
      {"flashinfer", "cuda backend plays that role on NVIDIA GPUs"},
      {"fa3", "cuda backend plays that role on NVIDIA GPUs"},
      {"triton", "cuda backend plays that role on NVIDIA GPUs"},
      {"trtllm_mha", "cuda backend plays that role on NVIDIA GPUs"},
      {"flashmla", "cuda backend plays that role on NVIDIA GPUs"},
      {"cutlass_mla", "cuda backend plays that role on NVIDIA GPUs"},
      {"torch_native", "the cpu backend on CPUs"},
      {"flex_attention", "the cpu backend on CPUs"},
      {"intel_amx", "the cpu backend plays that role"},
      {"aiter", "attnrt has no backend for that hardware"},
  };
  const char* flags[][2] = {{"--attention-backend", nullptr},
                            {"--prefill-attention-backend", nullptr},
                            {"--decode-attention-backend", nullptr}};
  for (const auto& [name, role] : foreign) {
    for (const auto& flag : flags) {
      Options f;
      std::string which = flag[0];
      if (which == "--attention-backend") f.attention_backend = name;
      if (which == "--prefill-attention-backend") f.prefill_attention_backend = name;
      if (which == "--decode-attention-backend") f.decode_attention_backend = name;
      std::string err = x.error(f);
      EXPECT_HAS(err, fmt::format("{} {}: '{}' is a backend of the reference serving engine", which,
                                  name, name));
      EXPECT_HAS(err, role);
      EXPECT_HAS(err, "Registered attnrt backends: reference, cpu, cuda, basic");
    }
  }
  EXPECT_EQ(foreign_backend_note("cpu"), "");
}

TEST(Selection, RejectsPhaseBackendsOnDifferentDevices) {
  const std::string err =
      with_hopper().error({.prefill_attention_backend = "cuda", .decode_attention_backend = "cpu"});
  EXPECT_HAS(err, "do not share a device");
  EXPECT_HAS(err, "prefill backend 'cuda' (--prefill-attention-backend) runs on cuda");
  EXPECT_HAS(err, "decode backend 'cpu' (--decode-attention-backend) runs on cpu");
}

TEST(Selection, RejectsBadScalarOptions) {
  Machine x = without_gpu();
  Options o;
  o.speculative_attention_mode = "verify";
  EXPECT_HAS(x.error(o), "--speculative-attention-mode 'verify' is not valid: use 'prefill'");
  o = Options{};
  o.page_size = -x.mk.uniform(0, 64);
  EXPECT_HAS(x.error(o),
             fmt::format("--page-size {} is not valid: use an integer in [1, 1024]", o.page_size));
  o.page_size = kMaxPageSize + x.mk.uniform(1, 64);
  EXPECT_HAS(x.error(o), fmt::format("--page-size {} is not valid", o.page_size));
  o = Options{};
  o.num_threads = -x.mk.uniform(1, 64);
  EXPECT_HAS(x.error(o), fmt::format("--threads {} is not valid: use 0 (automatic) or a thread "
                                     "count in [1, {}]",
                                     o.num_threads, max_num_threads()));
  o.num_threads = max_num_threads() + 1;
  EXPECT_HAS(x.error(o), fmt::format("--threads {} is not valid", o.num_threads));
}

// ------------------------------------------------------------------------------------------------
// Speculative decoding (§9.2): attnrt errors where the reference engine rewrites.

TEST(Selection, SpeculativeDefaultsAreExplainedAndMismatchesRejected) {
  Machine x = without_gpu();
  Options o;
  o.speculative_num_steps = x.mk.uniform(1, 7);
  Selection s = x.resolve(o);
  EXPECT_EQ(s.spec_topk, 1);
  EXPECT_EQ(s.spec_num_draft_tokens, o.speculative_num_steps + 1);
  EXPECT_TRUE(any_reason(s, "chain verify, topk 1 (default)"));

  o.speculative_num_draft_tokens = o.speculative_num_steps + 1 + x.mk.uniform(1, 3);
  std::string err = x.error(o);
  EXPECT_HAS(err, fmt::format("--speculative-num-draft-tokens {} does not fit a chain",
                              o.speculative_num_draft_tokens));
  EXPECT_HAS(err, fmt::format("pass {} or leave it unset", o.speculative_num_steps + 1));

  Options t;
  t.speculative_eagle_topk = x.mk.uniform(1, 8);
  EXPECT_HAS(x.error(t),
             fmt::format("--speculative-eagle-topk {} is set but --speculative-num-steps is not",
                         t.speculative_eagle_topk));
  Options d;
  d.speculative_num_draft_tokens = x.mk.uniform(2, 8);
  EXPECT_HAS(x.error(d),
             fmt::format("--speculative-num-draft-tokens {} is set but --speculative-num-steps is "
                         "not",
                         d.speculative_num_draft_tokens));
  Options n;
  n.speculative_num_steps = -1;
  EXPECT_HAS(x.error(n), "--speculative-num-steps -1 is negative");
}

TEST(Selection, TreeVerifyNeedsADraftTokenCountWithinTheTree) {
  Machine x = without_gpu();
  Options o;
  o.speculative_num_steps = x.mk.uniform(1, 5);
  o.speculative_eagle_topk = x.mk.uniform(2, 8);
  const int max =
      1 + o.speculative_eagle_topk +
      (o.speculative_num_steps - 1) * o.speculative_eagle_topk * o.speculative_eagle_topk;
  EXPECT_HAS(x.error(o), fmt::format("--speculative-eagle-topk {} (tree verify) needs "
                                     "--speculative-num-draft-tokens",
                                     o.speculative_eagle_topk));
  o.speculative_num_draft_tokens = max + x.mk.uniform(1, 10);
  EXPECT_HAS(x.error(o), fmt::format("--speculative-num-draft-tokens {} is out of range",
                                     o.speculative_num_draft_tokens));
  EXPECT_HAS(x.error(o), fmt::format("allowed 2..{}", max));
  o.speculative_num_draft_tokens = x.mk.uniform(2, max);
  Selection s = x.resolve(o);
  EXPECT_EQ(s.spec_topk, o.speculative_eagle_topk);
  EXPECT_EQ(s.spec_num_draft_tokens, o.speculative_num_draft_tokens);
}

TEST(Selection, VerifyCapabilityIsCheckedOnThePhaseTheModeSendsVerifyTo) {
  ModelMaker mk;
  Registry r = Registries::standard();
  Options o;
  o.prefill_attention_backend = "cuda";  // chain only
  o.decode_attention_backend = "cuda";
  o.speculative_num_steps = 3;
  o.speculative_eagle_topk = 4;
  o.speculative_num_draft_tokens = 8;
  // Same device required, so use a cuda pair; tree verify fails wherever it goes.
  std::string err = error_of(o, mk.dense(), r, gpu(9, 0));
  EXPECT_HAS(err,
             "--prefill-attention-backend cuda: backend 'cuda' does not support tree verify "
             "(--speculative-eagle-topk 4), which it would serve as the prefill backend "
             "under --speculative-attention-mode prefill");

  // cpu prefill + basic decode: chain verify fails on basic only in decode mode.
  r = Registries::standard(kNoCuda);
  Options c;
  c.prefill_attention_backend = "cpu";
  c.decode_attention_backend = "basic";
  c.speculative_num_steps = mk.uniform(1, 5);
  Selection s = resolve_backends(c, mk.dense(), r, no_gpu());
  EXPECT_EQ(s.decode, "basic");
  c.speculative_attention_mode = "decode";
  err = error_of(c, mk.dense(), r, no_gpu());
  EXPECT_HAS(err,
             "--decode-attention-backend basic: backend 'basic' does not support chain verify "
             "(--speculative-eagle-topk 1), which it would serve as the decode backend under "
             "--speculative-attention-mode decode");
  EXPECT_HAS(err,
             "Use instead: --speculative-attention-mode prefill (prefill backend 'cpu' "
             "supports it); or --decode-attention-backend cpu or reference");
}

// ------------------------------------------------------------------------------------------------
// Linear-attention layers

namespace {

ModelSpec with_gdn(ModelMaker& mk, std::vector<int>* gdn_ids) {
  ModelSpec m = mk.dense();
  *gdn_ids = mk.some_layers(m);
  if (gdn_ids->size() == m.layers.size()) gdn_ids->pop_back();  // keep one attention layer
  for (int id : *gdn_ids) {
    LayerSpec& l = m.layers[id];
    l.kind = LayerKind::gdn;
    l.linear.num_k_heads = 4;
    l.linear.num_v_heads = 8;
    l.linear.head_k_dim = l.linear.head_v_dim = 128;
  }
  return m;
}

BackendCaps gdn_caps() {
  BackendCaps c;
  c.devices = {DeviceKind::cpu};
  c.full_attention = false;
  c.spec_topk1 = true;
  c.linear_kinds = {LayerKind::gdn};
  return c;
}

}  // namespace

TEST(Selection, LinearLayersWithoutALinearBackendGiveAClearError) {
  ModelMaker mk;
  std::vector<int> ids;
  ModelSpec m = with_gdn(mk, &ids);
  Registry r = Registries::standard(kNoCuda);
  std::string err = error_of(Options{}, m, r, no_gpu());
  EXPECT_HAS(err, fmt::format("model '{}' has linear-attention layers: gdn ({} of {} layers: {}",
                              m.name, ids.size(), m.layers.size(), ids[0]));
  EXPECT_HAS(err, "No registered backend serves that kind (registered: reference, cpu, cuda, basic)");
}

TEST(Selection, LinearBackendsAreAutoSelectedAndValidatedLikeTheFullOnes) {
  ModelMaker mk;
  std::vector<int> ids;
  ModelSpec m = with_gdn(mk, &ids);
  Registry r = Registries::standard(kNoCuda);
  r.add(entry("gdnlin", gdn_caps()));
  Selection s = resolve_backends(Options{}, m, r, no_gpu());
  EXPECT_EQ(s.prefill, "cpu");
  EXPECT_EQ(s.linear_prefill, "gdnlin");
  EXPECT_EQ(s.linear_decode, "gdnlin");
  EXPECT_TRUE(any_reason(s, "linear prefill: gdnlin (auto)"));

  Options o;
  o.linear_attn_backend = "cpu";
  std::string err = error_of(o, m, r, no_gpu());
  EXPECT_HAS(err, fmt::format("--linear-attn-backend cpu: backend 'cpu' does not serve gdn layers, "
                              "which model '{}' has",
                              m.name));
  EXPECT_HAS(err, "Use instead: --linear-attn-backend gdnlin");

  // A linear-only backend cannot serve the attention layers.
  Options full;
  full.attention_backend = "gdnlin";
  EXPECT_HAS(error_of(full, m, r, no_gpu()),
             "--attention-backend gdnlin: backend 'gdnlin' serves only linear-attention layers");

  // Tree verify on the linear phase is checked too.
  Options tree;
  tree.speculative_num_steps = 2;
  tree.speculative_eagle_topk = 2;
  tree.speculative_num_draft_tokens = 3;
  tree.linear_attn_prefill_backend = "gdnlin";
  EXPECT_HAS(error_of(tree, m, r, no_gpu()),
             "--linear-attn-prefill-backend gdnlin: backend 'gdnlin' does not support tree verify");

  Options foreign;
  foreign.linear_attn_decode_backend = "cutedsl";
  EXPECT_HAS(error_of(foreign, m, r, no_gpu()),
             "--linear-attn-decode-backend cutedsl: 'cutedsl' is a backend of the reference "
             "serving engine");
}

// The KV cache and the state pool live on one device: with the attention layers on the host
// (e.g. MLA layers only a host backend serves), auto-selection keeps the linear layers there too.
TEST(Selection, AutoSelectedLinearBackendsRunOnTheAttentionBackendsDevice) {
  ModelMaker mk;
  std::vector<int> ids;
  const ModelSpec m = with_gdn(mk, &ids);
  BackendCaps host = cpu_caps(), device = cuda_caps();
  host.linear_kinds = device.linear_kinds = {LayerKind::gdn};
  Registry r;
  r.add(entry("cpu", host));
  r.add(entry("cuda", device));
  Options o;
  o.attention_backend = "cpu";
  Selection s = resolve_backends(o, m, r, gpu(9, 0));
  EXPECT_EQ(s.linear_prefill, "cpu");
  EXPECT_EQ(s.linear_decode, "cpu");
  EXPECT_TRUE(any_reason(s, "cuda: runs on cuda, but the attention layers' backends run on cpu"))
      << fmt::format("{}", fmt::join(s.reasons, "\n"));
  s = resolve_backends(Options{}, m, r, gpu(9, 0));
  EXPECT_EQ(s.prefill, "cuda");
  EXPECT_EQ(s.linear_prefill, "cuda");
  EXPECT_EQ(s.linear_decode, "cuda");
}

TEST(Selection, LinearOptionsOnAModelWithoutLinearLayersAreNotedNotApplied) {
  Machine x = without_gpu();
  Options o;
  o.linear_attn_backend = "reference";
  Selection s = x.resolve(o);
  EXPECT_TRUE(s.linear_prefill.empty());
  EXPECT_TRUE(any_reason(s, "--linear-attn-backend reference has no effect"));
  o.linear_attn_backend = "nosuch";
  EXPECT_HAS(x.error(o), "--linear-attn-backend nosuch: unknown attention backend");
}
