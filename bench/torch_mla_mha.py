"""torch's best form of the MHA-form MLA rows of `attnrt bench --suite mla` (mla-prefill-1x16384,
mla-extend-8x4096+512), side by side with attnrt's times from its JSON report.

The attention is DeepSeek-V3's MHA form: per q head, q / k of 192 (128 nope + 64 rope) and v of
128, causal within each request's new tokens, every prefix key visible. torch's candidates, each
tried and checked against float32 on sampled rows before it is timed:
  sdpa-<kernel>      scaled_dot_product_attention over the request's whole K/V (prefix and new
                     tokens) with the lower-right causal mask, q / k 192 and v 128 as they are
                     (kernels: flash, efficient, cudnn)
  sdpa-<kernel>-pad  the same with v padded to 192 columns (kernels whose head dims must match)
The decompression of the prefix (the model's GEMM) is not timed, as in attnrt's rows: K/V are
given. Counted FLOPs: 2 x (192 + 128) x q heads per visible (query, key) pair, as attnrt counts.

examples:
  python3 bench/torch_mla_mha.py --attnrt-json mla.json        # both rows, ratios to attnrt
  python3 bench/torch_mla_mha.py --quick --json torch_mha.json
"""
import argparse
import json
import math
import sys

from bench_util import import_torch, make_flush, time_calls, timing_ms, read_attnrt_report

QK, V, HEADS = 192, 128, 128
ROWS = [
    dict(name="mla-prefill-1x16384", batch=1, prefix=0, new=16384),
    dict(name="mla-extend-8x4096+512", batch=8, prefix=4096, new=512),
]
KERNELS = ("flash", "efficient", "cudnn")


def visible_pairs(r):
    n, p = r["new"], r["prefix"]
    return r["batch"] * (n * p + n * (n + 1) // 2)


def flops(r):
    return 2.0 * (QK + V) * HEADS * visible_pairs(r)


def backend_ctx(torch, kernel):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
         "cudnn": SDPBackend.CUDNN_ATTENTION}[kernel]
    return sdpa_kernel([b])


def make_inputs(torch, r, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, L, N = r["batch"], r["prefix"] + r["new"], r["new"]
    q = torch.randn(B, HEADS, N, QK, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HEADS, L, QK, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HEADS, L, V, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def reference_rows(torch, q, k, v, r, scale, heads=2, rows=64):
    """float32 output of the last `rows` queries of request 0, first `heads` heads."""
    N, P = r["new"], r["prefix"]
    qs = q[0, :heads, N - rows:].float()
    ks = k[0, :heads].float()
    vs = v[0, :heads].float()
    s = qs @ ks.transpose(-1, -2) * scale
    pos = torch.arange(N - rows, N, device="cuda")[:, None] + P
    keys = torch.arange(ks.shape[1], device="cuda")[None, :]
    s = s.masked_fill(keys > pos, float("-inf"))
    return torch.softmax(s, -1) @ vs


def candidate(torch, F, kernel, pad, q, k, v, r, scale):
    from torch.nn.attention.bias import causal_lower_right
    N, L = r["new"], r["prefix"] + r["new"]
    vv = torch.nn.functional.pad(v, (0, QK - V)) if pad else v
    mask = None if r["prefix"] == 0 else causal_lower_right(N, L)

    def call():
        with backend_ctx(torch, kernel):
            if mask is None:
                o = F.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=scale)
            else:
                o = F.scaled_dot_product_attention(q, k, vv, attn_mask=mask, scale=scale)
        return o[..., :V] if pad else o

    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--attnrt-json", help="attnrt bench JSON (--suite mla) of the same machine: "
                                          "adds torch best / attnrt per row")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3 repeats after 1 warm-up")
    ap.add_argument("--json", help="write every row and candidate here")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.warmup = 3, 1
    torch, F = import_torch()
    if not torch.cuda.is_available():
        sys.exit("torch has no usable CUDA device; this script times GPU kernels")
    attnrt = {}
    if args.attnrt_json:
        rep = read_attnrt_report(args.attnrt_json)
        attnrt = {x["name"]: x for x in rep["rows"] if x.get("status") == "ok"}
    flush = make_flush(torch, "cuda", "write")
    scale = 1 / math.sqrt(QK)
    out = []
    for r in ROWS:
        q, k, v = make_inputs(torch, r, args.seed)
        ref = reference_rows(torch, q, k, v, r, scale)
        res = dict(name=r["name"], flops=flops(r), candidates=[])
        best = None
        for kernel in KERNELS:
            for pad in (False, True):
                form = f"sdpa-{kernel}{'-pad' if pad else ''}"
                c = dict(form=form)
                try:
                    call = candidate(torch, F, kernel, pad, q, k, v, r, scale)
                    o = call()
                    got = o[0, :ref.shape[0], r["new"] - ref.shape[1]:].float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    c["max_rel_err"] = err
                    if not err < 0.02:
                        c["status"] = "wrong"
                    else:
                        del o
                        t = time_calls(torch, call, "cuda", args.warmup, args.repeats, flush)
                        c["time_ms"] = timing_ms(t)
                        c["tflops"] = flops(r) / c["time_ms"]["median"] / 1e9
                        c["status"] = "ok"
                        if best is None or c["time_ms"]["median"] < best["time_ms"]["median"]:
                            best = c
                except Exception as e:  # a kernel that does not take this shape
                    c["status"] = "n/a"
                    c["error"] = str(e).split("\n")[0][:160]
                res["candidates"].append(c)
                torch.cuda.empty_cache()
        res["best"] = best["form"] if best else None
        a = attnrt.get(r["name"])
        line = f"{r['name']:<24}"
        for c in res["candidates"]:
            line_c = (f"{c['time_ms']['median']:.3f} ms {c['tflops']:.0f} TF/s" if c["status"] == "ok"
                      else c["status"])
            print(f"  {r['name']:<24} {c['form']:<20} {line_c}  {c.get('error', '')}")
        if best:
            line += f" torch best {best['form']} {best['time_ms']['median']:.3f} ms {best['tflops']:.0f} TFLOP/s"
        if a and best:
            am = a["time_ms"]["median"]
            res["attnrt_ms"] = am
            res["torch_over_attnrt"] = best["time_ms"]["median"] / am
            line += f" | attnrt {am:.3f} ms {flops(r) / am / 1e9:.0f} TFLOP/s | torch/attnrt {res['torch_over_attnrt']:.2f}x"
        print(line, flush=True)
        out.append(res)
        del q, k, v
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(schema="attnrt-torch-mla-mha/1", torch=torch.__version__,
                           device=torch.cuda.get_device_name(), rows=out), f, indent=1)


if __name__ == "__main__":
    main()
