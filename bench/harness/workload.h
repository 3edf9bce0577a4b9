// The standard benchmark workloads of docs/workloads.md: their shapes, names, counting rules and the
// ways to shrink them for small machines. One definition shared by `attnrt bench`, the tests and
// (through the JSON rows) bench/torch_sdpa.py.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attnrt/core/dtype.h"

namespace attnrt::bench {

enum class WorkloadKind : uint8_t { decode, prefill, extend, verify_chain, verify_tree };
std::string_view workload_kind_name(WorkloadKind k);  // "decode", "prefill", ...
bool is_verify(WorkloadKind k);

// Which measured ceiling a row is judged against.
enum class Bound : uint8_t { memory, compute };

struct Workload {
  std::string name;  // the standard row name, e.g. "decode-16x4096-fp8"; kept when scaled
  WorkloadKind kind = WorkloadKind::decode;
  int batch = 1;
  // Tokens of each request already in the paged pool before the step. Decode B x L: L - 1 (the new
  // token is the L-th key); verify: P; prefill: 0.
  int prefix_len = 0;
  // Query tokens per request: 1 for decode, S for prefill, E for extend, N (root included) for verify.
  int new_tokens = 1;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int page_size = 16;
  DType kv_dtype = DType::bf16;
  int topk = 1;  // verify trees: branching factor of the draft tree
  // MLA rows (docs/workloads.md "MLA rows"): one LayerKind::mla layer in its absorbed form. The
  // single latent KV head holds head_dim = kv_lora_rank + rope columns per token; V is its first
  // kv_lora_rank columns, so the output has kv_lora_rank columns per q head. 0 = not an MLA row.
  int kv_lora_rank = 0;
  // MLA rows in the MHA form (docs/mla.md, docs/workloads.md "MLA rows"): the model decompresses
  // keys and values per head, q / k of qk_nope_head_dim + rope (head_dim - kv_lora_rank) columns,
  // v of mha_v_head_dim; the cached prefix is read in prefix_chunks chunks. 0 = the absorbed form.
  int qk_nope_head_dim = 0;
  int mha_v_head_dim = 0;
  int prefix_chunks = 0;
  // Prefill / extend rows over an e4m3 KV cache run with --fp8-prefill-attention on the backends
  // that have the fp8 prefill kernel (BackendCaps::fp8_prefill_attention; others run the fp8 KV
  // path they have), counted as the bf16 row of the same shape so the two rates compare.
  bool fp8_prefill = false;

  // Empty for a standard row; else what was changed and why ("scaled x0.25 from 16x4096").
  std::string scale_note;

  int kv_len() const { return prefix_len + new_tokens; }  // keys of each request after the step
  int64_t num_tokens() const { return static_cast<int64_t>(batch) * new_tokens; }
  bool is_mla() const { return kv_lora_rank > 0; }
  bool is_mla_mha() const { return is_mla() && mha_v_head_dim > 0; }
  // Columns of a q / k head and of a v / out head in the form the row runs: the MHA form's
  // 192 / 128, the absorbed form's 576 / 512, else head_dim / head_dim.
  int qk_head_dim() const {
    return is_mla_mha() ? qk_nope_head_dim + head_dim - kv_lora_rank : head_dim;
  }
  int v_head_dim() const {
    return is_mla_mha() ? mha_v_head_dim : is_mla() ? kv_lora_rank : head_dim;
  }
  Bound bound() const;
  // "16x4096", "1x8192 d64", "8x(2048+512)", "64x(4096+16, topk 4)", plus " page 1" / " fp8_e4m3";
  // MLA rows lead with their q heads: "h128 64x4096 page 64"; the MHA form's say so:
  // "h128 8x(4096+512) mha 4 chunks page 64".
  std::string shape() const;
  bool operator==(const Workload&) const = default;
};

// The counting rules of docs/workloads.md.
// Decode: B*L*Hkv*D*2*bytes(kv). Verify rows count their prefix and drafts the same way (they read
// the same pages); prefill and extend count the K/V they read once.
double counted_bytes(const Workload& w);
// Prefill: B*4*S^2*Hq*D/2. Extend: B*4*Hq*D*(E*P + E^2/2). Decode and verify: 4*Hq*D per visible
// (query, key) pair (informational: those rows are judged by bytes). MLA rows of every kind:
// 2*Hq*(qk + v columns) per exact visible pair (attention_work).
double counted_flops(const Workload& w);
// 4*Hq*D times the exact number of visible (query, key) pairs: the same work measure for every kind,
// used to compare the speed of two runs of different sizes (backend vs a scaled-down reference).
double attention_work(const Workload& w);

// Verify rows: parent of each of the N block tokens of one request (root = index 0, parent -1).
// Chain: t - 1. Tree: EAGLE-like levels of `topk` tokens, each hanging off a node of the level
// above, chosen by a fixed pseudo-random sequence so every run builds the same tree.
std::vector<int32_t> verify_parents(const Workload& w);
// Decode B x P: the row a verify row's time is divided by.
Workload decode_companion(const Workload& verify);

// Every row of docs/workloads.md, in a fixed order (decode, decode page 1, decode fp8, prefill, extend,
// verify).
std::vector<Workload> standard_workloads();
// The MLA rows of docs/workloads.md ("MLA rows", `--suite mla`), in a fixed order (decode, decode
// fp8, decode page 1, verify, then the MHA form's prefill and extend).
std::vector<Workload> mla_workloads();

// The fp8 variants of the large prefill / extend rows (fp8_prefill, names ending in "-fp8"):
// prefill-1x4096-fp8, prefill-1x16384-fp8, prefill-8x2048-fp8, extend-8x2048+512-fp8; then
// prefill-1x16384-kvfp8 and extend-8x2048+512-kvfp8, the same e4m3 cache without the fp8 kernel
// (what the option is measured against besides the bf16 rows), and prefill-1x8192-d64-kvfp8 and
// prefill-1x8192-d256-kvfp8 (the head dims the fp8 kernel does not take). Beside the
// docs/workloads.md set, selected by name or as "fp8-prefill" (not by "all" or a kind).
std::vector<Workload> fp8_prefill_workloads();
// The long-context decode rows (bf16, page 16): decode-1x131072 and decode-4x131072, one or a few
// requests whose keys a decode step must spread over many CTAs (split-KV, one merge). Beside the
// docs/workloads.md set, selected by name or as "long-decode" (not by "all" or a kind: their pools
// take 2-8 GB and the CPU backends minutes per row).
constexpr int kLongDecodeKeys = 131072;
std::vector<Workload> long_decode_workloads();
bool is_long_decode(const Workload& w);
// standard_workloads(), fp8_prefill_workloads(), then long_decode_workloads(): the rows
// select_workloads chooses from.
std::vector<Workload> attention_workloads();

// Selects rows: "all", a row name, a kind ("decode", "prefill", "extend", "verify"),
// "fp8-prefill", "long-decode", or a comma-separated list of those. Throws attnrt::Error naming the unknown entry
// and the valid names.
std::vector<Workload> select_workloads(std::string_view selector);
// The same over mla_workloads(): "all", a row name, a kind with or without the "mla-" prefix
// ("mla-decode", "mla-verify", "mla-verify-chain", "mla-prefill", "mla-extend", "decode", ...), or
// a list of those.
std::vector<Workload> select_mla_workloads(std::string_view selector);

// Multiplies batch and lengths by `factor` in (0, 1] (batch >= 1; lengths rounded to whole pages,
// at least one page; draft tokens, heads and dims never change). Records the change in scale_note.
Workload scale_workload(const Workload& w, double factor);
// The row over a KV pool of `page_size` slots a page instead of its own (attnrt bench
// --page-size): names unchanged, the change in scale_note ("page 128 instead of 16"); w itself
// when it already has that page size. Throws attnrt::Error for a page size outside [1, 4096].
Workload with_page_size(const Workload& w, int page_size);
// Halves the batch, then the lengths, until counted_bytes <= max_bytes and attention_work <=
// max_work; returns w unchanged when it already fits. `why` goes into scale_note.
Workload fit_workload(const Workload& w, double max_bytes, double max_work, std::string_view why);

// Named presets for small machines. "cpu-small": rows sized for a 2-core, 24 GB development box
// (KV read per row <= 1.25 GiB, attention work per call <= 6e11 FLOPs, shrunk by fit_workload).
// Throws attnrt::Error for an unknown name.
std::vector<Workload> apply_preset(const std::vector<Workload>& rows, std::string_view preset);
std::vector<std::string> preset_names();

}  // namespace attnrt::bench
