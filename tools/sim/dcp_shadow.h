// `attnrt run --dcp-size N` (docs/dcp.md): the target model's attention layers also run on a
// DcpAttention group of N simulated ranks over the same backends (cuda ranks share the one GPU),
// with the same batches and q / k / v, and each layer's merged output is compared with the single
// runtime's (which the reference checks). Layers that cannot be split (non-causal, DSA, linear)
// stay on the single runtime; MLA layers are compared in the absorbed form, and their MHA-form
// prefills only store the latent rows on the ranks. The report's notes say which layers and why.
// cuda ranks with CUDA graphs on (RuntimeConfig::cuda_graphs) run their DECODE and TARGET_VERIFY
// steps as an engine would (docs/dcp.md "CUDA graphs"): each layer's inputs go into static GPU
// tensors, and at end_step the group replays a graph of the step's rows (a power of two, captured
// when first needed) on a stream of its own; the outputs are compared after it.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attnrt/runtime/dcp.h"
#include "tools/sim/checker.h"

namespace attnrt::sim {

class DcpShadow {
 public:
  // `options.dcp_size` ranks over `model`'s splittable layers with `config` per rank. Throws
  // attnrt::Error when no layer can be split, or for the group's own errors (e.g. page_size > 1
  // with a cuda backend).
  DcpShadow(const ModelSpec& model, const Options& options, const RuntimeConfig& config,
            Tolerance tolerance, FailureLog& failures);

  bool splits(int layer_id) const;
  void begin_step(const ForwardBatch& batch);
  // The layer on the group; its output is compared with args.out (the single runtime's).
  void forward(const LayerSite& site, const AttnArgs& args);
  // An MLA layer run in the MHA form: only its latent rows [T, 1, rank + rope] go to the ranks.
  void store_latent(const LayerSite& site, const TensorView& latent);
  void end_step();
  // After the scheduler accepted the paths of a TARGET_VERIFY step (DcpAttention::commit_verify).
  void commit_verify(const ForwardBatch& batch, const std::vector<std::vector<int>>& paths);
  // One line per fact for the report's notes.
  std::vector<std::string> notes() const;

 private:
  // The stream graph steps run on: declared before the group, so that the group's runtimes
  // (which synchronise their stream when destroyed) go first, also when a step threw.
  std::unique_ptr<StreamCapture> capture_;
  std::unique_ptr<DcpAttention> group_;
  int group_id(int layer_id) const;  // the layer's id in the group's model, -1 if not split
  void check(const LayerSite& site, const TensorView& got, const TensorView& want);
  // Graph steps: the stream they are captured and replayed on, the static tensors (by group
  // layer id: q, k, v, out of max_rows_ rows; the sinks), the graph of each row count, and the
  // step in progress (its rows, batch and the outputs to compare after the replay).
  struct Static {
    TensorView q, k, v, out, sinks;
    bool sinks_written = false;
  };
  struct Pending {
    LayerSite site;
    int group_layer = 0;
    HostBuffer want;
  };
  std::unique_ptr<DeviceTensors> tensors_;
  std::map<int, Static> static_;
  std::map<int, int> graphs_;  // rows -> the capture's graph index
  int max_rows_ = 0;           // 0: no graph steps
  int64_t step_rows_ = 0;      // rows of the graph step in progress (0: eager)
  int64_t step_tokens_ = 0;
  const ForwardBatch* step_batch_ = nullptr;
  std::vector<Pending> pending_;
  int64_t graph_steps_ = 0;
  std::string graphs_off_;  // why cuda ranks run eagerly ("" when graphs are on or host ranks)
  void capture(int rows);
  void replay();
  std::vector<int> split_;           // the model's layer ids on the group (group ids 0, 1, ...)
  std::vector<std::string> left_;    // why each other layer stays on the single runtime
  Tolerance tolerance_;
  FailureLog* failures_;
  int64_t compared_ = 0, stored_only_ = 0, bad_ = 0;
  double max_abs_ = 0, seconds_ = 0;
  bool gpu_ = false;  // the ranks are cuda runtimes sharing the one GPU
};

}  // namespace attnrt::sim
