#include "bench/harness/cuda_bench.h"

#include <cublas_api.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attnrt/core/device.h"
#include "attnrt/core/dtype.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/kernels/l2_evict.h"
#include "bench/harness/timing.h"

namespace attnrt::cuda {

namespace {

// At least 4x the L2 (50 MiB on an H200), so that a repetition reads from HBM as it would after the
// other layers of a step ran.
size_t flush_bytes() {
  int device = 0, l2 = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
  return std::max<size_t>(size_t{256} << 20, size_t{4} * static_cast<size_t>(l2));
}

// The L2 flush before every timed GPU call of `attnrt bench`, in the mode ATTNRT_BENCH_FLUSH names
// (bench::gpu_flush_from_env): a memset of the buffer (write) or a read of it (clean). The flush
// buffer is written once here, so that the clean flush reads defined data.
class L2Flush {
 public:
  L2Flush() : mode_(bench::gpu_flush_from_env()), buffer_(flush_bytes()), sink_(sizeof(uint32_t)) {
    ATTNRT_CUDA_CHECK(cudaMemset(buffer_.data(), 0, buffer_.bytes()));
    // The flush may run on a non-blocking stream, which does not wait for the legacy one.
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }

  // Stream-ordered on `stream`, before the timed call's start event, so it is not timed.
  void run(cudaStream_t stream) {
    if (mode_ == bench::GpuFlush::write) {
      ATTNRT_CUDA_CHECK(cudaMemsetAsync(buffer_.data(), ++round_ & 0xff, buffer_.bytes(), stream));
    } else {
      ATTNRT_CUDA_CHECK(
          evict_l2_by_reading(buffer_.data(), buffer_.bytes(), sink_.ptr<uint32_t>(), stream));
    }
  }

  // e.g. "256 MiB read to evict the L2 (ATTNRT_BENCH_FLUSH=clean)".
  std::string describe() const {
    return fmt::format("{} MiB {} to evict the L2 (ATTNRT_BENCH_FLUSH={})", buffer_.bytes() >> 20,
                       mode_ == bench::GpuFlush::write ? "written" : "read",
                       bench::gpu_flush_name(mode_));
  }

 private:
  bench::GpuFlush mode_;
  DeviceBuffer buffer_, sink_;
  int round_ = 0;
};

// A start and a stop event: the GPU seconds of what one call of a body queues on a stream.
class EventPair {
 public:
  EventPair() {
    ATTNRT_CUDA_CHECK(cudaEventCreate(&start_));
    ATTNRT_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~EventPair() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;

  template <typename Body>
  double seconds(cudaStream_t stream, Body&& body) {
    ATTNRT_CUDA_CHECK(cudaEventRecord(start_, stream));
    body();
    ATTNRT_CUDA_CHECK(cudaEventRecord(stop_, stream));
    ATTNRT_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    ATTNRT_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms * 1e-3;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Events around `body` on `stream`, each repetition after an L2 flush; seconds per repetition.
template <typename Body>
std::vector<double> event_seconds(cudaStream_t stream, L2Flush& flush, int warmup, int repeats,
                                  Body&& body) {
  EventPair events;
  for (int i = 0; i < warmup; ++i) body();
  std::vector<double> seconds;
  for (int i = 0; i < repeats; ++i) {
    flush.run(stream);
    seconds.push_back(events.seconds(stream, body));
  }
  return seconds;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Random finite bf16 in [-1, 1): one random host block, tiled over the buffer, on `stream` (the
// GEMM's) and complete on return.
void fill_bf16(void* dst, size_t bytes, uint64_t seed, cudaStream_t stream) {
  const size_t block = std::min<size_t>(bytes, size_t{16} << 20);
  std::vector<uint16_t> host(block / 2);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (uint16_t& x : host) x = float_to_bf16(u(rng));
  for (size_t off = 0; off < bytes; off += block) {
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + off, host.data(),
                                      std::min(block, bytes - off), cudaMemcpyHostToDevice,
                                      stream));
  }
  ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// The cuBLAS entry points the GEMM probe calls, resolved from the shared library at run time.
struct Cublas {
  using Create = cublasStatus_t (*)(cublasHandle_t*);
  using Destroy = cublasStatus_t (*)(cublasHandle_t);
  using SetStream = cublasStatus_t (*)(cublasHandle_t, cudaStream_t);
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                    int, const void*, const void*, cudaDataType, int, const void*,
                                    cudaDataType, int, const void*, void*, cudaDataType, int,
                                    cublasComputeType_t, cublasGemmAlgo_t);
  void* lib = nullptr;
  Create create = nullptr;
  Destroy destroy = nullptr;
  SetStream set_stream = nullptr;
  GemmEx gemm = nullptr;
  std::string error;

  Cublas() {
    for (const char* name : {"libcublas.so", "libcublas.so.13", "libcublas.so.12"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      error = "cuBLAS (libcublas.so) could not be loaded; install the CUDA toolkit's cuBLAS";
      return;
    }
    create = reinterpret_cast<Create>(dlsym(lib, "cublasCreate_v2"));
    destroy = reinterpret_cast<Destroy>(dlsym(lib, "cublasDestroy_v2"));
    set_stream = reinterpret_cast<SetStream>(dlsym(lib, "cublasSetStream_v2"));
    gemm = reinterpret_cast<GemmEx>(dlsym(lib, "cublasGemmEx"));
    if (!create || !destroy || !set_stream || !gemm) error = "cuBLAS lacks cublasGemmEx";
  }
  ~Cublas() {
    if (lib != nullptr) dlclose(lib);
  }
};

class EventTimer final : public bench::DeviceTimer {
 public:
  EventTimer() {
    const CudaDeviceInfo& info = query_cuda();
    ATTNRT_CHECK(info.usable, "CUDA timer: no usable CUDA device ({})", info.reason);
    flush_.emplace();
    events_.emplace();
  }

  double time(const std::function<void()>& body) override {
    return events_->seconds(nullptr, body);
  }

  void flush_caches() override { flush_->run(nullptr); }

  std::string method() const override {
    return "CUDA events around each call on the default stream; between repetitions, " +
           flush_->describe();
  }

 private:
  // Made once the device is known to be usable.
  std::optional<L2Flush> flush_;
  std::optional<EventPair> events_;
};

}  // namespace

bench::Ceilings measure_gpu_ceilings(Device device, const bench::CeilingOptions& options) {
  const CudaDeviceInfo& info = query_cuda();
  ATTNRT_CHECK(info.usable, "GPU ceilings: no usable CUDA device ({})", info.reason);
  ATTNRT_CUDA_CHECK(cudaSetDevice(device.index));
  bench::Ceilings c;
  c.device = device;
  c.threads = bench::resolve_threads(options.threads);
  const int repeats = std::max(options.passes, 10);
  cudaStream_t stream = nullptr;
  ATTNRT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  L2Flush flush;

  // Copy: at least 4 GiB (a quarter of the memory on small GPUs), read + written.
  {
    const size_t bytes = std::min<size_t>(size_t{4} << 30, info.total_memory / 4) & ~size_t{255};
    DeviceBuffer a(bytes), b(bytes);
    ATTNRT_CUDA_CHECK(cudaMemsetAsync(a.data(), 1, bytes, stream));
    const double t = median(event_seconds(stream, flush, 2, repeats, [&] {
      ATTNRT_CUDA_CHECK(
          cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, stream));
    }));
    c.memory.value = 2.0 * static_cast<double>(bytes) / t / 1e9;
    c.memory.method = fmt::format(
        "device-to-device copy of {:.2f} GiB, bytes read + written, median of {}; before each, {}",
        static_cast<double>(bytes) / double(1ull << 30), repeats, flush.describe());
  }

  // Gathers: kGatherRowBytes-byte rows of a pool of min(1 GiB, memory / 8), read once each, at a
  // random permutation of the slots and in slot order (bytes read).
  {
    constexpr int row = bench::kGatherRowBytes;
    const int64_t n =
        static_cast<int64_t>(std::min<size_t>(size_t{1} << 30, info.total_memory / 8) / row);
    DeviceBuffer pool(static_cast<size_t>(n) * row), slots(static_cast<size_t>(n) * 4), sink(4);
    ATTNRT_CUDA_CHECK(cudaMemsetAsync(pool.data(), 3, pool.bytes(), stream));
    std::vector<int32_t> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    auto time_gather = [&] {
      ATTNRT_CUDA_CHECK(cudaMemcpyAsync(slots.data(), order.data(), slots.bytes(),
                                        cudaMemcpyHostToDevice, stream));
      ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const double t = median(event_seconds(stream, flush, 2, repeats, [&] {
        ATTNRT_CUDA_CHECK(gather_rows_by_reading(pool.data(), slots.ptr<int32_t>(), n, row,
                                                 sink.ptr<uint32_t>(), stream));
      }));
      return static_cast<double>(n) * row / t / 1e9;
    };
    c.gather_ordered.value = time_gather();
    std::shuffle(order.begin(), order.end(), std::mt19937_64(17));
    c.gather_random.value = time_gather();
    const std::string what = fmt::format(
        "reads of {} {}-byte rows ({:.2f} GiB), one warp a row, bytes read, median of {}; before "
        "each, {}",
        n, row, static_cast<double>(n) * row / double(1ull << 30), repeats, flush.describe());
    c.gather_random.method =
        fmt::format("at a random permutation of the slots ({:.0f}% of the same rows in order): {}",
                    100 * c.gather_random.value / c.gather_ordered.value, what);
    c.gather_ordered.method = "in slot order: " + what;
  }

  c.fp32.unavailable = "not measured on GPUs: bf16 attention rows are held against the bf16 GEMM";
  Cublas blas;
  if (!blas.error.empty()) {
    c.bf16.unavailable = blas.error;
  } else {
    constexpr int n = 8192;
    const size_t bytes = size_t{2} * n * n;
    DeviceBuffer a(bytes), b(bytes), out(bytes);
    fill_bf16(a.data(), bytes, 1, stream);
    fill_bf16(b.data(), bytes, 2, stream);
    cublasHandle_t handle = nullptr;
    if (blas.create(&handle) != CUBLAS_STATUS_SUCCESS) {
      c.bf16.unavailable = "cublasCreate failed";
    } else {
      blas.set_stream(handle, stream);
      const float one = 1.f, zero = 0.f;
      cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
      const double t = median(event_seconds(stream, flush, 2, repeats, [&] {
        const cublasStatus_t s =
            blas.gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.data(), CUDA_R_16BF, n,
                      b.data(), CUDA_R_16BF, n, &zero, out.data(), CUDA_R_16BF, n,
                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (s != CUBLAS_STATUS_SUCCESS) status = s;
      }));
      blas.destroy(handle);
      if (status != CUBLAS_STATUS_SUCCESS) {
        c.bf16.unavailable =
            fmt::format("cublasGemmEx failed (status {})", static_cast<int>(status));
      } else {
        c.bf16.value = 2.0 * n * double(n) * n / t / 1e9;
        c.bf16.method =
            fmt::format("cuBLAS bf16 GEMM {}^3 (fp32 accumulation), median of {}; before each, {}",
                        n, repeats, flush.describe());
      }
    }
  }
  ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
  return c;
}

void register_cuda_bench_probes() {
  bench::register_ceiling_probe(DeviceKind::cuda, measure_gpu_ceilings);
  bench::register_device_timer(DeviceKind::cuda,
                               [] { return std::unique_ptr<bench::DeviceTimer>(new EventTimer); });
}

}  // namespace attnrt::cuda
