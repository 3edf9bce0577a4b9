#!/usr/bin/env python3
"""The DSA rows of `attnrt bench --suite dsa` through torch, on the CPU or a CUDA GPU.

The torch anchor of each DSA row (docs/workloads.md "DSA rows"): one DeepSeek-V3.2 sparse-attention
layer in the absorbed form, 128 q heads of 576 (latent 512 + rope 64), the latent cache [L, 576]
bf16 per request (V = its first 512 columns), an index-key cache of 64-head x 128 indexer keys, and
index_topk 2048. Every tensor is dense (torch has no paged KV) and built before timing. The same
computation as attnrt's, in plain torch:

  index   scores I[t, j] = sum_h w[t, h] * relu(<q_idx[t, h], k_idx[j]>) as one einsum over the
          index keys, dequantised from fp8 e4m3 codes with one fp32 scale per key (--index-dtype
          fp8, the default, where this torch has float8_e4m3fn) or read as bf16 (--index-dtype
          bf16), then torch.topk(index_topk) (prefill: causal, in chunks of --chunk queries).
  sparse  the selected latent rows gathered (torch.gather) and the absorbed attention over them:
          S = q . rows^T (bf16 in, fp32 out), scale 1/sqrt(576), softmax in fp32, P . rows[:, :512].
  step    index then sparse, as one call (the dsa-decode / dsa-prefill rows).
  dense   decode: the absorbed attention over every cached row (the mla suite's decode form);
          prefill: the MHA form through F.scaled_dot_product_attention(is_causal=True), q / k of
          128 + 64 and v of 128 per head, the decompression done before timing (as attnrt's
          mla-prefill rows).

Rows, in the units of the attnrt rows: dsa-decode-BxL (step ms, dense ms, dsa / dense), dsa-index-BxL
(index + top-k ms, GB/s over the index-key bytes, 132 B per cached token), dsa-sparse-BxL (sparse
ms over a fixed selection, per-token rate % of the dense decode's), dsa-prefill-1xS (step ms,
dense ms, dense / dsa). Before timing, the step's output is compared with an fp32 recomputation on
the first request (relative L2 error per head <= 0.02).

Shapes: --from an attnrt bench JSON of `--suite dsa` (its rows' shapes as run), else the 7
standard rows built here (--scale multiplies batch and lengths, index_topk with the lengths, as
`attnrt bench --scale` does; --quick is --scale 1/64 and batch 1).

    attnrt bench --backend cpu --suite dsa --preset cpu-small --json dsa.json
    python3 bench/torch_dsa.py --from dsa.json --json torch_dsa.json      # --device cuda on a GPU
    python3 bench/torch_dsa.py --device cpu --quick
"""
import math
import sys

from bench_util import (add_row_args, check_row_args, check_torch_device, device_name,
                        import_torch, make_flush, read_attnrt_report, row_parser,
                        set_torch_threads, time_calls, timing_ms, write_report)

HEADS, RANK, ROPE, IDX_HEADS, IDX_DIM, TOPK = 128, 512, 64, 64, 128, 2048
LATENT = RANK + ROPE


def standard_rows():
    rows = []
    for b, l in ((64, 32768), (16, 131072)):
        for part in ("decode", "index", "sparse"):
            rows.append({"name": f"dsa-{part}-{b}x{l}", "part": part, "prefill": False,
                         "batch": b, "kv_len": l, "topk": TOPK})
    rows.append({"name": "dsa-prefill-1x32768", "part": "prefill", "prefill": True, "batch": 1,
                 "kv_len": 32768, "topk": TOPK})
    return rows


def scale_row(row, f, batch_one=False):
    if f == 1 and not batch_one:
        return row
    r = dict(row)
    r["batch"] = 1 if batch_one else max(1, round(row["batch"] * f))
    r["kv_len"] = max(16, round(row["kv_len"] * f / 16) * 16)
    r["topk"] = min(row["topk"], max(16, round(row["topk"] * r["kv_len"] / row["kv_len"])))
    return r


def rows_from_attnrt(report):
    rows = []
    for x in report["rows"]:
        if x.get("suite") != "dsa" or x["status"] != "ok":
            continue
        s = x["shape"]
        rows.append({"name": x["name"], "part": s["part"], "prefill": s["kind"] == "prefill",
                     "batch": s["batch"], "kv_len": s["kv_len"], "topk": s["index_topk"],
                     "counted": x["counted"]})
    if not rows:
        sys.exit("the attnrt report has no DSA row that ran (run `attnrt bench --suite dsa`)")
    return rows


def selected_pairs(row):
    b, l, k = row["batch"], row["kv_len"], min(row["topk"], row["kv_len"])
    return b * (k * (k + 1) / 2 + (l - k) * k) if row["prefill"] else b * k


class Shape:
    """The tensors of one shape and its timed calls."""

    def __init__(self, torch, F, row, args):
        self.torch, self.F = torch, F
        dev, bf = args.device, torch.bfloat16
        g = torch.Generator(device="cpu").manual_seed(args.seed)
        b, l, self.k = row["batch"], row["kv_len"], min(row["topk"], row["kv_len"])
        self.prefill, self.chunk = row["prefill"], args.chunk
        t = l if self.prefill else 1
        rnd = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
        self.latent = rnd(b, l, LATENT).to(bf)
        self.q = rnd(b, t, HEADS, LATENT).to(bf)
        self.iq = rnd(b, t, IDX_HEADS, IDX_DIM).to(bf)
        self.w = rnd(b, t, IDX_HEADS).to(torch.float32)
        keys = rnd(b, l, IDX_DIM)
        self.fp8 = args.index_dtype == "fp8"
        if self.fp8:
            amax = keys.abs().amax(-1, keepdim=True).clamp_min(1e-4)
            self.kscale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
            self.kcodes = (keys / self.kscale).to(torch.float8_e4m3fn)
        else:
            self.kbf = keys.to(bf)
        self.scale = 1.0 / math.sqrt(LATENT)
        self.idx = None
        if self.prefill:
            # The MHA form of the dense prefill: decompressed k / v built here, not timed.
            self.mq = rnd(b, HEADS, l, 192).to(bf)
            self.mk = rnd(b, HEADS, l, 192).to(bf)
            self.mv = rnd(b, HEADS, l, 128).to(bf)

    def index_keys(self):
        if self.fp8:
            return (self.kcodes.to(self.torch.float32) * self.kscale).to(self.torch.bfloat16)
        return self.kbf

    def scores(self, keys, t0, t1):
        """Index scores of queries t0..t1 over every key: [b, t, l] fp32."""
        s = self.torch.einsum("bthd,bld->bthl", self.iq[:, t0:t1], keys).float().relu_()
        return (s * self.w[:, t0:t1, :, None]).sum(2)

    def index(self):
        keys = self.index_keys()
        if not self.prefill:
            return self.scores(keys, 0, 1).topk(self.k, dim=-1).indices
        l, out = self.latent.shape[1], []
        pos = self.torch.arange(l, device=keys.device)
        for t0 in range(0, l, self.chunk):
            t1 = min(l, t0 + self.chunk)
            s = self.scores(keys, t0, t1)
            s.masked_fill_(pos[None, None, :] > pos[t0:t1, None], float("-inf"))
            out.append(s.topk(self.k, dim=-1).indices)
        return self.torch.cat(out, 1)

    def sparse(self, idx):
        """Absorbed attention of every query over its selected rows: [b, t, H, 512]."""
        torch = self.torch
        b, t = idx.shape[0], idx.shape[1]
        outs = []
        for t0 in range(0, t, self.chunk):
            t1 = min(t, t0 + self.chunk)
            sel = idx[:, t0:t1]
            rows = torch.gather(self.latent[:, None].expand(-1, t1 - t0, -1, -1), 2,
                                sel[..., None].expand(-1, -1, -1, LATENT))
            s = torch.matmul(self.q[:, t0:t1], rows.transpose(-1, -2)).float() * self.scale
            if self.prefill:  # fewer candidates than index_topk: the rest are masked out
                pos = torch.arange(t0, t1, device=idx.device)
                s.masked_fill_((sel > pos[None, :, None])[:, :, None, :], float("-inf"))
            p = s.softmax(-1).to(torch.bfloat16)
            outs.append(torch.matmul(p, rows[..., :RANK]))
        return torch.cat(outs, 1)

    def step(self):
        return self.sparse(self.index())

    def dense(self):
        torch = self.torch
        if self.prefill:
            return self.F.scaled_dot_product_attention(self.mq, self.mk, self.mv, is_causal=True)
        s = torch.matmul(self.q[:, 0], self.latent.transpose(-1, -2)).float() * self.scale
        return torch.matmul(s.softmax(-1).to(torch.bfloat16), self.latent[..., :RANK])

    def check(self):
        """The step's output of the first request against fp32, per (query, head)."""
        torch = self.torch
        idx = self.index()
        got = self.sparse(idx)[0].float()
        t = got.shape[0]
        worst = 0.0
        for i in range(0, t, max(1, t // 8)):
            rows = self.latent[0, idx[0, i]].float()
            s = self.q[0, i].float() @ rows.T * self.scale
            if self.prefill:
                s = s.masked_fill(idx[0, i][None, :] > i, float("-inf"))
            want = s.softmax(-1) @ rows[:, :RANK]
            err = ((got[i] - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
            worst = max(worst, err)
        return worst


def main():
    ap = row_parser(__doc__)
    add_row_args(ap, "attnrt bench JSON of --suite dsa: its rows' shapes",
                 "all, a part (decode, index, sparse, prefill), row names, or a comma list",
                 "multiply batch and lengths by F in (0, 1] (index_topk with the lengths)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: --scale 1/64, batch 1")
    ap.add_argument("--index-dtype", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--chunk", type=int, default=128, help="queries per chunk of the prefill")
    ap.add_argument("--json")
    args = ap.parse_args()
    check_row_args(ap, args)
    torch, F = import_torch()
    check_torch_device(torch, args.device)
    threads = set_torch_threads(torch, args.threads)
    if args.index_dtype == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        sys.exit(f"torch {torch.__version__} has no float8_e4m3fn: use --index-dtype bf16")
    if args.source:
        rows = rows_from_attnrt(read_attnrt_report(args.source))
    else:
        rows = [scale_row(r, 1 / 64 if args.quick else args.scale, args.quick)
                for r in standard_rows()]
    if args.workload != "all":
        want = [w.removeprefix("dsa-") for w in args.workload.split(",") if w]
        rows = [r for r in rows if r["part"] in want or r["name"].removeprefix("dsa-") in want]
        if not rows:
            sys.exit(f"--workload {args.workload}: no such row (parts: decode, index, sparse, "
                     "prefill, or a row name)")
    flush = make_flush(torch, args.device, args.flush)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    out, shapes = [], {}
    print(f"torch {torch.__version__} on {device_name(torch, args.device)}, {threads} threads, "
          f"index keys {args.index_dtype}")
    print(f"{'row':<24} {'shape':<28} {'ms':>9} {'dense ms':>9} {'rate':>14} {'figure':>28}")
    for row in rows:
        key = (row["prefill"], row["batch"], row["kv_len"], row["topk"])
        if key not in shapes:
            x = Shape(torch, F, row, args)
            err = x.check()
            if err > 0.02:
                sys.exit(f"{row['name']}: torch's step differs from its fp32 recomputation "
                         f"(relative error {err:.3g}, allowed 0.02)")
            x.idx = x.index()
            sync()
            t = lambda call: time_calls(torch, call, args.device, args.warmup,  # noqa: E731
                                        args.repeats, flush)
            shapes[key] = {"x": x, "err": err, "step": t(x.step), "dense": t(x.dense),
                           "index": t(x.index), "sparse": t(lambda: x.sparse(x.idx))}
        m = shapes[key]
        b, l = row["batch"], row["kv_len"]
        part = row["part"]
        secs = m["index" if part == "index" else "sparse" if part == "sparse" else "step"]
        med = timing_ms(secs)["median"] / 1e3
        dense = timing_ms(m["dense"])["median"] / 1e3
        r = {"name": row["name"], "status": "ok", "suite": "dsa",
             "shape": {"part": part, "batch": b, "kv_len": l, "index_topk": row["topk"],
                       "kind": "prefill" if row["prefill"] else "decode"},
             "time_ms": timing_ms(secs), "dense_time_ms": timing_ms(m["dense"]),
             "check": {"max_rel_err": m["err"], "tolerance": 0.02}}
        if part == "index":
            gbs = b * l * (IDX_DIM + 4) / med / 1e9
            r.update(metric="GB/s", rate=gbs, figure={"name": "GB/s over 132 B per cached key",
                                                      "value": gbs})
            rate, fig = f"{gbs:.3g} GB/s", "-"
        elif part == "sparse":
            pct = 100 * (selected_pairs(row) / med) / (b * l / dense)
            r.update(figure={"name": "per-token rate % of dense", "value": pct})
            rate, fig = f"{selected_pairs(row) / med:.3g} tok/s", f"{pct:.1f}% of dense per token"
        elif row["prefill"]:
            r.update(figure={"name": "dense / dsa time", "value": dense / med})
            rate, fig = "-", f"dense / dsa = {dense / med:.2f}x"
        else:
            r.update(figure={"name": "dsa / dense time", "value": med / dense})
            rate, fig = "-", f"dsa / dense = {med / dense:.3f}"
        shape = f"h{HEADS} {b}x{l}{' causal' if row['prefill'] else ''} top{row['topk']}"
        print(f"{row['name']:<24} {shape:<28} {med * 1e3:>9.3f} {dense * 1e3:>9.3f} {rate:>14} "
              f"{fig:>28}")
        out.append(r)
    write_report(args, {"implementation": "torch", "torch": torch.__version__,
                        "device": device_name(torch, args.device),
                        "index_dtype": args.index_dtype}, threads, out)


if __name__ == "__main__":
    main()
