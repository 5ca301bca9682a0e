"""Shared pytest setup: GPU tests skip cleanly on machines without (enough) CUDA devices; every test gets
its own moetrain cache directory (the tuner's decisions) and a fresh tuner, never the user's; each xdist worker (and
the processes its tests start) uses its share of the CPU cores for intra-op threads; on a machine without a GPU, XLA
compiles the JAX tests' programs without LLVM's costly optimizations."""

import os
import shutil
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


def _quick_xla_cpu_compiles() -> None:
    """The JAX tests on the CPU are mostly XLA compile time (a training step's program compiles in ~10 s with LLVM's
    full optimization, ~4 s without): the programs are tiny, their run time is not what the tests measure, and the
    results are the same IEEE arithmetic. Set before jax starts its backend; XLA_FLAGS reaches the subprocesses."""
    if shutil.which("nvidia-smi") is not None:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0"
                                   " --xla_llvm_disable_expensive_passes=true").strip()


_quick_xla_cpu_compiles()


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
