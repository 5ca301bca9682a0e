"""Compile the ping-pong forward / data gradient (kernels/rowgroup_pingpong.py, Gluon) for Hopper without a GPU:
plain, with SwiGLU's backward in the data gradient's epilogue, and with SwiGLU in the forward's. Each fits the shared
memory of a block, spills nothing, issues wgmma and TMA, and rebalances registers between its partitions. Runs in a
subprocess (compiled kernels are unavailable in a process that set TRITON_INTERPRET)."""

import json

import pytest

from kernel_checks import check_pingpong_compiled, script_result

pytest.importorskip("triton", reason="the triton package is not installed")

_SCRIPT = r"""
import json
from moetrain.kernels import rowgroup_pingpong as rp
from moetrain.kernels.grouped_gemm_aot import compiled_facts
rows = []
for kw in (dict(stages=4, tile=(128, 128)), dict(stages=5, tile=(128, 128), dgrad=True), dict(stages=4, tile=(64, 256)),
           dict(stages=6, epilogue=rp.SWIGLU_BWD), dict(stages=5, epilogue=rp.SWIGLU_BWD, act=1),
           dict(stages=5, epilogue=rp.SWIGLU_FWD), dict(stages=4, epilogue=rp.SWIGLU_FWD, act=1, has_probs=False)):
    rows.append(dict(kw=repr(kw), **compiled_facts(rp.aot_compile(**kw))))
print(json.dumps(rows))
"""


def test_compiles_for_sm90_and_fits():
    rows = json.loads(script_result(_SCRIPT))
    assert len(rows) == 7
    for row in rows:
        check_pingpong_compiled(row)
