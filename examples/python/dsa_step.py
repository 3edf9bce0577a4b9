"""DeepSeek-V3.2's sparse attention (DSA) from Python, as an engine drives it: every step hands a
DSA layer the indexer's inputs besides the MLA ones (index queries, the step's index keys, the
per-head weights), and reads back which cached tokens each query token attended (index_topk).
Requests of ragged lengths are prefilled in chunks (EXTEND over the cached prefix), then decoded;
on the backend auto-selected for this machine (cuda on a Hopper GPU, else cpu). With --check
every step also runs on the reference backend (float64), and the example reports how many
selections agree and the largest output difference.

    python examples/python/dsa_step.py                  # a small DSA layer, top 64
    python examples/python/dsa_step.py --check          # ... against reference
    python examples/python/dsa_step.py --preset         # DeepSeek-V3.2's layer (128 heads, top 2048)

docs/dsa.md has the math; docs/python.md "DSA layers" the arguments.
"""
import argparse
import sys
import time

import torch

import attnrt


def small_config(topk: int) -> dict:
    """A one-layer deepseek_v32 config: MLA with 16 heads over a 128 + 32 latent row, an indexer of
    16 heads x 64 dims (dims the tensor-core indexer takes) choosing `topk` tokens."""
    return {"model_type": "deepseek_v32", "num_hidden_layers": 1, "num_attention_heads": 16,
            "kv_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64,
            "v_head_dim": 64, "index_topk": topk, "index_n_heads": 16, "index_head_dim": 64,
            "rope_scaling": None, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


class Engine:
    """One runtime, its requests' slots, and the step loop an engine runs around it."""

    def __init__(self, model, backend, dtype, lens, chunk):
        opts = dict(page_size=64, max_requests=len(lens), kv_slots=sum(lens) + 64 * len(lens) + 256,
                    max_num_tokens=max(chunk * len(lens), 64))
        if backend is not None:
            opts["attention_backend"] = backend
        self.rt = attnrt.Runtime(model, dtype=dtype, **opts)
        self.layer = self.rt.layers[0]
        self.rows = [self.rt.alloc_request() for _ in lens]
        self.slots = [[] for _ in lens]

    def place(self, counts):
        """Slots for counts[i] new tokens of request i after its cached ones; the batch fields."""
        prefix = [len(s) for s in self.slots]
        locs = []
        for i, (p, n) in enumerate(zip(prefix, counts)):
            if n == 0:
                continue
            last = self.slots[i][-1] if p > 0 else -1
            loc = self.rt.alloc_extend([p], [p + n], [last])
            self.rt.write_req_to_token(self.rows[i], p, loc)
            self.slots[i] += loc
            locs += loc
        return prefix, locs

    def step(self, mode, counts, inputs):
        """One step of one DSA layer: returns its output and selections (on the host)."""
        live = [i for i, n in enumerate(counts) if n > 0]
        prefix, locs = self.place(counts)
        rows = [self.rows[i] for i in live]
        pre = [prefix[i] for i in live]
        new = [counts[i] for i in live]
        if mode == "DECODE":
            batch = attnrt.ForwardBatch("DECODE", rows, [p + 1 for p in pre], locs, positions=pre)
        else:
            batch = attnrt.ForwardBatch(
                "EXTEND", rows, [p + n for p, n in zip(pre, new)], locs, extend_prefix_lens=pre,
                extend_seq_lens=new, positions=[p + t for p, n in zip(pre, new) for t in range(n)])
        dev, dt = self.rt.device, self.rt.dtype
        q, latent, iq, ik, iw = inputs
        q, latent = q.to(dev, dt), latent.to(dev, dt)
        iq, ik, iw = iq.to(dev), ik.to(dev), iw.to(dev)
        T = q.shape[0]
        topk = torch.empty(T, self.layer["index_topk"], dtype=torch.int32, device=dev)
        self.rt.begin_step(batch)
        # The absorbed MLA form: q [T, heads, latent + rope], the step's latent rows [T, 1, same];
        # V is the latent part of the same rows. The indexer's tensors are float32.
        out = self.rt.forward(0, q, latent, latent[:, :, :self.layer["kv_lora_rank"]],
                              index_q=iq, index_k=ik, index_weights=iw, index_topk=topk)
        self.rt.end_step()
        return out.float().cpu(), topk.cpu()


def draw(layer, T, gen):
    """In an engine: this layer's projections of the step's hidden states."""
    h, row = layer["num_q_heads"], layer["head_dim"]
    ih, idim = layer["index_n_heads"], layer["index_head_dim"]
    return (torch.randn(T, h, row, generator=gen), torch.randn(T, 1, row, generator=gen),
            torch.randn(T, ih, idim, generator=gen), torch.randn(T, idim, generator=gen),
            torch.rand(T, ih, generator=gen))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", action="store_true",
                    help="DeepSeek-V3.2's layer (128 q heads, 576-wide latent rows, an indexer of "
                         "64 heads x 128 choosing 2048 tokens) instead of the small one")
    ap.add_argument("--topk", type=int, default=64, help="index_topk of the small layer")
    ap.add_argument("--lens", default="300,97,180",
                    help="prompt length of each request (comma-separated)")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk per request and step")
    ap.add_argument("--decodes", type=int, default=4, help="decode steps after the prompts")
    ap.add_argument("--backend", default=None, help="attention backend (default: auto)")
    ap.add_argument("--check", action="store_true", help="also run every step on reference")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    lens = [int(x) for x in a.lens.split(",")]
    model = "deepseek-v3.2" if a.preset else small_config(a.topk)
    gen = torch.Generator().manual_seed(a.seed)
    eng = Engine(model, a.backend, torch.bfloat16, lens, a.chunk)
    ref = Engine(model, "reference", torch.float32, lens, a.chunk) if a.check else None
    for reason in eng.rt.selection["reasons"]:
        print(reason)
    layer = eng.layer
    print(f"layer 0: {layer['num_q_heads']} q heads, latent rows of {layer['head_dim']}, indexer "
          f"{layer['index_n_heads']} heads x {layer['index_head_dim']}, top {layer['index_topk']}")

    done = [0] * len(lens)
    steps = []
    while any(d < n for d, n in zip(done, lens)):  # chunked prefill
        counts = [min(a.chunk, n - d) for d, n in zip(done, lens)]
        steps.append(("EXTEND", counts))
        done = [d + c for d, c in zip(done, counts)]
    steps += [("DECODE", [1] * len(lens))] * a.decodes

    agree = total = 0
    worst = 0.0
    for mode, counts in steps:
        inputs = draw(layer, sum(counts), gen)
        t0 = time.perf_counter()
        out, topk = eng.step(mode, counts, inputs)
        ms = (time.perf_counter() - t0) * 1e3
        chosen = (topk >= 0).sum(dim=1)
        line = (f"{mode:<7} {sum(counts):4d} tokens, each attends {int(chosen.min())}.."
                f"{int(chosen.max())} selected keys, {ms:7.1f} ms")
        if ref is not None:
            want, want_topk = ref.step(mode, counts, inputs)
            same = (torch.sort(topk, dim=1).values == torch.sort(want_topk, dim=1).values).all(1)
            agree += int(same.sum())
            total += same.numel()
            diff = (out - want).abs().max().item()
            worst = max(worst, diff)
            line += f"; reference: {int(same.sum())}/{same.numel()} selections equal, " \
                    f"largest difference {diff:.2e}"
        print(line)
    if ref is not None:
        # Scores within rounding of each other can swap places at the cut between backends
        # (fp32 sums in another order); a swapped token changes that row's output a little.
        print(f"selections equal to reference for {agree} of {total} query tokens; largest output "
              f"difference {worst:.2e}")
        if worst > 0.1 or agree < 0.95 * total:
            print("FAILED: more than rounding apart from reference", file=sys.stderr)
            return 1
        ref.rt.close()
    eng.rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
