"""attnrt inside transformers: every attention layer of a transformers model on attnrt's paged KV cache
and kernels.

    import attnrt.hf                                   # registers attn_implementation="attnrt"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnrt")
    cache = attnrt.hf.AttnrtCache(model, page_size=16, attention_backend="cuda")
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32)
                                                       # transformers >= 5.x: cache=cache
    cache.close()                                      # or let it go: rows, slots and pools are freed

or in one call: `attnrt.hf.generate(model, input_ids, attention_mask, max_new_tokens, **options)`.

The cache holds an attnrt.Runtime built from the model's own config (options: attnrt.Runtime's).
Its update() keeps nothing: the attention function hands q / k / v to `Runtime.forward`, which stores
k / v in attnrt's pools and attends. Each forward of the model is one attnrt step: the first layer
plans it from the padding mask (transformers' 2D mask of the step's tokens; no 4D mask is built),

    prefill (left padding)  EXTEND of the real tokens only (ragged rows); pad rows of the output are 0
    one new token per row   DECODE
    inside cache.verify()   TARGET_VERIFY of a chain of N tokens per row (all N are kept)

request rows and KV slots come from the runtime's allocator (alloc_request, alloc_extend /
alloc_decode, write_req_to_token) and go back on reset(), crop() and close(). Layer i of the model is
attnrt's layer_id i. Hybrid models: the Gated DeltaNet modules of the model run their conv and
recurrence in `Runtime.forward_linear` when called with an AttnrtCache (the state lives in attnrt).
MLA models (DeepSeek-V2/V3): transformers hands the cache the latent (kv_a_layernorm(c_kv) and the
roped shared key); attnrt stores it as one row per token and attends in the absorbed form (the
query's no-rope part through kv_b_proj's key half, the output through its value half).

Each layer is checked once against the layer attnrt loaded (scaling, sliding window, soft-cap,
sinks, heads): a disagreement raises ValueError naming the layer and both values.
"""
from __future__ import annotations

import inspect
import math
import threading
import types
import weakref
from contextlib import contextmanager
from typing import Any, Optional

import torch
import transformers

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:  # the layered Cache came with transformers 4.56
    raise ImportError(f"attnrt.hf needs transformers >= 4.56; this is {transformers.__version__}") \
        from e

from .runtime import ForwardBatch, Runtime, SpecInfo

NAME = "attnrt"

# The cache whose update() ran last on this thread, with the key tensor it returned: the attention
# function that follows in the same layer finds its cache here (transformers does not pass the cache
# to attention functions).
_last_update = threading.local()


# ---- the attention function and the mask entry -----------------------------------------------

def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, s_aux=None, **kwargs):
    """transformers' attention-function signature (see integrations/sdpa_attention.py): query
    [B, Hq, S, D], key / value [B, Hkv, S, D] (this step's tokens only), attention_mask: what
    `query_padding_mask` returned. Returns ([B, S, Hq, Dv], None)."""
    cache = getattr(_last_update, "cache", None)
    # MLA modules (DeepSeek-V2/V3, Kimi) cache the latent and hand this function the K / V
    # expanded from it, so for them the cache recognises the layer instead of the tensor.
    latent = hasattr(module, "kv_b_proj")
    if cache is None or (getattr(_last_update, "layer", None) != module.layer_idx if latent
                         else getattr(_last_update, "key", None) is not key):
        raise ValueError(
            f"attn_implementation={NAME!r} (layer {getattr(module, 'layer_idx', '?')}): the model "
            "was called without an attnrt.hf.AttnrtCache; pass past_key_values=AttnrtCache(model) "
            "(attnrt keeps the KV cache, so use_cache must stay on)")
    stored = (_last_update.key, _last_update.value)  # MLA: the latent update() received
    _last_update.cache = _last_update.key = _last_update.value = _last_update.layer = None
    if dropout and module.training:
        raise ValueError(f"attn_implementation={NAME!r}: dropout {dropout} in training mode; attnrt "
                         "serves inference (call model.eval())")
    return cache._attend(module, query, key, value, attention_mask, scaling, sliding_window,
                         softcap, s_aux, stored if latent else None)


def query_padding_mask(*args, attention_mask=None, q_length=None, cache_position=None, **kwargs):
    """transformers' mask-interface entry: instead of a 4D mask, the 2D mask of this step's query
    tokens ([B, S] bool, True = real token), or None when every token is real."""
    if attention_mask is None:
        return None
    if q_length is None:  # transformers < 5 passes cache_position instead of q_length
        q_length = cache_position.shape[0]
    mask = attention_mask[:, -q_length:]
    if mask.shape[1] != q_length:
        raise ValueError(f"attnrt: the attention mask has {mask.shape[1]} columns for a step of "
                         f"{q_length} tokens")
    return None if bool(mask.all()) else mask


def register() -> None:
    """Registers attn_implementation="attnrt" with transformers (done at import)."""
    transformers.AttentionInterface.register(NAME, attention_forward)
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(NAME, query_padding_mask)


register()


# ---- the cache -------------------------------------------------------------------------------

class _Layer(CacheLayerMixin):
    """One model layer's view of the cache: no tensors of its own."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "AttnrtCache"):
        super().__init__()
        self._cache = weakref.ref(cache)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, *args) -> int:
        return self._cache()._seen

    def get_mask_sizes(self, *args) -> tuple[int, int]:
        query_length = args[-1]
        if isinstance(query_length, torch.Tensor):  # transformers < 5: cache_position
            query_length = query_length.shape[0]
        return self._cache()._seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        pass


class _Step:
    """The step being run: which (row, token) pairs are real, and the layers already through it."""

    __slots__ = ("batch", "tokens", "index", "done", "expected", "accepted")

    def __init__(self, batch: int, tokens: int, index, expected: int, accepted=None):
        self.batch, self.tokens, self.index, self.expected = batch, tokens, index, expected
        self.accepted = accepted  # verify steps of hybrid models: the block token each row keeps
        self.done: set[int] = set()


class AttnrtCache(Cache):
    """transformers' Cache over an attnrt.Runtime (see the module docstring).

    model: the transformers model (its `config` builds the runtime; its dtype is the activation
        dtype unless `dtype` is given). runtime: an existing attnrt.Runtime instead (the cache then
        does not close it). Other keyword arguments: attnrt.Runtime's options and sizes
        (attention_backend, page_size, kv_cache_dtype, max_requests, kv_slots, ...).
    """

    def __init__(self, model, *, runtime: Optional[Runtime] = None, dtype=None, **runtime_options):
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if runtime is None:
            runtime = Runtime(config, dtype=dtype or model.dtype, **runtime_options)
            self._owns_runtime = True
        elif runtime_options or dtype is not None:
            raise TypeError("AttnrtCache: pass either runtime= or runtime options, not both")
        else:
            self._owns_runtime = False
        self.runtime = runtime
        num_layers = text.num_hidden_layers
        missing = [i for i in range(num_layers) if i not in runtime.layers]
        if missing:
            raise ValueError(
                f"AttnrtCache: the model has {num_layers} layers; attnrt's runtime has no layer "
                f"{missing[0]} (it has {len(runtime.layers)})")
        super().__init__(layers=[_Layer(self) for _ in range(num_layers)])
        self._rows: list[Optional[int]] = []  # request row of each batch row
        self._slots: list[list[int]] = []  # KV slots of each batch row's tokens
        self._seen = 0  # columns (pad included) of every forward so far
        self._step: Optional[_Step] = None
        self._in_step = False
        self._verify = 0  # tokens per row of the next step when it is a verify step
        self._checked: set[int] = set()
        self._linear = {i for i, l in runtime.layers.items() if i < num_layers
                        and not l.get("uses_kv_cache", True)}
        if self._linear:
            _route_linear_modules(model, self)
        self._layers_per_step = num_layers

    # ---- transformers' Cache interface -------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Keeps nothing: K/V go to attnrt's pools in the attention function that follows (MLA
        modules pass the latent here: kv_nope [B, 1, S, kv_lora_rank] and k_rot [B, 1, S, rope])."""
        _last_update.cache = self
        _last_update.key, _last_update.value = key_states, value_states
        _last_update.layer = layer_idx
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0, *args) -> int:
        return self._seen

    def get_mask_sizes(self, query_length, layer_idx: int = 0, *args) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        return self._seen > 0

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        """Frees every request row and KV slot; the next forward starts new requests."""
        rt = self.runtime
        if rt.closed:
            self._rows, self._slots = [], []
            return
        self._end_step()
        for row, slots in zip(self._rows, self._slots):
            if slots:
                rt.free_slots(slots)
            if row is not None:
                if self._linear:
                    rt.free_linear_state(row)
                rt.free_request(row)
        self._rows, self._slots, self._seen = [], [], 0

    def crop(self, n: int) -> None:
        """n < 0: drops the last -n tokens of every row; n >= 0: keeps the first n columns (the
        convention of transformers < 5). Pages left without a token go back to the allocator."""
        keep = self._seen + n if n < 0 else n
        if keep >= self._seen:
            return
        if self._linear:
            raise ValueError("AttnrtCache.crop: a hybrid model's linear state cannot be rolled back")
        self._end_step()
        drop = self._seen - keep
        page = self.runtime.page_size
        freed = []
        for b, slots in enumerate(self._slots):
            cut = max(len(slots) - drop, 0)
            kept_pages = {s // page for s in slots[:cut]}
            freed += [s for s in slots[cut:] if s // page not in kept_pages]
            self._slots[b] = slots[:cut]
        if freed:
            self.runtime.free_slots(freed)
        self._seen = keep

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("AttnrtCache: beam search is not supported (rows would share KV)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("AttnrtCache: beam search / num_return_sequences > 1 are not "
                                  "supported")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("AttnrtCache: selecting batch rows is not supported")

    # ---- attnrt's side -----------------------------------------------------------------------
    @contextmanager
    def verify(self, num_tokens: int):
        """The next forward inside the block is a TARGET_VERIFY chain step: every row brings
        `num_tokens` tokens (the root and its drafts, all real), attending to its cached prefix and
        causally to each other (reference-semantics §8.4). All tokens stay in the cache; crop()
        drops rejected ones."""
        if num_tokens < 1:
            raise ValueError(f"AttnrtCache.verify: num_tokens is {num_tokens}; it must be >= 1")
        self._end_step()
        self._verify = int(num_tokens)
        try:
            yield self
        finally:
            self._verify = 0

    def close(self) -> None:
        """Frees the rows and slots; closes the runtime when the cache created it."""
        self.reset()
        if self._owns_runtime and not self.runtime.closed:
            self.runtime.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the native module may be gone already
            pass

    def __repr__(self) -> str:
        return f"AttnrtCache(rows={len(self._rows)}, seen={self._seen}, runtime={self.runtime!r})"

    def _end_step(self) -> None:
        if self._in_step:
            self.runtime.end_step()
            self._in_step = False
            if self._step is not None and self._step.accepted is not None:
                self.runtime.update_state_after_verify(self._step.accepted)
        self._step = None

    def _step_for(self, layer_id: int, mask, batch: int, tokens: int, device) -> _Step:
        """The step this layer belongs to: the current one, or a new one when the layer has
        already run in it (the model's next forward)."""
        step = self._step
        if step is None or layer_id in step.done:
            step = self._begin(mask, batch, tokens, device)
        if step.batch != batch or step.tokens != tokens:
            raise ValueError(
                f"attnrt: layer {layer_id} brings [{batch} rows x {tokens} tokens]; the step "
                f"began with [{step.batch} x {step.tokens}]")
        step.done.add(layer_id)
        return step

    def _begin(self, mask, batch: int, tokens: int, device) -> _Step:
        self._end_step()
        rt = self.runtime
        if not self._rows:
            self._rows = [None] * batch
            self._slots = [[] for _ in range(batch)]
        elif len(self._rows) != batch:
            raise ValueError(f"attnrt: the batch has {batch} rows; this cache holds {len(self._rows)} "
                             "(reset() it for a new batch)")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise ValueError(f"attn_implementation={NAME!r}: the attention mask is "
                             f"{type(mask).__name__}; attnrt takes transformers' 2D padding mask")
        if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (batch, tokens)):
            raise ValueError(
                f"attn_implementation={NAME!r}: an attention mask of shape {tuple(mask.shape)}; "
                f"attnrt takes the 2D padding mask of the step ([{batch}, {tokens}]), not a custom "
                "4D mask")
        if mask is None:
            counts, index = [tokens] * batch, None
        else:
            host = mask.to("cpu", torch.bool)
            counts = host.sum(1).tolist()
            index = None
            if any(c != tokens for c in counts):
                index = host.reshape(-1).nonzero().squeeze(1).to(device)
        live = [b for b in range(batch) if counts[b] > 0]
        prefix = [len(self._slots[b]) for b in live]
        new = [counts[b] for b in live]
        last = [self._slots[b][-1] if self._slots[b] else -1 for b in live]
        spec = None
        if self._verify:
            if index is not None or tokens != self._verify:
                raise ValueError(
                    f"AttnrtCache.verify({self._verify}): the step has {tokens} tokens per row "
                    f"({'with' if index is not None else 'without'} padding); a verify step takes "
                    f"exactly {self._verify} real tokens per row")
            if min(prefix, default=0) == 0:
                raise ValueError("AttnrtCache.verify: every row needs a cached prefix (run the "
                                 "prefill first)")
            mode, spec = "TARGET_VERIFY", SpecInfo(draft_token_num=tokens, topk=1)
            self._verify = 0
        elif all(p > 0 and n == 1 for p, n in zip(prefix, new)):
            mode = "DECODE"
        else:
            mode = "EXTEND"
        seq = [p + n for p, n in zip(prefix, new)]
        if mode == "DECODE":
            loc = list(rt.alloc_decode(seq, last))
        else:
            loc = list(rt.alloc_extend(prefix, seq, last))
        if len(loc) != sum(new):
            raise RuntimeError(
                f"attnrt: out of KV slots: the step needs {sum(new)}, {rt.available_slots} are "
                "free (raise kv_slots)")
        at = 0
        for b, p, n in zip(live, prefix, new):
            if self._rows[b] is None:
                self._rows[b] = rt.alloc_request()
                if self._linear:
                    rt.alloc_linear_state(self._rows[b])
            rt.write_req_to_token(self._rows[b], p, loc[at:at + n])
            self._slots[b] += loc[at:at + n]
            at += n
        rows = [self._rows[b] for b in live]
        positions = [p + t for p, n in zip(prefix, new) for t in range(n)]
        if mode == "DECODE":
            fb = ForwardBatch(mode, rows, seq, loc, positions=positions)
        elif mode == "TARGET_VERIFY":
            fb = ForwardBatch(mode, rows, prefix, loc, positions=positions, spec_info=spec)
        else:
            fb = ForwardBatch(mode, rows, seq, loc, extend_prefix_lens=prefix, extend_seq_lens=new,
                              positions=positions)
        rt.begin_step(fb)
        self._in_step = True
        self._seen += tokens
        accepted = [tokens - 1] * len(live) if spec is not None and self._linear else None
        self._step = _Step(batch, tokens, index, self._layers_per_step, accepted)
        return self._step

    def _finish_layer(self, step: _Step) -> None:
        if len(step.done) == step.expected:
            self._end_step()

    def _attend(self, module, query, key, value, mask, scaling, sliding_window, softcap, s_aux,
                latent=None):
        rt = self.runtime
        layer_id = module.layer_idx
        batch, _, tokens, _ = query.shape
        info = rt.layers[layer_id]
        if layer_id not in self._checked:
            _check_layer(layer_id, info, module, query, key, value, scaling, sliding_window,
                         softcap, s_aux, rt)
            self._checked.add(layer_id)
        step = self._step_for(layer_id, mask, batch, tokens, query.device)
        if info["kind"] == "mla":
            out = self._attend_latent(module, info, query, latent, step)
        else:
            q, k, v = (_token_rows(x, step.index) for x in (query, key, value))
            sinks = None
            if info["has_sinks"]:
                sinks = (s_aux if s_aux is not None else module.sinks).detach().float().contiguous()
            out = rt.forward(layer_id, q, k, v, sinks=sinks)
        self._finish_layer(step)
        if step.index is not None:
            full = out.new_zeros((batch * tokens,) + tuple(out.shape[1:]))
            full.index_copy_(0, step.index, out)
            out = full
        return out.view(batch, tokens, out.shape[-2], out.shape[-1]), None

    def _attend_latent(self, module, info, query, latent, step):
        """An MLA layer in the absorbed form attnrt serves (reference-semantics: MLA): the cache
        holds one latent row per token, [kv_lora_rank | rope] (the compressed K/V after
        kv_a_layernorm, and the roped shared key), and every head attends over it. kv_b_proj
        splits per head into W_uk [nope, rank] and W_uv [v, rank]: q_nope . W_uk c = (W_uk^T
        q_nope) . c, so the query is absorbed into the latent space, and the output is the
        attention-weighted latent taken through W_uv. The expanded K / V transformers also made
        are not read."""
        rank, rope = info["kv_lora_rank"], info["qk_rope_head_dim"]
        nope = module.qk_nope_head_dim
        heads = query.shape[1]
        w = module.kv_b_proj.weight.view(heads, nope + module.v_head_dim, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        q = _token_rows(query, step.index)  # [T, H, nope + rope]
        q_latent = torch.cat([torch.einsum("thn,hnr->thr", q[..., :nope], w_uk), q[..., nope:]],
                             dim=-1).contiguous()
        kv = _token_rows(torch.cat(latent, dim=-1), step.index)  # [B, 1, S, rank+rope] -> rows
        # V is the latent part of the same row (the pool stores the row once and ignores v).
        out = self.runtime.forward(module.layer_idx, q_latent, kv, kv[..., :rank])  # [T, H, rank]
        return torch.einsum("thr,hvr->thv", out, w_uv)

    def _linear_forward(self, module, hidden_states, attention_mask):
        """A Gated DeltaNet module's forward with conv and recurrence in attnrt (the projections,
        the gated norm and the output projection stay transformers')."""
        rt = self.runtime
        layer_id = module.layer_idx
        batch, tokens, _ = hidden_states.shape
        mask = None
        if attention_mask is not None and attention_mask.dim() == 2:  # some versions pass it whole
            mask = attention_mask[:, -tokens:]
        step = self._step_for(layer_id, mask, batch, tokens, hidden_states.device)
        qkvz = module.in_proj_qkvz(hidden_states)
        ba = module.in_proj_ba(hidden_states)
        q, k, v, z, b, a = module.fix_query_key_value_ordering(qkvz, ba)
        mixed = torch.cat([x.reshape(batch, tokens, -1) for x in (q, k, v)], dim=-1)

        def rows(x):
            x = x.reshape(batch * tokens, *x.shape[2:])
            return (x.index_select(0, step.index) if step.index is not None else x).contiguous()

        out = torch.empty((rows(a).shape[0], module.num_v_heads, module.head_v_dim),
                          dtype=hidden_states.dtype, device=hidden_states.device)
        conv = module.conv1d
        rt.forward_linear(layer_id, rows(mixed), rows(a), rows(b),
                          conv.weight.detach().reshape(conv.weight.shape[0], -1).float().contiguous(),
                          None if conv.bias is None else conv.bias.detach().float().contiguous(),
                          module.A_log.detach().float().contiguous(),
                          module.dt_bias.detach().float().contiguous(), out=out)
        self._finish_layer(step)
        if step.index is not None:
            full = out.new_zeros((batch * tokens,) + tuple(out.shape[1:]))
            full.index_copy_(0, step.index, out)
            out = full
        z = z.reshape(batch * tokens, module.num_v_heads, module.head_v_dim)
        o = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return module.out_proj(o.reshape(batch, tokens, -1))


def _token_rows(x, index):
    """[B, H, S, D] -> [T, H, D]: the real tokens, request-major, contiguous."""
    b, h, s, d = x.shape
    rows = x.transpose(1, 2).reshape(b * s, h, d)
    if index is not None:
        rows = rows.index_select(0, index)
    return rows.contiguous()


def _check_layer(layer_id, info, module, query, key, value, scaling, sliding_window, softcap,
                 s_aux, rt) -> None:
    """The layer as transformers runs it against the layer attnrt loaded; a difference is a loader
    (or model) bug that would change the outputs, so it raises."""
    def fail(what, ours, theirs):
        raise ValueError(
            f"attnrt: layer {layer_id} ({type(module).__name__}): attnrt's {what} is {ours}, "
            f"transformers passes {theirs}; the config loader and the model disagree")

    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    if not math.isclose(info["scaling"], scaling, rel_tol=1e-6):
        fail("scaling", info["scaling"], f"scaling={scaling}")
    window = -1 if sliding_window is None else int(sliding_window) - 1  # §8.5: HF counts the query
    if info["sliding_window"] != window:
        fail("sliding_window", info["sliding_window"],
             f"sliding_window={sliding_window} (attnrt's W = sliding_window - 1 = {window})")
    cap = float(softcap) if softcap else 0.0
    if not math.isclose(info["logit_cap"], cap, rel_tol=1e-6):
        fail("logit_cap", info["logit_cap"], f"softcap={softcap}")
    sinks = s_aux is not None
    if info["has_sinks"] != sinks:
        fail("has_sinks", info["has_sinks"], f"s_aux={'a tensor' if sinks else None}")
    if info["kind"] == "mla":  # transformers' expanded form against attnrt's latent form
        shapes = {"num_q_heads": query.shape[1],
                  "kv_lora_rank": getattr(module, "kv_lora_rank", None),
                  "qk_rope_head_dim": getattr(module, "qk_rope_head_dim", None)}
    else:
        shapes = {"num_q_heads": query.shape[1], "num_kv_heads": key.shape[1],
                  "head_dim": query.shape[-1], "v_head_dim": value.shape[-1]}
    for name, theirs in shapes.items():
        if info[name] != theirs:
            fail(name, info[name], theirs)
    if query.dtype != rt.dtype or query.device != rt.device:
        raise ValueError(
            f"attnrt: layer {layer_id}: activations are {query.dtype} on {query.device}; the "
            f"runtime takes {rt.dtype} on {rt.device} (create the cache with the model's dtype and "
            "an attention_backend on the model's device)")


# ---- linear-attention modules (hybrid models) -------------------------------------------------

def _route_linear_modules(model, cache: AttnrtCache) -> None:
    """Gives the model's Gated DeltaNet modules (layers attnrt runs as linear attention) a forward
    that hands a call made with an AttnrtCache to that cache, and any other call to the module's
    own forward. Done once per module; the cache comes from each call, so several caches can
    serve one model."""
    found = set()
    for module in model.modules():
        layer_id = getattr(module, "layer_idx", None)
        if layer_id not in cache._linear or not hasattr(module, "in_proj_qkvz"):
            continue
        kind = cache.runtime.layers[layer_id]["kind"]
        if kind != "gdn":
            raise ValueError(f"attnrt: layer {layer_id} is {kind} in attnrt; only Gated DeltaNet "
                             "modules are routed")
        found.add(layer_id)
        if "_attnrt_own_forward" in module.__dict__:
            continue
        module._attnrt_own_forward = module.forward
        module.forward = types.MethodType(_linear_module_forward, module)
    if found != cache._linear:
        raise ValueError(
            f"attnrt: the runtime has linear-attention layers {sorted(cache._linear)}; the model "
            f"has Gated DeltaNet modules at {sorted(found)}")


def _linear_module_forward(module, *args, **kwargs):
    cache = next((kwargs[k] for k in ("cache", "cache_params", "past_key_values")
                  if isinstance(kwargs.get(k), AttnrtCache)), None)
    if cache is None:
        return module._attnrt_own_forward(*args, **kwargs)
    hidden_states = args[0] if args else kwargs["hidden_states"]
    return cache._linear_forward(module, hidden_states, kwargs.get("attention_mask"))


# ---- one call --------------------------------------------------------------------------------

def cache_kwarg(model) -> str:
    """The keyword a model's forward / generate takes the cache by: "cache" (transformers >= 5.x
    renamed it) or "past_key_values"."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else \
        "past_key_values"


def generate(model, input_ids, attention_mask=None, max_new_tokens: int = 32, **runtime_options):
    """Greedy generation with every attention layer on attnrt: the model's attention
    implementation is attnrt for the call (restored after), the cache is closed at the end.
    runtime_options: attnrt.Runtime's options and sizes. Returns model.generate's output."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    cache = AttnrtCache(model, **runtime_options)
    try:
        return model.generate(input_ids, attention_mask=attention_mask,
                              max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                              do_sample=False, **{cache_kwarg(model): cache})
    finally:
        cache.close()
        model.set_attn_implementation(previous)
