#include "bench/harness/dcp_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/runtime/attention_runtime.h"
#include "attnrt/runtime/dcp.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace attnrt::bench {

double DcpBenchRow::projected_us() const {
  const double rank = rank_us.empty() ? 0 : *std::max_element(rank_us.begin(), rank_us.end());
  return rank + exchange_us + merge_us;
}

namespace {

struct Shape {
  std::string name;
  int batch, len;
};

std::vector<Shape> shapes_of(const DcpBenchConfig& c) {
  std::vector<std::string> names = c.rows;
  if (names.empty()) names = {"dcp-decode-1x131072", "dcp-decode-8x131072", "dcp-decode-64x8192"};
  std::vector<Shape> out;
  for (std::string n : names) {
    if (n.rfind("decode-", 0) == 0) n = "dcp-" + n;
    int b = 0, l = 0;
    ATTNRT_CHECK(std::sscanf(n.c_str(), "dcp-decode-%dx%d", &b, &l) == 2 && b >= 1 && l >= 2,
                 "--dcp-size: row '{}' is not dcp-decode-BxL (B requests of L tokens, L >= 2)",
                 n);
    b = std::max(1, static_cast<int>(b * c.scale));
    l = std::max(2, static_cast<int>(l * c.scale));
    out.push_back({n, b, l});
  }
  return out;
}

}  // namespace

#ifdef ATTNRT_HAS_CUDA

namespace {

#define DCP_BENCH_CUDA(expr)                                                                   \
  do {                                                                                         \
    const cudaError_t e_ = (expr);                                                             \
    ATTNRT_CHECK(e_ == cudaSuccess, "dcp bench: {} failed: {}", #expr, cudaGetErrorString(e_)); \
  } while (0)

struct DeviceArray {
  void* ptr = nullptr;
  explicit DeviceArray(size_t bytes) {
    DCP_BENCH_CUDA(cudaMalloc(&ptr, std::max<size_t>(bytes, 16)));
    DCP_BENCH_CUDA(cudaMemset(ptr, 0, std::max<size_t>(bytes, 16)));
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

struct Events {
  std::vector<cudaEvent_t> e;
  explicit Events(size_t n) : e(n) {
    for (cudaEvent_t& x : e) DCP_BENCH_CUDA(cudaEventCreate(&x));
  }
  ~Events() {
    for (cudaEvent_t x : e) cudaEventDestroy(x);
  }
  void record(size_t i) { DCP_BENCH_CUDA(cudaEventRecord(e[i], nullptr)); }
  double us(size_t a, size_t b) {
    float ms = 0;
    DCP_BENCH_CUDA(cudaEventElapsedTime(&ms, e[a], e[b]));
    return 1000.0 * ms;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void run_row(const DcpBenchConfig& c, const Shape& s, DcpBenchRow& row) {
  const int B = s.batch, L = s.len, n = c.ranks;
  const int hq = 32, hkv = 8, d = 128;
  LayerSpec l;
  l.layer_id = 0;
  l.num_q_heads = hq;
  l.num_kv_heads = hkv;
  l.head_dim = l.v_head_dim = d;
  ModelSpec model{.name = "llama-3-8b-layer", .dtype = DType::bf16, .max_context_len = L,
                  .layers = {l}};
  Options o;
  o.attention_backend = "cuda";
  o.page_size = 1;
  RuntimeConfig one_cfg;
  one_cfg.max_requests = B;
  one_cfg.kv_slots = int64_t{B} * L + 64;
  one_cfg.max_num_tokens = B;
  one_cfg.max_context_len = L;
  one_cfg.cuda_graphs = false;

  // Device activations (zeros: the timing does not depend on the values).
  DeviceArray q(size_t{2} * B * hq * d), k(size_t{2} * B * hkv * d), v(size_t{2} * B * hkv * d),
      out(size_t{2} * B * hq * d), lse(size_t{4} * B * hq);
  const Device dev = Device::cuda(0);
  AttnArgs a;
  a.q = TensorView(q.ptr, DType::bf16, {B, hq, d}, dev);
  a.k = TensorView(k.ptr, DType::bf16, {B, hkv, d}, dev);
  a.v = TensorView(v.ptr, DType::bf16, {B, hkv, d}, dev);
  a.out = TensorView(out.ptr, DType::bf16, {B, hq, d}, dev);
  a.lse = TensorView(lse.ptr, DType::f32, {B, hq}, dev);
  const int total = c.warmup + c.repeats;

  {  // One runtime holding every token, on the legacy default stream (where the events are).
    AttentionRuntime rt(model, o, one_cfg);
    rt.set_stream(nullptr);
    std::vector<int64_t> rows;
    std::vector<int32_t> seq(B, L);
    ForwardBatch b;
    std::vector<int64_t> loc;
    for (int i = 0; i < B; ++i) {
      const int row = rt.req_to_token().alloc();
      rows.push_back(row);
      const std::vector<int32_t> prefix = {0}, len = {L};
      const std::vector<int64_t> last = {-1};
      const std::vector<int64_t> slots = rt.allocator().alloc_extend(prefix, len, last);
      rt.req_to_token().write(row, 0, slots);
      loc.push_back(slots.back());
    }
    b = make_decode_batch(rows, seq);
    b.out_cache_loc = loc;
    rt.begin_step(b);
    Events ev(2 * total);
    for (int i = 0; i < total; ++i) {
      ev.record(2 * i);
      rt.forward(0, a);
      ev.record(2 * i + 1);
    }
    DCP_BENCH_CUDA(cudaDeviceSynchronize());
    std::vector<double> t;
    for (int i = c.warmup; i < total; ++i) t.push_back(ev.us(2 * i, 2 * i + 1));
    row.single_us = median(t);
    rt.end_step();
  }

  {  // N cuda ranks on this GPU (their runtimes on the legacy default stream).
    Options g = o;
    g.dcp_size = n;
    RuntimeConfig cfg = one_cfg;
    cfg.kv_slots = int64_t{B} * (dcp_local_count(L, 0, n) + 1) + 64;
    DcpAttention group(model, g, cfg);
    std::vector<int64_t> rows;
    for (int i = 0; i < B; ++i) {
      rows.push_back(i);
      group.reserve_prefix(i, L - 1);
    }
    ForwardBatch b = make_decode_batch(rows, std::vector<int32_t>(B, L));
    b.out_cache_loc.assign(B, 0);
    group.begin_step(b);
    const size_t per = static_cast<size_t>(n) + 3;  // start, after each rank, exchange, merge
    Events ev(per * total);
    for (int i = 0; i < total; ++i) {
      const size_t e0 = per * i;
      ev.record(e0);
      for (int r = 0; r < n; ++r) {
        group.rank(r).partial(0, a);
        ev.record(e0 + 1 + r);
      }
      for (int r = 0; r < n; ++r) group.rank(r).exchange();
      ev.record(e0 + n + 1);
      for (int r = 0; r < n; ++r) group.rank(r).merge(0, a);
      ev.record(e0 + n + 2);
    }
    DCP_BENCH_CUDA(cudaDeviceSynchronize());
    std::vector<std::vector<double>> ranks(n);
    std::vector<double> x, m;
    for (int i = c.warmup; i < total; ++i) {
      const size_t e0 = per * i;
      for (int r = 0; r < n; ++r) ranks[r].push_back(ev.us(e0 + r, e0 + r + 1));
      x.push_back(ev.us(e0 + n, e0 + n + 1));
      m.push_back(ev.us(e0 + n + 1, e0 + n + 2));
    }
    for (auto& r : ranks) row.rank_us.push_back(median(r));
    row.exchange_us = median(x);
    row.merge_us = median(m);
    group.end_step();
  }
}

}  // namespace

std::vector<DcpBenchRow> run_dcp_bench(const DcpBenchConfig& c) {
  const CudaDeviceInfo& info = query_cuda();
  ATTNRT_CHECK(info.usable, "--dcp-size {}: the DCP rows run cuda ranks on a GPU; {}", c.ranks,
               info.reason);
  ATTNRT_CHECK(c.ranks >= 2 && c.ranks <= kMaxDcpSize, "--dcp-size {}: must be in [2, {}]",
               c.ranks, kMaxDcpSize);
  std::vector<DcpBenchRow> out;
  for (const Shape& s : shapes_of(c)) {
    DcpBenchRow row;
    row.name = s.name;
    row.batch = s.batch;
    row.len = s.len;
    row.ranks = c.ranks;
    try {
      run_row(c, s, row);
    } catch (const Error& e) {
      row.error = e.what();
    }
    out.push_back(std::move(row));
  }
  return out;
}

#else

std::vector<DcpBenchRow> run_dcp_bench(const DcpBenchConfig& c) {
  shapes_of(c);
  fail("--dcp-size {}: the DCP rows run cuda ranks on a GPU; this attnrt is built without CUDA",
       c.ranks);
}

#endif

std::string format_dcp_report(const DcpBenchConfig& c, const std::vector<DcpBenchRow>& rows) {
  std::string s = fmt::format(
      "DCP decode rows, {} cuda ranks SIMULATED ON ONE GPU (docs/dcp.md \"Benchmark\"): one "
      "Llama-3-8B layer (32 q / 8 kv heads, d 128, bf16, page 1); median of {} after {} warm-up.\n"
      "The ranks run one after another on the same GPU: 'group' is not DCP's time. 'projected' "
      "= the slowest rank's partial + this GPU's device-to-device exchange + the merge: what N "
      "GPUs would take with an exchange as fast as a local copy. The targets (>= 1.9x at 2 GPUs, "
      ">= 3.6x at 4, merge <= 15 us at batch 64 over NVLink) need N GPUs.\n\n",
      c.ranks, c.repeats, c.warmup);
  s += fmt::format("{:<22} {:>11} {:>26} {:>11} {:>10} {:>11} {:>11} {:>10}\n", "row",
                   "single us", "rank partials us", "exchange us", "merge us", "group us",
                   "projected", "speed-up");
  for (const DcpBenchRow& r : rows) {
    if (!r.error.empty()) {
      s += fmt::format("{:<22} n/a: {}\n", r.name, r.error);
      continue;
    }
    std::string ranks;
    double sum = 0;
    for (const double u : r.rank_us) {
      ranks += fmt::format("{}{:.1f}", ranks.empty() ? "" : " / ", u);
      sum += u;
    }
    const double group = sum + r.exchange_us + r.merge_us;
    s += fmt::format("{:<22} {:>11.1f} {:>26} {:>11.1f} {:>10.1f} {:>11.1f} {:>11.1f} {:>9.2f}x\n",
                     fmt::format("dcp-decode-{}x{}", r.batch, r.len), r.single_us,
                     ranks, r.exchange_us, r.merge_us, group, r.projected_us(),
                     r.projected_us() > 0 ? r.single_us / r.projected_us() : 0.0);
  }
  return s;
}

}  // namespace attnrt::bench
