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
// (4, 5), (6, 7) and block 8 alone: both raw chunks ch of a pair land in the even block's row, at
// its bf16 chunks 2 ch (block k) and 2 ch + 1 (block k + 1); block 8's at chunk 2 ch. A conversion
// then reads the two chunks it writes first and writes the odd block's two after, so no thread
// writes where another reads, and the eight threads that copy a row's 128 contiguous raw bytes (a
// quarter warp: chunks 0 .. 3 of two adjacent blocks) write the eight chunks of one 128-byte row.
// LDGSTS still take a shared-memory wavefront a thread here (7.76x the ideal, Nsight Compute,
// H100; the form before, block k + 1's chunks in its own row, 4.50x on its own ideal), where the
// bf16 copies are at 1.00x: the two threads of a 32-byte global sector write chunks 32 bytes
// apart (2 ch, 2 ch + 2), not a 32-byte pair (patches/mla-fp8-sector-pairs.patch changes that).
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
  return mla_bf16_chunk(k & ~1, row, 2 * ch + (k & 1));
}

// A copying thread's base offset: eight threads a row (row ld_row, thread ld_c), each copying raw
// chunk ld_c % 4 of the blocks 2 i + ld_c / 4 of its rows (rows 8 apart share the offset; the
// row's and the even block's constants are added per copy): mla_raw_chunk(B0 + 2 i + ld_c / 4,
// ld_row + 16 r, ld_c % 4) = this + 16 r * 128 + (B0 + 2 i) * 64 * 128 for an even B0.
constexpr uint32_t mla_raw_in_place(int ld_row, int ld_c) {
  return mla_raw_chunk(ld_c >> 2, ld_row, ld_c & 3);
}

// A converting thread wt (0 .. 127 of a warpgroup) takes raw chunk wt % 4 of rows wt / 4 and
// 32 + wt / 4 of every block: the offset of its bf16 chunk 2 ch in block 0, row wt / 4 (row + 32
// adds 32 * 128, block k adds k * 64 * 128). Chunk 2 ch + 1 is at this ^ 16; in an even block k the
// two hold the raw chunks of blocks k and k + 1.
constexpr uint32_t mla_convert_lo(int wt) { return mla_bf16_chunk(0, wt >> 2, 2 * (wt & 3)); }

}  // namespace attnrt::cuda
