// The device work of one DCP rank whose activations live on the GPU (docs/dcp.md "Ranks on one
// GPU"): buffers in GPU memory and the kernels of kernels/dcp.h, enqueued on the rank runtime's
// stream. Implemented by the cuda backend (backends/cuda/dcp_device.cpp); a build without CUDA
// has none (make_dcp_device_rank throws).
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "attnrt/core/tensor.h"

namespace attnrt {

struct DcpGraphSizes;  // attnrt/runtime/dcp.h

class DcpDeviceRank {
 public:
  virtual ~DcpDeviceRank() = default;
  // Later work goes to `stream` (a cudaStream_t; null: the legacy default stream), ordered after
  // what the old one still has queued (DcpRank::set_stream).
  virtual void set_stream(void* stream) = 0;
  // The entries of the calls that follow: the global row of each (rows) of the step's `tokens`
  // rows, kept on the GPU with the row -> entry map the packing reads as list `list` (a part's),
  // uploaded only when it differs from what that list held (once a step, or never for decodes
  // of the same rows).
  virtual void set_entries(int list, std::span<const int64_t> rows, int64_t tokens) = 0;
  // The entries' rows of a device tensor [T, H, D] (last dim contiguous), contiguous [E, H, D];
  // slot 0, 1, 2 are separate buffers (q, k, v).
  virtual TensorView gather(int slot, const TensorView& src) = 0;
  // The rank's partial output [E, hq, dv] (dtype) and lse fp32 [E, hq], device buffers.
  virtual TensorView partial_out(DType dtype, int64_t entries, int hq, int dv) = 0;
  virtual TensorView partial_lse(int64_t entries, int hq) = 0;
  // Packs the partial (dv outputs | lse per row and head, (0, -inf) for rows without an entry)
  // into the all-to-all's send buffer of `ranks` blocks; returns it (device floats).
  virtual std::span<float> pack(int hq, int dv, int ranks) = 0;
  // The receive buffer of `floats` floats (device), kept until the next call.
  virtual std::span<float> recv(int64_t floats) = 0;
  // The exact merge of heads [h0, h1) from the receive buffer into out (and lse when not empty),
  // device tensors; sinks: the layer's sink logits ([hq], host or device), or null.
  virtual void merge(int ranks, int h0, int h1, int dv, const float* sinks, const TensorView& out,
                     const TensorView& lse) = 0;
  // Waits for the rank's stream.
  virtual void synchronize() = 0;
  // Whether the rank's stream is capturing a CUDA graph.
  virtual bool capturing() const = 0;
  // Whether `p` points into GPU memory (a caller's sink logits).
  virtual bool on_device(const void* p) const = 0;

  // CUDA-graph steps (DcpRank::init_cuda_graph_state, docs/dcp.md "CUDA graphs"): every buffer of
  // `sizes`, and an entry list per part, allocated now at fixed addresses and never grown; eager
  // steps keep buffers of their own (they grow as steps need). Throws when called twice with
  // other sizes (a captured graph holds the first ones).
  virtual void reserve_graph(const DcpGraphSizes& sizes) = 0;
  // A graph step's list `list`: its entries' rows, padded to `tokens` entries (dcp_entry_list),
  // written into the list's fixed buffer now by a stream-ordered copy from pinned staging (before
  // the capture or the replay that reads it).
  virtual void set_graph_entries(int list, std::span<const int64_t> rows, int64_t tokens) = 0;
  // The calls that follow (a captured layer) read graph list `list` of `tokens` entries and rows
  // and the graph buffers; nothing is uploaded. Until the next set_entries.
  virtual void use_graph_entries(int list, int64_t tokens) = 0;
};

// One rank's device work on `stream` (a cudaStream_t; null: the legacy default stream).
std::unique_ptr<DcpDeviceRank> make_dcp_device_rank(void* stream);

}  // namespace attnrt
