"""Shared pytest setup: GPU tests skip cleanly on machines without (enough) CUDA devices; every test gets
its own moetrain cache directory (the tuner's decisions) and a fresh tuner, never the user's."""

import sys

import pytest


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
