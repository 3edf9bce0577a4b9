// The workspace unit and thread mappings of the chunked delta rule's state pass
// (backends/cuda/kernels/linear_delta_layout.h), on the host: the prep kernels write each operand
// element at the index the header gives, a stage receives the unit's bytes as they are, and the
// pass's wgmma reads the 16-bit operands through K-major descriptors with the 128-byte swizzle.
// Checked here: every element has its own place inside its array and the arrays do not overlap,
// the pieces the prep kernels store at once are contiguous, the header's swizzle is wgmma.cuh's,
// a descriptor's view of each array (modelled from the PTX ISA, independently of the header) reads
// back the element the prep kernels wrote, the four products of one chunk computed through those
// views, the accumulator layout and the register A operand equal the plain products, and the
// pass's shared-memory accesses to U^T and its output staging tile are free of bank conflicts.
// The GPU tests (test_cuda_linear_chunked.cpp) run the kernels themselves.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "backends/cuda/kernels/fp8_pv_layout.h"
#include "backends/cuda/kernels/linear_delta_layout.h"

namespace attnrt {
namespace {

namespace dl = cuda::linear::delta;
constexpr int C = dl::kChunk;

// The four 16-bit operands of a unit: rows (wgmma's N) x cols (the reduction index K), byte
// offset in the unit, and the header's element index.
struct Operand16 {
  const char* name;
  int64_t base;
  int rows, cols;
  int (*elem)(int dk, int row, int col);
};
std::vector<Operand16> operands(int dk) {
  const dl::UnitLayout u = dl::unit_layout(dk, dk);
  return {
      {"W", u.w, C, dk, [](int, int t, int c) { return dl::wq_elem(t, c); }},
      {"Qd", u.qd, C, dk, [](int, int t, int c) { return dl::wq_elem(t, c); }},
      {"KlT", u.klt, dk, C, [](int d, int c, int t) { return dl::klt_elem(d, c, t); }},
      {"Mqk", u.m, C, C, [](int, int t, int i) { return dl::mqk_elem(t, i); }},
  };
}

// PTX ISA, "Matrix Descriptor" / "Shared Memory Matrix Layout": the K-major B operand of a k16
// step with the 128-byte swizzle, descriptor start `start` and 1024 bytes between groups of 8 N
// rows, reads element (k, n) at byte start + 1024 (n / 8) + 128 (n % 8) + 2k with address bits
// 4..6 exclusive-ored with bits 7..9 (the tile 1024-byte aligned).
int kmajor_b_address(int64_t start, int k, int n) {
  const int a = static_cast<int>(start) + 1024 * (n / 8) + 128 * (n % 8) + 2 * k;
  return a ^ (((a >> 7) & 7) << 4);
}

// PTX ISA, "Register Fragments and Shared Memory Matrix Layouts" of wgmma, per warp of the
// warpgroup (16 rows) and lane (g = lane / 4, q = lane % 4):
//  - fp32 accumulator m64nN: register j holds row g + 8 ((j / 2) % 2), column
//    8 (j / 4) + 2q + j % 2;
//  - 16-bit A m64k16: half e of register r holds row g + 8 (r % 2), column 8 (r / 2) + 2q + e.
struct Cell {
  int row, col;
};
Cell ptx_acc_cell(int warp, int lane, int j) {
  return {16 * warp + lane / 4 + 8 * ((j / 2) % 2), 8 * (j / 4) + 2 * (lane % 4) + j % 2};
}
Cell ptx_a_cell(int warp, int lane, int r, int e) {
  return {16 * warp + lane / 4 + 8 * (r % 2), 8 * (r / 2) + 2 * (lane % 4) + e};
}

// Distinct 4-byte words per bank in one shared-memory access of a warp, `bytes` per lane (4, 8 or
// 16), summed over the phases the hardware splits it into (32, 16 or 8 lanes each): 32 / 16 / 8
// lanes reading 4 / 8 / 16 bytes take one wavefront per phase when conflict free.
int wavefronts(const std::vector<int>& byte_offsets, int bytes) {
  const int per_phase = 128 / bytes;
  int total = 0;
  for (size_t p0 = 0; p0 < byte_offsets.size(); p0 += per_phase) {
    std::vector<std::set<int>> banks(32);
    for (size_t l = p0; l < p0 + per_phase && l < byte_offsets.size(); ++l)
      for (int w = 0; w < bytes / 4; ++w) {
        const int word = byte_offsets[l] / 4 + w;
        banks[word % 32].insert(word);
      }
    size_t worst = 0;
    for (const auto& b : banks) worst = std::max(worst, b.size());
    total += static_cast<int>(worst);
  }
  return total;
}

TEST(DeltaPassLayout, UnitArraysAreAlignedDisjointAndInsideTheUnit) {
  for (int d : {64, 128}) {
    const dl::UnitLayout u = dl::unit_layout(d, d);
    struct Span {
      const char* name;
      int64_t begin, bytes;
    };
    const std::vector<Span> spans = {{"W", u.w, C * d * 2},     {"Qd", u.qd, C * d * 2},
                                     {"KlT", u.klt, d * C * 2}, {"Mqk", u.m, C * C * 2},
                                     {"U^T", u.u, d * C * 4},   {"el", u.el, d * 4}};
    for (size_t i = 0; i < spans.size(); ++i) {
      const Span& s = spans[i];
      SCOPED_TRACE(::testing::Message() << "d " << d << " " << s.name);
      // The swizzled operands on 1024 bytes (the descriptors' swizzle is a function of the
      // address), every bulk copy on 16 bytes and of a multiple of 16.
      if (i < 4) {
        EXPECT_EQ(s.begin % 1024, 0);
      }
      EXPECT_EQ(s.begin % 16, 0);
      EXPECT_EQ(s.bytes % 16, 0);
      EXPECT_LE(s.begin + s.bytes, u.bytes);
      if (i > 0) {
        EXPECT_GE(s.begin, spans[i - 1].begin + spans[i - 1].bytes);
      }
    }
    EXPECT_EQ(u.bytes % 128, 0) << "units stay 128-byte aligned in the workspace";
  }
}

TEST(DeltaPassLayout, EveryElementHasItsOwnPlaceInItsArray) {
  for (int d : {64, 128}) {
    for (const Operand16& op : operands(d)) {
      std::vector<int> hits(op.rows * op.cols, 0);
      for (int r = 0; r < op.rows; ++r)
        for (int c = 0; c < op.cols; ++c) {
          const int e = op.elem(d, r, c);
          ASSERT_GE(e, 0) << op.name << " d " << d;
          ASSERT_LT(e, op.rows * op.cols) << op.name << " d " << d;
          ++hits[e];
        }
      for (size_t e = 0; e < hits.size(); ++e) ASSERT_EQ(hits[e], 1) << op.name << " element " << e;
    }
    std::vector<int> hits(d * C, 0);
    for (int v = 0; v < d; ++v)
      for (int t = 0; t < C; ++t) {
        const int e = dl::ut_elem(v, t);
        ASSERT_GE(e, 0);
        ASSERT_LT(e, d * C);
        ++hits[e];
      }
    for (size_t e = 0; e < hits.size(); ++e) ASSERT_EQ(hits[e], 1) << "U^T element " << e;
  }
  std::vector<int> hits(dl::kOutStageFloats, 0);
  for (int t = 0; t < C; ++t)
    for (int vl = 0; vl < 16; ++vl) ++hits.at(dl::out_stage_elem(t, vl));
  for (int h : hits) ASSERT_EQ(h, 1) << "output staging tile";
}

TEST(DeltaPassLayout, PiecesThatAreStoredAtOnceStayContiguous) {
  // 16-bit operands: 8 elements of a row from a multiple of 8 (GDN's 16-byte stores of Qd and
  // KlT; the bf16 pairs of every other store are inside them). U^T: 8 tokens of a row from a
  // multiple of 8 (KDA's float4 stores, the pass's float2 loads). Staging: 4 value rows of a
  // token from a multiple of 4 (the pass's float4 loads).
  for (int d : {64, 128}) {
    for (const Operand16& op : operands(d))
      for (int r = 0; r < op.rows; ++r)
        for (int c0 = 0; c0 < op.cols; c0 += 8) {
          const int e0 = op.elem(d, r, c0);
          ASSERT_EQ(e0 % 8, 0) << op.name << " row " << r << " col " << c0;
          for (int i = 1; i < 8; ++i) ASSERT_EQ(op.elem(d, r, c0 + i), e0 + i) << op.name;
        }
    for (int v = 0; v < d; ++v)
      for (int t0 = 0; t0 < C; t0 += 8) {
        const int e0 = dl::ut_elem(v, t0);
        ASSERT_EQ(e0 % 8, 0) << "U^T row " << v << " token " << t0;
        for (int i = 1; i < 8; ++i) ASSERT_EQ(dl::ut_elem(v, t0 + i), e0 + i);
      }
  }
  for (int t = 0; t < C; ++t)
    for (int v0 = 0; v0 < 16; v0 += 4) {
      const int e0 = dl::out_stage_elem(t, v0);
      ASSERT_EQ(e0 % 4, 0);
      for (int i = 1; i < 4; ++i) ASSERT_EQ(dl::out_stage_elem(t, v0 + i), e0 + i);
    }
}

TEST(DeltaPassLayout, SwizzleIsTheOneOfWgmmaCuh) {
  // q16_offset is wgmma.cuh's swz128_offset (16-byte chunk c of row r) on the host.
  for (int rows : {64, 128})
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < 128; ++c)
        ASSERT_EQ(2 * dl::swz128_elem(rows, r, c), cuda::q16_offset(rows, r, c / 8) + 2 * (c % 8))
            << "rows " << rows << " row " << r << " col " << c;
}

TEST(DeltaPassLayout, DescriptorsReadWhatPrepWrote) {
  // For every k16 step of every operand, element (k, n) of the step as the MMA reads it from the
  // stage (descriptor start: the array's offset plus kmajor_step_offset) is the element
  // (row n, column 16 kk + k) that prep wrote at base + 2 elem(n, 16 kk + k).
  for (int d : {64, 128}) {
    for (const Operand16& op : operands(d)) {
      ASSERT_EQ(op.rows % 8, 0);
      for (int kk = 0; kk < op.cols / 16; ++kk) {
        const int64_t start = op.base + dl::kmajor_step_offset(op.rows, kk);
        for (int n = 0; n < op.rows; ++n)
          for (int k = 0; k < 16; ++k)
            ASSERT_EQ(kmajor_b_address(start, k, n), op.base + 2 * op.elem(d, n, 16 * kk + k))
                << op.name << " d " << d << " step " << kk << " n " << n << " k " << k;
      }
    }
  }
}

TEST(DeltaPassLayout, AccumulatorAndRegisterOperandFollowThePtxLayout) {
  for (int warp = 0; warp < 4; ++warp)
    for (int lane = 0; lane < 32; ++lane) {
      for (int j = 0; j < 64; ++j) {
        const Cell c = ptx_acc_cell(warp, lane, j);
        ASSERT_EQ(dl::acc_row_of(warp, lane, j), c.row) << "lane " << lane << " reg " << j;
        ASSERT_EQ(dl::acc_col_of(lane, j), c.col) << "lane " << lane << " reg " << j;
      }
      // The pass feeds an accumulator's columns as the reduction index of the next MMA: the
      // value packed into the A operand must sit in the same row and column.
      for (int k16 = 0; k16 < 8; ++k16)
        for (int r = 0; r < 4; ++r)
          for (int e = 0; e < 2; ++e) {
            const Cell from = ptx_acc_cell(warp, lane, dl::a_from_acc(k16, r, e));
            const Cell to = ptx_a_cell(warp, lane, r, e);
            ASSERT_EQ(from.row, to.row) << "k16 " << k16 << " r " << r << " e " << e;
            ASSERT_EQ(from.col, 16 * k16 + to.col) << "k16 " << k16 << " r " << r << " e " << e;
          }
    }
}

// One chunk of the pass for one consumer warpgroup (64 value rows) on small integers, every
// 16-bit operand written into a unit image by the header's indices (as prep writes it) and read
// back through the descriptor model, A operands packed from the accumulators as the pass packs
// them: u^T = S W^T, o^T = S Qd^T + u^T Mqk^T, S' = S + u^T Kl, against the plain products.
void check_chunk_products(int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> small(-3, 3);
  const dl::UnitLayout u = dl::unit_layout(d, d);
  std::vector<int> S(64 * d), W(C * d), Qd(C * d), Kl(C * d), M(C * C), Ut(64 * C);
  for (auto* v : {&S, &W, &Qd, &Kl, &M, &Ut})
    for (int& x : *v) x = small(rng);
  std::vector<int16_t> unit(u.bytes / 2, 0);
  auto put = [&](int64_t base, int elem, int value) { unit[(base + 2 * elem) / 2] = value; };
  for (int t = 0; t < C; ++t)
    for (int c = 0; c < d; ++c) {
      put(u.w, dl::wq_elem(t, c), W[t * d + c]);
      put(u.qd, dl::wq_elem(t, c), Qd[t * d + c]);
      put(u.klt, dl::klt_elem(d, c, t), Kl[t * d + c]);
    }
  for (int t = 0; t < C; ++t)
    for (int i = 0; i < C; ++i) put(u.m, dl::mqk_elem(t, i), M[t * C + i]);

  // D[64 x N] += A[64 x K] B[K x N] as the warpgroup runs it: A from each thread's accumulator
  // `acc` (its registers, ptx_acc_cell) packed by a_from_acc, B through the descriptors of the
  // K-major operand at `base` (N rows).
  using Acc = std::vector<std::vector<long>>;  // [thread][register]
  auto mma = [&](Acc& dst, const Acc& a, int64_t base, int n_rows, int k_cols) {
    // Which thread and register of D hold (row, column).
    std::vector<std::pair<int, int>> holder(64 * n_rows, {-1, -1});
    for (int th = 0; th < 128; ++th)
      for (int j = 0; j < n_rows / 2; ++j) {
        const Cell dc = ptx_acc_cell(th / 32, th % 32, j);
        holder[dc.row * n_rows + dc.col] = {th, j};
      }
    for (int warp = 0; warp < 4; ++warp)
      for (int lane = 0; lane < 32; ++lane) {
        const std::vector<long>& ar = a[32 * warp + lane];
        for (int k16 = 0; k16 < k_cols / 16; ++k16) {
          const int64_t start = base + dl::kmajor_step_offset(n_rows, k16);
          for (int r = 0; r < 4; ++r)
            for (int e = 0; e < 2; ++e) {
              const Cell at = ptx_a_cell(warp, lane, r, e);
              const long av = ar[dl::a_from_acc(k16, r, e)];
              for (int n = 0; n < n_rows; ++n) {
                const auto [th, j] = holder[at.row * n_rows + n];
                dst[th][j] += av * unit[kmajor_b_address(start, at.col, n) / 2];
              }
            }
        }
      }
  };
  auto load = [&](const std::vector<int>& m, int cols) {
    Acc a(128, std::vector<long>(cols / 2));
    for (int th = 0; th < 128; ++th)
      for (int j = 0; j < cols / 2; ++j) {
        const Cell c = ptx_acc_cell(th / 32, th % 32, j);
        a[th][j] = m[c.row * cols + c.col];
      }
    return a;
  };
  const Acc s = load(S, d);
  Acc ut(128, std::vector<long>(32, 0)), ot = ut;
  mma(ut, s, u.w, C, d);
  mma(ot, s, u.qd, C, d);
  // u^T = U^T - S W^T (the pass reads U^T at ut_elem: a permutation of its own array, checked
  // above, so the plain matrix stands in for it here).
  for (int th = 0; th < 128; ++th)
    for (int j = 0; j < 32; ++j) {
      const Cell c = ptx_acc_cell(th / 32, th % 32, j);
      ut[th][j] = Ut[c.row * C + c.col] - ut[th][j];
    }
  Acc s2 = s;
  mma(s2, ut, u.klt, d, C);
  mma(ot, ut, u.m, C, C);

  for (int v = 0; v < 64; ++v) {
    std::vector<long> uv(C);
    for (int t = 0; t < C; ++t) {
      long x = Ut[v * C + t];
      for (int c = 0; c < d; ++c) x -= long{S[v * d + c]} * W[t * d + c];
      uv[t] = x;
    }
    for (int th = 0; th < 128; ++th)
      for (int j = 0; j < 32; ++j) {
        const Cell c = ptx_acc_cell(th / 32, th % 32, j);
        if (c.row != v) continue;
        long o = 0;
        for (int k = 0; k < d; ++k) o += long{S[v * d + k]} * Qd[c.col * d + k];
        for (int i = 0; i < C; ++i) o += uv[i] * M[c.col * C + i];
        ASSERT_EQ(ut[th][j], uv[c.col]) << "u^T d " << d << " v " << v << " t " << c.col;
        ASSERT_EQ(ot[th][j], o) << "o^T d " << d << " v " << v << " t " << c.col;
      }
    for (int th = 0; th < 128; ++th)
      for (int j = 0; j < d / 2; ++j) {
        const Cell c = ptx_acc_cell(th / 32, th % 32, j);
        if (c.row != v) continue;
        long x = S[v * d + c.col];
        for (int t = 0; t < C; ++t) x += uv[t] * Kl[t * d + c.col];
        ASSERT_EQ(s2[th][j], x) << "S d " << d << " v " << v << " c " << c.col;
      }
  }
}

TEST(DeltaPassLayout, ChunkProductsThroughTheUnitEqualThePlainProducts) {
  check_chunk_products(64, 7);
  check_chunk_products(128, 8);
}

TEST(DeltaPassLayout, PassSharedMemoryAccessesAreConflictFree) {
  // U^T: per accumulator register pair of u^T, each lane's float2 at (its row, its token pair),
  // for every warp of both consumer warpgroups; the pair must be adjacent.
  for (int vw = 0; vw < 128; vw += 16)
    for (int j = 0; j < 32; j += 2) {
      std::vector<int> offs;
      for (int lane = 0; lane < 32; ++lane) {
        const int v = vw + dl::acc_row_of(0, lane, j), t = dl::acc_col_of(lane, j);
        ASSERT_EQ(dl::ut_elem(v, t + 1), dl::ut_elem(v, t) + 1);
        offs.push_back(4 * dl::ut_elem(v, t));
      }
      EXPECT_EQ(wavefronts(offs, 8), 2) << "U^T loads, rows from " << vw << ", register " << j;
    }
  // The output staging tile: the accumulator's scattered 4-byte writes, then float4 reads of 4
  // value rows of one token (lane: token 8 it + lane / 4, rows 4 (lane % 4) ..).
  for (int j = 0; j < 32; ++j) {
    std::vector<int> offs;
    for (int lane = 0; lane < 32; ++lane)
      offs.push_back(4 * dl::out_stage_elem(dl::acc_col_of(lane, j), dl::acc_row_of(0, lane, j)));
    EXPECT_EQ(wavefronts(offs, 4), 1) << "staging writes, register " << j;
  }
  for (int it = 0; it < C / 8; ++it) {
    std::vector<int> offs;
    for (int lane = 0; lane < 32; ++lane)
      offs.push_back(4 * dl::out_stage_elem(8 * it + lane / 4, 4 * (lane % 4)));
    EXPECT_EQ(wavefronts(offs, 16), 4) << "staging reads, tokens from " << 8 * it;
  }
}

}  // namespace
}  // namespace attnrt
