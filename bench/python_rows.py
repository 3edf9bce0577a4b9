#!/usr/bin/env python3
"""The standard bench rows of docs/workloads.md through attnrt's Python API, beside the CLI and torch.

Per row, three measurements of the same shape in one process (the CLI as a subprocess first, so it
has the GPU to itself):

  python   attnrt.Runtime with torch tensors: a one-layer model with the row's heads and head_dim,
           the KV pool filled with random values, the requests' pages a random permutation of the
           pool (page 0 reserved), req_to_token written, begin_step(batch) once, then the timed
           call is rt.forward(0, q, k, v, out) (K/V stored at out_cache_loc, attention), exactly
           what `attnrt bench` times (bench/harness/runner.cpp: the plan runs once before timing, the
           timed region is one backend forward of the layer). The step is ended after timing.
  cli      `attnrt bench --backend cuda|cpu --workload ROWS --json` (--cli), same shapes (this
           script takes the shapes, the verify tree and the decode companion of verify rows from
           the CLI's JSON), same --warmup / --repeats.
  torch    the same shapes through torch: SDPA (on a GPU the faster of its flash and cuDNN
           kernels) and FlexAttention compiled with a block mask (skipped, with the reason, when it
           fails; on the CPU only with --flex-cpu, its compilation takes minutes on a small box),
           on dense K/V gathered from attnrt's own pool before timing (torch has no paged KV; fp8
           is dequantised to bf16 then), as bench/torch_sdpa.py does.

Timing, as the CLI's: `--warmup` untimed calls, then `--repeats` calls each after a cache flush
(GPU: a max(256 MiB, 4 x L2) buffer written, on torch's current stream, which is the legacy
default stream the CLI records on; ATTNRT_BENCH_FLUSH=clean reads it instead; CPU: twice the
last-level cache written), CUDA events around the call on the GPU, perf_counter on the CPU; the
median is reported. Before timing, the Python output is checked against a float32 torch
computation from the pool (sampled query rows, relative error <= 0.02 as the CLI's check).

Reported per row: median ms, GB/s (decode and verify rows: bytes = B*L*Hkv*D*2*bytes per element)
or TFLOP/s (prefill and extend: docs/workloads.md's FLOPs), python / cli time (target: within 2%),
torch time / python time (> 1: attnrt is faster), and for verify rows verify / decode time.

    python bench/python_rows.py --device cuda --cli python/attnrt/bin/attnrt --json rows.json
    python bench/python_rows.py --device cpu --quick          # small shapes, < 60 s on 2 cores
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch and attnrt's OpenMP (serve.py says why)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
ROOT = os.path.dirname(HERE)

import torch  # noqa: E402

from bench_util import set_torch_threads, time_calls, timing_ms  # noqa: E402
from torch_sdpa import STANDARD, counted, eagle_tree, standard_rows  # noqa: E402

import attnrt  # noqa: E402

TARGET_CLI_RATIO = 0.02
# Rows run by default: a spread of every kind that fits in gpu_python.sh's 240 s with
# FlexAttention compiling per shape. --rows all runs every standard row.
DEFAULT_CUDA_ROWS = [
    "decode-1x32768", "decode-16x4096", "decode-64x4096", "decode-256x2048", "decode-32x32768",
    "decode-64x4096-p1", "decode-128x8192-fp8", "prefill-1x4096", "prefill-8x2048",
    "extend-8x2048+512", "verify-chain-64x4096+8", "verify-tree-64x4096+16-topk4",
]
DEFAULT_CPU_ROWS = ["decode-16x4096", "decode-64x4096-fp8", "prefill-1x1024", "extend-8x2048+512",
                    "verify-chain-64x4096+8", "verify-tree-64x4096+16-topk4"]
QUICK_SCALE = {"cpu": 1 / 32, "cuda": 1.0}


# ---- rows ------------------------------------------------------------------------------------
def pick_rows(spec: str, device: str) -> list[str]:
    names = [r[0] for r in STANDARD]
    if spec == "default":
        return DEFAULT_CUDA_ROWS if device == "cuda" else DEFAULT_CPU_ROWS
    if spec == "all":
        return names
    out = []
    for part in spec.split(","):
        hit = [n for n in names if n == part] or [
            n for n, kind, *_ in STANDARD if kind == part or (part == "verify" and kind.startswith("verify"))]
        if not hit:
            sys.exit(f"--rows: {part!r} is not a row name or kind (decode, prefill, extend, verify); "
                     f"rows: {', '.join(names)}")
        out += [n for n in hit if n not in out]
    return out


def depth_of(parents, t):
    d = 0
    while parents[t] >= 0:
        t, d = parents[t], d + 1
    return d


def row_parents(row):
    n = row["new_tokens"]
    if row["kind"] == "verify-tree":
        return list(row.get("tree_parents") or eagle_tree(n, row["topk"]))
    return [t - 1 for t in range(n)]  # a chain (also the causal rule of extend / prefill)


def visible(row, parents):
    """[N, kv_len] bool: which keys each new token sees (prefix, then its mask among the new)."""
    p, n = row["prefix_len"], row["new_tokens"]
    m = torch.zeros(n, p + n, dtype=torch.bool)
    m[:, :p] = True
    if row["kind"] == "verify-tree":
        for t in range(n):
            a = t
            while a >= 0:
                m[t, p + a] = True
                a = parents[a]
    else:
        m[:, p:] = torch.ones(n, n, dtype=torch.bool).tril()
    return m


def model_config(row) -> dict:
    hq, hkv, d = row["q_heads"], row["kv_heads"], row["head_dim"]
    return {"model_type": "llama", "_name_or_path": f"bench-{row['name']}", "num_hidden_layers": 1,
            "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": d,
            "hidden_size": hq * d, "max_position_embeddings": row["prefix_len"] + row["new_tokens"] + row["page_size"],
            "torch_dtype": "bfloat16"}


# ---- attnrt through Python -------------------------------------------------------------------
class PyRow:
    """One row laid out in an attnrt.Runtime: pool, req_to_token, batch, q / k / v / out."""

    def __init__(self, row, device, threads, seed):
        self.row = row
        b, p, n, page = row["batch"], row["prefix_len"], row["new_tokens"], row["page_size"]
        kv_len = p + n
        self.kind = row["kind"]
        self.parents = row_parents(row) if self.kind.startswith("verify") else None
        opts = {}
        if self.parents is not None:
            steps = max(1, max(depth_of(self.parents, t) for t in range(n))) \
                if row["kind"] == "verify-tree" else n - 1
            opts = dict(speculative_num_draft_tokens=n, speculative_eagle_topk=row.get("topk", 1),
                        speculative_num_steps=steps)
        per_req_pages = -(-kv_len // page)
        pages = b * per_req_pages
        self.rt = attnrt.Runtime(
            model_config(row), dtype=torch.bfloat16, attention_backend=device, page_size=page,
            kv_cache_dtype=row["kv_dtype"], max_requests=b, kv_slots=pages * page,
            max_num_tokens=b * n, max_context_len=per_req_pages * page, cuda_graphs=False,
            num_threads=threads, **opts)
        rt = self.rt
        dev = rt.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        # The pool: every row random (fp8 pools hold e4m3 bytes), in chunks to bound the temporary.
        kpool, vpool, self.k_scale, self.v_scale = rt.kv_buffers(0)
        self.kpool, self.vpool = kpool, vpool
        fp8 = row["kv_dtype"].startswith("fp8")
        for buf in (kpool, vpool):
            flat = buf.view(buf.shape[0], -1)
            step = max(1, (64 << 20) // (4 * flat.shape[1]))
            for r0 in range(0, flat.shape[0], step):
                x = torch.randn(min(step, flat.shape[0] - r0), flat.shape[1], generator=gen,
                                device=dev)
                flat[r0:r0 + x.shape[0]].copy_(
                    x.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else x.to(buf.dtype))
        # Pages 1..pages in a random order (page 0 reserved), as the CLI's RowData.
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)) + 1
        tok = torch.arange(kv_len)
        slots = order[torch.arange(b)[:, None] * per_req_pages + tok // page] * page + tok % page
        self.slots = slots  # [B, kv_len], CPU int64
        self.rows = [rt.alloc_request() for _ in range(b)]
        for r, srow in zip(self.rows, slots):
            rt.write_req_to_token(r, 0, srow)
        loc = slots[:, p:].reshape(-1)
        if self.kind == "decode":
            self.batch = attnrt.ForwardBatch("DECODE", self.rows, [kv_len] * b, loc,
                                             positions=[kv_len - 1] * b)
        elif self.kind in ("prefill", "extend"):
            self.batch = attnrt.ForwardBatch("EXTEND", self.rows, [kv_len] * b, loc,
                                             extend_prefix_lens=[p] * b, extend_seq_lens=[n] * b,
                                             positions=list(range(p, kv_len)) * b)
        else:
            spec = attnrt.SpecInfo(draft_token_num=n, topk=row.get("topk", 1),
                                   parents=self.parents * b)
            pos = [p + depth_of(self.parents, t) for t in range(n)] * b
            self.batch = attnrt.ForwardBatch("TARGET_VERIFY", self.rows, [p] * b, loc,
                                             positions=pos, spec_info=spec)
        t, hq, hkv, d = b * n, row["q_heads"], row["kv_heads"], row["head_dim"]
        rnd = lambda *s: torch.randn(*s, generator=gen, device=dev).to(torch.bfloat16)  # noqa: E731
        self.q, self.k, self.v = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d)
        self.out = torch.empty(t, hq, d, dtype=torch.bfloat16, device=dev)

    def begin(self):
        self.rt.begin_step(self.batch)

    def forward(self):
        self.rt.forward(0, self.q, self.k, self.v, self.out)

    def end(self):
        self.rt.end_step()

    def dense_kv(self, dtype=torch.bfloat16, reqs=None):
        """K / V of the requests `reqs` (default all) gathered from the pool: [B, Hkv, kv_len, D]
        (fp8 dequantised)."""
        slots = self.slots if reqs is None else self.slots[reqs]
        b, kv_len = slots.shape
        idx = slots.reshape(-1).to(self.kpool.device)
        res = []
        for pool, scale in ((self.kpool, self.k_scale), (self.vpool, self.v_scale)):
            x = pool[idx]
            if self.row["kv_dtype"].startswith("fp8"):
                x = x.view(torch.float8_e4m3fn).to(torch.float32) * float(scale or 1.0)
            x = x.to(dtype).view(b, kv_len, *pool.shape[1:]).transpose(1, 2).contiguous()
            res.append(x)
        return res

    def check(self, tol=0.02):
        """Max relative L2 error of sampled output vectors against float32 torch attention
        (first and last request; up to 16 query tokens at each end of them)."""
        row = self.row
        b, n, hq = row["batch"], row["new_tokens"], row["q_heads"]
        reqs = sorted({0, b - 1})
        k, v = self.dense_kv(torch.float32, reqs)
        mask = visible(row, self.parents or []).to(k.device)
        worst = 0.0
        for i, r in enumerate(reqs):
            toks = sorted(set(range(min(16, n))) | set(range(max(0, n - 16), n)))
            ti = torch.tensor(toks, device=k.device)
            q = self.q[r * n:(r + 1) * n][ti].float().transpose(0, 1).unsqueeze(0)  # [1, Hq, t, D]
            ref = torch.nn.functional.scaled_dot_product_attention(
                q, k[i:i + 1], v[i:i + 1], attn_mask=mask[ti], enable_gqa=True)[0].transpose(0, 1)
            got = self.out[r * n:(r + 1) * n][ti].float()
            err = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
            worst = max(worst, err.max().item())
        del k, v
        return {"max_rel_err": worst, "tolerance": tol, "passed": worst <= tol,
                "method": "float32 torch SDPA from the pool's K/V: requests 0 and B-1, up to 32 "
                          "query tokens each"}

    def close(self):
        self.rt.close()


def make_flush(device):
    """The CLI's flush (bench/harness/timing.cpp, bench/harness/cuda_bench.cpp) on torch's stream."""
    if device == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
        buf = torch.zeros(max(256 << 20, 4 * l2), dtype=torch.uint8, device="cuda")
        if os.environ.get("ATTNRT_BENCH_FLUSH", "") == "clean":
            return lambda: buf.max(), "clean"
        state = [0]

        def write():
            state[0] += 1
            buf.fill_(state[0] & 0xff)  # a memset, as cudaMemsetAsync

        return write, "write"
    from bench_util import make_flush as cpu_flush
    return cpu_flush(torch, "cpu", "write"), "write"


LEAD_US = 0.0  # --gpu-lead-us


def time_python(pr: PyRow, device, warmup, repeats, flush):
    pr.begin()
    try:
        pr.forward()
        if device == "cuda":
            torch.cuda.synchronize()
        check = pr.check()
        samples = time_calls(torch, pr.forward, device, warmup, repeats, flush, LEAD_US)
    finally:
        pr.end()
    return samples, check


# ---- torch anchors ---------------------------------------------------------------------------
def torch_anchors(pr: PyRow, args, flush, allow_flex):
    """{name: {median_ms,...} or {error}} for SDPA (flash / cuDNN on a GPU) and FlexAttention."""
    from torch_sdpa import cuda_calls

    row = pr.row
    b, n, hq, d = row["batch"], row["new_tokens"], row["q_heads"], row["head_dim"]
    k, v = pr.dense_kv()
    q = pr.q.view(b, n, hq, d).transpose(1, 2).contiguous()
    causal = row["kind"] == "prefill"
    mask = None
    if row["kind"] in ("extend", "verify-chain", "verify-tree"):
        mask = visible(row, pr.parents or []).to(q.device)
    F = torch.nn.functional
    out = {}
    if args.device == "cuda":
        kernels = ["flash", "cudnn"] + (["flex"] if allow_flex is True else [])
        calls = cuda_calls(torch, F, q, k, v, mask, causal, kernels)
    else:
        calls = {"sdpa": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)}
        if allow_flex is True:
            calls.update({n_: c for n_, c in cuda_calls(torch, F, q, k, v, mask, causal,
                                                         ["flex"]).items()})
    if allow_flex is not True:
        out["flex"] = {"error": f"skipped: {allow_flex}"}
    for name, call in calls.items():
        try:
            s = time_calls(torch, call, args.device, args.warmup, args.repeats, flush)
            out[name] = timing_ms(s)
        except Exception as e:  # noqa: BLE001 - a kernel that does not take the shape says why
            out[name] = {"error": (str(e).strip().split("\n")[0] or type(e).__name__)[:200]}
    best = [x for n_, x in out.items() if n_ in ("flash", "cudnn", "sdpa") and "median" in x]
    if best:
        out["sdpa_best_ms"] = min(x["median"] for x in best)
    del q, k, v, mask
    return out


# ---- the CLI ---------------------------------------------------------------------------------
def default_cli():
    for c in (os.path.join(ROOT, "python", "attnrt", "bin", "attnrt"),
              os.path.join(os.path.dirname(attnrt.__file__), "bin", "attnrt"),
              os.path.join(ROOT, "build", "attnrt")):
        if os.path.exists(c):
            return c
    return None


def run_cli(args, names, scale, timeout):
    """(rows by name, report) from `attnrt bench`, or ({}, {"error": ...})."""
    if not args.cli or not os.path.exists(args.cli):
        return {}, {"error": f"no CLI at {args.cli!r} (pass --cli)"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cli.json")
        cmd = [args.cli, "bench", "--backend", args.device, "--workload", ",".join(names),
               "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--no-reference",
               "--quiet", "--json", path]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if scale != 1.0:
            cmd += ["--scale", repr(scale)]
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {}, {"error": f"{' '.join(cmd)}: no answer in {timeout:.0f} s", "command": cmd}
        wall = time.perf_counter() - t0
        if not os.path.exists(path):
            tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
            return {}, {"error": f"rc {res.returncode}: {' | '.join(tail)}", "command": cmd}
        with open(path) as f:
            report = json.load(f)
    rows = {r["name"]: r for r in report.get("rows", [])}
    return rows, {"command": cmd, "rc": res.returncode, "wall_s": wall,
                  "timer": report.get("timer"), "commit": report.get("commit"),
                  "ceilings": report.get("ceilings"), "host_sync": report.get("host_sync")}


def row_from_cli(cli_row, fallback):
    s = dict(cli_row["shape"])
    row = dict(fallback)
    for key in ("batch", "prefix_len", "new_tokens", "head_dim", "page_size", "kv_dtype", "q_heads",
                "kv_heads", "topk", "tree_parents"):
        if key in s:
            row[key] = s[key]
    return row


# ---- main ------------------------------------------------------------------------------------
def rate_of(row, ms):
    unit, amount = counted(row)
    if unit == "GFLOP/s":
        return "TFLOP/s", amount / (ms * 1e-3) / 1e12
    return "GB/s", amount / (ms * 1e-3) / 1e9


def fmt_ratio(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="cuda (the cuda backend) or cpu (the cpu backend); default cuda when "
                         "attnrt and torch both see a GPU")
    ap.add_argument("--rows", default="default",
                    help="default (a spread of kinds), all, or comma-separated row names / kinds "
                         "(decode, prefill, extend, verify)")
    ap.add_argument("--quick", action="store_true",
                    help="fewer repeats; on the CPU small shapes (x1/32, as attnrt bench --scale)")
    ap.add_argument("--scale", type=float, default=None,
                    help="shrink batch and lengths as attnrt bench --scale (default 1, quick CPU 1/32)")
    ap.add_argument("--cli", default=None, help="the attnrt executable (default: the package's, "
                                                "else build/attnrt)")
    ap.add_argument("--no-cli", action="store_true", help="skip the CLI side")
    ap.add_argument("--cli-timeout", type=float, default=0,
                    help="seconds the CLI may run (0: half of --budget, at least 30)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 10, quick 5)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads of attnrt, the CLI and torch; 0 = ATTNRT_NUM_THREADS, else every core")
    ap.add_argument("--flex-cpu", action="store_true", help="also compile FlexAttention on the CPU")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--budget", type=float, default=200.0,
                    help="seconds: FlexAttention is skipped once 60%% are spent, rows once all are "
                         "(gpu_python.sh allows 240)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gpu-lead-us", type=float, default=0,
                    help="queue a GPU spin of this long before each timed call's start event "
                         "(separates host launch latency from GPU time; default 0, as the CLI)")
    ap.add_argument("--alloc-order", choices=("flush-first", "runtime-first"), default="flush-first",
                    help="runtime-first: the first row's runtime (its KV pool) is allocated before "
                         "torch's flush buffer, as the CLI's pool is (a placement experiment)")
    ap.add_argument("--json", help="write the rows, the CLI's command and the ratios here")
    args = ap.parse_args(argv)
    global LEAD_US
    LEAD_US = args.gpu_lead_us
    t_start = time.perf_counter()
    if args.device is None:
        args.device = "cuda" if attnrt.cuda_status()[0] and torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not (attnrt.cuda_status()[0] and torch.cuda.is_available()):
        sys.exit(f"--device cuda: attnrt: {attnrt.cuda_status()[1]}; torch.cuda.is_available() = "
                 f"{torch.cuda.is_available()}")
    if args.repeats is None:
        args.repeats = 5 if args.quick else 10
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    scale = args.scale if args.scale is not None else (QUICK_SCALE[args.device] if args.quick else 1.0)
    if not 0 < scale <= 1:
        ap.error(f"--scale {scale}: use a factor in (0, 1]")
    threads = set_torch_threads(torch, args.threads)
    if args.cli is None:
        args.cli = default_cli()
    names = pick_rows(args.rows, args.device)
    local = {r["name"]: r for r in standard_rows(scale)}

    # 1. The CLI, alone on the machine.
    if args.no_cli:
        cli_rows, cli_info = {}, {"error": "--no-cli"}
    else:
        print(f"running {args.cli} bench --backend {args.device} on {len(names)} rows ...", flush=True)
        cli_rows, cli_info = run_cli(args, names, scale,
                                     timeout=args.cli_timeout or max(30.0, 0.5 * args.budget))
        if "error" in cli_info:
            print(f"cli: {cli_info['error']}", flush=True)

    # 2. Python and torch, row by row.
    def row_of(name):
        return row_from_cli(cli_rows[name], local[name]) if name in cli_rows else dict(local[name])

    early = None  # --alloc-order runtime-first: the first row's runtime, made before the flush buffer
    if args.alloc_order == "runtime-first" and names:
        early = PyRow(row_of(names[0]), args.device, threads, args.seed)
    flush, flush_mode = make_flush(args.device)
    if args.device == "cuda":
        where = f"{torch.cuda.get_device_name()}, L2 flush {flush_mode}"
    else:
        where = f"cpu ({torch.backends.cpu.get_cpu_capability()}), {threads} threads"
    print(f"attnrt {attnrt.__version__} (python) / torch {torch.__version__} on {where}; "
          f"median of {args.repeats} after {args.warmup} warm-up; scale {scale:g}")
    head = (f"{'row':<30} {'shape':<24} {'py ms':>9} {'rate':>16} {'cli ms':>9} {'py/cli':>7} "
            f"{'sdpa/py':>8} {'flex/py':>8} {'ver/dec':>8}")
    print(head)
    results = []
    for name in names:
        row = row_of(name)
        shape = f"{row['batch']}x({row['prefix_len']}+{row['new_tokens']}) d{row['head_dim']}"
        res = {"name": name, "shape": {k: row.get(k) for k in (
            "kind", "batch", "prefix_len", "new_tokens", "head_dim", "page_size", "kv_dtype",
            "q_heads", "kv_heads", "topk", "tree_parents")}}
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget:
            res.update(status="skipped", error=f"time budget of {args.budget:.0f} s spent")
            print(f"{name:<30} {shape:<24} skipped: {res['error']}", flush=True)
            results.append(res)
            write_json(args, scale, threads, where, cli_info, results)
            continue
        if args.no_flex:
            allow_flex = "--no-flex"
        elif args.device == "cpu" and not args.flex_cpu:
            allow_flex = "on the CPU only with --flex-cpu (its compilation takes minutes here)"
        elif elapsed > 0.6 * args.budget:
            allow_flex = f"{elapsed:.0f} s of the {args.budget:.0f} s budget spent"
        else:
            allow_flex = True
        try:
            pr, early = (early, None) if early is not None else (
                PyRow(row, args.device, threads, args.seed), None)
            try:
                samples, check = time_python(pr, args.device, args.warmup, args.repeats, flush)
                res["check"] = check
                res["python_ms"] = timing_ms(samples)
                if not check["passed"]:
                    res["status"] = "mismatch"
                anchors = torch_anchors(pr, args, flush, allow_flex)
            finally:
                pr.close()
                del pr
            if row["kind"].startswith("verify"):
                # The decode row it is compared with (docs/workloads.md: time / decode B x P).
                dec = dict(row, kind="decode", new_tokens=1, prefix_len=row["prefix_len"] - 1,
                           name=name + "/decode", topk=1, tree_parents=None)
                dp = PyRow(dec, args.device, threads, args.seed + 17)
                try:
                    ds, _ = time_python(dp, args.device, args.warmup, args.repeats, flush)
                finally:
                    dp.close()
                res["python_decode_ms"] = timing_ms(ds)
        except Exception as e:  # noqa: BLE001 - a row that fails says why; the others still run
            res.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            print(f"{name:<30} {shape:<24} ERROR: {res['error']}", flush=True)
            results.append(res)
            write_json(args, scale, threads, where, cli_info, results)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            continue
        res.setdefault("status", "ok")
        res["torch"] = anchors
        py = res["python_ms"]["median"]
        unit, rate = rate_of(row, py)
        res["metric"], res["rate"] = unit, rate
        c = cli_rows.get(name)
        if c is not None and c.get("status") == "ok":
            res["cli_ms"] = c["time_ms"]
            res["cli_rate"] = c.get("rate")
            res["python_over_cli"] = py / c["time_ms"]["median"]
            res["within_target"] = abs(res["python_over_cli"] - 1) <= TARGET_CLI_RATIO
            if "decode" in c:
                res["cli_verify_over_decode"] = c["decode"].get("ratio")
        elif c is not None:
            res["cli_error"] = c.get("error") or c.get("status")
        sd = anchors.get("sdpa_best_ms")
        fx = anchors.get("flex", {}).get("median")
        res["sdpa_over_python"] = sd / py if sd else None
        res["flex_over_python"] = fx / py if fx else None
        if "python_decode_ms" in res:
            res["python_verify_over_decode"] = py / res["python_decode_ms"]["median"]
        results.append(res)
        cli_ms = res.get("cli_ms", {}).get("median")
        print(f"{name:<30} {shape:<24} {py:>9.3f} {rate:>8.3g} {unit:<7} "
              f"{fmt_ratio(cli_ms):>9} {fmt_ratio(res.get('python_over_cli')):>7} "
              f"{fmt_ratio(res['sdpa_over_python'], 2):>8} {fmt_ratio(res['flex_over_python'], 2):>8} "
              f"{fmt_ratio(res.get('python_verify_over_decode'), 2):>8}"
              f"{'' if res['status'] == 'ok' else '  ' + res['status'].upper()}", flush=True)
        write_json(args, scale, threads, where, cli_info, results)
        if args.device == "cuda":
            torch.cuda.empty_cache()

    # Summary: the ratio target, and why a torch column is empty.
    ratios = [r["python_over_cli"] for r in results if "python_over_cli" in r]
    if ratios:
        worst = max(ratios, key=lambda x: abs(x - 1))
        inside = sum(abs(x - 1) <= TARGET_CLI_RATIO for x in ratios)
        print(f"python / cli: {inside} of {len(ratios)} rows within {TARGET_CLI_RATIO:.0%} "
              f"(median {statistics.median(ratios):.3f}, furthest {worst:.3f})")
    else:
        print(f"python / cli: no CLI figures ({cli_info.get('error', 'no row in common')})")
    why = {}
    for r in results:
        for k, x in r.get("torch", {}).items():
            if isinstance(x, dict) and "error" in x:
                why.setdefault(f"{k}: {x['error']}", []).append(r["name"])
    for reason, rows in why.items():
        print(f"  torch {reason} ({len(rows)} rows)")
    failed = [r["name"] for r in results if r.get("status") in ("error", "mismatch")]
    if failed:
        print(f"FAILED rows: {', '.join(failed)}")
    print(f"done in {time.perf_counter() - t_start:.1f} s" + (f"; wrote {args.json}" if args.json else ""))
    return 1 if failed else 0


def write_json(args, scale, threads, where, cli_info, results):
    if not args.json:
        return
    report = {"schema": "attnrt-python-rows/1", "attnrt": attnrt.__version__,
              "torch": torch.__version__, "python": platform.python_version(),
              "device": args.device, "where": where, "threads": threads, "scale": scale,
              "repeats": args.repeats, "warmup": args.warmup,
              "target_python_over_cli": [1 - TARGET_CLI_RATIO, 1 + TARGET_CLI_RATIO],
              "cli": cli_info, "rows": results}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
