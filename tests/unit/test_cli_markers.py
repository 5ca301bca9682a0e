"""tests/conftest.py: `gpu` and `multigpu` tests skip cleanly when CUDA devices are missing."""

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def test_gpu_markers_skip_without_enough_devices(pytester):
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: gpu\n    multigpu: multigpu\naddopts = --strict-markers\n")
    pytester.makepyfile(test_marks="""
        import pytest

        def test_cpu():
            pass

        @pytest.mark.gpu
        def test_gpu():
            import torch
            assert torch.cuda.is_available()

        @pytest.mark.multigpu
        def test_two_gpus():
            import torch
            assert torch.cuda.device_count() >= 2
    """)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    gpu_ok = count >= 1
    multi_ok = count >= 2
    result.assert_outcomes(passed=1 + gpu_ok + multi_ok, skipped=(not gpu_ok) + (not multi_ok))
    if not gpu_ok:
        result.stdout.fnmatch_lines(["*needs a CUDA GPU*"])
