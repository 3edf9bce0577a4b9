// DCP ranks on one GPU (docs/dcp.md "Ranks on one GPU"): a rank's device work (gather, pack,
// merge: kernels/dcp.h) and the in-process communicator of device buffers, which copies each
// all-to-all block with cudaMemcpyAsync on the receiving rank's stream once every rank has called.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attnrt/core/error.h"
#include "attnrt/runtime/communicator.h"
#include "attnrt/runtime/dcp.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/kernels/dcp.h"
#include "src/runtime/dcp_device.h"

namespace attnrt {

namespace {

using cuda::DeviceBuffer;

bool is_device_memory(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

// An eager step's buffer: grown stream-ordered (cudaFreeAsync: the old buffer goes once the work
// queued before on `stream` has read it, and the host never waits); the contents are rewritten by
// every call anyway. A capturing stream would record the allocation and free, and a graph must
// read fixed buffers: that is refused.
void grow(DeviceBuffer& buf, size_t bytes, cudaStream_t stream, const char* what) {
  if (buf.bytes() >= bytes) return;
  ATTNRT_CHECK(!cuda::stream_is_capturing(stream),
               "DCP rank: the {} buffer must grow from {} to {} bytes while the stream captures a "
               "CUDA graph; capture steps begun with begin_capture_step after "
               "init_cuda_graph_state, whose buffers are fixed",
               what, buf.bytes(), bytes);
  buf.reserve_async(std::max(bytes, buf.bytes() * 2), stream);
}

// A graph step's buffer: allocated by reserve_graph, never grown (a captured graph holds its
// address).
void fits(const DeviceBuffer& buf, size_t bytes, const char* what) {
  ATTNRT_CHECK(buf.bytes() >= bytes,
               "DCP rank: a CUDA-graph step needs {} bytes of {}, but init_cuda_graph_state "
               "reserved {} (activations at the model's dtype, steps of up to its max_num_tokens); "
               "pass activations of the model's dtype",
               bytes, what, buf.bytes());
}

int32_t act_code(const TensorView& t, const char* what) {
  ATTNRT_CHECK(t.dtype == DType::f32 || t.dtype == DType::f16 || t.dtype == DType::bf16,
               "DcpAttention on the GPU: {} is {}; expected fp32, fp16 or bf16", what,
               t.describe());
  return static_cast<int32_t>(t.dtype);
}

class CudaDcpRank final : public DcpDeviceRank {
 public:
  explicit CudaDcpRank(void* stream) : stream_(static_cast<cudaStream_t>(stream)) {}

  void set_stream(void* stream) override {
    const auto s = static_cast<cudaStream_t>(stream);
    // The buffers' last readers (the merge, the exchange) and the staged uploads on the old
    // stream come first; a capturing stream records instead (as in CudaBackend::set_stream).
    if (!cuda::stream_is_capturing(s)) cuda::order_after(s, stream_);
    stream_ = s;
  }

  void set_entries(int list, std::span<const int64_t> rows, int64_t tokens) override {
    entries_ = static_cast<int64_t>(rows.size());
    tokens_ = tokens;
    set_ = &eager_;
    if (static_cast<size_t>(list) >= lists_.size()) lists_.resize(list + 1);
    List& l = lists_[list];
    index_ = &l.index;
    if (l.tokens == tokens && std::equal(rows.begin(), rows.end(), l.rows.begin(), l.rows.end()))
      return;  // the same entries as last time (the step's other layers, steady decodes)
    l.rows.assign(rows.begin(), rows.end());
    l.tokens = tokens;
    const size_t count = static_cast<size_t>(entries_ + tokens);
    const size_t bytes = std::max<size_t>(1, count) * sizeof(int64_t);
    grow(l.index, bytes, stream_, "entry list");
    upload_list(l.index, rows, entries_, tokens);
  }

  void reserve_graph(const DcpGraphSizes& sizes) override {
    ATTNRT_CHECK(graph_tokens_ == 0 || graph_tokens_ == sizes.tokens,
                 "DCP rank: graph buffers of {} tokens exist; a captured graph reads them, so "
                 "they are not made again for {}",
                 graph_tokens_, sizes.tokens);
    if (graph_tokens_ == sizes.tokens) return;
    ATTNRT_CHECK(!capturing(),
                 "DCP rank: init_cuda_graph_state while the stream captures a CUDA graph; call it "
                 "before any capture");
    // Plain allocations (cudaMalloc), once, before any capture: their addresses hold for every
    // stream the rank moves to, as the graphs recorded them.
    const std::pair<DeviceBuffer*, size_t> parts[] = {
        {&graph_.rows[0], sizes.gather[0]}, {&graph_.rows[1], sizes.gather[1]},
        {&graph_.rows[2], sizes.gather[2]}, {&graph_.out, sizes.out},
        {&graph_.lse, sizes.lse},           {&graph_.send, sizes.send},
        {&graph_.recv, sizes.recv}};
    for (const auto& [buf, bytes] : parts) buf->reserve(std::max<size_t>(bytes, 1));
    graph_lists_.resize(static_cast<size_t>(sizes.parts));
    for (DeviceBuffer& l : graph_lists_) l.reserve(sizes.index);
    graph_tokens_ = sizes.tokens;
  }

  void set_graph_entries(int list, std::span<const int64_t> rows, int64_t tokens) override {
    ATTNRT_CHECK(list >= 0 && static_cast<size_t>(list) < graph_lists_.size() && tokens >= 1 &&
                     tokens <= graph_tokens_,
                 "DCP rank: graph entry list {} of {} tokens; init_cuda_graph_state made {} lists "
                 "of up to {} tokens",
                 list, tokens, graph_lists_.size(), graph_tokens_);
    upload_list(graph_lists_[list], rows, tokens, tokens);
  }

  void use_graph_entries(int list, int64_t tokens) override {
    ATTNRT_CHECK(list >= 0 && static_cast<size_t>(list) < graph_lists_.size() && tokens >= 1 &&
                     tokens <= graph_tokens_,
                 "DCP rank: a graph step of {} tokens on list {}; init_cuda_graph_state made {} "
                 "lists of up to {} tokens",
                 tokens, list, graph_lists_.size(), graph_tokens_);
    entries_ = tokens;
    tokens_ = tokens;
    index_ = &graph_lists_[list];
    set_ = &graph_;
  }

  bool capturing() const override { return cuda::stream_is_capturing(stream_); }
  bool on_device(const void* p) const override { return is_device_memory(p); }

  TensorView gather(int slot, const TensorView& src) override {
    ATTNRT_CHECK(src.device.kind == DeviceKind::cuda && src.ndim == 3 && src.strides[2] == 1,
                 "DcpAttention on the GPU: an input is {}; expected a GPU tensor [T, H, D] with a "
                 "contiguous last dim",
                 src.describe());
    const int32_t code = act_code(src, "an input");
    DeviceBuffer& buf = set_->rows[slot];
    const int64_t per_row = src.shape[1] * src.shape[2];
    need(buf, std::max<size_t>(1, entries_ * per_row) * dtype_size(src.dtype), "gathered rows");
    cuda::DcpGatherParams p{};
    p.src = src.data;
    p.src_stride_tok = src.strides[0];
    p.src_stride_head = src.strides[1];
    p.dtype = code;
    p.heads = static_cast<int32_t>(src.shape[1]);
    p.dim = static_cast<int32_t>(src.shape[2]);
    p.rows = index_->ptr<int64_t>();
    p.count = entries_;
    p.dst = buf.data();
    ATTNRT_CUDA_CHECK(cuda::launch_dcp_gather(p, stream_));
    return TensorView(buf.data(), src.dtype, {entries_, src.shape[1], src.shape[2]}, src.device);
  }

  TensorView partial_out(DType dtype, int64_t entries, int hq, int dv) override {
    need(set_->out, std::max<size_t>(1, entries * hq * dv) * dtype_size(dtype), "partial output");
    out_dtype_ = dtype;
    return TensorView(set_->out.data(), dtype, {entries, hq, dv}, device());
  }

  TensorView partial_lse(int64_t entries, int hq) override {
    need(set_->lse, std::max<size_t>(1, entries * hq) * sizeof(float), "partial lse");
    return TensorView(set_->lse.data(), DType::f32, {entries, hq}, device());
  }

  std::span<float> pack(int hq, int dv, int ranks) override {
    const int64_t floats = tokens_ * hq * (dv + 1);
    DeviceBuffer& send = set_->send;
    need(send, std::max<size_t>(1, floats) * sizeof(float), "send buffer");
    cuda::DcpPackParams p{};
    p.out = set_->out.data();
    p.out_dtype = static_cast<int32_t>(out_dtype_);
    p.lse = set_->lse.ptr<float>();
    p.entry = index_->ptr<int64_t>() + entries_;
    p.tokens = tokens_;
    p.hq = hq;
    p.dv = dv;
    p.ranks = ranks;
    p.send = send.ptr<float>();
    if (entries_ == 0) {  // nothing attended here: out / lse were never written, every row is empty
      p.out = nullptr;
      p.lse = nullptr;
    }
    ATTNRT_CUDA_CHECK(cuda::launch_dcp_pack(p, stream_));
    return {send.ptr<float>(), static_cast<size_t>(floats)};
  }

  std::span<float> recv(int64_t floats) override {
    need(set_->recv, std::max<size_t>(1, floats) * sizeof(float), "receive buffer");
    return {set_->recv.ptr<float>(), static_cast<size_t>(floats)};
  }

  void merge(int ranks, int h0, int h1, int dv, const float* sinks, const TensorView& out,
             const TensorView& lse) override {
    ATTNRT_CHECK(out.device.kind == DeviceKind::cuda && out.strides[2] == 1,
                 "DcpAttention on the GPU: out is {}; expected a GPU tensor with a contiguous "
                 "last dim",
                 out.describe());
    cuda::DcpMergeParams p{};
    p.recv = set_->recv.ptr<float>();
    p.ranks = ranks;
    p.tokens = tokens_;
    p.h0 = h0;
    p.heads = h1 - h0;
    p.dv = dv;
    if (sinks != nullptr) {
      if (is_device_memory(sinks)) {
        p.sinks = sinks;
      } else {
        // A captured copy from the pinned staging would be replayed from a slot later steps
        // reuse (DcpRank refuses host sinks in graph steps before any work).
        ATTNRT_CHECK(set_ != &graph_,
                     "DCP rank: the layer's sinks are host memory in a CUDA-graph step; pass them "
                     "as a GPU tensor");
        // The layer's sink logits are a weight: a host array is staged and copied for this call.
        const size_t bytes = out.shape[1] * sizeof(float);
        grow(sinks_, bytes, stream_, "sinks");
        std::memcpy(staging_.acquire(bytes, stream_), sinks, bytes);
        staging_.upload(sinks_.data(), bytes, stream_);
        p.sinks = sinks_.ptr<float>();
      }
    }
    p.out = out.data;
    p.out_dtype = act_code(out, "out");
    p.out_stride_tok = out.strides[0];
    p.out_stride_head = out.strides[1];
    if (!lse.empty()) {
      p.lse = lse.ptr<float>();
      p.lse_stride_tok = lse.strides[0];
      p.lse_stride_head = lse.strides[1];
    }
    ATTNRT_CUDA_CHECK(cuda::launch_dcp_merge(p, stream_));
  }

  void synchronize() override { ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  static Device device() {
    int d = 0;
    ATTNRT_CUDA_CHECK(cudaGetDevice(&d));
    return Device::cuda(d);
  }

  // The buffers of the calls: an eager step's grow as needed; a graph step's were sized by
  // reserve_graph and must hold the call.
  void need(DeviceBuffer& buf, size_t bytes, const char* what) {
    if (set_ == &graph_) {
      fits(buf, bytes, what);
    } else {
      grow(buf, bytes, stream_, what);
    }
  }

  // dcp_entry_list into `dst` (which holds it), from pinned staging: a copy from pageable memory
  // may wait for the stream (the driver stages it). Stream order: the pinned slot is rewritten
  // only after the copy that last read it ran (StagingRing::acquire); this copy precedes, on the
  // stream, the kernels (or the replayed graph) that read the list.
  void upload_list(DeviceBuffer& dst, std::span<const int64_t> rows, int64_t entries,
                   int64_t tokens) {
    const size_t count = static_cast<size_t>(entries + tokens);
    const size_t bytes = std::max<size_t>(1, count) * sizeof(int64_t);
    auto* host = static_cast<int64_t*>(staging_.acquire(bytes, stream_));
    dcp_entry_list(rows, entries, tokens, host);
    staging_.upload(dst.data(), count * sizeof(int64_t), stream_);
  }

  cudaStream_t stream_;
  // A list of entries on the GPU: [entries: global row | tokens: entry or -1], and what it holds.
  struct List {
    DeviceBuffer index;
    std::vector<int64_t> rows;
    int64_t tokens = -1;
  };
  std::vector<List> lists_;
  DeviceBuffer* index_ = nullptr;  // the list of the call
  int64_t entries_ = 0, tokens_ = 0;
  cuda::StagingRing staging_;  // the uploads: entry lists, a host array of sinks
  // The gathered q / k / v rows, the partial (out, lse) and the exchange's send / receive buffers:
  // an eager step's, and a graph step's at fixed addresses (reserve_graph).
  struct Buffers {
    DeviceBuffer rows[3], out, lse, send, recv;
  };
  Buffers eager_, graph_;
  Buffers* set_ = &eager_;                 // the step's
  std::vector<DeviceBuffer> graph_lists_;  // one entry list per part
  int64_t graph_tokens_ = 0;               // reserve_graph's rows (0: none)
  DeviceBuffer sinks_;
  DType out_dtype_ = DType::f32;
};

// n ranks on one GPU, served one after another from one thread (DcpAttention): a collective's
// data moves when its last rank calls. Block (s -> d) is copied on rank d's stream after rank s's
// stream reached its call (an event); every rank's stream then waits for all copies before it
// goes on (a rank may rewrite its send buffer next).
class DeviceInProcessCommunicator final : public Communicator {
 public:
  DeviceInProcessCommunicator(int size, std::span<void* const> streams) : size_(size) {
    ATTNRT_CHECK(size >= 1, "device_in_process communicator: size {}; need at least 1 rank", size);
    ATTNRT_CHECK(streams.empty() || static_cast<int>(streams.size()) == size,
                 "device_in_process communicator: {} streams for {} ranks; pass none or one per "
                 "rank",
                 streams.size(), size);
    streams_.assign(size, nullptr);
    for (size_t i = 0; i < streams.size(); ++i) streams_[i] = static_cast<cudaStream_t>(streams[i]);
    events_.resize(size);
    for (cudaEvent_t& e : events_)
      ATTNRT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    calls_.resize(size);
  }
  ~DeviceInProcessCommunicator() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  std::string_view name() const override { return "device_in_process"; }
  int size() const override { return size_; }
  bool device_buffers() const override { return true; }

  void all_to_all(int rank, std::span<const float> send, std::span<const int64_t> send_counts,
                  std::span<float> recv, std::span<const int64_t> recv_counts) override {
    check_all_to_all("device_in_process", rank, size_, send, send_counts, recv, recv_counts);
    Call& c = arrive(rank, Kind::all_to_all);
    c.send = send.data();
    c.recv = recv.data();
    c.send_counts.assign(send_counts.begin(), send_counts.end());
    c.recv_counts.assign(recv_counts.begin(), recv_counts.end());
    if (++arrived_ < size_) return;
    for (int d = 0; d < size_; ++d) {
      for (int s = 0; s < size_; ++s) {
        ATTNRT_CHECK(calls_[s].send_counts[d] == calls_[d].recv_counts[s],
                     "device_in_process communicator: all_to_all: rank {} sends {} floats to rank "
                     "{}, which expects {}",
                     s, calls_[s].send_counts[d], d, calls_[d].recv_counts[s]);
      }
    }
    run([&](int d) {
      int64_t at = 0;
      for (int s = 0; s < size_; ++s) {
        int64_t from = 0;
        for (int k = 0; k < d; ++k) from += calls_[s].send_counts[k];
        const int64_t n = calls_[d].recv_counts[s];
        if (n > 0) {
          ATTNRT_CUDA_CHECK(cudaMemcpyAsync(calls_[d].recv + at, calls_[s].send + from,
                                            n * sizeof(float), cudaMemcpyDeviceToDevice,
                                            streams_[d]));
        }
        at += n;
      }
    });
  }

  void all_gather(int rank, std::span<const float> send, std::span<float> recv) override {
    ATTNRT_CHECK(recv.size() >= send.size() * size_,
                 "device_in_process communicator: all_gather: rank {} receives into {} floats; "
                 "{} ranks of {} need {}",
                 rank, recv.size(), size_, send.size(), send.size() * size_);
    Call& c = arrive(rank, Kind::all_gather);
    c.send = send.data();
    c.recv = recv.data();
    c.send_counts.assign(1, static_cast<int64_t>(send.size()));
    if (++arrived_ < size_) return;
    for (int s = 1; s < size_; ++s) {
      ATTNRT_CHECK(calls_[s].send_counts[0] == calls_[0].send_counts[0],
                   "device_in_process communicator: all_gather: rank {} sends {} floats, rank 0 "
                   "{}; every rank sends the same count",
                   s, calls_[s].send_counts[0], calls_[0].send_counts[0]);
    }
    run([&](int d) {
      const int64_t n = calls_[0].send_counts[0];
      for (int s = 0; s < size_ && n > 0; ++s) {
        ATTNRT_CUDA_CHECK(cudaMemcpyAsync(calls_[d].recv + s * n, calls_[s].send, n * sizeof(float),
                                          cudaMemcpyDeviceToDevice, streams_[d]));
      }
    });
  }

  void set_stream(int rank, void* stream) override {
    check_rank(rank);
    ATTNRT_CHECK(!called_[rank],
                 "device_in_process communicator: set_stream of rank {} while its {} is pending; "
                 "move a rank between collectives",
                 rank, kind_name(pending_));
    const auto s = static_cast<cudaStream_t>(stream);
    // The copies into the rank's receive buffers and its event came on the old stream; a
    // capturing stream records instead (as in CudaBackend::set_stream).
    if (!cuda::stream_is_capturing(s)) cuda::order_after(s, streams_[rank]);
    streams_[rank] = s;
  }
  void* stream(int rank) const override {
    check_rank(rank);
    return streams_[rank];
  }

  void barrier(int rank) override {
    check_rank(rank);
    ATTNRT_CHECK(!cuda::stream_is_capturing(streams_[rank]),
                 "device_in_process communicator: barrier of rank {} while its stream captures a "
                 "CUDA graph; a barrier waits for the streams on the host, which a capture cannot "
                 "hold (the step's all_to_all needs none)",
                 rank);
    arrive(rank, Kind::barrier);
    if (++arrived_ < size_) return;
    run([](int) {});
    for (cudaStream_t s : streams_) ATTNRT_CUDA_CHECK(cudaStreamSynchronize(s));
  }

 private:
  enum class Kind { none, all_to_all, all_gather, barrier };
  struct Call {
    const float* send = nullptr;
    float* recv = nullptr;
    std::vector<int64_t> send_counts, recv_counts;
  };

  static const char* kind_name(Kind k) {
    return k == Kind::all_to_all ? "all_to_all" : k == Kind::all_gather ? "all_gather" : "barrier";
  }

  void check_rank(int rank) const {
    ATTNRT_CHECK(rank >= 0 && rank < size_,
                 "device_in_process communicator: rank {}; the group has ranks 0..{}", rank,
                 size_ - 1);
  }

  Call& arrive(int rank, Kind kind) {
    check_rank(rank);
    ATTNRT_CHECK(pending_ == Kind::none || pending_ == kind,
                 "device_in_process communicator: rank {} calls {} while {} is pending", rank,
                 kind_name(kind), kind_name(pending_));
    ATTNRT_CHECK(!called_[rank],
                 "device_in_process communicator: rank {} calls {} twice before every rank has "
                 "called it once",
                 rank, kind_name(kind));
    // A capture records the copies on the receiving ranks' streams and the events between the
    // ranks' streams: only a capture on one stream shared by every rank holds all of them (the
    // others' work, queued before, would be outside the graph).
    if (cuda::stream_is_capturing(streams_[rank])) {
      for (int r = 0; r < size_; ++r) {
        ATTNRT_CHECK(streams_[r] == streams_[rank],
                     "device_in_process communicator: rank {}'s stream captures a CUDA graph but "
                     "rank {} runs on another stream; a captured exchange needs every rank of the "
                     "group on the capturing stream (DcpAttention::set_stream, or one stream for "
                     "every rank of make_device_in_process_communicator)",
                     rank, r);
      }
    }
    if (pending_ == Kind::none) called_.assign(size_, false);
    pending_ = kind;
    called_[rank] = true;
    // The rank's stream has reached its call: its send buffer holds the data from here on.
    ATTNRT_CUDA_CHECK(cudaEventRecord(events_[rank], streams_[rank]));
    return calls_[rank];
  }

  // The copies of the completed collective, per receiving rank, ordered after every rank's call;
  // then every stream waits for every copy.
  template <typename Copy>
  void run(Copy copy) {
    pending_ = Kind::none;
    arrived_ = 0;
    called_.assign(size_, false);
    for (int d = 0; d < size_; ++d) {
      for (int s = 0; s < size_; ++s) {
        if (streams_[s] != streams_[d])
          ATTNRT_CUDA_CHECK(cudaStreamWaitEvent(streams_[d], events_[s], 0));
      }
      copy(d);
    }
    for (int d = 0; d < size_; ++d) ATTNRT_CUDA_CHECK(cudaEventRecord(events_[d], streams_[d]));
    for (int s = 0; s < size_; ++s) {
      for (int d = 0; d < size_; ++d) {
        if (streams_[s] != streams_[d])
          ATTNRT_CUDA_CHECK(cudaStreamWaitEvent(streams_[s], events_[d], 0));
      }
    }
  }

  int size_;
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> events_;
  std::vector<Call> calls_;
  std::vector<bool> called_ = std::vector<bool>(static_cast<size_t>(size_), false);
  Kind pending_ = Kind::none;
  int arrived_ = 0;
};

}  // namespace

std::unique_ptr<DcpDeviceRank> make_dcp_device_rank(void* stream) {
  return std::make_unique<CudaDcpRank>(stream);
}

std::unique_ptr<Communicator> make_device_in_process_communicator(int size,
                                                                   std::span<void* const> streams) {
  return std::make_unique<DeviceInProcessCommunicator>(size, streams);
}

}  // namespace attnrt
