"""The multi-tensor AdamW and sum-of-squares kernels compiled for Hopper (sm_90a) without a GPU, at the default tile
and the dtype sets `moetrain bench optim` times: no register spills within the tile's register cap (which sets
the programs per SM), and a full chunk's loads and stores are 128-bit for fp32 tensors and 64-bit for 16-bit ones
(4 elements a thread): the bytes the floor counts move in whole vectors. Runs in a subprocess: a process that set
TRITON_INTERPRET has no compiled kernels."""

import json

import pytest

from kernel_checks import script_result

pytest.importorskip("triton", reason="the triton package is not installed")

_SCRIPT = r"""
import json, re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetrain.kernels import adamw as A
from moetrain.kernels.grouped_gemm_aot import spill_bytes

TILE = A.DEFAULT_TILE
F32, BF16 = tl.float32, tl.bfloat16
def build(fn, sig, consts, pointers):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": TILE.warps,
                                                                  "maxnreg": TILE.max_registers})
    ptx = ck.asm["ptx"]
    count = lambda pattern: len(re.findall(pattern, ptx))
    return dict(spill=spill_bytes(ptx), ld128=count(r"ld\.global\.v4\.b32"), ld64=count(r"ld\.global\.v2\.b32"),
                st128=count(r"st\.global\.v4\.b32"), st64=count(r"st\.global\.v2\.b32"))

common = dict(ALIGNED=True, BLOCK=TILE.block, CHUNK_BLOCKS=TILE.chunk // TILE.block)
update_sig = {"table_ptr": "*i64", "n": "i32", "total_chunks": "i32", "search_steps": "i32", "step_ptr": "*fp32",
              "lr_ptr": "*fp32", "scale_ptr": "*fp32", "inf_ptr": "*fp32", "weight_decay": "fp32", "eps": "fp32"}
sets = {"fp32 master": (F32, F32, F32, F32, BF16), "bf16 state": (BF16, BF16, BF16, BF16, None),
        "bf16 moments": (F32, F32, BF16, BF16, BF16)}
rows = {}
for name, (t, g, m, v, c) in sets.items():
    consts = dict(BETA1=0.9, BETA2=0.95, TARGET=t, GRAD=g, EXP_AVG=m, EXP_AVG_SQ=v, COPY=c, HAS_SCALE=True,
                  HAS_INF=True, **common)
    rows[name] = build(A._adamw_kernel, update_sig, consts, ["table_ptr", "step_ptr", "lr_ptr", "scale_ptr", "inf_ptr"])
for name, g in (("norm fp32", F32), ("norm bf16", BF16)):
    rows[name] = build(A._sq_partials_kernel, {"table_ptr": "*i64", "n": "i32", "total_chunks": "i32",
                       "search_steps": "i32", "partial_ptr": "*fp32"}, dict(GRAD=g, **common),
                       ["table_ptr", "partial_ptr"])
print(json.dumps(rows))
"""

# per dtype set: (128-bit loads, 64-bit loads, 128-bit stores, 64-bit stores) of a full chunk's vector step
WANT = {"fp32 master": (4, 0, 3, 1), "bf16 state": (0, 4, 0, 3), "bf16 moments": (2, 2, 1, 3)}


def test_adamw_kernels_compile_for_sm90_without_spills_in_whole_vectors():
    rows = json.loads(script_result(_SCRIPT))
    for name, row in rows.items():
        assert row["spill"] in (0, None), (name, row)
        if name in WANT:
            assert (row["ld128"], row["ld64"], row["st128"], row["st64"]) == WANT[name], (name, row)
    # the norm's chunk loop is unrolled (a whole chunk's loads in flight): only their width is fixed
    assert rows["norm fp32"]["ld128"] > 0 and rows["norm fp32"]["ld64"] == 0, rows["norm fp32"]
    assert rows["norm bf16"]["ld64"] > 0 and rows["norm bf16"]["ld128"] == 0, rows["norm bf16"]
