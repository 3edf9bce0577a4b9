// `attnrt bench --dcp-size N` (docs/dcp.md "Benchmark"): decode rows of one Llama-3-8B attention
// layer (32 q heads, 8 kv heads, head_dim 128, bf16, page size 1) on one `cuda` runtime holding
// every token and on a DcpAttention of N `cuda` ranks SHARING ONE GPU, timed with CUDA events per
// phase: each rank's partial (gather, attention over its share, pack), the all-to-all
// (device-to-device copies) and the merge kernels. The ranks run one after another on the one
// GPU, so the group's time is not DCP's speed; the projection "one rank's partial + exchange +
// merge" is what N GPUs would take if the exchange cost what it costs here (it does not: NVLink).
#pragma once

#include <string>
#include <vector>

namespace attnrt::bench {

struct DcpBenchRow {
  std::string name;  // dcp-decode-BxL
  int batch = 0, len = 0, ranks = 0;
  double single_us = 0;               // one runtime, every token
  std::vector<double> rank_us;        // each rank's partial (gather + attention + pack)
  double exchange_us = 0, merge_us = 0;
  double projected_us() const;        // max(rank_us) + exchange + merge
  std::string error;                  // why the row could not run ("" = it ran)
};

struct DcpBenchConfig {
  int ranks = 2;
  double scale = 1.0;  // lengths and batches scaled, as --scale
  int repeats = 10, warmup = 2;
  // Row names (dcp-decode-BxL, or decode-BxL); empty = the standard set: 1x131072, 8x131072,
  // 64x8192 (the merge at batch 64).
  std::vector<std::string> rows;
};

// Throws attnrt::Error where no CUDA device is usable (or the build has none).
std::vector<DcpBenchRow> run_dcp_bench(const DcpBenchConfig& config);
std::string format_dcp_report(const DcpBenchConfig& config, const std::vector<DcpBenchRow>& rows);

}  // namespace attnrt::bench
