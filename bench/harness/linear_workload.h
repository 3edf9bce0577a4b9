// The linear-attention benchmark rows of `attnrt bench --suite linear` (docs/bench.md): one GDN,
// KDA or Mamba2 layer of a served model, a DECODE step over states already built or an EXTEND from
// empty states; their names, shapes, counting rules and the ways to shrink them. Shared by the
// bench runner, the tests and (through the JSON rows) bench/torch_linear.py.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attnrt/core/dtype.h"
#include "attnrt/model/model_spec.h"
#include "bench/harness/workload.h"

namespace attnrt::bench {

enum class LinearMode : uint8_t { decode, extend };
std::string_view linear_mode_name(LinearMode m);  // "decode", "extend"

struct LinearWorkload {
  std::string name;   // e.g. "gdn-decode-64", "mamba2-extend-8x8192"; kept when scaled
  std::string model;  // the model preset the layer comes from, e.g. "qwen3-next-80b"
  LayerKind kind = LayerKind::gdn;  // gdn, kda or mamba2
  LinearMode mode = LinearMode::decode;
  int batch = 1;
  // Tokens each request has consumed before the timed step. Decode: that many tokens are run as
  // one untimed EXTEND first, so the step reads a state (and conv window) that real tokens built;
  // extend: 0 (the step starts from empty states).
  int prefix_len = 0;
  int new_tokens = 1;              // per request: 1 for decode
  LinearSpec spec;                 // heads, dims, conv kernel and chunk size of the layer
  DType act_dtype = DType::bf16;   // mixed_qkv, gates and outputs
  DType state_dtype = DType::f32;  // recurrent state and conv window
  std::string scale_note;          // empty for a standard row; else what was changed and why

  int64_t num_tokens() const { return static_cast<int64_t>(batch) * new_tokens; }
  // decode rows are judged by bytes against the memory ceiling, extend rows by FLOPs.
  Bound bound() const { return mode == LinearMode::decode ? Bound::memory : Bound::compute; }
  // "64 x 1 (state after 16)", "8 x 8192"
  std::string shape() const;
  // The one-layer model the row runs: this layer as layer 0.
  LayerSpec layer() const;
  bool operator==(const LinearWorkload& o) const;
};

// Widths of the per-token inputs of the layer (LinearArgs): mixed_qkv channels, a and b.
struct LinearWidths {
  int conv_dim = 0;
  int a = 0;                // gdn: HV; kda: H * Dk; mamba2: nheads (dt)
  int b = 0;                // gdn / kda: heads; mamba2: 0
  int out = 0;              // heads * rows
  int heads = 0;            // of the recurrent state
  int64_t state_elems = 0;  // per request
  int64_t conv_elems = 0;   // per request: (K - 1) * conv_dim
  int64_t param_elems = 0;  // conv weight and bias, A_log, dt_bias, D (fp32)
};
LinearWidths linear_widths(const LinearWorkload& w);

// Bytes a step moves at least, once each: the recurrent state and the conv window of every request
// read (unless the step starts from empty states) and written, every per-token input read
// (mixed_qkv, a, b in the activation dtype), every output written, the layer's fp32 parameters read
// once.
double linear_counted_bytes(const LinearWorkload& w);
// FLOPs of the chunked form (chunk C = the layer's chunk_size, or the request's tokens when fewer),
// summed over every chunk of every request; a chunk of c tokens costs
//   gdn / kda:  per key head 4·c²·Dk (K Kᵀ and Q Kᵀ: the value heads of a GDN key head share
//     its q and k), plus per value head 2·c²·Dk + 4·c²·Dv + 6·c·Dk·Dv + c³/3 (W = T·βK; U = T·βV
//     and the masked (Q Kᵀ)·u; W·S, Q·S and Kᵀ·u against the state; the unit-triangular inverse T
//     by forward substitution)
//   mamba2:  per head 2·c²·P + 4·c·N·P + 2·N·P, plus per group 2·c²·N
//     (masked scores · X; the chunk's state Bᵀ·X and the output C·h; the state pass; C Bᵀ once
//     per group, as B and C are shared by the heads of a group)
// Element-wise work (gates, decays, conv, norms) is not counted. Decode rows are the c = 1 case.
double linear_counted_flops(const LinearWorkload& w);

// FLOPs of a GDN / KDA extend row as FlashInfer's GDN prefill benchmark counts them
// (benchmarks/bench_gdn_prefill.py: the k-v outer product and q times the state, 2 GEMMs of
// Dk x Dv per token and value head: 4·tokens·H_v·Dk·Dv), for comparing with its published rates;
// 0 for Mamba2 and decode rows.
double linear_flashinfer_flops(const LinearWorkload& w);
// A time FlashInfer publishes for its Hopper GDN prefill kernel (an H100; q, k, v after the conv,
// so conv, L2 norm and gates are not in it) at the shape of one of these rows.
struct FlashInferFigure {
  double ms;            // published time
  std::string_view of;  // where it is published
};
// Its figure at w's shape (requests, tokens, heads, dims), if it publishes one:
//   gdn-extend-1x65536-h2v8: 0.399 ms, 86.1 TFLOP/s (its context-parallel path for few heads;
//     flashinfer-ai/flashinfer pull request 3866);
//   gdn-extend-8x8192 (16 / 32 heads): 0.820 ms, 167.6 TFLOP/s (its fused kernel, one CTA per
//     request and value head; the "35B / 9B / 4B TP1, 8192x8" row of pull request 3788).
std::optional<FlashInferFigure> flashinfer_published(const LinearWorkload& w);

// The rows of docs/bench.md "Linear-attention rows", in a fixed order: decode (gdn, mamba2 at
// batch 64 and 256), then extend (gdn, kda, mamba2 8 x 8192, mamba2 1 x 8192).
std::vector<LinearWorkload> linear_standard_workloads();
// Beside them, chosen by name or as "flashinfer-gdn" only (not by "all", a mode or a kind):
// gdn-extend-1x65536-h2v8, the GDN layer of qwen3-next-80b with the heads of FlashInfer's
// published row (2 key, 8 value), one request of 65536 tokens.
std::vector<LinearWorkload> linear_comparison_workloads();
// The standard rows, then the comparison rows.
std::vector<LinearWorkload> all_linear_workloads();

// Selects rows: "all", a row name, a mode ("decode", "extend"), a layer kind ("gdn", "kda",
// "mamba2"), or a comma-separated list. Throws attnrt::Error naming the unknown entry and the valid
// names.
std::vector<LinearWorkload> select_linear_workloads(std::string_view selector);
// True when `item` (one entry of a selector) names at least one linear row.
bool is_linear_selector(std::string_view item);

// Batch and tokens x factor in (0, 1] (at least 1 request; extend tokens rounded to 16, at least
// 16); heads and dims never change. Records the change in scale_note.
LinearWorkload scale_linear_workload(const LinearWorkload& w, double factor);
// "cpu-small": halve the batch, then the extend tokens, until the row moves <= 1.25 GiB and does
// <= 5e10 FLOPs (a 2-core box runs the whole suite in minutes). Throws for an unknown name.
std::vector<LinearWorkload> apply_linear_preset(const std::vector<LinearWorkload>& rows,
                                                std::string_view preset);

}  // namespace attnrt::bench
