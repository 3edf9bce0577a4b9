"""The Python examples and bench scripts run end to end as a user runs them (subprocesses, small
arguments, on the CPU), and what they print holds up:

- examples/python/engine_step.py: every KV slot comes back after the request ends;
- examples/python/dcp_decode.py --ranks 3: ranks on threads agree with one runtime;
- examples/python/dsa_step.py --check: a DSA layer's chunked prefills and decodes select the
  tokens reference selects and agree with it within the bf16 tolerance;
- examples/python/serve.py --check: tokens/s > 0, every request produced its output length, the
  attention share of DECODE steps is a percentage in (0, 100), and the tokens generated with attnrt
  equal those of the same model and scheduler with plain torch SDPA attention, with and without
  MIXED steps (float32, so a difference is a wrong attention result, not rounding);
- bench/python_rows.py --quick --device cpu: every row passed its check against float32 torch,
  has positive times and rates, and a python / cli ratio when the CLI is there;
- bench/python_overhead.py --quick: the report's per-call figures are positive and finite.

About 30 s on 2 cores."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("torch")
attnrt = pytest.importorskip("attnrt")
# The scripts run as subprocesses must import the attnrt this test imported (the installed
# package, with its extension and CLI), not the source tree.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(attnrt.__file__)))
CLI = os.path.join(os.path.dirname(os.path.abspath(attnrt.__file__)), "bin", "attnrt")


def run(args, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [PACKAGE_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, (f"{' '.join(args)} exited {res.returncode}\n--- stdout\n"
                                 f"{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}")
    return res.stdout


def number(pattern, text):
    m = re.search(pattern, text)
    assert m, f"no match for {pattern!r} in:\n{text}"
    return float(m.group(1))


def test_engine_step_returns_every_slot():
    out = run(["examples/python/engine_step.py"])
    assert "EXTEND  prefix  200 + 100 new tokens" in out
    assert out.count("DECODE  seq_len") == 4
    m = re.search(r"done: (\d+) of (\d+) KV slots available again", out)
    assert m and m.group(1) == m.group(2) and int(m.group(1)) > 0, out


def test_dcp_decode_ranks_agree_with_one_runtime():
    out = run(["examples/python/dcp_decode.py", "--ranks", "3", "--batch", "2", "--context", "384",
               "--chunk", "128", "--steps", "3", "--layers", "1"])
    assert out.count("tokens/s") == 3
    assert "within the bf16 tolerance" in out, out


def test_dsa_step_selects_as_reference():
    out = run(["examples/python/dsa_step.py", "--check", "--lens", "150,70", "--chunk", "64",
               "--decodes", "3", "--topk", "32"])
    assert out.count("EXTEND ") == 3 and out.count("DECODE ") == 3, out
    m = re.search(r"selections equal to reference for (\d+) of (\d+) query tokens; largest "
                  r"output difference ([\d.e+-]+)", out)
    assert m, out
    agree, total, worst = int(m.group(1)), int(m.group(2)), float(m.group(3))
    assert total == 150 + 70 + 2 * 3 and agree >= 0.95 * total and worst < 0.1, out
    # The decodes attend exactly index_topk tokens (every request has more cached).
    assert "DECODE     2 tokens, each attends 32..32 selected keys" in out, out


@pytest.mark.parametrize("mixed", [True, False])
def test_serve_generates_the_tokens_of_torch_attention(mixed):
    args = ["examples/python/serve.py", "--device", "cpu", "--requests", "10",
            "--prompt-len", "8:120", "--output-len", "2:16", "--check", "--no-progress"]
    if not mixed:
        args.append("--no-mixed-chunk")
    out = run(args)
    assert number(r"throughput: ([\d.]+) generated tokens/s", out) > 0
    generated = number(r"generated tokens: (\d+)", out)
    assert generated == number(r"\(sum of output lengths: (\d+)\)", out) > 0
    share = number(r"attention share of DECODE step time: ([\d.]+)% of eager steps", out)
    assert 0 < share < 100
    m = re.search(r"check: (\d+) of (\d+) requests generated the same tokens", out)
    assert m and m.group(1) == m.group(2) == "10", out
    assert number(r"  MIXED   steps\s+(\d+)", out) > 0 if mixed else \
        number(r"  MIXED   steps\s+(\d+)", out) == 0


def test_python_rows_quick_on_the_cpu(tmp_path):
    path = tmp_path / "rows.json"
    args = ["bench/python_rows.py", "--device", "cpu", "--quick", "--json", str(path)]
    out = run(args, timeout=90)
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert len(rows) >= 4 and all(r["status"] == "ok" for r in rows), out
    cli = os.path.exists(CLI)
    for r in rows:
        assert r["check"]["passed"] and r["check"]["max_rel_err"] < 0.02, r
        assert r["python_ms"]["median"] > 0 and math.isfinite(r["rate"]) and r["rate"] > 0, r
        assert r["torch"]["sdpa"]["median"] > 0, r
        if cli:
            # Tiny CPU rows timed on a shared machine: only sanity (a unit mistake is a factor of
            # 1000), not a speed claim; the band is wide because other work can slow either side.
            assert 0.05 < r["python_over_cli"] < 20, r
        if r["shape"]["kind"].startswith("verify"):
            assert r["python_verify_over_decode"] > 0, r
    assert "python / cli:" in out


def test_python_overhead_quick(tmp_path):
    path = tmp_path / "overhead.json"
    out = run(["bench/python_overhead.py", "--quick", "--no-plan-bench", "--json", str(path)])
    d = json.loads(path.read_text())["decomposition"]
    f = d["forward"]
    assert f["over_cxx_us"] > 0 and f["native_us"] > 0 and math.isfinite(f["wrapper_python_us"])
    step = d["step_256x2048"]
    assert step["native_step_us"] > 0 and step["binding_fixed_us"] > 0
    assert "forward, per call:" in out and "step 256x2048:" in out
