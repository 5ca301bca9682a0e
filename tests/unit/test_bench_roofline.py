"""`moetrain bench roofline` (moetrain.bench.roofline, CPU): its padding rule and its table over bench moe's routings,
which bench/grouped_gemm.md and bench/moe_layer.md quote beside measured layers."""

import pytest

from moetrain.bench import roofline
from moetrain.errors import UserError


def test_padding_follows_our_tiles():
    assert [roofline.padded(r, "fwd") for r in (0, 40, 64, 65, 128, 256, 260, 330)] == [0, 64, 64, 128, 128, 256, 320,
                                                                                        384]
    assert [roofline.padded(r, "wgrad") for r in (0, 1, 64, 65, 260)] == [64, 64, 64, 128, 320]
    assert roofline.padded(260, "fwd", tail=16) == 272


def test_one_group_at_the_ridge_is_mma_and_hbm_alike():
    # a group's three GEMMs: 2 * rows * N * K FLOPs at 1 TFLOP/s against its weight slice + rows at 1 TB/s
    (fwd_mma, fwd_hbm), _, (wgrad_mma, _) = roofline.group_times(128, 64, 32, tflops=1.0, tbps=1.0)
    assert fwd_mma == pytest.approx(2 * 128 * 64 * 32 / 1e12)
    assert fwd_hbm == pytest.approx((64 * 32 + 128 * (64 + 32)) * 2 / 1e12)
    assert wgrad_mma == fwd_mma  # 128 rows: two whole 64-row steps, no padding either way
    step, mixed = roofline.layer_times([128, 0], h=32, i=16, tflops=1.0, tbps=1.0)
    assert mixed <= step  # overlapping light and heavy groups can only help


def test_table_over_routings_and_token_counts(capsys):
    assert roofline.main(["--shapes", "deepseek-v3", "--routing", "skewed:10,skewed"]) == 0
    assert roofline.main(["--shapes", "deepseek-v3", "--tokens", "8320", "--routing", "balanced"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("deepseek-v3")]
    assert [(t, r) for _, t, r, *_ in lines] == [("8192", "balanced"), ("8192", "skewed:10"), ("8192", "skewed"),
                                                 ("8320", "balanced")]
    assert lines[0][4] == "+0.0%" and all(float(line[4].rstrip("%")) > 10 for line in lines[1:3])
    # the numbers bench/grouped_gemm.md quotes: DeepSeek-V3 skewed +34.3% in step, +13.6% mixed
    assert lines[2][4] == "+34.3%" and lines[2][6] == "+13.6%"
    # balanced routing at 8192 tokens gives every expert 256 rows (two whole tiles), at 8320 260 (a 64-row tail each)
    us_per_token = [float(line[-1]) for line in lines]
    assert us_per_token[3] > 1.15 * us_per_token[0]


@pytest.mark.parametrize("argv, match", [(["--routing", "uniform"], "unknown routing 'uniform'"),
                                         (["--shapes", "qwen3"], "unknown shape 'qwen3'"),
                                         (["--tail", "0"], "--tail 0: at least 1 row")])
def test_bad_arguments_are_one_line_errors(argv, match):
    with pytest.raises(UserError, match=match):
        roofline.main(argv)
