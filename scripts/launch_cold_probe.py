"""Which part of a Triton launch is slow right after the host waited on the GPU (bench/NOTES.md session 22, G: CUDA
calls after GPU idle run 1.5-10x their hot cost; an eager layer call's Triton launches took 100-290 us there against
20-56 hot)? Triton 3.6's C launcher calls the driver once per pointer argument (cuPointerGetAttribute, to check that
the pointer is a device one) unless the argument is a plain int, then launches (cuLaunchKernelEx). Times, right after
a wait and then hot (the third repeat):

    python scripts/launch_cold_probe.py [--wait-ms 5] [--rounds 40]

probes:
  torch.add      one PyTorch launch (the runtime API, no pointer checks)
  triton 1 ptr   a Triton kernel with one pointer argument, launched as usual (kernel[grid](...))
  triton 8 ptrs  the same with eight pointer arguments
  direct 8 ptrs  that kernel's compiled launcher called with the eight addresses as ints (no binder, no pointer
                 checks: what a cached direct launch would cost)
  8 ptr checks   eight cuPointerGetAttribute calls through ctypes (the checks alone)
waits: "event sync" (GEMMs queued, the host blocks on a timing event, as bench moe waits after each timed call),
"spin" (the GPU idle for WAIT ms while the host spins in Python), "short idle" (one tiny kernel, then 0.1 ms of
Python spin: the gaps inside an eager layer call). Prints the median us per probe and wait, first and hot.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _one_ptr(p0, n):
    offs = tl.arange(0, 16)
    tl.store(p0 + offs, tl.zeros([16], tl.float32), mask=offs < n)


@triton.jit
def _eight_ptrs(p0, p1, p2, p3, p4, p5, p6, p7, n):
    offs = tl.arange(0, 16)
    v = (tl.load(p1 + offs, mask=offs < n, other=0.0) + tl.load(p2 + offs, mask=offs < n, other=0.0)
         + tl.load(p3 + offs, mask=offs < n, other=0.0) + tl.load(p4 + offs, mask=offs < n, other=0.0)
         + tl.load(p5 + offs, mask=offs < n, other=0.0) + tl.load(p6 + offs, mask=offs < n, other=0.0)
         + tl.load(p7 + offs, mask=offs < n, other=0.0))
    tl.store(p0 + offs, v, mask=offs < n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=40)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/launch_cold_probe.py probes the host of a CUDA machine: no GPU visible")
    if a.rounds < 1 or a.wait_ms <= 0:
        raise SystemExit(f"--rounds {a.rounds} must be >= 1 and --wait-ms {a.wait_ms} > 0")
    m = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    bufs = [torch.zeros(1024, device="cuda") for _ in range(8)]
    addrs = [b.data_ptr() for b in bufs]
    n = 16
    one = _one_ptr[(1,)](bufs[0], n)
    eight = _eight_ptrs[(1,)](*bufs, n)
    stream = torch.cuda.current_stream().cuda_stream
    libcuda = ctypes.CDLL("libcuda.so.1")
    get_attr = libcuda.cuPointerGetAttribute
    get_attr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong]
    out = ctypes.c_ulonglong()
    DEVICE_POINTER = 2  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER

    def pointer_checks():
        for addr in addrs:
            if get_attr(ctypes.byref(out), DEVICE_POINTER, addr) != 0:
                raise SystemExit("cuPointerGetAttribute failed")

    probes = {
        "torch.add": lambda: torch.add(bufs[1], 1.0),
        "triton 1 ptr": lambda: _one_ptr[(1,)](bufs[0], n),
        "triton 8 ptrs": lambda: _eight_ptrs[(1,)](*bufs, n),
        "direct 8 ptrs": lambda: eight.run(1, 1, 1, stream, eight.function, eight.packed_metadata, None, None, None,
                                          *addrs, n),
        "8 ptr checks": pointer_checks,
    }
    del one
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        torch.mm(m, m)
    torch.cuda.synchronize()
    gemms = max(1, round(a.wait_ms / ((time.perf_counter() - t0) * 1e3 / 10)))

    def spin(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def event_sync():
        for _ in range(gemms):
            torch.mm(m, m)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        ev.synchronize()

    def short_idle():
        torch.add(bufs[2], 1.0)
        spin(1e-4)

    waits = {"event sync": event_sync, "spin": lambda: spin(a.wait_ms / 1e3), "short idle": short_idle}
    for wait in waits.values():  # one untimed pass
        for probe in probes.values():
            wait()
            probe()
    torch.cuda.synchronize()
    print(f"{'wait':10s} " + " ".join(f"{name:>14s}" for name in probes) + "   (us: first / hot)")
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
        print(f"{wname:10s} " + " ".join(f"{statistics.median(times[(k, 0)]):6.1f} / {statistics.median(times[(k, 2)]):5.1f}"
                                          for k in probes), flush=True)


if __name__ == "__main__":
    main()
