"""Shared pytest setup: GPU tests skip cleanly on machines without (enough) CUDA devices; every test gets
its own moetrain cache directory (the tuner's decisions) and a fresh tuner, never the user's; each xdist worker (and
the processes its tests start) uses its share of the CPU cores for intra-op threads."""

import os
import sys

import pytest


def _share_the_cores() -> None:
    """Under xdist, each worker's math libraries would otherwise start one thread per core, and the workers (and
    their tests' torchrun ranks) oversubscribe the machine: on 2 cores and 2 workers that costs ~15% of the suite's
    time. Set before the worker imports torch; OMP_NUM_THREADS reaches the subprocesses too."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores()


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE_DIR", str(tmp_path / "moetrain-cache"))
    tuning = sys.modules.get("moetrain.tuning")
    if tuning is not None:  # a fresh process tuner: no memo, the new directory's cache file
        tuning.reset()


def _cuda_device_count() -> int:
    try:
        import torch  # only imported when a gpu/multigpu test was collected
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    wanted = [i for i in items if i.get_closest_marker("gpu") or i.get_closest_marker("multigpu")]
    if not wanted:
        return
    count = _cuda_device_count()
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    few_gpus = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs (found {count})")
    for item in wanted:
        if count == 0:
            item.add_marker(no_gpu)
        elif item.get_closest_marker("multigpu") and count < 2:
            item.add_marker(few_gpus)
