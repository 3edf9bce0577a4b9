"""attnrt: the attention layer of an LLM serving engine, for PyTorch engines.

    import attnrt
    rt = attnrt.Runtime("llama3-8b", attention_backend="cuda", page_size=16)
    rt.begin_step(batch)                 # once per forward step
    out = rt.forward(layer_id, q, k, v)  # every attention layer: stores k/v, attends
    rt.end_step()

torch tensors pass through DLPack without copies; see docs/python.md.
"""
from ._native import Error
from ._native import version as _native_version

__version__ = _native_version()

from .runtime import Runtime, ForwardBatch, SpecInfo, cuda_status, presets  # noqa: E402
from .engine import AttnrtBackend  # noqa: E402
from .dcp import (DcpAttention, DcpRank, in_process_group, nccl_communicator,  # noqa: E402
                  nccl_unique_id, wrap_nccl_comm)

__all__ = ["Error", "Runtime", "AttnrtBackend", "ForwardBatch", "SpecInfo", "cuda_status",
           "presets", "DcpAttention", "DcpRank", "in_process_group", "nccl_communicator",
           "nccl_unique_id", "wrap_nccl_comm", "__version__"]
