// Communicator: the collectives a DCP group (docs/dcp.md) exchanges its partial outputs with.
// Every rank of a group makes the same sequence of calls, each with its own rank index and
// buffers. A collective completes once every rank has made its call; the receive buffers hold the
// data from then on (in process: when the last rank's call returns; over NCCL: when the stream
// reaches the collective). Send and receive buffers must stay valid until the collective completes.
// Blocks are in rank order on both sides.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
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
};

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

// kind "in_process": InProcessCommunicator(size). kind "nccl": one rank per GPU over NCCL, which
// this build does not contain: throws attnrt::Error saying so (docs/dcp.md, the GPU part). Any
// other kind: attnrt::Error listing the kinds.
std::unique_ptr<Communicator> make_communicator(std::string_view kind, int size);

}  // namespace attnrt
