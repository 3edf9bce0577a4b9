// The chunked (WY / UT) form of the delta rule for extend steps, the launchers declared in
// linear.h (the algorithm: linear_delta_chunked.cuh): the chunk table and the state pass, around
// the prep kernels of linear_delta_prep.cu.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "backends/cuda/kernels/common/convert.cuh"
#include "backends/cuda/kernels/common/elem.cuh"
#include "backends/cuda/kernels/linear.h"
#include "backends/cuda/kernels/linear_delta_chunked.cuh"
#include "backends/cuda/kernels/linear_delta_layout.h"
#include "backends/cuda/kernels/prefill_ws_sync.cuh"
#include "backends/cuda/kernels/primitives.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace attnrt::cuda::linear {
namespace delta {
namespace {

constexpr int kTableThreads = 1024;

// ---- 1. chunk table ---------------------------------------------------------------------------

// coff[r] = first chunk slot of request r (coff[num_reqs] = all chunks), table[slot] = its
// request or -1.
__global__ void __launch_bounds__(kTableThreads) chunk_table_kernel(const LinReq* reqs, int n,
                                                                   int64_t bound, int32_t* coff,
                                                                   int32_t* table) {
  using Scan = cub::BlockScan<int, kTableThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int per = (n + kTableThreads - 1) / kTableThreads;
  const int r0 = min(n, static_cast<int>(threadIdx.x) * per), r1 = min(n, r0 + per);
  int local = 0;
  for (int r = r0; r < r1; ++r) local += chunks_of(reqs[r].tokens);
  int first = 0, total = 0;
  Scan(scan).ExclusiveSum(local, first, total);
  for (int r = r0; r < r1; ++r) {
    coff[r] = first;
    const int c = chunks_of(reqs[r].tokens);
    for (int j = 0; j < c; ++j) {
      if (first + j < bound) table[first + j] = r;
    }
    first += c;
  }
  if (threadIdx.x == 0) coff[n] = total;
  for (int64_t i = total + threadIdx.x; i < bound; i += kTableThreads) table[i] = -1;
}

// ---- 3. state pass ----------------------------------------------------------------------------
//
// One CTA per (request, value head): warpgroup 0 the producer, warpgroups 1 .. DV / 64 the
// consumers, consumer c owning value rows 64 c .. 64 c + 63 of S. The producer's thread 0 copies
// each chunk's unit into a ring of two stages, one bulk copy per array (the unit's layout is the
// stage's: linear_delta_layout.h), and arrives on the stage's full barrier with the bytes to
// expect; it waits for the stage's empty barrier (one arrival per consumer warp) before reusing
// it. Per chunk, a consumer warpgroup, with S its rows as fp32 wgmma accumulators and Sb the bf16
// A fragments of S (packed once per chunk):
//   group 1: u^T = Sb W^T            (m64n64, B = W K-major, Dk / 16 steps)
//   group 2: o^T = Sb Qd^T           (m64n64, B = Qd K-major)
//            while both run: U^T loaded, the previous chunk's outputs stored
//   wait for group 1: u^T = U^T - u^T (tokens past the request zero), packed to bf16 A
//            fragments; S *= el (columns)
//   group 3: S += u^T Kl             (m64nDk, B = KlT K-major, 4 steps)
//   group 4: o^T += u^T Mqk^T        (m64n64, B = Mqk K-major)
//   wait for groups 2, 3: Sb of the next chunk; wait for group 4: the stage goes back, o^T goes
//   to the warp's staging tile, which the next chunk (or the end) stores to the outputs, one
//   token row of the warp's 16 value rows per 4 lanes.
// The consumer warpgroups share nothing but the stages; every consumer warp waits on every full
// barrier phase in order and arrives on every empty phase, so the parity waits cannot skip a
// phase. The stages are written only by the bulk copies (async proxy) and read by the MMAs and by
// plain loads after the full barrier's wait (its complete_tx makes the bytes visible to both).
template <int DK, int DV>
struct PassConfig {
  static constexpr int kConsumers = DV / 64;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kStages = 2;
  static constexpr UnitLayout kUnit = unit_layout(DK, DV);
  static constexpr int kStageBytes = static_cast<int>(round_up(kUnit.bytes, 1024));
  static constexpr int kOutOffset = kStages * kStageBytes;  // staging tiles, one per warp
  static constexpr int kOutWarpBytes = kOutStageFloats * 4;
  static constexpr int kBarOffset = kOutOffset + 4 * kConsumers * kOutWarpBytes;
  static constexpr int kSmemBytes = 1024 + kBarOffset + 2 * kStages * 8;  // + 1024: alignment
  // The bytes each stage receives: W, Qd, KlT, Mqk, U^T, el.
  static constexpr int kWBytes = kChunk * DK * 2, kMBytes = kChunk * kChunk * 2;
  static constexpr int kUBytes = DV * kChunk * 4, kElBytes = DK * 4;
  static constexpr uint32_t kTxBytes = 3 * kWBytes + kMBytes + kUBytes + kElBytes;
  // Two consumers: registers move from the producer (one thread works) to the consumers, whose
  // S (Dk / 2), bf16 S (Dk / 4), u^T and o^T (32 each) and U^T (32) stay live across group 1.
  static constexpr bool kMoveRegs = kConsumers == 2;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert((DK == 64 || DK == 128) && DV == DK);
  static_assert(kUnit.w % 1024 == 0 && kUnit.qd % 1024 == 0 && kUnit.klt % 1024 == 0 &&
                    kUnit.m % 1024 == 0 && kUnit.u % 16 == 0 && kUnit.el % 16 == 0,
                "the swizzled arrays start on 1024 bytes of the stage, the others on 16");
  static_assert(kUnit.el + kElBytes <= kStageBytes && kTxBytes < (1 << 20));
  static_assert(kSmemBytes <= 227 * 1024, "the ring and the staging fit one SM");
  static_assert(!kMoveRegs || kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <=
                                  kLaunchRegs * kThreads,
                "setmaxnreg.inc would wait forever");
};

// A 1-D bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory
// into shared memory at `dst`, completing on `bar`'s transaction count.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// A warp's staged outputs (out_stage_elem) to out: token rows t < n from `row0` (row stride
// `stride` elements), lane l taking value rows 4 (l % 4) .. + 3 of token rows l / 4 + 8 i, at
// column `col` of the rows (its first of the four). T: the output type, stored 4 elements at once
// (col a multiple of 4, rows and out aligned to 4 elements; in PTX, as the compiler splits a
// uint2 / float4 store here into 32-bit ones); void: one by one, dtype code `t`.
template <typename T>
__device__ __forceinline__ void store_staged(const float* stg, void* out, int32_t t, int64_t row0,
                                             int64_t stride, int64_t col, int n, int lane) {
#pragma unroll
  for (int it = 0; it < kChunk / 8; ++it) {
    const int tr = 8 * it + (lane >> 2);
    if (tr < n) {
      const float4 x = *reinterpret_cast<const float4*>(&stg[out_stage_elem(tr, 4 * (lane & 3))]);
      const float v[4] = {x.x, x.y, x.z, x.w};
      const int64_t i = (row0 + tr) * stride + col;
      if constexpr (std::is_void_v<T>) {
#pragma unroll
        for (int e = 0; e < 4; ++e) store_elem(out, t, i + e, v[e]);
      } else if constexpr (std::is_same_v<T, float>) {
        asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(static_cast<T*>(out) + i),
                     "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
                     : "memory");
      } else {
        asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(static_cast<T*>(out) + i),
                     "r"(pack2<T>(v[0], v[1])), "r"(pack2<T>(v[2], v[3]))
                     : "memory");
      }
    }
  }
}

// The bf16 A fragments of a 64 x N fp32 accumulator, its columns as the reduction index
// (a_from_acc): k-step k16 takes columns 16 k16 .. 16 k16 + 15.
template <int N>
__device__ __forceinline__ void pack_a(const float (&acc)[N / 2], uint32_t (&a)[N / 16][4]) {
#pragma unroll
  for (int k16 = 0; k16 < N / 16; ++k16) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
      a[k16][r] = pack2<bf16>(acc[a_from_acc(k16, r, 0)], acc[a_from_acc(k16, r, 1)]);
  }
}

template <int DK, int DV>
__global__ void __launch_bounds__(PassConfig<DK, DV>::kThreads, 1)
    delta_pass_kernel(const DeltaParams p, const Layout L, const char* __restrict__ ws) {
  using Cfg = PassConfig<DK, DV>;
  constexpr UnitLayout U = Cfg::kUnit;
  constexpr int ST = Cfg::kStages;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
  unsigned char* smem = smem_raw + pad;
  const uint32_t sbase = raw + pad;
  const uint32_t bars = sbase + Cfg::kBarOffset;
  auto full_bar = [&](int s) { return bars + 8 * s; };
  auto empty_bar = [&](int s) { return bars + 8 * (ST + s); };

  const int r = blockIdx.x, h = blockIdx.y;
  const LinReq req = p.step.reqs[r];
  const int nchunks = chunks_of(req.tokens);
  if (nchunks == 0) return;
  const int64_t c0 = reinterpret_cast<const int32_t*>(ws + L.coff_off)[r];
  if (c0 + nchunks > L.bound) return;  // more tokens than num_tokens: not ours to touch
  const int hv = p.state.heads;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(full_bar(s), 1);
      // Every consumer thread arrives: each reads u and el of the stage with plain loads, and an
      // arrival per thread orders its own reads before the producer's next bulk copy into the
      // stage (one arrival a warp after __syncwarp is ordered too, but racecheck flags it).
      mbar_init(empty_bar(s), 128 * Cfg::kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid < 128) {
    // ================= producer =================
    if constexpr (Cfg::kMoveRegs) setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid == 0) {
      for (int jc = 0; jc < nchunks; ++jc) {
        const int st = jc % ST;
        // Chunk jc - ST, the stage's last, is released: that is the (jc / ST - 1)-th phase.
        if (jc >= ST) mbar_wait(empty_bar(st), ((jc / ST) & 1) ^ 1);
        const char* unit = ws + L.units_off + ((c0 + jc) * hv + h) * L.unit_bytes;
        const uint32_t dst = sbase + st * Cfg::kStageBytes, bar = full_bar(st);
        mbar_arrive_expect_tx(bar, Cfg::kTxBytes);
        bulk_load(dst + U.w, unit + U.w, Cfg::kWBytes, bar);
        bulk_load(dst + U.qd, unit + U.qd, Cfg::kWBytes, bar);
        bulk_load(dst + U.klt, unit + U.klt, Cfg::kWBytes, bar);
        bulk_load(dst + U.m, unit + U.m, Cfg::kMBytes, bar);
        bulk_load(dst + U.u, unit + U.u, Cfg::kUBytes, bar);
        bulk_load(dst + U.el, unit + U.el, Cfg::kElBytes, bar);
      }
    }
    return;
  }

  // ================= consumers =================
  if constexpr (Cfg::kMoveRegs) setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int ct = tid - 128, cw = ct >> 7, wq = (ct >> 5) & 3, lane = ct & 31;
  const int vw = 64 * cw + 16 * wq;  // the warp's first value row
  // Accumulator register j of this thread: row vw + vrow(j) of S / u^T / o^T, column col(j).
  auto vrow = [&](int j) { return acc_row_of(0, lane, j); };
  auto col = [&](int j) { return acc_col_of(lane, j); };

  // S: the thread's rows and columns of the slot's state (zero without an initial state).
  const int64_t sb = (req.slot * hv + h) * static_cast<int64_t>(DV) * DK;
  float s[DK / 2];
#pragma unroll
  for (int j = 0; j < DK / 2; j += 2) {
    float2 x = make_float2(0.f, 0.f);
    if (req.has_initial_state) {
      x = load_elem2<Dtypes::f32_or_bf16>(p.state.ssm, p.state.ssm_dtype,
                                          sb + static_cast<int64_t>(vw + vrow(j)) * DK + col(j));
    }
    s[j] = x.x;
    s[j + 1] = x.y;
  }
  uint32_t sa[DK / 16][4];
  pack_a<DK>(s, sa);

  // The warp's staging tile; the outputs of a chunk leave it while the next chunk's first MMAs
  // run (flush).
  float* stg = reinterpret_cast<float*>(smem + Cfg::kOutOffset) + (ct >> 5) * kOutStageFloats;
  const bool vec_out = p.out_stride % 4 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  const int64_t out_col = static_cast<int64_t>(h) * DV + vw + 4 * (lane & 3);
  // Token rows t < n of the staged chunk jc: 4 lanes a token, 4 value rows a lane.
  auto flush = [&](int jc) {
    const int n = min(kChunk, req.tokens - jc * kChunk);
    const int64_t tok0 = req.token_start + static_cast<int64_t>(jc) * kChunk;
    const int32_t t = p.out_dtype;
    if (!vec_out) {
      store_staged<void>(stg, p.out, t, tok0, p.out_stride, out_col, n, lane);
    } else if (t == kBF16) {
      store_staged<bf16>(stg, p.out, t, tok0, p.out_stride, out_col, n, lane);
    } else if (t == kF16) {
      store_staged<__half>(stg, p.out, t, tok0, p.out_stride, out_col, n, lane);
    } else {
      store_staged<float>(stg, p.out, t, tok0, p.out_stride, out_col, n, lane);
    }
    __syncwarp();  // the tile is read before the next chunk's writes
  };

#pragma unroll 1
  for (int jc = 0; jc < nchunks; ++jc) {
    const int st = jc % ST;
    const uint32_t stage = sbase + st * Cfg::kStageBytes;
    const float* el = reinterpret_cast<const float*>(smem + st * Cfg::kStageBytes + U.el);
    const float* ut_in = reinterpret_cast<const float*>(smem + st * Cfg::kStageBytes + U.u);
    mbar_wait(full_bar(st), (jc / ST) & 1);

    // Groups 1 and 2: u^T = S W^T, o^T = S Qd^T.
    float ut[32], ot[32];
    wgmma_fence_operand(ut);
    wgmma_fence_operand(ot);
    wgmma_fence();  // sa was written by plain instructions
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
      wgmma_rs_k<64, bf16>(ut, sa[kk], wgmma_desc(stage + U.w + kmajor_step_offset(64, kk), 16),
                           kk > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
      wgmma_rs_k<64, bf16>(ot, sa[kk], wgmma_desc(stage + U.qd + kmajor_step_offset(64, kk), 16),
                           kk > 0);
    }
    wgmma_commit();
    wgmma_fence_operand(ut);
    wgmma_fence_operand(ot);

    // While they run: this thread's U^T elements and the previous chunk's outputs. (S is scaled
    // by el only once group 1 is in: scaled here, ptxas 13.0 made the scaling wait for both
    // groups, C7517.)
    float2 uv[16];
#pragma unroll
    for (int j = 0; j < 32; j += 2)
      uv[j / 2] = *reinterpret_cast<const float2*>(&ut_in[ut_elem(vw + vrow(j), col(j))]);
    if (jc > 0) flush(jc - 1);

    wgmma_wait<1>();  // u^T = S W^T is in
    wgmma_fence_operand(ut);
    const int n = min(kChunk, req.tokens - jc * kChunk);
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
      ut[j] = col(j) < n ? uv[j / 2].x - ut[j] : 0.f;
      ut[j + 1] = col(j + 1) < n ? uv[j / 2].y - ut[j + 1] : 0.f;
    }
    uint32_t ua[4][4];
    pack_a<64>(ut, ua);
#pragma unroll
    for (int j = 0; j < DK / 2; j += 2) {
      const float2 e = *reinterpret_cast<const float2*>(&el[col(j)]);
      s[j] *= e.x;
      s[j + 1] *= e.y;
    }

    // Groups 3 and 4: S += u^T Kl, o^T += u^T Mqk^T.
    wgmma_fence_operand(s);
    wgmma_fence();  // ua, and S scaled by el, were written by plain instructions
#pragma unroll
    for (int k16 = 0; k16 < 4; ++k16) {
      wgmma_rs_k<DK, bf16>(s, ua[k16], wgmma_desc(stage + U.klt + kmajor_step_offset(DK, k16), 16),
                           1);
    }
    wgmma_commit();
#pragma unroll
    for (int k16 = 0; k16 < 4; ++k16) {
      wgmma_rs_k<64, bf16>(ot, ua[k16], wgmma_desc(stage + U.m + kmajor_step_offset(64, k16), 16),
                           1);
    }
    wgmma_commit();
    wgmma_fence_operand(s);
    wgmma_fence_operand(ot);
    wgmma_wait<1>();  // o^T = S Qd^T and the new S are in
    wgmma_fence_operand(s);
    pack_a<DK>(s, sa);
    wgmma_wait<0>();  // o^T is complete; the stage is read no more
    wgmma_fence_operand(ot);
    mbar_arrive(empty_bar(st));
#pragma unroll
    for (int j = 0; j < 32; ++j) stg[out_stage_elem(col(j), vrow(j))] = ot[j];
    __syncwarp();
  }
  flush(nchunks - 1);

#pragma unroll
  for (int j = 0; j < DK / 2; j += 2) {
    store_elem2<Dtypes::f32_or_bf16>(p.state.ssm, p.state.ssm_dtype,
                                     sb + static_cast<int64_t>(vw + vrow(j)) * DK + col(j), s[j],
                                     s[j + 1]);
  }
}

template <int DK, int DV>
cudaError_t run_pass(const DeltaParams& p, const Layout& L, char* ws, cudaStream_t stream) {
  using Cfg = PassConfig<DK, DV>;
  auto pass = delta_pass_kernel<DK, DV>;
  const cudaError_t err =
      cudaFuncSetAttribute(pass, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.step.num_reqs, p.state.heads);
  pass<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, L, ws);
  return cudaGetLastError();
}

bool valid_dtype(DTypeCode t) { return t == kF32 || t == kF16 || t == kBF16; }

}  // namespace
}  // namespace delta

size_t delta_chunked_workspace(const DeltaParams& p, int64_t num_tokens, int chunk) {
  if (chunk != delta::kChunk || num_tokens < 0 || p.step.num_reqs < 0) return 0;
  return static_cast<size_t>(
      delta::make_layout(p.step.num_reqs, num_tokens, p.state.cols, p.state.rows, p.state.heads)
          .total);
}

// Supported: chunk 64, non-verify steps, (Dk, Dv) = (64, 64) or (128, 128), state fp32 / bf16,
// y fp32 / bf16 (16-byte aligned), activations fp32 / bf16 / fp16; anything else returns
// cudaErrorInvalidValue without launching.
cudaError_t launch_delta_chunked(const DeltaParams& p, int64_t num_tokens, int chunk,
                                 void* workspace, cudaStream_t stream) {
  const int dk = p.state.cols, dv = p.state.rows, hv = p.state.heads, hk = p.key_heads;
  if (chunk != delta::kChunk || p.step.verify != 0) return cudaErrorInvalidValue;
  if (!((dk == 64 && dv == 64) || (dk == 128 && dv == 128))) return cudaErrorInvalidValue;
  if (hk <= 0 || hv <= 0 || hv % hk != 0) return cudaErrorInvalidValue;
  if (p.state.conv_dim != 2 * hk * dk + hv * dv) return cudaErrorInvalidValue;
  if (!(p.state.ssm_dtype == kF32 || p.state.ssm_dtype == kBF16)) return cudaErrorInvalidValue;
  if (!(p.y_dtype == kF32 || p.y_dtype == kBF16)) return cudaErrorInvalidValue;
  if (!delta::valid_dtype(p.a_dtype) || !delta::valid_dtype(p.b_dtype) ||
      !delta::valid_dtype(p.out_dtype))
    return cudaErrorInvalidValue;
  if (p.step.num_reqs <= 0 || num_tokens <= 0) return cudaSuccess;
  if (workspace == nullptr) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(p.y) % 16 != 0) return cudaErrorInvalidValue;  // V's cp.async
  const delta::Layout L = delta::make_layout(p.step.num_reqs, num_tokens, dk, dv, hv);
  char* ws = static_cast<char*>(workspace);
  delta::chunk_table_kernel<<<1, delta::kTableThreads, 0, stream>>>(
      p.step.reqs, p.step.num_reqs, L.bound, reinterpret_cast<int32_t*>(ws + L.coff_off),
      reinterpret_cast<int32_t*>(ws + L.table_off));
  const cudaError_t prep = delta::launch_prep(p, L, ws, stream);
  if (prep != cudaSuccess) return prep;
  return dk == 64 ? delta::run_pass<64, 64>(p, L, ws, stream)
                  : delta::run_pass<128, 128>(p, L, ws, stream);
}

}  // namespace attnrt::cuda::linear
