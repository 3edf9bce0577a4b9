"""Decode context parallelism from Python (docs/dcp.md, docs/python.md "Decode context parallelism").

Token g of a request lives on rank g mod n; each rank attends its share of the context and the
partial outputs (with their log-sum-exp) are exchanged by one all-to-all per layer and merged
exactly. Two ways in:

    group = attnrt.DcpAttention("llama3-8b", dcp_size=2, attention_backend="cpu")
        n simulated ranks in one process, with the interface of one Runtime: begin_step(batch),
        forward(layer_id, q, k, v) (the merged output of every head), end_step(). Host backends,
        or cuda ranks sharing the one GPU: correctness, not speed. (cuda ranks take any page
        size, except for models with sliding windows and for tree verify: page_size 1 there.)

    rank = attnrt.DcpRank("llama3-8b", rank=r, dcp_size=n, communicator=comm, ...)
        one rank of a real group, a process (or thread) per rank: the same calls, and forward()
        writes the merged rows of this rank's heads (head_range(layer_id)); comm from
        attnrt.nccl_communicator (one GPU per rank; the NCCL id from attnrt.nccl_unique_id() on
        one rank, handed to the others by the engine), attnrt.wrap_nccl_comm (the engine's own
        ncclComm_t) or attnrt.in_process_group(n) (host ranks on threads of one process).

GPU ranks run on torch's current CUDA stream, as Runtime does: begin_step and every forward hand
it to the ranks (their runtimes, gather / pack / merge and the exchange, the communicator's
collectives included), so GPU tensors are read and written in that stream's order and the host
never waits for the GPU. So torch.cuda.graph captures them (docs/dcp.md "CUDA graphs"):
init_cuda_graph_state(T) once, begin_capture_step(T) and the layers' forward() inside the
capture, then per step begin_replay_step(batch, T), the graph's replay and end_step().

Request rows are the engine's ids in [0, max_requests); the group allocates every new token's slot
on its owner (out_cache_loc values are not read, only its length) and frees a request's slots with
free_request(row). After a tree TARGET_VERIFY step, commit_verify(accepted) moves each request's
accepted path into place before the next step (a chain needs none).
"""
from __future__ import annotations

from typing import Any

from . import _native
from .runtime import (_begin_native, _dtype_name, _explain_tensor_error, _forward_out,
                      _model_source, _options_and_config, _torch)


def in_process_group(size: int) -> list:
    """The communicators of an in-process group of `size` host ranks, one per rank (rank i's is
    element i): each rank's DcpRank runs on a thread of its own, and a collective returns when
    every rank has made its call."""
    return _native.in_process_group(int(size))


def nccl_unique_id() -> bytes:
    """NCCL's id of a new group (128 bytes): made on one rank and handed to every rank by the
    engine's own means (e.g. torch.distributed.broadcast_object_list). attnrt.Error when NCCL
    cannot be used here, saying why."""
    reason = _native.nccl_unavailable_reason()
    if reason:
        raise _native.Error(f"nccl_unique_id: NCCL cannot be used here: {reason}")
    return _native.nccl_unique_id()


def nccl_communicator(unique_id: bytes, size: int, rank: int, device: int | None = None,
                      stream: int = 0):
    """This process's rank of the NCCL group `unique_id` (size ranks, one GPU each) on CUDA device
    `device` (default: torch's current device). Blocks until every rank has joined. `stream`: the
    cudaStream_t the collectives go to (0: the device's legacy default stream) until the DcpRank
    using it moves them to torch's current stream, at its first step."""
    reason = _native.nccl_unavailable_reason()
    if reason:
        raise _native.Error(f"nccl_communicator: NCCL cannot be used here: {reason}")
    if device is None:
        device = _torch().cuda.current_device()
    return _native.nccl_communicator(bytes(unique_id), int(size), int(rank), int(device),
                                     int(stream))


def wrap_nccl_comm(comm: int, rank: int, stream: int = 0):
    """A communicator over an ncclComm_t the engine made (its address as an int); the engine keeps
    it and destroys it after the ranks that use it are closed. `rank`: this process's rank in it."""
    return _native.wrap_nccl_comm(int(comm), int(rank), int(stream))


class _DcpSteps:
    """The step calls DcpAttention and DcpRank share."""

    _who = "DCP"

    def _finish_init(self) -> None:
        self.layers = {l["layer_id"]: l for l in self._g.layers}
        kind, index = self._g.pool_device
        self._cuda = kind == "cuda"
        self._device_index = index
        self._stream = None  # the CUDA stream handed to the ranks last (without the fast path)
        try:  # torch's current stream read natively through DLPack's C exchange table
            import torch

            if hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
                self._g.use_framework(torch.Tensor)
        except ImportError:  # pragma: no cover
            pass

    @property
    def size(self) -> int:
        """dcp_size: the ranks of the group."""
        return self._g.size

    @property
    def dtype(self):
        """The activation dtype (torch) of q / k / v / out."""
        names = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
        return getattr(_torch(), names.get(self._g.model_dtype, "float32"))

    @property
    def device(self):
        """The torch device of the ranks' pools (and of the tensors forward() takes)."""
        torch = _torch()
        return torch.device("cuda", self._device_index) if self._cuda else torch.device("cpu")

    def begin_step(self, batch: Any) -> None:
        """Starts a step: `batch` as for Runtime.begin_step (the global batch of one runtime);
        out_cache_loc must have one entry per token, its values are not read."""
        self._use_current_stream()
        _begin_native(self._g.begin_step, batch)

    # ---- CUDA graphs the engine captures (torch.cuda.graph around its whole step) ----------
    @property
    def cuda_graphs_off_reason(self) -> str:
        """Why graph steps are refused here ("" when cuda ranks can be captured)."""
        return self._g.cuda_graphs_off_reason

    def init_cuda_graph_state(self, max_num_tokens: int) -> None:
        """Once, before any capture: every buffer of graph steps of up to max_num_tokens query
        rows, at fixed addresses. A rank's batch is decode-shaped rows whatever the step's mode, so
        a graph depends on its rows alone: one captured at T rows replays any step (DECODE, chain
        or tree TARGET_VERIFY, EXTEND, ...) of at most T tokens."""
        self._g.init_cuda_graph_state(int(max_num_tokens))

    def begin_capture_step(self, tokens: int) -> None:
        """Before capturing a step of `tokens` rows (outside torch.cuda.graph): the forward()
        calls made inside the capture, with GPU tensors of `tokens` rows (sinks on the GPU),
        record kernels and the exchange over fixed buffers only. Then end_step()."""
        self._use_current_stream()
        self._g.begin_capture_step(int(tokens))

    def begin_replay_step(self, batch: Any, tokens: int) -> None:
        """Before every replay of the graph captured at `tokens` rows: the real step (at most
        `tokens` tokens; the rows past them come out as 0). Its slots and lists are written into
        the graph's buffers on torch's current stream; replay the graph there, then end_step()."""
        self._use_current_stream()
        _begin_native(self._g.begin_step, batch, int(tokens))

    def _use_current_stream(self) -> None:
        if not self._cuda or self._g.follows_framework_stream:
            return  # the native layer reads torch's current stream itself
        s = _torch().cuda.current_stream(self._device_index).cuda_stream
        if s != self._stream:
            self._g.set_stream(s)
            self._stream = s

    def forward(self, layer_id: int, q, k, v, out=None, *, save_kv: bool = True, sinks=None,
                lse=None):
        """One attention layer of the step: q [T, Hq, D], k / v [T, Hkv, D] (or flat) of the
        whole step (each rank stores the tokens it owns); out [T, Hq, Dv] or None (a new tensor).
        MLA layers in the absorbed form (q [T, Hq, kv_lora_rank + rope], k the latent rows, v
        their first kv_lora_rank values). lse (float32 [T, Hq]), when given, gets the merged
        log-sum-exp. GPU tensors are read and written on torch's current stream, in its order
        (no host wait). Returns out."""
        if out is None:
            out = _forward_out(self.layers, layer_id, q)
        self._use_current_stream()
        try:
            self._g.forward(layer_id, q, k, v, out, save_kv, sinks, lse)
        except TypeError as e:
            _explain_tensor_error(e, q=q, k=k, v=v, out=out, sinks=sinks, lse=lse)
            raise
        return out

    def end_step(self) -> None:
        self._g.end_step()

    def commit_verify(self, accepted) -> None:
        """After a TARGET_VERIFY step's end_step, before the next begin_step: request i keeps the
        block tokens accepted[i] (block indices from the root 0 down its tree, by depth); each is
        moved to the column of its position on its owner. A chain needs no commit."""
        paths = [[int(x) for x in (p.tolist() if hasattr(p, "tolist") else p)] for p in accepted]
        self._g.commit_verify(paths)

    def free_request(self, row: int) -> None:
        """Releases request row `row`'s slots on every rank (the request ended)."""
        self._g.free_request(int(row))

    def reserve_prefix(self, row: int, tokens: int) -> None:
        """The first `tokens` tokens of row `row` count as stored (slots allocated on their owners,
        K/V as the pools hold them): for benchmarks and engines that write the pools themselves."""
        self._g.reserve_prefix(int(row), int(tokens))

    def set_kv_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        self._g.set_kv_scales(int(layer_id), float(k_scale), float(v_scale))

    def close(self) -> None:
        """Releases the ranks' pools; any later call raises RuntimeError."""
        self._g.close()

    @property
    def closed(self) -> bool:
        return self._g.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DcpAttention(_DcpSteps):
    """dcp_size simulated ranks in one process with the interface of one Runtime (see the module
    docstring). model, dtype, tp_size and the options as for Runtime; max_requests bounds the
    request rows, max_num_tokens the tokens of a step. cuda ranks all run on torch's current
    stream (one after another, the exchange between them): forward() returns without waiting and
    its output is ready in that stream's order, as Runtime.forward's is."""

    def __init__(self, model: Any = "demo", *, dcp_size: int, dtype: Any = None, tp_size: int = 1,
                 **kwargs):
        options, config = _options_and_config(kwargs, "DcpAttention", ("dcp_size",))
        if isinstance(dcp_size, bool) or not isinstance(dcp_size, int):
            raise TypeError(f"DcpAttention: dcp_size={dcp_size!r}; it must be an integer")
        options.dcp_size = dcp_size
        name, text = _model_source(model)
        self._g = _native.DcpAttention(name, text, _dtype_name(dtype), int(tp_size), options,
                                       config)
        self._finish_init()

    def __repr__(self) -> str:
        if self.closed:
            return "attnrt.DcpAttention(closed)"
        return f"attnrt.DcpAttention(dcp_size={self.size}, device={self.device})"


class DcpRank(_DcpSteps):
    """One rank of a DCP group (see the module docstring): rank, dcp_size and the rank's
    communicator (nccl_communicator, wrap_nccl_comm or in_process_group); model, dtype, tp_size
    and the options as for Runtime. forward() writes the merged rows of this rank's heads only
    (head_range(layer_id)); the engine's next collective (e.g. the TP-sharded o_proj) takes them
    from there. Ranks over NCCL take GPU tensors; in-process ranks host tensors. A GPU rank runs
    on torch's current stream (its runtimes, kernels and the NCCL collectives: the communicator is
    moved to that stream), so forward() neither waits for the GPU nor needs the engine to."""

    def __init__(self, model: Any = "demo", *, rank: int, dcp_size: int, communicator,
                 dtype: Any = None, tp_size: int = 1, **kwargs):
        options, config = _options_and_config(kwargs, "DcpRank", ("rank", "dcp_size",
                                                                   "communicator"))
        if isinstance(dcp_size, bool) or not isinstance(dcp_size, int):
            raise TypeError(f"DcpRank: dcp_size={dcp_size!r}; it must be an integer")
        if not isinstance(communicator, _native.Communicator):
            raise TypeError(
                f"DcpRank: communicator is {type(communicator).__name__}; pass one made by "
                "attnrt.nccl_communicator, attnrt.wrap_nccl_comm or attnrt.in_process_group")
        if communicator.rank != rank:
            raise ValueError(
                f"DcpRank: rank={rank} but the communicator is rank {communicator.rank}'s of its "
                "group; pass this rank's communicator")
        options.dcp_size = dcp_size
        name, text = _model_source(model)
        self._g = _native.DcpRank(name, text, _dtype_name(dtype), int(tp_size), options, config,
                                  communicator)
        self._comm = communicator
        self._finish_init()

    @property
    def rank(self) -> int:
        return self._g.rank

    def head_range(self, layer_id: int) -> tuple[int, int]:
        """[begin, end): the q heads whose merged rows forward() writes on this rank."""
        return tuple(self._g.head_range(int(layer_id)))

    def synchronize(self) -> None:
        """Waits for the rank's GPU work (queued on the stream of its last call)."""
        self._g.synchronize()

    def __repr__(self) -> str:
        if self.closed:
            return "attnrt.DcpRank(closed)"
        return f"attnrt.DcpRank(rank={self.rank} of {self.size}, device={self.device})"
