"""The MXFP8 kernels (``kernels.fp8_mx``) compiled ahead of time without a GPU, with DOT_SCALED: for Blackwell
(sm_100a) both GEMMs issue the block-scaled tensor-core MMA (tcgen05.mma kind::mxf8f6f4.block_scale, E8M0 scales
per 32 values: scale_vec::1X); for Hopper (sm_90a), where Triton emulates dot_scaled, a bf16 wgmma; each fits a
block's shared memory; the quantizer spills nothing. Runs in a subprocess: a process that set TRITON_INTERPRET has
no compiled kernels. sm_100a needs Triton's bundled ptxas for Blackwell (the test skips, saying so, without it)."""

import json
import os

import pytest

from kernel_checks import SMEM_BLOCK, script_result

triton = pytest.importorskip("triton", reason="the triton package is not installed")

_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetrain.kernels import fp8_mx as k
from moetrain.kernels.grouped_gemm_aot import spill_bytes

P = "*fp8e4nv"
def build(fn, ints, ptrs, consts, warps, stages, cap):
    sig = {**ptrs, **{n: "i32" for n in ints}, **{n: "constexpr" for n in consts}}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", cap, 32),
                        options={"num_warps": warps, "num_stages": stages})
    ptx = ck.asm["ptx"]
    mma = sorted(set(re.findall(r"tcgen05\.mma[\w.:]*|wgmma\.mma_async[\w.]*", ptx)))
    return dict(shared=ck.metadata.shared, mma=mma, target=re.findall(r"\.target (\S+)", ptx),
                spill=spill_bytes(ptx) if cap == 90 else None, cubin=len(ck.asm["cubin"]))

rows = {}
gemm_ptrs = {"a_ptr": P, "sa_ptr": "*u8", "b_ptr": P, "sb_ptr": "*u8", "y_ptr": "*bf16", "offs_ptr": "*i32"}
gemm_ints = ["M", "N", "K", "G", "ROW_TILES", "stride_am", "stride_sam", "stride_bg", "stride_bn", "stride_sbg",
             "stride_sbn", "stride_ym"]
wg_ptrs = {"at_ptr": P, "sat_ptr": "*u8", "bt_ptr": P, "sbt_ptr": "*u8", "dw_ptr": "*bf16", "offs_ptr": "*i32"}
wg_ints = ["M", "N", "K", "stride_atn", "stride_satn", "stride_btk", "stride_sbtk", "stride_dwg", "stride_dwn"]
q_ptrs = {"x_ptr": "*bf16", "q_ptr": P, "s_ptr": "*u8"}
q_ints = ["R", "C", "stride_xb", "stride_xr", "stride_xc", "stride_qb", "stride_qr", "stride_sb", "stride_sr"]
for cap in (100, 90):
    rows[f"gemm sm_{cap}"] = build(k._grouped_mx_kernel, gemm_ints, gemm_ptrs, dict(BLOCK_M=128, BLOCK_N=128,
                                   BLOCK_K=128, BLOCK_G=32, GROUP_M=8, DOT_SCALED=True), 8, 3, cap)
    rows[f"wgrad sm_{cap}"] = build(k._grouped_wgrad_mx_kernel, wg_ints, wg_ptrs, dict(BLOCK_N=128, BLOCK_K=128,
                                    BLOCK_R=128, DOT_SCALED=True), 8, 3, cap)
    rows[f"quantize sm_{cap}"] = build(k._quantize_mx_kernel, q_ints, q_ptrs, dict(BLOCK_R=32, BLOCK_C=128,
                                       FP8_MAX=448.0), 4, 1, cap)
print(json.dumps(rows))
"""

BLOCK_SCALED_MMA = "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X"


def _blackwell_ptxas() -> bool:
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                       "ptxas-blackwell"))


def test_mx_gemms_issue_block_scaled_mma_on_sm100_and_emulate_on_sm90():
    if not _blackwell_ptxas():
        pytest.skip("triton's bundled ptxas-blackwell is missing: sm_100a cannot be assembled here")
    rows = json.loads(script_result(_SCRIPT))
    for name, row in rows.items():
        assert row["shared"] <= SMEM_BLOCK and row["cubin"] > 0, (name, row)
    for name in ("gemm", "wgrad"):
        assert rows[f"{name} sm_100"]["target"] == ["sm_100a"], rows
        assert rows[f"{name} sm_100"]["mma"] == [BLOCK_SCALED_MMA], rows
        assert rows[f"{name} sm_90"]["target"] == ["sm_90a"], rows
        assert rows[f"{name} sm_90"]["mma"] == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"], rows
    assert rows["quantize sm_90"]["spill"] in (0, None), rows
