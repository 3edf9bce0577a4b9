#!/usr/bin/env python3
"""Times the torch chunked scan of HuggingFace transformers' Mamba2 (Mamba2Mixer.torch_forward, the
path taken without the mamba_ssm kernels) at the Nemotron-H-8B mixer shape: hidden 4096, 128 heads x
head_dim 64, d_state 128, 8 groups, chunk 128, bf16 weights. The attnrt counterpart is
CudaLinearSsd.ThroughputNemotronShape (tests/test_cuda_linear_ssd.cpp).

torch_forward also runs the in / out projections, the conv and the gated norm; those are timed on
their own with the mixer's modules and subtracted, so the "scan" column is the chunked SSD alone.
Lengths whose segment-sum tensors do not fit in GPU memory are reported as OOM.

usage: bench/torch_mamba2_scan.py [--lengths 8192,4096] [--batches 1,8] [--repeat 3]
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,4096,2048")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import torch
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    cfg = Mamba2Config(hidden_size=4096, num_heads=128, head_dim=64, n_groups=8, state_size=128,
                       expand=2, chunk_size=128, conv_kernel=4, num_hidden_layers=1)
    dev = torch.device("cuda")
    with torch.device(dev):
        mixer = Mamba2Mixer(cfg, layer_idx=0).to(torch.bfloat16).eval()

    def timed(fn, repeat):
        fn()
        torch.cuda.synchronize()
        ms = []
        for _ in range(repeat):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            ms.append(e0.elapsed_time(e1))
        ms.sort()
        return ms[len(ms) // 2]

    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        for t in [int(x) for x in args.lengths.split(",")]:
            row = {"batch": b, "len": t}
            try:
                hs = torch.randn(b, t, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
                inter = mixer.intermediate_size
                conv_dim = inter + 2 * cfg.n_groups * cfg.state_size

                def rest():
                    proj = mixer.in_proj(hs)
                    gate = proj[..., :inter]
                    xbc = proj[..., inter:inter + conv_dim]
                    xbc = mixer.act(mixer.conv1d(xbc.transpose(1, 2))[..., :t].transpose(1, 2))
                    y = mixer.norm(xbc[..., :inter].contiguous(), gate)
                    return mixer.out_proj(y)

                with torch.inference_mode():
                    total = timed(lambda: mixer.torch_forward(hs), args.repeat)
                    other = timed(rest, args.repeat)
                row.update(total_ms=total, other_ms=other, scan_ms=total - other)
            except torch.cuda.OutOfMemoryError:
                row["oom"] = True
            except Exception as e:  # report, keep going with the other shapes
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
