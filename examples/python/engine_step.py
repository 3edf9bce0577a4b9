"""How an engine drives attnrt from Python: one request is prefilled in two chunks (the second on
top of the cached first), then decoded for a few steps, on the backend auto-selected for this
machine (the Python twin of examples/engine_step.cpp). Tensors are torch tensors on the runtime's
device (the GPU when the cuda backend was chosen, else the CPU).

    python examples/python/engine_step.py
"""
import sys

import torch

import attnrt


def run_layers(rt: attnrt.Runtime, tokens: int, gen: torch.Generator) -> None:
    """Every attention layer of the model for the step in progress."""
    for layer_id, layer in rt.layers.items():
        hq, hkv = layer["num_q_heads"], layer["num_kv_heads"]
        d, dv = layer["head_dim"], layer["v_head_dim"]

        # In an engine: the projections of this layer's hidden states.
        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(rt.device, rt.dtype)

        q, k, v = rand(tokens, hq, d), rand(tokens, hkv, d), rand(tokens, hkv, dv)
        out = rt.forward(layer_id, q, k, v)  # stores k / v at out_cache_loc, then attends
        assert out.shape == (tokens, hq, dv) and torch.isfinite(out.float()).all()


def main() -> int:
    gen = torch.Generator().manual_seed(7)
    # attention_backend unset: auto-select (cuda on a Hopper GPU, else cpu).
    rt = attnrt.Runtime("demo", page_size=16, max_requests=4, kv_slots=4096)
    for reason in rt.selection["reasons"]:
        print(reason)
    print(rt)

    available_at_start = rt.available_slots
    row = rt.alloc_request()
    slots: list[int] = []  # the request's KV slots, position by position
    prompt, chunk, decode_steps = 300, 200, 4

    # Chunked prefill: EXTEND steps, the second one with a cached prefix of `chunk` tokens.
    for start in range(0, prompt, chunk):
        n = min(chunk, prompt - start)
        loc = rt.alloc_extend([start], [start + n], [slots[-1] if slots else -1])
        rt.write_req_to_token(row, start, loc)  # the mapping is written before the forward
        slots += loc
        rt.begin_step(attnrt.ForwardBatch(
            forward_mode="EXTEND", req_pool_indices=[row], seq_lens=[start + n],
            extend_prefix_lens=[start], extend_seq_lens=[n], out_cache_loc=loc,
            positions=list(range(start, start + n))))
        run_layers(rt, n, gen)
        rt.end_step()
        print(f"EXTEND  prefix {start:4d} + {n:3d} new tokens")

    # DECODE steps: seq_lens include the token being decoded.
    for _ in range(decode_steps):
        seq_len = len(slots) + 1
        loc = rt.alloc_decode([seq_len], [slots[-1]])
        rt.write_req_to_token(row, seq_len - 1, loc)
        slots += loc
        rt.begin_step(attnrt.ForwardBatch(
            forward_mode="DECODE", req_pool_indices=[row], seq_lens=[seq_len], out_cache_loc=loc,
            positions=[seq_len - 1]))
        run_layers(rt, 1, gen)
        rt.end_step()
        print(f"DECODE  seq_len {seq_len}")

    rt.synchronize()
    rt.free_slots(slots)  # the request ends: its pages go back to the pool
    rt.free_request(row)
    available_at_end = rt.available_slots
    print(f"done: {available_at_end} of {available_at_start} KV slots available again")
    rt.close()
    return 0 if available_at_end == available_at_start else 1


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
