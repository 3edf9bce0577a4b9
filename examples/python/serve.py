"""Serving with attnrt as an engine does it: continuous batching of a stream of requests on a small
random-weight decoder whose attention is attnrt.

The model is a torch decoder (token embedding; per layer RMSNorm, q / k / v / o projections with
RoPE and GQA, attention through attnrt.Runtime.forward, RMSNorm, SwiGLU MLP; final norm and LM
head) with the attention shapes of a preset (heads, head_dim, sliding-window layers). The
scheduler admits arriving requests while their whole life fits the KV-slot budget, prefills
prompts in chunks of --chunked-prefill-size tokens (later chunks on the cached prefix), merges the
running decodes into prefill steps (MIXED) or alternates EXTEND and DECODE steps
(--no-mixed-chunk), samples greedily, and frees a request's row and KV slots when it has produced
its output. With --cuda-graphs (GPU) every DECODE step of a captured batch size runs as one
torch.cuda.graph replay: the model's GEMMs and attnrt's attention of every layer.

    python examples/python/serve.py                       # defaults: < 30 s on a small CPU
    python examples/python/serve.py --device cuda --model-preset llama3-8b --layers 8 \\
        --requests 256 --max-running 64 --cuda-graphs

At the end it prints tokens/s, the steps of each forward mode and, for DECODE steps, the share of
the step time spent in attention (CUDA events around each attention call on a GPU, perf_counter on
the CPU).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

# torch and attnrt's cpu backend each bring an OpenMP runtime; with the default (active) wait
# policy the idle threads of one spin on the cores the other needs, which made CPU steps 5-10x
# slower. Set before either library starts its threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import attnrt  # noqa: E402


# ---- the model -------------------------------------------------------------------------------
class Layer(nn.Module):
    def __init__(self, layer_id: int, hidden: int, hq: int, hkv: int, d: int, dv: int,
                 intermediate: int):
        super().__init__()
        self.layer_id, self.hq, self.hkv, self.d, self.dv = layer_id, hq, hkv, d, dv
        self.input_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.q_proj = nn.Linear(hidden, hq * d, bias=False)
        self.k_proj = nn.Linear(hidden, hkv * d, bias=False)
        self.v_proj = nn.Linear(hidden, hkv * dv, bias=False)
        self.o_proj = nn.Linear(hq * dv, hidden, bias=False)
        self.post_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)


class Decoder(nn.Module):
    """A Llama-style decoder; attention goes through `attend(layer_id, q, k, v)`."""

    def __init__(self, layers: dict, hidden: int, vocab: int, max_pos: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            Layer(i, hidden, l["num_q_heads"], l["num_kv_heads"], l["head_dim"], l["v_head_dim"],
                  2 * hidden) for i, l in layers.items())
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[1]))
        d = layers[0]["head_dim"]
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rope(self, x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(self, input_ids, positions, last_rows, attend):
        """Logits of the rows `last_rows` (each request's last token in the step)."""
        t = input_ids.shape[0]
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        h = self.embed(input_ids)
        for layer in self.layers:
            x = layer.input_norm(h)
            q = self.rope(layer.q_proj(x).view(t, layer.hq, layer.d), cos, sin)
            k = self.rope(layer.k_proj(x).view(t, layer.hkv, layer.d), cos, sin)
            v = layer.v_proj(x).view(t, layer.hkv, layer.dv)
            o = attend(layer.layer_id, q, k, v)
            h = h + layer.o_proj(o.view(t, layer.hq * layer.dv))
            gate, up = layer.gate_up(layer.post_norm(h)).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return self.lm_head(self.norm(h[last_rows]))


# ---- requests and the scheduler --------------------------------------------------------------
@dataclass
class Request:
    rid: int
    arrival: int  # engine step at which it arrives
    prompt: list
    output_len: int
    row: int = -1
    slots: list = field(default_factory=list)  # KV slot of every cached position
    prefilled: int = 0
    output: list = field(default_factory=list)
    reserved: int = 0  # KV slots held back for its whole life at admission

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)

    def lifetime_slots(self, page: int) -> int:
        # The last output token is never fed back: the cache ends at prompt + output - 1 tokens.
        return -(-(len(self.prompt) + self.output_len - 1) // page) * page


def make_requests(args, vocab: int) -> list[Request]:
    rng = random.Random(args.seed)
    reqs, step = [], 0.0
    for i in range(args.requests):
        if i:  # Poisson arrivals: exponential gaps of mean 1 / rate steps
            step += rng.expovariate(args.arrival_rate) if args.arrival_rate > 0 else 0.0
        plen = rng.randint(*args.prompt_len)
        reqs.append(Request(i, int(step), [rng.randrange(vocab) for _ in range(plen)],
                            rng.randint(*args.output_len)))
    return reqs


class Stats:
    def __init__(self):
        self.steps = {"EXTEND": 0, "MIXED": 0, "DECODE": 0}
        self.graph_steps = 0
        self.tokens = {"EXTEND": 0, "MIXED": 0, "DECODE": 0}
        self.decode_step_s = 0.0  # eager DECODE steps: model forward, attention included
        self.decode_attn_s = 0.0
        self.eager_decode_steps = 0


class AttentionTimer:
    """Times every attention call of a step: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, rt: attnrt.Runtime):
        self.rt = rt
        self.cuda = rt.device.type == "cuda"
        self.reset()

    def reset(self):
        self.events, self.cpu_s = [], 0.0

    def __call__(self, layer_id, q, k, v):
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.rt.forward(layer_id, q, k, v)
            stop.record()
            self.events.append((start, stop))
            return out
        t0 = time.perf_counter()
        out = self.rt.forward(layer_id, q, k, v)
        self.cpu_s += time.perf_counter() - t0
        return out

    def seconds(self) -> float:  # after the step's results were read (the GPU is done)
        return sum(a.elapsed_time(b) for a, b in self.events) / 1e3 if self.cuda else self.cpu_s


class TorchAttention:
    """The --check reference: the same steps with plain torch SDPA over a dense K/V cache per
    request and layer (float64 not needed: the check compares greedy tokens in float32)."""

    def __init__(self, layers: dict):
        self.layers = layers
        self.k, self.v = {}, {}
        self.plan = []

    def begin(self, reqs, prefix, ext):
        self.plan = list(zip(reqs, prefix, ext))

    def drop(self, r):
        for layer_id in self.layers:
            self.k.pop((r.rid, layer_id), None)
            self.v.pop((r.rid, layer_id), None)

    def __call__(self, layer_id, q, k, v):
        info = self.layers[layer_id]
        window = info["sliding_window"]
        out = q.new_empty(q.shape[0], info["num_q_heads"], info["v_head_dim"])
        at = 0
        for r, p, n in self.plan:
            key = (r.rid, layer_id)
            kc = torch.cat([self.k[key], k[at:at + n]]) if p else k[at:at + n].clone()
            vc = torch.cat([self.v[key], v[at:at + n]]) if p else v[at:at + n].clone()
            assert kc.shape[0] == p + n, f"request {r.rid}: {kc.shape[0]} cached keys, expected {p + n}"
            self.k[key], self.v[key] = kc, vc
            pos = torch.arange(p, p + n, device=q.device)[:, None]
            j = torch.arange(p + n, device=q.device)[None, :]
            vis = j <= pos
            if window >= 0:  # attnrt's window W: keys at distance <= W (reference-semantics §8.5)
                vis &= pos - j <= window
            o = F.scaled_dot_product_attention(
                q[at:at + n].transpose(0, 1)[None], kc.transpose(0, 1)[None],
                vc.transpose(0, 1)[None], attn_mask=vis, scale=info["scaling"], enable_gqa=True)
            out[at:at + n] = o[0].transpose(0, 1)
            at += n
        return out


class Server:
    def __init__(self, args, rt: attnrt.Runtime, model: Decoder, reqs: list[Request],
                 reference: "TorchAttention | None" = None):
        self.args, self.rt, self.model = args, rt, model
        self.reference = reference  # --check: torch attention instead of attnrt's
        self.device = rt.device
        self.page = rt.page_size
        self.waiting = list(reqs)  # in arrival order
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.budget = rt.available_slots  # KV slots not reserved by a running request
        self.step = 0
        self.last_was_prefill = False
        self.stats = Stats()
        self.timer = AttentionTimer(rt)
        self.graphs = (CudaGraphs(rt, model, args.max_running, args.share_every)
                       if args.cuda_graphs and reference is None else None)

    # Admission: a request enters when a row is free and its whole life fits the KV budget.
    def admit(self):
        while (self.waiting and self.waiting[0].arrival <= self.step
               and len(self.running) < self.args.max_running):
            r = self.waiting[0]
            need = r.lifetime_slots(self.page)
            if need > self.budget:
                break
            self.waiting.pop(0)
            r.row, r.reserved = self.rt.alloc_request(), need
            self.budget -= need
            self.running.append(r)

    def finish(self, r: Request):
        self.rt.free_slots(r.slots)  # its pages go back to the pool
        self.rt.free_request(r.row)
        if self.reference is not None:
            self.reference.drop(r)
        self.budget += r.reserved
        self.running.remove(r)
        self.finished.append(r)

    def plan(self):
        """(mode, requests, prefix lens, new-token counts) of the next step, or None."""
        decoding = [r for r in self.running if r.decoding]
        mix = not self.args.no_mixed_chunk
        reqs, prefix, ext = [], [], []
        if not decoding or mix or not self.last_was_prefill:
            budget = self.args.chunked_prefill_size - (len(decoding) if mix else 0)
            for r in self.running:
                if budget <= 0:
                    break
                if not r.decoding:
                    n = min(len(r.prompt) - r.prefilled, budget)
                    reqs.append(r)
                    prefix.append(r.prefilled)
                    ext.append(n)
                    budget -= n
        if not reqs:
            self.last_was_prefill = False
            return ("DECODE", decoding, [len(r.slots) for r in decoding],
                    [1] * len(decoding)) if decoding else None
        self.last_was_prefill = True
        if mix and decoding:  # decodes ride along as extends of one token behind the chunks
            reqs += decoding
            prefix += [len(r.slots) for r in decoding]
            ext += [1] * len(decoding)
            return "MIXED", reqs, prefix, ext
        return "EXTEND", reqs, prefix, ext

    def run_step(self, mode, reqs, prefix, ext):
        rt = self.rt
        seq = [p + n for p, n in zip(prefix, ext)]
        last = [r.slots[-1] if r.slots else -1 for r in reqs]
        loc = rt.alloc_decode(seq, last) if mode == "DECODE" else rt.alloc_extend(prefix, seq, last)
        ids, positions, last_rows, at = [], [], [], 0
        for r, p, n in zip(reqs, prefix, ext):
            new = loc[at:at + n]
            rt.write_req_to_token(r.row, p, new)  # the mapping is written before the forward
            r.slots += new
            ids += r.prompt[p:p + n] if not r.decoding else [r.output[-1]]
            positions += range(p, p + n)
            at += n
            last_rows.append(at - 1)
        batch = attnrt.ForwardBatch(
            forward_mode=mode, req_pool_indices=[r.row for r in reqs], seq_lens=seq,
            out_cache_loc=loc, positions=positions,
            extend_prefix_lens=None if mode == "DECODE" else prefix,
            extend_seq_lens=None if mode == "DECODE" else ext)
        self.stats.steps[mode] += 1
        self.stats.tokens[mode] += len(ids)
        if mode == "DECODE" and self.graphs is not None and self.graphs.fits(len(reqs)):
            next_tokens = self.graphs.run(batch, ids, positions)
            self.stats.graph_steps += 1
        else:
            if self.reference is not None:
                self.reference.begin(reqs, prefix, ext)
            next_tokens = self.eager(batch, mode, ids, positions, last_rows)
        for r, n, tok in zip(reqs, ext, next_tokens):
            if not r.decoding:
                r.prefilled += n
                if not r.decoding:
                    continue  # a chunk in the middle of the prompt: its sample is dropped
            r.output.append(tok)  # the prompt's last position samples the first output token
        for r in reqs:
            if len(r.output) >= r.output_len:
                self.finish(r)

    def eager(self, batch, mode, ids, positions, last_rows):
        dev = self.device
        ids_t = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        pos_t = torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True)
        rows_t = torch.tensor(last_rows, dtype=torch.long).to(dev, non_blocking=True)
        timed = mode == "DECODE"
        self.timer.reset()
        if timed and dev.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        if self.reference is not None:
            logits = self.model(ids_t, pos_t, rows_t, self.reference)
        else:
            self.rt.begin_step(batch)
            logits = self.model(ids_t, pos_t, rows_t, self.timer if timed else self.rt.forward)
            self.rt.end_step()
        if timed and dev.type == "cuda":
            stop.record()
        tokens = logits.argmax(-1).tolist()  # greedy sampling; waits for the step
        if timed:
            step_s = start.elapsed_time(stop) / 1e3 if dev.type == "cuda" else time.perf_counter() - t0
            self.stats.decode_step_s += step_s
            self.stats.decode_attn_s += self.timer.seconds()
            self.stats.eager_decode_steps += 1
        return tokens

    def serve(self, progress):
        while self.waiting or self.running:
            self.admit()
            planned = self.plan()
            if planned is None:
                if not self.running and self.waiting and self.waiting[0].arrival > self.step:
                    self.step = self.waiting[0].arrival  # idle until the next arrival
                    continue
                r = self.waiting[0]
                raise SystemExit(f"request {r.rid} needs {r.lifetime_slots(self.page)} KV slots "
                                 f"but the pool has {self.rt.available_slots}; raise "
                                 "--max-total-tokens")
            before = len(self.finished)
            self.run_step(*planned)
            self.step += 1
            progress(len(self.finished) - before)


# ---- CUDA graphs of whole decode steps -------------------------------------------------------
class CudaGraphs:
    """One torch.cuda.graph per batch-size bucket, captured at its first DECODE step: the model's
    GEMMs, RoPE, attnrt's attention of every layer and the greedy argmax. Replays read the static
    input tensors below; attnrt pads the batch to the bucket (padded rows write KV slot 0, their
    outputs are dropped).

    The attention share of a replayed step: every `share_every`-th replay is followed, in the same
    attnrt step, by the replay of a second graph of the bucket holding only attnrt's attention of
    every layer (save_kv=False: the cache is not touched), CUDA events around both."""

    def __init__(self, rt: attnrt.Runtime, model: Decoder, max_bs: int, share_every: int):
        self.rt, self.model = rt, model
        sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
        self.buckets = sorted({s for s in sizes if s < max_bs} | {max_bs})
        rt.init_cuda_graph_state(max_bs, max_bs)  # once, before any capture
        dev = rt.device
        self.ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.rows = torch.arange(max_bs, dtype=torch.long, device=dev)
        self.graphs, self.outputs = {}, {}
        self.pool = None
        # Attention alone (the share probe): static q / k / v / out per layer, random values.
        self.share_every = share_every
        self.attn_graphs = {}
        self.attn_off = None if share_every > 0 else "--share-every 0"
        self.replays = 0
        self.step_s, self.attn_s, self.sampled = 0.0, 0.0, 0
        gen = torch.Generator(device=dev).manual_seed(1)
        self.attn_io = {}
        for layer_id, l in rt.layers.items():
            shape = (l["num_q_heads"], l["head_dim"]), (l["num_kv_heads"], l["head_dim"]), \
                (l["num_kv_heads"], l["v_head_dim"]), (l["num_q_heads"], l["v_head_dim"])
            self.attn_io[layer_id] = [torch.randn(max_bs, *s, generator=gen, device=dev).to(rt.dtype)
                                      for s in shape]

    def fits(self, bs: int) -> bool:
        return bs <= self.buckets[-1]

    def _dummy_attend(self, layer_id, q, k, v):
        l = self.rt.layers[layer_id]
        return q.new_zeros(q.shape[0], l["num_q_heads"], l["v_head_dim"])

    def capture(self, bs: int, batch):
        # Warm-up on a side stream (torch's rule for capture): the model's kernels at this batch
        # size run once outside the graph, attention stubbed so the KV cache is not touched.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model(self.ids[:bs], self.positions[:bs], self.rows[:bs], self._dummy_attend)
        torch.cuda.current_stream().wait_stream(side)
        # The plan of a captured step runs before the capture (begin_capture_step), the layers'
        # kernels inside it; attnrt follows torch's capture stream at every forward.
        self.rt.begin_capture_step(batch, bs)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.pool):
                logits = self.model(self.ids[:bs], self.positions[:bs], self.rows[:bs],
                                    self.rt.forward)
                self.outputs[bs] = logits.argmax(-1)
        finally:
            self.rt.end_step()
        self.pool = g.pool()
        self.graphs[bs] = g
        if self.attn_off is None:
            self.capture_attention(bs, batch)

    def capture_attention(self, bs: int, batch):
        self.rt.begin_capture_step(batch, bs)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.pool):
                for layer_id, (q, k, v, o) in self.attn_io.items():
                    self.rt.forward(layer_id, q[:bs], k[:bs], v[:bs], o[:bs], save_kv=False)
            self.attn_graphs[bs] = g
        except Exception as e:  # noqa: BLE001 - the share is then reported as not measured
            self.attn_off = f"the attention-only graph failed to capture: {type(e).__name__}: {e}"
        finally:
            self.rt.end_step()

    def run(self, batch, ids, positions):
        n = len(ids)
        bs = next(b for b in self.buckets if b >= n)
        if bs not in self.graphs:
            self.capture(bs, batch)
        self.positions[n:bs].zero_()
        self.ids[:n].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        self.replays += 1
        probe = (self.attn_off is None and bs in self.attn_graphs
                 and self.replays % self.share_every == 0)
        self.rt.begin_replay_step(batch, bs)
        if probe:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
        self.graphs[bs].replay()
        if probe:
            ev[1].record()
            self.attn_graphs[bs].replay()  # the same padded batch, attention only, no KV store
            ev[2].record()
        self.rt.end_step()
        tokens = self.outputs[bs][:n].tolist()  # waits for the replay
        if probe:
            self.step_s += ev[0].elapsed_time(ev[1]) / 1e3
            self.attn_s += ev[1].elapsed_time(ev[2]) / 1e3
            self.sampled += 1
        return tokens


# ---- setup -----------------------------------------------------------------------------------
def model_config(preset: str, layers: int, hidden: int, max_context: int, dtype: str,
                 on_cpu: bool) -> dict:
    """A Llama-style config.json with the attention shapes of `preset` (heads, head_dim, the
    sliding window of its windowed layers), `layers` layers (the preset's pattern repeated);
    hidden 0 = q heads x head_dim, dtype "auto" = the preset's (float32 on the CPU)."""
    probe = attnrt.Runtime(preset, max_requests=1, kv_slots=64, max_context_len=64)
    spec = [probe.layers[i] for i in sorted(probe.layers)]
    if dtype == "auto":
        dtype = "float32" if on_cpu else str(probe.dtype).replace("torch.", "")
    probe.close()
    bad = [l for l in spec if l["kind"] not in ("full", "swa")]
    if bad:
        raise SystemExit(f"--model-preset {preset}: layer {bad[0]['layer_id']} is a "
                         f"{bad[0]['kind']} layer; this example's model has q / k / v attention "
                         "layers (presets: demo, llama3-8b, qwen2.5-7b, mistral-7b, gemma3-12b)")
    first = spec[0]
    picked = [spec[i % len(spec)] for i in range(layers or len(spec))]
    windows = {l["sliding_window"] for l in picked if l["kind"] == "swa"}
    cfg = {
        "model_type": "llama", "_name_or_path": f"{preset} (serve.py)",
        "num_hidden_layers": len(picked),
        "hidden_size": hidden or first["num_q_heads"] * first["head_dim"],
        "num_attention_heads": first["num_q_heads"], "num_key_value_heads": first["num_kv_heads"],
        "head_dim": first["head_dim"], "max_position_embeddings": max_context, "torch_dtype": dtype,
        "layer_types": ["sliding_attention" if l["kind"] == "swa" else "full_attention"
                        for l in picked],
    }
    if windows:
        cfg["sliding_window"] = max(windows) + 1  # attnrt's W counts the query out (§8.5)
    return cfg


def length_range(text: str):
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO:HI with 1 <= LO <= HI")
    return lo, hi


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Continuous batching of a synthetic request stream on a random-weight torch "
        "decoder whose attention is attnrt (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model-preset", default="demo",
                   help="attnrt preset giving the attention shapes: q / KV heads, head_dim, "
                   "sliding-window layers (demo, llama3-8b, qwen2.5-7b, mistral-7b, gemma3-12b)")
    m.add_argument("--layers", type=int, default=0,
                   help="decoder layers; 0 = the preset's count (its layer pattern repeats)")
    m.add_argument("--hidden", type=int, default=0,
                   help="hidden size of the residual stream (MLP: 2x); 0 = q heads x head_dim")
    m.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    m.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="activation and weight dtype; auto = the preset's on a GPU, float32 on "
                   "the CPU (torch's bf16 matmuls are slow on CPUs without bf16 instructions)")
    b = p.add_argument_group("attention")
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model and the KV cache live; auto = where the auto-selected "
                   "attention backend runs (cpu selects the cpu backend, cuda the cuda backend "
                   "unless --attention-backend says otherwise)")
    b.add_argument("--attention-backend", default=None,
                   help="attnrt backend for every phase (cpu, cuda, reference); unset: auto-select")
    b.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    b.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model's dtype), bf16, fp16, fp32, fp8_e4m3 or fp8_e5m2")
    b.add_argument("--cuda-graphs", action="store_true",
                   help="GPU: run each DECODE step as one CUDA-graph replay (model GEMMs and "
                   "attention), captured per batch-size bucket at its first step")
    s = p.add_argument_group("scheduler")
    s.add_argument("--requests", type=int, default=24, help="requests in the stream")
    s.add_argument("--prompt-len", type=length_range, default=(8, 160), metavar="LO:HI",
                   help="prompt lengths, uniform in [LO, HI]")
    s.add_argument("--output-len", type=length_range, default=(4, 32), metavar="LO:HI",
                   help="output lengths (generated tokens), uniform in [LO, HI]")
    s.add_argument("--arrival-rate", type=float, default=1.0,
                   help="mean arrivals per engine step (Poisson); 0 = all at once")
    s.add_argument("--max-running", type=int, default=16,
                   help="requests running at once (request rows; the largest decode batch)")
    s.add_argument("--max-total-tokens", type=int, default=8192,
                   help="KV slots of the pool: a request is admitted when its prompt + output fit "
                   "next to those of the running requests")
    s.add_argument("--chunked-prefill-size", type=int, default=128,
                   help="prefill tokens per step; longer prompts are prefilled in chunks (in MIXED "
                   "steps the decodes count against it)")
    s.add_argument("--no-mixed-chunk", action="store_true",
                   help="no MIXED steps: EXTEND and DECODE steps alternate instead")
    b.add_argument("--share-every", type=int, default=4,
                   help="with --cuda-graphs: every N-th replayed DECODE step also replays an "
                   "attention-only graph of its bucket, to measure attention's share of the step "
                   "(0: never)")
    p.add_argument("--check", action="store_true",
                   help="serve the same stream again with plain torch SDPA attention (dense K/V "
                   "per request, no attnrt) and require the same generated tokens, request by "
                   "request; exact in float32 (the CPU default), a bf16 near-tie may flip a token")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the request stream")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    for name in ("requests", "max_running", "chunked_prefill_size", "page_size", "max_total_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.layers < 0 or args.hidden < 0 or args.share_every < 0:
        p.error("--layers, --hidden and --share-every must be >= 0")
    return args


def make_progress(total: int, off: bool):
    if off:
        return lambda n: None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, unit="req", desc="serving", file=sys.stderr, dynamic_ncols=True)
        return bar.update, bar.close
    done = [0]

    def update(n):
        done[0] += n
        if n:
            print(f"\rserving: {done[0]}/{total} requests finished", end="", file=sys.stderr,
                  flush=True)

    return update, lambda: print(file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = args.attention_backend
    if backend is None and args.device != "auto":
        backend = args.device  # the cpu backend for --device cpu, cuda for --device cuda
    max_context = args.prompt_len[1] + args.output_len[1] + args.page_size
    on_gpu = args.device == "cuda" or (args.device == "auto" and backend in (None, "cuda")
                                       and attnrt.cuda_status()[0])
    cfg = model_config(args.model_preset, args.layers, args.hidden, max_context, args.dtype,
                       on_cpu=not on_gpu)
    hidden = cfg["hidden_size"]
    rt = attnrt.Runtime(
        cfg, attention_backend=backend, page_size=args.page_size,
        kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        max_requests=args.max_running, kv_slots=args.max_total_tokens,
        max_num_tokens=max(args.chunked_prefill_size, args.max_running),
        max_context_len=max_context)
    if args.device != "auto" and rt.device.type != args.device:
        raise SystemExit(f"--device {args.device}: the attention backend "
                         f"{rt.selection['decode']} keeps the KV cache on {rt.device}")
    if args.cuda_graphs:
        if rt.device.type != "cuda":
            raise SystemExit("--cuda-graphs: the KV cache is on the CPU; CUDA graphs need "
                             "--device cuda")
        if rt.cuda_graphs_off_reason:
            raise SystemExit(f"--cuda-graphs: {rt.cuda_graphs_off_reason}")
    print(rt)
    model = Decoder(rt.layers, hidden, args.vocab, max_context, args.seed).to(rt.device, rt.dtype)
    reqs = make_requests(args, args.vocab)
    print(f"model: {len(rt.layers)} layers, hidden {hidden}, {cfg['num_attention_heads']} q / "
          f"{cfg['num_key_value_heads']} KV heads x {cfg['head_dim']}, vocab {args.vocab}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {rt.dtype}")
    print(f"stream: {len(reqs)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
          f"outputs {args.output_len[0]}-{args.output_len[1]} tokens, arrivals over "
          f"{reqs[-1].arrival + 1} steps; {rt.available_slots} KV slots, "
          f"{args.max_running} running at most")

    slots_at_start = rt.available_slots
    server = Server(args, rt, model, reqs)
    update, close = make_progress(len(reqs), args.no_progress)
    t0 = time.perf_counter()
    server.serve(update)
    rt.synchronize()
    wall = time.perf_counter() - t0
    close()

    st = server.stats
    graphs = server.graphs
    probe_s = graphs.attn_s if graphs is not None else 0.0  # attention-only replays: not serving
    wall_serving = wall - probe_s
    generated = sum(len(r.output) for r in server.finished)
    expected = sum(r.output_len for r in reqs)
    processed = sum(st.tokens.values())
    steps = sum(st.steps.values())
    print(f"served {len(server.finished)} requests in {wall:.2f} s, {steps} steps"
          + (f" ({1e3 * probe_s:.1f} ms of attention-only probe replays left out of the rates)"
             if probe_s else ""))
    print(f"generated tokens: {generated} (sum of output lengths: {expected})")
    print(f"throughput: {generated / wall_serving:.1f} generated tokens/s, "
          f"{processed / wall_serving:.1f} processed tokens/s (prompt + decode)")
    for mode in ("EXTEND", "MIXED", "DECODE"):
        note = f" ({st.graph_steps} as CUDA-graph replays)" if mode == "DECODE" and args.cuda_graphs else ""
        print(f"  {mode:<7} steps {st.steps[mode]:5d}  tokens {st.tokens[mode]:7d}{note}")
    shares = []
    if st.eager_decode_steps and st.decode_step_s > 0:
        n = st.eager_decode_steps
        how = "CUDA events" if rt.device.type == "cuda" else "perf_counter"
        shares.append(f"{100 * st.decode_attn_s / st.decode_step_s:.1f}% of eager steps "
                      f"({1e3 * st.decode_attn_s / n:.3f} of {1e3 * st.decode_step_s / n:.3f} ms "
                      f"per step, {n} steps, {how} around each attention call and the step)")
    if graphs is not None and st.graph_steps:
        if graphs.sampled:
            k = graphs.sampled
            shares.append(f"{100 * graphs.attn_s / graphs.step_s:.1f}% of graph replays "
                          f"({1e3 * graphs.attn_s / k:.3f} of {1e3 * graphs.step_s / k:.3f} ms per "
                          f"step, {k} of {st.graph_steps} replays sampled: the step's graph, then "
                          "an attention-only graph of the bucket, CUDA events)")
        else:
            shares.append("graph replays not measured ("
                          + (graphs.attn_off or f"fewer than --share-every {args.share_every} "
                             "replays") + ")")
    for line in shares or ["no DECODE step ran"]:
        print(f"attention share of DECODE step time: {line}")
    leaked = rt.available_slots != slots_at_start or server.budget != slots_at_start
    print(f"KV slots: {rt.available_slots} of {slots_at_start} available again")
    ok = generated == expected and not server.running and not leaked

    if args.check:
        ok = check_against_torch(args, rt, model, reqs, server) and ok
    rt.close()
    return 0 if ok else 1


def check_against_torch(args, rt, model, reqs, server) -> bool:
    """Serves the same stream with torch attention and compares the generated tokens."""
    bad = [l for l in rt.layers.values() if l.get("logit_cap", 0) > 0]
    if bad:
        print(f"check: layer {bad[0]['layer_id']} has a logit soft-cap; the torch reference does "
              "not model it")
        return False
    fresh = make_requests(args, args.vocab)  # the same stream, no state
    ref = Server(args, rt, model, fresh, reference=TorchAttention(rt.layers))
    t0 = time.perf_counter()
    ref.serve(lambda n: None)
    got = {r.rid: r.output for r in server.finished}
    want = {r.rid: r.output for r in ref.finished}
    same = [rid for rid in want if got.get(rid) == want[rid]]
    print(f"check: {len(same)} of {len(want)} requests generated the same tokens as torch SDPA "
          f"attention ({sum(len(o) for o in want.values())} tokens; the reference took "
          f"{time.perf_counter() - t0:.2f} s)")
    for rid in sorted(set(want) - set(same))[:3]:
        a, b = got.get(rid, []), want[rid]
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"  request {rid}: first difference at output token {i}: attnrt {a[i:i + 4]} vs "
              f"torch {b[i:i + 4]}")
    return len(same) == len(want) == len(reqs)


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
