// Replay cases: one layer of one forward step, saved with everything needed to run it again on any
// backend (docs/replay.md describes the directory format). `attnrt run --dump-step` writes them,
// `attnrt replay` reads and runs them.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "attnrt/backend/attention_backend.h"
#include "attnrt/backend/options.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/tensor.h"
#include "attnrt/model/model_spec.h"
#include "tools/io/npy.h"

namespace attnrt {

class KVCache;
class ReqToTokenPool;

// Version 2 adds the indexer of DSA layers (docs/replay.md); cases of other layers are written as
// version 1, so older builds still read them, and refuse a DSA case rather than replay it without
// its indexer.
inline constexpr int kCaseFormatVersion = 2;
inline constexpr int kCaseFormatVersionWithoutIndexer = 1;

// The indexer of a DSA layer's call (docs/dsa.md): its inputs, the index-key cache rows the step
// reads (after the call, so the step's own keys included) and the selection the recording backend
// returned.
struct IndexerCase {
  NpyArray q;                             // float32 [T, Hi, Di]
  NpyArray k;                             // float32 [T, Di], when save_kv
  NpyArray weights;                       // float32 [T, Hi]
  NpyArray key_codes;                     // fp8 e4m3 codes [S, Di] of each slot of kv_slots
  NpyArray key_scales;                    // float32 [S]
  std::optional<NpyArray> expected_topk;  // int32 [T, index_topk], -1 after the last
};

struct Case {
  // The model around the layer: name, activation dtype (q/k/v/out), max_context_len.
  std::string model_name;
  DType act_dtype = DType::bf16;
  int max_context_len = 0;
  LayerSpec layer;  // layer_id as in the original model
  Options options;
  std::string backend;  // the backend that produced expected_out ("" = unknown)

  DType kv_dtype = DType::bf16;  // KV pool storage dtype
  float k_scale = 1.f, v_scale = 1.f;

  ForwardBatch batch;   // as the engine passed it (full-pool slots, original request rows)
  bool save_kv = true;  // false: the step's K/V were already in the pool (k and v absent)

  // req_to_token[row_i, 0 : kv_len_i) of every request i of the batch (batch order).
  std::vector<std::vector<int32_t>> req_to_token;
  // Every full-pool slot the step reads or writes, ascending, and the layer's pool rows at those
  // slots in their storage dtype: k_cache [S, Hkv, Dqk], v_cache [S, Hkv, Dv].
  std::vector<int64_t> kv_slots;
  NpyArray k_cache, v_cache;

  // float32: q [T, Hq, Dqk]; k [T, Hkv, Dqk] and v [T, Hkv, Dv] when save_kv.
  NpyArray q, k, v;
  std::optional<NpyArray> sinks;         // [Hq] float32 when the layer has sinks
  std::optional<NpyArray> expected_out;  // [T, Hq, Dv] float32, as the backend produced it
  std::optional<NpyArray> expected_lse;  // [T, Hq] float32
  std::optional<IndexerCase> indexer;    // DSA layers (layer.has_indexer())

  int64_t num_tokens() const { return static_cast<int64_t>(batch.out_cache_loc.size()); }
};

// Captures layer `layer_id` of the current step from live state: the batch, the request table and
// the KV cache the step ran on, and the layer's call (q, k, v, and out / lse / sinks when set).
// Call it after the layer's forward so that out is filled; the KV rows it saves then include this
// step's K/V, which a replay writes again unchanged.
Case capture_case(const ModelSpec& model, int layer_id, const Options& options,
                  const ForwardBatch& batch, const ReqToTokenPool& req_to_token,
                  const KVCache& kv_cache, const AttnArgs& args, const std::string& backend = "");

// Writes / reads a case directory (created if missing; existing case files are replaced).
void write_case(const std::string& dir, const Case& c);
Case read_case(const std::string& dir);
// read_case over files given by name ("case.json", "q.npy", ...): `read_file` returns a file's
// bytes, or nullopt when it is missing; `dir` names the case in messages.
using CaseFileReader = std::function<std::optional<std::string>(const std::string& name)>;
Case parse_case(const CaseFileReader& read_file, const std::string& dir);

// capture_case + write_case: what `attnrt run --dump-step N DIR` calls.
void write_step_case(const std::string& dir, const ModelSpec& model, int layer_id,
                     const Options& options, const ForwardBatch& batch,
                     const ReqToTokenPool& req_to_token, const KVCache& kv_cache,
                     const AttnArgs& args, const std::string& backend = "");

struct ReplayResult {
  std::string backend;
  HostBuffer out;  // [T, Hq, Dv] in the case's activation dtype
  HostBuffer lse;  // [T, Hq] float32 when asked for, else empty
  HostBuffer topk;  // DSA layers: int32 [T, index_topk], each token's selection (docs/dsa.md)
};

// Rebuilds a request table and a host KV cache holding only the case's rows (pages renumbered
// compactly, page offsets kept), creates `backend` through the registry and runs the step's
// layer once. Inputs are converted back to the activation dtype, so a deterministic backend
// reproduces expected_out bit for bit.
ReplayResult replay_case(const Case& c, const std::string& backend, bool want_lse = false);

// out.npy (float32), lse.npy (when computed) and topk.npy (DSA layers) into `dir`.
void write_replay_result(const std::string& dir, const ReplayResult& result);

}  // namespace attnrt
