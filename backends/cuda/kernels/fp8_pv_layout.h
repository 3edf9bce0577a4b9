// How the fp8 prefill CTA (prefill_fp8.cuh) feeds the probabilities P to O += P V on the tensor
// cores without moving registers between threads. Plain C++ (constexpr), so the CPU tests check
// the same functions the kernel runs.
//
// The fp32 accumulator of S = Q K^T (wgmma m64nN, per warp 16 rows, lane l: q = l % 4, rows
// r = l / 4 and r + 8) holds, in register 4j + e, row r + 8 * (e >> 1) and column
// 8j + 2q + (e & 1). The 8-bit A operand of wgmma m64nNk32 (PTX ISA, "register fragment, matrix
// A, .e4m3 / .e5m2") holds in register a (byte b) row r + 8 * (a & 1) and k position
// 16 * (a >> 1) + 4q + b. The rows agree; the columns do not: the accumulator's thread holds
// columns {2q, 2q + 1, 8 + 2q, 9 + 2q} of each 16, the A fragment's wants k {4q .. 4q + 3}.
// Instead of exchanging registers, the kernel packs each thread's own values (pv_fragment_index)
// and lets k position p of every 32-key step stand for key pv_key(p): the transposed V tile it
// builds in shared memory holds key pv_key(p)'s row at position p. The sum over keys does not
// depend on their order, so O is unchanged.
#pragma once

#include <cstdint>

namespace attnrt::cuda {

// The accumulator register (0 .. 15 within one 32-key step) that byte b of A register a takes.
constexpr int pv_fragment_index(int a, int b) {
  return (a >> 1) * 8 + (a & 1) * 2 + (b >> 1) * 4 + (b & 1);
}

// The key (within the tile) whose V row sits at k position p of the transposed V tile: in each
// group of 32, p = 16h + 4q + i holds key 16h + 8 * (i >> 1) + 2q + (i & 1).
constexpr int pv_key(int p) {
  const int i = p & 3, q = (p >> 2) & 3;
  return (p & ~15) + 8 * (i >> 1) + 2 * q + (i & 1);
}

// The shared-memory tiles of the V transpose (64 keys x 128 head-dim bytes):
//  - the staged tile as the copies land: key rows of 128 bytes, the 16-byte chunk c of row `key`
//    at c ^ (key % 8) (the 128-byte swizzle of wgmma.cuh);
//  - the transposed tile the P V MMAs read (K-major B operand, 64-byte swizzle): head-dim rows of
//    64 bytes (64 key positions), the 16-byte chunk c of row d at c ^ ((d / 2) % 4).
constexpr int v_stage_offset(int key, int byte) {
  return key * 128 + ((((byte >> 4) ^ key) & 7) << 4) + (byte & 15);
}
constexpr int vt_offset(int d, int p) {
  return d * 64 + ((((p >> 4) ^ (d >> 1)) & 3) << 4) + (p & 15);
}

// A tile of more keys (the warp-specialised CTA's 128) is transposed as tiles of 64 keys,
// kFp8VtBytes apart; k32 step k of O += P V over it reads the descriptor starting at
// vt_k32_offset(k): position 32 (k % 2) of row 0 of tile k / 2.
inline constexpr int kFp8VtBytes = 64 * 128;
constexpr int vt_k32_offset(int k) { return (k >> 1) * kFp8VtBytes + (k & 1) * 32; }

// The Q tiles (128 rows): the 16-bit rows as copied (wgmma.cuh's swz128_offset: 16-byte chunk c,
// elements 8c .. 8c + 7, of row r in column block c / 8 of `rows` rows) and the e4m3 tile the S
// MMAs read (128-byte rows, 128-byte swizzle; the 8 bytes of elements 8c .. 8c + 7 of row r).
constexpr int q16_offset(int rows, int r, int c) {
  return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}
constexpr int q8_offset(int r, int c) {
  return r * 128 + ((((c >> 1) ^ r) & 7) << 4) + (c & 1) * 8;
}

// The warp-specialised CTA's in-place Q conversion: consumer thread ct (0 .. 255, the index the
// kernel's consumers run on; consumer ct / 128 owns rows 64 (ct / 128) .. 64 (ct / 128) + 63)
// converts in pass n (of q_convert_passes(D)) the 16-bit chunk c of row r, the 128 threads of a
// consumer taking consecutive chunks of its 64 rows x D / 8; its warp (ct / 32) % 4 of the
// consumer writes that consumer's row maximum slot q_amax_slot. D: the head dim (64, 128, 256).
struct QChunk {
  int r, c;
};
constexpr int q_convert_passes(int d) { return 64 * (d / 8) / 128; }
inline constexpr int kQConvertPasses = q_convert_passes(128);
template <int D = 128>
constexpr QChunk q_convert_chunk(int ct, int n) {
  constexpr int kChunks = D / 8;
  const int i = (ct & 127) + 128 * n;
  return {64 * (ct >> 7) + i / kChunks, i % kChunks};
}
constexpr int q_amax_slot(int ct) { return (ct >> 5) & 3; }

// The warp-specialised CTA over fp8 pages (prefill_ws_kv8.cuh) converts each staged e4m3 / e5m2
// tile of `keys` rows (CH8 = D / 16 16-byte chunks a row at head dim D, as ws_copy_tile lands them:
// chunk c of row key at swz128_offset(keys, key, c), i.e. 128-byte rows in column blocks of 8
// chunks, the rows of a 64-wide head half filled) into the 16-bit tile the consumers' MMAs read
// (D / 64 column blocks of 128-byte rows: q16_offset, the layout of wgmma.cuh's swz128_offset):
// producer thread tid (of 128) takes in pass n (of keys * CH8 / 128) the chunk c of row key, which
// becomes the 16-bit chunks 2c and 2c + 1 of that row. The 8 lanes of each quarter warp take 8
// consecutive rows (every key % 8) at one chunk, so neither the 16-byte loads (chunk c ^ key % 8)
// nor the 16-byte stores (2c ^ key % 8, then 2c + 1 ^ key % 8) meet a bank conflict.
struct Kv8Chunk {
  int key, c;
};
constexpr int kv8_log2(int x) { return x <= 1 ? 0 : 1 + kv8_log2(x / 2); }
template <int CH8 = 8>
constexpr Kv8Chunk kv8_chunk(int tid, int n) {
  static_assert(CH8 >= 4 && (CH8 & (CH8 - 1)) == 0, "head dims 64, 128, 256, ...");
  const int i = tid + 128 * n;
  return {(i & 7) | ((i >> (3 + kv8_log2(CH8))) << 3), (i >> 3) & (CH8 - 1)};
}
// Bytes of one staged fp8 K or V tile of `keys` rows at head dim d (128-byte rows, column blocks
// of 128 bytes: a 64-wide row fills half of one).
constexpr int kv8_staged_tile_bytes(int keys, int d) { return keys * 128 * ((d + 127) / 128); }

// The 4 x 4 byte block of the transposed tile that thread `tid` (of 128) writes in pass n (of 4):
// head-dim rows 4 dq .. 4 dq + 3, key positions 4 pq .. 4 pq + 3. Lanes take pq's low 2 bits,
// dq's low 2 bits, then pq's bit 2; warps and passes the rest, so that the 32-bit loads from the
// staged tile and the stores into the transposed one each meet at most two-way bank conflicts.
struct VtBlock {
  int dq, pq;
};
constexpr VtBlock vt_block(int tid, int n) {
  const int lane = tid & 31, warp = tid >> 5;
  return {((lane >> 2) & 3) | (((warp << 1) | (n & 1)) << 2),
          (lane & 3) | ((lane >> 4) << 2) | ((n >> 1) << 3)};
}

// __byte_perm(x, y, s) on the host: byte k of the result is byte (s >> 4k) & 7 of y:x.
constexpr uint32_t byte_perm_host(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t xy = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k)
    r |= static_cast<uint32_t>((xy >> (8 * ((s >> (4 * k)) & 7))) & 0xff) << (8 * k);
  return r;
}

// The 4 x 4 byte transpose of the V transpose: in[i] holds bytes (key i, columns 0 .. 3); out[c]
// gets bytes (column c, keys 0 .. 3). PERM is __byte_perm on the device, byte_perm_host here.
template <typename Perm>
constexpr void transpose4x4_bytes(const uint32_t (&in)[4], uint32_t (&out)[4], Perm perm) {
  const uint32_t t0 = perm(in[0], in[1], 0x5140u);  // a0 b0 a1 b1
  const uint32_t t1 = perm(in[0], in[1], 0x7362u);  // a2 b2 a3 b3
  const uint32_t t2 = perm(in[2], in[3], 0x5140u);  // c0 d0 c1 d1
  const uint32_t t3 = perm(in[2], in[3], 0x7362u);  // c2 d2 c3 d3
  out[0] = perm(t0, t2, 0x5410u);
  out[1] = perm(t0, t2, 0x7632u);
  out[2] = perm(t1, t3, 0x5410u);
  out[3] = perm(t1, t3, 0x7632u);
}

}  // namespace attnrt::cuda
