// Standalone GPU benchmark of the cuda backend on the standard workloads (WORKLOADS.md), with the
// ceilings measured in the same run: device-to-device copy (bytes read + written) and a cuBLAS bf16
// GEMM 8192^3, L2 flushed between repetitions. Attention is timed with CUDA events around one
// forward (plan excluded; the plan's host time is reported separately), median of 20.
//   usage: attnrt_gpu_bench [--json FILE] [--quick] [--only GROUP[,GROUP...]]
// --only keeps the rows of the named groups (decode, prefill, extend, verify) and skips the
// host-plan timing.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_kv_cache.h"

using namespace attnrt;

namespace {

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) fail("{}: {}", #x, cudaGetErrorString(e_));               \
  } while (0)

struct Stats {
  double median = 0, lo = 0, hi = 0;  // seconds
};
Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

void* flush_buf = nullptr;
constexpr size_t kFlushBytes = size_t{256} << 20;
void flush_l2(cudaStream_t s) { CK(cudaMemsetAsync(flush_buf, 0, kFlushBytes, s)); }

template <typename F>
Stats time_events(cudaStream_t s, int reps, F&& f) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    flush_l2(s);
    CK(cudaEventRecord(a, s));
    f();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e-3);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return stats(t);
}

// Fills device memory with random finite values of `dtype` by tiling one random host block.
void fill_device(void* dst, size_t bytes, DType dtype, std::mt19937& rng) {
  const size_t block = std::min<size_t>(bytes, size_t{16} << 20);
  std::vector<unsigned char> host(block);
  const size_t es = dtype_size(dtype);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (size_t i = 0; i < block / es; ++i) store_from_float(host.data(), dtype, i, u(rng));
  void* dblock = nullptr;
  CK(cudaMalloc(&dblock, block));
  CK(cudaMemcpy(dblock, host.data(), block, cudaMemcpyHostToDevice));
  for (size_t off = 0; off < bytes; off += block)
    CK(cudaMemcpy(static_cast<char*>(dst) + off, dblock, std::min(block, bytes - off),
                  cudaMemcpyDeviceToDevice));
  CK(cudaFree(dblock));
}

struct Row {
  std::string group, name;
  double seconds = 0, spread_lo = 0, spread_hi = 0;
  double amount = 0;  // bytes (decode) or FLOPs (prefill)
  double rate = 0;    // GB/s or TFLOP/s
  double pct = 0;     // of the measured ceiling
  std::string unit;
};

struct Workload {
  std::string group, name;
  ForwardMode mode = ForwardMode::DECODE;
  int bs = 1;
  int prefix = 0, qlen = 1;  // decode: prefix = L - 1
  int dim = 128, page = 16, topk = 1;
  DType kv = DType::bf16;
  bool causal = true;
};

struct Ceil {
  double copy_gbps = 0, gemm_tflops = 0;
};

Ceil measure_ceilings(cudaStream_t s) {
  Ceil c;
  const size_t bytes = size_t{4} << 30;
  void *a = nullptr, *b = nullptr;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  Stats st = time_events(s, 10, [&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s)); });
  c.copy_gbps = 2.0 * bytes / st.median / 1e9;
  CK(cudaFree(a));
  CK(cudaFree(b));

  const int n = 8192;
  void *A, *B, *C;
  CK(cudaMalloc(&A, size_t{2} * n * n));
  CK(cudaMalloc(&B, size_t{2} * n * n));
  CK(cudaMalloc(&C, size_t{2} * n * n));
  std::mt19937 rng(1);
  fill_device(A, size_t{2} * n * n, DType::bf16, rng);
  fill_device(B, size_t{2} * n * n, DType::bf16, rng);
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) fail("cublasCreate failed");
  cublasSetStream(h, s);
  const float one = 1.f, zero = 0.f;
  st = time_events(s, 10, [&] {
    if (cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, A, CUDA_R_16BF, n, B, CUDA_R_16BF,
                     n, &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) !=
        CUBLAS_STATUS_SUCCESS)
      fail("cublasGemmEx failed");
  });
  c.gemm_tflops = 2.0 * n * n * n / st.median / 1e12;
  cublasDestroy(h);
  CK(cudaFree(A));
  CK(cudaFree(B));
  CK(cudaFree(C));
  return c;
}

struct Setup {
  ModelSpec model;
  Options options;
  KVStorage storage;
  std::unique_ptr<ReqToTokenPool> pool;
  std::vector<int64_t> rows;
  ForwardBatch batch;
};

// Builds the pool (pages of every request scattered by a random permutation) and the step batch.
std::unique_ptr<Setup> make_setup(const Workload& w, std::mt19937& rng) {
  auto s = std::make_unique<Setup>();
  LayerSpec l;
  l.layer_id = 0;
  l.num_q_heads = 32;
  l.num_kv_heads = 8;
  l.head_dim = l.v_head_dim = w.dim;
  l.attn_type = w.causal ? AttnType::decoder : AttnType::encoder_only;
  s->model.name = "bench";
  s->model.layers = {l};
  const int kv_len = w.prefix + w.qlen;
  s->model.max_context_len = kv_len + w.page;
  const int64_t pages_per = (kv_len + w.page - 1) / w.page;
  const int64_t pages = pages_per * w.bs;
  KVCacheConfig cfg;
  cfg.full_slots = pages * w.page;
  cfg.page_size = w.page;
  cfg.dtype = w.kv;
  cfg.max_num_tokens = std::max<int>(w.bs * w.qlen, 1);
  s->storage = cuda::make_cuda_kv_storage(s->model, cfg);
  auto* cache = static_cast<cuda::CudaKVCache*>(s->storage.cache.get());
  const KVLayerView v = cache->layer(0);
  fill_device(v.k, v.num_rows * v.k_row_stride * dtype_size(v.dtype), v.dtype, rng);
  fill_device(v.v, v.num_rows * v.v_row_stride * dtype_size(v.dtype), v.dtype, rng);
  s->options.page_size = w.page;
  s->pool = std::make_unique<ReqToTokenPool>(w.bs, s->model.max_context_len);
  std::vector<int64_t> perm(pages);
  std::iota(perm.begin(), perm.end(), 1);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int64_t>> slots(w.bs);
  for (int i = 0; i < w.bs; ++i) {
    const int row = s->pool->alloc();
    s->rows.push_back(row);
    for (int j = 0; j < kv_len; ++j)
      slots[i].push_back(perm[i * pages_per + j / w.page] * w.page + j % w.page);
    s->pool->write(row, 0, slots[i]);
  }
  std::vector<int32_t> prefix(w.bs, w.prefix), qlen(w.bs, w.qlen);
  switch (w.mode) {
    case ForwardMode::DECODE:
      s->batch = make_decode_batch(s->rows, std::vector<int32_t>(w.bs, kv_len));
      break;
    case ForwardMode::TARGET_VERIFY: {
      SpecInfo spec = SpecInfo::chain(w.bs, w.qlen);
      if (w.topk > 1) {
        spec.topk = w.topk;
        for (int i = 0; i < w.bs; ++i)
          for (int t = 1; t < w.qlen; ++t)
            spec.parents[size_t(i) * w.qlen + t] = std::uniform_int_distribution<int>(0, t - 1)(rng);
      }
      s->batch = make_verify_batch(s->rows, prefix, std::move(spec));
      break;
    }
    default:
      s->batch = make_extend_batch(s->rows, prefix, qlen, ForwardMode::EXTEND);
  }
  s->batch.out_cache_loc.clear();
  for (int i = 0; i < w.bs; ++i)
    for (int t = 0; t < w.qlen; ++t) s->batch.out_cache_loc.push_back(slots[i][w.prefix + t]);
  return s;
}

Row run_workload(const Workload& w, const Ceil& ceil, std::mt19937& rng, double* plan_us) {
  auto s = make_setup(w, rng);
  BackendContext ctx;
  ctx.model = &s->model;
  ctx.options = &s->options;
  ctx.kv_cache = s->storage.cache.get();
  ctx.req_to_token = s->pool.get();
  ctx.device = Device::cuda(0);
  cuda::CudaBackend be(ctx);
  const LayerSpec& l = s->model.layers[0];
  const int64_t T = s->batch.num_tokens();
  void *q = nullptr, *o = nullptr;
  CK(cudaMalloc(&q, T * 32 * w.dim * 2));
  CK(cudaMalloc(&o, T * 32 * w.dim * 2));
  fill_device(q, T * 32 * w.dim * 2, DType::bf16, rng);
  AttnArgs a;
  a.q = TensorView(q, DType::bf16, {T, 32, w.dim}, Device::cuda(0));
  a.out = TensorView(o, DType::bf16, {T, 32, w.dim}, Device::cuda(0));
  a.save_kv = false;
  // Plan host time: median of 50 steps (wall clock around the plan only; the plan never waits for
  // the GPU). Each plan is followed by its forward, as in serving: the plan keeps the committed
  // pages of every row on the device once a step's kernels ran, so steady-state steps upload only
  // what changed. The GPU is drained outside the timed region.
  std::vector<double> pt;
  for (int i = 0; i < 50; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    be.init_forward_metadata(s->batch);
    pt.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    be.forward(a, l, s->batch);
    CK(cudaStreamSynchronize(be.stream()));
  }
  if (plan_us) *plan_us = stats(pt).median * 1e6;
  const Stats st = time_events(be.stream(), 20, [&] { be.forward(a, l, s->batch); });
  CK(cudaFree(q));
  CK(cudaFree(o));
  Row r;
  r.group = w.group;
  r.name = w.name;
  r.seconds = st.median;
  r.spread_lo = st.lo;
  r.spread_hi = st.hi;
  const double kv_len = w.prefix + w.qlen;
  if (w.group == "decode") {
    r.amount = double(w.bs) * kv_len * 8 * w.dim * 2 * dtype_size(w.kv);
    r.rate = r.amount / st.median / 1e9;
    r.unit = "GB/s";
    r.pct = 100 * r.rate / ceil.copy_gbps;
  } else if (w.group == "verify") {
    r.unit = "us";
    r.rate = st.median * 1e6;
  } else {
    const double e = w.qlen, p = w.prefix;
    r.amount = double(w.bs) * 4 * 32 * w.dim * (e * p + (w.causal ? e * e / 2 : e * e));
    r.rate = r.amount / st.median / 1e12;
    r.unit = "TFLOP/s";
    r.pct = 100 * r.rate / ceil.gemm_tflops;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  bool quick = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = "," + std::string(argv[++i]) + ",";
  }
  const auto wanted = [&](const std::string& group) {
    return only.empty() || only.find("," + group + ",") != std::string::npos;
  };
  try {
    const CudaDeviceInfo& info = query_cuda();
    if (!info.usable) {
      std::printf("no usable CUDA device: %s\n", info.reason.c_str());
      return 0;
    }
    cudaStream_t s0;
    CK(cudaStreamCreate(&s0));
    CK(cudaMalloc(&flush_buf, kFlushBytes));
    const Ceil ceil = measure_ceilings(s0);
    std::printf("device %s, %d SMs: copy %.0f GB/s (read+write), bf16 GEMM %.0f TFLOP/s\n",
                info.name.c_str(), info.sm_count, ceil.copy_gbps, ceil.gemm_tflops);
    std::mt19937 rng(42);
    std::vector<Workload> ws;
    const std::vector<std::pair<int, int>> dec = {{1, 32768}, {16, 4096}, {64, 4096},
                                                  {128, 8192}, {256, 2048}, {32, 32768}};
    for (auto [b, L] : dec) {
      Workload w;
      w.group = "decode";
      w.bs = b;
      w.prefix = L - 1;
      w.name = "decode " + std::to_string(b) + "x" + std::to_string(L);
      ws.push_back(w);
    }
    for (auto [b, L] : dec) {
      if (quick && b != 64) continue;
      Workload w;
      w.group = "decode";
      w.bs = b;
      w.prefix = L - 1;
      w.kv = DType::e4m3;
      w.name = "decode " + std::to_string(b) + "x" + std::to_string(L) + " fp8";
      ws.push_back(w);
      w.kv = DType::bf16;
      w.page = 1;
      w.name = "decode " + std::to_string(b) + "x" + std::to_string(L) + " page1";
      ws.push_back(w);
    }
    const std::vector<std::tuple<int, int, int>> pre = {
        {1, 1024, 128}, {1, 4096, 128}, {1, 16384, 128}, {8, 2048, 128}, {1, 8192, 64},
        {1, 8192, 256}};
    for (auto [b, S, d] : pre) {
      Workload w;
      w.group = "prefill";
      w.mode = ForwardMode::EXTEND;
      w.bs = b;
      w.qlen = S;
      w.dim = d;
      w.name = "prefill " + std::to_string(b) + "x" + std::to_string(S) + " d" + std::to_string(d);
      ws.push_back(w);
    }
    {
      Workload w;
      w.group = "extend";
      w.mode = ForwardMode::EXTEND;
      w.bs = 8;
      w.prefix = 2048;
      w.qlen = 512;
      w.name = "extend 8x(2048+512)";
      ws.push_back(w);
      Workload v;
      v.group = "verify";
      v.mode = ForwardMode::TARGET_VERIFY;
      v.bs = 64;
      v.prefix = 4096;
      v.qlen = 8;
      v.name = "verify chain 64x(4096+8)";
      ws.push_back(v);
      v.qlen = 16;
      v.topk = 4;
      v.name = "verify tree 64x(4096+16,topk4)";
      ws.push_back(v);
    }
    std::vector<Row> rows;
    double decode_64x4096 = 0;
    for (const Workload& w : ws) {
      if (!wanted(w.group)) continue;
      Row r = run_workload(w, ceil, rng, nullptr);
      if (w.name == "decode 64x4096") decode_64x4096 = r.seconds;
      if (w.group == "verify" && decode_64x4096 > 0) {
        r.pct = r.seconds / decode_64x4096;
        r.unit = "x decode";
        r.rate = r.seconds * 1e6;
      }
      rows.push_back(r);
      std::fflush(stdout);
    }
    // Host plan time at batch 256.
    double plan_decode = 0, plan_verify = 0, plan_extend = 0;
    if (only.empty()) {
      Workload w;
      w.group = "decode";
      w.bs = 256;
      w.prefix = 2047;
      run_workload(w, ceil, rng, &plan_decode);
      Workload v;
      v.group = "verify";
      v.mode = ForwardMode::TARGET_VERIFY;
      v.bs = 256;
      v.prefix = 2048;
      v.qlen = 8;
      run_workload(v, ceil, rng, &plan_verify);
      Workload e;
      e.group = "extend";
      e.mode = ForwardMode::EXTEND;
      e.bs = 256;
      e.prefix = 2048;
      e.qlen = 16;
      run_workload(e, ceil, rng, &plan_extend);
    }
    std::FILE* js = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");
    if (js) {
      std::fprintf(js, "{\"device\": \"%s\", \"copy_gbps\": %.1f, \"gemm_tflops\": %.1f,\n",
                   info.name.c_str(), ceil.copy_gbps, ceil.gemm_tflops);
      std::fprintf(js, " \"plan_us_bs256\": {\"decode\": %.2f, \"verify\": %.2f, \"extend\": %.2f},\n",
                   plan_decode, plan_verify, plan_extend);
      std::fprintf(js, " \"rows\": [\n");
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        std::fprintf(js,
                     "  {\"name\": \"%s\", \"median_us\": %.2f, \"min_us\": %.2f, \"max_us\": "
                     "%.2f, \"rate\": %.2f, \"unit\": \"%s\", \"pct_or_ratio\": %.3f}%s\n",
                     r.name.c_str(), r.seconds * 1e6, r.spread_lo * 1e6, r.spread_hi * 1e6,
                     r.rate, r.unit.c_str(), r.pct, i + 1 < rows.size() ? "," : "");
      }
      std::fprintf(js, " ]}\n");
      std::fclose(js);
    }
    std::printf("\n%-34s %11s %20s %10s\n", "workload", "median us", "rate", "% ceil");
    for (const Row& r : rows) {
      if (r.group == "verify") {
        std::printf("%-34s %11.1f %20s %9.2fx\n", r.name.c_str(), r.seconds * 1e6, "", r.pct);
      } else {
        std::printf("%-34s %11.1f %12.1f %-7s %9.1f%%\n", r.name.c_str(), r.seconds * 1e6, r.rate,
                    r.unit.c_str(), r.pct);
      }
    }
    std::printf("plan host time at batch 256: decode %.2f us, verify %.2f us, extend %.2f us\n",
                plan_decode, plan_verify, plan_extend);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
