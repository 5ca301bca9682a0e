"""bench moe --profile's timeline summary: busy time as the union of kernel intervals, idle gaps, on made-up
kernels (the profiler itself runs on a GPU only)."""

import pytest

from moetrain.bench.gpu_timeline import CallTimeline, describe, kernel_totals, timeline


def test_busy_time_is_the_union_and_gaps_are_listed_largest_first():
    kernels = [(130.0, 200.0, "b"), (100.0, 150.0, "a"),  # overlap: busy 100..200
               (260.0, 300.0, "c"),  # a 60 us gap before c
               (305.0, 310.0, "d"),  # 5 us: below the 20 us threshold
               (1310.0, 1400.0, "e")]  # a 1 ms gap before e
    t = timeline(90.0, kernels)
    assert t.busy_us == 100.0 + 40.0 + 5.0 + 90.0
    assert t.wall_us == 1400.0 - 90.0 and t.first_kernel_us == 10.0
    assert t.idle_us == t.wall_us - t.busy_us
    assert t.gaps == [(1000.0, "e"), (60.0, "c")]


def test_a_kernel_inside_another_does_not_end_the_run():
    t = timeline(0.0, [(0.0, 100.0, "long"), (10.0, 20.0, "short"), (150.0, 160.0, "next")])
    assert t.busy_us == 110.0 and t.gaps == [(50.0, "next")]


def test_describe_and_empty_calls():
    assert timeline(5.0, []).wall_us == 0.0
    call = CallTimeline(wall_us=2000.0, busy_us=1500.0, first_kernel_us=100.0, gaps=[(300.0, "gemm")],
                        runtime={"cudaMalloc": (2, 900.0)})
    line = describe(call)
    assert "idle 0.50" in line and "0.30 ms before gemm" in line and "cudaMalloc x2 (0.90 ms)" in line


def test_kernel_totals_average_the_calls():
    one = timeline(0.0, [(0.0, 10.0, "gemm"), (12.0, 14.0, "swiglu"), (20.0, 30.0, "gemm")])
    two = timeline(0.0, [(0.0, 30.0, "gemm")])
    assert one.kernels == {"gemm": (2, 20.0), "swiglu": (1, 2.0)}
    assert kernel_totals([one, two]) == {"gemm": (1.5, 25.0), "swiglu": (0.5, 1.0)}


@pytest.mark.gpu
def test_profile_calls_finds_the_kernels_of_each_call():
    import torch

    from moetrain.bench.gpu_timeline import profile_calls

    a = torch.randn(2048, 2048, device="cuda")
    calls = profile_calls(lambda: a @ a @ a, calls=2)
    assert len(calls) == 2
    for call in calls:
        assert sum(n for n, _ in call.kernels.values()) == 2, call.kernels  # two GEMMs per call
        assert 0 < call.busy_us <= call.wall_us
