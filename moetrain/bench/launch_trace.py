"""Which host code the GPU waits on: every GPU operation of one profiled call with the host time of its launch
and the innermost moetrain function that launched it, from a torch.profiler Chrome trace.

``bench/gpu_timeline.py`` says how much of a call is idle and before which kernels; this says why: a gap before
a kernel is the host still busy issuing it, and the launch's source line and the host time since the previous
launch show where that time went. Used by scripts/gap_sources.py (GPU); parsed here from the trace's JSON so that
it can be tested without one.

Times are microseconds on the trace's clock (host and GPU events share it).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass
class Launch:
    name: str  # the GPU operation (kernel, memcpy, memset)
    host_us: float  # when the host launched it, from the call's start
    host_step_us: float  # host time since the previous launch of the call
    gpu_start_us: float  # when it started on the GPU, from the call's start
    gpu_us: float  # its GPU duration
    idle_before_us: float  # GPU idle time right before it (0 when the GPU was busy or it was queued)
    source: str  # innermost moetrain frame around the launch ("" when none: torch's autograd engine, ...)


def call_launches(trace: dict, call_name: str = "call 0") -> list[Launch]:
    """The GPU operations of the host range ``call_name`` (a record_function around one call and its sync) in
    GPU order. ``trace``: the loaded JSON of ``prof.export_chrome_trace`` (with_stack=True for sources)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    call = next((e for e in events if e.get("name") == call_name and e.get("cat") == "user_annotation"), None)
    if call is None:
        raise ValueError(f"no host range {call_name!r} in the trace (record_function around the call?)")
    start, end = call["ts"], call["ts"] + call["dur"]
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") in LAUNCH_CATEGORIES
                and start <= e["ts"] <= end and "correlation" in e.get("args", {})}
    # GPU operations inside the call's range; one whose launch the trace lacks (a launch API the profiler does not
    # record) is kept, with no host time or source, so that the idle time stays whole
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and start <= e["ts"] <= end),
                 key=lambda e: e["ts"])
    frames = _Frames([e for e in events if e.get("cat") == "python_function"])
    out, busy_until, prev_host = [], None, None
    for e in gpu:
        launch = launches.get(e.get("args", {}).get("correlation"))
        host = float("nan") if launch is None else launch["ts"]
        idle = 0.0 if busy_until is None else max(0.0, e["ts"] - busy_until)
        source = "?" if launch is None else frames.innermost(launch.get("tid"), host)
        out.append(Launch(e["name"], host - start, 0.0 if prev_host is None else host - prev_host, e["ts"] - start,
                          e["dur"], idle, source))
        busy_until = max(busy_until or 0.0, e["ts"] + e["dur"])
        if launch is not None:
            prev_host = host  # one stream: GPU order is launch order
    return out


class _Frames:
    """Python frames (trace slices) per thread, to find the innermost moetrain one around a time."""

    def __init__(self, slices: list[dict]):
        self.by_tid: dict = {}
        for s in slices:
            if "moetrain/" in s.get("name", ""):
                self.by_tid.setdefault(s.get("tid"), []).append((s["ts"], s["ts"] + s["dur"], s["name"]))
        for v in self.by_tid.values():
            v.sort()

    def innermost(self, tid, t: float) -> str:
        spans = self.by_tid.get(tid, [])
        best = None
        for lo, hi, name in spans[:bisect_right(spans, (t, float("inf"), ""))]:
            if lo <= t <= hi and (best is None or lo >= best[0]):
                best = (lo, name)
        return "" if best is None else _short(best[1])


def _short(frame: str) -> str:
    """'/a/b/moetrain/ops/moe.py(150): _moe_experts' -> 'ops/moe.py:150 _moe_experts'."""
    path, _, func = frame.partition(": ")
    path = path[path.rfind("moetrain/") + len("moetrain/"):]
    return f"{path.replace('(', ':').rstrip(')')} {func}".strip()


def describe_launches(launches: list[Launch], min_idle_us: float = 20.0, first: int = 30) -> str:
    """The first ``first`` launches (the host's path to the first large kernel), then every launch that found
    the GPU idle for ``min_idle_us`` or more, largest first; and the idle total."""
    rows = [f"{'host us':>9s} {'+host':>7s} {'idle':>7s} {'gpu us':>8s}  kernel / launched from"]

    def row(x: Launch) -> str:
        return (f"{x.host_us:9.0f} {x.host_step_us:7.0f} {x.idle_before_us:7.0f} {x.gpu_us:8.0f}  "
                f"{x.name[:50]}  <- {x.source or '(no moetrain frame)'}")

    rows += [row(x) for x in launches[:first]]
    gaps = sorted((x for x in launches if x.idle_before_us >= min_idle_us), key=lambda x: -x.idle_before_us)
    idle = sum(x.idle_before_us for x in launches)
    rows.append(f"-- GPU idle between operations: {idle / 1e3:.2f} ms in {len(gaps)} gaps of >= {min_idle_us:.0f} us"
                + (f"; first operation {launches[0].gpu_start_us / 1e3:.2f} ms after the call's start"
                   if launches else ""))
    rows += [row(x) for x in gaps]
    return "\n".join(rows)
