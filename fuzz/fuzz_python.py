"""Fuzz harness of the Python API's argument checks (docs/RELIABILITY.md "Fuzzing").

Each input is a short program run against fresh attnrt.Runtime objects on the CPU (inputs whose
first byte is 0xDC: an attnrt.DcpAttention group of simulated ranks, whose pools are not compared):
the bytes pick
a model (full attention with GQA, sliding window, MLA, DSA), its options, then up to 24 calls, each
either a step an engine would make (requests allocated, req_to_token written, a batch built and
every layer's forward called) with one field or tensor possibly spoiled, or a call with arguments
drawn wholesale: batch fields of the wrong length, sign, size or type, tensors of the wrong shape,
dtype, strides or kind, layer ids out of range, allocator calls on rows and slots it never gave.

What must hold, else the harness raises (a finding):
- a call succeeds or raises attnrt.Error, TypeError or ValueError (RuntimeError only after
  close()); anything else (IndexError, KeyError, AttributeError, OverflowError, SystemError, a
  crash) is a defect of the argument checks;
- a call that raises leaves req_to_token, every layer's KV pool and the free-slot count exactly as
  they were;
- an error's message is not empty.

Run with atheris (scripts/fuzz.sh python: coverage of the Python layer, the native module as it is
built) or replay inputs without it: `python fuzz/fuzz_python.py FILE...` (python/tests/
test_fuzz_corpus.py replays fuzz/corpus/python/ in the test suite)."""
import sys

import numpy as np
import torch

# Fuzzing (flags, no files): atheris traces the attnrt package's Python code for coverage.
FUZZING = __name__ == "__main__" and (len(sys.argv) == 1 or sys.argv[1].startswith("-"))
if FUZZING:
    import atheris

    with atheris.instrument_imports(include=["attnrt"]):
        import attnrt
else:
    import attnrt

ALLOWED = (attnrt.Error, TypeError, ValueError)
MODES = ("EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND")
WILD_INTS = (-1, 0, 1, 2, 3, 7, 63, 64, 255, 4095, 2**31 - 1, 2**31, -2**31, 2**32, 2**63 - 1,
             -2**63, 2**64, -10**30)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.float8_e4m3fn)


class Bytes:
    """The input as a stream of decisions; past its end every decision is 0."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            return 0
        self.at += 1
        return self.data[self.at - 1]

    @property
    def done(self) -> bool:
        return self.at >= len(self.data)

    def below(self, n: int) -> int:
        """0 .. n - 1."""
        if n <= 256:
            return self.byte() % n
        return (self.byte() << 8 | self.byte()) % n

    def pick(self, seq):
        return seq[self.below(len(seq))]

    def chance(self, per256: int) -> bool:
        return self.byte() < per256

    def wild_int(self) -> int:
        return self.pick(WILD_INTS) if self.chance(128) else self.below(4096) - 64


# ---- models ----------------------------------------------------------------------------------
def llama(b: Bytes) -> dict:
    heads = b.pick((1, 2, 4, 8))
    kv = b.pick([h for h in (1, 2, 4, 8) if heads % h == 0])
    cfg = {"model_type": "llama", "num_hidden_layers": 1 + b.below(2), "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": b.pick((16, 32, 64, 128)),
           "max_position_embeddings": 4096, "torch_dtype": b.pick(("float32", "bfloat16", "float16"))}
    cfg["hidden_size"] = heads * cfg["head_dim"]
    if b.chance(64):
        cfg["model_type"] = "mistral"
        cfg["sliding_window"] = b.pick((1, 4, 16, 100))
    return cfg


def mla(b: Bytes) -> dict:
    cfg = {"model_type": "deepseek_v2", "num_hidden_layers": 1, "num_attention_heads": b.pick((1, 4)),
           "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 24,
           "rope_scaling": None, "max_position_embeddings": 1024, "torch_dtype": "float32"}
    if b.chance(128):
        cfg.update(model_type="deepseek_v32", index_topk=b.pick((4, 8, 64)), index_n_heads=4,
                   index_head_dim=32)
    return cfg


def model_and_options(b: Bytes):
    cfg = mla(b) if b.chance(64) else llama(b)
    opts = {"attention_backend": b.pick(("cpu", "reference")), "page_size": b.pick((1, 2, 16)),
            "max_requests": 1 + b.below(4), "kv_slots": b.pick((16, 64, 256)), "max_num_tokens": 64}
    if b.chance(48):
        opts["kv_cache_dtype"] = b.pick(("fp8_e4m3", "fp8_e5m2", "bf16", "auto"))
    if b.chance(24):  # one option spoiled: unknown name, wrong type, out of range
        key = b.pick(list(opts) + ["bogus_option", "speculative_num_draft_tokens", "num_threads"])
        opts[key] = b.pick((None, -1, 0, 2**40, "x", 1.5, True, [1], "cpu"))
    return cfg, opts


def make_runtime(b: Bytes):
    cfg, opts = model_and_options(b)
    return attnrt.Runtime(cfg, **opts)


# ---- what must not change when a call fails --------------------------------------------------
def snapshot(rt):
    state = [rt.req_to_token.clone(), rt.available_slots]
    for layer in rt.layers:
        k, v, _, _ = rt.kv_buffers(layer)
        state += [k.clone(), v.clone()]
    return state


def same(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                return False
        elif x != y:
            return False
    return True


class Finding(AssertionError):
    pass


def call(h, what, fn, *args, **kwargs):
    """fn(*args) under the rules above; returns (ok, result)."""
    before = h.snapshot() if not h.closed else None
    try:
        return True, fn(*args, **kwargs)
    except ALLOWED as e:
        if not str(e).strip():
            raise Finding(f"{what}: {type(e).__name__} with an empty message") from e
        if before is not None and not h.closed and not same(before, h.snapshot()):
            raise Finding(f"{what}: raised {type(e).__name__}({e}) and changed the pools") from e
        return False, None
    except RuntimeError as e:
        if h.closed:
            return False, None
        raise Finding(f"{what}: RuntimeError on an open runtime: {e}") from e


# ---- values --------------------------------------------------------------------------------
def wrap64(xs):
    return [x % 2**64 - (x % 2**64 >= 2**63) * 2**64 for x in xs]


def spoil_ints(b: Bytes, xs: list):
    """A batch field as an engine might get it wrong: one element off, a length off, another type."""
    xs = list(xs)
    k = b.below(10)
    if k == 0 and xs:
        xs[b.below(len(xs))] = b.wild_int()
    elif k == 1:
        xs.append(b.wild_int())
    elif k == 2 and xs:
        xs.pop()
    elif k == 3:
        return None
    elif k == 4:  # values that do not fit the type wrap around, as an engine's cast would
        dtype = b.pick((np.int32, np.int64, np.float32, np.uint8, np.int16))
        return np.asarray(wrap64(xs)).astype(dtype)
    elif k == 5:
        dtype = b.pick((torch.int32, torch.int64, torch.float32, torch.int16))
        return torch.tensor(wrap64(xs)).to(dtype)
    elif k == 6:
        return b.pick(("1,2", 3, 2.5, [[1, 2]], [None], {"a": 1}, [1.5], [float("nan")], b"\x01"))
    elif k == 7 and xs:
        t = torch.tensor(wrap64(xs), dtype=torch.int64)
        return t.reshape(1, -1) if b.chance(128) else t.flip(0)[::1]
    return xs


def tensor(b: Bytes, shape, dtype):
    """A tensor of `shape` / `dtype` filled with fresh values, or, now and then, the wrong one."""
    shape = list(shape)
    k = b.below(24)
    if k == 0 and shape:
        shape[b.below(len(shape))] += b.pick((-1, 1, 7))
    elif k == 1:
        shape = shape[:-1] if len(shape) > 1 and b.chance(128) else shape + [1]
    elif k == 2 and len(shape) == 3:
        shape = [shape[0], shape[1] * shape[2]]
    elif k == 3:
        dtype = b.pick(DTYPES)
    elif k == 4:
        return b.pick((None, 3, [1.0, 2.0], "q", np.zeros(3, np.float32)))
    shape = [max(s, 0) for s in shape]
    if dtype.is_floating_point and dtype.itemsize > 1:
        t = torch.randn(shape, dtype=torch.float32).to(dtype)
    else:
        t = torch.randint(0, 8, shape, dtype=torch.int32).to(dtype)
    if k == 5 and t.dim() >= 2 and t.shape[0] > 1:
        t = t.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, rows not contiguous
    elif k == 6 and t.dim() >= 1 and t.shape[-1] > 1:
        t = torch.cat([t, t], -1)[..., ::2]  # last dim of stride 2
    elif k == 7 and t.dim() >= 1 and t.numel() > 0:
        t = t[..., :1].expand(t.shape)  # stride 0
    elif k == 8 and t.is_floating_point():
        t.requires_grad_(True)
    elif k == 9 and t.is_floating_point() and t.numel():
        t.view(-1)[b.below(t.numel())] = b.pick((float("nan"), float("inf"), -float("inf"), 1e30))
    elif k == 10:
        t = t.reshape(()) if t.numel() == 1 else t[..., 0] if t.dim() else t
    return t


def qkv(b: Bytes, info: dict, tokens: int, dt):
    """q, k, v of a layer's call (MLA: v now and then the latent part of k, as engines pass it)."""
    hq, hkv, d, dv = info["num_q_heads"], info["num_kv_heads"], info["head_dim"], info["v_head_dim"]
    q = tensor(b, (tokens, hq, d), dt)
    k = tensor(b, (tokens, hkv, d), dt)
    v = tensor(b, (tokens, hkv, dv), dt)
    if info["kv_lora_rank"] and isinstance(k, torch.Tensor) and k.dim() == 3 and b.chance(200):
        v = k[:, :, :info["kv_lora_rank"]]
    return q, k, v


# ---- the engine side: requests, slots, batches ----------------------------------------------
class Program:
    """Up to 24 calls: mostly steps, some wild calls, now and then close() and a call after it."""

    def run(self):
        for _ in range(24):
            if self.b.done:
                break
            k = self.b.below(16)
            if k < 10:
                self.step()
            elif k < 15:
                self.wild()
            else:
                self.target().close()
                self.closed = True
                call(self, "begin_step after close", self.target().begin_step,
                     attnrt.ForwardBatch("IDLE", [], [], []))
                return


class Harness(Program):
    def __init__(self, b: Bytes):
        self.b = b
        self.rt = make_runtime(b)
        self.closed = False
        self.rows = {}  # row -> committed slots

    def snapshot(self):
        return snapshot(self.rt)

    def add_request(self):
        ok, row = call(self, "alloc_request", self.rt.alloc_request)
        if ok:
            self.rows[row] = []

    def batch(self):
        """A step an engine would build (or None when none can be), spoiled now and then."""
        b, rt = self.b, self.rt
        mode = b.pick(MODES)
        rows = [r for r in self.rows if b.chance(192)] or list(self.rows)[:1]
        if mode == "IDLE" or not rows:
            return attnrt.ForwardBatch("IDLE", [], [], [])
        if mode != "EXTEND" and mode != "MIXED" and not all(self.rows[r] for r in rows):
            mode = "EXTEND"
        spec = None
        if mode in ("EXTEND", "MIXED", "DRAFT_EXTEND"):
            lens = [1 + b.below(6) for _ in rows]
            if mode == "MIXED":
                lens = [1 if self.rows[r] and b.chance(128) else n for r, n in zip(rows, lens)]
            if mode == "DRAFT_EXTEND":
                acc = [n - 1 for n in lens]
                spec = attnrt.SpecInfo(draft_token_num=max(lens), accept_length=acc)
            prefix = [len(self.rows[r]) for r in rows]
            seq = [p + n for p, n in zip(prefix, lens)]
            last = [self.rows[r][-1] if self.rows[r] else -1 for r in rows]
            ok, loc = call(self, "alloc_extend", rt.alloc_extend, prefix, seq, last)
            if not ok:
                return None
            loc, at = list(loc), 0
            for r, p, n in zip(rows, prefix, lens):
                call(self, "write_req_to_token", rt.write_req_to_token, r, p, loc[at:at + n])
                self.rows[r] = self.rows[r] + loc[at:at + n]
                at += n
            fb = attnrt.ForwardBatch(mode, rows, seq, loc, extend_prefix_lens=prefix,
                                     extend_seq_lens=lens,
                                     positions=[p + t for p, n in zip(prefix, lens) for t in range(n)],
                                     spec_info=spec)
        elif mode == "DECODE":
            seq = [len(self.rows[r]) + 1 for r in rows]
            ok, loc = call(self, "alloc_decode", rt.alloc_decode, seq, [self.rows[r][-1] for r in rows])
            if not ok:
                return None
            loc = list(loc)
            for r, s, l in zip(rows, seq, loc):
                call(self, "write_req_to_token", rt.write_req_to_token, r, s - 1, [l])
                self.rows[r] = self.rows[r] + [l]
            fb = attnrt.ForwardBatch("DECODE", rows, seq, loc, positions=[s - 1 for s in seq])
        else:  # TARGET_VERIFY, chain or tree; nothing committed
            n = 1 + b.below(4)
            topk = 1 if n == 1 or b.chance(160) else 2
            parents = None
            if topk > 1:
                parents = [(-1 if t == 0 else b.below(t)) for _ in rows for t in range(n)]
            seq = [len(self.rows[r]) for r in rows]
            ok, loc = call(self, "alloc_extend", rt.alloc_extend, seq, [s + n for s in seq],
                           [self.rows[r][-1] for r in rows])
            if not ok:
                return None
            loc = list(loc)
            for i, r in enumerate(rows):
                call(self, "write_req_to_token", rt.write_req_to_token, r, seq[i], loc[i * n:(i + 1) * n])
            spec = attnrt.SpecInfo(draft_token_num=n, topk=topk, parents=parents)
            fb = attnrt.ForwardBatch("TARGET_VERIFY", rows, seq, loc, spec_info=spec,
                                     positions=[s + t for s in seq for t in range(n)])
        if b.chance(64):  # one field spoiled
            name = b.pick(("req_pool_indices", "seq_lens", "out_cache_loc", "extend_prefix_lens",
                           "extend_seq_lens", "positions"))
            setattr(fb, name, spoil_ints(b, getattr(fb, name) or []))
        if b.chance(16):
            fb.forward_mode = b.pick(("extend", "VERIFY", 9, -1, None, 2.0, "TARGET_VERIFY", "IDLE"))
        if spec is not None and b.chance(48):
            field = b.pick(("draft_token_num", "topk", "parents", "accept_length"))
            value = getattr(spec, field)
            setattr(spec, field, spoil_ints(b, value) if isinstance(value, list) else b.wild_int())
        return fb

    def forward_layers(self, tokens: int):
        b, rt = self.b, self.rt
        for layer, info in rt.layers.items():
            dt = rt.dtype
            hq, dv = info["num_q_heads"], info["v_head_dim"]
            q, k, v = qkv(b, info, tokens, dt)
            kw = {}
            if info["index_topk"]:
                kw = dict(index_q=tensor(b, (tokens, info["index_n_heads"], info["index_head_dim"]), dt),
                          index_k=tensor(b, (tokens, info["index_head_dim"]), dt),
                          index_weights=tensor(b, (tokens, info["index_n_heads"]), dt))
                if b.chance(96):
                    kw["index_topk"] = tensor(b, (tokens, info["index_topk"]), torch.int32)
            out = tensor(b, (tokens, hq, dv), dt) if b.chance(128) else None
            lid = layer if b.chance(240) else b.wild_int()
            call(self, "forward", rt.forward, lid, q, k, v, out, save_kv=b.chance(224), **kw)

    def step(self):
        if not self.rows or self.b.chance(40):
            self.add_request()
        fb = self.batch()
        if fb is None:
            return
        ok, _ = call(self, "begin_step", self.rt.begin_step, fb)
        tokens = len(fb.out_cache_loc) if isinstance(fb.out_cache_loc, list) else 1
        if fb.forward_mode == "IDLE":
            tokens = 0
        if ok or self.b.chance(32):  # a forward without a step begun must fail cleanly too
            self.forward_layers(tokens)
        if self.b.chance(240):
            call(self, "end_step", self.rt.end_step)

    def wild(self):
        """One call with arguments drawn wholesale."""
        b, rt = self.b, self.rt
        k = b.below(9)
        if k == 0:
            call(self, "free_request", rt.free_request, b.wild_int())
        elif k == 1:
            call(self, "write_req_to_token", rt.write_req_to_token, b.wild_int(), b.wild_int(),
                 spoil_ints(b, [b.wild_int() for _ in range(b.below(4))]))
        elif k == 2:
            call(self, "alloc_extend", rt.alloc_extend, spoil_ints(b, [0]), spoil_ints(b, [b.wild_int()]),
                 spoil_ints(b, [-1]))
        elif k == 3:
            call(self, "free_slots", rt.free_slots, spoil_ints(b, [b.wild_int() for _ in range(b.below(3))]))
        elif k == 4:
            fb = attnrt.ForwardBatch(b.pick(MODES), *(spoil_ints(b, [b.wild_int()]) for _ in range(3)),
                                     extend_prefix_lens=spoil_ints(b, [0]),
                                     extend_seq_lens=spoil_ints(b, [1]))
            call(self, "begin_step", rt.begin_step, fb)
        elif k == 5:
            call(self, "update_state_after_verify", rt.update_state_after_verify,
                 spoil_ints(b, [b.wild_int()]))
        elif k == 6:
            call(self, "kv_buffers", rt.kv_buffers, b.wild_int())
        elif k == 7:
            call(self, "set_kv_scales", rt.set_kv_scales, b.wild_int(),
                 b.pick((1.0, 0.0, -1.0, float("nan"), float("inf"), 1e-30)), 1.0)
        else:
            call(self, "end_step", rt.end_step)

    def target(self):
        return self.rt


# ---- decode context parallelism: attnrt.DcpAttention ----------------------------------------
class DcpHarness(Program):
    """The same kind of program against a simulated DCP group (docs/dcp.md): the group keeps its
    pools to itself, so only the exception rules are checked, not the pools."""

    def __init__(self, b: Bytes):
        self.b = b
        cfg, opts = model_and_options(b)
        size = b.pick((1, 2, 3, 4)) if b.chance(232) else b.wild_int()
        self.g = attnrt.DcpAttention(cfg, dcp_size=size, **opts)
        self.closed = False
        self.max_rows = opts.get("max_requests") if isinstance(opts.get("max_requests"), int) else 1
        self.lens = {}  # row -> tokens stored

    def snapshot(self):
        return None

    def batch(self):
        b = self.b
        rows = sorted({b.below(max(self.max_rows, 1)) for _ in range(1 + b.below(3))})
        mode = b.pick(("EXTEND", "DECODE", "TARGET_VERIFY", "MIXED", "IDLE"))
        if mode == "IDLE":
            return attnrt.ForwardBatch("IDLE", [], [], []), []
        prefix = [self.lens.get(r, 0) for r in rows]
        if mode != "EXTEND" and not all(prefix):
            mode = "EXTEND"
        spec = None
        if mode in ("EXTEND", "MIXED"):
            lens = [1 + b.below(6) for _ in rows]
            fb = attnrt.ForwardBatch(mode, rows, [p + n for p, n in zip(prefix, lens)],
                                     [0] * sum(lens), extend_prefix_lens=prefix,
                                     extend_seq_lens=lens,
                                     positions=[p + t for p, n in zip(prefix, lens) for t in range(n)])
            keep = lens
        elif mode == "DECODE":
            fb = attnrt.ForwardBatch("DECODE", rows, [p + 1 for p in prefix], [0] * len(rows),
                                     positions=prefix)
            keep = [1] * len(rows)
        else:
            n = 1 + b.below(4)
            topk = 1 if n == 1 or b.chance(128) else 2
            parents = [(-1 if t == 0 else b.below(t)) for _ in rows for t in range(n)] if topk > 1 else None
            spec = attnrt.SpecInfo(draft_token_num=n, topk=topk, parents=parents)
            fb = attnrt.ForwardBatch("TARGET_VERIFY", rows, prefix, [0] * (n * len(rows)),
                                     spec_info=spec, positions=[p + t for p in prefix for t in range(n)])
            keep = None
        if b.chance(64):
            name = b.pick(("req_pool_indices", "seq_lens", "out_cache_loc", "extend_prefix_lens",
                           "extend_seq_lens", "positions"))
            setattr(fb, name, spoil_ints(b, getattr(fb, name) or []))
        return fb, keep

    def forward_layers(self, tokens: int):
        b, g = self.b, self.g
        for layer, info in g.layers.items():
            dt = g.dtype
            hq, dv = info["num_q_heads"], info["v_head_dim"]
            q, k, v = qkv(b, info, tokens, dt)
            out = tensor(b, (tokens, hq, dv), dt) if b.chance(128) else None
            lse = tensor(b, (tokens, hq), torch.float32) if b.chance(32) else None
            lid = layer if b.chance(240) else b.wild_int()
            call(self, "dcp forward", g.forward, lid, q, k, v, out, save_kv=b.chance(224), lse=lse)

    def step(self):
        b, g = self.b, self.g
        fb, keep = self.batch()
        ok, _ = call(self, "dcp begin_step", g.begin_step, fb)
        tokens = len(fb.out_cache_loc) if isinstance(fb.out_cache_loc, list) else 1
        if ok or b.chance(32):
            self.forward_layers(tokens if fb.forward_mode != "IDLE" else 0)
        if b.chance(240):
            call(self, "dcp end_step", g.end_step)
        if not ok:
            return
        rows = list(fb.req_pool_indices)
        if keep is not None:
            for r, n in zip(rows, keep):
                self.lens[r] = self.lens.get(r, 0) + n
            return
        spec = fb.spec_info
        n = spec.draft_token_num
        paths = []
        for i, r in enumerate(rows):
            path = [0]
            while spec.topk > 1 and b.chance(160):
                kids = [t for t in range(1, n) if spec.parents[i * n + t] == path[-1]]
                if not kids:
                    break
                path.append(b.pick(kids))
            if spec.topk == 1:
                path = list(range(1 + b.below(n)))
            paths.append(path)
        if b.chance(32):
            paths = b.pick(([[0]], [[1, 0]], [[0, n]], "x", [[]], [[0]] * (len(rows) + 1), None))
        if spec.topk > 1 or b.chance(16):
            ok, _ = call(self, "dcp commit_verify", g.commit_verify, paths)
        if ok and isinstance(paths, list):
            for r, p in zip(rows, paths):
                self.lens[r] = self.lens.get(r, 0) + len(p)

    def wild(self):
        b, g = self.b, self.g
        k = b.below(6)
        if k == 0:
            row = b.wild_int()
            ok, _ = call(self, "dcp free_request", g.free_request, row)
            if ok:
                self.lens.pop(row, None)
        elif k == 1:
            row, n = b.wild_int(), b.wild_int()
            ok, _ = call(self, "dcp reserve_prefix", g.reserve_prefix, row, n)
            if ok:
                self.lens[row] = max(self.lens.get(row, 0), n)
        elif k == 2:
            call(self, "dcp commit_verify", g.commit_verify,
                 b.pick(([[0]], [[b.wild_int()]], [], "x", None, [[0, 1]])))
        elif k == 3:
            call(self, "dcp set_kv_scales", g.set_kv_scales, b.wild_int(),
                 b.pick((1.0, 0.0, -1.0, float("nan"), 1e-30)), 1.0)
        elif k == 4:
            fb = attnrt.ForwardBatch(b.pick(MODES), *(spoil_ints(b, [b.wild_int()]) for _ in range(3)),
                                     extend_prefix_lens=spoil_ints(b, [0]),
                                     extend_seq_lens=spoil_ints(b, [1]))
            call(self, "dcp begin_step", g.begin_step, fb)
        else:
            call(self, "dcp end_step", g.end_step)

    def target(self):
        return self.g


def TestOneInput(data: bytes) -> None:
    b = Bytes(data)
    # Inputs starting with 0xDC run against a DCP group (the seeds before it keep their meaning).
    dcp = len(data) > 0 and data[0] == 0xDC
    if dcp:
        b.byte()
    try:
        h = DcpHarness(b) if dcp else Harness(b)
    except ALLOWED as e:  # options refused: fine, with a message
        if not str(e).strip():
            raise Finding(f"{'DcpAttention' if dcp else 'Runtime'}: {type(e).__name__} with an "
                          "empty message") from e
        return
    with torch.no_grad() if b.chance(200) else _null():
        h.run()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _instrument_this_module():
    """Coverage of the harness's own decisions too, so that the fuzzer sees which calls and
    spoilings an input reached."""
    import inspect

    for name, obj in list(globals().items()):
        if inspect.isfunction(obj) and obj.__module__ == __name__ and name != "main":
            globals()[name] = atheris.instrument_func(obj)
        elif inspect.isclass(obj) and obj.__module__ == __name__:
            for key, value in list(vars(obj).items()):
                if inspect.isfunction(value):
                    setattr(obj, key, atheris.instrument_func(value))


def main(argv):
    if not FUZZING:
        for path in argv[1:]:  # replay files without atheris
            with open(path, "rb") as f:
                TestOneInput(f.read())
            print(f"{path}: ok")
        return
    _instrument_this_module()
    atheris.Setup(argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv)
