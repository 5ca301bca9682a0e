"""Host-side integer helpers for launch grids and block sizes, in plain Python.

triton.cdiv and triton.next_power_of_2 are constexpr functions in Triton 3.6: called from host code
each costs ~6 us of Python (argument unwrapping), and one MoE layer forward+backward made ~40 such calls
(timed on the CPU with the GPU work stubbed out). Same results for the non-negative ints used here.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a >= 0, b > 0."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1."""
    return 1 << (n - 1).bit_length()


def require_pow2(what: str, value: int) -> None:
    """Refuse a block, program or warp count that is not a power of two >= 1: ValueError "<what>=<value> must be a
    power of two" (what names the knob, e.g. "sort_rows: chunk")."""
    if value < 1 or value & (value - 1):
        raise ValueError(f"{what}={value} must be a power of two")


def rows_bucket(rows: int, groups: int) -> int:
    """Rows per group rounded up to a power of two (1, 2, 4, ...): the shape bucket that run-time choices
    (the config autotuner, backend "auto") are keyed by."""
    return next_pow2(max(1, rows // max(groups, 1)))
