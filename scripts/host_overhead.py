"""Host (Python) time of the fused MoE path per forward+backward, GPU work removed: CPU-only.

    python scripts/host_overhead.py [--calls 200] [--profile]

Runs ops.moe_experts(backend="triton") on small CPU tensors under TRITON_INTERPRET=1 with every Triton
launch replaced by a no-op, so what is timed is our wrappers, Triton's launch-side Python and the small
torch ops around them (CPU kernels on tiny tensors). Relative numbers only: the lent H200 host differs.
A long host path leaves the GPU idle between short kernels (the Qwen3 layer showed ~1 ms of gaps).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="cProfile the calls, top 25 by own time")
    args = ap.parse_args(argv)
    if "triton" in sys.modules:
        raise SystemExit("run as a fresh process: TRITON_INTERPRET must be set before triton is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.runtime import interpreter

    launches: dict[str, int] = {}
    real_run = interpreter.InterpretedFunction.run
    placed: list = []

    def no_launch(self, *a, **kw):
        name = self.fn.__name__
        launches[name] = launches.get(name, 0) + 1
        # The row sort (kernels/sort_rows.py): every later op indexes with the rows it places. The routing is
        # the same each call, so it runs once in the interpreter and later calls copy its outputs.
        if name == "_chunk_counts_kernel" and not placed:
            real_run(self, *a, **kw)
        elif name == "_place_rows_kernel":
            if not placed:
                real_run(self, *a, **kw)
                placed.extend(t.clone() for t in a[2:6])  # offs, row_map, inverse, token_of_row
            for out, got in zip(a[2:6], placed):
                out.copy_(got)

    interpreter.InterpretedFunction.run = no_launch
    from moetrain import ops

    T, H, I, E, K = 256, 64, 32, 8, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    w1 = torch.randn(E, 2 * I, H, generator=g, requires_grad=True)
    w2 = torch.randn(E, H, I, generator=g, requires_grad=True)
    r = ops.route(torch.randn(T, E, generator=g), K, impl="torch")  # a stubbed routing kernel routes nowhere

    def call():
        ops.moe_experts(x, r.topk_idx, r.topk_weight, w1, w2, backend="triton").sum().backward()

    for _ in range(5):
        call()
    launches.clear()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    per = (time.perf_counter() - t0) / args.calls
    print(f"host time per forward+backward: {per * 1e6:.0f} us; Triton launches per call: "
          f"{ {k: v // args.calls for k, v in launches.items()} }")
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
