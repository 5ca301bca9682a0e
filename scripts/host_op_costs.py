"""What single PyTorch calls on the eager layer's path before FC1 cost the host (GPU): us per call, issued 25 at a
time with no sync inside the timed loop, medians over batches.

    python scripts/host_op_costs.py [--tokens 16384] [--hidden 2880] [--experts 32] [--topk 4] [--batches 20]

Also each call's first and second issue right after the host waited on ~17 ms of GPU work ("after a sync"), as in
`bench moe`'s eager timing, where the layer's first calls follow end.synchronize().

Why: host_breakdown.py (session 19, call C) put the router's logits at ~290 us of GPT-OSS's ~1.2 ms of host time
before its first expert GEMM, for one torch.mm(out_dtype=fp32) inside an autograd Function; this says whether that
call itself is slow on the host (and what the alternatives cost), or the wrapping around it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from launch_cost import per_call_us  # (this folder): median us per call over batches of 25, hot


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# How the host waits for the GPU before the timed call, and what it does in between (the mechanism's tests)
WAITS = {
    "event sync": lambda done: done.synchronize(),
    "event sync, 1 ms Python spin": lambda done: (done.synchronize(), _spin(1e-3)),
    "event sync, one torch.empty": lambda done: (done.synchronize(), torch.empty(8, device="cuda")),
    "poll event.query()": lambda done: [None for _ in iter(done.query, True)],
}


def after_sync_us(fn, batches: int, wait_ms: float = 17.0, wait=WAITS["event sync"]) -> tuple[float, float]:
    """(first call, second call) us, each median over ``batches``, issued right after the host waited (``wait``) on
    ~wait_ms of queued GPU sleep."""
    cycles = int(wait_ms * 1.98e6)  # at the H200's 1,980 MHz boost clock
    first, second = [], []
    for _ in range(batches):
        torch.cuda._sleep(cycles)
        done = torch.cuda.Event()
        done.record()
        wait(done)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        first.append((t1 - t0) * 1e6)
        second.append((t2 - t1) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(first), statistics.median(second)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def main(argv=None) -> int:
    from moetrain import ops
    from moetrain.ops import router_gemm

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--batches", type=int, default=20)
    args = ap.parse_args(argv)
    for name in ("tokens", "hidden", "experts", "batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} {getattr(args, name)}: at least 1")
    if not 1 <= args.topk <= args.experts:
        raise SystemExit(f"--topk {args.topk}: between 1 and --experts ({args.experts})")
    if not torch.cuda.is_available():
        raise SystemExit("scripts/host_op_costs.py: needs a CUDA GPU")
    T, H, E = args.tokens, args.hidden, args.experts
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(T, E, device="cuda")
    xd, wd = x.detach(), w.detach()
    calls = {
        "torch.empty([T, E] fp32)": lambda: torch.empty(T, E, device="cuda"),
        "logits + forcing (add)": lambda: logits + logits,
        "identity autograd.Function": lambda: _Identity.apply(x),
        "torch.mm bf16 (no grad)": lambda: torch.mm(xd, wd.t()),
        "torch.mm out_dtype=fp32 (no grad)": lambda: torch.mm(xd, wd.t(), out_dtype=torch.float32),
        "torch.mm out_dtype=fp32 into out=": lambda: torch.mm(xd, wd.t(), out_dtype=torch.float32,
                                                             out=torch.empty(T, E, device="cuda")),
        "F.linear fp32 upcast (no grad)": lambda: F.linear(xd.float(), wd.float()),
        "_TensorCoreRouterGemm.apply (grad)": lambda: router_gemm._TensorCoreRouterGemm.apply(x, w),
        "ops.router_logits (grad)": lambda: ops.router_logits(x, w),
        "ops.route triton (no grad)": lambda: ops.route(logits, args.topk, impl="triton"),
    }
    print(f"{'call':40s} {'us/call':>8s} {'after a sync: 1st':>18s} {'2nd':>6s}   (T={T}, H={H}, E={E})", flush=True)
    for name, fn in calls.items():
        try:
            fn()  # (a first call compiles what it launches)
            us = per_call_us(fn, args.batches)
            first, second = after_sync_us(fn, args.batches)
        except (RuntimeError, TypeError) as err:
            print(f"{name:40s} failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
            continue
        print(f"{name:40s} {us:8.1f} {first:18.1f} {second:6.1f}", flush=True)
    print(f"\nfirst / second call after each way of waiting, us: {', '.join(WAITS)}", flush=True)
    for name in ("logits + forcing (add)", "ops.router_logits (grad)", "ops.route triton (no grad)"):
        cells = [after_sync_us(calls[name], args.batches, wait=wait) for wait in WAITS.values()]
        print(f"{name:40s} " + "  ".join(f"{a:6.1f} / {b:5.1f}" for a, b in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
