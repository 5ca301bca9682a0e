"""The JAX backend's Triton wrapper kernels (moetrain.jax.triton_gemm: rows_kernel, wgrad_kernel) launched from torch,
against the float64 references: the wrappers' argument order, constexpr strides and fixed options are what jax-triton
launches on a GPU. Without a GPU they run in Triton's interpreter in float32 (the interpreter computes bf16 dots
wrongly in triton 3.6), and their sm_90a compile is checked in a subprocess; jax is not needed, jax-triton's own call
is covered on the GPU (tests/jax).
Outputs are poisoned with NaN before every run.

Legend: M rows, G groups, N = w.shape[1], K = w.shape[2].
"""

import json

import pytest
import torch

from kernel_checks import FP32_BOUND, SMEM_BLOCK, rel_err, script_result
from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.jax import triton_gemm as tg  # noqa: E402
from moetrain.kernels import grouped_gemm as gg  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU:
    gg.interpreter_numpy_shim()  # as the torch launchers do before an interpreted launch
pytestmark = pytest.mark.usefixtures("exact_fp32")  # tests/kernels/conftest.py

# (name, cumulative row ends, M): uneven and empty groups with padding rows past the last end, and one group.
CASES = [
    ("uneven_empty_padding", [10, 10, 47, 60], 70),
    ("one_group", [37], 37),
]
TILES = [gg.GemmConfig(32, 32, 16, 1, 4, use_tma=False), gg.GemmConfig(16, 32, 16, 1, 4, use_tma=False, group_m=2)]


def _rows(a, w, ends, dgrad, tiles, programs):
    scalars, nprog, consts = tg.rows_args(a.shape[0], a.shape[1], tuple(w.shape), dgrad, programs, tiles)
    out = torch.full((a.shape[0], consts["OUT"]), float("nan"), device=DEVICE)
    tg.rows_kernel[(nprog,)](a, w, ends, *scalars, out, FLATTEN=ON_GPU, num_warps=tiles.num_warps,
                             num_stages=tiles.num_stages, **consts)
    return out


def _wgrad(dy, x, ends, tiles, programs):
    (m, n), k, g = dy.shape, x.shape[1], ends.shape[0]
    scalars, nprog, consts = tg.wgrad_args(m, n, k, g, programs, tiles)
    dw = torch.full((g, n, k), float("nan"), device=DEVICE)
    tg.wgrad_kernel[(nprog,)](dy, x, ends, *scalars, dw, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                              **consts)
    return dw


@pytest.mark.parametrize("tiles", TILES, ids=str)
@pytest.mark.parametrize("name,ends,m", CASES, ids=[c[0] for c in CASES])
def test_wrapper_kernels_match_fp64(name, ends, m, tiles):
    n, k = 40, 20  # neither a multiple of 32; K=20 leaves a partial reduction step
    gen = torch.Generator().manual_seed(m)
    x, w, dy = (torch.randn(*s, generator=gen).to(DEVICE) for s in ((m, k), (len(ends), n, k), (m, n)))
    ends_t = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    programs = 3  # several programs share the tiles

    y = _rows(x, w, ends_t, False, tiles, programs)
    assert rel_err(y, gg.grouped_gemm_ref(x.double(), w.double(), ends_t)) < FP32_BOUND
    assert torch.equal(y[ends[-1]:], torch.zeros_like(y[ends[-1]:]))
    dx = _rows(dy, w, ends_t, True, tiles, programs)
    assert rel_err(dx, gg.grouped_gemm_dgrad_ref(dy.double(), w.double(), ends_t)) < FP32_BOUND
    assert torch.equal(dx[ends[-1]:], torch.zeros_like(dx[ends[-1]:]))
    dw = _wgrad(dy, x, ends_t, tiles, programs)
    assert rel_err(dw, gg.grouped_gemm_wgrad_ref(dy.double(), x.double(), ends_t)) < FP32_BOUND


def test_launch_arguments():
    # DeepSeek-V3 EP8's FC1 on 132 SMs: the persistent grids, the constexpr strides of contiguous operands.
    scalars, nprog, consts = tg.rows_args(65536, 7168, (32, 4096, 7168), False, 132, tg.ROWS_TILES)
    assert scalars == (65536, 32, 132) and nprog == 132
    assert (consts["OUT"], consts["RED"], consts["STRIDE_WG"], consts["STRIDE_W1"]) == (4096, 7168, 4096 * 7168, 7168)
    scalars, nprog, consts = tg.rows_args(65536, 4096, (32, 4096, 7168), True, 132, tg.ROWS_TILES)
    assert consts["OUT"] == 7168 and consts["STRIDE_OM"] == 7168 and consts["DGRAD"]
    _, nprog, _ = tg.rows_args(10, 8, (1, 16, 8), False, 132, tg.ROWS_TILES)
    assert nprog == 2  # (1 row tile + 1 group) x 1 column tile
    scalars, nprog, consts = tg.wgrad_args(100, 48, 40, 3, 132, tg.WGRAD_TILES)
    assert nprog == 3 and consts["STRIDE_DWG"] == 48 * 40
    assert tg.block_g(3) == 256 and tg.block_g(300) == 512


@pytest.mark.parametrize("cfg", [gg.GemmConfig(128, 256, 64, 3, 8), gg.GemmConfig(128, 256, 64, 3, 8, use_tma=False,
                                                                                   tail_split=True)], ids=str)
def test_configs_the_wrappers_cannot_run_are_refused(cfg):
    with pytest.raises(ValueError, match="is not a pointer-load config of the Triton kernels"):
        tg.check_tiles(cfg)
    tg.check_tiles(tg.ROWS_TILES)


_SM90_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetrain.jax import triton_gemm as tg
from moetrain.kernels.grouped_gemm_aot import spill_bytes

def compile_sm90(fn, ptrs, consts, tiles):
    # as jax-triton specializes: arrays 16-byte aligned, the runtime scalars (M, G, NUM_PROGS) plain i32
    sig = {name: "*bf16" for name in ptrs}
    sig.update(ends_ptr="*i32", M="i32", G="i32", NUM_PROGS="i32")
    sig.update({name: "constexpr" for name in consts})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, "ends_ptr")}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    ptx = ck.asm["ptx"]
    return dict(shared=ck.metadata.shared, spill=spill_bytes(ptx), wgmma="wgmma.mma_async" in ptx,
                cp_async="cp.async.cg" in ptx or "cp.async.ca" in ptx)

M, H, N, E = 65536, 7168, 4096, 32  # DeepSeek-V3 EP8's FC1
rows = {}
for dgrad in (False, True):
    _, _, consts = tg.rows_args(M, N if dgrad else H, (E, N, H), dgrad, 132, tg.ROWS_TILES)
    rows["dgrad" if dgrad else "fwd"] = compile_sm90(tg.rows_kernel, ("a_ptr", "w_ptr", "out_ptr"),
                                                    dict(consts, FLATTEN=True), tg.ROWS_TILES)
_, _, consts = tg.wgrad_args(M, N, H, E, 132, tg.WGRAD_TILES)
rows["wgrad"] = compile_sm90(tg.wgrad_kernel, ("dy_ptr", "x_ptr", "dw_ptr"), consts, tg.WGRAD_TILES)
print(json.dumps(rows))
"""


def test_wrappers_compile_pipelined_for_sm90():
    """What jax-triton will launch on Hopper, compiled here without a GPU: software-pipelined (cp.async into
    num_stages shared buffers), wgmma, no spills. The strides must reach Triton as constexprs for that: passed as
    runtime i32 scalars (how jax-triton passes every scalar) Triton cannot prove 16-byte rows, and the pipeline is
    lost (one stage, no cp.async) with registers spilled."""
    stage = 128 * 64 * 2 + 256 * 64 * 2  # one bf16 stage of the 128 x 256 x 64 tiles
    for kind, row in json.loads(script_result(_SM90_SCRIPT)).items():
        assert row["shared"] >= tg.ROWS_TILES.num_stages * stage and row["shared"] <= SMEM_BLOCK, (kind, row)
        assert row["cp_async"] and row["wgmma"], (kind, row)
        assert row["spill"] in (0, None), (kind, row)  # None: no ptxas beside triton to count with
