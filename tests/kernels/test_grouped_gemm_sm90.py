"""Compile every grouped GEMM autotune config for Hopper (sm_90a) without a GPU and check what
the H200 will get: it compiles, fits the 227 KiB of shared memory a block may use, spills no
registers, issues wgmma, loads through TMA (or cp.async on the pointer path), and the tile loop
is software-pipelined (loads of later steps in flight while wgmma runs).

Runs in a subprocess: the compiled kernels are unavailable in a process that set TRITON_INTERPRET.
"""

import json

import pytest

from kernel_checks import SMEM_BLOCK, script_result

pytest.importorskip("triton", reason="the triton package is not installed")

SMEM_SM = 233472  # per SM, shared by its resident blocks (each also reserves 1 KiB)

_SCRIPT = r"""
import json
from moetrain.kernels import grouped_gemm_aot as aot
from moetrain.kernels import grouped_gemm as gg
rows = []
launches = []
for op in ("fwd", "fwd_gather", "dgrad", "wgrad", "wgrad_gather"):
    for cfg in gg.configs_for(op):
        if cfg.tail_split and not op.startswith("wgrad"):  # the body launch, then the half-height tail
            launches += [(op, cfg, 1, cfg.block_m), (op, gg.tail_config(cfg), 2, cfg.block_m)]
        else:
            launches.append((op, cfg, 0, None))
for op, cfg, part, big_m in launches:
    ck = aot.aot_compile(op, cfg, part=part, big_m=big_m)
    ptx, ttgir = ck.asm["ptx"], ck.asm["ttgir"]
    spill = aot.spill_bytes(ptx)
    rows.append(dict(op=op, config=str(cfg), part=part, tma=cfg.use_tma, shared=ck.metadata.shared, spill=spill,
                     per_sm=cfg.programs_per_sm,
                     wgmma="wgmma.mma_async" in ptx, tma_load="cp.async.bulk.tensor" in ptx,
                     cp_async="cp.async.cg" in ptx or "cp.async.ca" in ptx,
                     # an MMA left in flight while the next loads issue
                     pipelined="pendings = 1" in ttgir))
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def compiled():
    return json.loads(script_result(_SCRIPT))


def test_every_config_compiles_for_sm90_and_fits(compiled):
    assert len(compiled) >= 10
    for row in compiled:
        assert row["shared"] <= SMEM_BLOCK, row
        assert (row["shared"] + 1024) * row["per_sm"] <= SMEM_SM, row
        assert row["spill"] in (0, None), row
        assert row["wgmma"], row
        assert row["pipelined"], row
        if row["tma"]:
            assert row["tma_load"], row
        else:
            assert row["cp_async"], row
