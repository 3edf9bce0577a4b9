// Communicator: the collectives a DCP group (docs/dcp.md) exchanges its partial outputs with.
// Every rank of a group makes the same sequence of calls, each with its own rank index and
// buffers. A collective completes once every rank has made its call; the receive buffers hold the
// data from then on (in process: when the last rank's call returns; over NCCL: when the stream
// reaches the collective). Send and receive buffers must stay valid until the collective completes.
// Blocks are in rank order on both sides.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace attnrt {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual std::string_view name() const = 0;
  virtual int size() const = 0;
  // send = size() blocks, block d (send_counts[d] floats) goes to rank d; recv = size() blocks,
  // block s (recv_counts[s] floats) comes from rank s. send_counts[d] of rank s must equal
  // recv_counts[s] of rank d.
  virtual void all_to_all(int rank, std::span<const float> send,
                          std::span<const int64_t> send_counts, std::span<float> recv,
                          std::span<const int64_t> recv_counts) = 0;
  // Every rank sends send.size() floats (the same count on every rank); recv holds size() such
  // blocks, rank order.
  virtual void all_gather(int rank, std::span<const float> send, std::span<float> recv) = 0;
  virtual void barrier(int rank) = 0;
  // Whether the buffers are GPU memory (nccl, device_in_process) rather than host memory.
  virtual bool device_buffers() const { return false; }
  // Device communicators: the CUDA stream (a cudaStream_t; nullptr = the legacy default stream)
  // rank `rank`'s later collectives are enqueued on, ordered after what its old stream still has
  // queued. A DcpRank puts its communicator on the rank's own stream (DcpRank::set_stream), so the
  // exchange is in stream order with the partial before it and the merge after it, with no event
  // and no host wait. Host communicators have no stream: nothing changes, stream() is nullptr.
  virtual void set_stream(int /*rank*/, void* /*stream*/) {}
  virtual void* stream(int /*rank*/) const { return nullptr; }
};

// For Communicator implementations: the checks of an all_to_all call (a count per rank on both
// sides, none negative, the buffers large enough), errors starting "<who> communicator:".
void check_all_to_all(std::string_view who, int rank, int size, std::span<const float> send,
                      std::span<const int64_t> send_counts, std::span<float> recv,
                      std::span<const int64_t> recv_counts);

// n simulated ranks in one process. The data moves when the last rank of a collective calls.
// blocking = false: the ranks are served one after another from one thread; a call returns at
// once. blocking = true: each rank runs on a thread of its own; a call returns when the collective
// has completed (as a rank of NCCL sees it). Mismatched calls (another collective while one is
// pending, a rank calling twice, counts that do not pair up) throw attnrt::Error naming the ranks
// and values (a failed collective throws on every waiting rank too).
class InProcessCommunicator final : public Communicator {
 public:
  explicit InProcessCommunicator(int size, bool blocking = false);
  ~InProcessCommunicator() override;
  std::string_view name() const override { return "in_process"; }
  int size() const override;
  void all_to_all(int rank, std::span<const float> send, std::span<const int64_t> send_counts,
                  std::span<float> recv, std::span<const int64_t> recv_counts) override;
  void all_gather(int rank, std::span<const float> send, std::span<float> recv) override;
  void barrier(int rank) override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// n simulated ranks on ONE GPU (docs/dcp.md "Ranks on one GPU"), served one after another from
// one thread: buffers are device memory of the current device; a collective's blocks are copied
// (cudaMemcpyAsync, device to device) on each receiving rank's stream once the last rank has
// called, ordered after every rank's call by events, and every rank's stream then waits for all
// copies. streams: one cudaStream_t per rank, or empty for the legacy default stream; set_stream
// moves one rank (not while a collective it joined is pending). NCCL cannot
// put two ranks on one GPU; this is how DcpAttention runs `cuda` ranks in one process. A build
// without CUDA throws.
std::unique_ptr<Communicator> make_device_in_process_communicator(
    int size, std::span<void* const> streams = {});

// kind "in_process": InProcessCommunicator(size); "device_in_process": the above on the legacy
// default stream. kind "nccl" needs a rank, a device and the
// group's id: an attnrt::Error pointing at make_nccl_communicator (or saying why NCCL cannot be
// used here). Any other kind: attnrt::Error listing the kinds.
std::unique_ptr<Communicator> make_communicator(std::string_view kind, int size);

// ---- NCCL (docs/dcp.md "Over NCCL") ------------------------------------------------------------
// One rank per GPU. A communicator over NCCL is ONE rank of its group: its calls take that rank's
// index (anything else is an error), their buffers are device memory of its GPU, and they are
// enqueued on its stream and return at once (barrier() also waits for the stream); set_stream
// changes that stream (a DcpRank puts it on the rank's). NCCL is loaded
// when first needed (dlopen of libnccl.so.2: $ATTNRT_NCCL_LIBRARY, else the loader's search path,
// else the CUDA toolkit's lib folders), so attnrt starts and runs without it.

// NCCL's unique id of a group: made by one process (nccl_unique_id), handed to every rank by the
// engine's own means (it is plain bytes).
struct NcclUniqueId {
  std::array<char, 128> bytes{};
};

// "" when NCCL can be used here (a CUDA build, a usable CUDA device, the library loaded); else why
// not, in words that say what to change.
std::string nccl_unavailable_reason();
// The library's version as NCCL writes it (e.g. 22807 for 2.28.7), GPU or not; throws when the
// library cannot be loaded.
int nccl_version();
NcclUniqueId nccl_unique_id();

// Joins the group `id` as `rank` of `size` on CUDA device `device` (ncclCommInitRank: blocks until
// every rank has joined, so the ranks of one process must call from threads of their own).
// `stream` is the cudaStream_t collectives go to (null: the device's legacy default stream).
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int size, int rank,
                                                     int device, void* stream = nullptr);
// Every rank of a group in this process at once, rank i on devices[i] (ncclCommInitAll); streams
// empty or one per device.
std::vector<std::unique_ptr<Communicator>> make_nccl_group(std::span<const int> devices,
                                                           std::span<void* const> streams = {});
// A communicator over an ncclComm_t the engine created (its rank and size are the comm's); the
// engine keeps ownership and destroys the comm after this object.
std::unique_ptr<Communicator> wrap_nccl_comm(void* nccl_comm, void* stream = nullptr);

}  // namespace attnrt
