#!/usr/bin/env python3
"""Side-by-side table of several `attnrt bench --json` reports of the same rows: builds or settings
under A/B comparison, each run one or more times (rounds).

    python3 bench/ab.py DIR_OR_FILES... [--base LABEL] [--markdown]

A report's label is its file name without the .json and a trailing `_rN` (main_r1.json and
main_r2.json are two rounds of `main`), so one label gathers its rounds. Per row and label the table
gives the median time over the rounds (µs), the spread of the rounds' medians, % of the row's
ceiling, and the time of the base label (the first, or --base) over the label's (> 1: faster than
the base). Rows ending in -fp8 also get the bf16 row's time over the fp8 row's in the same label
(the fp8 tokens/s ratio of issue 4's targets). Lines that start with `copy` list each report's
measured copy ceiling and the commit the binary was built from, so a change in the machine or a
mixed-up binary shows. Exit status 0 whatever the numbers.
"""

import argparse
import glob
import json
import os
import re
import statistics
import sys


def label_of(path):
    name = os.path.basename(path)
    if name.endswith(".json"):
        name = name[:-5]
    return re.sub(r"_r\d+$", "", name)


def load_reports(paths):
    files = []
    for p in paths:
        files.extend(sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p])
    reports = []
    for f in files:
        try:
            with open(f) as fh:
                j = json.load(fh)
        except (OSError, ValueError) as e:
            sys.exit(f"ab.py: {f}: {e}")
        if "rows" not in j:
            sys.exit(f"ab.py: {f} is not an attnrt bench report (no 'rows'); pass the --json files")
        reports.append((label_of(f), f, j))
    if not reports:
        sys.exit("ab.py: no reports found; pass attnrt bench --json files or folders holding them")
    return reports


def gather(reports):
    """{row: {label: [(time_us, pct), ...]}} and the row order of the first report."""
    rows, order = {}, []
    for label, _, j in reports:
        for r in j["rows"]:
            t = r.get("time_ms", {}).get("median")
            if t is None:
                continue
            name = r["name"]
            if name not in rows:
                rows[name] = {}
                order.append(name)
            rows[name].setdefault(label, []).append((t * 1000.0, r.get("pct_of_ceiling")))
    return rows, order


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="attnrt bench --json files, or folders of them")
    ap.add_argument("--base", help="label the ratios are taken against (default: the first)")
    ap.add_argument("--markdown", action="store_true", help="a Markdown table")
    args = ap.parse_args()

    reports = load_reports(args.reports)
    labels = list(dict.fromkeys(label for label, _, _ in reports))
    base = args.base or labels[0]
    if base not in labels:
        sys.exit(f"ab.py: --base {base} is not a label of the reports; labels: {', '.join(labels)}")
    for label, f, j in reports:
        mem = j.get("ceilings", {}).get("memory", {}).get("value")
        print(f"copy {label} ({os.path.basename(f)}, commit {j.get('commit', '?')}): "
              f"{f'{mem:.1f}' if isinstance(mem, (int, float)) else '-'} GB/s")

    rows, order = gather(reports)
    med = {n: {l: statistics.median(t for t, _ in v) for l, v in by.items()} for n, by in rows.items()}

    # Each label's commit(s) in its column's head: a base folder left from an older build shows in
    # the table itself, not only in the copy lines above it.
    commits = {l: ",".join(dict.fromkeys(str(j.get("commit", "?")) for lb, _, j in reports if lb == l))
               for l in labels}
    head = ["row"] + [f"{l} @{commits[l]} µs (spread, %ceil, {base}/{l})" for l in labels]
    if any(n.endswith("-fp8") for n in order):
        head.append("bf16/fp8 time per label")
    lines = []
    for n in order:
        cells = [n]
        for l in labels:
            v = rows[n].get(l)
            if not v:
                cells.append("-")
                continue
            ts = [t for t, _ in v]
            pcts = [p for _, p in v if p is not None]
            spread = f"{min(ts):.1f}-{max(ts):.1f}" if len(ts) > 1 else "1 run"
            pct = f"{statistics.median(pcts):.1f}%" if pcts else "-"
            ratio = f"{med[n][base] / med[n][l]:.3f}x" if base in med[n] else "-"
            cells.append(f"{med[n][l]:.1f} ({spread}, {pct}, {ratio})")
        if n.endswith("-fp8"):
            bf = n[: -len("-fp8")]
            cells.append(" ".join(f"{l} {med[bf][l] / med[n][l]:.3f}x" for l in labels
                                  if bf in med and l in med[bf] and l in med[n]) or "-")
        elif len(head) > len(labels) + 1:
            cells.append("")
        lines.append(cells)

    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for c in lines:
            print("| " + " | ".join(c) + " |")
    else:
        widths = [max(len(r[i]) for r in [head] + lines) for i in range(len(head))]
        for r in [head] + lines:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    main()
