#!/usr/bin/env python3
"""bench/ncu_stalls.py on a synthetic Nsight Compute source export: the reasons' shares, the top
instruction with the lines before it, a load whose result is read at once, and a clear exit on a
file that is not such an export; and on a cuobjdump -sass listing (--sass)."""

import csv
import os
import subprocess
import sys
import tempfile

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "ncu_stalls.py")
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed", "stall_long_sb",
          "stall_barrier", "stall_wait", "stall_long_sb (Not Issued)"]


def row(i, src, long_sb=0, barrier=0, wait=0):
    n = long_sb + barrier + wait
    return [hex(0x1000 + 16 * i), src, str(n), str(n), "1024", str(long_sb), str(barrier), str(wait),
            str(long_sb)]


def run(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)


def main():
    rows = [row(0, "IMAD R2, R0, 0x4, RZ", wait=1),
            row(1, "LDG.E R4, desc[UR4][R2.64]"),
            row(2, "IADD3 R6, R0, 0x1, RZ", wait=2),
            row(3, "SHF.R.S32.HI R5, RZ, 0x1f, R4", long_sb=60),
            row(4, "LDG.E R8, desc[UR4][R2.64+0x4]"),
            row(5, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0", wait=3),
            row(6, "WARPGROUP.DEPBAR.LE gsb0, 0x0", barrier=30),
            row(7, "IMAD R9, R8, 0x2, RZ", wait=4)]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sass.csv")
        with open(path, "w", newline="") as f:
            w = csv.writer(f, quoting=csv.QUOTE_ALL)
            w.writerow(["Kernel Name", "void k<float>(Params)"])
            w.writerow(HEADER)
            w.writerows(rows)
        r = run(path, "--top", "2", "--context", "2", "--near", "2")
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert "8 SASS instructions, 100 stall samples" in out, out
        assert "long_sb 60.0%, barrier 30.0%, wait 10.0%" in out, out
        # The top instruction, its reasons and the two lines before it.
        lines = out.splitlines()
        top = [k for k, l in enumerate(lines) if "SHF.R.S32.HI R5" in l and "[long_sb 60]" in l]
        assert top and "LDG.E R4" in lines[top[0] + 1] and "IADD3 R6" in lines[top[0] + 2], out
        # LDG R4 is read two instructions later (within --near 2); LDG R8 three after (IMAD R9), so
        # it is not listed.
        assert "1 ->      3     62  LDG.E R4" in out, out
        assert "LDG.E R8" not in out.split("loads used within")[1], out
        assert "shared-memory wavefronts" not in out, out  # no wavefront columns in this export
        # With SourceCounters' shared-memory wavefront columns: totals by opcode against the ideal.
        wpath = os.path.join(d, "waves.csv")
        with open(wpath, "w", newline="") as f:
            w = csv.writer(f, quoting=csv.QUOTE_ALL)
            w.writerow(["Kernel Name", "void k<float>(Params)"])
            w.writerow(HEADER + ["L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"])
            w.writerow(row(0, "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64], P0", wait=1) +
                       ["500", "100"])
            w.writerow(row(1, "@P1 LDS.128 R4, [R6]", wait=1) + ["40", "40"])
            w.writerow(row(2, "LDGSTS.E.BYPASS.128 [R1+0x80], desc[UR4][R2.64+0x10], P0") +
                       ["500", "100"])
        r = run(wpath)
        assert r.returncode == 0, r.stderr
        assert "shared-memory wavefronts: 1040 (4.33x the ideal 240)" in r.stdout, r.stdout
        assert "LDGSTS             1000 /          200   5.00x" in r.stdout, r.stdout
        assert "LDS                  40 /           40   1.00x" in r.stdout, r.stdout
        r = run(path, "--kernel", "nope")
        assert r.returncode != 0 and "no kernel in it" in r.stderr, r.stderr
        bad = os.path.join(d, "x.csv")
        with open(bad, "w") as f:
            f.write("a,b\n1,2\n")
        r = run(bad)
        assert r.returncode != 0 and "no kernel in it" in r.stderr, r.stderr
        # A cuobjdump -sass listing: the function, its count, the load read at once.
        listing = os.path.join(d, "k.sass")
        with open(listing, "w") as f:
            f.write("\tcode for sm_90a\n\t\tFunction : _Z1kv\n")
            for i, text in enumerate(["LDG.E R4, desc[UR4][R2.64]", "IADD3 R6, R0, 0x1, RZ",
                                      "SHF.R.S32.HI R5, RZ, 0x1f, R4", "EXIT", "BRA 0x40"]):
                f.write(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x0 */\n")
        r = run("--sass", listing)
        assert r.returncode == 0, r.stderr
        assert "5 SASS instructions, 1 global loads used within 12" in r.stdout, r.stdout
        assert "0 ->      2  LDG.E R4" in r.stdout, r.stdout
        r = run("--sass", path)
        assert r.returncode != 0 and "no function in it" in r.stderr, r.stderr
    print("ncu_stalls.py checks passed")


if __name__ == "__main__":
    main()
