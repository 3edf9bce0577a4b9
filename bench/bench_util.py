"""What the torch side-by-side scripts (torch_sdpa.py, torch_linear.py) share: reading an attnrt
bench report, the cache eviction before each repetition (written, or on a GPU read with --flush
clean), the timing loop (CUDA events on a GPU, perf_counter on the CPU), the timing figures of a
row, and the options that pick and time rows."""
import json
import os
import statistics
import sys
import time

FLUSH_MODES = ("write", "clean")


def read_attnrt_report(path):
    """The attnrt bench JSON at `path`; exits with the reason when it is not one."""
    with open(path) as f:
        report = json.load(f)
    if report.get("schema") != "attnrt-bench/1":
        sys.exit(f"{path}: not an attnrt bench report (schema {report.get('schema')!r})")
    return report


def llc_bytes():
    """The largest CPU cache (bytes), 32 MiB when sysfs does not say."""
    best = 0
    for i in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{i}/size") as f:
                t = f.read().strip()
        except OSError:
            continue
        v = int(t.rstrip("KMG"))
        v <<= {"K": 10, "M": 20, "G": 30}.get(t[-1], 0)
        best = max(best, v)
    return best or (32 << 20)


def make_flush(torch, device, mode):
    """The cache eviction run before each timed repetition (untimed), as `attnrt bench` does. On a
    GPU a 256 MiB tensor (5x the H200's L2), written (mode "write": add 1, which leaves the L2 full
    of dirty lines whose write-back the timed call pays) or read (mode "clean": its max, one scalar
    written, which leaves only clean lines); on the CPU a tensor of twice the last-level cache,
    written (the CPU flush of `attnrt bench` writes too)."""
    if device == "cuda":
        buf = torch.zeros((256 << 20) // 4, dtype=torch.float32, device="cuda")
    else:
        buf = torch.zeros(2 * llc_bytes() // 4, dtype=torch.float32)
    if mode == "clean":
        return lambda: buf.max()
    return lambda: buf.add_(1)


def time_calls(torch, call, device, warmup, repeats, flush, lead_us: float = 0):
    """Seconds per call, sorted: `warmup` untimed calls, then `repeats` timed ones, each after
    `flush()` (make_flush: evicts the caches). lead_us > 0 (GPU): a spin of that long is queued
    after the flush, so the call's launch is issued while the GPU is still busy and the timed
    region holds GPU time only (no wait for the host)."""
    cuda = device == "cuda"
    with torch.no_grad():
        for _ in range(warmup):
            call()
        if cuda:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(repeats):
            flush()
            if cuda:
                if lead_us > 0:
                    torch.cuda._sleep(int(lead_us * 2000))  # ~2 cycles per ns at H200 clocks
                start.record()
                call()
                stop.record()
                stop.synchronize()
                samples.append(start.elapsed_time(stop) * 1e-3)
            else:
                t0 = time.perf_counter()
                call()
                samples.append(time.perf_counter() - t0)
    return sorted(samples)


def timing_ms(samples):
    """The JSON timing of sorted per-call seconds, in ms: median, extremes, p10 / p90 (linear
    interpolation between samples), count."""
    def quantile(f):
        pos = f * (len(samples) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(samples) - 1)
        return samples[lo] + (samples[hi] - samples[lo]) * (pos - lo)

    return {"median": statistics.median(samples) * 1e3, "min": samples[0] * 1e3,
            "max": samples[-1] * 1e3, "p10": quantile(0.1) * 1e3, "p90": quantile(0.9) * 1e3,
            "repeats": len(samples)}


def add_row_args(ap, from_help, workload_help, scale_help):
    """The options every torch bench script takes to pick and time its rows."""
    ap.add_argument("--from", dest="source", help=from_help)
    ap.add_argument("--workload", default="all", help=workload_help)
    ap.add_argument("--scale", type=float, default=1.0, help=scale_help)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads; 0 = ATTNRT_NUM_THREADS, else every core")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--flush", choices=FLUSH_MODES,
                    help="with --device cuda, how the L2 is evicted before each repetition: write "
                         "(a 256 MiB tensor written, as attnrt bench does by default) or clean (the "
                         "tensor read, so the L2 holds no dirty lines); default ATTNRT_BENCH_FLUSH, "
                         "else write. The CPU's caches are always evicted by writing")


def check_row_args(ap, args):
    if args.flush is None:
        env = os.environ.get("ATTNRT_BENCH_FLUSH", "")
        if env not in ("",) + FLUSH_MODES:
            ap.error(f"ATTNRT_BENCH_FLUSH={env} is invalid; use write or clean")
        # attnrt bench reads ATTNRT_BENCH_FLUSH on a GPU only; so does this script.
        args.flush = env if env and args.device == "cuda" else "write"
    elif args.flush == "clean" and args.device != "cuda":
        ap.error("--flush clean: only with --device cuda (the CPU's caches are evicted by writing, "
                 "as attnrt bench does)")
    if not 0 < args.scale <= 1:
        ap.error(f"--scale {args.scale} is out of range: use a factor in (0, 1]")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} is invalid: use at least 1")
