"""What makes the host slow right after it waited on the GPU (bench/NOTES.md sessions 19-22: every host step of an
eager layer call runs 3-15x its hot cost after the sync)? Times three probes right after five kinds of wait, then
again hot:

    python scripts/host_cold_probe.py [--wait-ms 5] [--rounds 50]

probes: pure Python (no CUDA: 2,000 dict lookups), torch.empty on the GPU (the caching allocator, no CUDA call when
cached), a small torch.add on the GPU (one kernel launch and its output's allocation; host time only).
waits: "gpu sync" (the host blocks in torch.cuda.synchronize while ~WAIT ms of GEMMs run), "event sync" (the same
behind a timing event's synchronize(), as bench moe waits), "sleep" (time.sleep, GPU idle), "spin" (a Python busy
loop, GPU idle), "gpu spin" (the same GEMMs queued, the host spinning in Python on event.query() until they finish).
Prints the median us of each probe per wait, first after the wait and hot (the third repeat).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    a = probe_args(__doc__, "scripts/host_cold_probe.py", rounds=50)
    small = torch.ones(1024, device="cuda")
    table = {i: i for i in range(256)}
    w = Waits(a.wait_ms)

    def python_work():
        s = 0
        for i in range(2000):
            s += table[i & 255]
        return s

    probes = {"python": python_work, "empty": lambda: torch.empty(1024, device="cuda"),
              "launch": lambda: torch.add(small, 1.0)}
    waits = {"gpu sync": w.gpu_sync, "event sync": w.event_sync, "sleep": w.sleep, "spin": w.spin,
             "gpu spin": w.gpu_spin}
    print(f"{'wait':10s} " + " ".join(f"{name + ' first':>13s} {name + ' hot':>11s}" for name in probes))
    for wname, row in first_and_hot(waits, probes, a.rounds):
        print(f"{wname:10s} " + " ".join(f"{first:13.1f} {hot:11.1f}" for first, hot in row.values()), flush=True)


def probe_args(doc: str, script: str, rounds: int):
    """--wait-ms and --rounds of a probe script (this one, launch_cold_probe.py), checked, on a CUDA machine."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=rounds)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} probes the host of a CUDA machine: no GPU visible")
    if a.rounds < 1 or a.wait_ms <= 0:
        raise SystemExit(f"--rounds {a.rounds} must be >= 1 and --wait-ms {a.wait_ms} > 0")
    return a


class Waits:
    """The ways the host waits before a probe, each about ``wait_ms`` long (the GPU-bound ones queue square bf16
    GEMMs, counted to last that long)."""

    def __init__(self, wait_ms: float):
        self.seconds = wait_ms / 1e3
        self.m = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(self.m, self.m)
        torch.cuda.synchronize()
        self.gemms = max(1, round(wait_ms / ((time.perf_counter() - t0) * 1e3 / 10)))

    def queue_gemms(self):  # ~wait_ms of GPU work
        for _ in range(self.gemms):
            torch.mm(self.m, self.m)

    def gpu_sync(self):
        self.queue_gemms()
        torch.cuda.synchronize()

    def sleep(self):
        time.sleep(self.seconds)

    def spin(self, seconds: float | None = None):  # a Python busy loop, the GPU idle
        end = time.perf_counter() + (self.seconds if seconds is None else seconds)
        while time.perf_counter() < end:
            pass

    def event_sync(self):  # as bench moe waits after each timed call
        self.queue_gemms()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        ev.synchronize()

    def gpu_spin(self):
        self.queue_gemms()
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            pass


def first_and_hot(waits: dict, probes: dict, rounds: int):
    """Yields (wait name, {probe name: (median us of its first call right after the wait, of its third call: hot)})
    per wait, over ``rounds`` rounds (each: every probe after its own wait). One untimed pass first: the first timed
    wait ran at half speed without it (session 22)."""
    for wait in waits.values():
        for probe in probes.values():
            wait()
            probe()
    torch.cuda.synchronize()
    for wname, wait in waits.items():
        times = {(name, rep): [] for name in probes for rep in (0, 2)}
        for _ in range(rounds):
            for name, probe in probes.items():
                wait()
                for rep in range(3):
                    t = time.perf_counter()
                    probe()
                    dt = (time.perf_counter() - t) * 1e6
                    if rep in (0, 2):
                        times[(name, rep)].append(dt)
            torch.cuda.synchronize()
        yield wname, {n: (statistics.median(times[(n, 0)]), statistics.median(times[(n, 2)])) for n in probes}


if __name__ == "__main__":
    main()
