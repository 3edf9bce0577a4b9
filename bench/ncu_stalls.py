#!/usr/bin/env python3
"""Where a kernel's warps wait, instruction by instruction, from Nsight Compute's source page.

    ncu --section WarpStateStats --section SourceCounters -o rep ...   (on the GPU machine)
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 bench/ncu_stalls.py sass.csv [--top 25] [--context 4] [--kernel NAME]

Prints, per kernel in the export: the stall samples by reason (share of all samples), the top
instructions by samples with their two main reasons and the lines before each (what the warp
waits for is usually a few instructions up: the load a scoreboard names, the barrier or MMA
wait), and "loads used at once": global loads (LDG) whose result the next few instructions
already read, which ptxas placed there and which make the warp wait a memory latency on the
spot (how the paired-tile MLA CTA's page-table wait showed), and the shared-memory wavefronts by
opcode against their ideal where the export has them (bank conflicts). Exit status 0 whatever it
finds; 1 on a file that is not such an export.

    cuobjdump -sass OBJECT > k.sass; python3 bench/ncu_stalls.py --sass k.sass

reads a SASS listing instead (no GPU, no samples): per function, its instruction count and the
loads used at once, so a change can be checked for them before it reaches the GPU.
"""

import argparse
import csv
import re
import signal
import sys

_LOAD = re.compile(r"^\s*(@!?U?P\w+\s+)?LDG\S*\s+(R\d+),")


def kernels(path):
    """(kernel name, header, rows) for each kernel section of the export."""
    out = []
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    i = 0
    while i < len(rows):
        row = rows[i]
        if row and row[0] == "Kernel Name":
            name = row[1] if len(row) > 1 else "?"
            header = rows[i + 1] if i + 1 < len(rows) else []
            j = i + 2
            while j < len(rows) and not (rows[j] and rows[j][0] == "Kernel Name"):
                j += 1
            out.append((name, header, [r for r in rows[i + 2:j] if len(r) == len(header)]))
            i = j
        else:
            i += 1
    return out


def as_int(s):
    try:
        return int(float(s.replace(",", "")))
    except ValueError:
        return 0


def report(name, header, rows, top, context, near):
    if "Source" not in header or "Warp Stall Sampling (All Samples)" not in header:
        print(f"{name}: no SASS stall columns (export with --print-source sass and SourceCounters)")
        return
    src = header.index("Source")
    total_col = header.index("Warp Stall Sampling (All Samples)")
    execd = header.index("Instructions Executed") if "Instructions Executed" in header else None
    reasons = [(c, k) for k, c in enumerate(header)
               if c.startswith("stall_") and "Not Issued" not in c]
    samples = [as_int(r[total_col]) for r in rows]
    total = sum(samples) or 1
    print(f"== {name}")
    print(f"{len(rows)} SASS instructions, {sum(samples)} stall samples")
    by = sorted(((sum(as_int(r[k]) for r in rows), c) for c, k in reasons), reverse=True)
    print("by reason: " + ", ".join(f"{c[6:]} {100.0 * n / total:.1f}%" for n, c in by if n))
    print(f"top {top} instructions (index, samples, % of all, executions, reasons):")
    order = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
    for i in order:
        if not samples[i]:
            break
        main = sorted(((as_int(rows[i][k]), c[6:]) for c, k in reasons), reverse=True)[:2]
        why = ", ".join(f"{c} {n}" for n, c in main if n)
        ex = rows[i][execd] if execd is not None else "-"
        print(f"  {i:6d} {samples[i]:6d} {100.0 * samples[i] / total:5.1f}% {ex:>9s}  "
              f"{rows[i][src].strip()[:70]}  [{why}]")
        for k in range(max(0, i - context), i):
            print(f"  {k:6d} {samples[k]:6d}                    {rows[k][src].strip()[:70]}")
    used = loads_used_at_once([r[src] for r in rows], near, samples)
    print(f"loads used within {near} instructions (samples from the load to the use):")
    for n, i, k in used[:top]:
        if not n:
            break
        print(f"  {i:6d} -> {k:6d} {n:6d}  {rows[i][src].strip()[:60]}  |  {rows[k][src].strip()[:50]}")
    shared_wavefronts(header, rows, src)


def opcode(text):
    """The instruction's opcode without its modifiers and predicate: LDGSTS, HGMMA, LDS, ..."""
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


def shared_wavefronts(header, rows, src):
    """Shared-memory wavefronts by opcode, actual against ideal (SourceCounters' "L1 Wavefronts
    Shared" and "... Ideal"): bank conflicts show as actual / ideal above 1 (how the fp8 paired-tile
    MLA CTA's raw copies and split conversion loads showed)."""
    if "L1 Wavefronts Shared" not in header or "L1 Wavefronts Shared Ideal" not in header:
        return
    actual_col = header.index("L1 Wavefronts Shared")
    ideal_col = header.index("L1 Wavefronts Shared Ideal")
    by = {}
    for r in rows:
        a, i = as_int(r[actual_col]), as_int(r[ideal_col])
        if a or i:
            t = by.setdefault(opcode(r[src]), [0, 0])
            t[0] += a
            t[1] += i
    if not by:
        return
    total_a = sum(t[0] for t in by.values())
    total_i = sum(t[1] for t in by.values())
    print(f"shared-memory wavefronts: {total_a} ({total_a / max(total_i, 1):.2f}x the ideal "
          f"{total_i}); by opcode, actual / ideal:")
    for op, (a, i) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        print(f"  {op:10s} {a:12d} / {i:12d}  {a / max(i, 1):5.2f}x")


def loads_used_at_once(code, near, samples=None):
    """(samples from the load to its use, load index, use index) of every global load whose
    destination register a later instruction within `near` reads, most samples first."""
    used = []
    for i, text in enumerate(code):
        m = _LOAD.match(text)
        if not m:
            continue
        reg = re.compile(r"\b" + m.group(2) + r"\b")
        for k in range(i + 1, min(i + 1 + near, len(code))):
            t = code[k].strip()
            operands = t.split(None, 1)[1] if " " in t else ""
            if reg.search(operands.split(",", 1)[1] if "," in operands else ""):
                used.append((sum(samples[i:k + 1]) if samples else 0, i, k))
                break
    used.sort(key=lambda u: (-u[0], u[1]))
    return used


def sass_functions(path):
    """(name, [instruction text]) of each function of a cuobjdump -sass listing."""
    funcs = []
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                funcs.append((m.group(1), []))
                continue
            m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
            if m and funcs:
                funcs[-1][1].append(m.group(1))
    return funcs


def report_sass(name, code, near, top):
    used = loads_used_at_once(code, near)
    print(f"== {name}")
    print(f"{len(code)} SASS instructions, {len(used)} global loads used within {near}")
    for _, i, k in used[:top]:
        print(f"  {i:6d} -> {k:6d}  {code[i][:60]}  |  {code[k][:50]}")

def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the output, not in a traceback
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu -i REP --page source --csv --print-source sass > FILE "
                                "(with --sass: cuobjdump -sass OBJECT > FILE)")
    ap.add_argument("--sass", action="store_true",
                    help="the file is a cuobjdump -sass listing: loads used at once only")
    ap.add_argument("--top", type=int, default=25, help="instructions listed (25)")
    ap.add_argument("--context", type=int, default=3, help="lines shown before each (3)")
    ap.add_argument("--near", type=int, default=12,
                    help="a load whose register is read within this many instructions counts as "
                         "used at once (12)")
    ap.add_argument("--kernel", default="", help="only kernels whose name contains this")
    a = ap.parse_args()
    if a.sass:
        funcs = [f for f in sass_functions(a.csv) if a.kernel in f[0]]
        if not funcs:
            sys.exit(f"{a.csv}: no function in it (expected `cuobjdump -sass` output)")
        for name, code in funcs:
            report_sass(name, code, a.near, a.top)
        return
    found = [k for k in kernels(a.csv) if a.kernel in k[0]]
    if not found:
        sys.exit(f"{a.csv}: no kernel in it (expected `ncu -i REP --page source --csv "
                 f"--print-source sass` output" + (f" with a kernel named *{a.kernel}*)" if a.kernel
                                                   else ")"))
    for name, header, rows in found:
        report(name, header, rows, a.top, a.context, a.near)


if __name__ == "__main__":
    main()
