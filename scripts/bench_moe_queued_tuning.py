"""`moetrain bench moe` with the grouped GEMM autotuner timing each candidate as a queued batch (one pair of CUDA
events around `reps` calls issued back to back) instead of kernels.timing.median_ms (each call timed from a
synchronized, idle GPU). An experiment, not a product setting: after a two-programs-per-SM launch, the ping-pong
weight gradient timed slow under median_ms and fast under bench gemm's do_bench (session 10, bench/NOTES.md); inside
the layer the kernels run queued.

    python scripts/bench_moe_queued_tuning.py --shapes deepseek-v3 --routing balanced ...   (bench moe's arguments)
"""

from __future__ import annotations

import sys


def tuning_timer(run, warmup: int = 1, reps: int = 4) -> float:
    """pick_config's median_ms signature, timed as one queued batch (kernels.timing.queued_ms)."""
    from moetrain.kernels.timing import queued_ms

    return queued_ms(run, reps=reps, warmup=warmup)


def main(argv=None) -> int:
    from moetrain import cli
    from moetrain.kernels import grouped_gemm_tuning

    grouped_gemm_tuning.median_ms = tuning_timer  # pick_config's timer (module global)
    print("grouped GEMM autotuner: candidates timed as queued batches", flush=True)
    return cli.main(["bench", "moe", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
