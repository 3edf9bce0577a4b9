// Communicator over NCCL (communicator.h, docs/dcp.md "Over NCCL"): one rank per GPU, collectives
// enqueued on the rank's stream. NCCL is loaded with dlopen when first used, so the binary starts
// without it; the few entry points and types used are declared here as NCCL 2.x defines them
// (nccl.h: ncclUniqueId of 128 bytes, ncclComm_t an opaque pointer, ncclResult_t / ncclDataType_t /
// ncclRedOp_t enums, ncclFloat32 = 7, ncclSum = 0).
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/runtime/communicator.h"
#include "backends/cuda/cuda_util.h"

namespace attnrt {

namespace {

using NcclComm = struct NcclCommOpaque*;
using NcclResult = int;
constexpr NcclResult kNcclSuccess = 0;
constexpr int kNcclFloat32 = 7;
constexpr int kNcclSum = 0;
struct NcclId {
  char internal[128];
};
static_assert(sizeof(NcclId) == sizeof(NcclUniqueId::bytes));

// The entry points attnrt calls, resolved from the loaded library.
struct NcclApi {
  NcclResult (*get_version)(int*) = nullptr;
  NcclResult (*get_unique_id)(NcclId*) = nullptr;
  NcclResult (*comm_init_rank)(NcclComm*, int, NcclId, int) = nullptr;
  NcclResult (*comm_init_all)(NcclComm*, int, const int*) = nullptr;
  NcclResult (*comm_destroy)(NcclComm) = nullptr;
  NcclResult (*comm_count)(NcclComm, int*) = nullptr;
  NcclResult (*comm_user_rank)(NcclComm, int*) = nullptr;
  NcclResult (*comm_cu_device)(NcclComm, int*) = nullptr;
  const char* (*get_error_string)(NcclResult) = nullptr;
  const char* (*get_last_error)(NcclComm) = nullptr;
  NcclResult (*group_start)() = nullptr;
  NcclResult (*group_end)() = nullptr;
  NcclResult (*send)(const void*, size_t, int, int, NcclComm, cudaStream_t) = nullptr;
  NcclResult (*recv)(void*, size_t, int, int, NcclComm, cudaStream_t) = nullptr;
  NcclResult (*all_gather)(const void*, void*, size_t, int, NcclComm, cudaStream_t) = nullptr;
  NcclResult (*all_reduce)(const void*, void*, size_t, int, int, NcclComm, cudaStream_t) = nullptr;
  std::string path;    // the library loaded
  std::string error;   // why it could not be loaded ("" = loaded)
};

template <typename F>
bool resolve(void* lib, const char* symbol, F& fn, std::string& error) {
  fn = reinterpret_cast<F>(dlsym(lib, symbol));
  if (fn == nullptr && error.empty()) error = std::string("it has no symbol ") + symbol;
  return fn != nullptr;
}

NcclApi load_nccl() {
  NcclApi api;
  std::vector<std::string> tried;
  if (const char* env = std::getenv("ATTNRT_NCCL_LIBRARY"); env != nullptr && *env != '\0') {
    tried.push_back(env);
  } else {
    tried = {"libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2"};
  }
  void* lib = nullptr;
  std::string last;
  for (const std::string& path : tried) {
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) {
      api.path = path;
      break;
    }
    if (const char* e = dlerror()) last = e;
  }
  if (lib == nullptr) {
    std::string list;
    for (const std::string& p : tried) list += (list.empty() ? "" : ", ") + p;
    api.error = "libnccl.so.2 could not be loaded (tried " + list + "; last error: " + last +
                "); install NCCL (the CUDA toolkit's, or PyPI's nvidia-nccl-cu12 / -cu13) and set "
                "ATTNRT_NCCL_LIBRARY to its libnccl.so.2";
    return api;
  }
  std::string missing;
  resolve(lib, "ncclGetVersion", api.get_version, missing);
  resolve(lib, "ncclGetUniqueId", api.get_unique_id, missing);
  resolve(lib, "ncclCommInitRank", api.comm_init_rank, missing);
  resolve(lib, "ncclCommInitAll", api.comm_init_all, missing);
  resolve(lib, "ncclCommDestroy", api.comm_destroy, missing);
  resolve(lib, "ncclCommCount", api.comm_count, missing);
  resolve(lib, "ncclCommUserRank", api.comm_user_rank, missing);
  resolve(lib, "ncclCommCuDevice", api.comm_cu_device, missing);
  resolve(lib, "ncclGetErrorString", api.get_error_string, missing);
  resolve(lib, "ncclGetLastError", api.get_last_error, missing);
  resolve(lib, "ncclGroupStart", api.group_start, missing);
  resolve(lib, "ncclGroupEnd", api.group_end, missing);
  resolve(lib, "ncclSend", api.send, missing);
  resolve(lib, "ncclRecv", api.recv, missing);
  resolve(lib, "ncclAllGather", api.all_gather, missing);
  resolve(lib, "ncclAllReduce", api.all_reduce, missing);
  if (!missing.empty()) {
    api.error = api.path + " is not a usable NCCL 2 library: " + missing;
    return api;
  }
  int version = 0;
  if (api.get_version(&version) != kNcclSuccess || version < 21800) {
    api.error = api.path + " is NCCL " + std::to_string(version) +
                "; attnrt needs NCCL 2.18 or newer (ncclCommInitAll, grouped send / recv)";
  }
  return api;
}

const NcclApi& nccl() {
  static const NcclApi api = load_nccl();
  return api;
}

// The library, checked usable (a CUDA device and the library).
const NcclApi& nccl_checked() {
  const std::string why = nccl_unavailable_reason();
  ATTNRT_CHECK(why.empty(), "NCCL: {}", why);
  return nccl();
}

void check_nccl(NcclResult r, const char* what, NcclComm comm = nullptr) {
  if (r == kNcclSuccess) return;
  const NcclApi& api = nccl();
  const char* last = comm != nullptr ? api.get_last_error(comm) : nullptr;
  fail("NCCL: {} failed: {}{}{}", what, api.get_error_string(r),
       last != nullptr && *last != '\0' ? ": " : "", last != nullptr ? last : "");
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(NcclComm comm, bool owned, cudaStream_t stream)
      : comm_(comm), owned_(owned), stream_(stream) {
    const NcclApi& api = nccl();
    check_nccl(api.comm_count(comm_, &size_), "ncclCommCount", comm_);
    check_nccl(api.comm_user_rank(comm_, &rank_), "ncclCommUserRank", comm_);
    check_nccl(api.comm_cu_device(comm_, &device_), "ncclCommCuDevice", comm_);
  }
  ~NcclCommunicator() override {
    if (barrier_ != nullptr) cudaFree(barrier_);
    if (owned_) nccl().comm_destroy(comm_);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  std::string_view name() const override { return "nccl"; }
  bool device_buffers() const override { return true; }
  int size() const override { return size_; }

  void set_stream(int rank, void* stream) override {
    check_rank(rank, "set_stream");
    const auto s = static_cast<cudaStream_t>(stream);
    // The new stream waits for what the old one has queued (the last collectives, the barrier's
    // zeroing); a capturing stream records instead of running (as in CudaBackend::set_stream).
    if (!cuda::stream_is_capturing(s)) cuda::order_after(s, stream_);
    stream_ = s;
  }
  void* stream(int rank) const override {
    check_rank(rank, "stream");
    return stream_;
  }

  void all_to_all(int rank, std::span<const float> send, std::span<const int64_t> send_counts,
                  std::span<float> recv, std::span<const int64_t> recv_counts) override {
    check_rank(rank, "all_to_all");
    check_all_to_all("nccl", rank, size_, send, send_counts, recv, recv_counts);
    const NcclApi& api = nccl();
    // One group: NCCL pairs each send with the peer's matching receive, self included.
    check_nccl(api.group_start(), "ncclGroupStart");
    int64_t s_off = 0, r_off = 0;
    NcclResult r = kNcclSuccess;
    for (int d = 0; d < size_ && r == kNcclSuccess; ++d) {
      if (send_counts[d] > 0)
        r = api.send(send.data() + s_off, static_cast<size_t>(send_counts[d]), kNcclFloat32, d,
                     comm_, stream_);
      if (r == kNcclSuccess && recv_counts[d] > 0)
        r = api.recv(recv.data() + r_off, static_cast<size_t>(recv_counts[d]), kNcclFloat32, d,
                     comm_, stream_);
      s_off += send_counts[d];
      r_off += recv_counts[d];
    }
    const NcclResult end = api.group_end();
    check_nccl(r, "ncclSend / ncclRecv of all_to_all", comm_);
    check_nccl(end, "ncclGroupEnd of all_to_all", comm_);
  }

  void all_gather(int rank, std::span<const float> send, std::span<float> recv) override {
    check_rank(rank, "all_gather");
    ATTNRT_CHECK(recv.size() >= send.size() * static_cast<size_t>(size_),
                 "nccl communicator: all_gather of rank {} sends {} floats per rank into a buffer "
                 "of {}; it needs {} ({} ranks)",
                 rank, send.size(), recv.size(), send.size() * size_, size_);
    check_nccl(nccl().all_gather(send.data(), recv.data(), send.size(), kNcclFloat32, comm_,
                                 stream_),
               "ncclAllGather", comm_);
  }

  // A one-float all-reduce, then the stream drained: every rank has reached it.
  void barrier(int rank) override {
    check_rank(rank, "barrier");
    ATTNRT_CHECK(!cuda::stream_is_capturing(stream_),
                 "nccl communicator: barrier of rank {} while its stream captures a CUDA graph; a "
                 "barrier waits for the stream on the host, which a capture cannot hold (the "
                 "collectives themselves are captured)",
                 rank);
    if (barrier_ == nullptr) {
      DeviceGuard guard(device_);
      ATTNRT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&barrier_), sizeof(float)));
      ATTNRT_CUDA_CHECK(cudaMemsetAsync(barrier_, 0, sizeof(float), stream_));
    }
    check_nccl(nccl().all_reduce(barrier_, barrier_, 1, kNcclFloat32, kNcclSum, comm_, stream_),
               "ncclAllReduce of barrier", comm_);
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  // Makes `device` current for the scope (cudaMalloc allocates on the current device).
  struct DeviceGuard {
    int prev = 0;
    explicit DeviceGuard(int device) {
      cudaGetDevice(&prev);
      ATTNRT_CUDA_CHECK(cudaSetDevice(device));
    }
    ~DeviceGuard() { cudaSetDevice(prev); }
  };

  void check_rank(int rank, const char* op) const {
    ATTNRT_CHECK(rank == rank_,
                 "nccl communicator: {} called for rank {} on the communicator of rank {} (of {}); "
                 "an NCCL communicator is one rank, its calls pass its own rank",
                 op, rank, rank_, size_);
  }

  NcclComm comm_ = nullptr;
  bool owned_ = false;
  cudaStream_t stream_ = nullptr;
  int size_ = 0, rank_ = 0, device_ = 0;
  float* barrier_ = nullptr;
};

}  // namespace

std::string nccl_unavailable_reason() {
  const CudaDeviceInfo& info = query_cuda();
  if (!info.usable) return "no usable CUDA device (" + info.reason + ")";
  return nccl().error;
}

int nccl_version() {
  const NcclApi& api = nccl();  // the library alone: no GPU needed
  ATTNRT_CHECK(api.error.empty(), "NCCL: {}", api.error);
  int version = 0;
  check_nccl(api.get_version(&version), "ncclGetVersion");
  return version;
}

NcclUniqueId nccl_unique_id() {
  NcclId id{};
  check_nccl(nccl_checked().get_unique_id(&id), "ncclGetUniqueId");
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), id.internal, sizeof id.internal);
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int size, int rank,
                                                     int device, void* stream) {
  const NcclApi& api = nccl_checked();
  const int devices = query_cuda().device_count;
  ATTNRT_CHECK(size >= 1 && rank >= 0 && rank < size,
               "nccl communicator: rank {} of a group of {}; ranks are 0..size-1, size >= 1", rank,
               size);
  ATTNRT_CHECK(device >= 0 && device < devices,
               "nccl communicator: device {}; this machine has CUDA devices 0..{}", device,
               devices - 1);
  int prev = 0;
  cudaGetDevice(&prev);
  ATTNRT_CUDA_CHECK(cudaSetDevice(device));
  NcclId nid;
  std::memcpy(nid.internal, id.bytes.data(), sizeof nid.internal);
  NcclComm comm = nullptr;
  const NcclResult r = api.comm_init_rank(&comm, size, nid, rank);
  cudaSetDevice(prev);
  check_nccl(r, "ncclCommInitRank");
  return std::make_unique<NcclCommunicator>(comm, /*owned=*/true,
                                            static_cast<cudaStream_t>(stream));
}

std::vector<std::unique_ptr<Communicator>> make_nccl_group(std::span<const int> devices,
                                                           std::span<void* const> streams) {
  const NcclApi& api = nccl_checked();
  const int count = query_cuda().device_count;
  ATTNRT_CHECK(!devices.empty() && (streams.empty() || streams.size() == devices.size()),
               "nccl group: {} devices and {} streams; give at least one device and no streams "
               "or one per device",
               devices.size(), streams.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    ATTNRT_CHECK(devices[i] >= 0 && devices[i] < count,
                 "nccl group: device {} (rank {}); this machine has CUDA devices 0..{}",
                 devices[i], i, count - 1);
    for (size_t j = 0; j < i; ++j) {
      ATTNRT_CHECK(devices[j] != devices[i],
                   "nccl group: ranks {} and {} are both on device {}; NCCL takes one GPU per "
                   "rank (simulated ranks on one device: InProcessCommunicator)",
                   j, i, devices[i]);
    }
  }
  std::vector<NcclComm> comms(devices.size());
  check_nccl(api.comm_init_all(comms.data(), static_cast<int>(devices.size()), devices.data()),
             "ncclCommInitAll");
  std::vector<std::unique_ptr<Communicator>> out;
  for (size_t i = 0; i < comms.size(); ++i) {
    out.push_back(std::make_unique<NcclCommunicator>(
        comms[i], /*owned=*/true,
        streams.empty() ? nullptr : static_cast<cudaStream_t>(streams[i])));
  }
  return out;
}

std::unique_ptr<Communicator> wrap_nccl_comm(void* nccl_comm, void* stream) {
  nccl_checked();
  ATTNRT_CHECK(nccl_comm != nullptr, "nccl communicator: wrap_nccl_comm of a null ncclComm_t");
  return std::make_unique<NcclCommunicator>(static_cast<NcclComm>(nccl_comm), /*owned=*/false,
                                            static_cast<cudaStream_t>(stream));
}

}  // namespace attnrt
