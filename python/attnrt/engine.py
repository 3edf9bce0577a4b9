"""attnrt as the reference serving engine's attention backend.

`AttnrtBackend` has the method names and arguments of the reference engine's backend interface
(reference-semantics §3.1), so an engine swaps its backend for attnrt without changing its model
runner:

    backend = attnrt.AttnrtBackend(model_config, attention_backend="cuda", page_size=16)
    backend.init_forward_metadata(forward_batch)            # once per step
    o = backend.forward(q, k, v, layer, forward_batch)        # every attention layer

What the backend reads from a forward_batch (any object with these attributes; tensors or lists):

    forward_mode         the mode: an enum with .name (EXTEND, DECODE, MIXED, IDLE, TARGET_VERIFY,
                         DRAFT_EXTEND, DRAFT_EXTEND_V2), a name or its index
    req_pool_indices     [bs] request rows of req_to_token
    seq_lens             [bs] mode-dependent (§2.2): EXTEND / MIXED prefix + new tokens; DECODE the
                         length including the token decoded; TARGET_VERIFY the length before the
                         drafts; DRAFT_EXTEND the length after acceptance
    seq_lens_cpu         [bs] host mirror; used instead of seq_lens when present (no device sync)
    out_cache_loc        [T] KV slot of every query token (written before attending);
                         out_cache_loc_cpu, when present, is read instead (no device sync)
    positions            [T] positions of the query tokens (checked against the mode's rule)
    extend_prefix_lens / extend_seq_lens (or their _cpu lists)
                         [bs] extend-like modes: cached tokens and new tokens per request
    spec_info            TARGET_VERIFY: draft_token_num (N, root included), topk (1 = chain),
                         and for trees either `parents` [bs*N] or retrive_next_token /
                         retrive_next_sibling [bs, N]; DRAFT_EXTEND: accept_length [bs]
    req_to_token_pool    optional: the engine's own pool; its .req_to_token table is mirrored into
                         attnrt's: DECODE / TARGET_VERIFY steps add the columns of out_cache_loc
                         (the engine's table is not read, so it may live on the GPU at no sync
                         cost), extend steps copy their rows from column 0 (a prefix the engine
                         found in its own cache included). Without it the engine writes attnrt's
                         table itself (backend.req_to_token, zero-copy) and hands rows out with
                         backend.alloc_request / free_request.

Per layer, `layer` is the engine's layer descriptor (anything with .layer_id, or the id itself).
q is [T, Hq*Dqk] or [T, Hq, Dqk]; k / v [T, Hkv*D] or [T, Hkv, D]; the output is [T, Hq*Dv].
The KV pools are attnrt's (backend.kv_buffers(layer_id) gives them as tensors, in place), or the
engine's own: AttnrtBackend(model, token_to_kv_pool=pool) stores and reads K/V in the tensors of
pool.get_key_buffer(layer_id) / get_value_buffer(layer_id), at the engine's slots.
"""
from __future__ import annotations

from typing import Any, Optional

from .runtime import Runtime, _host_ints, _mode_name


def _cpu_ints(x: Any):
    if x is None:
        return None
    if hasattr(x, "detach"):
        return x.detach().to("cpu")
    return x


class _Batch:
    """The fields of a step as the runtime reads them (host integers)."""

    __slots__ = ("forward_mode", "req_pool_indices", "seq_lens", "out_cache_loc",
                 "extend_prefix_lens", "extend_seq_lens", "positions", "spec_info")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))


def _field(batch: Any, name: str):
    """batch.<name>_cpu when the engine keeps a host mirror, else batch.<name>."""
    cpu = getattr(batch, name + "_cpu", None)
    return cpu if cpu is not None else getattr(batch, name, None)


class AttnrtBackend:
    """The reference engine's attention-backend interface over an attnrt.Runtime.

    AttnrtBackend(model, **options) builds the runtime (model: preset, config.json path, dict or
    transformers PretrainedConfig; options: the reference engine's flag names, see
    attnrt.Runtime); AttnrtBackend(runtime=rt) wraps an existing one.
    """

    def __init__(self, model: Any = None, *, runtime: Optional[Runtime] = None,
                 token_to_kv_pool: Any = None, **options):
        if runtime is None:
            if model is None:
                raise TypeError("AttnrtBackend: pass a model (preset, config.json, PretrainedConfig) "
                                "or runtime=attnrt.Runtime(...)")
            runtime = Runtime(model, **options)
        elif options or model is not None:
            raise TypeError("AttnrtBackend: pass either runtime= or a model with options, not both")
        self.runtime = runtime
        # The engine's own request rows (when it passes its req_to_token_pool) -> attnrt's rows,
        # allocated the first time an extend step brings one.
        self._rows: dict[int, int] = {}
        self._table = None
        if token_to_kv_pool is not None:
            self.bind_kv_pool(token_to_kv_pool)

    def bind_kv_pool(self, pool: Any) -> None:
        """The engine's own KV pool (reference-semantics §4.3 MHATokenToKVPool / §4.5
        MLATokenToKVPool: get_key_buffer(layer_id), get_value_buffer(layer_id)) backs attnrt's
        layers from now on: K/V are stored into and read from the engine's tensors in place, at
        the engine's slots. Before the first step."""
        for layer_id, info in self.runtime.layers.items():
            if not info.get("uses_kv_cache", True):
                continue
            k = pool.get_key_buffer(layer_id)
            v = None if info["kind"] == "mla" else pool.get_value_buffer(layer_id)
            self.runtime.bind_kv_buffers(layer_id, k, v)

    # ---- pools -----------------------------------------------------------------------------
    @property
    def req_to_token(self):
        return self.runtime.req_to_token

    def kv_buffers(self, layer_id: int):
        return self.runtime.kv_buffers(layer_id)

    def alloc_request(self) -> int:
        return self.runtime.alloc_request()

    def free_request(self, row: int) -> None:
        self.runtime.free_request(row)

    # ---- eager steps -----------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: Any) -> None:
        """The plan of a step: once, before the first layer."""
        b = self._read(forward_batch)
        pool = getattr(forward_batch, "req_to_token_pool", None)
        table = getattr(pool, "req_to_token", None) if pool is not None else None
        if table is not None and table.data_ptr() != self.runtime.req_to_token.data_ptr():
            self._table = table  # kept for graph replays, which get no forward_batch
            self._mirror_req_to_token(table, b)
        self.runtime.begin_step(b)

    def forward(self, q, k, v, layer: Any, forward_batch: Any = None, save_kv_cache: bool = True,
                **kwargs):
        """IDLE: an empty output; otherwise stores k / v (save_kv_cache) and attends. Returns
        [T, Hq*Dv]."""
        layer_id = layer if isinstance(layer, int) else layer.layer_id
        if forward_batch is not None and _mode_name(forward_batch.forward_mode) == "IDLE":
            info = self.runtime.layers[layer_id]
            return q.new_empty((q.shape[0], info["num_q_heads"] * info["v_head_dim"]))
        out = self.runtime.forward(layer_id, q, k, v, kwargs.get("out"), save_kv=save_kv_cache,
                                   sinks=kwargs.get("sinks"))
        return out.view(out.shape[0], -1)

    def forward_extend(self, q, k, v, layer: Any, forward_batch: Any = None,
                       save_kv_cache: bool = True, **kwargs):
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer: Any, forward_batch: Any = None,
                       save_kv_cache: bool = True, **kwargs):
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    # ---- CUDA graphs (§3.3) ----------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs) -> None:
        self.runtime.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, req_pool_indices,
                                                 seq_lens, encoder_lens, forward_mode,
                                                 spec_info=None) -> None:
        """Just before capturing a step of `bs` requests (`num_tokens` = bs * tokens per request).
        The engine then runs its layers inside torch.cuda.graph; attnrt's kernels read only fixed
        buffers."""
        b = _Batch(forward_mode=forward_mode, req_pool_indices=[], seq_lens=[], out_cache_loc=[],
                   spec_info=spec_info)
        self.runtime.begin_capture_step(b, bs)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens,
                                                seq_lens_sum=None, encoder_lens=None,
                                                forward_mode=None, spec_info=None,
                                                seq_lens_cpu=None, *, out_cache_loc=None,
                                                raw_bs: Optional[int] = None, positions=None
                                                ) -> None:
        """Before every replay. req_pool_indices / seq_lens may be the engine's padded static
        buffers ([bs]); the real requests are the first raw_bs (pass raw_bs; without it, the
        length of out_cache_loc / tokens per request). out_cache_loc: the real tokens' KV slots
        (attnrt's graph writes K/V through its own slot buffer, filled here)."""
        if out_cache_loc is None:
            raise ValueError(
                "init_forward_metadata_replay_cuda_graph: pass out_cache_loc= (the real tokens' KV "
                "slots); attnrt's captured store reads them from its own buffer")
        mode = _mode_name(forward_mode)
        n = int(getattr(spec_info, "draft_token_num", 1) or 1) if mode == "TARGET_VERIFY" else 1
        loc = _cpu_ints(out_cache_loc)
        if raw_bs is None:
            raw_bs = len(loc) // n
        lens = _cpu_ints(seq_lens_cpu if seq_lens_cpu is not None else seq_lens)[:raw_bs]
        rows = _cpu_ints(req_pool_indices)[:raw_bs]
        loc = loc[: raw_bs * n]
        b = _Batch(forward_mode=mode, req_pool_indices=rows, seq_lens=lens, out_cache_loc=loc,
                   positions=_cpu_ints(positions)[: raw_bs * n] if positions is not None else None,
                   spec_info=spec_info)
        if self._table is not None:
            self._mirror_req_to_token(self._table, b)
        self.runtime.begin_replay_step(b, bs)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.runtime.cuda_graph_seq_len_fill_value()

    # ---- linear-attention layers (hybrid models) -------------------------------------------
    def forward_linear(self, layer_id: int, **kwargs):
        """mixed_qkv, a, b, conv_weights (or conv_weight), bias (or conv_bias), A_log, dt_bias,
        D, out: see attnrt.Runtime.forward_linear."""
        w = kwargs.get("conv_weights", kwargs.get("conv_weight"))
        bias = kwargs.get("bias", kwargs.get("conv_bias"))
        return self.runtime.forward_linear(layer_id, kwargs["mixed_qkv"], kwargs["a"],
                                           kwargs.get("b"), w, bias, kwargs["A_log"],
                                           kwargs["dt_bias"], kwargs.get("D"), kwargs.get("out"))

    def update_mamba_state_after_mtp_verify(self, accepted_steps, model: Any = None) -> None:
        """After TARGET_VERIFY: request i keeps the linear state after its block token
        accepted_steps[i] (chain: accepted drafts; tree: deepest accepted node; -1: unchanged)."""
        self.runtime.update_state_after_verify(_cpu_ints(accepted_steps))

    # ---- internals -------------------------------------------------------------------------
    def _read(self, fb: Any) -> _Batch:
        return _Batch(
            forward_mode=fb.forward_mode,
            req_pool_indices=_cpu_ints(fb.req_pool_indices),
            seq_lens=_cpu_ints(_field(fb, "seq_lens")),
            out_cache_loc=_cpu_ints(_field(fb, "out_cache_loc")),
            extend_prefix_lens=_cpu_ints(_field(fb, "extend_prefix_lens")),
            extend_seq_lens=_cpu_ints(_field(fb, "extend_seq_lens")),
            positions=_cpu_ints(getattr(fb, "positions", None)),
            spec_info=getattr(fb, "spec_info", None),
        )

    def _mirror_req_to_token(self, table: Any, b: _Batch) -> None:
        """Copies the step's columns of the engine's req_to_token into attnrt's and rewrites
        b.req_pool_indices as attnrt's rows."""
        import torch

        rows = torch.as_tensor(_host_ints(b.req_pool_indices, "req_pool_indices"), dtype=torch.long)
        if rows.numel() == 0:
            return
        mode = _mode_name(b.forward_mode)
        extend_like = mode not in ("DECODE", "TARGET_VERIFY", "IDLE")
        mapped = []
        for r in rows.tolist():
            m = self._rows.get(r)
            if m is None:
                if not extend_like:
                    raise ValueError(
                        f"{mode} step: request row {r} of the engine's req_to_token was never in "
                        "an extend step, so attnrt holds no copy of it")
                m = self._rows[r] = self.runtime.alloc_request()
            mapped.append(m)
        b.req_pool_indices = mapped
        theirs = rows
        rows = torch.tensor(mapped, dtype=torch.long)
        mine = self.runtime.req_to_token
        lens = torch.as_tensor(_host_ints(b.seq_lens, "seq_lens"), dtype=torch.long)
        # DECODE and TARGET_VERIFY add columns whose slots are the step's out_cache_loc (the
        # engine wrote the same values into its table), so the engine's table, on the GPU in
        # most engines, is not read: no device-to-host copy on the decode path.
        loc = torch.as_tensor(_host_ints(b.out_cache_loc, "out_cache_loc")).to(torch.int32)
        if mode == "DECODE":
            mine[rows, lens - 1] = loc[: rows.numel()]
            return
        if mode == "TARGET_VERIFY":
            n = int(b.spec_info.draft_token_num)
            cols = lens.unsqueeze(1) + torch.arange(n).unsqueeze(0)
            mine[rows.unsqueeze(1).expand_as(cols), cols] = loc[: rows.numel() * n].view(-1, n)
            return
        # Extend-like steps rewrite their rows from column 0 (a row may have changed hands).
        host = table[theirs.to(table.device)].to("cpu")
        for i in range(rows.numel()):
            n = int(lens[i])
            self.runtime.write_req_to_token(int(rows[i]), 0, host[i, :n].to(torch.int64))
