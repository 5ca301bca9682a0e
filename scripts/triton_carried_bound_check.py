"""Whether this Triton keeps a loop-carried scalar that is used only as an inner loop's bound (CPU only: compiles a
minimal kernel for sm_90 and reads its IR; no GPU).

    python scripts/triton_carried_bound_check.py

Why: in session 19 a ping-pong producer that carried each next tile's step count from one iteration to the next
hung on skewed routing. Triton 3.6's tritongpu-remove-layout-conversions pass dropped the carried value: the TTIR
carries it, the TTGIR runs every outer iteration with the first value as the inner loop's bound (bench/NOTES.md,
session 19). Balanced routing, where every tile has the same count, hid it. Until this prints "kept", recompute such
a bound from values the loop does carry.
"""

from __future__ import annotations

import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _bound_of(n_ptr, t):
    a = tl.load(n_ptr + t)
    return a * 2, tl.maximum(a, 1)


@triton.jit
def _carried_bound(out, n_ptr, T):
    x, steps = _bound_of(n_ptr, 0)
    acc = 0
    for t in range(0, T):
        acc += x
        x_next, steps_next = _bound_of(n_ptr, t + 1)
        for s in range(1, steps):  # steps: carried from the previous outer iteration
            acc += s
        x = x_next
        steps = steps_next
    tl.store(out, acc)


def carried_values(ir: str) -> int:
    """iter_args of the outer scf.for (the first one in the IR)."""
    m = re.search(r"scf\.for [^\n]*iter_args\(([^)]*)\)", ir)
    if m is None:
        raise SystemExit("no scf.for in the IR: this Triton lowers the kernel differently; read its IR by hand")
    return m.group(1).count("=")


def main() -> int:
    src = ASTSource(_carried_bound, {"out": "*i32", "n_ptr": "*i32", "T": "i32"}, constexprs={})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    ttir, ttgir = carried_values(compiled.asm["ttir"]), carried_values(compiled.asm["ttgir"])
    kept = ttgir == ttir == 3  # x, steps, acc
    print(f"triton {triton.__version__}: outer loop carries {ttir} values in TTIR, {ttgir} in TTGIR: "
          f"{'kept' if kept else 'DROPPED (the inner bound is frozen at its first value)'}")
    return 0 if kept else 1


if __name__ == "__main__":
    sys.exit(main())
