"""Compile the ping-pong weight gradient (kernels/wgrad_pingpong.py, Gluon) for Hopper without a GPU: it fits the
shared memory of a block, spills nothing, issues wgmma and TMA, and rebalances registers between its partitions.
Runs in a subprocess (compiled kernels are unavailable in a process that set TRITON_INTERPRET)."""

import json

import pytest

from kernel_checks import check_pingpong_compiled, script_result

pytest.importorskip("triton", reason="the triton package is not installed")

_SCRIPT = r"""
import json
from moetrain.kernels import wgrad_pingpong as wp
from moetrain.kernels.grouped_gemm_aot import compiled_facts
rows = []
for tile, stages, gather in (((128, 128), 3, False), ((128, 128), 4, False), ((128, 128), 5, False),
                             ((64, 256), 3, False), ((64, 256), 4, False), ((128, 128), 3, True), ((128, 128), 4, True)):
    ck = wp.aot_compile(stages, tile=tile, gather=gather)
    ptx = ck.asm["ptx"]
    rows.append(dict(tile=tile, stages=stages, gather=gather, cp_async=ptx.count("cp.async.cg.shared.global"),
                     noinc="cp.async.mbarrier.arrive.noinc" in ptx, **compiled_facts(ck)))
print(json.dumps(rows))
"""


def test_compiles_for_sm90_and_fits():
    rows = json.loads(script_result(_SCRIPT))
    assert [r["stages"] for r in rows] == [3, 4, 5, 3, 4, 3, 4]
    for row in rows:
        check_pingpong_compiled(row)
        if row["gather"]:  # 16-byte copies (8 per thread per step), each thread's arrival tracking its own
            assert row["cp_async"] == 8 and row["noinc"], row
