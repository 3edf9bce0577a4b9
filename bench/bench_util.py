"""What the torch side-by-side scripts (torch_sdpa.py, torch_linear.py) share: reading an attnrt
bench report, the cache eviction before each repetition (written, or on a GPU read with --flush
clean), the timing loop (CUDA events on a GPU, perf_counter on the CPU), the timing figures of a
row, the options that pick and time rows, torch's thread count and device, and the CPU's name."""
import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

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


def row_parser(doc):
    """The argument parser of a torch bench script whose module docstring is `doc`: its first line
    is the description, what follows the first paragraph break the epilog."""
    return argparse.ArgumentParser(description=doc.split("\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=doc.split("\n", 2)[2])


def add_row_args(ap, from_help, workload_help, scale_help, device_help=None):
    """The options every torch bench script takes to pick and time its rows, and --device (cpu or
    cuda), which check_row_args reads too."""
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
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help=device_help)


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


def import_torch():
    """torch and torch.nn.functional; exits saying how to install torch when it is missing."""
    # torch warns at import when NumPy is absent; nothing here uses NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        sys.exit("torch is not installed: `pip install torch` (the CPU build is enough), then rerun")
    return torch, F


def set_torch_threads(torch, requested):
    """Sets and returns torch's thread count: `requested`, else ATTNRT_NUM_THREADS, else every core
    (as attnrt bench counts them)."""
    threads = requested or int(os.environ.get("ATTNRT_NUM_THREADS", "0") or 0) or os.cpu_count()
    torch.set_num_threads(threads)
    return threads


def check_torch_device(torch, device):
    """Exits with the reason when `device` is cuda and this torch has no usable CUDA device."""
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: this torch has no usable CUDA device "
                 f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")


def cpu_model():
    """The CPU's model name from /proc/cpuinfo, else what platform.processor() says."""
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return name


def write_report(args, head, threads, rows):
    """Writes `rows` to args.json (nothing without --json) as an attnrt-bench/1 report: `head` (what
    ran: implementation, versions, device, ...), then the threads, the flush mode, the attnrt
    report the rows came from and the machine."""
    if not args.json:
        return
    report = {
        "schema": "attnrt-bench/1",
        **head,
        "threads": threads,
        "flush": args.flush,
        "source": args.source,
        "machine": {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count()},
        "rows": rows,
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)


def device_name(torch, device):
    """"cpu", or the name of the CUDA device."""
    return device if device == "cpu" else torch.cuda.get_device_name()
