#!/usr/bin/env python3
"""Side-by-side table of an attnrt bench report and a bench/torch_sdpa.py or bench/torch_linear.py
report.

    python3 bench/compare.py attnrt.json torch.json [--markdown]

Rows are joined by name. A row is compared only when both sides ran the same shape (attention rows:
batch, lengths, head dim, page size, KV dtype; linear rows: layer kind, mode, batch, tokens, heads
and dims); otherwise the table says the shapes differ. Rows of the attnrt report that the torch
report does not cover (the other suite) are left out. The speed-up is torch time / attnrt time
(> 1: attnrt is faster). Targets on that ratio, where the issues set one: cpu decode and prefill
attention rows >= 1.5x; cuda GDN / KDA extend >= 10x and Mamba2 extend >= 50x the transformers
torch forms (cuda attention rows are judged against the measured ceilings instead, by attnrt bench
itself). Exit status 0 whatever the numbers: this is a report, not a gate.
"""

import argparse
import json
import sys

SHAPE_KEYS = ("batch", "prefix_len", "new_tokens", "head_dim", "page_size", "kv_dtype")
LINEAR_SHAPE_KEYS = ("kind", "mode", "batch", "prefix_len", "new_tokens", "num_k_heads",
                     "num_v_heads", "head_k_dim", "head_v_dim", "d_state", "n_groups", "chunk_size")


def target_of(row, backend):
    """The torch-ratio target of a row, or None where no issue sets one."""
    shape = row.get("shape", {})
    if row.get("suite") == "linear":
        if backend != "cuda" or shape.get("mode") != "extend":
            return None
        return 50.0 if shape.get("kind") == "mamba2" else 10.0
    if backend == "cpu" and shape.get("kind") in ("decode", "prefill"):
        return 1.5
    return None


def load(path, what):
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"{path}: cannot read the {what} report: {e}")
    if report.get("schema") != "attnrt-bench/1":
        sys.exit(f"{path}: not a bench report (schema {report.get('schema')!r}, "
                 "expected 'attnrt-bench/1')")
    return report


def shape_text(s):
    if "mode" in s:  # a linear row
        return f"{s['kind']} {s['mode']} {s['batch']}x{s['new_tokens']}"
    text = f"{s['batch']}x"
    text += f"{s['new_tokens']}" if s["kind"] == "prefill" else (
        f"{s['prefix_len'] + 1}" if s["kind"] == "decode" else f"({s['prefix_len']}+{s['new_tokens']})")
    if s["head_dim"] != 128:
        text += f" d{s['head_dim']}"
    if s["page_size"] != 16:
        text += f" p{s['page_size']}"
    if s["kv_dtype"] != "bf16":
        text += " fp8"
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("attnrt_json")
    ap.add_argument("torch_json")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args()
    ours = load(args.attnrt_json, "attnrt")
    theirs = load(args.torch_json, "torch")
    if ours.get("implementation") != "attnrt":
        sys.exit(f"{args.attnrt_json}: first argument must be the attnrt report "
                 f"(this one is {ours.get('implementation')!r})")
    by_name = {r["name"]: r for r in theirs["rows"]}
    # Compare the suite the torch report covers: linear rows (torch_linear.py) or attention rows.
    torch_linear = any(r.get("suite") == "linear" for r in theirs["rows"])

    header = ["row", "shape", "attnrt ms", "torch ms", "speed-up", "target"]
    lines = []
    for r in ours["rows"]:
        linear = r.get("suite") == "linear"
        if linear != torch_linear:
            continue
        keys = LINEAR_SHAPE_KEYS if linear else SHAPE_KEYS
        t = by_name.get(r["name"])
        shape = shape_text(r["shape"])
        if r.get("status") != "ok" or "time_ms" not in r:
            lines.append([r["name"], shape, f"attnrt {r.get('status')}", "", "", ""])
            continue
        a_ms = r["time_ms"]["median"]
        if t is None:
            lines.append([r["name"], shape, f"{a_ms:.2f}", "not run", "", ""])
            continue
        if t.get("status") != "ok":
            lines.append([r["name"], shape, f"{a_ms:.2f}", f"torch {t.get('error', 'error')}", "", ""])
            continue
        if any(r["shape"][k] != t["shape"].get(k) for k in keys):
            lines.append([r["name"], shape, f"{a_ms:.2f}",
                          f"shape differs: {shape_text(t['shape'])}", "", ""])
            continue
        t_ms = t["time_ms"]["median"]
        speedup = t_ms / a_ms
        target = target_of(r, ours.get("backend"))
        verdict = ("(no target)" if target is None else
                   f">= {target:g}x {'met' if speedup >= target else 'MISSED'}")
        lines.append([r["name"], shape, f"{a_ms:.2f}", f"{t_ms:.2f}", f"{speedup:.2f}x", verdict])

    what = (f"transformers {theirs.get('transformers_version', '?')} torch forms" if torch_linear
            else "SDPA")
    print(f"attnrt {ours.get('commit', '?')} backend {ours.get('backend')} ({ours.get('threads')} "
          f"threads) vs torch {theirs.get('torch_version', '?')} {what} ({theirs.get('threads')} "
          "threads); medians")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(str(x[i])) for x in lines + [header]) for i in range(len(header))]
        for line in [header] + lines:
            print("  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w)
                            for i, (x, w) in enumerate(zip(line, widths))))


if __name__ == "__main__":
    main()
