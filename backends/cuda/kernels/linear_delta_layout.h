// Where the chunked delta rule (linear_delta_chunked.cuh) keeps each operand of its state pass:
// the workspace unit of one (chunk, value head) that the prep kernels write and the pass copies
// into a shared-memory stage as it is, and the pass's own thread mappings. Plain C++ (constexpr),
// so the CPU tests check the same functions the kernels run.
//
// The 16-bit operands W, Qd [64][Dk], KlT [Dk][64] and Mqk [64][64] are stored already in the
// 128-byte swizzled layout of wgmma.cuh (swz128_offset): a [rows][cols] array is cols / 64 column
// blocks of [rows][64] (128-byte rows), and inside each 1024-byte group of 8 rows the 16-byte
// piece p (elements 8p .. 8p + 7) of row r sits at p ^ (r % 8). Every array starts on a multiple
// of 1024 bytes of the unit, and a stage on a multiple of 1024 bytes of shared memory, so one
// linear bulk copy per array lands it in exactly the layout the wgmma descriptors read (the
// hardware applies the swizzle to the shared-memory address bits). All four are K-major B
// operands of the pass's MMAs (rows = N, the reduction index contiguous).
//
// U is fp32 and stored transposed, U^T [Dv][64], with the 32-byte pieces (8 tokens) of row v at
// piece ^ (v % 8): the pass reads it in the layout of its u^T accumulator (row v, tokens 2q, 2q + 1
// of each 8) as float2 loads without bank conflicts. el [Dk] fp32 is plain.
#pragma once

#include <cstdint>

namespace attnrt::cuda::linear::delta {

inline constexpr int kChunk = 64;  // tokens per chunk (the only chunk size supported)

// Byte offsets of the arrays inside a unit and its size.
struct UnitLayout {
  int64_t w, qd, klt, m, u, el, bytes;
};
constexpr int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
constexpr UnitLayout unit_layout(int dk, int dv) {
  UnitLayout u{};
  u.w = 0;
  u.qd = u.w + int64_t{kChunk} * dk * 2;
  u.klt = u.qd + int64_t{kChunk} * dk * 2;
  u.m = u.klt + int64_t{dk} * kChunk * 2;
  u.u = u.m + int64_t{kChunk} * kChunk * 2;
  u.el = u.u + int64_t{dv} * kChunk * 4;
  u.bytes = round_up(u.el + int64_t{dk} * 4, 128);
  return u;
}

// Element (row, col) of a [rows][cols] 16-bit array in the 128-byte swizzled layout (elements
// from the array's start; rows a multiple of 8, cols of 64).
constexpr int swz128_elem(int rows, int row, int col) {
  return (col >> 6) * rows * 64 + row * 64 + ((((col >> 3) ^ row) & 7) << 3) + (col & 7);
}
// W and Qd: token t, channel c.
constexpr int wq_elem(int t, int c) { return swz128_elem(kChunk, t, c); }
// KlT: channel c, token t.
constexpr int klt_elem(int dk, int c, int t) { return swz128_elem(dk, c, t); }
// Mqk: token t, token i (<= t).
constexpr int mqk_elem(int t, int i) { return swz128_elem(kChunk, t, i); }
// U^T: value row v, token t (fp32 elements).
constexpr int ut_elem(int v, int t) { return v * kChunk + ((((t >> 3) ^ v) & 7) << 3) + (t & 7); }

// The byte offset from a K-major swizzled operand of `rows` rows (N) at which the descriptor of
// its k-step kk (16 elements of the reduction index) starts: column block kk / 4, 32 bytes per
// k-step inside the 128-byte row.
constexpr int kmajor_step_offset(int rows, int kk) {
  return (kk >> 2) * rows * 128 + (kk & 3) * 32;
}

// The fp32 accumulator of a wgmma m64nN (per warp w of the warpgroup 16 rows, lane l): register
// j holds row 16 w + l / 4 + 8 * ((j >> 1) & 1), column 8 (j / 4) + 2 (l % 4) + (j & 1).
constexpr int acc_row_of(int warp, int lane, int j) {
  return 16 * warp + (lane >> 2) + 8 * ((j >> 1) & 1);
}
constexpr int acc_col_of(int lane, int j) { return 8 * (j >> 2) + 2 * (lane & 3) + (j & 1); }
// The register A operand of a wgmma m64nNk16 (16-bit, four 32-bit registers per thread) packed
// from such an accumulator, its columns taken as the reduction index: value e (0 low, 1 high
// half) of register r of k-step k16 is accumulator register a_from_acc(k16, r, e).
constexpr int a_from_acc(int k16, int r, int e) { return 8 * k16 + 2 * r + e; }

// A warp's output staging tile of the pass: 64 tokens x its 16 value rows in fp32, 16 floats per
// token row; the rows of each pair are swapped by bit 1 of t and the 8-float halves of a row by
// bit 2 of t, so that both the accumulator's scattered writes (acc_row_of / acc_col_of) and the
// float4 reads of 4 consecutive value rows of one token hit 32 different banks.
inline constexpr int kOutStageFloats = kChunk * 16;
constexpr int out_stage_elem(int t, int vl) {
  return (t ^ ((t >> 1) & 1)) * 16 + (vl ^ (((t >> 2) & 1) << 3));
}

}  // namespace attnrt::cuda::linear::delta
