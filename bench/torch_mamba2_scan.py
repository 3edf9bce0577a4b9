#!/usr/bin/env python3
"""Times the torch chunked scan of HuggingFace transformers' Mamba2 (`mamba2_chunk_scan` of
transformers.models.mamba2.modeling_mamba2, the torch path Mamba2Mixer takes without the mamba_ssm
kernels: it materialises the per-chunk segment sums and C B^T for every head) at the Nemotron-H-8B
mixer shape: 128 heads x head_dim 64, d_state 128, 8 groups, chunk 128; bf16 x / dt / B / C, fp32
A, D, dt_bias; softplus(dt + dt_bias) and the final states included, as in attnrt's
launch_ssd_chunked (tests/test_cuda_linear_ssd.cpp, CudaLinearSsd.ThroughputNemotronShape).
Prints one JSON line per (batch, length); shapes that do not fit in memory report "oom".

usage: bench/torch_mamba2_scan.py [--device cuda] [--batches 1,8] [--lengths 8192] [--repeat 3]
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--lengths", default="8192")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--d-state", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=128)
    args = ap.parse_args()
    import torch
    import transformers
    from transformers.models.mamba2 import modeling_mamba2

    scan = modeling_mamba2.mamba2_chunk_scan
    scan = getattr(scan, "__wrapped__", scan)  # the torch function, never a hub / mamba_ssm kernel
    dev = torch.device(args.device)
    H, G, P, N, Q = args.heads, args.groups, args.head_dim, args.d_state, args.chunk

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        fn()
        sync()
        ms = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn()
            sync()
            ms.append((time.perf_counter() - t0) * 1e3)
        ms.sort()
        return ms[len(ms) // 2]

    gen = torch.Generator(device=dev).manual_seed(0)
    A = -torch.rand(H, device=dev, generator=gen) * 4 - 0.5
    D = torch.rand(H, device=dev, generator=gen) + 0.5
    dt_bias = torch.rand(H, device=dev, generator=gen) - 0.5
    for b in [int(x) for x in args.batches.split(",")]:
        for t in [int(x) for x in args.lengths.split(",")]:
            row = {"impl": f"transformers {transformers.__version__} mamba2_chunk_scan",
                   "device": str(dev), "batch": b, "len": t, "heads": H, "head_dim": P,
                   "d_state": N, "groups": G, "chunk": Q}
            x = dt = B = C = None
            try:
                bf = torch.bfloat16
                x = torch.rand(b, t, H, P, device=dev, generator=gen).to(bf) * 2 - 1
                dt = (torch.rand(b, t, H, device=dev, generator=gen) * 3 - 4).to(bf)
                B = (torch.rand(b, t, G, N, device=dev, generator=gen) * 2 - 1).to(bf)
                C = (torch.rand(b, t, G, N, device=dev, generator=gen) * 2 - 1).to(bf)
                with torch.inference_mode():
                    ms = timed(lambda: scan(x, dt, A, B, C, Q, D=D, dt_bias=dt_bias,
                                            dt_softplus=True, return_final_states=True))
                row.update(ms=ms, tokens_per_s=b * t / (ms * 1e-3))
            except torch.OutOfMemoryError:
                row["oom"] = True
            x = dt = B = C = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
