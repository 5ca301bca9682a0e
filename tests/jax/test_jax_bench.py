"""`moetrain bench jax`: its timed layer runs (tiny shapes, CPU) and its checks refuse in one line."""

import pytest

pytest.importorskip("jax")

from moetrain.bench import jax_gemm  # noqa: E402
from moetrain.errors import UserError  # noqa: E402


def test_group_sizes_cover_every_row():
    assert jax_gemm.group_sizes(10, 3) == [3, 3, 4]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_the_timed_layer_runs(impl, monkeypatch):
    monkeypatch.setattr(jax_gemm, "_timed", lambda call: (call(), 1.0)[1])  # one call: the code path, not a time
    assert jax_gemm.jax_layer_time(impl, 48, 32, 16, 3) == 1.0


def test_refusals_are_one_line():
    with pytest.raises(UserError, match="--impls foo"):
        jax_gemm.main(["--impls", "foo"])
    with pytest.raises(UserError, match="unknown shape"):
        jax_gemm.main(["--shapes", "nope"])
    with pytest.raises(UserError, match="--sweep times the triton and pallas kernels; --impls torch names neither"):
        jax_gemm.main(["--sweep", "--impls", "torch"])


def test_without_a_jax_gpu_it_refuses_in_one_line():
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("checks the refusal without a GPU")
    with pytest.raises(UserError, match=r"^moetrain bench jax needs a GPU for JAX \(its backend here is cpu\)$"):
        jax_gemm.main(["--impls", "xla"])


def test_the_sweeps_candidates_are_valid_tiles():
    from moetrain.bench import jax_gemm_sweep
    from moetrain.jax import grouped_gemm as gg

    for changes in jax_gemm_sweep.ROW_CANDIDATES + jax_gemm_sweep.WGRAD_CANDIDATES:
        gg._check_tiles(gg.GemmTiles(**changes))
    assert jax_gemm_sweep.ROW_CANDIDATES[0] == {}  # the rows kernels' defaults come first
    assert gg.GemmTiles(**jax_gemm_sweep.WGRAD_CANDIDATES[0]) == gg.WGRAD_TILES
    from moetrain.jax import triton_gemm

    assert jax_gemm_sweep.TRITON_ROW_CANDIDATES[0] == triton_gemm.ROWS_TILES  # impl "triton"'s defaults first
    assert jax_gemm_sweep.TRITON_WGRAD_CANDIDATES[0] == triton_gemm.WGRAD_TILES
