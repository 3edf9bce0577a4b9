"""What the Python binding adds to attnrt's C++ calls, measured on the CPU (cpu backend, tiny
shapes, so the C++ work is short and steady).

(a) forward(): one attention call through the Python wrapper (attnrt.Runtime.forward) and through
    the native method it calls (attnrt._native.Runtime.forward), in an IDLE step with 0-token
    tensors, where the C++ forward returns at once: the native figure is then the binding's own
    cost (nanobind's dispatch plus reading q, k, v, out through torch's DLPack C exchange table,
    Tensor.__dlpack_c_exchange_api__), the wrapper's the whole Python cost over C++. For scale:
    a native method without arguments (dispatch), one tensor through nanobind's __dlpack__
    import, the path of non-torch arrays (free_slots of an empty tensor minus free_slots(None)),
    torch's Tensor.__dlpack__ (what that import calls), and the exchange table's
    dltensor_from_py_object_no_sync called through ctypes (ctypes' own call cost included, so an
    upper bound). Also a DECODE of one
    request over 16 cached tokens (the kernel runs too).
(b) begin_step + end_step of a DECODE step of 256 requests (page 16) at 2048 tokens (the shape of
    bench/plan_bench.cpp's rows) and at 16 tokens (little C++ work, so the difference is sharp):
    through the wrapper with the batch fields as torch CPU tensors (an engine's *_cpu fields),
    numpy arrays or lists; through the native method with the same tensors; the native IDLE step
    (empty tensors: the binding's fixed cost); and the wrapper's field conversions alone. The
    C++ side, when build/attnrt_plan_bench exists: make_step_layout (in place) and the host KV
    cache's begin_step for the 256 x 2048 batch (what AttentionRuntime::begin_step does around
    the backend's plan) and the cuda backend's host plan, for scale.

Rows of one group are timed in interleaved rounds (--repeats rounds of --number calls each), so a
difference between two rows is the median of per-round differences, robust to a machine whose
load changes. The Python loop's own cost (a lambda returning None) is subtracted from every row.
Targets: at most 2 us per forward and 3 us per planned step (batch 256) over the C++ calls.

    python bench/python_overhead.py [--quick] [--json out.json] [--plan-bench build/attnrt_plan_bench]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see examples/python/serve.py

import numpy as np  # noqa: E402
import torch  # noqa: E402

import attnrt  # noqa: E402

TARGET_FORWARD_US = 2.0
TARGET_STEP_US = 3.0
BATCH, PAGE = 256, 16
LONG, SHORT = 2048, 16
HQ, HKV, D = 4, 1, 16


def tiny_model() -> dict:
    return {"model_type": "llama", "_name_or_path": "overhead-tiny", "num_hidden_layers": 1,
            "hidden_size": HQ * D, "num_attention_heads": HQ, "num_key_value_heads": HKV,
            "head_dim": D, "max_position_embeddings": LONG + PAGE, "torch_dtype": "bfloat16"}


class Timer:
    def __init__(self, number: int, repeats: int):
        self.number, self.repeats = number, repeats
        self.baseline = 0.0
        self.baseline = self.group({"loop": lambda: None})["loop"]["median_us"]

    def group(self, fns: dict, number: int | None = None) -> dict:
        """Per-call microseconds of every function, timed in interleaved rounds."""
        number = number or self.number
        rows, ok = {}, {}
        for name, fn in fns.items():
            try:
                for _ in range(max(number // 10, 3)):  # warm-up; a failing call is a finding
                    fn()
                ok[name] = fn
            except Exception as e:  # noqa: BLE001
                rows[name] = {"error": f"{type(e).__name__}: {e}"}
        samples = {name: [] for name in ok}
        names = list(ok)
        gc.disable()
        try:
            for r in range(self.repeats):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    fn = ok[name]
                    t0 = time.perf_counter_ns()
                    for _ in itertools.repeat(None, number):
                        fn()
                    samples[name].append((time.perf_counter_ns() - t0) / number / 1e3 - self.baseline)
        finally:
            gc.enable()
        for name, s in samples.items():
            rows[name] = {"median_us": statistics.median(s), "min_us": min(s), "number": number,
                          "samples_us": s}
        return rows


def diff(rows: dict, a: str, b: str) -> float | None:
    """Median over rounds of rows[a] - rows[b] (same group)."""
    if "samples_us" not in rows.get(a, {}) or "samples_us" not in rows.get(b, {}):
        return None
    return statistics.median(x - y for x, y in zip(rows[a]["samples_us"], rows[b]["samples_us"]))


def native_begin(nrt):
    """The native begin_step (builds with engine CUDA graphs take two more arguments)."""
    if "kind" in (nrt.begin_step.__doc__ or ""):
        return lambda mode, rows, seq, loc, pos: nrt.begin_step(
            mode, rows, seq, None, None, loc, pos, 0, 1, None, None, 0, 0)
    return lambda mode, rows, seq, loc, pos: nrt.begin_step(
        mode, rows, seq, None, None, loc, pos, 0, 1, None, None)


def exchange_api_call(t: torch.Tensor):
    """A call of torch's dltensor_from_py_object_no_sync through ctypes, or None."""
    capsule = getattr(type(t), "__dlpack_c_exchange_api__", None)
    if capsule is None:
        return None

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                    ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                    ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                    ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                    ("byte_offset", ctypes.c_uint64)]

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    api = get(capsule, b"dlpack_exchange_api")
    # DLPackExchangeAPI: header {version (2 x u32), prev_api}, then managed_tensor_allocator,
    # managed_tensor_from_py_object_no_sync, managed_tensor_to_py_object_no_sync,
    # dltensor_from_py_object_no_sync, current_work_stream.
    table = (ctypes.c_void_p * 7).from_address(api)
    if not table[5]:
        return None
    fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(DLTensor))(table[5])
    out = DLTensor()
    ref = ctypes.byref(out)
    if fn(t, ref) != 0 or out.data != t.data_ptr():
        return None
    return lambda: fn(t, ref)


def measure_forward(timer: Timer) -> dict:
    rt = attnrt.Runtime(tiny_model(), attention_backend="cpu", num_threads=1, page_size=PAGE,
                        max_requests=4, kv_slots=4096)
    nrt = rt._rt
    empty = torch.zeros(0, dtype=torch.int64)
    q1 = torch.randn(1, HQ, D).to(torch.bfloat16)
    parts = {
        "nanobind_call": nrt.synchronize,
        "free_slots_none": lambda: nrt.free_slots(None),
        "free_slots_tensor": lambda: nrt.free_slots(empty),
        "torch_dlpack_export": q1.__dlpack__,
    }
    xapi = exchange_api_call(q1)
    if xapi is not None:
        parts["exchange_api_ctypes"] = xapi
    rows = {"parts": timer.group(parts)}

    q0, kv0 = torch.zeros(0, HQ, D, dtype=torch.bfloat16), torch.zeros(0, HKV, D, dtype=torch.bfloat16)
    o0 = torch.zeros(0, HQ, D, dtype=torch.bfloat16)
    q0f, kv0f = q0.view(0, HQ * D), kv0.view(0, HKV * D)
    rt.begin_step(attnrt.ForwardBatch("IDLE", empty, empty, empty))
    rows["idle"] = timer.group({
        "native_forward_idle": lambda: nrt.forward(0, q0, kv0, kv0, o0, True, None, None),
        "wrapper_forward_idle": lambda: rt.forward(0, q0, kv0, kv0, o0),
        "wrapper_forward_idle_new_out": lambda: rt.forward(0, q0, kv0, kv0),
        "wrapper_forward_idle_flat": lambda: rt.forward(0, q0f, kv0f, kv0f, o0),
    })
    rt.end_step()

    row = rt.alloc_request()
    slots = rt.alloc_extend([0], [16], [-1])
    rt.write_req_to_token(row, 0, slots)
    k1 = torch.randn(1, HKV, D).to(torch.bfloat16)
    o1 = torch.empty(1, HQ, D, dtype=torch.bfloat16)
    rt.begin_step(attnrt.ForwardBatch("DECODE", [row], [16], [slots[-1]], positions=[15]))
    rows["decode"] = timer.group({
        "native_forward_decode": lambda: nrt.forward(0, q1, k1, k1, o1, True, None, None),
        "wrapper_forward_decode": lambda: rt.forward(0, q1, k1, k1, o1),
    })
    rt.end_step()
    rt.close()
    return rows


def measure_step(timer: Timer) -> dict:
    rt = attnrt.Runtime(tiny_model(), attention_backend="cpu", num_threads=1, page_size=PAGE,
                        max_requests=2 * BATCH, kv_slots=BATCH * (LONG + SHORT + 2 * PAGE),
                        max_num_tokens=BATCH, max_context_len=LONG + PAGE)
    nrt = rt._rt
    begin = native_begin(nrt)
    from attnrt.runtime import _host_ints, _mode_name

    out = {}
    e = torch.zeros(0, dtype=torch.int64)
    for seq in (LONG, SHORT):
        req = [rt.alloc_request() for _ in range(BATCH)]
        loc_all = rt.alloc_extend([0] * BATCH, [seq] * BATCH, [-1] * BATCH)
        for i, r in enumerate(req):
            rt.write_req_to_token(r, 0, loc_all[i * seq:(i + 1) * seq])
        # A DECODE step whose new token is each request's last position (its slot is in the table).
        fields = (np.asarray(req, dtype=np.int64), np.full(BATCH, seq, dtype=np.int64),
                  np.asarray(loc_all[seq - 1::seq], dtype=np.int64),
                  np.full(BATCH, seq - 1, dtype=np.int64))
        inputs = {"torch": tuple(torch.from_numpy(a) for a in fields), "numpy": fields,
                  "list": tuple(a.tolist() for a in fields)}
        fns = {}
        for kind, (r, s, l, p) in inputs.items():
            batch = attnrt.ForwardBatch("DECODE", r, s, l, positions=p)

            def step(batch=batch):
                rt.begin_step(batch)
                rt.end_step()

            fns[f"wrapper_step_{kind}"] = step
        rows_t, seq_t, loc_t, pos_t = inputs["torch"]

        def native_step(r=rows_t, s=seq_t, l=loc_t, p=pos_t):
            begin("DECODE", r, s, l, p)
            nrt.end_step()

        def native_idle():
            begin("IDLE", e, e, e, None)
            nrt.end_step()

        def conversions(r=rows_t, s=seq_t, l=loc_t, p=pos_t):
            _mode_name("DECODE")
            for x in (r, s, None, None, l, p, None, None):
                _host_ints(x, "field")

        fns.update(native_step=native_step, native_step_idle=native_idle,
                   wrapper_conversions_torch=conversions)
        number = max(timer.number // (20 if seq == LONG else 4), 20)
        out[f"{BATCH}x{seq}"] = timer.group(fns, number)
    rt.close()
    return out


def plan_bench(path: str | None, quick: bool) -> dict:
    """C++ figures of the 256 x 2048 decode batch from attnrt_plan_bench, medians in us."""
    if path is None:
        cand = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build",
                            "attnrt_plan_bench")
        path = cand if os.path.exists(cand) else shutil.which("attnrt_plan_bench")
    if not path or not os.path.exists(path):
        return {"available": False, "reason": "attnrt_plan_bench not found (pass --plan-bench)"}
    names = ["BM_MakeStepLayoutInPlace/kind:0", "BM_KVCacheBeginStep/kind:0",
             "BM_HostPlan/kind:0/page:16"]
    cmd = [path, "--benchmark_filter=" + "|".join(n + "$" for n in names),
           f"--benchmark_repetitions={3 if quick else 7}", "--benchmark_report_aggregates_only=true",
           "--benchmark_format=json", f"--benchmark_min_time={0.02 if quick else 0.2}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        data = json.loads(res.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        return {"available": False, "reason": f"{' '.join(cmd)}: {e}"}
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}
    rows = {b["run_name"]: b["real_time"] * scale[b["time_unit"]]
            for b in data.get("benchmarks", []) if b.get("aggregate_name") == "median"}
    return {"available": True, "binary": path, "median_us": rows}


def decompose(fwd: dict, step: dict, cxx: dict) -> dict:
    p, idle = fwd["parts"], fwd["idle"]
    med = lambda rows, k: rows[k]["median_us"] if "median_us" in rows.get(k, {}) else None  # noqa: E731
    imp = diff(p, "free_slots_tensor", "free_slots_none")
    native = med(idle, "native_forward_idle")
    f = {
        "nanobind_dispatch_us": med(p, "nanobind_call"),
        "dlpack_import_per_tensor_us": imp,
        "torch_dlpack_export_us": med(p, "torch_dlpack_export"),
        "exchange_api_ctypes_us": med(p, "exchange_api_ctypes"),
        "native_us": native,
        "native_rest_us": add(native, -4 * imp if imp is not None else None,
                              -med(p, "nanobind_call") if med(p, "nanobind_call") is not None else None),
        "wrapper_python_us": diff(idle, "wrapper_forward_idle", "native_forward_idle"),
        "wrapper_new_out_extra_us": diff(idle, "wrapper_forward_idle_new_out", "wrapper_forward_idle"),
        "wrapper_flat_extra_us": diff(idle, "wrapper_forward_idle_flat", "wrapper_forward_idle"),
        # The C++ IDLE forward returns at once: the wrapper's whole time is over C++.
        "over_cxx_us": med(idle, "wrapper_forward_idle"),
        "target_us": TARGET_FORWARD_US,
    }
    f["meets_target"] = f["over_cxx_us"] is not None and f["over_cxx_us"] <= TARGET_FORWARD_US
    out = {"forward": f}
    for shape, rows in step.items():
        s = {
            "wrapper_python_us": diff(rows, "wrapper_step_torch", "native_step"),
            "wrapper_conversions_us": med(rows, "wrapper_conversions_torch"),
            "binding_fixed_us": med(rows, "native_step_idle"),
            "native_step_us": med(rows, "native_step"),
            "numpy_fields_extra_us": diff(rows, "wrapper_step_numpy", "wrapper_step_torch"),
            "list_fields_extra_us": diff(rows, "wrapper_step_list", "wrapper_step_torch"),
        }
        # Over C++: the wrapper's Python plus the native call's fixed cost (the IDLE step: an upper
        # bound); copying the fields into the C++ batch is counted on the C++ side.
        s["over_cxx_us"] = add(s["wrapper_python_us"], s["binding_fixed_us"])
        s["target_us"] = TARGET_STEP_US
        s["meets_target"] = s["over_cxx_us"] is not None and s["over_cxx_us"] <= TARGET_STEP_US
        out[f"step_{shape}"] = s
    if cxx.get("available"):
        c = cxx["median_us"]
        parts = [c.get("BM_MakeStepLayoutInPlace/kind:0"), c.get("BM_KVCacheBeginStep/kind:0")]
        if all(x is not None for x in parts) and f"step_{BATCH}x{LONG}" in out:
            s = out[f"step_{BATCH}x{LONG}"]
            s["cxx_layout_and_kv_begin_us"] = sum(parts)
            s["native_minus_cxx_parts_us"] = add(s["native_step_us"], -sum(parts))
    return out


def add(*xs):
    """The sum, or None when a part is missing (a row that failed)."""
    return None if any(x is None for x in xs) else sum(xs)


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def print_report(fwd: dict, step: dict, cxx: dict, d: dict) -> None:
    print(f"{'row':36s} {'median us':>10s} {'min us':>9s}")
    groups = [("forward, no step", fwd["parts"]), ("forward, IDLE step (0 tokens)", fwd["idle"]),
              ("forward, DECODE 1 x 16", fwd["decode"])]
    groups += [(f"begin_step + end_step, DECODE {shape}", rows) for shape, rows in step.items()]
    for title, rows in groups:
        print(f"-- {title}")
        for name, r in rows.items():
            if "error" in r:
                print(f"{name:36s} failed: {r['error']}")
            else:
                print(f"{name:36s} {r['median_us']:10.3f} {r['min_us']:9.3f}")
    if cxx.get("available"):
        print(f"-- C++ ({os.path.basename(cxx['binary'])}, DECODE {BATCH}x{LONG})")
        for name, v in cxx["median_us"].items():
            print(f"{name:36s} {v:10.3f}")
    else:
        print(f"-- C++: {cxx['reason']}")
    f = d["forward"]
    print(f"\nforward, per call: {fmt(f['over_cxx_us'])} us over C++ (target {TARGET_FORWARD_US:g}: "
          f"{'met' if f['meets_target'] else 'missed'}) = wrapper Python {fmt(f['wrapper_python_us'])}"
          f" + native {fmt(f['native_us'])} (dispatch {fmt(f['nanobind_dispatch_us'])}; q, k, v, "
          f"out through torch's DLPack C exchange table; nanobind's __dlpack__ import, the path "
          f"of other arrays, costs {fmt(f['dlpack_import_per_tensor_us'])} per tensor [torch "
          f"__dlpack__ {fmt(f['torch_dlpack_export_us'])}]); out=None adds "
          f"{fmt(f['wrapper_new_out_extra_us'])}, flat q/k/v add {fmt(f['wrapper_flat_extra_us'])}")
    for key, s in d.items():
        if not key.startswith("step_"):
            continue
        extra = ""
        if "cxx_layout_and_kv_begin_us" in s:
            extra = (f"; C++ make_step_layout + KV begin_step {fmt(s['cxx_layout_and_kv_begin_us'])}")
        print(f"step {key[5:]}: {fmt(s['over_cxx_us'])} us over C++ (target {TARGET_STEP_US:g}: "
              f"{'met' if s['meets_target'] else 'missed'}) = wrapper Python "
              f"{fmt(s['wrapper_python_us'])} (field conversions {fmt(s['wrapper_conversions_us'])})"
              f" + binding fixed {fmt(s['binding_fixed_us'])}; native step "
              f"{fmt(s['native_step_us'])}{extra}; numpy fields {fmt(s['numpy_fields_extra_us'])}, "
              f"lists {fmt(s['list_fields_extra_us'])} more than tensors")


def print_failures(fwd: dict, step: dict) -> None:
    """Calls that raised instead of being timed: findings about the binding, listed last."""
    groups = {"forward": fwd["parts"], "forward IDLE": fwd["idle"], "forward DECODE": fwd["decode"]}
    groups.update({f"step {k}": v for k, v in step.items()})
    failed = [(g, n, r["error"]) for g, rows in groups.items() for n, r in rows.items() if "error" in r]
    for g, n, e in failed:
        print(f"FAILED CALL ({g}) {n}: {e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer, shorter loops (a smoke run)")
    p.add_argument("--number", type=int, default=0, help="calls per timed loop (0: 2000, quick 200)")
    p.add_argument("--repeats", type=int, default=0, help="timed rounds per group (0: 21, quick 3)")
    p.add_argument("--plan-bench", default=None,
                   help="attnrt_plan_bench binary for the C++ figures (default build/attnrt_plan_bench)")
    p.add_argument("--no-plan-bench", action="store_true", help="skip the C++ figures")
    p.add_argument("--json", default=None, help="write the rows and the decomposition here")
    args = p.parse_args(argv)
    number = args.number or (200 if args.quick else 2000)
    repeats = args.repeats or (3 if args.quick else 21)
    torch.set_num_threads(1)
    timer = Timer(number, repeats)
    with torch.inference_mode():
        fwd = measure_forward(timer)
        step = measure_step(timer)
    cxx = ({"available": False, "reason": "--no-plan-bench"} if args.no_plan_bench
           else plan_bench(args.plan_bench, args.quick))
    d = decompose(fwd, step, cxx)
    load = os.getloadavg()[0]
    print(f"attnrt {attnrt.__version__}, torch {torch.__version__}, python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs, load {load:.1f}; loop baseline "
          f"{timer.baseline * 1e3:.0f} ns subtracted; {repeats} rounds of {number} calls")
    print_report(fwd, step, cxx, d)
    print_failures(fwd, step)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "attnrt-python-overhead/1", "attnrt": attnrt.__version__,
                       "torch": torch.__version__, "python": platform.python_version(),
                       "machine": platform.machine(), "cpus": os.cpu_count(), "load_avg": load,
                       "number": number, "repeats": repeats, "loop_baseline_us": timer.baseline,
                       "forward": fwd, "step": step, "cxx": cxx, "decomposition": d}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
