"""Distributed tests: each spawns gloo ranks on the CPU through ``gloo_ranks.run_ranks``.

This directory's path is what makes ``import gloo_ranks`` work in the test modules (pytest puts a
test file's directory on sys.path) and in the spawned ranks (which inherit sys.path).
"""

import pytest
import torch.distributed as dist


def pytest_collection_modifyitems(config, items):
    if not dist.is_available() or not dist.is_gloo_available():
        skip = pytest.mark.skip(reason="torch.distributed with gloo is not available")
        for item in items:
            if "tests/distributed" in str(item.fspath):
                item.add_marker(skip)
