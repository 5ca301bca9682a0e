"""scripts/gap_sources.py's trace reading (moetrain.bench.launch_trace) on a made-up Chrome trace: the profiler
itself needs a GPU."""

import pytest

from moetrain.bench.launch_trace import call_launches, describe_launches


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def trace():
    return {"traceEvents": [
        _x("user_annotation", "call 0", 1000.0, 500.0),
        _x("python_function", "/x/moetrain/ops/moe.py(150): _moe_experts", 1005.0, 300.0),
        _x("python_function", "/x/moetrain/ops/moe.py(80): sort_rows", 1010.0, 40.0),
        _x("python_function", "/x/torch/nn/functional.py(9): linear", 1002.0, 2.0),
        _x("cuda_runtime", "cudaLaunchKernel", 1003.0, 1.0, correlation=1),  # no moetrain frame around it
        _x("cuda_runtime", "cudaLaunchKernel", 1020.0, 1.0, correlation=2),  # inside sort_rows
        _x("cuda_driver", "cuLaunchKernelEx", 1100.0, 1.0, correlation=3),  # inside _moe_experts only
        _x("cuda_runtime", "cudaLaunchKernel", 2000.0, 1.0, correlation=9),  # after the call: not its own
        _x("kernel", "router_gemm", 1010.0, 5.0, correlation=1),
        _x("kernel", "sort", 1025.0, 10.0, correlation=2),
        _x("kernel", "_rowgroup_kernel", 1105.0, 300.0, correlation=3),
        _x("kernel", "later", 2005.0, 1.0, correlation=9),
        _x("gpu_memset", "Memset (Device)", 1040.0, 2.0, correlation=77),  # its launch is not in the trace
    ]}


def test_launches_carry_host_times_idle_gaps_and_sources():
    got = call_launches(trace())
    assert [x.name for x in got] == ["router_gemm", "sort", "Memset (Device)", "_rowgroup_kernel"]
    assert [x.host_us for x in got][:2] == [3.0, 20.0] and got[3].host_us == 100.0
    assert got[2].host_us != got[2].host_us and got[2].source == "?"  # no launch event: NaN, unknown source
    assert [x.host_step_us for x in got][:2] == [0.0, 17.0] and got[3].host_step_us == 80.0
    assert [x.idle_before_us for x in got] == [0.0, 10.0, 5.0, 63.0]  # 1015 -> 1025, 1035 -> 1040, 1042 -> 1105
    assert [x.source for x in got[:2]] + [got[3].source] == ["", "ops/moe.py:80 sort_rows",
                                                            "ops/moe.py:150 _moe_experts"]
    text = describe_launches(got, min_idle_us=20.0, first=2)
    assert "0.08 ms in 1 gaps" in text and text.count("_rowgroup_kernel") == 1  # listed once, among the gaps
    assert "(no moetrain frame)" in text


def test_a_trace_without_the_call_range_is_an_error():
    with pytest.raises(ValueError, match="no host range 'call 0'"):
        call_launches({"traceEvents": []})
