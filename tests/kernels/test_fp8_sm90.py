"""The FP8 blockwise kernels compiled for Hopper (sm_90a) without a GPU: each compiles, fits a block's shared
memory; the GEMMs issue FP8 wgmma (e4m3 operands); the quantizers spill no registers. Runs in a subprocess: a process that set
TRITON_INTERPRET has no compiled kernels."""

import json

import pytest

from kernel_checks import SMEM_BLOCK, script_result

pytest.importorskip("triton", reason="the triton package is not installed")

_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetrain.kernels import fp8_blockwise as fb, fp8_quantize as fq
from moetrain.kernels.grouped_gemm_aot import spill_bytes

P = "*fp8e4nv"
def build(fn, ints, ptrs, consts, warps, stages):
    sig = {**ptrs, **{k: "i32" for k in ints}, **{k: "constexpr" for k in consts}}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages})
    ptx = ck.asm["ptx"]
    return dict(shared=ck.metadata.shared, wgmma_fp8="wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx,
                spill=spill_bytes(ptx))

rows = {}
gemm_ptrs = {"a_ptr": P, "sa_ptr": "*fp32", "b_ptr": P, "sb_ptr": "*fp32", "y_ptr": "*bf16", "offs_ptr": "*i32"}
gemm_ints = ["M", "N", "K", "G", "ROW_TILES", "stride_am", "stride_sam", "stride_bg", "stride_bn", "stride_sbg",
             "stride_sbn", "stride_ym"]
rows["gemm"] = build(fb._grouped_blockwise_kernel, gemm_ints, gemm_ptrs,
                     dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, BLOCK_G=32, GROUP_M=8, PAIR=0), 8, 4)
wg_ptrs = {"at_ptr": P, "sat_ptr": "*fp32", "bt_ptr": P, "sbt_ptr": "*fp32", "dw_ptr": "*bf16", "offs_ptr": "*i32"}
wg_ints = ["M", "N", "K", "stride_atn", "stride_satn", "stride_btk", "stride_sbtk", "stride_dwg", "stride_dwn"]
rows["wgrad"] = build(fb._grouped_wgrad_blockwise_kernel, wg_ints, wg_ptrs, dict(BLOCK_N=128, BLOCK_K=128, BLOCK_R=128),
                      8, 3)
q_ptrs = {"x_ptr": "*bf16", "q_ptr": P, "s_ptr": "*fp32", "qt_ptr": P, "st_ptr": "*fp32"}
q_ints = ["R", "C", "stride_xb", "stride_xr", "stride_qb", "stride_qr", "stride_sb", "stride_sr", "stride_qtb",
          "stride_qtc", "stride_stb", "stride_stc"]
for square in (True, False):
    rows[f"quantize square={square}"] = build(fq._quantize_tile_2d_kernel, q_ints, q_ptrs,
                                              dict(BLOCK=128, CHUNK=16, FP8_MAX=448.0, SQUARE=square), 4, 1)
rows["quantize rows"] = build(fq._quantize_rows_kernel, ["M", "K", "stride_xm", "stride_qm", "stride_sm"],
                              {"x_ptr": "*bf16", "q_ptr": P, "s_ptr": "*fp32"}, dict(BLOCK_M=32, BLOCK=128,
                              FP8_MAX=448.0), 4, 1)
print(json.dumps(rows))
"""


def test_fp8_kernels_compile_for_sm90_fit_and_the_gemms_issue_fp8_wgmma():
    rows = json.loads(script_result(_SCRIPT))
    for name, row in rows.items():
        assert row["shared"] <= SMEM_BLOCK, (name, row)
    assert rows["gemm"]["wgmma_fp8"] and rows["wgrad"]["wgmma_fp8"], rows
    for name in ("quantize square=True", "quantize square=False", "quantize rows"):  # tiles walked in row chunks
        assert rows[name]["spill"] in (0, None), (name, rows[name])
