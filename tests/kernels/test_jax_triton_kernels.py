"""The JAX backend's Triton wrapper kernels (moetrain.jax.triton_gemm: rows_kernel, wgrad_kernel) launched from torch,
against the float64 references: the wrappers' argument order, constexpr strides and fixed options are what jax-triton
launches on a GPU. Without a GPU they run in Triton's interpreter in float32 (the interpreter computes bf16 dots
wrongly in triton 3.6); jax is not needed, jax-triton's own call is covered on the GPU (tests/jax).
Outputs are poisoned with NaN before every run.

Legend: M rows, G groups, N = w.shape[1], K = w.shape[2].
"""

import pytest
import torch

from kernel_checks import FP32_BOUND, rel_err
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
TILES = [tg.TritonTiles(32, 32, 16, 1, 4), tg.TritonTiles(16, 32, 16, 1, 4, group_m=2)]


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
