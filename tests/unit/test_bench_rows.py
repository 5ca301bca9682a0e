"""`moetrain bench rows` (moetrain.bench.row_kernels)'s command line: bad shapes, kernels and rounds, or no GPU, end in
one line (its timing needs a GPU; the candidates' agreement with the rules is the kernel tests' job:
tests/kernels/test_moe_rows.py, test_route.py, test_sort_rows.py)."""

from types import SimpleNamespace

import pytest
import torch

from moetrain.bench import row_kernels as sweep
from moetrain.errors import UserError


@pytest.mark.parametrize("argv,match", [
    (["--shapes", "qwen3-30b-a3b,llama"], "unknown shape 'llama'"),
    (["--kernels", "route,gemm"], "unknown gemm"),
    (["--rounds", "0"], "--rounds 0: at least 1 round"),
])
def test_bad_arguments_end_in_one_line(argv, match):
    with pytest.raises(UserError, match=match):
        sweep.main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_no_gpu_ends_in_one_line():
    with pytest.raises(UserError, match="moetrain bench rows needs a CUDA GPU"):
        sweep.main(["--shapes", "qwen3-30b-a3b", "--kernels", "sort"])


def test_program_labels():
    # a RowTile's fields (kernels.moe_rows imports triton: not here, before the kernel tests set its interpreter)
    assert sweep.label(SimpleNamespace(rows=8, cols=256, warps=8, steps=3)) == "8x256 w8 s3"
    assert sweep.label((512, 32, 2)) == "(512, 32, 2)"

