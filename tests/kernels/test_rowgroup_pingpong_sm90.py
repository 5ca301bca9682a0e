"""Compile the ping-pong forward / data gradient (kernels/rowgroup_pingpong.py, Gluon) for Hopper without a GPU,
with and without SwiGLU's backward in the data gradient's epilogue: each fits the shared memory of a block, spills
nothing, issues wgmma and TMA, and rebalances registers between its partitions. Runs in a subprocess (compiled
kernels are unavailable in a process that set TRITON_INTERPRET)."""

import json

import pytest

from kernel_checks import run_without_interpreter

pytest.importorskip("triton", reason="the triton package is not installed")

SMEM_BLOCK = 232448  # bytes of shared memory one block may use on H100/H200

_SCRIPT = r"""
import json, os, re, subprocess, tempfile
import triton
from moetrain.kernels import rowgroup_pingpong as rp
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
rows = []
for kw in (dict(stages=4, tile=(128, 128)), dict(stages=5, tile=(128, 128), dgrad=True), dict(stages=4, tile=(64, 256)),
           dict(stages=4, swiglu=True), dict(stages=3, swiglu=True, act=1, has_probs=False)):
    ck = rp.aot_compile(**kw)
    ptx = ck.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stderr
    spill = re.search(r"(\d+) bytes spill stores", info)
    rows.append(dict(kw=repr(kw), shared=ck.metadata.shared, spill=int(spill.group(1)) if spill else None,
                     wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
                     setmaxnreg=len(re.findall(r"setmaxnreg\.(?:inc|dec)", ptx))))
print(json.dumps(rows))
"""


def test_compiles_for_sm90_and_fits():
    proc = run_without_interpreter(_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 5
    for row in rows:
        assert row["shared"] <= SMEM_BLOCK, row
        assert row["spill"] == 0, row
        assert row["wgmma"] and row["tma"], row
        assert row["setmaxnreg"] >= 3, row  # the consumers take registers, the producer gives them up
