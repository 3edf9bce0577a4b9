// `attnrt run --dump-step N DIR`: one layer of step N written as a replay case (tools/io, read back
// by `attnrt replay`), and the report's line about it.
#pragma once

#include <cstdint>
#include <string>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/model/model_spec.h"
#include "tools/sim/scheduler.h"

namespace attnrt {
class KVCache;
class ReqToTokenPool;
}  // namespace attnrt

namespace attnrt::sim {

class CaseDumper {
 public:
  // step < 0: nothing is written.
  CaseDumper(int step, std::string dir);

  // The layer a dumped step writes: the first full-attention layer of `model`, else its first
  // layer with a KV cache; -1 when it has none.
  static int layer_of(const ModelSpec& model);

  // Whether step `index`, of `tokens` tokens, is the one to write (an IDLE step never is), and
  // whether `layer_id` of `model` is its layer.
  bool wants_step(int index, int64_t tokens) const;
  bool wants_layer(int index, int64_t tokens, const ModelSpec& model, int layer_id) const;

  // Writes the layer's call right after its forward (args.out filled): the batch, the request
  // table and the KV rows it read, from `kv_cache` (on the host).
  void write(int index, ModelRole role, const ModelSpec& model, int layer_id,
             const Options& options, const ForwardBatch& batch, const ReqToTokenPool& req_to_token,
             const KVCache& kv_cache, const AttnArgs& args, const std::string& backend);

  // "DIR (step N, target DECODE, layer L)" once written, else empty.
  const std::string& written() const { return written_; }
  // After the run, which planned `steps_planned` steps: why nothing was written (no such step, or
  // an IDLE one); empty when a case was written or none was asked for.
  std::string error(int steps_planned) const;

 private:
  int step_;
  std::string dir_;
  std::string written_;
};

}  // namespace attnrt::sim
