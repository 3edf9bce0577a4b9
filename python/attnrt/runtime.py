"""attnrt.Runtime: the attention layer of one model, driven step by step with torch tensors.

The runtime owns the paged KV cache (and, for hybrid models, the linear-attention state), chooses a
backend per phase from the options (the reference engine's flag names), and per step:

    rt.begin_step(batch)            the batch of this forward step (ForwardBatch, or any object with
                                    the reference engine's field names)
    rt.forward(layer_id, q, k, v)   every attention layer: stores k / v at out_cache_loc, attends
    rt.forward_linear(layer_id, ...)  every linear-attention layer (hybrid models)
    rt.end_step()

MLA layers of a step whose rt.mla_form() is "mha" run in the MHA form with the cached prefix in
chunks (docs/mla.md): forward_mla_mha, then per chunk of rt.prefix_chunk_plan()
gather_prefix_chunk and forward_mla_prefix_chunk.

Tensors are read and written in place through DLPack (no copies, CPU or CUDA); on CUDA the work goes
to torch's current stream. Batch fields are host integers (lists, numpy or CPU tensors); a CUDA tensor
is accepted too, at the cost of a device-to-host copy.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from . import _native

# Reference-engine option names (and their types) the runtime accepts as keyword arguments.
_OPTIONS = {
    "attention_backend": str,
    "prefill_attention_backend": str,
    "decode_attention_backend": str,
    "speculative_attention_mode": str,
    "page_size": int,
    "kv_cache_dtype": str,
    "speculative_num_steps": int,
    "speculative_eagle_topk": int,
    "speculative_num_draft_tokens": int,
    "linear_attn_backend": str,
    "linear_attn_prefill_backend": str,
    "linear_attn_decode_backend": str,
    "num_threads": int,
    "deterministic": bool,
    "fp8_prefill_attention": bool,
    "disable_chunked_prefix_cache": bool,
    "chunked_prefix_cache_threshold": int,
    "max_chunk_capacity": int,
    "dsa_prefill_backend": str,
    "dsa_decode_backend": str,
}
_CONFIG = {
    "max_requests": int,
    "kv_slots": int,
    "swa_full_tokens_ratio": float,
    "max_num_tokens": int,
    "max_context_len": int,
    "linear_state_slots": int,
    "linear_verify_requests": int,
    "cuda_graphs": bool,
    "cuda_graph_max_bs": int,
    "cuda_graph_batch_sizes": list,
}
_MODES = ("EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_EXTEND_V2")


def cuda_status() -> tuple[bool, str]:
    """(usable, device name or the reason CUDA is off) as attnrt sees this machine."""
    return _native.cuda_status()


def presets() -> list[str]:
    """The built-in model presets (`attnrt info` lists them too)."""
    return _native.preset_names()


@dataclass
class SpecInfo:
    """Speculative payload of a TARGET_VERIFY or DRAFT_EXTEND step (reference-semantics §2.4).

    draft_token_num: tokens per request in a verify block, the root included (N).
    topk: 1 for a chain, > 1 for a tree.
    parents: [bs * N] parent of each block token inside its block (-1 for the root); a chain may
        leave it None. Alternatively retrive_next_token / retrive_next_sibling ([bs, N], -1 = none).
    accept_length: DRAFT_EXTEND: accepted drafts per request (root / bonus excluded).
    """

    draft_token_num: int = 0
    topk: int = 1
    parents: Any = None
    retrive_next_token: Any = None
    retrive_next_sibling: Any = None
    accept_length: Any = None


@dataclass
class ForwardBatch:
    """One forward step (reference-semantics §2.1); field names are the reference engine's."""

    forward_mode: str
    req_pool_indices: Any
    seq_lens: Any
    out_cache_loc: Any
    extend_prefix_lens: Any = None
    extend_seq_lens: Any = None
    positions: Any = None
    spec_info: Optional[SpecInfo] = None
    batch_size: int = field(default=-1)


def _mode_name(mode: Any) -> str:
    if isinstance(mode, str):
        name = mode
    elif hasattr(mode, "name"):  # the reference engine's ForwardMode enum
        name = mode.name
    elif isinstance(mode, int):
        if not 0 <= mode < len(_MODES):
            raise ValueError(f"forward_mode: {mode} is not a mode; the modes are {', '.join(_MODES)}")
        name = _MODES[mode]
    else:
        raise TypeError(f"forward_mode: {type(mode).__name__}; pass a mode name ({', '.join(_MODES)})")
    return name.upper()


def _host_ints(x: Any, name: str):
    """A batch field as something the native layer reads without a copy when it can."""
    if x is None:
        return None
    if hasattr(x, "__dlpack__") and hasattr(x, "dim"):  # torch tensor
        dev = getattr(x.device, "type", "cpu")
        if dev != "cpu":
            x = x.cpu()  # a CUDA batch field: one device-to-host copy
        if x.dim() == 0:
            x = x.reshape(1)
        if not x.is_contiguous():
            x = x.contiguous()
        return x
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if np is not None:
        if isinstance(x, np.ndarray):
            return x
        try:
            values = list(x)
        except TypeError:
            raise TypeError(
                f"batch field {name}: {type(x).__name__}; pass a list, numpy array or tensor of "
                "integers") from None
        bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, (int, np.integer))), None)
        if bad is not None:
            raise TypeError(f"batch field {name}: element {bad!r} ({type(bad).__name__}); the "
                            "values must be integers")
        try:
            return np.asarray(values, dtype=np.int64)
        except OverflowError:
            big = next(v for v in values if not -2**63 <= int(v) < 2**63)
            raise ValueError(f"batch field {name}: {big} does not fit int64") from None
    raise TypeError(f"batch field {name}: {type(x).__name__}; pass a list, numpy array or tensor")


def _parents_from_retrive(next_token, next_sibling, bs: int, n: int) -> list[int]:
    """parent[t] from the first-child / next-sibling form (reference-semantics §2.4)."""
    import numpy as np

    nt = np.asarray(next_token.cpu() if hasattr(next_token, "cpu") else next_token).reshape(bs, n)
    ns = np.asarray(next_sibling.cpu() if hasattr(next_sibling, "cpu") else next_sibling).reshape(bs, n)
    parents = np.full((bs, n), -1, dtype=np.int32)
    for r in range(bs):
        for t in range(n):
            c = nt[r, t]
            if c >= 0:
                parents[r, c] = t
            s = ns[r, t]
            if s >= 0:
                parents[r, s] = parents[r, t]
    return parents.reshape(-1)


def _model_source(model: Any) -> tuple[str, str]:
    """(name or path, config.json text or '') for the native loader."""
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        return path, ""
    if isinstance(model, dict):
        return model.get("_name_or_path") or model.get("model_type", "config"), json.dumps(model)
    if hasattr(model, "to_dict"):  # transformers.PretrainedConfig
        d = model.to_dict()
        name = getattr(model, "_name_or_path", "") or d.get("model_type", "config")
        return f"{name} (PretrainedConfig)", json.dumps(d, default=str)
    raise TypeError(
        f"model: {type(model).__name__}; pass a preset name, a config.json path, a dict of a "
        "config.json or a transformers PretrainedConfig"
    )


def _options_and_config(kwargs: dict, who: str, extra: tuple = ()):
    """The native Options and RuntimeConfig from keyword arguments (the reference engine's names);
    TypeError naming the argument for an unknown name or a value of the wrong type."""
    options = _native.Options()
    config = _native.RuntimeConfig()
    for key, value in kwargs.items():
        if key in _OPTIONS:
            target = options
            kind = _OPTIONS[key]
        elif key in _CONFIG:
            target = config
            kind = _CONFIG[key]
        else:
            allowed = ", ".join(sorted(list(_OPTIONS) + list(_CONFIG) + ["dtype", "tp_size"] +
                                       list(extra)))
            raise TypeError(f"{who}: unknown option {key!r}; the options are {allowed}")
        if value is None:
            continue
        if key == "kv_cache_dtype" and not isinstance(value, str):
            value = str(value).replace("torch.", "")
        if kind is bool and not isinstance(value, bool):
            raise TypeError(f"{who}: {key}={value!r}; it must be True or False")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{who}: {key}={value!r}; it must be an integer")
        if kind is str and not isinstance(value, str):
            raise TypeError(f"{who}: {key}={value!r}; it must be a string")
        setattr(target, key, list(value) if kind is list else kind(value))
    return options, config


def _dtype_name(dtype: Any) -> str:
    if dtype is not None and not isinstance(dtype, str):
        dtype = str(dtype).replace("torch.", "")
    return dtype or ""


def _begin_native(begin, batch: Any, *extra) -> None:
    """Calls a native begin_step with the batch's fields: lists, numpy arrays and CPU tensors as
    they are, anything else (GPU tensors, other integer types, iterables) as host int64 copies."""
    mode = batch.forward_mode
    if type(mode) is not str or not mode.isupper():
        mode = _mode_name(mode)
    spec = getattr(batch, "spec_info", None)
    n, topk, parents, accept = 0, 1, None, None
    rows = batch.req_pool_indices
    if spec is not None:
        n = int(getattr(spec, "draft_token_num", 0) or 0)
        topk = int(getattr(spec, "topk", 1) or 1)
        parents = getattr(spec, "parents", None)
        nt = getattr(spec, "retrive_next_token", None)
        if parents is None and nt is not None and topk > 1:
            parents = _parents_from_retrive(nt, spec.retrive_next_sibling, len(rows), n)
        accept = getattr(spec, "accept_length", None)
    fields = [rows, batch.seq_lens, getattr(batch, "extend_prefix_lens", None),
              getattr(batch, "extend_seq_lens", None), batch.out_cache_loc,
              getattr(batch, "positions", None)]
    try:
        begin(mode, *fields, n, topk, parents, accept, *extra)
    except TypeError:
        names = ("req_pool_indices", "seq_lens", "extend_prefix_lens", "extend_seq_lens",
                 "out_cache_loc", "positions")
        fields = [_host_ints(x, name) for x, name in zip(fields, names)]
        begin(mode, *fields, n, topk, _host_ints(parents, "spec_info.parents"),
              _host_ints(accept, "spec_info.accept_length"), *extra)


def _torch():
    import torch

    return torch


_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class Runtime:
    """The attention layer of one model (see the module docstring and docs/python.md).

    model: a preset name (attnrt.presets()), a config.json path or directory, a dict of a
        config.json, or a transformers PretrainedConfig.
    dtype: activation dtype of q / k / v / out (torch dtype or name); default the model's.
    tp_size: heads split over this many ranks (this runtime holds one rank's heads).
    Options (the reference engine's flag names): attention_backend, prefill_attention_backend,
        decode_attention_backend, speculative_attention_mode, page_size, kv_cache_dtype,
        speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens,
        linear_attn_backend, linear_attn_prefill_backend, linear_attn_decode_backend, num_threads,
        deterministic, fp8_prefill_attention (docs/backends.md "fp8 prefill"); MLA's MHA form
        (docs/mla.md): disable_chunked_prefix_cache, chunked_prefix_cache_threshold,
        max_chunk_capacity; DSA models (docs/dsa.md): dsa_prefill_backend, dsa_decode_backend.
    Sizes: max_requests, kv_slots, max_num_tokens, max_context_len, swa_full_tokens_ratio,
        linear_state_slots, linear_verify_requests, cuda_graphs, cuda_graph_max_bs,
        cuda_graph_batch_sizes.
    """

    def __init__(self, model: Any = "demo", *, dtype: Any = None, tp_size: int = 1, **kwargs):
        options, config = _options_and_config(kwargs, "Runtime")
        name, text = _model_source(model)
        self._rt = _native.Runtime(name, text, _dtype_name(dtype), int(tp_size), options, config)
        self.layers = {l["layer_id"]: l for l in self._rt.layers}
        kind, index = self._rt.pool_device
        self._cuda = kind == "cuda"
        self._device_index = index
        self._stream = None  # the CUDA stream handed to the native runtime last
        self._capturing = False  # between begin_capture_step and the next step
        self.page_size = self._rt.page_size
        try:  # torch's tensors and current stream through DLPack's C exchange table (fast path)
            import torch

            if hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
                self._rt.use_framework(torch.Tensor)
        except ImportError:  # pragma: no cover
            pass
        self._bound: dict = {}  # layer id -> the engine's (k, v) tensors (bind_kv_buffers)

    # ---- what was chosen -------------------------------------------------------------------
    @property
    def selection(self) -> dict:
        """The backend per phase and kv dtype, with the reason for each choice."""
        return self._rt.selection

    @property
    def device(self):
        """The torch device of the pools (and of the tensors forward() takes)."""
        torch = _torch()
        return torch.device("cuda", self._device_index) if self._cuda else torch.device("cpu")

    @property
    def dtype(self):
        """The activation dtype (torch) of q / k / v / out."""
        return getattr(_torch(), _TORCH_DTYPES.get(self._rt.model_dtype, "float32"))

    @property
    def kv_cache_dtype(self) -> str:
        return self._rt.kv_cache_dtype

    @property
    def has_linear_layers(self) -> bool:
        return self._rt.has_linear_layers

    @property
    def cuda_graphs_off_reason(self) -> str:
        return self._rt.cuda_graphs_off_reason

    # ---- pools -----------------------------------------------------------------------------
    @property
    def req_to_token(self):
        """int32 [max_requests, max_context_len]: the request-row -> token-slot table, in place."""
        return _as_torch(self._rt.req_to_token())

    def kv_buffers(self, layer_id: int):
        """(k, v, k_scale, v_scale): the layer's KV pool as tensors [slots, kv_heads, dim], in
        place; fp8 pools come as uint8 (view them with .view(torch.float8_e4m3fn) / e5m2)."""
        k, v, ks, vs = self._rt.kv_buffers(layer_id)
        return _as_torch(k), _as_torch(v), ks, vs

    def bind_kv_buffers(self, layer_id: int, k, v=None) -> None:
        """An engine that owns its KV pools: layer `layer_id` stores and reads K/V in the engine's
        tensors (reference-semantics §4.3 / §4.5 layouts) instead of attnrt's, whose buffers of the
        layer are released. k / v: contiguous [rows, kv_heads, head_dim] / [rows, kv_heads,
        v_head_dim], rows >= kv_slots + page_size, the KV cache dtype (fp8: uint8 bytes too), on
        the runtime's device; MLA layers: k [rows, 1, kv_lora_rank + rope] and v None (or a view
        of k). out_cache_loc and req_to_token then hold the engine's slots. Call before the first
        step; the runtime keeps the tensors alive."""
        self._rt.bind_kv_buffers(int(layer_id), k, v)
        self._bound[int(layer_id)] = (k, v)

    def set_kv_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        self._rt.set_kv_scales(layer_id, float(k_scale), float(v_scale))

    def alloc_request(self) -> int:
        """A free request row of req_to_token."""
        return self._rt.alloc_request()

    def free_request(self, row: int) -> None:
        self._rt.free_request(int(row))

    def write_req_to_token(self, row: int, start: int, slots) -> None:
        """req_to_token[row, start : start + len(slots)] = slots."""
        self._rt.write_req_to_token(int(row), int(start), _host_ints(slots, "slots"))

    def alloc_extend(self, prefix_lens, seq_lens, last_locs) -> list[int]:
        """Slots for the new tokens of extending requests (page-aligned; reference-semantics §4.2).
        last_locs: the slot of each request's last cached token, -1 when it has none."""
        return self._rt.alloc_extend(
            _host_ints(prefix_lens, "prefix_lens"), _host_ints(seq_lens, "seq_lens"),
            _host_ints(last_locs, "last_locs"))

    def alloc_decode(self, seq_lens, last_locs) -> list[int]:
        """One slot per decoding request (seq_lens include the new token)."""
        return self._rt.alloc_decode(_host_ints(seq_lens, "seq_lens"), _host_ints(last_locs, "last_locs"))

    def free_slots(self, slots) -> None:
        self._rt.free_slots(_host_ints(slots, "slots"))

    @property
    def available_slots(self) -> int:
        return self._rt.available_slots

    def alloc_linear_state(self, row: int) -> int:
        """A linear-attention state slot bound to request row `row` (hybrid models)."""
        return self._rt.alloc_linear_state(int(row))

    def free_linear_state(self, row: int) -> None:
        self._rt.free_linear_state(int(row))

    # ---- the step --------------------------------------------------------------------------
    def _use_current_stream(self) -> None:
        if not self._cuda or self._rt.follows_framework_stream:
            return  # the native layer reads torch's current stream itself
        torch = _torch()
        s = torch.cuda.current_stream(self._device_index).cuda_stream
        if s != self._stream:
            self._rt.set_stream(s)
            self._stream = s

    def begin_step(self, batch: Any) -> None:
        """Starts a forward step. `batch`: ForwardBatch, or any object with the reference engine's
        fields (forward_mode, req_pool_indices, seq_lens, out_cache_loc, extend_prefix_lens,
        extend_seq_lens, positions, spec_info). req_to_token must already hold the step's slots."""
        self._capturing = False
        self._begin(batch, 0, 0)

    # ---- CUDA graphs the engine captures (torch.cuda.graph around its whole step) ----------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Once, before any capture: fixed buffers for steps of up to max_bs requests and
        max_num_tokens tokens (max_bs * tokens per request)."""
        self._rt.init_cuda_graph_state(int(max_bs), int(max_num_tokens))

    def begin_capture_step(self, batch: Any, bs: int) -> None:
        """Before capturing a DECODE / TARGET_VERIFY step of `bs` requests: the forward() calls
        made inside the capture record kernels that read only fixed buffers. `batch` gives the mode
        (and spec_info for verify); its lengths are not read."""
        self._capturing = True
        self._begin(batch, 1, int(bs))

    def begin_replay_step(self, batch: Any, bs: int) -> None:
        """Before every replay of the graph captured at size `bs`: the real batch (at most bs
        requests; padded here). Then replay the graph, then end_step()."""
        self._capturing = False
        self._begin(batch, 2, int(bs))

    def cuda_graph_seq_len_fill_value(self) -> int:
        """The seq_lens value padded requests carry (reference-semantics §3.3)."""
        return self._rt.cuda_graph_seq_len_fill_value()

    def _begin(self, batch: Any, kind: int, bs: int) -> None:
        self._use_current_stream()
        _begin_native(self._rt.begin_step, batch, kind, bs)

    def forward(self, layer_id: int, q, k, v, out=None, *, save_kv: bool = True, sinks=None,
                lse=None, index_q=None, index_k=None, index_weights=None, index_topk=None):
        """Attention of one layer for the step begun: stores k / v (when save_kv) and attends.
        q [T, Hq, D] (or [T, Hq*D]), k / v [T, Hkv, D] (or flat), out [T, Hq, Dv] (or flat) or
        None (a new [T, Hq, Dv] tensor). Returns out.

        DSA layers (a model with an indexer, e.g. deepseek-v3.2; docs/dsa.md) also take the
        indexer's inputs: index_q [T, index_n_heads, index_head_dim], index_k [T, index_head_dim]
        (stored in the layer's index-key cache with the latent rows; None when save_kv is off),
        index_weights [T, index_n_heads]; index_topk, an int32 [T, index_topk] tensor, receives
        each token's selected token indices (increasing, -1 after the last) when given."""
        if out is None:
            out = _forward_out(self.layers, layer_id, q)
        if self._capturing:
            self._use_current_stream()  # the capture runs on a stream of its own
        try:
            self._rt.forward(layer_id, q, k, v, out, save_kv, sinks, lse, index_q, index_k,
                             index_weights, index_topk)
        except TypeError as e:
            _explain_tensor_error(e, q=q, k=k, v=v, out=out, sinks=sinks, lse=lse,
                                  index_q=index_q, index_k=index_k, index_weights=index_weights,
                                  index_topk=index_topk)
            raise
        return out

    # ---- MLA in the MHA form (docs/mla.md) ---------------------------------------------------
    def mla_form(self) -> str:
        """The form the MLA layers of the step begun run in: "mha" (forward_mla_mha and the
        prefix chunks) or "absorbed" (forward with q_lat and the latent rows)."""
        return self._rt.mla_form()

    def prefix_chunk_plan(self) -> dict:
        """The prefix chunks of the step begun: {"chunk_len", "chunks": [{"num_tokens", "starts",
        "lens", "cu_seqlens", "slots"}, ...]} (request order; empty for an absorbed step)."""
        return self._rt.prefix_chunk_plan()

    def forward_mla_mha(self, layer_id: int, q, k, v, latent, out=None, lse=None, *,
                        save_kv: bool = True):
        """The causal part of an MHA-form MLA layer: the extend tokens against themselves. q / k
        [T, Hq, qk_nope + qk_rope], v [T, Hq, mha_v] (or flat), latent [T, 1, kv_lora_rank +
        qk_rope] (stored at out_cache_loc when save_kv). out [T, Hq, mha_v] and lse float32
        [T, Hq] are written in place, or new tensors when None. Returns (out, lse), the running
        result the prefix chunks merge into."""
        info = self._mla_layer(layer_id)
        if out is None:
            out = _new_out(q, "forward_mla_mha", info["num_q_heads"], info["mha_v_head_dim"])
        if lse is None:
            lse = q.new_empty((q.shape[0], info["num_q_heads"]), dtype=_torch().float32)
        try:
            self._rt.forward_mla_mha(layer_id, q, k, v, out, lse, latent, save_kv)
        except TypeError as e:
            _explain_tensor_error(e, q=q, k=k, v=v, out=out, lse=lse, latent=latent)
            raise
        return out, lse

    def gather_prefix_chunk(self, layer_id: int, chunk: int, latent=None):
        """The latent rows of prefix chunk `chunk` (request order, dequantised), into latent
        [n, 1, kv_lora_rank + qk_rope] (n = the chunk's num_tokens) or a new tensor of the
        activation dtype. Returns latent."""
        info = self._mla_layer(layer_id)
        if latent is None:
            n = self._rt.prefix_chunk_plan()["chunks"][chunk]["num_tokens"] if chunk >= 0 else 0
            latent = _torch().empty((n, 1, info["head_dim"]), dtype=self.dtype, device=self.device)
        try:
            self._rt.gather_prefix_chunk(layer_id, chunk, latent)
        except TypeError as e:
            _explain_tensor_error(e, latent=latent)
            raise
        return latent

    def forward_mla_prefix_chunk(self, layer_id: int, chunk: int, q, k, v, out, lse):
        """Prefix chunk `chunk` of an MHA-form MLA layer, after its forward_mla_mha: q as there,
        k [n, Hq, qk_nope + qk_rope] and v [n, Hq, mha_v] decompressed from the chunk's latent
        rows; merged into out / lse in place. Returns out."""
        try:
            self._rt.forward_mla_prefix_chunk(layer_id, chunk, q, k, v, out, lse)
        except TypeError as e:
            _explain_tensor_error(e, q=q, k=k, v=v, out=out, lse=lse)
            raise
        return out

    def _mla_layer(self, layer_id: int) -> dict:
        info = self.layers.get(layer_id)
        if info is None:
            raise ValueError(
                f"layer_id {layer_id} is not a layer of the model; layers are "
                f"0..{len(self.layers) - 1}")
        return info

    def forward_linear(self, layer_id: int, mixed_qkv, a, b, conv_weight, conv_bias, A_log,
                       dt_bias, D=None, out=None):
        """One linear-attention layer (gdn / kda / mamba2): conv + recurrence with the request's
        state (reference-semantics §2.3, §8.8-8.9). Returns out [T, heads, head_v_dim]."""
        if out is None:
            info = self.layers[layer_id]
            raise ValueError(
                f"forward_linear(layer {layer_id}, {info['kind']}): pass out, a [T, heads, head_v_dim] "
                "tensor")
        try:
            self._rt.forward_linear(layer_id, mixed_qkv, a, b, conv_weight, conv_bias, A_log,
                                    dt_bias, D, out)
        except TypeError as e:
            _explain_tensor_error(e, mixed_qkv=mixed_qkv, a=a, b=b, conv_weight=conv_weight,
                                  conv_bias=conv_bias, A_log=A_log, dt_bias=dt_bias, D=D, out=out)
            raise
        return out

    def end_step(self) -> None:
        self._rt.end_step()

    def update_state_after_verify(self, last_accepted) -> None:
        """After a TARGET_VERIFY step (hybrid models): request i keeps the linear state after its
        block token last_accepted[i] (-1: unchanged). reference-semantics §8.10."""
        self._rt.update_state_after_verify(_host_ints(last_accepted, "last_accepted"))

    def synchronize(self) -> None:
        """Waits for the GPU work this runtime issued."""
        self._rt.synchronize()

    def close(self) -> None:
        """Releases the pools; any later call raises RuntimeError. Closing twice is harmless."""
        self._rt.close()

    @property
    def closed(self) -> bool:
        """True after close(): the pools are released and every call raises RuntimeError."""
        return getattr(self, "_rt", None) is None or self._rt.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "attnrt.Runtime(closed)"
        s = self.selection
        return (f"attnrt.Runtime({self._rt.model_name!r}, prefill={s['prefill']}, "
                f"decode={s['decode']}, kv={s['kv_cache_dtype']}, page_size={self.page_size}, "
                f"device={self.device})")


def _new_out(q, call: str, heads: int, dim: int):
    """The output tensor [T, heads, dim] a call makes when the caller passes none: q's kind."""
    if not hasattr(q, "new_empty") or not hasattr(q, "shape"):
        raise TypeError(f"{call}: q is {type(q).__name__}; pass a torch tensor")
    if q.dim() == 0:
        raise ValueError(f"{call}: q is a 0-dimensional tensor; pass q [T, heads, head_dim] (or "
                         "[T, heads * head_dim])")
    return q.new_empty((q.shape[0], heads, dim))


def _forward_out(layers: dict, layer_id: int, q):
    """forward()'s output when the caller passes none: [T, Hq, Dv] of layer `layer_id`."""
    info = layers.get(layer_id)
    if info is None:
        raise ValueError(f"forward: layer_id {layer_id} is not a layer of the model; layers are "
                         f"0..{len(layers) - 1}")
    return _new_out(q, "forward", info["num_q_heads"], info["v_head_dim"])


def _as_torch(array):
    torch = _torch()
    return torch.from_dlpack(array)


def _explain_tensor_error(err: TypeError, **tensors) -> None:
    """Replaces nanobind's generic 'incompatible arguments' with the argument that is wrong."""
    for name, t in tensors.items():
        if t is None:
            continue
        if not hasattr(t, "__dlpack__"):
            raise TypeError(f"{name}: {type(t).__name__}; pass a torch tensor") from err
        if getattr(t, "requires_grad", False):
            raise TypeError(
                f"{name}: the tensor requires grad; run attnrt under torch.no_grad() / "
                "torch.inference_mode() or pass tensor.detach()") from err
        if hasattr(t, "is_contiguous") and not t.is_contiguous() and t.dim() > 0 and t.stride(-1) != 1:
            raise ValueError(
                f"{name}: strides {tuple(t.stride())} for shape {tuple(t.shape)}; the last "
                "dimension must be contiguous (stride 1)") from err
