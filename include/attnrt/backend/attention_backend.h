// The backend contract (DESIGN.md "The backend contract", reference-semantics §3).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/tensor.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

class KVCache;
class ReqToTokenPool;
struct Options;

struct BackendContext {
  const ModelSpec* model = nullptr;
  const Options* options = nullptr;
  KVCache* kv_cache = nullptr;
  const ReqToTokenPool* req_to_token = nullptr;
  Device device;
};

// One layer's call. q [T, Hq, Dqk], k [T, Hkv, Dqk], v [T, Hkv, Dv], out [T, Hq, Dv] (T = tokens of
// the step). k and v are both empty when the step's K/V were already stored (cross-layer KV sharing):
// the backend then reads them from the pool at out_cache_loc.
struct AttnArgs {
  TensorView q, k, v, out;
  const float* sinks = nullptr;  // [Hq] sink logits when the layer has sinks
  TensorView lse;                // optional [T, Hq] fp32: log-sum-exp of each row (natural log)
  bool save_kv = true;
};

class AttentionBackend {
 public:
  explicit AttentionBackend(const BackendContext& ctx) : ctx_(ctx) {}
  virtual ~AttentionBackend() = default;
  AttentionBackend(const AttentionBackend&) = delete;
  AttentionBackend& operator=(const AttentionBackend&) = delete;

  virtual std::string_view name() const = 0;

  // The plan: once per step, before the first layer; shared by every layer.
  virtual void init_forward_metadata(const ForwardBatch& batch) = 0;

  // IDLE: nothing to do; DECODE: forward_decode; everything else: forward_extend.
  virtual void forward(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch);
  virtual void forward_decode(const AttnArgs& args, const LayerSpec& layer,
                              const ForwardBatch& batch) = 0;
  virtual void forward_extend(const AttnArgs& args, const LayerSpec& layer,
                              const ForwardBatch& batch) = 0;

  // CUDA-graph hooks (§3.3). Backends without graph support keep these defaults, which throw.
  virtual void init_cuda_graph_state(int max_bs, int max_num_tokens);
  virtual void init_forward_metadata_capture_cuda_graph(int bs, int num_tokens,
                                                        const ForwardBatch& batch);
  // `raw_bs` real requests padded to `bs`; padded rows carry the fill value in seq_lens.
  virtual void init_forward_metadata_replay_cuda_graph(int bs, int raw_bs,
                                                       const ForwardBatch& batch);
  virtual int cuda_graph_seq_len_fill_value() const { return 1; }

  const BackendContext& context() const { return ctx_; }

 protected:
  BackendContext ctx_;
};

}  // namespace attnrt
