"""Ahead-of-time compilation of the grouped GEMM kernels for a GPU target, without a GPU:
resource and instruction checks (shared memory, wgmma, TMA, spills) in the CPU tests."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton

from moetrain.kernels.grouped_gemm import _block_g
from moetrain.kernels.grouped_gemm_kernels import _rowgroup_kernel, _wgrad_kernel
from moetrain.kernels.grouped_gemm_configs import GemmConfig


def aot_compile(op: str, config: GemmConfig, dtype: str = "bf16", capability: int = 90, num_groups: int = 256,
                part: int = 0, big_m: int | None = None):
    """Compile one op's kernel for CUDA compute capability ``capability`` without a GPU.

    op: "fwd", "fwd_gather", "dgrad", "wgrad" or "wgrad_gather"; dtype: Triton type name ("bf16", "fp16",
    "fp32"); part / big_m: the forward / dgrad launch of a tail split (1 body, 2 tail with big_m the body's
    BLOCK_M; 0 no split).
    Returns the triton CompiledKernel (``.metadata.shared`` bytes of shared memory, ``.asm["ptx"|"cubin"|
    "ttgir"]``). Integer sizes and strides are compiled as multiples of 16, as at the benchmark
    shapes. Needs the compiled (not interpreted) kernels: run without TRITON_INTERPRET.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if config.kernel == "pingpong":
        if op not in ("fwd", "dgrad", "wgrad", "wgrad_gather") or dtype != "bf16":
            raise ValueError(f"the ping-pong kernels compute bf16 forwards, data and weight gradients, rows not "
                             f"gathered in the forward (asked: {op}, {dtype})")
        if op in ("fwd", "dgrad"):
            from moetrain.kernels import rowgroup_pingpong

            return rowgroup_pingpong.aot_compile(config.num_stages, (config.block_m, config.block_n),
                                                 dgrad=op == "dgrad", capability=capability,
                                                 group_m=config.group_m)
        from moetrain.kernels import wgrad_pingpong

        return wgrad_pingpong.aot_compile(config.num_stages, config.group_m, (config.block_m, config.block_n),
                                          capability, gather=op == "wgrad_gather", cohorts=config.cohorts,
                                          mix=config.mix, sorted_groups=config.sorted_groups)
    bm, bn, bk, tma = config.block_m, config.block_n, config.block_k, config.use_tma
    ptr = f"*{dtype}"

    def desc(*block):
        return f"tensordesc<{dtype}[{', '.join(str(b) for b in block)}]>" if tma else ptr

    if op in ("fwd", "fwd_gather", "dgrad"):
        fn = _rowgroup_kernel
        gather = op == "fwd_gather"
        sig = {"a_ptr": ptr, "a_desc": ptr if gather else desc(bm, bk), "gather_ptr": "*i32", "w_ptr": ptr,
               "w_desc": desc(1, bk, bn) if op == "dgrad" else desc(1, bn, bk),
               "out_ptr": ptr, "out_desc": desc(1, 1, bm, bn), "offs_ptr": "*i32", "sched_ptr": "*i32"}
        ints = ["M", "OUT", "RED", "G", "stride_am", "stride_wg", "stride_w1", "stride_om", "NUM_PROGS"]
        consts = dict(DGRAD=op == "dgrad", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
                      BLOCK_G=_block_g(num_groups), USE_TMA=tma, FLATTEN=True, PRECISION="tf32", GATHER=gather,
                      PART=part, BIG_M=big_m or bm, MIX=config.mix)
    elif op in ("wgrad", "wgrad_gather"):
        fn = _wgrad_kernel
        gather = op == "wgrad_gather"
        sig = {"dy_ptr": ptr, "dy_desc": desc(1, 1, bk, bm), "x_ptr": ptr,
               "x_desc": ptr if gather else desc(1, 1, bk, bn), "gather_ptr": "*i32",
               "dw_ptr": ptr, "dw_desc": desc(1, bm, bn), "offs_ptr": "*i32"}
        ints = ["M", "N", "K", "G", "stride_dym", "stride_xm", "stride_dwg", "stride_dwn", "NUM_PROGS"]
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_N=config.group_m, BLOCK_G=_block_g(num_groups),
                      USE_TMA=tma, PRECISION="tf32", GATHER=gather, TMA_STORE=config.tma_store)
    else:
        raise ValueError(f"unknown op {op!r}; valid: fwd, fwd_gather, dgrad, wgrad, wgrad_gather")
    sig.update({name: "i32" for name in ints})
    sig.update({name: "constexpr" for name in consts})
    aligned = [n for n, t in sig.items() if t.startswith("*")] + [n for n in ints if n not in ("M", "G", "NUM_PROGS")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


def spill_bytes(ptx: str, arch: str = "sm_90a") -> int | None:
    """Bytes of spill stores when triton's bundled ptxas assembles ``ptx`` for ``arch``; None without a ptxas."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stderr
    found = re.search(r"(\d+) bytes spill stores", info)
    return int(found.group(1)) if found else None


def compiled_facts(ck) -> dict:
    """What the sm_90a compile tests check of a compiled warp-specialized kernel: its shared memory, spilled bytes
    (spill_bytes), whether its PTX issues wgmma and TMA copies, and its register rebalancing (setmaxnreg count)."""
    ptx = ck.asm["ptx"]
    return dict(shared=ck.metadata.shared, spill=spill_bytes(ptx), wgmma="wgmma.mma_async" in ptx,
                tma="cp.async.bulk.tensor" in ptx, setmaxnreg=len(re.findall(r"setmaxnreg\.(?:inc|dec)", ptx)))
