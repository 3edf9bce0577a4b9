// The backend contract (DESIGN.md "The backend contract", reference-semantics §3).
#pragma once

#include <array>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "attnrt/backend/mla_mha.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/tensor.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

struct KVLayerView;

class KVCache;
class LinearStatePool;
class ReqToTokenPool;
struct Options;

struct BackendContext {
  const ModelSpec* model = nullptr;
  const Options* options = nullptr;
  KVCache* kv_cache = nullptr;
  const ReqToTokenPool* req_to_token = nullptr;
  // Conv windows and recurrent states of the linear-attention layers (hybrid models only).
  LinearStatePool* linear_state = nullptr;
  Device device;
};

// The indexer inputs of a DSA layer's call (docs/dsa.md), empty for every other layer. T = tokens
// of the step, Hi = index_n_heads, Di = index_head_dim; float tensors (fp32 / fp16 / bf16), any
// strides, on the backend's device.
//   q        [T, Hi, Di] index queries (after the model's RoPE and Hadamard rotation)
//   k        [T, Di] the step's index keys, stored (fp8 + scale per token) at out_cache_loc with
//            the latent rows; empty when the latent rows are not stored (k empty or !save_kv)
//   weights  [T, Hi] the per-head weights (weights_proj(x), before any scaling)
//   topk     optional int32 [T, index_topk]: the selection of every query token, the token indices
//            (positions in its request's row) in increasing order, -1 after the last
struct IndexerArgs {
  TensorView q, k, weights;
  TensorView topk;
  bool empty() const { return q.empty() && k.empty() && weights.empty() && topk.empty(); }
};

// One layer's call. q [T, Hq, Dqk], k [T, Hkv, Dqk], v [T, Hkv, Dv], out [T, Hq, Dv] (T = tokens of
// the step). k and v are both empty when the step's K/V were already stored (cross-layer KV sharing):
// the backend then reads them from the pool at out_cache_loc.
struct AttnArgs {
  TensorView q, k, v, out;
  const float* sinks = nullptr;  // [Hq] sink logits when the layer has sinks
  TensorView lse;                // optional [T, Hq] fp32: log-sum-exp of each row (natural log)
  bool save_kv = true;
  IndexerArgs indexer;           // DSA layers only (LayerSpec::has_indexer)
};

// One linear-attention layer's call (reference-semantics §2.3, §8.8, §8.9). T = tokens of the step.
// Per-token inputs may be any float dtype (fp32 / bf16 / fp16); parameters are fp32.
//   gdn:    mixed_qkv [T, 2*Hk*Dk + HV*Dv] (q | k | v, before the conv), a [T, HV], b [T, HV],
//           A_log [HV], dt_bias [HV]; out [T, HV, Dv]
//   kda:    mixed_qkv [T, 2*H*Dk + H*Dv], a [T, H, Dk] (per-channel decay input), b [T, H],
//           A_log [H], dt_bias [H, Dk]; out [T, H, Dv]
//   mamba2: mixed_qkv [T, nheads*P + 2*G*N] (x | B | C), a = dt [T, nheads], A_log [nheads],
//           dt_bias [nheads], D [nheads]; b unused; out [T, nheads, P]
// conv_weight [conv_dim, K] (column K-1 multiplies the newest input), conv_bias [conv_dim] or
// empty. The gated RMSNorm with z that follows in the model is not the backend's job.
struct LinearArgs {
  TensorView mixed_qkv;
  TensorView conv_weight, conv_bias;
  TensorView a, b;
  TensorView A_log, dt_bias, D;
  TensorView out;
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

  // Linear-attention layers (gdn / kda / mamba2): conv + recurrence for every mode, with the state
  // in BackendContext::linear_state. IDLE does nothing. The default throws: the backend serves no
  // linear layers.
  virtual void forward_linear(const LinearArgs& args, const LayerSpec& layer,
                              const ForwardBatch& batch);
  // After a TARGET_VERIFY step (reference-semantics §8.10): for request i of that step, makes the
  // committed state of every linear layer the state after block token last_accepted[i] (chain:
  // the number of accepted drafts; tree: the block index of the deepest accepted node; -1 = leave
  // the request's state as it was). The default throws, as for forward_linear.
  virtual void update_state_after_verify(std::span<const int32_t> last_accepted);

  // MLA layers in the MHA form with a chunked prefix (docs/mla.md). After init_forward_metadata:
  // mla_form() is the form the step's MLA layers run in (choose_mla_form) and, for the MHA form,
  // prefix_chunk_plan() lists the chunks. forward_mla_mha runs a layer's causal part;
  // forward_mla_prefix_chunk then merges each chunk into its out / lse. The defaults: absorbed, no
  // chunks, and calls that throw (the backend serves MLA in the absorbed form only).
  virtual MlaForm mla_form() const { return MlaForm::absorbed; }
  virtual const PrefixChunkPlan& prefix_chunk_plan() const;
  virtual void forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                               const ForwardBatch& batch);
  virtual void forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args,
                                        const LayerSpec& layer, const ForwardBatch& batch);
  // The latent rows of prefix chunk `chunk` from `kv` (layer `layer_id`'s latent pool) into
  // `latent` [chunk tokens, 1, kv_lora_rank + rope], for the model to decompress (the runtime's
  // gather_prefix_chunk, which checked `chunk`). The default gathers from a host pool into a host
  // tensor (gather_latent_rows).
  virtual void gather_prefix_chunk(int chunk, const KVLayerView& kv, int layer_id,
                                   const TensorView& latent);

  // GPU backends: the CUDA stream (a cudaStream_t) every later launch and copy goes to, ordered
  // after what the old stream still has queued; an engine passes its framework's current stream.
  // Host backends ignore it.
  virtual void set_stream(void* stream) { (void)stream; }

  // Per-phase host timing of the plan, for `attnrt bench`: turns it on or off and returns whether
  // this backend keeps one. plan_part_seconds(): host seconds of the last plan's phases (capture
  // query, staging acquire, prepare, write, copy); zeros where none is kept.
  virtual bool set_plan_timing(bool on) {
    (void)on;
    return false;
  }
  virtual std::array<double, 5> plan_part_seconds() const { return {}; }

  const BackendContext& context() const { return ctx_; }

 protected:
  BackendContext ctx_;
};

// A backend that runs DECODE and every extend-like mode through one path, attend(): its
// forward_decode and forward_extend check that the batch's mode is theirs (an error names the
// backend and the mode), then call it.
class OnePathAttnBackend : public AttentionBackend {
 public:
  using AttentionBackend::AttentionBackend;

  void forward_decode(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) final;
  void forward_extend(const AttnArgs& args, const LayerSpec& layer,
                      const ForwardBatch& batch) final;

 protected:
  virtual void attend(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch) = 0;
};

}  // namespace attnrt
