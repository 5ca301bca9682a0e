"""JAX grouped GEMM (moetrain.jax.grouped_gemm): forward and the custom-VJP gradients of impl "xla" and "pallas"
(interpret mode on the CPU), and "triton" on a GPU, against the one-hot jnp reference, and once against a torch loop
over the groups.

Interpret mode fills pallas_call outputs with NaN before the kernels run, so a row or tile the schedule missed shows
up as NaN here. The basename differs from tests/kernels/test_grouped_gemm.py: tests/ has no __init__.py files, so
pytest's default import mode needs unique test file names (and a tests/jax/__init__.py would shadow the jax package).

Legend: M rows, G groups, N = w.shape[1], K = w.shape[2].
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
gg = pytest.importorskip("moetrain.jax.grouped_gemm")  # after the jax check: the module imports jax

M, K, N = 120, 40, 24  # K, N: not multiples of the tiles below, so the column masks are exercised

# (name, group_sizes): sums <= M; the rows past the sum are padding.
CASES = [
    ("uneven_empty_padding", [17, 0, 45, 3, 40]),  # 105 rows, 15 padding
    ("one_group_all_rows", [0, 0, M, 0]),
    ("exact_sum", [30, 25, 0, 40, 25]),
    ("all_padding", [0, 0, 0]),
]
CASE_IDS = [name for name, _ in CASES]

# Small tiles for interpret mode, different per kernel so each kernel's own tiling is exercised; launch bands of
# 3 and 2 row tiles, so the last band of the grouped order is a narrower one.
FWD = gg.GemmTiles(block_m=16, block_n=16, block_k=16, group_m=3)
DGRAD = gg.GemmTiles(block_m=32, block_n=16, block_k=16, group_m=2)
WGRAD = gg.GemmTiles(block_m=16, block_n=16, block_k=32)
ON_GPU = jax.default_backend() == "gpu"
IMPLS = ["xla", "pallas"] + (["triton"] if ON_GPU else [])  # triton: jax-triton launches need a GPU


def _gemm(impl):
    return lambda x, w, gs: gg.grouped_gemm(x, w, gs, impl=impl, fwd_tiles=FWD, dgrad_tiles=DGRAD, wgrad_tiles=WGRAD)


def _inputs(sizes, dtype=jnp.float32, seed=0):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (len(sizes), N, K), jnp.float32).astype(dtype)
    dy = jax.random.normal(kd, (M, N), jnp.float32).astype(dtype)  # nonzero on padding rows too
    return x, w, jnp.asarray(sizes, jnp.int32), dy


def _vjp(fn, x, w, gs, dy):
    y, pullback = jax.vjp(fn, x, w, gs)
    return (y, *pullback(dy))


def _close(got, want, rtol, atol):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("sizes", [s for _, s in CASES], ids=CASE_IDS)
def test_forward_and_gradients_fp32(impl, sizes):
    x, w, gs, dy = _inputs(sizes)
    y, dx, dw, dgs = _vjp(_gemm(impl), x, w, gs, dy)
    y_ref, dx_ref, dw_ref, _ = _vjp(gg.grouped_gemm_reference, x, w, gs, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32,) * 3
    assert dgs.dtype == jax.dtypes.float0 and dgs.shape == gs.shape  # no gradient for the integer sizes
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        _close(got, want, rtol=1e-5, atol=1e-5)
    used = sum(sizes)
    assert not np.any(np.asarray(y[used:])) and not np.any(np.asarray(dx[used:]))  # padding rows: exact zeros
    empty_groups = np.asarray(sizes) == 0
    assert not np.any(np.asarray(dw)[empty_groups])  # an empty group's weight gradient: exact zeros


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16(impl):
    x, w, gs, dy = _inputs(CASES[0][1], jnp.bfloat16)
    y, dx, dw, _ = _vjp(_gemm(impl), x, w, gs, dy)
    y_ref, dx_ref, dw_ref, _ = _vjp(gg.grouped_gemm_reference, x, w, gs, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):  # both round an fp32 sum once: ~1 bf16 ulp apart
        _close(got, want, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_under_jit(impl):
    """jit over traced group_sizes (no host read of the sizes) of a scalar loss's gradient in x and w."""
    x, w, gs, dy = _inputs(CASES[0][1], seed=1)

    def grads(fn):
        def loss(x, w, gs):
            return jnp.sum(fn(x, w, gs) * dy)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, gs)

    for got, want in zip(grads(_gemm(impl)), grads(gg.grouped_gemm_reference), strict=True):
        _close(got, want, rtol=1e-5, atol=1e-5)
    y = jax.jit(_gemm(impl))(x, w, gs)
    _close(y, gg.grouped_gemm_reference(x, w, gs), rtol=1e-5, atol=1e-5)


def test_auto_is_xla_on_cpu():
    x, w, gs, _ = _inputs(CASES[0][1])
    y = gg.grouped_gemm(x, w, gs)  # impl="auto"
    assert jax.default_backend() != "cpu" or np.array_equal(y, gg.grouped_gemm(x, w, gs, impl="xla"))


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "triton"])  # triton computes bf16 and fp32
def test_against_torch_loop_fp64(impl):
    """A torch loop over the groups (torch._grouped_mm has no CPU float64) with torch autograd, in float64."""
    torch = pytest.importorskip("torch")
    sizes = CASES[0][1]
    with jax.enable_x64(True):
        x, w, gs, dy = _inputs(sizes, jnp.float64, seed=2)
        y, dx, dw, _ = _vjp(_gemm(impl), x, w, gs, dy)
        assert y.dtype == jnp.float64
    tx, tw = (torch.tensor(np.asarray(a)).requires_grad_() for a in (x, w))
    rows = np.concatenate([[0], np.cumsum(sizes)])
    ty = torch.zeros(M, N, dtype=torch.float64)
    for g in range(len(sizes)):
        ty[rows[g]:rows[g + 1]] = tx[rows[g]:rows[g + 1]] @ tw[g].T
    ty.backward(torch.tensor(np.asarray(dy)))
    for got, want in ((y, ty), (dx, tx.grad), (dw, tw.grad)):
        _close(got, want.detach().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not ON_GPU, reason="jax-triton launches need a GPU")
def test_triton_bf16_at_the_default_tiles():
    """Several 128 x 256 tiles per group, a group longer than the persistent grid's first wave, an empty group."""
    sizes = [700, 0, 1900, 33, 1300]
    kx, kw, kd = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (4000, 520), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (len(sizes), 392, 520), jnp.float32) * 0.05).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (4000, 392), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(lambda x, w, gs, dy: _vjp(lambda x, w, gs: gg.grouped_gemm(x, w, gs, impl="triton"),
                                            x, w, gs, dy)[:3])(x, w, gs, dy)
    want = _vjp(lambda x, w, gs: gg.grouped_gemm(x, w, gs, impl="xla"), x, w, gs, dy)[:3]
    for a, b in zip(got, want, strict=True):
        _close(a, b, rtol=2e-2, atol=6e-2)
    assert not np.any(np.asarray(got[0][sum(sizes):])) and not np.any(np.asarray(got[2][1]))


def test_triton_needs_a_gpu_and_no_float64():
    x, w, gs, _ = _inputs(CASES[0][1])
    if not ON_GPU:
        with pytest.raises(ValueError, match='impl "triton" runs on a GPU backend only'):
            gg.grouped_gemm(x, w, gs, impl="triton")
        return
    with jax.enable_x64(True), pytest.raises(ValueError, match='for float64 use impl "xla"'):
        gg.grouped_gemm(x.astype(jnp.float64), w.astype(jnp.float64), gs, impl="triton")


def test_pallas_lowers_to_triton_for_cuda():
    """The compiled path (interpret=False, default Hopper tiles) lowers for CUDA without a GPU: three Triton calls."""
    x, w, gs, dy = _inputs(CASES[0][1], jnp.bfloat16)

    def step(x, w, gs):
        y, pullback = jax.vjp(lambda x, w: gg.grouped_gemm(x, w, gs, impl="pallas", interpret=False), x, w)
        return y, pullback(dy)

    hlo = jax.jit(step).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("xla.gpu.triton") == 3


@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_row_tile_schedule_covers_each_row_once(block_m):
    """Every row in exactly one tile of its own group (padding = group G); the static tile count suffices."""
    rng = np.random.default_rng(block_m)
    for num_groups in (1, 3, 6):
        sizes = rng.integers(0, 60, num_groups)
        m = int(sizes.sum()) + int(rng.integers(0, 20))
        group, start, end = (np.asarray(a) for a in gg._row_tile_schedule(jnp.asarray(sizes, jnp.int32), m, block_m))
        assert len(group) == -(-m // block_m) + num_groups
        assert np.all(end - start <= block_m) and np.all(start <= end)
        want = np.repeat(np.arange(num_groups + 1), np.append(sizes, m - sizes.sum()))  # group of each row
        owner = np.full(m, -1)
        for t in np.nonzero(end > start)[0]:
            assert np.all(owner[start[t]:end[t]] == -1)
            owner[start[t]:end[t]] = group[t]
        np.testing.assert_array_equal(owner, want)


@pytest.mark.parametrize(("x_shape", "w_shape", "gs_shape", "dtypes", "message"), [
    ((8, 5), (2, 3, 4), (2,), ("float32",) * 2, r"x \(8, 5\) and w \(2, 3, 4\) do not match"),
    ((8, 4), (3, 4), (2,), ("float32",) * 2, r"x \(8, 4\) and w \(3, 4\) do not match"),
    ((8, 4), (2, 3, 4), (3,), ("float32",) * 2, r"group_sizes \(3,\) int32 must be an integer \[G\] = \[2\]"),
    ((8, 4), (2, 3, 4), (2,), ("float32", "bfloat16"), r"x \(8, 4\) float32 and w \(2, 3, 4\) bfloat16 must share"),
    ((8, 4), (2, 3, 4), (2,), ("float16",) * 2, r"x \(8, 4\) float16 and w \(2, 3, 4\) float16 must share"),
])
def test_bad_inputs_raise_one_line(x_shape, w_shape, gs_shape, dtypes, message):
    x, w = jnp.zeros(x_shape, dtypes[0]), jnp.zeros(w_shape, dtypes[1])
    with pytest.raises(ValueError, match=message) as err:
        gg.grouped_gemm(x, w, jnp.zeros(gs_shape, jnp.int32), impl="xla")
    assert "\n" not in str(err.value)


def test_bad_impl_and_tiles_raise():
    x, w, gs, _ = _inputs([M])
    with pytest.raises(ValueError, match="impl 'cuda' is not one of"):
        gg.grouped_gemm(x, w, gs, impl="cuda")
    with pytest.raises(ValueError, match=r"block_k=48 .* must be a power of 2"):
        gg.grouped_gemm(x, w, gs, impl="pallas", wgrad_tiles=gg.GemmTiles(block_k=48))
    with pytest.raises(ValueError, match=r"group_sizes .* float32 must be an integer"):
        gg.grouped_gemm(x, w, gs.astype(jnp.float32), impl="xla")


@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad"])
def test_each_kernel_alone_equals_the_reference(kind):
    """pallas_kernel (what `moetrain bench jax --sweep` times) runs one kernel with the given tiles."""
    sizes = CASES[0][1]
    x, w, gs, dy = _inputs(sizes)
    _, dx_ref, dw_ref, _ = _vjp(gg.grouped_gemm_reference, x, w, gs, dy)
    tiles = {"fwd": FWD, "dgrad": DGRAD, "wgrad": WGRAD}[kind]
    a, b = {"fwd": (x, w), "dgrad": (dy, w), "wgrad": (dy, x)}[kind]
    got = gg.pallas_kernel(kind, a, b, gs, tiles, interpret=True)
    want = {"fwd": gg.grouped_gemm_reference(x, w, gs), "dgrad": dx_ref, "wgrad": dw_ref}[kind]
    _close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kind 'bwd'"):
        gg.pallas_kernel("bwd", a, b, gs, tiles, interpret=True)
