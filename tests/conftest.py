"""Shared pytest setup: GPU tests skip cleanly on machines without (enough) CUDA devices."""

import pytest


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
