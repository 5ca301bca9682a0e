"""`moetrain bench optim` (moetrain.bench.optim)'s command line and byte count: bad sets, contenders, tiles and
sizes, or no GPU, end in one line after the arguments are checked; the floor's bytes per parameter of each dtype set
(its timing needs a GPU; the kernels' correctness is tests/kernels/test_adamw*.py's job)."""

import pytest
import torch

from moetrain.bench import optim as bench
from moetrain.errors import UserError


@pytest.mark.parametrize("argv,match", [
    (["--sets", "fp32-master,fp8"], "--sets: unknown fp8; valid: fp32-master, bf16-state, bf16-moments"),
    (["--sets", ","], r"--sets: unknown \(none given\)"),
    (["--contenders", "triton,apex"], "--contenders: unknown apex"),
    (["--tiles", "8x4"], "is not WxPrR"),
    (["--tiles", "6x4r64"], "powers of two"),
    (["--tiles", "8x4r64c1000"], "not a whole number of 1024-element blocks"),
    (["--params", "1000"], "--params 1000: at least 1000000 parameters"),
    (["--tensors", "0"], "--tensors 0: at least 1 tensor"),
    (["--rounds", "0"], "--rounds 0: at least 1 round"),
])
def test_bad_arguments_end_in_one_line(argv, match):
    with pytest.raises(UserError, match=match):
        bench.main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_no_gpu_ends_in_one_line_after_the_arguments_are_checked():
    with pytest.raises(UserError, match="moetrain bench optim needs a CUDA GPU"):
        bench.main(["--params", "1e7", "--sets", "bf16-state", "--tiles", "8x8r80,4x4r64c8192"])


def test_floor_bytes_per_parameter():
    """norm (gradient read) + update (gradient read; updated tensor, moments read and written; copy written)."""
    per_param = {name: (s.norm_bytes(), s.update_bytes()) for name, s in bench.SETS.items()}
    assert per_param == {"fp32-master": (4, 30), "bf16-state": (2, 14), "bf16-moments": (4, 22)}
    assert bench.SETS["fp32-master"].floor_formula() == (
        "norm 4 + update 4 (grad) + 2x4 (master) + 2x4 (m) + 2x4 (v) + 2 (copy) = 34 B/param")
    sizes = bench.tensor_sizes(10**9, 64)
    assert len(sizes) == 128 and abs(sum(sizes) - 10**9) < 64 * 7168 and sizes[-1] % 1024


def test_tiles_parse():
    assert bench.parse_tiles("8x4r64, 4x8r80c8192") == [(8, 4, 64, None), (4, 8, 80, 8192)]
