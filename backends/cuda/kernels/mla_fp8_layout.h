// Where the paired-tile MLA CTA (mla_pairs.cu) puts an fp8 latent tile's raw rows, and how it
// converts them in place into the bf16 tile its MMAs read (mla_tile.cuh: MlaTileCopier's fp8
// copy_blocks, mla_convert_in_place). Plain C++ (constexpr), so the CPU tests check the same
// functions the kernel runs.
//
// The bf16 tile: 64 keys (rows) x 576 columns as nine blocks of 64 columns, block k at
// k * 64 * 128 bytes; row `row` of a block is 128 bytes, its 16-byte chunk c (columns 8c .. 8c + 7
// of the block) at chunk c ^ (row % 8) (wgmma.cuh's 128-byte swizzle). The raw row of a key is
// 576 fp8 bytes; its 16-byte chunk ch of block k (columns 16 ch .. 16 ch + 15 of the block) turns
// into the bf16 chunks 2 ch and 2 ch + 1 of the same row. Blocks go in pairs (0, 1), (2, 3),
// (4, 5), (6, 7) and block 8 alone; a pair's eight raw chunks of a row land in the even block's
// row in their global order (chunk x = 4 (k & 1) + ch at x ^ (row % 8), the swizzle of the bf16
// copies), block 8's four at chunks 0 .. 3. So the eight threads that copy a row's 128 contiguous
// raw bytes write one 128-byte row, and the two threads of each 32-byte global sector a 32-byte
// pair of it, as the bf16 copies do: two earlier layouts that put a sector's two chunks 32 bytes
// apart wrote one shared-memory wavefront a thread (32 an LDGSTS against 8; 4.5x and 7.8x the
// ideal; Nsight Compute, H100); this one 1.52x, and mla-decode-h128-64x4096-fp8 runs 1.21x
// faster than with the layout before it (H200). A conversion's eight threads of a row (one
// quarter warp) read the row's raw chunks, meet at a __syncwarp, then write the bf16 chunks
// (mla_convert_in_place).
#pragma once

#include <cstdint>

namespace attnrt::cuda {

inline constexpr int kMlaFp8LayoutKeys = 64;  // keys (rows) of a tile

// The byte offset in the bf16 tile of chunk c (0 .. 7) of row `row` of column block k.
constexpr uint32_t mla_bf16_chunk(int k, int row, int c) {
  return static_cast<uint32_t>(k * kMlaFp8LayoutKeys * 128 + row * 128 + ((c ^ (row & 7)) << 4));
}

// Where raw chunk ch (0 .. 3) of row `row` of column block k lands.
constexpr uint32_t mla_raw_chunk(int k, int row, int ch) {
  return mla_bf16_chunk(k & ~1, row, 4 * (k & 1) + ch);
}

// A copying thread's base offset: eight threads a row (row ld_row, thread ld_c), each copying raw
// chunk ld_c % 4 of the blocks 2 i + ld_c / 4 of its rows (rows 8 apart share the offset; the
// row's and the even block's constants are added per copy): mla_raw_chunk(B0 + 2 i + ld_c / 4,
// ld_row + 16 r, ld_c % 4) = this + 16 r * 128 + (B0 + 2 i) * 64 * 128 for an even B0 (the
// offset of the bf16 copies).
constexpr uint32_t mla_raw_in_place(int ld_row, int ld_c) {
  return mla_raw_chunk(ld_c >> 2, ld_row, ld_c & 3);
}

// The conversion (128 threads of a warpgroup, wt = 0 .. 127; x = wt % 8, R = wt / 8): in a pair of
// blocks, thread wt takes raw chunk x of rows R + 16 r (r < 4), which fills bf16 chunks
// 2 (x % 4) and 2 (x % 4) + 1 of block k + x / 4; it writes the odd one of the two first where
// x >= 4, so each of a quarter warp's two stores falls on eight bank groups. Block 8 alone: raw
// chunk x % 4 of rows R + 32 r (x < 4) or (R ^ 4) + 32 r + 16 (x >= 4), r < 2 (rows 4 apart in a
// quarter warp: their raw chunks on the two halves of the banks). The row of item r:
constexpr int mla_convert_row(int wt, int r, bool single) {
  const int x = wt & 7, R = wt >> 3;
  return !single ? R + 16 * r : x < 4 ? R + 32 * r : (R ^ 4) + 32 * r + 16;
}
// The offset of its raw chunk (block 0's row: the even block's constant is added per pair).
constexpr uint32_t mla_convert_src(int wt, int r, bool single) {
  const int row = mla_convert_row(wt, r, single), x = wt & 7;
  return mla_bf16_chunk(0, row, single ? x & 3 : x);
}
// The offset of its first bf16 store (the even chunk where x < 4, the odd one where x >= 4); the
// second is at this ^ 16. In a pair, x >= 4 adds the odd block (64 * 128).
constexpr uint32_t mla_convert_dst(int wt, int r, bool single) {
  const int row = mla_convert_row(wt, r, single), x = wt & 7;
  return mla_bf16_chunk(!single && x >= 4 ? 1 : 0, row, 2 * (x & 3) + (x >> 2));
}

}  // namespace attnrt::cuda
