#!/usr/bin/env bash
# Nsight Compute counters of one kernel of one `attnrt bench` row, for several prebuilt binaries
# (scripts/gpu_prebuild.sh DIR/bin.tar.xz each, carried with .devdeps): where an A/B shows a kernel
# slower, this says whether it executes more instructions or stalls more.
#   usage: scripts/gpu_ncu_ab.sh ROW KERNEL_REGEX DIR [DIR...]
# Environment: NCU_SUITE (attnrt bench --suite: attention, mla, linear; default attention),
# NCU_SECTIONS (default "SpeedOfLight WarpStateStats InstructionStats"), NCU_SKIP
# (launches of the kernel to skip first, default 2), NCU_METRICS (more metrics, comma-separated;
# instanced ones such as sass__inst_executed_per_opcode print their values per instance). Files in $OUT (default ./out/ncu):
# LABEL.txt per binary; the lines that compare are printed side by side at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
row=$1 kernel=$2
shift 2
out=${OUT:-$PWD/out/ncu}
mkdir -p "$out"
if [ -f .devdeps/unpack-debs.sh ]; then source .devdeps/unpack-debs.sh >/dev/null; fi
source scripts/gpubin.sh
sections=()
for s in ${NCU_SECTIONS:-SpeedOfLight WarpStateStats InstructionStats}; do sections+=(--section "$s"); done
labels=()
for dir in "$@"; do
  label=$(gpubin_label "$dir")
  bin=/tmp/ncu-bin/$label
  gpubin_unpack "$dir" "$bin" || exit 1
  ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip "${NCU_SKIP:-2}" --launch-count 1 \
    "${sections[@]}" --metrics "gpu__time_duration.sum,smsp__inst_executed.sum${NCU_METRICS:+,$NCU_METRICS}" \
    --print-metric-instances values \
    "$bin/attnrt" bench --backend cuda --suite "${NCU_SUITE:-attention}" --workload "$row" --repeats 2 --warmup 1 --no-reference --quiet \
    >"$out/$label.txt" 2>&1
  echo "$label: rc=$?"
  labels+=("$label")
done
# The metric lines of each report ("  Name  Unit  Value"), joined by name.
python3 - "$out" "${labels[@]}" <<'PY'
import re, sys
out, labels = sys.argv[1], sys.argv[2:]
tables = []
for label in labels:
    rows = {}
    for line in open(f"{out}/{label}.txt", errors="replace"):
        m = re.match(r"\s{4}(\S[\w .:/%()-]*?)\s{2,}(\S+)?\s{2,}([\d.,]+)\s*$", line)
        if m:
            rows.setdefault(m.group(1).strip(), m.group(3))
    tables.append(rows)
names = [n for n in tables[0]]
print("%-58s" % "metric" + "".join("%16s" % l[:15] for l in labels))
for n in names:
    print("%-58s" % n[:57] + "".join("%16s" % t.get(n, "-") for t in tables))
PY
