// What a bench run reports: the machine and build it ran on, a table for people, and JSON for
// tools (bench/compare.py, docs/BENCHMARKS.md). Schema "attnrt-bench/1", written out in docs/bench.md.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "bench/harness/runner.h"

namespace attnrt::bench {

struct MachineInfo {
  std::string cpu_model;
  int logical_cpus = 0;
  int physical_cores = 0;
  double memory_gib = 0;
  std::string simd_target;  // best Highway target of this CPU
  std::string cuda;         // device name, or why there is none
};
MachineInfo describe_machine();

// `git describe --always --dirty` of the source tree at build time ("unknown" outside git).
std::string build_commit();

struct RunInfo {
  std::string command;  // the command line, for the record
  double scale = 1.0;
  std::string preset;
  std::string created;  // UTC, ISO 8601
  MachineInfo machine;
  std::string commit;
};
// Fills created, machine and commit.
RunInfo make_run_info(std::string command, double scale, std::string preset);

nlohmann::json to_json(const BenchResult& result, const RunInfo& info);
// Throws attnrt::Error when the file cannot be written.
void write_json(const std::string& path, const BenchResult& result, const RunInfo& info);

// The table printed on stdout: ceilings, one line per row, then the notes (scaling, reference
// measurement, failures).
std::string format_report(const BenchResult& result, const RunInfo& info);

}  // namespace attnrt::bench
