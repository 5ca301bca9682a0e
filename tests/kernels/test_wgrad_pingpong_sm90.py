"""Compile the ping-pong weight gradient (kernels/wgrad_pingpong.py, Gluon) for Hopper without a GPU: it fits the
shared memory of a block, spills nothing, issues wgmma and TMA, and rebalances registers between its partitions.
Runs in a subprocess (compiled kernels are unavailable in a process that set TRITON_INTERPRET)."""

import json

import pytest

from kernel_checks import run_without_interpreter

pytest.importorskip("triton", reason="the triton package is not installed")

SMEM_BLOCK = 232448  # bytes of shared memory one block may use on H100/H200

_SCRIPT = r"""
import json, os, re, subprocess, tempfile
import triton
from moetrain.kernels import wgrad_pingpong as wp
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
rows = []
for tile, stages, gather in (((128, 128), 3, False), ((128, 128), 4, False), ((128, 128), 5, False),
                             ((64, 256), 3, False), ((64, 256), 4, False), ((128, 128), 3, True), ((128, 128), 4, True)):
    ck = wp.aot_compile(stages, tile=tile, gather=gather)
    ptx = ck.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stderr
    spill = re.search(r"(\d+) bytes spill stores", info)
    rows.append(dict(tile=tile, stages=stages, gather=gather, cp_async=ptx.count("cp.async.cg.shared.global"),
                     noinc="cp.async.mbarrier.arrive.noinc" in ptx, shared=ck.metadata.shared, spill=int(spill.group(1)) if spill else None,
                     wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
                     setmaxnreg=len(re.findall(r"setmaxnreg\.(?:inc|dec)", ptx))))
print(json.dumps(rows))
"""


def test_compiles_for_sm90_and_fits():
    proc = run_without_interpreter(_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["stages"] for r in rows] == [3, 4, 5, 3, 4, 3, 4]
    for row in rows:
        assert row["shared"] <= SMEM_BLOCK, row
        assert row["spill"] == 0, row
        assert row["wgmma"] and row["tma"], row
        assert row["setmaxnreg"] >= 3, row  # the consumers take registers, the producer gives them up
        if row["gather"]:  # 16-byte copies (8 per thread per step), each thread's arrival tracking its own
            assert row["cp_async"] == 8 and row["noinc"], row
