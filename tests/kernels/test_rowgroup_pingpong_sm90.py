"""Compile the ping-pong forward / data gradient (kernels/rowgroup_pingpong.py, Gluon) for Hopper without a GPU:
plain, with SwiGLU's backward in the data gradient's epilogue, and with SwiGLU in the forward's. Each fits the shared
memory of a block, spills nothing, issues wgmma and TMA, and rebalances registers between its partitions. Runs in a
subprocess (compiled kernels are unavailable in a process that set TRITON_INTERPRET)."""

import json

import pytest

from kernel_checks import run_without_interpreter

pytest.importorskip("triton", reason="the triton package is not installed")

SMEM_BLOCK = 232448  # bytes of shared memory one block may use on H100/H200

_SCRIPT = r"""
import json, re
from moetrain.kernels import rowgroup_pingpong as rp
from moetrain.kernels.grouped_gemm_aot import spill_bytes
rows = []
for kw in (dict(stages=4, tile=(128, 128)), dict(stages=5, tile=(128, 128), dgrad=True), dict(stages=4, tile=(64, 256)),
           dict(stages=6, epilogue=rp.SWIGLU_BWD), dict(stages=5, epilogue=rp.SWIGLU_BWD, act=1),
           dict(stages=5, epilogue=rp.SWIGLU_FWD), dict(stages=4, epilogue=rp.SWIGLU_FWD, act=1, has_probs=False)):
    ck = rp.aot_compile(**kw)
    ptx = ck.asm["ptx"]
    rows.append(dict(kw=repr(kw), shared=ck.metadata.shared, spill=spill_bytes(ptx),
                     wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
                     setmaxnreg=len(re.findall(r"setmaxnreg\.(?:inc|dec)", ptx))))
print(json.dumps(rows))
"""


def test_compiles_for_sm90_and_fits():
    proc = run_without_interpreter(_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 7
    for row in rows:
        assert row["shared"] <= SMEM_BLOCK, row
        assert row["spill"] == 0, row
        assert row["wgmma"] and row["tma"], row
        assert row["setmaxnreg"] >= 3, row  # the consumers take registers, the producer gives them up
