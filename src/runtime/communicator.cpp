#include "attnrt/runtime/communicator.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <string>

#include "attnrt/core/error.h"

namespace attnrt {

namespace {

enum class Op { none, all_to_all, all_gather, barrier };

const char* op_name(Op op) {
  switch (op) {
    case Op::all_to_all:
      return "all_to_all";
    case Op::all_gather:
      return "all_gather";
    case Op::barrier:
      return "barrier";
    case Op::none:
      break;
  }
  return "none";
}

struct Call {
  std::span<const float> send;
  std::vector<int64_t> send_counts;
  std::span<float> recv;
  std::vector<int64_t> recv_counts;
};

}  // namespace

void check_all_to_all(std::string_view who, int rank, int size, std::span<const float> send,
                      std::span<const int64_t> send_counts, std::span<float> recv,
                      std::span<const int64_t> recv_counts) {
  const auto n = static_cast<size_t>(size);
  ATTNRT_CHECK(send_counts.size() == n && recv_counts.size() == n,
               "{} communicator: all_to_all of rank {} has {} send and {} recv counts; the group "
               "has {} ranks",
               who, rank, send_counts.size(), recv_counts.size(), n);
  int64_t send_total = 0, recv_total = 0;
  for (size_t d = 0; d < n; ++d) {
    ATTNRT_CHECK(send_counts[d] >= 0 && recv_counts[d] >= 0,
                 "{} communicator: all_to_all of rank {}: counts for rank {} are {} / {}; counts "
                 "are >= 0",
                 who, rank, d, send_counts[d], recv_counts[d]);
    send_total += send_counts[d];
    recv_total += recv_counts[d];
  }
  ATTNRT_CHECK(send_total <= static_cast<int64_t>(send.size()) &&
                   recv_total <= static_cast<int64_t>(recv.size()),
               "{} communicator: all_to_all of rank {} sends {} floats from a buffer of {} and "
               "receives {} into a buffer of {}",
               who, rank, send_total, send.size(), recv_total, recv.size());
}

struct InProcessCommunicator::State {
  int size = 0;
  bool blocking = false;
  std::mutex mutex;
  std::condition_variable done;
  uint64_t generation = 0;  // collectives completed
  std::string error;        // why the last collective failed ("" = it did not)
  Op pending = Op::none;
  int arrived = 0;
  std::vector<uint8_t> called;
  std::vector<Call> calls;

  // Records rank's call of `op`; true when it is the last one (the caller then moves the data).
  bool arrive(Op op, int rank, Call call) {
    ATTNRT_CHECK(rank >= 0 && rank < size,
                 "in_process communicator: rank {}; the group has ranks 0..{}", rank, size - 1);
    ATTNRT_CHECK(pending == Op::none || pending == op,
                 "in_process communicator: rank {} called {} while {} is pending; every rank must "
                 "make the same sequence of collectives",
                 rank, op_name(op), op_name(pending));
    ATTNRT_CHECK(!called[rank],
                 "in_process communicator: rank {} called {} twice before ranks {} of {} joined",
                 rank, op_name(op), size - arrived, size);
    pending = op;
    called[rank] = 1;
    calls[rank] = std::move(call);
    return ++arrived == size;
  }

  // The last rank's call: the collective is over (failed, with `why`, when not empty).
  void complete(std::string why = {}) {
    pending = Op::none;
    arrived = 0;
    std::fill(called.begin(), called.end(), uint8_t{0});
    for (Call& c : calls) c = Call{};
    error = std::move(why);
    ++generation;
    done.notify_all();
  }

  // An earlier rank's call: with blocking ranks, waits until collective `gen` is over.
  void wait(std::unique_lock<std::mutex>& lock, uint64_t gen) {
    if (!blocking) return;
    done.wait(lock, [&] { return generation != gen; });
    if (generation == gen + 1 && !error.empty()) fail("{}", error);
  }

  [[noreturn]] void abort(std::string why) {
    complete(why);
    fail("{}", why);
  }
};

InProcessCommunicator::InProcessCommunicator(int size, bool blocking)
    : state_(std::make_unique<State>()) {
  ATTNRT_CHECK(size >= 1, "in_process communicator: size {}; a group has at least 1 rank", size);
  state_->size = size;
  state_->blocking = blocking;
  state_->called.assign(size, 0);
  state_->calls.resize(size);
}

InProcessCommunicator::~InProcessCommunicator() = default;

int InProcessCommunicator::size() const { return state_->size; }

void InProcessCommunicator::all_to_all(int rank, std::span<const float> send,
                                       std::span<const int64_t> send_counts, std::span<float> recv,
                                       std::span<const int64_t> recv_counts) {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  check_all_to_all("in_process", rank, s.size, send, send_counts, recv, recv_counts);
  const auto n = static_cast<size_t>(s.size);
  Call call{send,
            {send_counts.begin(), send_counts.end()},
            recv,
            {recv_counts.begin(), recv_counts.end()}};
  const uint64_t gen = s.generation;
  if (!s.arrive(Op::all_to_all, rank, std::move(call))) return s.wait(lock, gen);
  // Every rank has called: check that the counts pair up, then move block (src -> dst).
  for (size_t src = 0; src < n; ++src) {
    for (size_t dst = 0; dst < n; ++dst) {
      const int64_t a = s.calls[src].send_counts[dst], b = s.calls[dst].recv_counts[src];
      if (a != b) {
        s.abort(
            fmt::format("in_process communicator: all_to_all: rank {} sends {} floats to "
                        "rank {}, which expects {}",
                        src, a, dst, b));
      }
    }
  }
  for (size_t src = 0; src < n; ++src) {
    int64_t at = 0;
    for (size_t dst = 0; dst < n; ++dst) {
      int64_t into = 0;
      for (size_t k = 0; k < src; ++k) into += s.calls[dst].recv_counts[k];
      const int64_t count = s.calls[src].send_counts[dst];
      std::copy_n(s.calls[src].send.data() + at, count, s.calls[dst].recv.data() + into);
      at += count;
    }
  }
  s.complete();
}

void InProcessCommunicator::all_gather(int rank, std::span<const float> send,
                                       std::span<float> recv) {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  const auto n = static_cast<size_t>(s.size);
  ATTNRT_CHECK(recv.size() >= n * send.size(),
               "in_process communicator: all_gather of rank {} sends {} floats but its recv buffer "
               "holds {}; it needs {} ranks x {}",
               rank, send.size(), recv.size(), n, send.size());
  const uint64_t gen = s.generation;
  if (!s.arrive(Op::all_gather, rank, Call{send, {}, recv, {}})) return s.wait(lock, gen);
  for (size_t src = 0; src < n; ++src) {
    if (s.calls[src].send.size() != send.size()) {
      s.abort(
          fmt::format("in_process communicator: all_gather: rank {} sends {} floats, rank {} "
                      "sends {}; every rank sends the same count",
                      src, s.calls[src].send.size(), rank, send.size()));
    }
  }
  for (size_t dst = 0; dst < n; ++dst) {
    for (size_t src = 0; src < n; ++src) {
      std::copy(s.calls[src].send.begin(), s.calls[src].send.end(),
                s.calls[dst].recv.begin() + static_cast<std::ptrdiff_t>(src * send.size()));
    }
  }
  s.complete();
}

void InProcessCommunicator::barrier(int rank) {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  const uint64_t gen = s.generation;
  if (!s.arrive(Op::barrier, rank, Call{})) return s.wait(lock, gen);
  s.complete();
}

std::unique_ptr<Communicator> make_communicator(std::string_view kind, int size) {
  if (kind == "in_process") return std::make_unique<InProcessCommunicator>(size);
  if (kind == "nccl") {
    const std::string why = nccl_unavailable_reason();
    ATTNRT_CHECK(why.empty(),
                 "communicator 'nccl': {}; a DCP group across GPUs needs NCCL and one GPU per rank "
                 "({} here). Use 'in_process' (simulated ranks on host backends, docs/dcp.md)",
                 why, size);
    fail("communicator 'nccl' of {} ranks: an NCCL rank needs its rank, device and the group's "
         "id; use make_nccl_communicator(nccl_unique_id(), {}, rank, device) in each rank's "
         "thread or process, or make_nccl_group(devices) (docs/dcp.md)",
         size, size);
  }
  if (kind == "device_in_process") return make_device_in_process_communicator(size);
  fail("communicator '{}' is unknown; kinds: in_process, device_in_process, nccl", kind);
}

}  // namespace attnrt
