"""What the torch side-by-side scripts (torch_sdpa.py, torch_linear.py) share: reading an attnrt
bench report, the size of the cache to evict between repetitions, the timing loop (CUDA events
on a GPU, perf_counter on the CPU, the eviction buffer written before each repetition), the timing
figures of a row, and the options that pick and time rows."""
import json
import statistics
import sys
import time


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


def time_calls(torch, call, device, warmup, repeats, flush):
    """Seconds per call, sorted: `warmup` untimed calls, then `repeats` timed ones, each after
    writing `flush` (evicting the caches)."""
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
            flush.add_(1)
            if cuda:
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


def check_row_args(ap, args):
    if not 0 < args.scale <= 1:
        ap.error(f"--scale {args.scale} is out of range: use a factor in (0, 1]")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} is invalid: use at least 1")
