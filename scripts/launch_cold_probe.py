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

import ctypes

import torch
import triton
import triton.language as tl
from host_cold_probe import Waits, first_and_hot, probe_args  # (this folder)


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
    a = probe_args(__doc__, "scripts/launch_cold_probe.py", rounds=40)
    bufs = [torch.zeros(1024, device="cuda") for _ in range(8)]
    addrs = [b.data_ptr() for b in bufs]
    n = 16
    _one_ptr[(1,)](bufs[0], n)  # compiled before the timing
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
    w = Waits(a.wait_ms)

    def short_idle():  # the gaps inside an eager layer call: a small kernel, then 0.1 ms of host work
        torch.add(bufs[2], 1.0)
        w.spin(1e-4)

    waits = {"event sync": w.event_sync, "spin": w.spin, "short idle": short_idle}
    print(f"{'wait':10s} " + " ".join(f"{name:>14s}" for name in probes) + "   (us: first / hot)")
    for wname, row in first_and_hot(waits, probes, a.rounds):
        print(f"{wname:10s} " + " ".join(f"{first:6.1f} / {hot:5.1f}" for first, hot in row.values()), flush=True)


if __name__ == "__main__":
    main()
