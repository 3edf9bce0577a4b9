#!/usr/bin/env python3
"""The MLA rows of `attnrt bench --suite mla` through torch's best forms, on the CPU or a CUDA GPU.

The torch anchor of each MLA row (docs/workloads.md "MLA rows"): DeepSeek-V3's latent attention,
q [B*n, H, 576] bf16, one latent row [576] per cached token (V = its first 512 columns), out
[B*n, H, 512], softmax scale 1/sqrt(576) as the attnrt rows use (the layer's default, 1/sqrt of the
latent head_dim; --softmax-scale sets another). Every tensor is dense (torch has no paged KV) and
built before timing; page size is therefore irrelevant here (the -p1 rows time as their page-64
twins), and fp8 rows are dequantised to bf16 then (torch reads 2 bytes per latent element where
attnrt reads 1; the row is still counted with fp8 bytes, so its rate compares the same work).
Three forms of the same attention are timed, each alone:

  eager  the absorbed form as batched matmuls, as DeepSeek's and transformers' eager code do it:
         S = q . latent^T (torch.bmm, bf16 in, fp32 accumulation), scale, the chain / tree mask of
         verify rows as an additive fp32 bias, softmax in fp32, P (bf16) . latent[:, :512].
  sdpa   the absorbed form through F.scaled_dot_product_attention with the latent as one K/V head
         (MQA), in three layouts: `gqa` (q [B, H, n, 576], k [B, 1, L, 576], enable_gqa=True),
         `expand` (k/v expanded to H heads, stride 0, no copy) and `fold` (the H heads folded into
         the query length: q [B, 1, n*H, 576] against the one head, the mask repeated per head).
         V is the view latent[..., :512]; where a kernel refuses qk 576 with v 512, V is the whole
         latent (v 576, the same tensor as K) and the output's first 512 columns are kept (`v576`).
         On a GPU each layout runs with each kernel of --kernels (flash, efficient, cudnn); those
         that cannot take the shape are listed with their reason.
  mha    the decompressed (MHA) form: per head k = [latent[:, :512] . W_UK (128) | rope 64],
         v = latent[:, :512] . W_UV (128), SDPA with qk 192 / v 128 over H heads (v padded to 192
         and sliced where a kernel needs equal dims, `v192`). The attention is timed alone
         (`attention`); the decompression (kv_b_proj as one F.linear of [B*L, 512] by
         [H*256, 512], the split, the rope column broadcast to every head; transformers'
         DeepSeek-V3 code) is timed separately (`decompress`): a decode step would pay it every
         step over the whole context, which is why engines use the absorbed form. The form's time
         is attention + decompress.
         Skipped, with the reason, where the decompressed K/V (k, and the kv_b_proj output v is a
         view of), B*L*H*(192+256)*2 bytes, exceed --mha-max-gb (h128 128x8192: 120 GB).

torch's time for a row is its fastest form (mha counted with its decompression); every form's
median and rate are in the output. Rates use the row's counted bytes / FLOPs and metric from the
attnrt JSON (`counted`, `metric`), so the counting is the CLI's; rows built here (no JSON) count
by the same rules (docs/workloads.md).

Correctness before timing: the first call of every form / kernel is compared with an fp32
recomputation of the absorbed attention on the first --check-requests requests (the mha form
against that output times W_UV), and the forms with each other; relative L2 error per (query, head)
at most 0.02. A form that fails is reported as a mismatch and not timed.

Timing, as `attnrt bench` and bench/torch_sdpa.py: --warmup untimed calls, then --repeats calls
each after a cache flush (GPU: a 256 MiB tensor written, or read with --flush clean; CPU: twice the
last-level cache written), CUDA events on the GPU, perf_counter on the CPU; median, p10, p90.

Shapes: --from an attnrt bench JSON of `--suite mla` (its rows' shapes and verify trees), or --cli
PATH to run `attnrt bench --suite mla` first (same device, --workload, --repeats, --warmup;
--scale passed on), else the 14 standard rows built here (--scale shrinks them as `attnrt bench
--scale` does). --attnrt-json FILE (the CLI's JSON of the same rows on the same machine; --cli sets
it) adds torch best / attnrt per row (> 1: attnrt is faster).

    attnrt bench --backend cuda --suite mla --json mla.json
    python3 bench/torch_mla.py --device cuda --from mla.json --attnrt-json mla.json --json t.json
    python3 bench/torch_mla.py --device cuda --cli build/attnrt --json t.json   # both in one go
    python3 bench/torch_mla.py --device cpu --quick            # tiny shapes (x1/128), < 60 s
"""

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import warnings

# Passive OpenMP waits: on a small shared box spinning torch threads stall each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_util import (add_row_args, check_row_args, check_torch_device, device_name,  # noqa: E402
                        import_torch, make_flush, read_attnrt_report, row_parser,
                        set_torch_threads, time_calls, timing_ms, write_report)

LORA, ROPE = 512, 64          # DeepSeek-V3: kv_lora_rank, qk_rope_head_dim
NOPE, VDIM = 128, 128         # qk_nope_head_dim, v_head_dim of the decompressed (MHA) form
LATENT = LORA + ROPE          # 576 columns per cached token
MLA_PAGE = 64
LENGTH_QUANTUM = 16           # bench/harness/scale.h kLengthQuantum
TOLERANCE = 0.02
QUICK_SCALE = {"cpu": 1 / 128, "cuda": 1.0}
CUDA_KERNELS = ("flash", "efficient", "cudnn")
SDPA_LAYOUTS = ("gqa", "expand", "fold")

# bench/harness/workload.cpp mla_workloads(): (heads, batch, kv_len) decode sets, then verify.
DECODE_SET = ((16, 1, 32768), (16, 64, 8192), (128, 64, 4096), (128, 128, 8192))


# ---- rows ------------------------------------------------------------------------------------
def mla_row(name, kind, heads, batch, prefix, new, page, dtype, topk=1):
    return dict(name=name, kind=kind, batch=batch, prefix_len=prefix, new_tokens=new,
                kv_len=prefix + new, q_heads=heads, kv_heads=1, head_dim=LATENT,
                kv_lora_rank=LORA, v_head_dim=LORA, page_size=page, kv_dtype=dtype, topk=topk,
                layer="mla")


def standard_rows():
    """The 14 rows of `attnrt bench --suite mla`, in its order."""
    rows = []
    for sfx, page, dt in (("", MLA_PAGE, "bf16"), ("-fp8", MLA_PAGE, "fp8_e4m3"),
                          ("-p1", 1, "bf16")):
        for h, b, l in DECODE_SET:
            rows.append(mla_row(f"mla-decode-h{h}-{b}x{l}{sfx}", "decode", h, b, l - 1, 1, page, dt))
    rows.append(mla_row("mla-verify-chain-64x4096+4", "verify-chain", 128, 64, 4096, 4, MLA_PAGE,
                        "bf16"))
    rows.append(mla_row("mla-verify-tree-64x4096+16-topk4", "verify-tree", 128, 64, 4096, 16,
                        MLA_PAGE, "bf16", topk=4))
    for r in rows:
        if r["kind"].startswith("verify"):
            r["tree_parents"] = verify_parents(r["new_tokens"], r["topk"])
    return rows


def round_length(x):
    """bench/harness/scale.h round_length: to a multiple of 16 (half away from zero), >= 16."""
    return max(LENGTH_QUANTUM, int(math.floor(x / LENGTH_QUANTUM + 0.5)) * LENGTH_QUANTUM)


def scale_row(row, f):
    """`attnrt bench --scale f` (scale_workload): batch x f (>= 1), lengths x f rounded to 16,
    draft tokens, heads and dims unchanged."""
    if f == 1:
        return row
    s = dict(row)
    s["batch"] = max(1, int(math.floor(row["batch"] * f + 0.5)))
    if row["kind"] == "decode":
        s["prefix_len"] = round_length(row["kv_len"] * f) - 1
    else:
        s["prefix_len"] = round_length(row["prefix_len"] * f)
    s["kv_len"] = s["prefix_len"] + s["new_tokens"]
    s["scale_note"] = f"scaled x{f:g} from {shape_text(row)}"
    return s


def verify_parents(n, topk):
    """bench/harness/workload.cpp verify_parents: a chain, or EAGLE-like levels of `topk` tokens
    whose parents are drawn from the level above by the same 64-bit LCG, so the tree is the CLI's."""
    parent = [-1] * n
    if topk <= 1:
        return [t - 1 for t in range(n)]
    mask = (1 << 64) - 1
    state = 0x9E3779B97F4A7C15
    level_begin, level_end, t = 0, 1, 1
    while t < n:
        next_end = min(n, t + topk)
        for u in range(t, next_end):
            state = (state * 6364136223846793005 + 1442695040888963407) & mask
            parent[u] = level_begin + (state >> 33) % (level_end - level_begin)
        parent[t:next_end] = sorted(parent[t:next_end])
        level_begin, level_end, t = t, next_end, next_end
    return parent


def visible_pairs(row):
    p, n = row["prefix_len"], row["new_tokens"]
    if row["kind"] == "verify-tree":
        parents = row["tree_parents"]
        inner = 0
        for t in range(n):
            u = t
            while u >= 0:
                inner, u = inner + 1, parents[u]
        return n * p + inner
    return n * p + n * (n + 1) / 2


def counted(row):
    """bench/harness/workload.cpp counted_bytes / attention_work for an MLA row."""
    elem = 1 if row["kv_dtype"].startswith("fp8") else 2
    tokens = row["batch"] * row["new_tokens"]
    return {"bytes": float(row["batch"] * row["kv_len"] * LATENT * elem
                           + tokens * row["q_heads"] * (LATENT + LORA) * 2),
            "flops": float(row["batch"] * 2 * row["q_heads"] * (LATENT + LORA) * visible_pairs(row))}


def bound(row):
    return "compute" if row["q_heads"] >= 64 else "memory"


def shape_text(row):
    b, p, n = row["batch"], row["prefix_len"], row["new_tokens"]
    s = f"h{row['q_heads']} " + (f"{b}x{p + n}" if row["kind"] == "decode" else
                                 f"{b}x({p}+{n}" + (f", topk {row['topk']})" if row["kind"] ==
                                                    "verify-tree" else ")"))
    if row["page_size"] != 16:
        s += f" page {row['page_size']}"
    if row["kv_dtype"] != "bf16":
        s += f" {row['kv_dtype']}"
    return s


def rows_from_attnrt(report):
    rows = []
    for r in report["rows"]:
        if r.get("shape", {}).get("layer") != "mla":
            continue
        s = dict(r["shape"])
        s["name"] = r["name"]
        s.setdefault("kv_len", s["prefix_len"] + s["new_tokens"])
        s.setdefault("topk", 1)
        if s["kind"].startswith("verify") and not s.get("tree_parents"):
            s["tree_parents"] = verify_parents(s["new_tokens"], s["topk"])
        if s["head_dim"] != LATENT or s.get("kv_lora_rank", LORA) != LORA:
            sys.exit(f"{r['name']}: latent {s['head_dim']} / rank {s.get('kv_lora_rank')}; this "
                     f"script knows DeepSeek-V3's {LATENT} / {LORA} only")
        if "counted" in r:
            s["counted"] = r["counted"]
        if "metric" in r:
            s["metric"] = r["metric"]
        if r.get("scale_note"):
            s["scale_note"] = r["scale_note"]
        rows.append(s)
    return rows


def select(rows, spec):
    if spec == "all":
        return rows
    out = []
    for item in spec.split(","):
        bare = item[4:] if item.startswith("mla-") else item
        hit = [r for r in rows if r["name"] in (item, "mla-" + bare) or r["kind"] == bare
               or (bare == "verify" and r["kind"].startswith("verify"))]
        if not hit:
            sys.exit(f"--workload {item}: no MLA row matches; rows: "
                     f"{', '.join(r['name'] for r in rows)} (or decode, verify, verify-chain, "
                     "verify-tree)")
        out += [r for r in hit if r not in out]
    return out


def metric_of(row, device):
    """(unit, divisor): the CLI's metric when the JSON gave one, else by the row's bound."""
    unit = row.get("metric") or ("GB/s" if bound(row) == "memory" else
                                 ("TFLOP/s" if device == "cuda" else "GFLOP/s"))
    scale = {"GB/s": 1e9, "TB/s": 1e12, "GFLOP/s": 1e9, "TFLOP/s": 1e12}[unit]
    return unit, ("bytes" if unit.endswith("B/s") else "flops"), scale


# ---- inputs ----------------------------------------------------------------------------------
class Inputs:
    """One row's dense tensors, built before timing. Token-major like an engine's: q [B, n, H, 576]
    (the absorbed query, W_UK folded into q_nope), latent [B, L, 576]; for the mha form q_nope /
    q_pe [B, n, H, 128 / 64] and the kv_b_proj weights W_UK / W_UV [H, 512, 128]."""

    def __init__(self, torch, row, device, seed, scale):
        b, n, h, L = row["batch"], row["new_tokens"], row["q_heads"], row["kv_len"]
        gen = torch.Generator(device=device).manual_seed(seed)
        bf16 = torch.bfloat16
        randn = lambda *s, std=1.0: (torch.randn(*s, generator=gen, device=device) * std)  # noqa: E731
        # The latent cache: N(0, 1) (fp8 rows: rounded to e4m3, then held as bf16), in chunks of
        # requests to bound the fp32 temporary.
        self.latent = torch.empty(b, L, LATENT, dtype=bf16, device=device)
        step = max(1, (256 << 20) // (4 * L * LATENT))
        for r0 in range(0, b, step):
            x = randn(min(step, b - r0), L, LATENT)
            if row["kv_dtype"].startswith("fp8"):
                x = x.to(torch.float8_e4m3fn)
            self.latent[r0:r0 + x.shape[0]].copy_(x.to(bf16))
            del x
        # Weights of std 1/sqrt(512): k_nope and v of the decompressed form are then ~N(0, 1).
        self.w_uk = randn(h, LORA, NOPE, std=LORA ** -0.5).to(bf16)
        self.w_uv = randn(h, LORA, VDIM, std=LORA ** -0.5).to(bf16)
        self.q_nope = randn(b, n, h, NOPE).to(bf16)
        self.q_pe = randn(b, n, h, ROPE).to(bf16)
        q_lat = torch.einsum("bnhc,hlc->bnhl", self.q_nope.float(), self.w_uk.float())
        self.q = torch.cat([q_lat.to(bf16), self.q_pe], dim=-1)  # [B, n, H, 576]
        del q_lat
        self.scale = scale
        self.mask = None  # [n, L] bool: what each new token sees; None for decode
        if row["kind"] != "decode":
            p = row["prefix_len"]
            parents = row["tree_parents"]
            m = torch.zeros(n, L, dtype=torch.bool)
            m[:, :p] = True
            for t in range(n):
                u = t
                while u >= 0:
                    m[t, p + u] = True
                    u = parents[u]
            self.mask = m.to(device)
        self.b, self.n, self.h, self.L = b, n, h, L


# ---- the forms -------------------------------------------------------------------------------
def eager_call(torch, x):
    """S = q.latent^T (bmm), fp32 scale (+ mask bias) and softmax, P.V (bmm): returns [B, n*H, 512]."""
    b, n, h, L = x.b, x.n, x.h, x.L
    q = x.q.reshape(b, n * h, LATENT)
    kt = x.latent.transpose(1, 2)
    v = x.latent[:, :, :LORA]
    bias = None
    if x.mask is not None:
        bias = torch.zeros(n, 1, L, dtype=torch.float32, device=x.q.device)
        bias.masked_fill_(~x.mask[:, None, :], float("-inf"))
    scale = x.scale

    def call():
        s = torch.bmm(q, kt).float()
        if bias is not None:
            s = (s.view(b, n, h, L) * scale + bias).view(b, n * h, L)
        else:
            s = s * scale
        p = torch.softmax(s, dim=-1).to(torch.bfloat16)
        return torch.bmm(p, v)
    return call


def sdpa_call(torch, F, x, layout, v576, backend):
    """The absorbed form through SDPA with the latent as one K/V head; returns a zero-argument call
    and a function mapping its output to [B, n, H, 512]."""
    from contextlib import nullcontext

    b, n, h, L = x.b, x.n, x.h, x.L
    k = x.latent[:, None]                                  # [B, 1, L, 576]
    v = k if v576 else k[..., :LORA]                       # V: the latent itself, or its 512 view
    gqa = False
    mask = x.mask
    if layout == "fold":
        q = x.q.reshape(b, 1, n * h, LATENT)
        if mask is not None:
            mask = mask.repeat_interleave(h, dim=0)        # row t*H + h sees what token t sees
        unfold = lambda o: o[..., :LORA].reshape(b, n, h, LORA)  # noqa: E731
    else:
        q = x.q.permute(0, 2, 1, 3)                         # [B, H, n, 576] view
        if layout == "expand":
            k, v = k.expand(b, h, L, LATENT), v.expand(b, h, L, v.shape[-1])
        else:
            gqa = True
        unfold = lambda o: o[..., :LORA].permute(0, 2, 1, 3)  # noqa: E731
    kw = dict(attn_mask=mask, scale=x.scale)
    if gqa:
        kw["enable_gqa"] = True
    ctx = sdpa_context(torch, backend)

    def call():
        with ctx() if ctx else nullcontext():
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return call, unfold


def sdpa_context(torch, backend):
    if backend == "default":
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    which = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]
    return lambda: sdpa_kernel(which)


def decompress_call(torch, x):
    """kv_b_proj as transformers' DeepSeek-V3 runs it (F.linear, weight [H*(128+128), 512]), split per
    head into k_nope / v, k = [k_nope | k_pe broadcast to every head]; returns k [B, H, L, 192] and
    v [B, H, L, 128] (views of token-major tensors)."""
    b, h, L = x.b, x.h, x.L
    # nn.Linear's layout: weight [H*(128+128), 512], per head [W_UK^T; W_UV^T].
    w = torch.cat([x.w_uk, x.w_uv], dim=-1).permute(0, 2, 1).reshape(h * (NOPE + VDIM), LORA)
    w = w.contiguous()
    nope = x.latent[:, :, :LORA].reshape(b * L, LORA)
    k_pe = x.latent[:, :, None, LORA:]                      # [B, L, 1, 64]

    def call():
        kv = torch.nn.functional.linear(nope, w).view(b, L, h, NOPE + VDIM)
        k_nope, v = kv.split([NOPE, VDIM], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, L, h, ROPE)], dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)
    return call


def mha_call(torch, F, x, k, v, v192, backend):
    """SDPA over H heads with qk 192 / v 128 (or v zero-padded to 192, output sliced)."""
    from contextlib import nullcontext

    q = torch.cat([x.q_nope, x.q_pe], dim=-1).permute(0, 2, 1, 3)  # [B, H, n, 192]
    if v192:
        v = F.pad(v, (0, NOPE + ROPE - VDIM))
    ctx = sdpa_context(torch, backend)
    kw = dict(attn_mask=x.mask, scale=x.scale)

    def call():
        with ctx() if ctx else nullcontext():
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return call, lambda o: o[..., :VDIM].permute(0, 2, 1, 3)


# ---- correctness -----------------------------------------------------------------------------
def reference(torch, x, requests):
    """fp32 absorbed attention of the first `requests` requests: [r, n, H, 512]."""
    q = x.q[:requests].float()
    lat = x.latent[:requests].float()
    s = torch.einsum("bnhd,bld->bnhl", q, lat) * x.scale
    if x.mask is not None:
        s = s.masked_fill(~x.mask[None, :, None, :], float("-inf"))
    return torch.einsum("bnhl,bld->bnhd", torch.softmax(s, dim=-1), lat[..., :LORA])


def rel_err(torch, a, b):
    """Max over (request, token, head) of ||a - b|| / ||b|| over the last dim."""
    a, b = a.float(), b.float()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).max())


# ---- timing ----------------------------------------------------------------------------------
def timed(torch, call, args, flush):
    return time_calls(torch, call, args.device, args.warmup, args.repeats, flush)


def probe_and_time(torch, call, unfold, ref, nchk, args, flush, form_entry):
    """One SDPA variant: a first call checked against `ref`, then timed when it agrees. Returns
    (entry, checked output): status error (the kernel refused the shape or ran out of memory: the
    reason), mismatch (not timed) or ok."""
    # A kernel restricted by sdpa_kernel that cannot take the shape raises "No available kernel";
    # its reasons come as warnings, kept here for the error.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.no_grad():
                o = unfold(call())[:nchk]
            err = rel_err(torch, o, ref)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
            why = [first_line(w.message) for w in caught]
            return {"status": "error", "error": "; ".join([first_line(e)] + why)[:400]}, None
    if err > TOLERANCE:
        return {"status": "mismatch", "max_rel_err": err}, None
    try:
        return form_entry(timed(torch, call, args, flush), err), o
    except RuntimeError as e:
        return {"status": "error", "error": first_line(e)}, None


def run_row(torch, F, row, args, flush):
    cuda = args.device == "cuda"
    unit, what, div = metric_of(row, args.device)
    amount = row["counted"][what]
    rate = lambda sec: amount / sec / div  # noqa: E731
    x = Inputs(torch, row, args.device, args.seed, args.softmax_scale)
    nchk = min(row["batch"], args.check_requests)
    ref = reference(torch, x, nchk)
    ref_mha = torch.einsum("bnhd,hdc->bnhc", ref, x.w_uv.float())
    forms, outs, notes = {}, {}, []

    def form_entry(samples, err):
        med = statistics.median(samples)
        return {"status": "ok", "time_ms": timing_ms(samples), "rate": rate(med),
                "max_rel_err": err}

    # 1. eager
    call = eager_call(torch, x)
    with torch.no_grad():
        o = call().view(x.b, x.n, x.h, LORA)[:nchk]
    err = rel_err(torch, o, ref)
    outs["eager"] = o
    if err > TOLERANCE:
        forms["eager"] = {"status": "mismatch", "max_rel_err": err}
    else:
        forms["eager"] = form_entry(timed(torch, call, args, flush), err)
    del call

    # 2. sdpa, absorbed, latent as one head
    kernels = args.kernels if cuda else ["default"]
    variants, best = {}, None
    for backend in kernels:
        for layout in SDPA_LAYOUTS:
            name = f"{backend},{layout}"
            entry = None
            for v576 in (False, True):
                call, unfold = sdpa_call(torch, F, x, layout, v576, backend)
                entry, o = probe_and_time(torch, call, unfold, ref, nchk, args, flush, form_entry)
                if entry["status"] == "error":
                    continue
                entry["v"] = "v576" if v576 else "v512"
                if entry["status"] != "ok":
                    break
                if best is None or entry["time_ms"]["median"] < variants[best]["time_ms"]["median"]:
                    best = name
                    outs["sdpa"] = o
                break
            variants[name] = entry
            del call
    if best is None:
        forms["sdpa"] = {"status": "error", "variants": variants,
                         "error": "no SDPA kernel ran the absorbed form"}
    else:
        forms["sdpa"] = {**variants[best], "variant": f"{best},{variants[best]['v']}",
                         "variants": variants}

    # 3. mha: decompressed K/V, SDPA qk 192 / v 128; decompression timed separately
    # k [.., 192] and the kv_b_proj output [.., 128 + 128] that v is a view of, per token and head
    mha_bytes = x.b * x.L * x.h * (NOPE + ROPE + NOPE + VDIM) * 2
    if mha_bytes > args.mha_max_gb * 1e9:
        forms["mha"] = {"status": "skipped",
                        "reason": f"decompressed K/V and temporary {mha_bytes / 1e9:.0f} GB > "
                                  f"--mha-max-gb {args.mha_max_gb:g}"}
    else:
        dec = decompress_call(torch, x)
        dec_samples = timed(torch, dec, args, flush)
        with torch.no_grad():
            k, v = dec()
        variants, best = {}, None
        for backend in kernels:
            entry = None
            for v192 in (False, True):
                call, unfold = mha_call(torch, F, x, k, v, v192, backend)
                entry, o = probe_and_time(torch, call, unfold, ref_mha, nchk, args, flush,
                                          form_entry)
                if entry["status"] == "error":
                    continue
                entry["v"] = "v192" if v192 else "v128"
                if entry["status"] != "ok":
                    break
                if best is None or entry["time_ms"]["median"] < variants[best]["time_ms"]["median"]:
                    best = backend
                    outs["mha"] = o
                break
            variants[backend] = entry
            del call
        del k, v
        dec_ms = timing_ms(dec_samples)
        if best is None:
            forms["mha"] = {"status": "error", "variants": variants, "decompress_ms": dec_ms,
                            "error": "no SDPA kernel ran the MHA form"}
        else:
            att = variants[best]
            total = att["time_ms"]["median"] + dec_ms["median"]
            forms["mha"] = {"status": "ok", "variant": f"{best},{att['v']}",
                            "attention_ms": att["time_ms"], "attention_rate": att["rate"],
                            "decompress_ms": dec_ms, "time_ms": {"median": total},
                            "rate": rate(total / 1e3), "max_rel_err": att["max_rel_err"],
                            "variants": variants}

    # The forms against each other (mha through W_UV), as well as each against fp32.
    pair = {}
    if "eager" in outs and "sdpa" in outs:
        pair["eager~sdpa"] = rel_err(torch, outs["sdpa"], outs["eager"])
    if "mha" in outs:
        for f in ("eager", "sdpa"):
            if f in outs:
                up = torch.einsum("bnhd,hdc->bnhc", outs[f].float(), x.w_uv.float())
                pair[f"{f}~mha"] = rel_err(torch, outs["mha"], up)
    errs = {f: v["max_rel_err"] for f, v in forms.items() if "max_rel_err" in v}
    check = {"method": f"fp32 absorbed attention of {nchk} of {row['batch']} requests x "
                       f"{row['new_tokens']} tokens x {row['q_heads']} heads; forms pairwise",
             "requests_checked": nchk, "max_rel_err": errs, "pairwise_rel_err": pair,
             "tolerance": TOLERANCE,
             "passed": all(e <= TOLERANCE for e in list(errs.values()) + list(pair.values()))}
    del x, outs, ref, ref_mha

    ok = {f: v for f, v in forms.items() if v.get("status") == "ok"}
    if not ok:
        raise RuntimeError("no torch form ran: " + "; ".join(
            f"{f}: {v.get('error') or v.get('reason') or v.get('status')}" for f, v in forms.items()))
    best_form = min(ok, key=lambda f: ok[f]["time_ms"]["median"])
    best_ms = ok[best_form]["time_ms"]
    notes.append("dense latent built before timing (no paging; page size does not apply)")
    if row["kv_dtype"].startswith("fp8"):
        notes.append("fp8 latent dequantised to bf16 before timing (torch reads 2 B per element)")
    if forms.get("mha", {}).get("status") == "ok":
        notes.append("mha time = attention + decompression (both in forms.mha)")
    return {
        "name": row["name"],
        "shape": {k: row[k] for k in ("kind", "batch", "prefix_len", "new_tokens", "kv_len",
                                      "q_heads", "kv_heads", "head_dim", "kv_lora_rank",
                                      "v_head_dim", "page_size", "kv_dtype", "topk", "layer")
                  if k in row},
        **({"tree_parents": row["tree_parents"]} if row["kind"] == "verify-tree" else {}),
        **({"scale_note": row["scale_note"]} if row.get("scale_note") else {}),
        "softmax_scale": args.softmax_scale,
        "counted": row["counted"],
        "metric": unit,
        "status": "ok" if check["passed"] else "mismatch",
        "best_form": best_form,
        "time_ms": best_ms,
        "rate": ok[best_form]["rate"],
        "forms": forms,
        "check": check,
        "notes": notes,
    }


def first_line(e):
    return str(e).strip().split("\n")[0][:200]


# ---- driver ----------------------------------------------------------------------------------
def run_cli(args):
    """`attnrt bench --suite mla` on the same device; returns its report's path."""
    fd, path = tempfile.mkstemp(prefix="attnrt-mla-", suffix=".json")
    os.close(fd)
    cmd = [args.cli, "bench", "--backend", args.device, "--suite", "mla", "--workload",
           args.workload, "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--json", path]
    if args.scale != 1:
        cmd += ["--scale", f"{args.scale:g}"]
    env = dict(os.environ)
    if args.device == "cuda":
        env["ATTNRT_BENCH_FLUSH"] = args.flush
    print("$ " + " ".join(cmd), flush=True)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stderr[-3000:]}")
    return path


def attnrt_times(path):
    report = read_attnrt_report(path)
    return {r["name"]: r for r in report["rows"] if r.get("status") == "ok" and "time_ms" in r}


SAME_SHAPE = ("batch", "prefix_len", "new_tokens", "q_heads", "head_dim", "kv_dtype")


def main():
    ap = row_parser(__doc__)
    add_row_args(ap, from_help="attnrt bench JSON (--suite mla) whose row shapes to run",
                 workload_help="all, a kind (decode, verify, verify-chain, verify-tree; with or "
                               "without mla-) or row names, comma-separated",
                 scale_help="without --from: shrink batch and lengths as attnrt bench --scale does",
                 device_help="where to run: cpu (SDPA's CPU kernel) or cuda (the kernels of "
                             "--kernels)")
    ap.add_argument("--quick", action="store_true",
                    help="small and fast: on the CPU the rows x1/128 (unless --scale), 3 repeats "
                         "after 1 warm-up; on a GPU full rows, 3 repeats")
    ap.add_argument("--cli", help="an attnrt executable: run its `bench --suite mla` first on the "
                                  "same device and take the shapes and the attnrt times from it")
    ap.add_argument("--attnrt-json", help="the attnrt bench JSON of the same rows on the same "
                                          "machine: adds torch best / attnrt per row")
    ap.add_argument("--kernels", default=",".join(CUDA_KERNELS),
                    help="with --device cuda: the SDPA kernels to try, a subset of "
                         "flash, efficient, cudnn, math")
    ap.add_argument("--mha-max-gb", type=float, default=None,
                    help="skip the mha form where its decompressed K/V (B*L*H*(192+256)*2 B) exceed "
                         "this (default 40 on a GPU, a quarter of the memory on the CPU)")
    ap.add_argument("--softmax-scale", type=float, default=1 / math.sqrt(LATENT),
                    help="default 1/sqrt(576), the scale the attnrt MLA rows use")
    ap.add_argument("--check-requests", type=int, default=2,
                    help="requests of each row checked against fp32 before timing")
    ap.add_argument("--json", help="write every row, form and kernel here")
    args = ap.parse_args()
    args.kernels = args.kernels.split(",")
    unknown = [k for k in args.kernels if k not in CUDA_KERNELS + ("math",)]
    if unknown:
        ap.error(f"--kernels: unknown {', '.join(unknown)}; use flash, efficient, cudnn, math")
    if args.quick:
        if args.scale == 1.0 and not args.source and not args.cli:
            args.scale = QUICK_SCALE[args.device]
        if args.repeats == 10:
            args.repeats = 3
        if args.warmup == 2 and args.device == "cpu":
            args.warmup = 1
    check_row_args(ap, args)
    if args.source and args.cli:
        ap.error("--from and --cli both give the shapes: use one")

    torch, F = import_torch()
    threads = set_torch_threads(torch, args.threads)
    check_torch_device(torch, args.device)
    if args.mha_max_gb is None:
        if args.device == "cuda":
            args.mha_max_gb = 40.0
        else:
            args.mha_max_gb = min(40.0, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                  / 4 / 1e9)

    if args.cli:
        args.source = run_cli(args)
        args.attnrt_json = args.attnrt_json or args.source
    if args.source:
        rows = rows_from_attnrt(read_attnrt_report(args.source))
        if not rows:
            sys.exit(f"{args.source}: no MLA rows (run attnrt bench --suite mla)")
    else:
        rows = [scale_row(r, args.scale) for r in standard_rows()]
    rows = select(rows, args.workload)
    for r in rows:
        r.setdefault("counted", counted(r))
    cli_rows = attnrt_times(args.attnrt_json) if args.attnrt_json else {}

    flush = make_flush(torch, args.device, args.flush)
    if args.device == "cuda":
        where = f"{torch.cuda.get_device_name()}, SDPA kernels {','.join(args.kernels)}, " \
                f"L2 flush: {args.flush}"
    else:
        where = f"cpu ({torch.backends.cpu.get_cpu_capability()}), {threads} threads"
    print(f"torch {torch.__version__} on {where}; softmax scale {args.softmax_scale:.6g}; "
          f"median of {args.repeats} after {args.warmup} warm-up")
    out = []
    for row in rows:
        if row["kind"] not in ("decode", "verify-chain", "verify-tree"):
            # The MHA-form rows (mla-prefill-*, mla-extend-*) are prefills: their torch form is
            # SDPA over the decompressed K/V, which bench/torch_sdpa.py's prefill rows measure.
            r = {"name": row["name"], "status": "n/a",
                 "reason": f"{row['kind']} rows (MLA's MHA form) are not anchored here"}
            print(f"{row['name']:<34} n/a: {r['reason']}")
            out.append(r)
            continue
        print(f"{row['name']:<34} {shape_text(row)}"
              + (f"   [{row['scale_note']}]" if row.get("scale_note") else ""), flush=True)
        try:
            r = run_row(torch, F, row, args, flush)
        except (RuntimeError, MemoryError) as e:
            r = {"name": row["name"], "status": "error", "error": first_line(e)}
            print(f"    ERROR: {r['error']}")
            out.append(r)
            write_mla_report(args, torch, threads, out)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            continue
        cli = cli_rows.get(row["name"])
        if cli is not None:
            if any(cli["shape"].get(k) != row.get(k) for k in SAME_SHAPE):
                r["attnrt"] = {"error": f"shape differs: attnrt ran {cli['shape'].get('shape')}"}
            else:
                a = cli["time_ms"]["median"]
                r["attnrt"] = {"time_ms": cli["time_ms"], "rate": cli.get("rate"),
                               "metric": cli.get("metric")}
                r["torch_over_attnrt"] = r["time_ms"]["median"] / a
                for f in r["forms"].values():
                    if f.get("status") == "ok":
                        f["over_attnrt"] = f["time_ms"]["median"] / a
        print_row(r)
        out.append(r)
        write_mla_report(args, torch, threads, out)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    failed = [r["name"] for r in out if r["status"] not in ("ok", "n/a")]
    if failed:
        print(f"not ok: {', '.join(failed)}")
    if args.json:
        print(f"wrote {args.json}")
    sys.exit(1 if any(r["status"] == "mismatch" for r in out) else 0)


def print_row(r):
    unit = r["metric"]
    for f, v in r["forms"].items():
        if v.get("status") == "ok":
            tag = v.get("variant", "bmm")
            line = (f"    {f:<6} {v['time_ms']['median']:>10.3f} ms {v['rate']:>9.2f} {unit:<7}"
                    f" {tag}")
            if f == "mha":
                line += (f": attention {v['attention_ms']['median']:.3f} ms "
                         f"({v['attention_rate']:.2f} {unit}) + decompress "
                         f"{v['decompress_ms']['median']:.3f} ms")
            line += f"  err {v['max_rel_err']:.1e}"
        else:
            why = v.get("reason") or v.get("error") or f"max_rel_err {v.get('max_rel_err', 0):.2e}"
            line = f"    {f:<6} {v['status']}: {why}"
        print(line)
        if "variants" in v:
            failed = [f"{k}: {x.get('error') or x['status']}" for k, x in v["variants"].items()
                      if x.get("status") != "ok"]
            ran = [f"{k},{x['v']}={x['time_ms']['median']:.3f}" for k, x in v["variants"].items()
                   if x.get("status") == "ok"]
            if ran:
                print(f"           ran: {' '.join(ran)}")
            for x in failed:
                print(f"           n/a {x}")
    c = r["check"]
    pair = " ".join(f"{k} {e:.1e}" for k, e in c["pairwise_rel_err"].items())
    line = (f"    best   {r['time_ms']['median']:>10.3f} ms {r['rate']:>9.2f} {unit:<7} "
            f"{r['best_form']}; check {'ok' if c['passed'] else 'MISMATCH'} ({pair})")
    if "torch_over_attnrt" in r:
        line += (f"; attnrt {r['attnrt']['time_ms']['median']:.3f} ms, "
                 f"torch / attnrt {r['torch_over_attnrt']:.2f}x")
    elif "attnrt" in r:
        line += f"; attnrt: {r['attnrt']['error']}"
    print(line, flush=True)


def write_mla_report(args, torch, threads, out):
    write_report(args, {"implementation": "torch-mla", "suite": "mla",
                        "torch_version": torch.__version__,
                        "device": device_name(torch, args.device),
                        "kernels": args.kernels if args.device == "cuda" else ["default"],
                        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                        "softmax_scale": args.softmax_scale, "repeats": args.repeats,
                        "warmup": args.warmup, "scale": args.scale,
                        "mha_max_gb": args.mha_max_gb, "attnrt_json": args.attnrt_json},
                 threads, out)


if __name__ == "__main__":
    main()
