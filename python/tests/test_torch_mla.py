"""bench/torch_mla.py --device cpu --quick runs end to end (a subprocess, as a user runs it): its JSON
has every row of `attnrt bench --suite mla`, in order, each timed in the three torch forms (eager,
SDPA, MHA with its decompression) whose outputs agree with an fp32 recomputation and with each other,
with the CLI's verify tree; the MHA form is skipped with its reason past --mha-max-gb. Needs torch
only (not the attnrt package); about 15 s on 2 cores."""
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "torch_mla.py")

# bench/harness/workload.cpp mla_workloads(), in order.
MLA_ROWS = [f"mla-decode-h{h}-{b}x{l}{sfx}" for sfx in ("", "-fp8", "-p1")
            for h, b, l in ((16, 1, 32768), (16, 64, 8192), (128, 64, 4096), (128, 128, 8192))]
MLA_ROWS += ["mla-verify-chain-64x4096+4", "mla-verify-tree-64x4096+16-topk4"]
# The tree the CLI builds for the verify-tree row (verify_parents, top-k 4, 16 tokens).
CLI_TREE = [-1, 0, 0, 0, 0, 3, 3, 3, 4, 5, 5, 6, 8, 10, 11, 12]


def run(args, timeout=120):
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    res = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, (f"torch_mla.py {' '.join(args)} exited {res.returncode}\n"
                                 f"--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}")
    return res.stdout


def test_quick_on_the_cpu_has_every_row_and_the_forms_agree(tmp_path):
    path = tmp_path / "torch_mla.json"
    out = run(["--device", "cpu", "--quick", "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["schema"] == "attnrt-bench/1" and report["implementation"] == "torch-mla"
    assert report["softmax_scale"] == pytest.approx(1 / math.sqrt(576))
    rows = report["rows"]
    assert [r["name"] for r in rows] == MLA_ROWS, out
    for r in rows:
        assert r["status"] == "ok", r
        check = r["check"]
        assert check["passed"], r
        assert set(check["max_rel_err"]) == {"eager", "sdpa", "mha"}, r
        assert all(0 <= e <= 0.02 for e in check["max_rel_err"].values()), r
        assert set(check["pairwise_rel_err"]) == {"eager~sdpa", "eager~mha", "sdpa~mha"}, r
        assert all(0 <= e <= 0.02 for e in check["pairwise_rel_err"].values()), r
        for name in ("eager", "sdpa", "mha"):
            form = r["forms"][name]
            assert form["status"] == "ok", (name, r)
            assert form["time_ms"]["median"] > 0 and math.isfinite(form["rate"]), (name, r)
        mha = r["forms"]["mha"]
        assert mha["time_ms"]["median"] == pytest.approx(
            mha["attention_ms"]["median"] + mha["decompress_ms"]["median"])
        assert r["best_form"] in ("eager", "sdpa", "mha")
        assert r["time_ms"]["median"] == min(f["time_ms"]["median"] for f in r["forms"].values())
        assert r["counted"]["bytes"] > 0 and r["counted"]["flops"] > 0
        assert r["metric"] == ("GB/s" if r["shape"]["q_heads"] < 64 else "GFLOP/s"), r
        assert r["shape"]["head_dim"] == 576 and r["shape"]["v_head_dim"] == 512
    tree = rows[-1]
    assert tree["tree_parents"] == CLI_TREE
    assert "check ok" in out and "MISMATCH" not in out


def test_mha_form_skipped_past_the_memory_limit(tmp_path):
    path = tmp_path / "torch_mla.json"
    out = run(["--device", "cpu", "--quick", "--workload", "mla-decode-h16-1x32768,verify-chain",
               "--mha-max-gb", "0.001", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [r["name"] for r in rows] == ["mla-decode-h16-1x32768", "mla-verify-chain-64x4096+4"]
    for r in rows:
        assert r["status"] == "ok" and r["forms"]["mha"]["status"] == "skipped", r
        assert "--mha-max-gb" in r["forms"]["mha"]["reason"]
        assert r["best_form"] in ("eager", "sdpa")
        assert set(r["check"]["pairwise_rel_err"]) == {"eager~sdpa"}
    assert "skipped" in out
