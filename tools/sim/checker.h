// The output checks of `attnrt run`. Every layer output is scanned for elements the backend left
// unwritten (outputs are poisoned with NaN before each call); on checked steps the `reference`
// backend recomputes the layer over the same pools and the two are compared within the tolerance of
// the conformance suite (linear-attention layers: the output and the state each request ends
// with). What fails goes into a FailureLog, with the one-line text the report prints.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/tensor.h"
#include "attnrt/model/model_spec.h"
#include "tools/sim/mla_weights.h"
#include "tools/sim/report.h"

namespace attnrt {
class LinearStatePool;
}

namespace attnrt::sim {

// The conformance suite's bounds for outputs of `out_dtype` (fp32, fp16 or bf16), so that `run`
// and `check` agree on what passes. Throws attnrt::Error for any other dtype.
Tolerance output_tolerance(DType out_dtype);

// Element-wise comparison of two tensors of the same [rows, d1, d2] shape: the largest errors over
// the finite ones, how many elements are beyond tolerance, and the worst of those (a NaN is beyond
// any tolerance).
struct Comparison {
  double max_abs = 0, max_rel = 0;
  int64_t bad = 0;
  double worst_excess = -1;
  int64_t token = 0;  // index along the first dimension
  int head = 0, column = 0;
  double got = 0, expected = 0;
};
Comparison compare(const TensorView& got, const TensorView& expected, const Tolerance& tol);

// The rows of a checked attention layer that the reference recomputes: query rows of the step and
// q heads, each ascending; an empty list means all of them.
struct RowSample {
  std::vector<int64_t> tokens;
  std::vector<int> heads;
};
// The same comparison over the sampled (token, head) rows only.
Comparison compare(const TensorView& got, const TensorView& expected, const Tolerance& tol,
                   const RowSample& sample);

// A checked step's query rows: every request's last row and the first row of each request with
// more than one (so every request, both ends of every extend and every verify block), then rows
// drawn with `seed` up to max_tokens in all; every row when max_tokens is 0 or the step has no
// more. Ascending.
std::vector<int64_t> sample_tokens(const ForwardBatch& batch, int max_tokens, uint64_t seed);
// At most max_heads of num_q_heads heads, evenly spread: every `stride`-th head from
// `round % stride` (stride = ceil(num_q_heads / max_heads)), so that `stride` successive rounds
// cover every head; all heads when max_heads is 0 or not below num_q_heads. Ascending.
std::vector<int> sample_heads(int num_q_heads, int max_heads, int64_t round);

// Fills `t` with NaN, so that an element a backend does not write shows.
void poison(const TensorView& t);
// Index of the first NaN element of `t`, or -1.
int64_t first_nan(const TensorView& t);

// One layer of one step, as failure messages name it.
struct LayerSite {
  int step = 0;
  ModelRole role = ModelRole::target;
  ForwardMode mode = ForwardMode::IDLE;
  const LayerSpec* layer = nullptr;
  std::string backend;  // the backend under test that served the step
};

// Every failure is counted; the first kMaxListedPerMode of each (model, mode) are kept.
class FailureLog {
 public:
  static constexpr int kMaxListedPerMode = 3;
  void record(const LayerSite& site, const Comparison& c, std::string what);
  int64_t count() const { return count_; }
  const std::vector<CheckFailure>& listed() const { return listed_; }

 private:
  int64_t count_ = 0;
  std::vector<CheckFailure> listed_;
  std::map<std::pair<int, int>, int> listed_per_mode_;
};

// The part of one linear layer's state a step reads or may change: the slots of its requests and,
// for TARGET_VERIFY, the checkpoints of its rows (the slots stay untouched there).
struct StateRegion {
  bool verify = false;
  std::vector<int64_t> slots;
  int64_t checkpoints = 0;  // verify: batch rows x N
  int draft_tokens = 0;     // verify: N
};

// The region's conv windows and states: the slots first, then the checkpoints.
struct StateCopy {
  std::vector<uint8_t> conv, ssm;
  int64_t count = 0;
};
StateCopy save_state(const LinearStatePool& pool, int layer_id, const StateRegion& region);
void restore_state(LinearStatePool& pool, int layer_id, const StateRegion& region,
                   const StateCopy& copy);

// The checks of one model's layers. Without a reference (checks off) only unwritten outputs are
// found.
class ReferenceChecker {
 public:
  // reference, reference_linear: the `reference` backend and its linear side (hybrid models), over
  // the pools the runtime writes or host copies of them; either may be null. runtime_states: the
  // runtime's linear state pool; reference_states: the pool reference_linear reads (the same one,
  // or its host copy). `log` outlives the checker.
  ReferenceChecker(std::unique_ptr<AttentionBackend> reference,
                   std::unique_ptr<AttentionBackend> reference_linear,
                   LinearStatePool* runtime_states, LinearStatePool* reference_states,
                   Tolerance tolerance, FailureLog& log);

  bool has_reference() const { return reference_ != nullptr; }
  // The reference's plan for a checked step.
  void begin_step(const ForwardBatch& batch);

  // An attention layer after it ran, its output in args.out on the host. With `check`, the
  // reference recomputes the layer's `sample` rows (the pools already hold this step's k/v;
  // storing them again writes the same bytes) and they are compared; the errors and the number of
  // rows compared fold into `stats`. Every element is scanned for the NaN poison either way.
  void check_attention(const LayerSite& site, const ForwardBatch& batch, const AttnArgs& args,
                       bool check, const RowSample& sample, ModeStats& stats);

  // An MLA layer after it ran in the MHA form (docs/mla.md): q [T, Hq, qk_nope + qk_rope], its
  // output in `out` [T, Hq, mha_v_head_dim] on the host. With `check`, the reference recomputes it
  // in the absorbed form over the same latent pool (q_lat = weights.absorb_q(q)) and maps its
  // output back with W_UV (weights.project_out): an independent check of the MHA form, its prefix
  // chunks and their merge.
  void check_mla_mha(const LayerSite& site, const ForwardBatch& batch, const TensorView& q,
                     const TensorView& out, const MlaWeights& weights, bool check,
                     const RowSample& sample, ModeStats& stats);

  // A linear layer after it ran. With `check`, `before` holds the region's state the runtime
  // started from (save_state before the call): the reference runs from it, and the output and the
  // state each request (and verify checkpoint) ends with are compared. On a shared pool the
  // runtime's state is put back afterwards, so the run goes on with the backend under test.
  void check_linear(const LayerSite& site, const ForwardBatch& batch, const LinearArgs& args,
                    bool check, const StateRegion& region, const StateCopy& before,
                    ModeStats& stats);

 private:
  // [T, d1, d2] scratch for the reference's output, in `like`'s dtype and shape, poisoned.
  TensorView reference_out(const TensorView& like);
  // Folds the comparison of `got` with `expected` into `stats` and logs a failure; with
  // `expected` empty (no check), reports the unwritten element `unwritten` of got.
  void record_output(const LayerSite& site, const TensorView& got, const TensorView& expected,
                     int64_t unwritten, const RowSample& sample, ModeStats& stats);
  // reference_->forward restricted to `sample`'s rows where the reference is ReferenceBackend.
  void reference_forward(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch,
                         const RowSample& sample);
  void compare_states(const LayerSite& site, const std::string& where, const StateRegion& region,
                      const StateCopy& got, const StateCopy& expected);

  std::unique_ptr<AttentionBackend> reference_, reference_linear_;
  LinearStatePool* runtime_states_;
  LinearStatePool* reference_states_;
  Tolerance tolerance_;
  FailureLog* log_;
  HostBuffer scratch_;
};

}  // namespace attnrt::sim
