"""The fused loss's kernels (``kernels.cross_entropy``) compiled for Hopper (sm_90a) without a GPU, at the default
block and warps, for bf16 and fp32 logits: no register spills, and where V and the row stride are multiples of 16
(Triton specializes such integer arguments at launch; Qwen3's 151936 and DeepSeek-V3's 129280 are, and so are their
8-way vocab shards) the logits move in 128-bit loads and stores. Runs in a subprocess: a process that set
TRITON_INTERPRET has no compiled kernels."""

import json

import pytest

from kernel_checks import script_result

pytest.importorskip("triton", reason="the triton package is not installed")

_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetrain.kernels import cross_entropy as K
from moetrain.kernels.grouped_gemm_aot import spill_bytes

def build(fn, z, outs):
    sig = {"z_ptr": z, "labels_ptr": "*i64", **{o: "*fp32" for o in outs}, "V": "i32", "stride": "i32",
           "ignore_index": "i32", "vocab_start": "i32", "BLOCK": "constexpr"}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ["z_ptr", "labels_ptr", *outs, "V", "stride"]}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={"BLOCK": K.BLOCK}, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": K.WARPS})
    ptx = ck.asm["ptx"]
    count = lambda pattern: len(re.findall(pattern, ptx))
    return dict(spill=spill_bytes(ptx), ld128=count(r"ld\.global\.v4\.b32"), st128=count(r"st\.global\.v4\.b32"))

rows = {}
for name, z in (("bf16", "*bf16"), ("fp32", "*fp32")):
    rows["stats " + name] = build(K._stats_kernel, z, ["m_ptr", "s_ptr", "zt_ptr"])
    rows["grad " + name] = build(K._grad_kernel, z, ["lse_ptr"])
    rows["fused " + name] = build(K._fused_kernel, z, ["lse_ptr", "zt_ptr"])
print(json.dumps(rows))
"""

# per kernel, a block's (128-bit loads, 128-bit stores) of the logits: BLOCK / (32 x WARPS) elements a thread, 8 bf16
# or 4 fp32 per 128 bits; the fused kernel loads each block twice (its two passes)
WANT = {"stats bf16": (2, 0), "grad bf16": (2, 2), "fused bf16": (4, 2),
        "stats fp32": (4, 0), "grad fp32": (4, 4), "fused fp32": (8, 4)}


def test_cross_entropy_kernels_compile_for_sm90_without_spills_in_whole_vectors():
    rows = json.loads(script_result(_SCRIPT))
    assert set(rows) == set(WANT)
    for name, row in rows.items():
        assert row["spill"] in (0, None), (name, row)
        assert (row["ld128"], row["st128"]) == WANT[name], (name, row)
