"""What the torch side-by-side scripts (torch_sdpa.py, torch_linear.py) share: reading an attnrt
bench report, the size of the cache to evict between repetitions, and the timing loop (CUDA events
on a GPU, perf_counter on the CPU, the eviction buffer written before each repetition)."""
import json
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
