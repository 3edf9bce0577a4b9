#!/usr/bin/env bash
# The MLA CTA on the GPU machine, in one call: its GPU tests (CudaMla*), then `attnrt bench
# --suite mla` with the generic kernel (ATTNRT_MLA_CTA=0) and with the MLA CTA, and the table of
# both; NCU=1 adds Nsight Compute counters of the CTA on mla-decode-h128-64x4096.
#   usage: OUT=DIR scripts/gpu_mla.sh   (carry .gpubin from scripts/gpu_prebuild.sh and .devdeps)
# Environment: MODES (default "0 1": which ATTNRT_MLA_CTA values to time: 0 the generic kernel,
# 1 the MLA CTAs, 64 the 64-row CTA on every item), TESTS (gtest filter).
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/o}; mkdir -p $O
source .devdeps/unpack-debs.sh >/dev/null
source scripts/gpubin.sh
B=/tmp/bin; gpubin_unpack .gpubin $B
s=$(date +%s)
timeout 240 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="${TESTS:-CudaMla*:CudaGeneric.ConformanceFeaturesPass}" > $O/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s)-s )) s"; grep -E "FAILED|PASSED|SKIPPED|Failure|error|rel|worst" $O/tests.log | head -30
$B/attnrt info --model deepseek-v3 --explain 2>&1 | sed -n '/^Kernels/,$p' | tee $O/explain.txt
for mode in ${MODES:-0 1}; do
  s=$(date +%s)
  ATTNRT_MLA_CTA=$mode timeout 150 $B/attnrt bench --backend cuda --suite mla --no-reference --repeats 5 --warmup 1 --json $O/mla_$mode.json > $O/mla_$mode.txt 2>&1
  echo "mla cta=$mode rc=$? $(( $(date +%s)-s )) s"
done
python3 - $O <<'PY'
import json,sys
o=sys.argv[1]
import os
b=json.load(open(o+'/mla_1.json')); base=os.environ.get('BASE', '0')
a=json.load(open(o+'/mla_%s.json' % base)) if os.path.exists(o+'/mla_%s.json' % base) else b
print('ceilings', json.dumps(b.get('ceilings'))[:400])
rb={r['name']:r for r in b['rows']}
def f(r):
  return "%8.1f us %7.1f %-7s %5.1f%% chk=%s err=%.4f" % (r['time_ms']['median']*1000, r['rate'], r['metric'], r['pct_of_ceiling'], r['check']['passed'], r['check']['max_rel_err'])
for r in a['rows']:
  if r.get('status') != 'ok':
    print("%-32s %s %s" % (r['name'], r.get('status'), r.get('reason', r.get('error', ''))[:90]))
    continue
  x=rb.get(r['name'])
  print("%-32s base %s | mla %s | base/mla %.2fx" % (r['name'], f(r), f(x) if x else '-', r['time_ms']['median']/x['time_ms']['median'] if x else 0))
PY
if [ -n "${NCU:-}" ]; then
  for row in mla-decode-h128-64x4096; do
    timeout 120 ncu --clock-control none -k regex:mla_attention --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --metrics smsp__inst_executed.sum,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_mio_throttle \
      /tmp/bin/attnrt bench --backend cuda --suite mla --workload $row --repeats 2 --warmup 1 --no-reference --quiet > $O/ncu_$row.txt 2>&1
    echo "== ncu $row"; grep -E "Duration|inst_executed|pcsamp|Issue Slots|Compute \(SM\)|DRAM Through" $O/ncu_$row.txt | sed 's/  */ /g'
  done
fi
