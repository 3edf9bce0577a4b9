#!/usr/bin/env python3
"""The attnrt bench workloads through PyTorch's attention kernels, on the CPU or a CUDA GPU.

Gives the other side of the side-by-side table (bench/compare.py). Row names, shapes and counting
rules are those of `attnrt bench` (docs/workloads.md). The best way to get identical shapes is to read
them from an attnrt JSON report:

    build/attnrt bench --preset cpu-small --json attnrt.json
    python3 bench/torch_sdpa.py --from attnrt.json --json torch.json
    python3 bench/compare.py attnrt.json torch.json

What is timed, per row, is one SDPA call (median of repeats after warm-up, caches flushed between
repetitions as attnrt does). SDPA has no paged KV and no fp8 KV, so:
  * decode / extend / verify: K/V are laid out in a paged pool (pages randomly permuted, as attnrt
    does), then gathered into dense [B, Hkv, L, D] tensors BEFORE timing; only SDPA is timed. The
    gather a paged kernel does for free is therefore not charged to torch.
  * fp8 rows: the pool holds e4m3 values; they are dequantised to bf16 during that gather, so torch
    reads 2 bytes per element where attnrt reads 1. The row is still counted with fp8 bytes, so its
    GB/s compares the same work.
  * GQA runs through enable_gqa=True (no K/V head expansion), causal prefill through is_causal,
    extend and verify through an explicit boolean mask (prefix visible, causal or tree among the
    new tokens).

On a GPU (--device cuda, as `attnrt bench --backend cuda` runs) every row is timed with each of
--kernels: SDPA restricted to its flash kernel (`flash`), to cuDNN (`cudnn`), and FlexAttention
compiled with a block mask (`flex`); CUDA events around the call, a 256 MiB tensor written
(--flush write) or read (--flush clean) before each repetition to evict the L2. A kernel that
cannot run a row (flash takes no explicit mask) is recorded with its reason; the row's time is its
fastest kernel's. The JSON is rewritten after every row, so an interrupted run keeps what it
measured.
"""

import statistics
import sys

from bench_util import (add_row_args, check_row_args, check_torch_device, device_name,
                        import_torch, make_flush, read_attnrt_report, row_parser, set_torch_threads,
                        time_calls, timing_ms, write_report)

STANDARD = [
    # (name, kind, batch, prefix_len, new_tokens, head_dim, page_size, kv_dtype, topk)
    *[(f"decode-{b}x{l}{sfx}", "decode", b, l - 1, 1, 128, page, dt, 1)
      for sfx, page, dt in (("", 16, "bf16"), ("-p1", 1, "bf16"), ("-fp8", 16, "fp8_e4m3"))
      for b, l in ((1, 32768), (16, 4096), (64, 4096), (128, 8192), (256, 2048), (32, 32768))],
    ("prefill-1x1024", "prefill", 1, 0, 1024, 128, 16, "bf16", 1),
    ("prefill-1x4096", "prefill", 1, 0, 4096, 128, 16, "bf16", 1),
    ("prefill-1x16384", "prefill", 1, 0, 16384, 128, 16, "bf16", 1),
    ("prefill-8x2048", "prefill", 8, 0, 2048, 128, 16, "bf16", 1),
    ("prefill-1x8192-d64", "prefill", 1, 0, 8192, 64, 16, "bf16", 1),
    ("prefill-1x8192-d256", "prefill", 1, 0, 8192, 256, 16, "bf16", 1),
    ("extend-8x2048+512", "extend", 8, 2048, 512, 128, 16, "bf16", 1),
    ("verify-chain-64x4096+8", "verify-chain", 64, 4096, 8, 128, 16, "bf16", 1),
    ("verify-tree-64x4096+16-topk4", "verify-tree", 64, 4096, 16, 128, 16, "bf16", 4),
]

Q_HEADS, KV_HEADS = 32, 8


def standard_rows(scale):
    rows = []
    for name, kind, b, p, n, d, page, dt, topk in STANDARD:
        row = dict(name=name, kind=kind, batch=b, prefix_len=p, new_tokens=n, head_dim=d,
                   page_size=page, kv_dtype=dt, topk=topk, q_heads=Q_HEADS, kv_heads=KV_HEADS)
        if scale != 1.0:
            # The same rule as `attnrt bench --scale`: batch x F (>= 1), lengths x F rounded to
            # multiples of 16 (>= 16), draft tokens unchanged.
            q = lambda x: max(16, int(round(x * scale / 16)) * 16)
            row["batch"] = max(1, int(round(b * scale)))
            if kind == "decode":
                row["prefix_len"] = q(p + 1) - 1
            elif kind == "prefill":
                row["new_tokens"] = q(n)
            elif kind == "extend":
                row["prefix_len"], row["new_tokens"] = q(p), q(n)
            else:
                row["prefix_len"] = q(p)
        if topk > 1:
            row["tree_parents"] = None  # only attnrt's JSON carries the exact tree; see below
        rows.append(row)
    return rows


def rows_from_attnrt(path):
    report = read_attnrt_report(path)
    rows = []
    for r in report["rows"]:
        if r.get("suite") == "linear":  # bench/torch_linear.py runs those
            continue
        if r["shape"].get("layer") == "mla":  # latent rows: V is not a head_dim-wide tensor
            continue
        s = dict(r["shape"])
        s["name"] = r["name"]
        rows.append(s)
    return rows, report


def eagle_tree(n, topk):
    """Fallback tree when no attnrt JSON gives one: levels of topk nodes, each hanging off the
    level above in turn (same shape family as attnrt's, not the same draw)."""
    parents, level = [-1], [0]
    while len(parents) < n:
        nxt = []
        for i in range(min(topk, n - len(parents))):
            parents.append(level[i % len(level)])
            nxt.append(len(parents) - 1)
        level = nxt
    return parents


def counted(row):
    b, p, n, d = row["batch"], row["prefix_len"], row["new_tokens"], row["head_dim"]
    elem = 1 if row["kv_dtype"].startswith("fp8") else 2
    kv_bytes = b * (p + n) * row["kv_heads"] * d * 2 * elem
    if row["kind"] == "prefill":
        return "GFLOP/s", b * 4 * n * n * row["q_heads"] * d / 2
    if row["kind"] == "extend":
        return "GFLOP/s", b * 4 * row["q_heads"] * d * (n * p + n * n / 2)
    return "GB/s", kv_bytes



def build_inputs(torch, row, gen, device="cpu"):
    """q [B, Hq, N, D], dense k/v [B, Hkv, P+N, D] gathered from a permuted paged pool, mask."""
    b, p, n, d = row["batch"], row["prefix_len"], row["new_tokens"], row["head_dim"]
    hq, hkv, page = row["q_heads"], row["kv_heads"], row["page_size"]
    kv_len = p + n
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)
    q = randn(b, hq, n, d)
    if row["kind"] == "prefill":
        return q, randn(b, hkv, n, d), randn(b, hkv, n, d), None, True
    pages_per_req = -(-kv_len // page)
    num_pages = b * pages_per_req
    pool_dtype = torch.float8_e4m3fn if row["kv_dtype"] == "fp8_e4m3" else torch.bfloat16
    # page 0 reserved, as in attnrt
    order = torch.randperm(num_pages, generator=gen, device=device) + 1
    tok = torch.arange(kv_len, device=device)
    slots = order[(torch.arange(b, device=device)[:, None] * pages_per_req + tok // page)]
    slots = slots * page + tok % page  # [B, L]
    rows_total = (num_pages + 1) * page

    def gathered():
        pool = torch.randn(rows_total, hkv, d, generator=gen, device=device).to(pool_dtype)
        dense = pool[slots.reshape(-1)].to(torch.bfloat16).reshape(b, kv_len, hkv, d)
        del pool
        return dense.transpose(1, 2).contiguous()

    k, v = gathered(), gathered()
    if row["kind"] == "decode":
        return q, k, v, None, False
    mask = torch.ones(n, kv_len, dtype=torch.bool, device=device)
    if row["kind"] in ("extend", "verify-chain"):
        mask[:, p:] = torch.ones(n, n, dtype=torch.bool).tril()
    else:
        parents = row.get("tree_parents") or eagle_tree(n, row["topk"])
        for t in range(n):
            mask[t, p:] = False
            a = t
            while a != -1:
                mask[t, p + a] = True
                a = parents[a]
    return q, k, v, mask, False




def cuda_calls(torch, F, q, k, v, mask, causal, kernels):
    """name -> zero-argument call, for every kernel of `kernels` that exists in this torch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                      enable_gqa=True)
        return call

    calls = {}
    if "flash" in kernels:
        calls["flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    if "cudnn" in kernels:
        calls["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    if "flex" in kernels:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        n, kv_len = q.shape[2], k.shape[2]
        if causal:
            mask_mod = lambda b, h, qi, ki: qi >= ki
        elif mask is not None:
            mask_mod = lambda b, h, qi, ki: mask[qi, ki]
        else:
            mask_mod = None
        block_mask = (create_block_mask(mask_mod, None, None, n, kv_len, device=q.device)
                      if mask_mod is not None else None)
        # Every row is a new shape, so a new specialization of the one compiled function; past
        # dynamo's recompile limit (8) it falls back to the unfused implementation silently
        # (scores materialised, 10-40x slower), which would make the later rows' anchor wrong.
        import torch._dynamo

        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 256))
        flex = torch.compile(flex_attention, dynamic=False)
        calls["flex"] = lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    return calls


def run_row(torch, F, row, args, flush):
    cuda = args.device == "cuda"
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    q, k, v, mask, causal = build_inputs(torch, row, gen, args.device)
    kernels = {}
    if cuda:
        best = None
        for name, call in cuda_calls(torch, F, q, k, v, mask, causal, args.kernels).items():
            try:
                times = time_calls(torch, call, "cuda", args.warmup, args.repeats, flush)
            except Exception as e:  # a kernel that does not take this shape says why
                kernels[name] = {"error": str(e).strip().split("\n")[0][:200]}
                continue
            kernels[name] = {"median_ms": statistics.median(times) * 1e3}
            if best is None or statistics.median(times) < statistics.median(best[1]):
                best = (name, times)
        if best is None:
            raise RuntimeError("no kernel ran: " + "; ".join(
                f"{n}: {x['error']}" for n, x in kernels.items()))
        samples = sorted(best[1])
    else:
        call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                      enable_gqa=True)
        samples = time_calls(torch, call, "cpu", args.warmup, args.repeats, flush)
    del q, k, v, mask

    unit, amount = counted(row)
    med = statistics.median(samples)
    notes = []
    if row["kind"] != "prefill":
        notes.append("paged K/V gathered to dense before timing; only SDPA timed")
    if row["kv_dtype"].startswith("fp8"):
        notes.append("fp8 KV dequantised to bf16 before timing (SDPA has no fp8 KV)")
    if row["kind"] == "verify-tree" and not row.get("tree_parents"):
        notes.append("tree built locally (no attnrt JSON given)")
    return {
        "name": row["name"],
        "shape": {key: row[key] for key in ("kind", "batch", "prefix_len", "new_tokens",
                                            "head_dim", "page_size", "kv_dtype", "q_heads",
                                            "kv_heads")},
        "time_ms": timing_ms(samples),
        "metric": unit,
        "rate": amount / med / 1e9,
        "status": "ok",
        "notes": notes,
        **({"kernels": kernels, "best_kernel": best[0]} if cuda else {}),
    }


def main():
    ap = row_parser(__doc__)
    add_row_args(ap, from_help="attnrt bench JSON whose row shapes to run",
                 workload_help="all, a kind (decode, prefill, extend, verify) or row names, "
                               "comma-separated",
                 scale_help="without --from: shrink batch and lengths as attnrt bench --scale does",
                 device_help="where to run: cpu (SDPA) or cuda (the kernels of --kernels)")
    ap.add_argument("--kernels", default="flash,cudnn,flex",
                    help="with --device cuda: comma-separated subset of flash, cudnn, flex")
    ap.add_argument("--json", help="write the rows as JSON (for bench/compare.py)")
    args = ap.parse_args()
    args.kernels = args.kernels.split(",")
    unknown = [x for x in args.kernels if x not in ("flash", "cudnn", "flex")]
    if unknown:
        ap.error(f"--kernels: unknown {', '.join(unknown)}; use flash, cudnn and/or flex")
    check_row_args(ap, args)

    torch, F = import_torch()
    threads = set_torch_threads(torch, args.threads)
    check_torch_device(torch, args.device)
    if args.source:
        rows, _ = rows_from_attnrt(args.source)
    else:
        rows = standard_rows(args.scale)
    if args.workload != "all":
        wanted = args.workload.split(",")
        rows = [r for r in rows if r["name"] in wanted or r["kind"] in wanted
                or (r["kind"].startswith("verify") and "verify" in wanted)]
        if not rows:
            sys.exit(f"--workload {args.workload}: no row matches")

    if args.device == "cuda":
        where = (f"{torch.cuda.get_device_name()}, kernels {','.join(args.kernels)} "
                 f"(a row's time is its fastest kernel's), L2 flush: {args.flush}")
    else:
        where = f"cpu ({torch.backends.cpu.get_cpu_capability()}), {threads} threads, SDPA"
    flush = make_flush(torch, args.device, args.flush)
    out = []
    print(f"torch {torch.__version__} on {where}")
    print(f"{'row':<30} {'shape':<26} {'ms':>9} {'p10..p90 ms':>17} {'rate':>14}")
    for row in rows:
        shape = f"{row['batch']}x({row['prefix_len']}+{row['new_tokens']}) d{row['head_dim']}"
        try:
            r = run_row(torch, F, row, args, flush)
        except (RuntimeError, MemoryError) as e:
            r = {"name": row["name"], "status": "error", "error": str(e).split("\n")[0]}
            print(f"{row['name']:<30} {shape:<26} ERROR: {r['error']}")
            out.append(r)
            write_sdpa_report(args, torch, threads, out)
            continue
        t = r["time_ms"]
        per_kernel = ""
        if "kernels" in r:
            per_kernel = "  " + " ".join(
                f"{n}={x['median_ms']:.3f}" if "median_ms" in x else f"{n}=n/a"
                for n, x in r["kernels"].items())
        print(f"{row['name']:<30} {shape:<26} {t['median']:>9.2f} "
              f"{t['p10']:>8.2f}..{t['p90']:<8.2f} {r['rate']:>7.1f} {r['metric']}{per_kernel}",
              flush=True)
        out.append(r)
        write_sdpa_report(args, torch, threads, out)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        print(f"wrote {args.json}")


def write_sdpa_report(args, torch, threads, out):
    write_report(args, {"implementation": "torch-sdpa" if args.device == "cpu" else "torch-cuda",
                        "torch_version": torch.__version__,
                        "device": device_name(torch, args.device),
                        "kernels": args.kernels if args.device == "cuda" else ["sdpa"],
                        "cpu_capability": torch.backends.cpu.get_cpu_capability()}, threads, out)


if __name__ == "__main__":
    main()
