"""Decode context parallelism (docs/dcp.md): long-context requests whose KV cache is split over N
ranks (token g on rank g mod N). Every rank prefills its share in chunks, then decodes; each layer's
partial outputs are exchanged and merged exactly, and every rank checks the rows of its heads
against one Runtime that holds the whole cache.

    python examples/python/dcp_decode.py --ranks 2
        N host ranks on threads of this process (attnrt.in_process_group), cpu backend
    torchrun --nproc-per-node 2 examples/python/dcp_decode.py --nccl
        a process per GPU over NCCL (attnrt.nccl_unique_id made on rank 0 and broadcast with
        torch.distributed; cuda backend, page_size 16)

Prints each rank's prefill and decode times, the decode tokens/s and the largest difference from
the single runtime; exits 1 if it is beyond the tolerance.
"""
import argparse
import os
import sys
import threading
import time

import torch

import attnrt


def model_config(layers: int) -> dict:
    # A Llama-3-8B attention layer (32 q heads, 8 kv heads, head dim 128); no weights are needed.
    return {"model_type": "llama", "num_hidden_layers": layers, "num_attention_heads": 32,
            "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
            "max_position_embeddings": 1 << 20, "torch_dtype": "bfloat16"}


def layer_inputs(layers: dict, tokens: int, step: int, device, dtype):
    """q, k, v of every layer for one step: the same on every rank (drawn from the step's seed), as
    every rank of a DCP group sees the whole step's activations."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for info in layers.values():
        h, kv, d = info["num_q_heads"], info["num_kv_heads"], info["head_dim"]
        out.append(tuple(torch.randn(*shape, generator=gen).to(device, dtype)
                         for shape in ((tokens, h, d), (tokens, kv, d), (tokens, kv, d))))
    return out


class Single:
    """The oracle: one Runtime holding every token (the engine's own req_to_token bookkeeping)."""

    def __init__(self, cfg, opts, batch, context):
        self.rt = attnrt.Runtime(cfg, **opts, max_requests=batch,
                                 kv_slots=batch * (context + 64) + 64)
        self.rows = [self.rt.alloc_request() for _ in range(batch)]
        self.lens = [0] * batch

    def batch(self, counts):
        prefix = list(self.lens)
        last = [int(self.rt.req_to_token[r, p - 1]) if p else -1 for r, p in zip(self.rows, prefix)]
        slots = self.rt.alloc_extend(prefix, [p + n for p, n in zip(prefix, counts)], last)
        at = 0
        for r, p, n in zip(self.rows, prefix, counts):
            self.rt.write_req_to_token(r, p, slots[at:at + n])
            at += n
        self.lens = [p + n for p, n in zip(prefix, counts)]
        positions = [p + t for p, n in zip(prefix, counts) for t in range(n)]
        if all(n == 1 for n in counts):
            return attnrt.ForwardBatch("DECODE", self.rows, self.lens, slots, positions=positions)
        return attnrt.ForwardBatch("EXTEND", self.rows, self.lens, slots,
                                   extend_prefix_lens=prefix, extend_seq_lens=counts,
                                   positions=positions)


def run_rank(rank: int, size: int, comm, args, device, report: dict) -> None:
    cfg = model_config(args.layers)
    opts = dict(dtype=torch.bfloat16, attention_backend="cuda" if args.nccl else "cpu",
                page_size=16)
    dcp = attnrt.DcpRank(cfg, rank=rank, dcp_size=size, communicator=comm, **opts,
                         max_requests=args.batch, max_num_tokens=args.batch * args.chunk,
                         max_context_len=args.context + args.steps + 1)
    single = Single(cfg, opts, args.batch, args.context + args.steps + 1)
    layers = dcp.layers
    worst = 0.0
    times = {"prefill": 0.0, "decode": 0.0}
    steps = [("prefill", [args.chunk] * args.batch)] * (args.context // args.chunk)
    steps += [("decode", [1] * args.batch)] * args.steps
    for i, (phase, counts) in enumerate(steps):
        batch = single.batch(counts)
        tokens = sum(counts)
        inputs = layer_inputs(layers, tokens, i, device, torch.bfloat16)
        outs = [torch.full((tokens, l["num_q_heads"], l["v_head_dim"]), float("nan"),
                           device=device, dtype=torch.bfloat16) for l in layers.values()]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dcp.begin_step(batch)
        for layer, (q, k, v) in enumerate(inputs):
            dcp.forward(layer, q, k, v, outs[layer])
        dcp.end_step()
        dcp.synchronize()
        times[phase] += time.perf_counter() - t0
        # The oracle on the same inputs; this rank checks the heads it merged.
        single.rt.begin_step(batch)
        for layer, (q, k, v) in enumerate(inputs):
            want = single.rt.forward(layer, q, k, v)
            h0, h1 = dcp.head_range(layer)
            diff = (want[:, h0:h1].float() - outs[layer][:, h0:h1].float()).abs().max().item()
            worst = max(worst, diff)
        single.rt.end_step()
        if rank == 0 and (i + 1) % max(1, len(steps) // 8) == 0:
            print(f"  step {i + 1}/{len(steps)} ({phase})", flush=True)
    report[rank] = (times, worst)
    dcp.close()
    single.rt.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="host ranks on threads (without --nccl)")
    p.add_argument("--nccl", action="store_true",
                   help="a process per GPU over NCCL (launch with torchrun)")
    p.add_argument("--batch", type=int, default=2, help="requests")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per request)")
    p.add_argument("--steps", type=int, default=8, help="decode steps")
    p.add_argument("--layers", type=int, default=2, help="attention layers")
    args = p.parse_args()
    if args.context % args.chunk:
        p.error(f"--context {args.context} must be a multiple of --chunk {args.chunk}")
    report: dict = {}
    if args.nccl:
        import torch.distributed as dist

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dist.init_process_group("gloo")
        uid = [attnrt.nccl_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(uid, src=0)  # the engine hands the id over by its own means
        comm = attnrt.nccl_communicator(uid[0], size, rank, device=local)
        run_rank(rank, size, comm, args, torch.device("cuda", local), report)
        gathered = [None] * size
        dist.all_gather_object(gathered, report[rank])
        report = dict(enumerate(gathered))
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        size = args.ranks
        comms = attnrt.in_process_group(size)
        errors = []

        def thread(r):
            try:
                run_rank(r, size, comms[r], args, torch.device("cpu"), report)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append((r, e))

        threads = [threading.Thread(target=thread, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            r, e = errors[0]
            raise RuntimeError(f"rank {r} failed: {e}") from e
    tokens = args.batch * args.steps
    worst = max(w for _, w in report.values())
    for r in sorted(report):
        times, w = report[r]
        print(f"rank {r}: prefill {times['prefill'] * 1e3:.1f} ms, decode "
              f"{times['decode'] * 1e3:.1f} ms ({tokens / times['decode']:.1f} tokens/s), "
              f"largest difference {w:.2e}")
    tolerance = 2e-2  # bf16 outputs
    verdict = "within" if worst <= tolerance else "BEYOND"
    print(f"dcp_size {size}: {args.batch} requests x {args.context} tokens, largest difference "
          f"from one runtime {worst:.2e} ({verdict} the bf16 tolerance {tolerance})")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
