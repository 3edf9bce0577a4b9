#!/usr/bin/env python3
"""bench/ab.py on synthetic reports: labels gather their rounds, medians, ratios to the base, the
bf16/fp8 ratio, and a clear exit on input that is not a bench report."""

import json
import os
import subprocess
import sys
import tempfile

AB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "ab.py")


def report(path, commit, times_us, pct=None):
    rows = [{"name": n, "time_ms": {"median": t / 1000.0}, "pct_of_ceiling": pct}
            for n, t in times_us.items()]
    with open(path, "w") as f:
        json.dump({"commit": commit, "ceilings": {"memory": {"value": 4273.0}}, "rows": rows}, f)


def run(*args):
    return subprocess.run([sys.executable, AB, *args], capture_output=True, text=True)


def main():
    with tempfile.TemporaryDirectory() as d:
        # base: two rounds (100, 120 -> median 110), new: one round at 100 -> 1.1x.
        report(os.path.join(d, "base_r1.json"), "aaa", {"decode-1": 100.0, "decode-1-fp8": 50.0}, 90.0)
        report(os.path.join(d, "base_r2.json"), "aaa", {"decode-1": 120.0, "decode-1-fp8": 60.0}, 80.0)
        report(os.path.join(d, "new_r1.json"), "bbb", {"decode-1": 100.0, "decode-1-fp8": 40.0}, 95.0)
        r = run(d)
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert "commit aaa" in out and "commit bbb" in out, out
        # The commits head their columns too (a stale base shows in the table).
        assert "base @aaa µs" in out and "new @bbb µs" in out, out
        assert "110.0 (100.0-120.0, 85.0%, 1.000x)" in out, out
        assert "100.0 (1 run, 95.0%, 1.100x)" in out, out
        # bf16 / fp8 per label: base 110 / 55 = 2.0x, new 100 / 40 = 2.5x.
        assert "base 2.000x new 2.500x" in out, out
        r = run(d, "--base", "new", "--markdown")
        assert r.returncode == 0 and "| decode-1 | 110.0 (100.0-120.0, 85.0%, 0.909x)" in r.stdout, r.stdout
        r = run(d, "--base", "nope")
        assert r.returncode != 0 and "labels: base, new" in r.stderr, r.stderr
        bad = os.path.join(d, "x.json")
        with open(bad, "w") as f:
            json.dump({"schema": "other"}, f)
        r = run(bad)
        assert r.returncode != 0 and "not an attnrt bench report" in r.stderr, r.stderr
    print("ab.py report checks passed")


if __name__ == "__main__":
    main()
