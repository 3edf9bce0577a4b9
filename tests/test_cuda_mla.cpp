// The MLA CTA (backends/cuda/kernels/mla_decode.cu) against the reference backend: DeepSeek-V3's
// latent rows (576 / 512; bf16, e4m3 and e5m2) at the tensor-parallel head counts 16, 32, 64 and
// 128, every mode (decode with split-KV, chain and tree verify, draft extend, absorbed-form extend
// and mixed), the native page sizes 1, 16, 32, 64 and 128 with lengths across page edges, soft-cap,
// and the dispatch that sends these launches to it. Fresh random inputs every run (ATTNRT_TEST_SEED
// replays one); the GPU cases skip, with the reason, where no CUDA device is usable.
#include <gtest/gtest.h>

#include <random>
#include <map>
#include <set>
#include <vector>

#include "attnrt/core/device.h"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/mla_fp8_layout.h"
#include "tests/conformance/conformance.h"
#include "tests/test_cuda_cases.h"
#include "tests/test_cuda_util.h"

#ifdef ATTNRT_HAS_CUDA
#include "attnrt/backend/options.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/kernels/mla.h"
#endif

namespace attnrt {
namespace {

using namespace attnrt::conformance;
using cuda::AttnCta;
using cuda::AttnKernelKey;
using cuda::KvKind;
using cuda::TileShape;
using test::every_mode;
using test::mla;

void expect_matches_reference(const CaseSpec& s) {
  SCOPED_TRACE(s.describe());
  const CaseResult r = run_case("cuda", make_case(s));
  EXPECT_TRUE(r.ok) << r.detail;
}

// Host-only: which CTA the table gives MLA launches, and that the plan's shapes stay within the
// CTA's 64 rows.
TEST(CudaMlaCta, DispatchSendsBf16LatentLaunchesToIt) {
  for (int heads : {16, 32, 64, 128}) {
    for (int qlen : {1, 2, 5, 17, 300}) {
      const TileShape shape = cuda::choose_shape(qlen, heads, cuda::kMlaHeadDim);
      EXPECT_NE(shape, TileShape::prefill) << heads << " heads, " << qlen << " tokens";
      const AttnKernelKey key{.head_dim = 576, .v_head_dim = 512, .shape = shape};
      // Items of at most 16 rows (one token at 16 heads or fewer) take the keys-on-M CTA.
      EXPECT_EQ(cuda::attention_cta(key), qlen * heads <= 16 ? AttnCta::mla_keys_m : AttnCta::mla);
    }
  }
  for (KvKind kv : {KvKind::e4m3, KvKind::e5m2}) {
    const AttnKernelKey fp8{.head_dim = 576, .v_head_dim = 512, .kv = kv};
    EXPECT_EQ(cuda::attention_cta(fp8), AttnCta::mla_keys_m);
    const AttnKernelKey fp8_verify{
        .head_dim = 576, .v_head_dim = 512, .kv = kv, .shape = TileShape::verify};
    EXPECT_EQ(cuda::attention_cta(fp8_verify), AttnCta::mla);
  }
  AttnKernelKey fp16{.head_dim = 576, .v_head_dim = 512, .fp16 = true};
  EXPECT_EQ(cuda::attention_cta(fp16), AttnCta::generic);
  // Other dims keep their shapes: 128 rows of a head-dim-128 layer are a prefill tile.
  EXPECT_EQ(cuda::choose_shape(32, 4, 128), TileShape::prefill);
}

// Host model of the paired-tile CTA's fp8 tiles (mla_fp8_layout.h), over the kernel's thread
// indices and the four parts its warpgroups copy ([0, 4), [4, 9), [4, 8), [0, 4) + [8, 9)): every
// raw chunk of a part is copied once, to where the converting thread reads it; a quarter warp's
// copies (a row's 128 contiguous raw bytes) write one 128-byte row of shared memory, each 32-byte
// global sector to a 32-byte pair of it (what LDGSTS needs to write a sector at once), on 8
// different 16-byte bank groups. The conversion reads every raw chunk once and writes every bf16
// chunk of the part once, at the 128-byte swizzled place the MMAs read; a row's raw chunks are
// read and overwritten by one quarter warp only (its __syncwarp orders them), and a quarter warp's
// load and each of its two stores touch 8 different bank groups.
TEST(CudaMlaCta, Fp8InPlaceLayoutOfThePairedTileCta) {
  using cuda::mla_bf16_chunk;
  using cuda::mla_raw_chunk;
  constexpr int kBlock = 64 * 128;
  auto group = [](uint32_t offset) { return (offset >> 4) & 7; };
  const std::vector<std::vector<std::pair<int, int>>> parts = {
      {{0, 4}}, {{4, 9}}, {{4, 8}}, {{0, 4}, {8, 9}}};
  for (const auto& part : parts) {
    std::map<uint32_t, int> raw;  // raw chunk -> its (block, row, chunk) as one number
    int part_chunks = 0;
    // The copies: thread wt (row ld_row = wt / 8, ld_c = wt % 8), rows ld_row + 16 r, chunks
    // i + ld_c of each range's 4 (B1 - B0) (copy_blocks), one quarter warp = one row.
    for (auto [b0, b1] : part) {
      const int chunks = 4 * (b1 - b0);
      part_chunks += chunks * 64;
      for (int r = 0; r < 4; ++r)
        for (int i = 0; i < chunks; i += 8)
          for (int quarter = 0; quarter < 16; ++quarter) {
            std::set<int> groups;
            std::set<uint32_t> lines;
            uint32_t at_of[8] = {};
            for (int l = 0; l < 8; ++l) {
              const int wt = 8 * quarter + l, ld_row = wt >> 3, ld_c = wt & 7;
              if (!(i + 8 <= chunks || ld_c < 4)) continue;
              const uint32_t at =
                  cuda::mla_raw_in_place(ld_row, ld_c) + r * 16 * 128 + (b0 + i / 4) * kBlock;
              const int k = b0 + i / 4 + ld_c / 4, row = ld_row + 16 * r, ch = ld_c % 4;
              EXPECT_EQ(at, mla_raw_chunk(k, row, ch)) << k << " " << row << " " << ch;
              EXPECT_TRUE(raw.emplace(at, (k * 64 + row) * 4 + ch).second) << "copied twice";
              groups.insert(group(at));
              lines.insert(at >> 7);
              at_of[l] = at;
            }
            const int lanes = i + 8 <= chunks ? 8 : 4;
            EXPECT_EQ(static_cast<int>(groups.size()), lanes) << "copies, quarter " << quarter;
            EXPECT_EQ(lines.size(), 1u) << "copies, quarter " << quarter;
            // Lanes 2m and 2m + 1 read one 32-byte sector: they write one 32-byte pair.
            for (int l = 0; l < lanes; l += 2) EXPECT_EQ(at_of[l] >> 5, at_of[l + 1] >> 5) << l;
          }
    }
    EXPECT_EQ(static_cast<int>(raw.size()), part_chunks);
    // The conversion (mla_convert_in_place): thread wt, x = wt % 8; a pair of blocks from an even
    // k, four rows a thread; block 8 alone, two.
    std::set<uint32_t> written, read;
    for (auto [b0, b1] : part)
      for (int k = b0; k < b1; k += 2) {
        const bool single = k + 1 == b1;
        const int items = single ? 2 : 4;
        const int row_step = single ? 32 : 16;
        std::map<uint32_t, int> reader;  // raw chunk -> the warp that reads it in this call
        for (int r = 0; r < items; ++r)
          for (int wt = 0; wt < 128; ++wt)
            reader[cuda::mla_convert_src(wt, r, single) + k * kBlock] = wt >> 5;
        for (int r = 0; r < items; ++r)
          for (int quarter = 0; quarter < 16; ++quarter) {
            std::set<int> loads, first, second;
            for (int l = 0; l < 8; ++l) {
              const int wt = 8 * quarter + l, x = wt & 7;
              if (single && r > 0)
                EXPECT_EQ(cuda::mla_convert_row(wt, r, true),
                          cuda::mla_convert_row(wt, 0, true) + row_step * r);
              const int row = cuda::mla_convert_row(wt, r, single);
              const uint32_t src = cuda::mla_convert_src(wt, 0, single) + k * kBlock +
                                   r * row_step * 128,
                             dst = cuda::mla_convert_dst(wt, 0, single) + k * kBlock +
                                   r * row_step * 128;
              EXPECT_EQ(src, cuda::mla_convert_src(wt, r, single) + k * kBlock);
              const int kb = single ? k : k + x / 4, ch = single ? x & 3 : x % 4;
              // It reads its raw chunk ...
              ASSERT_EQ(raw.count(src), 1u) << "k " << k << " row " << row << " x " << x;
              EXPECT_EQ(raw[src], (kb * 64 + row) * 4 + ch);
              EXPECT_TRUE(read.insert(src).second);
              // ... and writes the bf16 chunks 2 ch, 2 ch + 1 of its block (the odd one first
              // where x >= 4).
              const uint32_t lo = mla_bf16_chunk(kb, row, 2 * ch),
                             hi = mla_bf16_chunk(kb, row, 2 * ch + 1);
              EXPECT_EQ(dst, x >= 4 ? hi : lo);
              EXPECT_EQ(dst ^ 16u, x >= 4 ? lo : hi);
              EXPECT_TRUE(written.insert(lo).second);
              EXPECT_TRUE(written.insert(hi).second);
              // A raw chunk it overwrites is read in this call, by its own warp (before the
              // __syncwarp that precedes every store of the call).
              for (uint32_t w : {lo, hi})
                if (raw.count(w)) {
                  ASSERT_EQ(reader.count(w), 1u) << "overwritten before its conversion: " << w;
                  EXPECT_EQ(reader[w], wt >> 5);
                }
              loads.insert(group(src));
              first.insert(group(dst));
              second.insert(group(dst ^ 16u));
            }
            EXPECT_EQ(loads.size(), 8u) << "k " << k << " r " << r << " quarter " << quarter;
            EXPECT_EQ(first.size(), 8u);
            EXPECT_EQ(second.size(), 8u);
          }
      }
    EXPECT_EQ(read.size(), raw.size());
    // Every bf16 chunk of the part, nothing outside it.
    EXPECT_EQ(static_cast<int>(written.size()), 2 * part_chunks);
    for (uint32_t at : written) {
      const int k = static_cast<int>(at / kBlock);
      bool inside = false;
      for (auto [b0, b1] : part) inside |= k >= b0 && k < b1;
      EXPECT_TRUE(inside) << at;
    }
  }
}

#ifdef ATTNRT_HAS_CUDA
// `attnrt info --explain` names the CTA per phase from the same table (host only).
TEST(CudaMlaCta, ExplainNamesTheCtaOfEachPhase) {
  Options o;
  o.speculative_num_steps = 3;
  const ModelSpec m = model_preset("deepseek-v3");
  auto has = [](const std::vector<std::string>& lines, const std::string& what) {
    for (const std::string& l : lines)
      if (l.find(what) != std::string::npos) return true;
    return false;
  };
  const std::vector<std::string> bf16 = cuda::explain_cuda_kernels(m, o, DType::bf16);
  ASSERT_EQ(bf16.size(), 5u) << ::testing::PrintToString(bf16);
  for (size_t i = 1; i <= 3; ++i)
    EXPECT_NE(bf16[i].find("paired-tile MLA CTA (mla_pairs.cu)"), std::string::npos) << bf16[i];
  EXPECT_TRUE(has(bf16, "decode ")) << ::testing::PrintToString(bf16);
  EXPECT_TRUE(has(bf16, "verify ")) << ::testing::PrintToString(bf16);
  EXPECT_TRUE(has(bf16, "MHA form (EXTEND / MIXED")) << ::testing::PrintToString(bf16);
  EXPECT_TRUE(has(bf16, "q / k 192, v 128")) << ::testing::PrintToString(bf16);
  // fp8: the paired-tile CTA at every page size unless ATTNRT_MLA_FP8_PAIRS_MAX_PAGE lowers it;
  // ATTNRT_MLA_PAIRS=0: mla_decode.cu's CTA.
  const std::vector<std::string> e4m3 = cuda::explain_cuda_kernels(m, o, DType::e4m3);
  if (cuda::mla_pairs_enabled() && cuda::mla_pairs_fp8_max_page() >= 128) {
    EXPECT_TRUE(has(e4m3, "paired-tile MLA CTA (mla_pairs.cu)")) << ::testing::PrintToString(e4m3);
    EXPECT_TRUE(has(e4m3, "raw rows converted in place")) << ::testing::PrintToString(e4m3);
    EXPECT_FALSE(has(e4m3, "MLA CTA (mla_decode.cu):")) << ::testing::PrintToString(e4m3);
  }
  const bool pairs = cuda::mla_pairs_enabled();
  cuda::set_mla_pairs(false);
  const std::vector<std::string> split = cuda::explain_cuda_kernels(m, o, DType::e4m3);
  cuda::set_mla_pairs(pairs);
  EXPECT_FALSE(has(split, "paired-tile")) << ::testing::PrintToString(split);
  EXPECT_TRUE(has(split, "MLA CTA (mla_decode.cu)")) << ::testing::PrintToString(split);
  EXPECT_TRUE(has(split, "converted from fp8")) << ::testing::PrintToString(split);
  const std::vector<std::string> tp8 =
      cuda::explain_cuda_kernels(apply_tensor_parallel(m, 8), o, DType::bf16);
  ASSERT_EQ(tp8.size(), 5u);
  EXPECT_NE(tp8[1].find("keys-on-M MLA CTA"), std::string::npos) << tp8[1];
  ModelSpec f16 = m;
  f16.dtype = DType::f16;
  EXPECT_TRUE(has(cuda::explain_cuda_kernels(f16, o, DType::f16), "generic SIMT kernel"));
}
#endif

TEST(CudaMlaCta, EveryModeAtEveryTensorParallelHeadCount) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = test::test_seed();
  for (int heads : {16, 32, 64, 128}) {
    for (CaseSpec& s : every_mode({mla(heads)}, DType::bf16, seed)) {
      s.label += " h" + std::to_string(heads);
      expect_matches_reference(s);
    }
    seed += 16;
  }
}

// fp8 latent rows (converted to bf16 in shared memory), both formats, with their layer scale.
TEST(CudaMlaCta, Fp8LatentInEveryMode) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = test::test_seed();
  for (DType kv : {DType::e4m3, DType::e5m2}) {
    for (int heads : {16, 128}) {
      for (CaseSpec& s : every_mode({mla(heads)}, kv, seed)) {
        s.label += " " + std::string(dtype_name(kv)) + " h" + std::to_string(heads);
        expect_matches_reference(s);
      }
      seed += 16;
    }
  }
}

// Page sizes 1 .. 128 with random lengths (page edges crossed, partial last pages), a tree and a
// chain verify block on top of each.
TEST(CudaMlaCta, NativePageSizesWithRaggedLengths) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  for (int page : {1, 16, 32, 64, 128}) {
    for (int heads : {16, 128}) {
      // Every fp8 CTA copies its own rows (the keys-on-M CTA at 16 heads; at 128 the paired-tile
      // CTA's raw chunks in place): e4m3 on every page size too.
      for (DType kv : {DType::bf16, DType::e4m3}) {
        std::vector<CaseSpec> cases = every_mode({mla(heads)}, kv, seed + page + heads);
        for (CaseSpec& s : cases) {
          if (s.mode == ForwardMode::EXTEND || s.mode == ForwardMode::MIXED) continue;
          s.page_size = page;
          for (int32_t& p : s.prefix_lens) p = static_cast<int32_t>(rng() % 700) + (p > 0 ? 1 : 0);
          s.label += " page " + std::to_string(page) + " h" + std::to_string(heads) + " " +
                     std::string(dtype_name(kv));
          expect_matches_reference(s);
        }
      }
    }
  }
}

// The keys-on-M CTA's items hold (token, head) columns of several tokens when a request has fewer
// than 16 heads: 8 heads (tensor parallel 16) and 4 heads with chains and trees of 2 and 4 tokens.
TEST(CudaMlaCta, KeysOnMItemsOfSeveralTokens) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = test::test_seed();
  for (int heads : {8, 4}) {
    for (DType kv : {DType::bf16, DType::e4m3}) {
      for (CaseSpec& s : every_mode({mla(heads)}, kv, seed)) {
        s.label += " " + std::string(dtype_name(kv)) + " h" + std::to_string(heads);
        expect_matches_reference(s);
      }
      seed += 16;
    }
  }
}

#ifdef ATTNRT_HAS_CUDA
// The 64-row items on both CTAs: the paired-tile CTA (the default) and mla_decode.cu's, which
// ATTNRT_MLA_PAIRS=0 selects: every mode at 64 and 128 heads, odd and even tile counts, page sizes
// 1 and 64, bf16 and both fp8 latents; then the paired-tile CTA's two-CTA clusters
// (ATTNRT_MLA_MC=1, off by default) on the bf16 latent at 128 heads and pages 32 and 64.
TEST(CudaMlaCta, PairedTileCtaAndTheSplitCtaInEveryMode) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  auto run = [&](DType kv, int heads, int page, const std::string& label) {
    for (CaseSpec& s : every_mode({mla(heads)}, kv, seed++)) {
      s.page_size = page;
      for (int32_t& p : s.prefix_lens) p = static_cast<int32_t>(rng() % 900) + (p > 0 ? 1 : 0);
      s.label += label + " h" + std::to_string(heads) + " page " + std::to_string(page) + " " +
                 std::string(dtype_name(kv));
      expect_matches_reference(s);
    }
  };
  const bool before = cuda::mla_pairs_enabled();
  const bool mc_before = cuda::mla_pairs_mc_enabled();
  cuda::set_mla_pairs_mc(false);
  for (bool pairs : {true, false}) {
    cuda::set_mla_pairs(pairs);
    for (DType kv : {DType::bf16, DType::e4m3, DType::e5m2})
      for (int heads : {64, 128})
        for (int page : {1, 64}) run(kv, heads, page, pairs ? " pairs" : " split");
  }
  cuda::set_mla_pairs(true);
  cuda::set_mla_pairs_mc(true);
  for (int page : {32, 64}) run(DType::bf16, 128, page, " clusters");
  cuda::set_mla_pairs_mc(mc_before);
  cuda::set_mla_pairs(before);
}

// The paired-tile CTA's two page-id instances (ATTNRT_MLA_PAIRS_IDS_MAX_PAGE): the ids through
// shared memory at every page size (limit 128), then in registers at every page size (limit 0),
// bf16 and e4m3 latents at 128 heads, decode / verify / draft-extend steps with ragged lengths.
TEST(CudaMlaCta, PairedTileCtaPageIdsBothWaysAtEveryPageSize) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  const bool pairs_before = cuda::mla_pairs_enabled();
  const bool mc_before = cuda::mla_pairs_mc_enabled();
  const int ids_before = cuda::mla_pairs_ids_max_page();
  cuda::set_mla_pairs(true);
  cuda::set_mla_pairs_mc(false);
  for (int limit : {128, 0}) {
    cuda::set_mla_pairs_ids_max_page(limit);
    for (int page : {1, 16, 32, 64}) {
      for (DType kv : {DType::bf16, DType::e4m3}) {
        for (CaseSpec& s : every_mode({mla(128)}, kv, seed++)) {
          if (s.mode == ForwardMode::EXTEND || s.mode == ForwardMode::MIXED) continue;
          s.page_size = page;
          for (int32_t& p : s.prefix_lens) p = static_cast<int32_t>(rng() % 700) + (p > 0 ? 1 : 0);
          s.label += std::string(limit > 0 ? " ids in shared memory" : " ids in registers") +
                     " page " + std::to_string(page) + " " + std::string(dtype_name(kv));
          expect_matches_reference(s);
        }
      }
    }
  }
  cuda::set_mla_pairs_ids_max_page(ids_before);
  cuda::set_mla_pairs_mc(mc_before);
  cuda::set_mla_pairs(pairs_before);
}
#endif

// One long request (many splits and their merge) beside short ones, soft-cap on, large logits.
TEST(CudaMlaCta, SoftcapAndManySplits) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = test::test_seed();
  for (int heads : {16, 128}) {
    LayerSpec l = mla(heads);
    l.logit_cap = 30.f;
    for (CaseSpec& s : every_mode({l}, DType::bf16, seed++)) {
      if (s.mode != ForwardMode::DECODE && s.mode != ForwardMode::TARGET_VERIFY) continue;
      s.q_amplitude = 3.f;
      if (s.mode == ForwardMode::DECODE) s.prefix_lens = {20000, 63, 64, 65};
      s.label += " softcap h" + std::to_string(heads);
      expect_matches_reference(s);
    }
  }
}

}  // namespace
}  // namespace attnrt
