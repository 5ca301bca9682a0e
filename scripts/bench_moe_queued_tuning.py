"""`moetrain bench moe` with the grouped GEMM autotuner timing each candidate as a queued batch (one pair of CUDA
events around `reps` calls issued back to back) instead of kernels.timing.median_ms (each call timed from a
synchronized, idle GPU). An experiment, not a product setting: after a two-programs-per-SM launch, the ping-pong
weight gradient timed slow under median_ms and fast under bench gemm's do_bench (session 10, bench/NOTES.md); inside
the layer the kernels run queued.

    python scripts/bench_moe_queued_tuning.py --shapes deepseek-v3 --routing balanced ...   (bench moe's arguments)
"""

from __future__ import annotations

import sys

import torch


def queued_ms(run, warmup: int = 1, reps: int = 4) -> float:
    """Milliseconds per call of ``run()`` issued ``reps`` times back to back on the current stream, after ``warmup``
    synchronized calls."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> int:
    from moetrain import cli
    from moetrain.kernels import grouped_gemm_tuning

    grouped_gemm_tuning.median_ms = queued_ms  # pick_config's timer (module global)
    print("grouped GEMM autotuner: candidates timed as queued batches", flush=True)
    return cli.main(["bench", "moe", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
