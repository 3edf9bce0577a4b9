// The fp8 prefill CTAs (backends/cuda/kernels/prefill_fp8.cuh, one warpgroup, and
// prefill_fp8_ws.cuh, warp-specialised with ATTNRT_PREFILL_FP8_WS=1; --fp8-prefill-attention)
// against the reference backend over the same e4m3 pool bytes, every case on both CTAs (the
// warp-specialised one with its TMA producer where it applies and with its cp.async producer
// everywhere): ragged extend batches with cached prefixes crossing page edges, pages of 1 to 256
// slots (TMA boxes of 8 to 128 rows, the partial page at a range's end), GQA groups
// 1, 4 and 8, causal and not, sliding windows, softcap, sinks, split keys merged by lse, MIXED and
// DRAFT_EXTEND steps, fp16, more units than the persistent grid has CTAs. Every case checks that
// the table sends its prefill items to the fp8 CTA. Without a GPU the host-side models run: the
// register-fragment permutation, the kernels' V transpose simulated thread by thread (placement,
// coverage, bank conflicts), P V through the packed A operand and the transposed tiles (64 keys,
// and 128 as two halves) read as the MMA's K-major B operand, the warp-specialised CTA's in-place
// Q conversion, the dispatch table and `info --explain`.
//
// Tolerance. The reference reads the same fp8 K and V; the CTA adds two roundings to e4m3 (3
// mantissa bits: relative error at most 2^-4 each): q (at a power-of-two scale, so nothing else)
// and the softmax weights P (the row sums add the unrounded weights).
//  - q: a logit moves by ds = scale * sum_d dq_d k_d. Independent errors of q ~ U[-1, 1] against
//    keys of at most kmax give a standard deviation of at most
//    sigma = 2^-4 / sqrt(3) * rms(q) * rms(k) = 2^-4 / sqrt(3) * (1 / sqrt(3)) * (kmax / sqrt(3))
//    at scale = D^-1/2 (0.024 at kmax = 2).
//  - o = sum_j p_j (1 + e_j) v_j / sum_j p_j with weights p_j exp(ds_j): o moves by at most
//    max|e| * max|v| (the rounding against the unrounded sums) plus max|e + ds| * the mean
//    absolute deviation of v (at most max|v|), so |o - ref| <= max|v| (2^-3 + 5 sigma) with
//    |ds| within five sigma; relative to o's size the independent errors leave about
//    rms(e) + sigma, bounded here by 2^-4 + 2 sigma.
//  - lse = m + log sum_j p_j exp(ds_j): off by at most max|ds|, 5 sigma (at least 0.02).
// The 16-bit CTAs are held to 1.2e-2 relative (bf16 P); an fp8 CTA that lost a tile or misplaced
// a key is off by O(max|v|), far beyond these.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/fp8_pv_layout.h"
#include "tests/test_cuda_prefill_case.h"
#include "tests/test_cuda_util.h"

#ifdef ATTNRT_HAS_CUDA
#include "backends/cuda/cuda_backend.h"
#endif

namespace attnrt {
namespace {

// ---- Host models (no GPU).

// The fp32 accumulator of wgmma m64nN (PTX ISA, "wgmma D fragment"): register 4j + e of lane
// quad position q holds row half e >> 1 (rows r, r + 8) and column 8j + 2q + (e & 1).
struct Cell {
  int half, col;
};
Cell accumulator_cell(int reg, int q) {
  return {(reg & 3) >> 1, 8 * (reg >> 2) + 2 * q + (reg & 1)};
}

// The 8-bit A operand of wgmma m64nNk32 (PTX ISA, "wgmma A fragment, .e4m3"): byte b of register
// a of lane quad position q holds row half a & 1 and k position 16 * (a >> 1) + 4q + b.
Cell a_fragment_cell(int a, int b, int q) { return {a & 1, 16 * (a >> 1) + 4 * q + b}; }

TEST(Fp8PrefillLayout, PackedWeightsMeetTheirKeysInTheTransposedV) {
  // For every thread position and every byte of the A operand of one 32-key step: the
  // accumulator value the kernel packs there lies in the same row, and its key (column of S) is
  // the one the transposed V holds at that k position.
  for (int q = 0; q < 4; ++q)
    for (int a = 0; a < 4; ++a)
      for (int b = 0; b < 4; ++b) {
        const int idx = cuda::pv_fragment_index(a, b);
        ASSERT_GE(idx, 0);
        ASSERT_LT(idx, 16);
        const Cell from = accumulator_cell(idx, q), to = a_fragment_cell(a, b, q);
        EXPECT_EQ(from.half, to.half) << "q " << q << " a " << a << " b " << b;
        EXPECT_EQ(from.col, cuda::pv_key(to.col)) << "q " << q << " a " << a << " b " << b;
      }
  // Each thread packs each of its 16 values of a step exactly once.
  std::set<int> packed;
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b) packed.insert(cuda::pv_fragment_index(a, b));
  EXPECT_EQ(packed.size(), 16u);
}

TEST(Fp8PrefillLayout, KeyOrderIsAPermutationOfEach32) {
  // The transposed V tile of 64 keys: every key once, never leaving its group of 32 (a k32 MMA
  // step reads one group).
  std::set<int> keys;
  for (int p = 0; p < 64; ++p) {
    EXPECT_EQ(cuda::pv_key(p) / 32, p / 32) << "position " << p;
    keys.insert(cuda::pv_key(p));
  }
  EXPECT_EQ(keys.size(), 64u);
  // The order of the brief's derivation, spelled out for one thread (q = 1): positions 4..7 hold
  // keys 2, 3, 10, 11; positions 20..23 keys 18, 19, 26, 27.
  EXPECT_EQ(cuda::pv_key(4), 2);
  EXPECT_EQ(cuda::pv_key(5), 3);
  EXPECT_EQ(cuda::pv_key(6), 10);
  EXPECT_EQ(cuda::pv_key(7), 11);
  EXPECT_EQ(cuda::pv_key(20), 18);
  EXPECT_EQ(cuda::pv_key(23), 27);
}

TEST(Fp8PrefillLayout, ByteTransposeOfFourKeysByFourColumns) {
  uint32_t in[4], out[4];
  for (int k = 0; k < 4; ++k) {
    in[k] = 0;
    for (int c = 0; c < 4; ++c) in[k] |= static_cast<uint32_t>(16 * k + c + 1) << (8 * c);
  }
  cuda::transpose4x4_bytes(in, out, cuda::byte_perm_host);
  for (int c = 0; c < 4; ++c)
    for (int k = 0; k < 4; ++k)
      EXPECT_EQ((out[c] >> (8 * k)) & 0xff, static_cast<uint32_t>(16 * k + c + 1))
          << "column " << c << " key " << k;
}

// The kernel's V transpose run on the host: every thread's passes (vt_block) over a staged tile
// whose bytes are `value(key, byte)`; returns the transposed tile. Fails the test when a byte of
// the transposed tile is written other than exactly once, or a warp's 32-bit loads or stores meet
// more than two-way bank conflicts.
std::vector<uint8_t> simulate_v_transpose(int (*value)(int key, int byte)) {
  std::vector<uint8_t> stage(64 * 128), vt(64 * 128);
  std::vector<int> writes(vt.size(), 0);
  for (int key = 0; key < 64; ++key)
    for (int c = 0; c < 128; ++c)
      stage[cuda::v_stage_offset(key, c)] = static_cast<uint8_t>(value(key, c));
  auto load32 = [](const std::vector<uint8_t>& buf, int off) {
    uint32_t w = 0;
    for (int k = 0; k < 4; ++k) w |= static_cast<uint32_t>(buf[off + k]) << (8 * k);
    return w;
  };
  // Distinct 4-byte words per bank among a warp's 32 accesses.
  auto worst_conflict = [](const std::vector<int>& offsets) {
    std::vector<std::set<int>> banks(32);
    for (int off : offsets) banks[(off / 4) % 32].insert(off / 4);
    size_t worst = 0;
    for (const auto& b : banks) worst = std::max(worst, b.size());
    return static_cast<int>(worst);
  };
  for (int warp = 0; warp < 4; ++warp)
    for (int n = 0; n < 4; ++n) {
      std::vector<std::vector<int>> loads(4), stores(4);
      for (int lane = 0; lane < 32; ++lane) {
        const cuda::VtBlock blk = cuda::vt_block(32 * warp + lane, n);
        uint32_t in[4], out[4];
        for (int i = 0; i < 4; ++i) {
          const int off = cuda::v_stage_offset(cuda::pv_key(4 * blk.pq + i), 4 * blk.dq);
          loads[i].push_back(off);
          in[i] = load32(stage, off);
        }
        cuda::transpose4x4_bytes(in, out, cuda::byte_perm_host);
        for (int b = 0; b < 4; ++b) {
          const int off = cuda::vt_offset(4 * blk.dq + b, 4 * blk.pq);
          stores[b].push_back(off);
          for (int k = 0; k < 4; ++k) {
            vt[off + k] = static_cast<uint8_t>(out[b] >> (8 * k));
            ++writes[off + k];
          }
        }
      }
      for (int i = 0; i < 4; ++i) {
        EXPECT_LE(worst_conflict(loads[i]), 2) << "warp " << warp << " pass " << n << " load " << i;
        EXPECT_LE(worst_conflict(stores[i]), 2)
            << "warp " << warp << " pass " << n << " store " << i;
      }
    }
  for (size_t i = 0; i < writes.size(); ++i) EXPECT_EQ(writes[i], 1) << "transposed byte " << i;
  return vt;
}

TEST(Fp8PrefillLayout, TransposedVHoldsKeyPvKeyOfEveryPositionInEveryRow) {
  // Two runs: bytes naming their key, then their head-dim column; together they place every byte.
  const std::vector<uint8_t> by_key = simulate_v_transpose([](int key, int) { return key; });
  const std::vector<uint8_t> by_col = simulate_v_transpose([](int, int c) { return c; });
  for (int d = 0; d < 128; ++d)
    for (int p = 0; p < 64; ++p) {
      ASSERT_EQ(by_key[cuda::vt_offset(d, p)], cuda::pv_key(p)) << "row " << d << " position " << p;
      ASSERT_EQ(by_col[cuda::vt_offset(d, p)], d) << "row " << d << " position " << p;
    }
}

// One m64 block of P (64 rows x `keys` keys, 64 or 128) in the S accumulators of a warpgroup,
// packed into the A operand as the kernels pack it, times the transposed V (the kernel's transpose
// of each 64 keys, kFp8VtBytes apart) read as the K-major B operand of each k32 step from its
// descriptor start vt_k32_offset (element (k, n) of a step at vt_offset(n, k) from there, the
// 64-byte swizzle being a function of the address), against P V directly. Small integers: exact.
void check_packed_pv(int keys, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> small(0, 15);
  std::vector<int> P(64 * keys), V(keys * 128);
  for (int& x : P) x = small(rng);
  static std::vector<int> v_values;
  v_values.resize(64 * 128);
  for (int& x : V) x = small(rng);
  std::vector<uint8_t> vt(keys / 64 * cuda::kFp8VtBytes);
  for (int h = 0; h < keys / 64; ++h) {
    std::copy(V.begin() + h * 64 * 128, V.begin() + (h + 1) * 64 * 128, v_values.begin());
    const std::vector<uint8_t> half =
        simulate_v_transpose([](int key, int c) { return v_values[key * 128 + c]; });
    std::copy(half.begin(), half.end(), vt.begin() + h * cuda::kFp8VtBytes);
  }
  std::vector<long> O(64 * 128, 0);
  for (int warp = 0; warp < 4; ++warp)
    for (int lane = 0; lane < 32; ++lane) {
      const int q = lane % 4, r = 16 * warp + lane / 4;
      std::vector<int> s(keys / 2);  // this thread's S accumulator of the block (m64nKEYS)
      for (int reg = 0; reg < keys / 2; ++reg) {
        const Cell c = accumulator_cell(reg, q);
        s[reg] = P[(r + 8 * c.half) * keys + c.col];
      }
      for (int t = 0; t < keys / 32; ++t) {  // the k32 steps
        const int start = cuda::vt_k32_offset(t);
        // The descriptor starts at position 32 (t % 2) of row 0 of tile t / 2.
        ASSERT_EQ(start, t / 2 * cuda::kFp8VtBytes + cuda::vt_offset(0, 32 * (t % 2))) << t;
        const int tile = t / 2 * cuda::kFp8VtBytes;
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < 4; ++b) {
            const Cell at = a_fragment_cell(a, b, q);
            const int row = r + 8 * at.half, k = 32 * (t % 2) + at.col;
            const int weight = s[16 * t + cuda::pv_fragment_index(a, b)];
            for (int n = 0; n < 128; ++n)
              O[row * 128 + n] += long{weight} * vt[tile + cuda::vt_offset(n, k)];
          }
      }
    }
  for (int row = 0; row < 64; ++row)
    for (int n = 0; n < 128; ++n) {
      long want = 0;
      for (int key = 0; key < keys; ++key) want += long{P[row * keys + key]} * V[key * 128 + n];
      ASSERT_EQ(O[row * 128 + n], want) << keys << " keys, row " << row << " column " << n;
    }
}

TEST(Fp8PrefillLayout, PackedWeightsTimesTransposedVIsPTimesV) {
  check_packed_pv(64, 20);  // the one-warpgroup CTA's tile
}

TEST(Fp8PrefillLayout, TwoTransposedHalvesServeA128KeyTile) {
  check_packed_pv(128, 21);  // the warp-specialised CTA's tile: four k32 steps over two halves
}

TEST(Fp8PrefillLayout, InPlaceQQuantisationStaysInEachConsumersOwnBytes) {
  // The warp-specialised CTA's in-place Q conversion run on the host, over the kernel's own
  // thread indices: consumer thread ct (0 .. 255, as the kernel numbers them) reads in pass n the
  // 16-bit chunk q_convert_chunk(ct, n) of the copied Q tile (q16_offset, 16 bytes) and writes
  // its e4m3 bytes (q8_offset, 8) in place. Each consumer reads only its own rows 64c .. 64c + 63,
  // every chunk of them once; every byte it writes is one it read (so only its own barrier orders
  // the two) and none is a byte the other consumer reads or writes; nothing lies outside the
  // 32 KiB Q tile; the e4m3 tile is whole (each of its 16 KiB written once). Before the fix the
  // second consumer's threads, 128 .. 255, took rows 72 .. 135: rows 64 .. 71 kept their 16-bit
  // bytes (NaN as e4m3) and rows 128 .. 135 reached the other consumer's bytes and the ring.
  constexpr int kRows = 128, kQBytes = kRows * 128 * 2;
  std::vector<int> reader(kQBytes, -1), writer(kRows * 128, -1);
  for (int ct = 0; ct < 256; ++ct)
    for (int n = 0; n < cuda::kQConvertPasses; ++n) {
      const int c = ct / 128;
      const cuda::QChunk q = cuda::q_convert_chunk(ct, n);
      ASSERT_GE(q.r, 64 * c) << "thread " << ct << " pass " << n;
      ASSERT_LT(q.r, 64 * c + 64) << "thread " << ct << " pass " << n;
      ASSERT_GE(q.c, 0);
      ASSERT_LT(q.c, 16);
      for (int b = 0; b < 16; ++b) {
        const int off = cuda::q16_offset(kRows, q.r, q.c) + b;
        ASSERT_LT(off, kQBytes);
        ASSERT_EQ(reader[off], -1) << "16-bit byte read twice: row " << q.r << " chunk " << q.c;
        reader[off] = c;
      }
      for (int b = 0; b < 8; ++b) {
        const int off = cuda::q8_offset(q.r, q.c) + b;
        ASSERT_EQ(writer[off], -1) << "e4m3 byte written twice: row " << q.r << " chunk " << q.c;
        writer[off] = c;
      }
    }
  for (int off = 0; off < kQBytes; ++off)
    ASSERT_NE(reader[off], -1) << "16-bit byte " << off << " unread";
  for (int off = 0; off < kRows * 128; ++off) {
    ASSERT_NE(writer[off], -1) << "e4m3 byte " << off << " unwritten";
    EXPECT_EQ(reader[off], writer[off]) << "byte " << off;
  }
  // The e4m3 rows are the S MMAs' K-major rows: row r's 16-byte chunk k at k ^ (r % 8); consumer
  // c's descriptor starts at row 64c (a whole number of 1024-byte swizzle atoms).
  for (int r = 0; r < kRows; ++r)
    for (int ch = 0; ch < 16; ++ch)
      EXPECT_EQ(cuda::q8_offset(r, ch), r * 128 + (((ch / 2) ^ (r % 8)) * 16) + (ch % 2) * 8);
  EXPECT_EQ(cuda::q8_offset(64, 0) % 1024, 0);
  // The row maximum: lane 0 of each warp of a consumer writes one of that consumer's 4 slots,
  // each once, and the consumer reads all 4.
  for (int c = 0; c < 2; ++c) {
    std::set<int> slots;
    for (int ct = 128 * c; ct < 128 * c + 128; ct += 32) {
      const int slot = cuda::q_amax_slot(ct);
      ASSERT_GE(slot, 0);
      ASSERT_LT(slot, 4);
      slots.insert(slot);
    }
    EXPECT_EQ(slots.size(), 4u) << "consumer " << c;
  }
}

// The table (host code): the fp8 CTA takes prefill items over e4m3 at head dim 128 when asked
// for, and nothing else (fp8 prefill items it does not take at head dim 128 go to the
// warp-specialised CTA over fp8 pages, test_cuda_prefill_kv8.cpp).
TEST(Fp8PrefillDispatch, OnlyAskedForE4m3PrefillItemsAtHeadDim128) {
  using cuda::AttnCta;
  using cuda::AttnKernelKey;
  using cuda::KvKind;
  using cuda::TileShape;
  const AttnKernelKey on{.head_dim = 128,
                         .v_head_dim = 128,
                         .kv = KvKind::e4m3,
                         .shape = TileShape::prefill,
                         .rows = 128,
                         .fp8_prefill = true};
  EXPECT_EQ(cuda::attention_cta(on), AttnCta::fp8_prefill);
  AttnKernelKey k = on;
  k.fp16 = true;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::fp8_prefill) << "fp16 q / out";
  k = on;
  k.fp8_prefill = false;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill_kv8) << "off: the default over fp8 pages";
  k = on;
  k.kv = KvKind::e5m2;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill_kv8) << "e5m2";
  k = on;
  k.kv = KvKind::same_as_q;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill) << "16-bit KV";
  k = on;
  k.target_verify = true;
  EXPECT_EQ(cuda::attention_cta(k), AttnCta::mma_prefill) << "TARGET_VERIFY";
  for (int d : {64, 256}) {
    k = on;
    k.head_dim = k.v_head_dim = d;
    EXPECT_EQ(cuda::attention_cta(k), AttnCta::prefill_kv8)
        << "head dim " << d << ": the fp8 CTA's one head dim is 128";
  }
  for (TileShape sh : {TileShape::decode, TileShape::decode32, TileShape::verify}) {
    k = on;
    k.shape = sh;
    EXPECT_NE(cuda::attention_cta(k), AttnCta::fp8_prefill) << static_cast<int>(sh);
  }
  EXPECT_FALSE(cuda::launches_as_dependent(AttnCta::fp8_prefill));
}

#ifdef ATTNRT_HAS_CUDA

using test::check_gqa_groups;
using test::check_non_causal_and_long;
using test::check_prefill;
using test::check_split_keys;
using test::check_window_softcap_and_sinks;
using test::draft_extend_case;
using test::lengths;
using test::many_units_case;
using test::mixed_step_case;
using test::PrefillCase;
using test::PrefillTolerance;
using test::ring_wrap_case;
using test::small_step_case;

// The derivation above, for a case's scales: pool codes and new tokens' k / v lie in [-2, 2]
// (codes times the layer's scale when read).
PrefillTolerance fp8_tolerance(const PrefillCase& c) {
  const double e = 1.0 / 16, vmax = 2.0 * std::max(1.f, c.v_scale),
               kmax = 2.0 * std::max(1.f, c.k_scale);
  const double sigma = e / std::sqrt(3.0) * (1.0 / std::sqrt(3.0)) * (kmax / std::sqrt(3.0));
  PrefillTolerance t;
  t.rel = t.rel_f16 = e + 2 * sigma;
  t.max_abs = vmax * (2 * e + 5 * sigma);
  t.lse = std::max(0.02, 5 * sigma);
  return t;
}

PrefillCase fp8_case(std::vector<int32_t> prefix, std::vector<int32_t> qlen, uint32_t seed) {
  PrefillCase c = lengths(std::move(prefix), std::move(qlen), seed);
  c.fp8_kv = true;
  c.fp8_prefill = true;
  return c;
}

void check_fp8(const PrefillCase& c, const testing::Message& what = testing::Message()) {
  check_prefill(c, what, fp8_tolerance(c));
}

// Host only: `attnrt info --explain` names the fp8 CTA for the extend phase when the option is on
// over e4m3 (the one-warpgroup CTA, or with the switch the warp-specialised one), and the
// warp-specialised CTA over fp8 pages without it.
TEST(Fp8PrefillDispatch, ExplainNamesWhichFp8CtaRunsExtend) {
  ModelSpec m;
  m.name = "fp8-prefill-explain";
  m.layers = {test::attention_layer(0, 32, 8, 128)};
  Options o;
  auto extend_line = [&](DType kv) {
    for (const std::string& line : cuda::explain_cuda_kernels(m, o, kv))
      if (line.find("  extend") == 0) return line;
    return std::string();
  };
  const bool saved = cuda::prefill_fp8_ws_enabled();
  cuda::set_prefill_fp8_ws(false);
  const test::ScopedPrefillKv8 kv8_on(true);
  const std::string kv8 = "warp-specialised prefill CTA over fp8 pages";
  EXPECT_NE(extend_line(DType::e4m3).find(kv8), std::string::npos);
  o.fp8_prefill_attention = true;
  const std::string on = extend_line(DType::e4m3);
  EXPECT_NE(on.find("fp8 prefill CTA (prefill_fp8.cuh)"), std::string::npos) << on;
  EXPECT_NE(on.find("--fp8-prefill-attention"), std::string::npos) << on;
  cuda::set_prefill_fp8_ws(true);
  const std::string ws = extend_line(DType::e4m3);
  EXPECT_NE(ws.find("warp-specialised fp8 prefill CTA (prefill_fp8_ws.cuh)"), std::string::npos)
      << ws;
  EXPECT_NE(ws.find("ATTNRT_PREFILL_FP8_WS=0: the one-warpgroup one"), std::string::npos) << ws;
  o.fp8_prefill_attention = false;
  EXPECT_NE(extend_line(DType::e4m3).find(kv8), std::string::npos)
      << "the switch alone changes nothing";
  cuda::set_prefill_fp8_ws(saved);
}

// Which launches of the warp-specialised fp8 CTA take its TMA producer: host checks only (no
// driver call), so this runs without a GPU. Elsewhere its cp.async producer runs.
TEST(Fp8PrefillTma, AppliesToE4m3PoolsWithPagesOfEightOrMore) {
  alignas(16) static uint8_t pool[1024];
  cuda::AttnParams p{};
  p.k = pool;
  p.v = pool + 512;
  p.k_row_stride = p.v_row_stride = 2 * 128;  // bytes: two KV heads of 128 e4m3 values a slot
  p.kv_rows = 1 << 20;
  p.kv_kind = cuda::KvKind::e4m3;
  p.page_shift = 4;
  p.num_kv_heads = 2;
  EXPECT_TRUE(cuda::prefill_fp8_tma_applies(p));
  cuda::AttnParams q = p;
  q.page_shift = 3;
  EXPECT_TRUE(cuda::prefill_fp8_tma_applies(q)) << "pages of 8";
  q.page_shift = 8;
  EXPECT_TRUE(cuda::prefill_fp8_tma_applies(q)) << "pages of 256: boxes of 128 slots";
  q.page_shift = 2;
  EXPECT_FALSE(cuda::prefill_fp8_tma_applies(q)) << "pages of 4";
  q.page_shift = 0;
  EXPECT_FALSE(cuda::prefill_fp8_tma_applies(q)) << "pages of 1";
  q = p;
  const int64_t map[2] = {0, -1};
  q.slot_map = map;
  EXPECT_FALSE(cuda::prefill_fp8_tma_applies(q)) << "SWA pool: slots remapped";
  for (cuda::KvKind kind : {cuda::KvKind::same_as_q, cuda::KvKind::e5m2}) {
    q = p;
    q.kv_kind = kind;
    EXPECT_FALSE(cuda::prefill_fp8_tma_applies(q)) << "not e4m3: " << static_cast<int>(kind);
  }
  q = p;
  q.tree = 1;
  EXPECT_FALSE(cuda::prefill_fp8_tma_applies(q)) << "tree mask";
  q = p;
  q.kv_rows = 0;
  EXPECT_FALSE(cuda::prefill_fp8_tma_applies(q)) << "pool rows unknown";
  q = p;
  q.k = pool + 8;
  EXPECT_FALSE(cuda::prefill_fp8_tma_applies(q)) << "K base not 16-byte aligned";
  q = p;
  q.v_row_stride = 2 * 128 + 8;
  EXPECT_FALSE(cuda::prefill_fp8_tma_applies(q)) << "V rows not 16-byte aligned";
  q = p;
  q.k_row_stride = 128;
  EXPECT_FALSE(cuda::prefill_fp8_tma_applies(q)) << "K rows shorter than their heads";
  // The pool with rows 8 bytes off 16 (a map the driver could not encode): no maps, so the
  // launch takes the cp.async producer.
  q = p;
  q.k_row_stride = q.v_row_stride = 2 * 128 + 8;
  EXPECT_FALSE(cuda::prefill_fp8_ws_uses_tma(q, false));
}

// Every GPU case runs on both fp8 CTAs: OneWarpgroup (prefill_fp8.cuh) and the warp-specialised
// one (prefill_fp8_ws.cuh, ATTNRT_PREFILL_FP8_WS=1) with its TMA producer where it applies
// (WarpSpecialised; the cp.async one on pages below 8 slots) and with the cp.async producer
// everywhere (WarpSpecialisedCpAsync, ATTNRT_PREFILL_TMA=0); the switches are restored after each
// test.
enum class Fp8Cta { one_warpgroup, warp_specialised, warp_specialised_cp_async };

class CudaFp8PrefillTest : public ::testing::TestWithParam<Fp8Cta> {
 protected:
  void SetUp() override {
    saved_ = cuda::prefill_fp8_ws_enabled();
    saved_tma_ = cuda::prefill_tma_enabled();
    cuda::set_prefill_fp8_ws(GetParam() != Fp8Cta::one_warpgroup);
    cuda::set_prefill_tma(GetParam() != Fp8Cta::warp_specialised_cp_async);
    SKIP_WITHOUT_GPU();
  }
  void TearDown() override {
    cuda::set_prefill_fp8_ws(saved_);
    cuda::set_prefill_tma(saved_tma_);
  }

 private:
  bool saved_ = false, saved_tma_ = true;
};

TEST_P(CudaFp8PrefillTest, RaggedCausalExtendOverPageEdges) {
  // Prefixes on a page boundary (0, 32, 256), one key past one (17) and mid-page (301); query runs
  // shorter than a tile, one token, and several tiles long.
  for (int page : {1, 16, 64}) {
    PrefillCase c =
        fp8_case({0, 17, 256, 32, 301}, {300, 45, 1, 129, 200}, static_cast<uint32_t>(page + 100));
    c.page = page;
    check_fp8(c, testing::Message() << "page " << page);
  }
}

TEST_P(CudaFp8PrefillTest, TmaBoxesOfEveryPageSize) {
  // Pages of 8 to 256 slots (boxes of min(page, 128) rows): prefixes and ends off page edges (the
  // partial page at hi and the keys past it by cp.async), a one-token request, a unit whose last
  // tile holds only cached keys; then a window whose first key lies inside a tile (the TMA
  // producer's range starts on that tile's first key).
  for (int page : {8, 32, 128, 256}) {
    PrefillCase c =
        fp8_case({0, 9, 250, 130}, {200, 37, 300, 1}, static_cast<uint32_t>(page + 200));
    c.page = page;
    check_fp8(c, testing::Message() << "page " << page);
  }
  PrefillCase w = fp8_case({700, 33}, {260, 190}, 41);
  w.page = 32;
  w.window = 150;
  check_fp8(w, testing::Message() << "window 150, page 32");
}

TEST_P(CudaFp8PrefillTest, GqaGroups) {
  check_gqa_groups(fp8_case, check_fp8);
}

TEST_P(CudaFp8PrefillTest, NonCausalAndLongRuns) {
  check_non_causal_and_long(fp8_case, check_fp8);
}

TEST_P(CudaFp8PrefillTest, WindowSoftcapAndSinks) {
  check_window_softcap_and_sinks(fp8_case, check_fp8);
}

TEST_P(CudaFp8PrefillTest, SplitKeysMergeWithLse) {
  check_split_keys(fp8_case, check_fp8);
}

TEST_P(CudaFp8PrefillTest, ScalesAndQMagnitudes) {
  // Other per-layer scales (the power-of-two q scale is the CTA's own), and fp16 activations.
  PrefillCase c = fp8_case({33, 0}, {220, 140}, 17);
  c.k_scale = 0.05f;
  c.v_scale = 4.f;
  check_fp8(c, testing::Message() << "k_scale 0.05, v_scale 4");
  c.act = DType::f16;
  c.k_scale = 2.f;
  c.v_scale = 0.25f;
  c.seed = 18;
  check_fp8(c, testing::Message() << "fp16, k_scale 2, v_scale 0.25");
}

TEST_P(CudaFp8PrefillTest, MixedAndDraftExtendSteps) {
  check_fp8(mixed_step_case(fp8_case), testing::Message() << "MIXED");
  check_fp8(draft_extend_case(fp8_case), testing::Message() << "DRAFT_EXTEND");
}

TEST_P(CudaFp8PrefillTest, SmallStepForTheSanitizers) {
  check_fp8(small_step_case(fp8_case));
}

TEST_P(CudaFp8PrefillTest, RingWrapForTheSanitizers) {
  check_fp8(ring_wrap_case(fp8_case));
}

TEST_P(CudaFp8PrefillTest, MoreWorkItemsThanSms) {
  check_fp8(many_units_case(fp8_case));
}

TEST_P(CudaFp8PrefillTest, OffTheOptionTheMmaSyncCtaRunsTheSameCases) {
  // The same pool without the option and with ATTNRT_PREFILL_KV8=0: the fp8 KV path of before
  // (mma.sync, K / V dequantised to 16 bits), held to the 16-bit tolerance; a check that the case
  // builder's fp8 pools are right.
  const test::ScopedPrefillKv8 off(false);
  PrefillCase c = fp8_case({0, 17, 301}, {300, 45, 200}, 21);
  c.fp8_prefill = false;
  check_prefill(c);
}

INSTANTIATE_TEST_SUITE_P(Fp8Ctas, CudaFp8PrefillTest,
                         ::testing::Values(Fp8Cta::one_warpgroup, Fp8Cta::warp_specialised,
                                           Fp8Cta::warp_specialised_cp_async),
                         [](const ::testing::TestParamInfo<Fp8Cta>& info) -> std::string {
                           switch (info.param) {
                             case Fp8Cta::one_warpgroup:
                               return "OneWarpgroup";
                             case Fp8Cta::warp_specialised:
                               return "WarpSpecialised";
                             default:
                               return "WarpSpecialisedCpAsync";
                           }
                         });

#endif

}  // namespace
}  // namespace attnrt
