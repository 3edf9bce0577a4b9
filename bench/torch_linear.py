#!/usr/bin/env python3
"""The linear-attention rows of `attnrt bench --suite linear` through the torch implementations that
ship with the `transformers` package, on the CPU or a CUDA GPU.

Gives the other side of the side-by-side table (bench/compare.py). Row names, shapes and counting
rules are those of `attnrt bench --suite linear` (docs/bench.md); read them from an attnrt report:

    build/attnrt bench --backend cpu --suite linear --preset cpu-small --json attnrt.json
    python3 bench/torch_linear.py --from attnrt.json --json torch_linear.json
    python3 bench/compare.py attnrt.json torch_linear.json

What is timed per row is what attnrt's forward_linear does for the step: the causal conv (+ SiLU),
the gates, the recurrence and the state update, from bf16 per-token inputs already on the device:
  * gdn (Qwen3-Next): transformers.models.qwen3_next causal_conv1d_fn / causal_conv1d_update,
    q/k repeated to the value heads as Qwen3NextGatedDeltaNet does, beta = sigmoid(b),
    g = -exp(A_log) * softplus(a + dt_bias), then torch_chunk_gated_delta_rule (extend, chunk 64)
    or torch_recurrent_gated_delta_rule (decode) with use_qk_l2norm_in_kernel=True.
  * kda (Kimi-Linear): transformers.models.kimi_linear causal_conv1d_fn, the per-channel gate of
    KimiLinearForgetGate (from its pre-activation input a), beta = sigmoid(b), then
    chunk_kimi_delta_attention (chunk 64).
  * mamba2 (Nemotron-H): transformers.models.nemotron_h causal_conv1d_fn / causal_conv1d_update,
    then mamba2_chunk_scan (the torch chunked scan with segment sums, chunk 128) or
    mamba2_selective_state_update (decode), dt_softplus with dt_bias, D skip.
Every function is called through inspect.unwrap, i.e. its torch implementation, even where the
optional fla / mamba_ssm / causal_conv1d packages are installed. Decode rows start from random
states (attnrt builds its states from 16 tokens; the time does not depend on the values).

On a GPU (--device cuda): CUDA events around each call, a 256 MiB tensor written (--flush write)
or read (--flush clean) before each repetition to evict the L2 (as bench/torch_sdpa.py). A batched call that runs out of GPU memory (the torch forms
materialise [batch, chunks, chunk, chunk, heads, dim] products) is retried as one call per request,
timed as a whole, and the row says so. The JSON is rewritten after every row.
"""

import inspect
import statistics
import sys

from bench_util import (add_row_args, check_row_args, check_torch_device, device_name,
                        import_torch, make_flush, read_attnrt_report, row_parser, set_torch_threads,
                        time_calls, timing_ms, write_report)

DECODE_PREFIX = 16
GDN = dict(model="qwen3-next-80b", num_k_heads=16, num_v_heads=32, head_k_dim=128,
           head_v_dim=128, d_state=0, n_groups=0, conv_kernel=4, chunk_size=64)
KDA = dict(model="kimi-linear-48b", num_k_heads=32, num_v_heads=32, head_k_dim=128,
           head_v_dim=128, d_state=0, n_groups=0, conv_kernel=4, chunk_size=64)
MAMBA2 = dict(model="nemotron-h-8b", num_k_heads=0, num_v_heads=128, head_k_dim=0, head_v_dim=64,
              d_state=128, n_groups=8, conv_kernel=4, chunk_size=128)
STANDARD = [  # (name, kind, mode, batch, tokens), as attnrt's linear_standard_workloads()
    ("gdn-decode-64", "gdn", "decode", 64, 1),
    ("gdn-decode-256", "gdn", "decode", 256, 1),
    ("mamba2-decode-64", "mamba2", "decode", 64, 1),
    ("mamba2-decode-256", "mamba2", "decode", 256, 1),
    ("gdn-extend-8x8192", "gdn", "extend", 8, 8192),
    ("kda-extend-8x8192", "kda", "extend", 8, 8192),
    ("mamba2-extend-8x8192", "mamba2", "extend", 8, 8192),
    ("mamba2-extend-1x8192", "mamba2", "extend", 1, 8192),
]
SHAPE_KEYS = ("kind", "mode", "model", "batch", "prefix_len", "new_tokens", "num_k_heads",
              "num_v_heads", "head_k_dim", "head_v_dim", "d_state", "n_groups", "conv_kernel",
              "chunk_size")


def standard_rows(scale):
    rows = []
    for name, kind, mode, b, t in STANDARD:
        spec = {"gdn": GDN, "kda": KDA, "mamba2": MAMBA2}[kind]
        row = dict(name=name, kind=kind, mode=mode, batch=b, new_tokens=t,
                   prefix_len=DECODE_PREFIX if mode == "decode" else 0, **spec)
        if scale != 1.0:  # the rule of `attnrt bench --scale` for linear rows
            row["batch"] = max(1, round(b * scale))
            if mode == "extend":
                row["new_tokens"] = max(16, round(t * scale / 16) * 16)
        rows.append(row)
    return rows


def rows_from_attnrt(path):
    report = read_attnrt_report(path)
    rows = []
    for r in report["rows"]:
        if r.get("suite") != "linear":
            continue
        row = dict(r["shape"])
        row["name"] = r["name"]
        row["counted"] = r.get("counted")
        rows.append(row)
    if not rows:
        sys.exit(f"{path}: no linear rows (run attnrt bench with --suite linear or all)")
    return rows


def widths(row):
    hk, hv, dk, dv = row["num_k_heads"], row["num_v_heads"], row["head_k_dim"], row["head_v_dim"]
    if row["kind"] == "mamba2":
        conv_dim = hv * dv + 2 * row["n_groups"] * row["d_state"]
        return dict(conv_dim=conv_dim, a=hv, b=0, out=hv * dv, state=hv * dv * row["d_state"],
                    params=conv_dim * (row["conv_kernel"] + 1) + 3 * hv)
    conv_dim = 2 * hk * dk + hv * dv
    a = hv * dk if row["kind"] == "kda" else hv
    params = conv_dim * row["conv_kernel"] + hv + (a if row["kind"] == "kda" else hv)
    return dict(conv_dim=conv_dim, a=a, b=hv, out=hv * dv, state=hv * dk * dv, params=params)


def chunk_flops(row, c):
    if row["kind"] == "mamba2":
        p, n = row["head_v_dim"], row["d_state"]
        return (row["num_v_heads"] * (2 * c * c * p + 4 * c * n * p + 2 * n * p)
                + row["n_groups"] * 2 * c * c * n)
    dk, dv = row["head_k_dim"], row["head_v_dim"]
    return (row["num_k_heads"] * 4 * c * c * dk
            + row["num_v_heads"] * (2 * c * c * dk + 4 * c * c * dv + 6 * c * dk * dv + c ** 3 / 3))


def counted(row):
    """(bytes, flops) as attnrt counts them (docs/bench.md); taken from the report when given."""
    if row.get("counted"):
        return row["counted"]["bytes"], row["counted"]["flops"]
    w = widths(row)
    conv_elems = (row["conv_kernel"] - 1) * w["conv_dim"]
    per_request = 4 * (w["state"] + conv_elems) * (2 if row["prefix_len"] > 0 else 1)
    tokens = row["batch"] * row["new_tokens"]
    nbytes = (row["batch"] * per_request + tokens * 2 * (w["conv_dim"] + w["a"] + w["b"] + w["out"])
              + 4 * w["params"])
    c = max(1, row["chunk_size"])
    full, tail = divmod(row["new_tokens"], c)
    flops = row["batch"] * (full * chunk_flops(row, c) + (chunk_flops(row, tail) if tail else 0))
    return nbytes, flops



def torch_functions():
    """The torch implementations shipped with transformers, unwrapped from their kernel hooks."""
    import transformers.models.qwen3_next.modeling_qwen3_next as qn
    import transformers.models.nemotron_h.modeling_nemotron_h as nh
    fns = dict(
        gdn_conv=qn.causal_conv1d_fn, gdn_conv_update=qn.causal_conv1d_update,
        gdn_chunk=qn.torch_chunk_gated_delta_rule, gdn_recurrent=qn.torch_recurrent_gated_delta_rule,
        m2_conv=nh.causal_conv1d_fn, m2_conv_update=nh.causal_conv1d_update,
        m2_chunk=nh.mamba2_chunk_scan, m2_update=nh.mamba2_selective_state_update)
    try:
        import transformers.models.kimi_linear.modeling_kimi_linear as kl
        fns.update(kda_conv=kl.causal_conv1d_fn, kda_chunk=kl.chunk_kimi_delta_attention)
    except ImportError:
        pass
    return {k: inspect.unwrap(v) for k, v in fns.items()}


def make_call(torch, F, fns, row, device, gen, batch):
    """A zero-argument call running the row's step for `batch` requests, with the names of the
    transformers functions it goes through."""
    kind, mode, t = row["kind"], row["mode"], row["new_tokens"]
    w = widths(row)
    hk, hv, dk, dv = row["num_k_heads"], row["num_v_heads"], row["head_k_dim"], row["head_v_dim"]
    K = row["conv_kernel"]
    bf16 = torch.bfloat16

    def randn(*shape, dtype=bf16, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    def uniform(n, lo, hi):
        return torch.rand(n, generator=gen, device=device) * (hi - lo) + lo

    x = randn(batch, t, w["conv_dim"])
    a = randn(batch, t, w["a"])
    b = randn(batch, t, w["b"]) if w["b"] else None
    conv_w = uniform(w["conv_dim"] * K, -0.6, 0.6).reshape(w["conv_dim"], K).to(bf16)
    A_log = uniform(hv, -1.5, 0.5)
    dt_bias = uniform(w["a"] if kind == "kda" else hv, -1.0, 1.0)

    if kind in ("gdn", "kda"):
        if kind == "kda" and "kda_chunk" not in fns:
            raise RuntimeError("not available: this transformers has no Kimi-Linear "
                               "(transformers.models.kimi_linear)")
        conv_fn = fns["kda_conv" if kind == "kda" else "gdn_conv"]

        def gates():
            beta = b.sigmoid()
            if kind == "kda":
                g = (a.float() + dt_bias).view(batch, t, hv, dk)
                g = -A_log.exp().view(1, 1, hv, 1) * torch.where(g > 20.0, g, torch.log1p(g.exp()))
            else:
                g = -A_log.exp() * F.softplus(a.float() + dt_bias)
            return g, beta

        def split(y):  # y [B, T, conv_dim] -> q, k [B, T, HV, Dk], v [B, T, HV, Dv]
            q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
            q, k, v = q.reshape(batch, -1, hk, dk), k.reshape(batch, -1, hk, dk), v.reshape(batch, -1, hv, dv)
            if hv > hk:
                q = q.repeat_interleave(hv // hk, dim=2)
                k = k.repeat_interleave(hv // hk, dim=2)
            return q, k, v

        if mode == "decode":
            state = randn(batch, hv, dk, dv, dtype=torch.float32, scale=0.1)
            conv_state = randn(batch, w["conv_dim"], K)
            update, recurrent = fns["gdn_conv_update"], fns["gdn_recurrent"]

            def call():
                y = update(x.transpose(1, 2), conv_state, conv_w, None, "silu").transpose(1, 2)
                g, beta = gates()
                q, k, v = split(y)
                o, s = recurrent(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
                state.copy_(s)
                return o
            return call, ["causal_conv1d_update", "torch_recurrent_gated_delta_rule"]

        chunk = fns["kda_chunk" if kind == "kda" else "gdn_chunk"]

        def call():
            y = conv_fn(x.transpose(1, 2), conv_w, None, "silu").transpose(1, 2)
            g, beta = gates()
            q, k, v = split(y)
            return chunk(q, k, v, g, beta, chunk_size=row["chunk_size"], initial_state=None,
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        return call, ["causal_conv1d_fn", "chunk_kimi_delta_attention" if kind == "kda"
                      else "torch_chunk_gated_delta_rule"]

    # mamba2
    p, n, groups = dv, row["d_state"], row["n_groups"]
    conv_b = uniform(w["conv_dim"], -0.3, 0.3).to(bf16)
    D = uniform(hv, -1.0, 1.0)
    A = -A_log.exp()

    def split(y):
        xs, B, C = torch.split(y, [hv * p, groups * n, groups * n], dim=-1)
        return xs, B, C

    if mode == "decode":
        state = randn(batch, hv, p, n, dtype=torch.float32, scale=0.1)
        conv_state = randn(batch, w["conv_dim"], K)
        update, step = fns["m2_conv_update"], fns["m2_update"]

        # Broadcast over the head dim as NemotronHMamba2Mixer does before this call.
        A_e = A[:, None, None].expand(-1, p, n)
        D_e = D[:, None].expand(-1, p)
        dt_bias_e = dt_bias[:, None].expand(-1, p)

        def call():
            y = update(x.transpose(1, 2), conv_state, conv_w, conv_b, "silu").transpose(1, 2)
            xs, B, C = split(y[:, 0])
            dt = a[:, 0, :, None].expand(-1, -1, p)
            return step(state, xs.reshape(batch, hv, p), dt, A_e, B.reshape(batch, groups, n),
                        C.reshape(batch, groups, n), D=D_e, dt_bias=dt_bias_e, dt_softplus=True)
        return call, ["causal_conv1d_update", "mamba2_selective_state_update"]

    conv_fn, scan = fns["m2_conv"], fns["m2_chunk"]

    def call():
        y = conv_fn(x.transpose(1, 2), conv_w, conv_b, "silu").transpose(1, 2)
        xs, B, C = split(y)
        return scan(xs.reshape(batch, t, hv, p), a, A, B.reshape(batch, t, groups, n),
                    C.reshape(batch, t, groups, n), row["chunk_size"], D=D, dt_bias=dt_bias,
                    dt_softplus=True, return_final_states=True)
    return call, ["causal_conv1d_fn", "mamba2_chunk_scan"]



def run_row(torch, F, fns, row, args, flush):
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    notes = []
    out_of_memory = False
    try:
        call, used = make_call(torch, F, fns, row, args.device, gen, row["batch"])
        samples = time_calls(torch, call, args.device, args.warmup, args.repeats, flush)
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True  # retried below, once the traceback no longer holds the tensors
    if out_of_memory:
        call = None
        torch.cuda.empty_cache()
        calls = []
        for _ in range(row["batch"]):
            c, used = make_call(torch, F, fns, row, args.device, gen, 1)
            calls.append(c)

        def per_request():
            for c in calls:
                c()
        samples = time_calls(torch, per_request, args.device, args.warmup, args.repeats, flush)
        notes.append(f"the batched call ran out of GPU memory; timed as {row['batch']} calls of "
                     "one request")
    if row["mode"] == "decode":
        notes.append("state starts random (attnrt builds it from 16 tokens)")
    med = statistics.median(samples)

    nbytes, flops = counted(row)
    memory = row["mode"] == "decode"
    return {
        "name": row["name"],
        "suite": "linear",
        "shape": {k: row[k] for k in SHAPE_KEYS},
        "functions": used,
        "time_ms": timing_ms(samples),
        "counted": {"bytes": nbytes, "flops": flops},
        "metric": "GB/s" if memory else "GFLOP/s",
        "rate": (nbytes if memory else flops) / med / 1e9,
        "tokens_per_s": row["batch"] * row["new_tokens"] / med,
        "status": "ok",
        "notes": notes,
    }


def main():
    ap = row_parser(__doc__)
    add_row_args(ap, from_help="attnrt bench JSON whose linear rows to run",
                 workload_help="all, a mode (decode, extend), a kind (gdn, kda, mamba2) or row "
                               "names, comma-separated",
                 scale_help="without --from: shrink batch and tokens as attnrt bench --scale does")
    ap.add_argument("--json", help="write the rows as JSON (for bench/compare.py)")
    args = ap.parse_args()
    check_row_args(ap, args)

    torch, F = import_torch()
    try:
        import transformers
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()  # the "falling back to torch" notices: that is the point
        fns = torch_functions()
    except ImportError as e:
        sys.exit(f"transformers is not installed or lacks a model used here ({e}): "
                 "`pip install transformers`, then rerun")

    threads = set_torch_threads(torch, args.threads)
    check_torch_device(torch, args.device)
    rows = rows_from_attnrt(args.source) if args.source else standard_rows(args.scale)
    if args.workload != "all":
        wanted = args.workload.split(",")
        rows = [r for r in rows if r["name"] in wanted or r["mode"] in wanted or r["kind"] in wanted]
        if not rows:
            sys.exit(f"--workload {args.workload}: no row matches")

    if args.device == "cuda":
        where = f"{torch.cuda.get_device_name()}, L2 flush: {args.flush}"
    else:
        where = f"cpu ({torch.backends.cpu.get_cpu_capability()}), {threads} threads"
    flush = make_flush(torch, args.device, args.flush)
    print(f"torch {torch.__version__}, transformers {transformers.__version__} on {where}")
    if "kda_chunk" not in fns:
        print("this transformers ships no Kimi-Linear: kda rows are reported as not available")
    print(f"{'row':<24} {'shape':<18} {'ms':>10} {'p10..p90 ms':>19} {'rate':>16} {'tokens/s':>11}")
    out = []
    for row in rows:
        shape = f"{row['batch']}x{row['new_tokens']}"
        try:
            r = run_row(torch, F, fns, row, args, flush)
        except (RuntimeError, MemoryError) as e:
            r = {"name": row["name"], "suite": "linear", "status": "error",
                 "shape": {k: row[k] for k in SHAPE_KEYS}, "error": str(e).split("\n")[0][:200]}
            print(f"{row['name']:<24} {shape:<18} ERROR: {r['error']}", flush=True)
        else:
            t = r["time_ms"]
            rate = (f"{r['rate']:.1f} GB/s" if r["metric"] == "GB/s"
                    else f"{r['rate'] / 1e3:.3f} TFLOP/s")
            print(f"{row['name']:<24} {shape:<18} {t['median']:>10.3f} "
                  f"{t['p10']:>9.3f}..{t['p90']:<9.3f} {rate:>16} {r['tokens_per_s']:>11.4g}"
                  + ("  (" + "; ".join(r["notes"]) + ")" if r["notes"] else ""), flush=True)
        out.append(r)
        write_linear_report(args, torch, transformers, threads, out)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        print(f"wrote {args.json}")


def write_linear_report(args, torch, transformers, threads, out):
    write_report(args, {"implementation": "torch-transformers",
                        "torch_version": torch.__version__,
                        "transformers_version": transformers.__version__,
                        "device": device_name(torch, args.device)}, threads, out)


if __name__ == "__main__":
    main()
