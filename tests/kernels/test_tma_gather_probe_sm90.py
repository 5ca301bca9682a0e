"""Compile scripts/tma_gather_probe.py's kernel (Gluon) for Hopper without a GPU: the row-by-row ways (one, two or
four loader warps, each row's index loaded before its copy or eight at a time) issue one TMA copy per row of each
[128, 64] stage, from one warp each 128 bytes after the last in shared memory (where a whole box puts that row before
the swizzle), the whole-box way one; none spills. The probe checks on a GPU that the rows land
where the MMA reads them. Runs in a subprocess (compiled kernels are unavailable in a process that set
TRITON_INTERPRET)."""

import json
from pathlib import Path

import pytest

from kernel_checks import script_result

pytest.importorskip("triton", reason="the triton package is not installed")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, SCRIPTS)
import tma_gather_probe as probe
from moetrain.kernels.grouped_gemm_aot import compiled_facts
rows = []
for way in [probe.BOX] + probe.ROW_WAYS:
    gather, loaders, batch = way
    for mma in (False, True):
        ck = probe.aot_compile(way, mma)
        ptx = ck.asm["ptx"]
        dests = [int(d) for d in re.findall(r"add\.s32\s+%r\d+, %r\d+, (\d+);\s*\n\s*elect\.sync", ptx)]
        rows.append(dict(gather=gather, loaders=loaders, batch=batch, mma=mma, dests=dests,
                         copies=ptx.count("cp.async.bulk.tensor"), **compiled_facts(ck)))
print(json.dumps(rows))
"""


def test_probe_compiles_for_sm90_with_one_copy_per_row():
    rows = json.loads(script_result(_SCRIPT.replace("SCRIPTS", repr(str(SCRIPTS)))))
    for row in rows:
        assert row["spill"] == 0 and row["tma"], row
        assert row["wgmma"] == row["mma"], row
        w_copy = 1 if row["mma"] else 0  # the MMA's fixed [128, 64] w block
        assert row["copies"] == (128 if row["gather"] else 1) + w_copy, row
        if row["gather"] and row["loaders"] == 1 and row["batch"] == 1:
            assert row["dests"] == [128 * r for r in range(1, 128)], row  # row 0 at the stage's start
