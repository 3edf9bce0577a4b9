#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <tuple>

#include "attnrt/core/error.h"
#include "attnrt/model/model_spec.h"
#include "tests/test_util.h"

using namespace attnrt;

namespace {

const std::filesystem::path kDataDir = std::filesystem::path(__FILE__).parent_path() / "data";

std::string data_file(const char* name) { return (kDataDir / name).string(); }

using attnrt::test::error_of;

std::set<int> ids_of_kind(const ModelSpec& m, LayerKind k) {
  std::set<int> ids;
  for (const auto& l : m.layers) {
    if (l.kind == k) ids.insert(l.layer_id);
  }
  return ids;
}

struct PresetShape {
  const char* name;
  int layers;
  int attn_layers;  // layers with a KV cache
  int q_heads, kv_heads, head_dim, v_head_dim;
};

}  // namespace

TEST(ModelSpec, LayerKindNamesAndLinearKinds) {
  EXPECT_EQ(layer_kind_name(LayerKind::full), "full");
  EXPECT_EQ(layer_kind_name(LayerKind::swa), "swa");
  EXPECT_EQ(layer_kind_name(LayerKind::mla), "mla");
  EXPECT_EQ(layer_kind_name(LayerKind::gdn), "gdn");
  EXPECT_EQ(layer_kind_name(LayerKind::mamba2), "mamba2");
  EXPECT_EQ(layer_kind_name(LayerKind::kda), "kda");
  EXPECT_FALSE(is_linear_kind(LayerKind::full));
  EXPECT_FALSE(is_linear_kind(LayerKind::swa));
  EXPECT_FALSE(is_linear_kind(LayerKind::mla));
  EXPECT_TRUE(is_linear_kind(LayerKind::gdn));
  EXPECT_TRUE(is_linear_kind(LayerKind::mamba2));
  EXPECT_TRUE(is_linear_kind(LayerKind::kda));
}

TEST(ModelSpec, SoftmaxScaleDefaultsToInverseSqrtHeadDim) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    LayerSpec l;
    l.head_dim = std::uniform_int_distribution<int>(1, 512)(rng);
    EXPECT_FLOAT_EQ(l.softmax_scale(), 1.f / std::sqrt(static_cast<float>(l.head_dim)));
    l.scaling = std::uniform_real_distribution<float>(0.01f, 2.f)(rng);
    EXPECT_EQ(l.softmax_scale(), l.scaling);
  }
  LayerSpec gdn;
  gdn.kind = LayerKind::gdn;
  gdn.linear.head_k_dim = 128;
  EXPECT_FLOAT_EQ(gdn.softmax_scale(), 1.f / std::sqrt(128.f));
}

TEST(ModelPresets, EveryPresetValidatesWithItsPublishedShape) {
  const PresetShape shapes[] = {
      {"demo", 4, 4, 8, 2, 64, 64},
      {"llama3-8b", 32, 32, 32, 8, 128, 128},
      {"qwen2.5-7b", 28, 28, 28, 4, 128, 128},
      {"mistral-7b", 32, 32, 32, 8, 128, 128},
      {"gemma3-12b", 48, 48, 16, 8, 256, 256},
      {"deepseek-v3", 61, 61, 128, 1, 576, 512},
      {"deepseek-v3.2", 61, 61, 128, 1, 576, 512},
      {"qwen3-next-80b", 48, 12, 16, 2, 256, 256},
      {"kimi-linear-48b", 27, 7, 32, 1, 576, 512},
      {"nemotron-h-8b", 28, 4, 32, 8, 128, 128},
  };
  std::vector<std::string> listed = preset_names();
  ASSERT_EQ(listed.size(), std::size(shapes));
  for (const auto& s : shapes) {
    SCOPED_TRACE(s.name);
    EXPECT_NE(std::find(listed.begin(), listed.end(), s.name), listed.end());
    const ModelSpec m = model_preset(s.name);
    EXPECT_NO_THROW(m.validate());
    EXPECT_EQ(m.name, s.name);
    EXPECT_EQ(m.tp_size, 1);
    EXPECT_EQ(m.dtype, DType::bf16);
    ASSERT_EQ(static_cast<int>(m.layers.size()), s.layers);
    EXPECT_EQ(static_cast<int>(m.full_attention_layer_ids().size()), s.attn_layers);
    for (const auto& l : m.layers) {
      if (!l.uses_kv_cache()) continue;
      EXPECT_EQ(l.num_q_heads, s.q_heads) << "layer " << l.layer_id;
      EXPECT_EQ(l.num_kv_heads, s.kv_heads) << "layer " << l.layer_id;
      EXPECT_EQ(l.head_dim, s.head_dim) << "layer " << l.layer_id;
      EXPECT_EQ(l.v_head_dim, s.v_head_dim) << "layer " << l.layer_id;
    }
  }
}

TEST(ModelPresets, WindowsAndPatternsFollowThePublishedConfigs) {
  const ModelSpec demo = model_preset("demo");
  EXPECT_EQ(ids_of_kind(demo, LayerKind::swa), (std::set<int>{2}));
  EXPECT_EQ(demo.layers[2].sliding_window, 64);
  EXPECT_TRUE(demo.has_sliding_window());
  EXPECT_FALSE(demo.has_linear_layers());

  const ModelSpec mistral = model_preset("mistral-7b");
  for (const auto& l : mistral.layers) {
    EXPECT_EQ(l.kind, LayerKind::swa);
    EXPECT_EQ(l.sliding_window, 4095);  // hf sliding_window 4096 counts the query itself
  }
  EXPECT_FALSE(model_preset("llama3-8b").has_sliding_window());
  EXPECT_FALSE(model_preset("qwen2.5-7b").has_sliding_window());

  const ModelSpec gemma = model_preset("gemma3-12b");
  EXPECT_EQ(ids_of_kind(gemma, LayerKind::full), (std::set<int>{5, 11, 17, 23, 29, 35, 41, 47}));
  for (const auto& l : gemma.layers) {
    EXPECT_EQ(l.sliding_window, l.kind == LayerKind::swa ? 1023 : -1);
    EXPECT_FLOAT_EQ(l.softmax_scale(), 1.f / 16.f);  // query_pre_attn_scalar 256
    EXPECT_EQ(l.logit_cap, 0.f);
  }

  const ModelSpec ds = model_preset("deepseek-v3");
  EXPECT_TRUE(ds.has_kind(LayerKind::mla));
  for (const auto& l : ds.layers) {
    EXPECT_EQ(l.kind, LayerKind::mla);
    EXPECT_EQ(l.kv_lora_rank, 512);
    EXPECT_EQ(l.qk_rope_head_dim, 64);
    // 192^-1/2 times YaRN's mscale^2 (factor 40, mscale_all_dim 1)
    const float mscale = 0.1f * std::log(40.f) + 1.f;
    EXPECT_NEAR(l.softmax_scale(), mscale * mscale / std::sqrt(192.f), 1e-6);
  }

  const ModelSpec next = model_preset("qwen3-next-80b");
  std::set<int> full_ids;
  for (int i = 3; i < 48; i += 4) full_ids.insert(i);
  EXPECT_EQ(ids_of_kind(next, LayerKind::full), full_ids);
  EXPECT_TRUE(next.has_linear_layers());
  const LinearSpec& gdn = next.layers[0].linear;
  EXPECT_EQ(next.layers[0].kind, LayerKind::gdn);
  EXPECT_EQ(
      std::tuple(gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, gdn.conv_kernel),
      std::tuple(16, 32, 128, 128, 4));
  EXPECT_FALSE(next.layers[0].uses_kv_cache());

  const ModelSpec kimi = model_preset("kimi-linear-48b");
  EXPECT_EQ(ids_of_kind(kimi, LayerKind::mla), (std::set<int>{3, 7, 11, 15, 19, 23, 26}));
  EXPECT_EQ(ids_of_kind(kimi, LayerKind::kda).size(), 20u);
  EXPECT_EQ(kimi.layers[0].linear.num_k_heads, 32);
  EXPECT_EQ(kimi.layers[0].linear.head_k_dim, 128);

  const ModelSpec nemo = model_preset("nemotron-h-8b");
  EXPECT_EQ(ids_of_kind(nemo, LayerKind::full), (std::set<int>{4, 10, 16, 22}));
  const LinearSpec& mamba = nemo.layers[0].linear;
  EXPECT_EQ(nemo.layers[0].kind, LayerKind::mamba2);
  EXPECT_EQ(std::tuple(mamba.num_v_heads, mamba.head_v_dim, mamba.d_state, mamba.n_groups,
                       mamba.chunk_size),
            std::tuple(128, 64, 128, 8, 128));
}

TEST(ModelPresets, UnknownNameListsThePresets) {
  const std::string msg = error_of([] { model_preset("llama-9000"); });
  EXPECT_NE(msg.find("'llama-9000'"), std::string::npos) << msg;
  for (const auto& name : preset_names()) EXPECT_NE(msg.find(name), std::string::npos) << msg;
}

TEST(ModelValidate, RejectsEachInconsistentFieldWithItsName) {
  struct Case {
    const char* what;
    std::function<void(ModelSpec&)> mutate;
    const char* expect;
  };
  const Case cases[] = {
      {"q heads", [](ModelSpec& m) { m.layers[1].num_q_heads = 0; },
       "layer 1 (full): num_q_heads = 0"},
      {"kv heads", [](ModelSpec& m) { m.layers[0].num_kv_heads = -2; }, "num_kv_heads = -2"},
      {"gqa", [](ModelSpec& m) { m.layers[3].num_kv_heads = 3; },
       "num_q_heads = 8 is not a multiple of num_kv_heads = 3"},
      {"head dim", [](ModelSpec& m) { m.layers[0].head_dim = 0; }, "head_dim = 0"},
      {"v head dim", [](ModelSpec& m) { m.layers[0].v_head_dim = 0; }, "v_head_dim = 0"},
      {"window", [](ModelSpec& m) { m.layers[2].sliding_window = -5; }, "sliding_window = -5"},
      {"swa without window", [](ModelSpec& m) { m.layers[2].sliding_window = -1; },
       "a swa layer needs a window"},
      {"full with window", [](ModelSpec& m) { m.layers[0].sliding_window = 16; },
       "use kind swa for windowed layers"},
      {"scaling", [](ModelSpec& m) { m.layers[0].scaling = -1.f; }, "scaling = -1"},
      {"softcap", [](ModelSpec& m) { m.layers[0].logit_cap = NAN; }, "logit_cap = nan"},
      {"ids", [](ModelSpec& m) { m.layers[2].layer_id = 7; }, "layers[2] has layer_id 7"},
      {"empty", [](ModelSpec& m) { m.layers.clear(); }, "has no layers"},
      {"dtype", [](ModelSpec& m) { m.dtype = DType::e4m3; }, "activation dtype fp8_e4m3"},
      {"context", [](ModelSpec& m) { m.max_context_len = 0; }, "max_context_len = 0"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    ModelSpec m = model_preset("demo");
    c.mutate(m);
    const std::string msg = error_of([&] { m.validate(); });
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
    EXPECT_NE(msg.find("'demo'"), std::string::npos) << msg;
  }
}

TEST(ModelValidate, RejectsInconsistentMlaAndLinearDims) {
  struct Case {
    const char* preset;
    std::function<void(LayerSpec&)> mutate;
    const char* expect;
  };
  const Case cases[] = {
      {"deepseek-v3", [](LayerSpec& l) { l.head_dim = 512; },
       "head_dim = 512; the latent form needs kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576"},
      {"deepseek-v3", [](LayerSpec& l) { l.v_head_dim = 128; }, "v_head_dim = 128"},
      {"deepseek-v3", [](LayerSpec& l) { l.num_kv_heads = 2; }, "exactly 1 kv head"},
      {"deepseek-v3", [](LayerSpec& l) { l.kv_lora_rank = 0; }, "kv_lora_rank = 0"},
      {"qwen3-next-80b", [](LayerSpec& l) { l.linear.num_k_heads = 0; }, "linear.num_k_heads = 0"},
      {"qwen3-next-80b",
       [](LayerSpec& l) {
         l.linear.num_v_heads = 24;
         l.linear.num_k_heads = 16;
       },
       "linear.num_v_heads = 24 is not a multiple of linear.num_k_heads = 16"},
      {"qwen3-next-80b", [](LayerSpec& l) { l.linear.head_k_dim = 0; }, "linear.head_k_dim = 0"},
      {"nemotron-h-8b", [](LayerSpec& l) { l.linear.d_state = 0; }, "linear.d_state = 0"},
      {"nemotron-h-8b", [](LayerSpec& l) { l.linear.n_groups = 3; }, "linear.n_groups = 3"},
      {"kimi-linear-48b", [](LayerSpec& l) { l.linear.num_v_heads = 16; }, "KDA has one head"},
      {"kimi-linear-48b", [](LayerSpec& l) { l.linear.conv_kernel = 0; }, "linear.conv_kernel = 0"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.expect);
    ModelSpec m = model_preset(c.preset);
    c.mutate(m.layers[0]);
    const std::string msg = error_of([&] { m.validate(); });
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
    EXPECT_NE(msg.find("layer 0"), std::string::npos) << msg;
  }
}

TEST(HfConfig, LlamaDerivesHeadDimFromHiddenSize) {
  const ModelSpec m = load_hf_config(data_file("llama3_8b_config.json"));
  EXPECT_EQ(m.name, "meta-llama/Meta-Llama-3-8B");
  EXPECT_EQ(m.dtype, DType::bf16);
  EXPECT_EQ(m.max_context_len, 8192);
  ASSERT_EQ(m.layers.size(), 32u);
  const ModelSpec preset = model_preset("llama3-8b");
  for (size_t i = 0; i < m.layers.size(); ++i) {
    EXPECT_EQ(m.layers[i].kind, LayerKind::full);
    EXPECT_EQ(m.layers[i].num_q_heads, preset.layers[i].num_q_heads);
    EXPECT_EQ(m.layers[i].num_kv_heads, preset.layers[i].num_kv_heads);
    EXPECT_EQ(m.layers[i].head_dim, 128);
    EXPECT_EQ(m.layers[i].v_head_dim, 128);
    EXPECT_EQ(m.layers[i].sliding_window, -1);
    EXPECT_FLOAT_EQ(m.layers[i].softmax_scale(), 1.f / std::sqrt(128.f));
  }
}

TEST(HfConfig, MistralWindowOnEveryLayerAndNullMeansOff) {
  const ModelSpec m = load_hf_config(data_file("mistral_7b_v01_config.json"));
  ASSERT_EQ(m.layers.size(), 32u);
  for (const auto& l : m.layers) {
    EXPECT_EQ(l.kind, LayerKind::swa);
    EXPECT_EQ(l.sliding_window, 4095);
  }
  const ModelSpec off = load_hf_config_text(
      R"({"model_type": "mistral", "num_hidden_layers": 2, "num_attention_heads": 32,
          "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": null, "sliding_window": null})",
      "v0.3.json");
  for (const auto& l : off.layers) {
    EXPECT_EQ(l.kind, LayerKind::full);
    EXPECT_EQ(l.sliding_window, -1);
    EXPECT_EQ(l.head_dim, 128);
  }
}

TEST(HfConfig, Qwen2WindowsLayersFromMaxWindowLayersOn) {
  const ModelSpec m = load_hf_config(data_file("qwen2_sliding_config.json"));
  EXPECT_EQ(m.dtype, DType::f16);
  ASSERT_EQ(m.layers.size(), 6u);
  EXPECT_EQ(ids_of_kind(m, LayerKind::full), (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(ids_of_kind(m, LayerKind::swa), (std::set<int>{4, 5}));
  EXPECT_EQ(m.layers[5].sliding_window, 1023);
  EXPECT_EQ(m.layers[0].head_dim, 64);  // 896 / 14
  EXPECT_EQ(m.layers[0].num_kv_heads, 2);

  // The same file with use_sliding_window false: the window field is ignored, as in transformers.
  const ModelSpec off = load_hf_config_text(
      R"({"model_type": "qwen3", "num_hidden_layers": 3, "num_attention_heads": 16, "head_dim": 128,
          "num_key_value_heads": 8, "use_sliding_window": false, "sliding_window": 4096,
          "max_window_layers": 1})",
      "qwen3.json");
  EXPECT_FALSE(off.has_sliding_window());
  EXPECT_EQ(off.layers[0].head_dim, 128);
}

TEST(HfConfig, Gemma2AlternatesLocalLayersWithSoftcapAndScalar) {
  const ModelSpec m = load_hf_config(data_file("gemma2_9b_config.json"));
  EXPECT_EQ(m.dtype, DType::f32);
  ASSERT_EQ(m.layers.size(), 42u);
  for (const auto& l : m.layers) {
    const bool local = l.layer_id % 2 == 0;
    EXPECT_EQ(l.kind, local ? LayerKind::swa : LayerKind::full) << l.layer_id;
    EXPECT_EQ(l.sliding_window, local ? 4095 : -1);
    EXPECT_EQ(l.logit_cap, 50.f);
    EXPECT_FLOAT_EQ(l.softmax_scale(), 1.f / 16.f);
    EXPECT_EQ(l.num_q_heads, 16);
    EXPECT_EQ(l.num_kv_heads, 8);
    EXPECT_EQ(l.head_dim, 256);
  }
  // query_pre_attn_scalar differs from head_dim in gemma-2-27b (144): the scale follows the scalar.
  const ModelSpec g27 = load_hf_config_text(
      R"({"model_type": "gemma2", "num_hidden_layers": 2, "num_attention_heads": 32,
          "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 144,
          "attn_logit_softcapping": null})",
      "gemma2-27b.json");
  EXPECT_FLOAT_EQ(g27.layers[0].softmax_scale(), 1.f / 12.f);
  EXPECT_EQ(g27.layers[0].logit_cap, 0.f);
}

// Every attention-relevant field of two specs (the loader's and the preset's) agrees.
void expect_same_layers(const ModelSpec& m, const ModelSpec& preset) {
  ASSERT_EQ(m.layers.size(), preset.layers.size());
  EXPECT_EQ(m.max_context_len, preset.max_context_len);
  for (size_t i = 0; i < m.layers.size(); ++i) {
    SCOPED_TRACE(i);
    const LayerSpec& a = m.layers[i];
    const LayerSpec& b = preset.layers[i];
    EXPECT_EQ(a.layer_id, b.layer_id);
    EXPECT_EQ(a.kind, b.kind);
    EXPECT_EQ(a.sliding_window, b.sliding_window);
    EXPECT_EQ(a.has_sinks, b.has_sinks);
    if (!is_linear_kind(a.kind)) {
      const auto dims = [](const LayerSpec& l) {
        return std::tuple(l.num_q_heads, l.num_kv_heads, l.head_dim, l.v_head_dim, l.kv_lora_rank,
                          l.qk_rope_head_dim);
      };
      EXPECT_EQ(dims(a), dims(b));
      EXPECT_NEAR(a.softmax_scale(), b.softmax_scale(), 1e-6);
    } else {
      attnrt::test::expect_same_linear_dims(a.linear, b.linear);
    }
  }
}

TEST(HfConfig, Gemma3NestedTextConfigMatchesThePreset) {
  const ModelSpec m = load_hf_config(data_file("gemma3_12b_config.json"));
  expect_same_layers(m, model_preset("gemma3-12b"));  // head_dim 256 by the class default
  for (const LayerSpec& l : m.layers) EXPECT_EQ(l.logit_cap, 0.f);
}

TEST(HfConfig, DeepSeekV3IsMlaWithTheYarnMscaleInTheScaleAndMatchesThePreset) {
  const ModelSpec m = load_hf_config(data_file("deepseek_v3_config.json"));
  ASSERT_EQ(m.layers.size(), 61u);
  const LayerSpec& l = m.layers[0];
  EXPECT_EQ(l.kind, LayerKind::mla);
  EXPECT_EQ(l.num_q_heads, 128);
  EXPECT_EQ(l.num_kv_heads, 1);
  EXPECT_EQ(l.head_dim, 576);  // kv_lora_rank 512 + qk_rope_head_dim 64
  EXPECT_EQ(l.v_head_dim, 512);
  // (128 + 64)^-1/2 * (0.1 * ln 40 + 1)^2, as transformers' DeepseekV3Attention.scaling
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(l.softmax_scale(), mscale * mscale / std::sqrt(192.0), 1e-6);
  EXPECT_NEAR(l.softmax_scale(), 0.13523, 1e-5);
  EXPECT_EQ(m.dtype, DType::bf16);
  expect_same_layers(m, model_preset("deepseek-v3"));
}

TEST(HfConfig, DeepSeekV2LiteWithoutQLoraTakesItsOwnMscale) {
  const ModelSpec m = load_hf_config(data_file("deepseek_v2_lite_config.json"));
  ASSERT_EQ(m.layers.size(), 27u);
  EXPECT_EQ(ids_of_kind(m, LayerKind::mla).size(), 27u);
  EXPECT_EQ(m.layers[5].num_q_heads, 16);
  const double mscale = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(m.layers[5].softmax_scale(), mscale * mscale / std::sqrt(192.0), 1e-6);
  // Without YaRN the scale is the plain (nope + rope)^-1/2.
  const ModelSpec plain = load_hf_config_text(
      R"({"model_type": "deepseek_v2", "num_hidden_layers": 1, "num_attention_heads": 4,
          "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
          "rope_scaling": null})",
      "plain.json");
  EXPECT_NEAR(plain.layers[0].softmax_scale(), 1.0 / std::sqrt(48.0), 1e-7);
  EXPECT_EQ(plain.layers[0].head_dim, 80);
}

TEST(HfConfig, Qwen3NextEveryFourthLayerIsFullAttentionAndMatchesThePreset) {
  const ModelSpec m = load_hf_config(data_file("qwen3_next_80b_config.json"));
  ASSERT_EQ(m.layers.size(), 48u);
  EXPECT_EQ(ids_of_kind(m, LayerKind::full).size(), 12u);
  EXPECT_EQ(m.layers[3].kind, LayerKind::full);
  EXPECT_EQ(m.layers[3].head_dim, 256);
  EXPECT_EQ(m.layers[0].kind, LayerKind::gdn);
  EXPECT_EQ(m.layers[0].linear.num_v_heads, 32);
  expect_same_layers(m, model_preset("qwen3-next-80b"));
}

TEST(HfConfig, GptOssAlternatesWindow128WithFullLayersAllWithSinks) {
  const ModelSpec m = load_hf_config(data_file("gpt_oss_20b_config.json"));
  ASSERT_EQ(m.layers.size(), 24u);
  for (const LayerSpec& l : m.layers) {
    SCOPED_TRACE(l.layer_id);
    EXPECT_TRUE(l.has_sinks);
    EXPECT_EQ(l.num_q_heads, 64);
    EXPECT_EQ(l.num_kv_heads, 8);
    EXPECT_EQ(l.head_dim, 64);
    EXPECT_EQ(l.sliding_window, l.layer_id % 2 == 0 ? 127 : -1);  // W = 128 - 1 (§8.5)
    EXPECT_NEAR(l.softmax_scale(), 0.125, 1e-7);
  }
  // Without layer_types: transformers' rule (even layers sliding) and its default window 128.
  const ModelSpec d = load_hf_config_text(
      R"({"model_type": "gpt_oss", "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 64})",
      "gpt_oss_defaults.json");
  EXPECT_EQ(ids_of_kind(d, LayerKind::swa), (std::set<int>{0, 2}));
  EXPECT_EQ(d.layers[2].sliding_window, 127);
}

TEST(HfConfig, Phi3WindowsEveryLayer) {
  const ModelSpec m = load_hf_config(data_file("phi3_mini_4k_config.json"));
  ASSERT_EQ(m.layers.size(), 32u);
  EXPECT_EQ(ids_of_kind(m, LayerKind::swa).size(), 32u);
  EXPECT_EQ(m.layers[7].sliding_window, 2046);
  EXPECT_EQ(m.layers[7].head_dim, 96);  // 3072 / 32
  EXPECT_EQ(m.layers[7].num_kv_heads, 32);
  EXPECT_EQ(m.max_context_len, 4096);
}

TEST(HfConfig, KimiLinearKdaAndMlaLayersFromOneBasedListsMatchThePreset) {
  ModelSpec m = load_hf_config(data_file("kimi_linear_48b_config.json"));
  ASSERT_EQ(m.layers.size(), 27u);
  EXPECT_EQ(ids_of_kind(m, LayerKind::mla), (std::set<int>{3, 7, 11, 15, 19, 23, 26}));
  EXPECT_EQ(m.layers[0].kind, LayerKind::kda);
  m.max_context_len = 1048576;  // model_max_length, not max_position_embeddings, in this file
  expect_same_layers(m, model_preset("kimi-linear-48b"));
  EXPECT_NE(error_of([] {
              load_hf_config_text(
                  R"({"model_type": "kimi_linear", "num_hidden_layers": 2,
                      "num_attention_heads": 4, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                      "qk_nope_head_dim": 32, "v_head_dim": 32,
                      "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [],
                                             "num_heads": 4, "head_dim": 32}})",
                  "kimi.json");
            }).find("layer 1 (1-based 2) is in neither"),
            std::string::npos);
}

TEST(HfConfig, NemotronHMixerBlocksBecomeLayersInPatternOrderAndMatchThePreset) {
  const ModelSpec m = load_hf_config(data_file("nemotron_h_8b_config.json"));
  ASSERT_EQ(m.layers.size(), 28u);  // 24 'M' + 4 '*'; the 24 '-' MLP blocks hold no state
  EXPECT_EQ(ids_of_kind(m, LayerKind::full).size(), 4u);
  EXPECT_EQ(m.layers[4].kind, LayerKind::full);  // "M-M-M-M*": the fifth mixer
  expect_same_layers(m, model_preset("nemotron-h-8b"));
  EXPECT_NE(error_of([] {
              load_hf_config_text(
                  R"({"model_type": "nemotron_h", "hybrid_override_pattern": "M*X",
                      "num_attention_heads": 4, "head_dim": 32, "mamba_num_heads": 8,
                      "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1})",
                  "nemo.json");
            }).find("hybrid_override_pattern[2] is 'X'"),
            std::string::npos);
}

TEST(HfConfig, UnknownModelTypeListsEverySupportedOne) {
  const std::string msg = error_of([] {
    load_hf_config_text(R"({"model_type": "falcon", "num_hidden_layers": 1})", "falcon.json");
  });
  for (const char* t : {"deepseek_v3", "deepseek_v2", "qwen3_next", "gpt_oss", "phi3",
                        "kimi_linear", "nemotron_h", "llama"}) {
    EXPECT_NE(msg.find(t), std::string::npos) << t << " missing from: " << msg;
  }
}

TEST(HfConfig, LayerTypesOverrideTheFamilyRule) {
  const ModelSpec m = load_hf_config_text(
      R"({"model_type": "gemma3_text", "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 512,
          "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                          "full_attention"]})",
      "layer_types.json");
  EXPECT_EQ(ids_of_kind(m, LayerKind::swa), (std::set<int>{1, 2}));
  EXPECT_EQ(m.layers[1].sliding_window, 511);
}

TEST(HfConfig, BadFilesNameTheFileAndTheField) {
  struct Case {
    const char* text;
    const char* expect;
  };
  const Case cases[] = {
      {R"({"model_type": "llama", "num_hidden_layers": 2,)", "bad.json: malformed JSON"},
      {R"([1, 2])", "expected a JSON object"},
      {R"({"model_type": "falcon", "num_hidden_layers": 2})",
       "model_type 'falcon' is not supported"},
      {R"({"model_type": "deepseek_v3", "num_hidden_layers": 2})",
       "missing required field 'num_attention_heads'"},
      {R"({"model_type": "qwen3_next", "num_hidden_layers": 2, "num_attention_heads": 2,
           "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "layer_types": ["full_attention", "mamba"]})",
       "layer_types[1] is \"mamba\""},
      {R"({"num_hidden_layers": 2})", "missing required field 'model_type'"},
      {R"({"model_type": "llama", "num_attention_heads": 8, "hidden_size": 512})",
       "missing required field 'num_hidden_layers'"},
      {R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8})",
       "missing required field 'hidden_size'"},
      {R"({"model_type": "llama", "num_hidden_layers": "32", "num_attention_heads": 8})",
       "field 'num_hidden_layers' is a string"},
      {R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
           "hidden_size": 1001})",
       "hidden_size 1001 is not divisible by num_attention_heads 8"},
      {R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 3, "head_dim": 64})",
       "num_q_heads = 8 is not a multiple of num_kv_heads = 3"},
      {R"({"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 8,
           "head_dim": 64, "use_sliding_window": "yes"})",
       "field 'use_sliding_window' is a string"},
      {R"({"model_type": "gemma3_text", "layer_types": ["full_attention"]})",
       "'layer_types' has 1 entries; num_hidden_layers is 26"},
      {R"({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 8, "head_dim": 64,
           "layer_types": ["chunked_attention"]})",
       "layer_types[0] is \"chunked_attention\""},
      {R"({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 8, "head_dim": 64,
           "layer_types": ["sliding_attention"]})",
       "'sliding_window' is missing or null"},
      {R"({"model_type": "mistral", "num_hidden_layers": 1, "num_attention_heads": 8,
           "head_dim": 64, "sliding_window": 0})",
       "field 'sliding_window' is 0; it must be >= 1"},
      {R"({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 8, "head_dim": 64,
           "torch_dtype": "int8"})",
       "field 'torch_dtype' is \"int8\""},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    const std::string msg = error_of([&] { load_hf_config_text(c.text, "bad.json"); });
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
    EXPECT_EQ(msg.rfind("bad.json", 0), 0u) << msg;
  }
  const std::string unknown =
      error_of([] { load_hf_config_text(R"({"model_type": "falcon"})", "bad.json"); });
  for (const char* t : {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text"}) {
    EXPECT_NE(unknown.find(t), std::string::npos) << unknown;
  }
  const std::string missing = error_of([] { load_hf_config("/nonexistent/config.json"); });
  EXPECT_NE(missing.find("/nonexistent/config.json"), std::string::npos) << missing;
}

// Issue 21 (fuzz_hf_config): a number too large for a double (1e999) made the JSON parser throw
// its out_of_range exception, which escaped the loader (only parse errors were caught) and
// ended the program. It is malformed JSON like any other.
TEST(HfConfig, NumbersBeyondDoubleAreMalformedJson) {
  const std::string msg = error_of([] {
    load_hf_config_text(R"({"model_type": "llama", "rope_theta": 1e999})", "big.json");
  });
  EXPECT_NE(msg.find("big.json: malformed JSON"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1e999"), std::string::npos) << msg;
}

TEST(ResolveModel, PresetsPathsAndDirectories) {
  EXPECT_EQ(resolve_model("demo").name, "demo");
  EXPECT_EQ(resolve_model(data_file("llama3_8b_config.json")).layers.size(), 32u);

  const auto dir = std::filesystem::temp_directory_path() /
                   ("attnrt_resolve_" + std::to_string(std::random_device{}()));
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(data_file("mistral_7b_v01_config.json"), dir / "config.json");
  EXPECT_TRUE(resolve_model(dir.string()).has_sliding_window());
  std::filesystem::remove_all(dir);

  const std::string msg = error_of([] { resolve_model("no-such-model"); });
  EXPECT_NE(msg.find("'no-such-model'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("llama3-8b"), std::string::npos) << msg;
  EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
  const std::string missing = error_of([] { resolve_model("missing/config.json"); });
  EXPECT_NE(missing.find("cannot open"), std::string::npos) << missing;
}

TEST(TensorParallel, SplitsHeadsAndReplicatesKvHeads) {
  const ModelSpec llama = model_preset("llama3-8b");
  const int tps[] = {1, 2, 4, 8, 16, 32};
  const int want_kv[] = {8, 4, 2, 1, 1, 1};  // tp 16/32 > 8 kv heads: replicated, one per rank
  for (size_t i = 0; i < std::size(tps); ++i) {
    const ModelSpec m = apply_tensor_parallel(llama, tps[i]);
    EXPECT_EQ(m.tp_size, tps[i]);
    EXPECT_NO_THROW(m.validate());
    EXPECT_EQ(m.layers[0].num_q_heads, 32 / tps[i]);
    EXPECT_EQ(m.layers[0].num_kv_heads, want_kv[i]);
    EXPECT_EQ(m.layers[0].head_dim, 128);
  }

  const ModelSpec ds = apply_tensor_parallel(model_preset("deepseek-v3"), 8);
  EXPECT_EQ(ds.layers[0].num_q_heads, 16);
  EXPECT_EQ(ds.layers[0].num_kv_heads, 1);  // the latent head lives on every rank

  const ModelSpec next = apply_tensor_parallel(model_preset("qwen3-next-80b"), 4);
  EXPECT_EQ(next.layers[3].num_q_heads, 4);
  EXPECT_EQ(next.layers[3].num_kv_heads, 1);
  EXPECT_EQ(next.layers[0].linear.num_k_heads, 4);
  EXPECT_EQ(next.layers[0].linear.num_v_heads, 8);
  EXPECT_NO_THROW(next.validate());

  const ModelSpec nemo = apply_tensor_parallel(model_preset("nemotron-h-8b"), 8);
  EXPECT_EQ(nemo.layers[0].linear.num_v_heads, 16);
  EXPECT_EQ(nemo.layers[0].linear.n_groups, 1);
  EXPECT_NO_THROW(nemo.validate());

  ModelSpec one_group = model_preset("nemotron-h-8b");
  for (auto& l : one_group.layers) l.linear.n_groups = 1;
  EXPECT_EQ(apply_tensor_parallel(one_group, 4).layers[0].linear.n_groups, 1);
}

TEST(TensorParallel, RejectsHeadCountsThatDoNotDivide) {
  struct Case {
    const char* preset;
    int tp;
    const char* expect;
  };
  const Case cases[] = {
      {"qwen2.5-7b", 8, "num_q_heads = 28 is not divisible by tp = 8"},
      {"llama3-8b", 3, "num_q_heads = 32 is not divisible by tp = 3"},
      {"llama3-8b", 64, "num_q_heads = 32 is not divisible by tp = 64"},
      {"qwen3-next-80b", 32, "linear.num_k_heads = 16 is not divisible by tp = 32"},
      {"llama3-8b", 0, "tensor-parallel size 0 is invalid"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.expect);
    const std::string msg = error_of([&] { apply_tensor_parallel(model_preset(c.preset), c.tp); });
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
  }
  ModelSpec odd_kv = model_preset("demo");
  for (auto& l : odd_kv.layers) {
    l.num_q_heads = 12;
    l.num_kv_heads = 3;
  }
  std::string msg = error_of([&] { apply_tensor_parallel(odd_kv, 2); });
  EXPECT_NE(msg.find("num_kv_heads = 3 cannot be split over tp = 2"), std::string::npos) << msg;

  ModelSpec groups = model_preset("nemotron-h-8b");
  for (auto& l : groups.layers) l.linear.n_groups = 2;
  msg = error_of([&] { apply_tensor_parallel(groups, 4); });
  EXPECT_NE(msg.find("linear.n_groups = 2 cannot be split over tp = 4"), std::string::npos) << msg;

  msg = error_of([] { apply_tensor_parallel(apply_tensor_parallel(model_preset("demo"), 2), 2); });
  EXPECT_NE(msg.find("already split for tp = 2"), std::string::npos) << msg;
}

// Random GQA shapes: a split either succeeds with heads that multiply back to the original (kv
// heads possibly replicated) or throws; it never produces an invalid model.
TEST(TensorParallel, RandomShapesSplitConsistently) {
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 500; ++trial) {
    const int kv = std::uniform_int_distribution<int>(1, 16)(rng);
    const int group = std::uniform_int_distribution<int>(1, 8)(rng);
    const int tp = std::uniform_int_distribution<int>(1, 32)(rng);
    ModelSpec m = model_preset("demo");
    for (auto& l : m.layers) {
      l.num_kv_heads = kv;
      l.num_q_heads = kv * group;
    }
    const bool q_ok = (kv * group) % tp == 0;
    const bool kv_ok = kv % tp == 0 || tp % kv == 0;
    if (!q_ok || !kv_ok) {
      EXPECT_THROW(apply_tensor_parallel(m, tp), Error) << kv << " " << group << " " << tp;
      continue;
    }
    const ModelSpec s = apply_tensor_parallel(m, tp);
    EXPECT_NO_THROW(s.validate());
    for (const auto& l : s.layers) {
      EXPECT_EQ(l.num_q_heads * tp, kv * group);
      if (tp <= kv) {
        EXPECT_EQ(l.num_kv_heads * tp, kv);
      } else {
        EXPECT_EQ(l.num_kv_heads, 1);
      }
    }
  }
}
