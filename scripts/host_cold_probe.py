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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=50)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/host_cold_probe.py probes the host of a CUDA machine: no GPU visible")
    if a.rounds < 1 or a.wait_ms <= 0:
        raise SystemExit(f"--rounds {a.rounds} must be >= 1 and --wait-ms {a.wait_ms} > 0")
    m = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    small = torch.ones(1024, device="cuda")
    table = {i: i for i in range(256)}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        torch.mm(m, m)
    torch.cuda.synchronize()
    gemms = max(1, round(a.wait_ms / ((time.perf_counter() - t0) * 1e3 / 10)))

    def python_work():
        s = 0
        for i in range(2000):
            s += table[i & 255]
        return s

    probes = {"python": python_work, "empty": lambda: torch.empty(1024, device="cuda"),
              "launch": lambda: torch.add(small, 1.0)}

    def queue_gemms():  # ~WAIT ms of GPU work
        for _ in range(gemms):
            torch.mm(m, m)

    def gpu_sync():
        queue_gemms()
        torch.cuda.synchronize()

    def sleep():
        time.sleep(a.wait_ms / 1e3)

    def spin():
        end = time.perf_counter() + a.wait_ms / 1e3
        while time.perf_counter() < end:
            pass

    def event_sync():  # as bench moe waits after each timed call
        queue_gemms()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        ev.synchronize()

    def gpu_spin():
        queue_gemms()
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            pass

    waits = {"gpu sync": gpu_sync, "event sync": event_sync, "sleep": sleep, "spin": spin, "gpu spin": gpu_spin}
    for wait in waits.values():  # one untimed pass: the first timed wait ran at half speed without it
        for probe in probes.values():
            wait()
            probe()
    print(f"{'wait':10s} " + " ".join(f"{name + ' first':>13s} {name + ' hot':>11s}" for name in probes))
    for wname, wait in waits.items():
        times = {(name, rep): [] for name in probes for rep in (0, 2)}
        for _ in range(a.rounds):
            for name, probe in probes.items():
                wait()
                for rep in range(3):
                    t = time.perf_counter()
                    probe()
                    dt = (time.perf_counter() - t) * 1e6
                    if rep in (0, 2):
                        times[(name, rep)].append(dt)
        torch.cuda.synchronize()
        print(f"{wname:10s} " + " ".join(f"{statistics.median(times[(n, 0)]):13.1f} "
                                          f"{statistics.median(times[(n, 2)]):11.1f}" for n in probes), flush=True)


if __name__ == "__main__":
    main()
