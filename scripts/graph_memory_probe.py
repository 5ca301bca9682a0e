"""The memory of the CUDA-graph capture step against the eager steps (session 6 diagnostic, GPU only).

`plan validate` measured tiny-wide-graph at 0.41 GiB peak on the capture step and 0.20 GiB on every replay step,
against 0.29-0.32 GiB for the eager steps and 0.31 projected: a 64 MiB cuBLAS workspace each for the side stream
of the warm-up and the capture's stream. This runs that trainer config for five steps and prints allocated bytes
around the capture, the capture's own peak, and the memory blocks by pool and state after it.

    python scripts/graph_memory_probe.py [extra key=value overrides]
"""

from __future__ import annotations

import sys

import torch

from moetrain.config import load_config
from moetrain.train import graphed_step, trainer

GIB = 2**30


def _mem(tag: str) -> None:
    torch.cuda.synchronize()
    print(f"  {tag:<34} allocated {torch.cuda.memory_allocated() / GIB:.4f} GiB, "
          f"peak {torch.cuda.max_memory_allocated() / GIB:.4f}, reserved {torch.cuda.memory_reserved() / GIB:.4f}")


def _pool_blocks() -> None:
    by_state: dict[str, list[int]] = {}
    for seg in torch.cuda.memory_snapshot():
        pool = seg.get("segment_pool_id", (0, 0))
        for blk in seg["blocks"]:
            key = f"{'graph pool' if tuple(pool) != (0, 0) else 'default'} {blk['state']}"
            by_state.setdefault(key, []).append(blk["size"])
    for key, sizes in sorted(by_state.items()):
        print(f"    {key:<36} {len(sizes):5d} blocks, {sum(sizes) / GIB:.4f} GiB")


def main(overrides: list[str]) -> None:
    original = graphed_step.GraphedStep._capture

    def capture(self) -> None:
        _mem("capture step, before capture")
        torch.cuda.reset_peak_memory_stats()
        original(self)
        _mem("after capture (peak = capture's)")
        _pool_blocks()

    graphed_step.GraphedStep._capture = capture
    try:
        cfg = load_config(preset="tiny", overrides=[
            "train.seq_length=512", "train.micro_batch_size=16", "train.global_batch_size=16", "train.cuda_graph=true",
            "train.steps=5", "train.log_interval=1", "train.eval_interval=0", "checkpoint.save_final=false",
            "train.out_dir=/tmp/graph_memory_probe", *overrides])
        result = trainer.run(cfg, show_progress=False)
        for r in result.records:
            print(f"  step {r['step']}: peak {r['peak_mem_gib']:.4f} GiB, {r['step_time_s'] * 1e3:.1f} ms")
    finally:
        graphed_step.GraphedStep._capture = original


if __name__ == "__main__":
    main(sys.argv[1:])
