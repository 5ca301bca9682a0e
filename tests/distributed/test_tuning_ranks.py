"""moetrain.tuning under torch.distributed (2 gloo ranks, CPU): rank 0 answers every question, so ranks whose own
timings disagree still run the same candidate; ranks asking different questions all raise instead of hanging."""

import pytest
import torch
from gloo_ranks import run_ranks

from moetrain import tuning


def _ask(tuner, kind="k", rows=8):
    x = torch.zeros(4, 4)
    return tuning.choose(kind, x, 3, 4, rows, 2, ("a", "b"), (lambda c: c,), variant=())


def _disagreeing_ranks(rank, world_size, cache_dir):
    # rank 0 finds "a" faster, rank 1 "b": both run rank 0's pick; only rank 0 writes the cache file
    fast = "a" if rank == 0 else "b"
    timer = lambda run, reps: 1.0 if run() == fast else 2.0  # noqa: E731
    tuner = tuning.Tuner(timer=timer, cache_file=f"{cache_dir}/rank{rank}.json")
    with tuning.use(tuner):
        assert _ask(tuner) == "a"
        assert _ask(tuner) == "a"  # the memo: no collective
        assert len(tuner.decisions) == 1
    import os

    import torch.distributed as dist

    dist.barrier()  # rank 0 writes after the broadcast
    assert os.path.exists(f"{cache_dir}/rank0.json") and not os.path.exists(f"{cache_dir}/rank1.json")
    # a new tuner on every rank: rank 0 answers from its file, broadcast; rank 1 times nothing
    fresh = tuning.Tuner(timer=lambda run, reps: pytest.fail("timed again"), cache_file=f"{cache_dir}/rank{rank}.json")
    with tuning.use(fresh):
        assert _ask(fresh) == "a" and fresh.decisions == []


def _mismatched_ranks(rank, world_size):
    tuner = tuning.Tuner(timer=lambda run, reps: 1.0)
    with tuning.use(tuner):
        try:
            _ask(tuner, rows=8 if rank == 0 else 64)
        except RuntimeError as err:
            assert "rank 1 asked" in str(err) and "while rank 0 asked" in str(err)
            return
    raise AssertionError("no rank raised")


def test_rank0_decides_for_every_rank(tmp_path):
    run_ranks(_disagreeing_ranks, str(tmp_path))


def test_ranks_asking_different_questions_raise():
    run_ranks(_mismatched_ranks)
