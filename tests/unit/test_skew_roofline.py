"""scripts/skew_roofline.py (CPU): its padding rule and its table over bench moe's routings, which bench/NOTES.md
quotes beside measured layers."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import skew_roofline as roofline  # noqa: E402  (scripts/, put on the path above)


def test_padding_follows_our_tiles():
    assert [roofline.padded(r, "fwd") for r in (0, 40, 64, 65, 128, 256, 260, 330)] == [0, 64, 64, 128, 128, 256, 320,
                                                                                        384]
    assert [roofline.padded(r, "wgrad") for r in (0, 1, 64, 65, 260)] == [64, 64, 64, 128, 320]
    assert roofline.padded(260, "fwd", tail=16) == 272


def test_table_over_routings_and_token_counts(capsys):
    assert roofline.main(["--shapes", "deepseek-v3", "--routing", "skewed:10,skewed"]) == 0
    assert roofline.main(["--shapes", "deepseek-v3", "--tokens", "8320", "--routing", "balanced"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("deepseek-v3")]
    assert [(t, r) for _, t, r, *_ in lines] == [("8192", "balanced"), ("8192", "skewed:10"), ("8192", "skewed"),
                                                 ("8320", "balanced")]
    assert lines[0][4] == "+0.0%" and all(float(line[4].rstrip("%")) > 10 for line in lines[1:3])
    # balanced routing at 8192 tokens gives every expert 256 rows (two whole tiles), at 8320 260 (a 64-row tail each)
    us_per_token = [float(line[-1]) for line in lines]
    assert us_per_token[3] > 1.15 * us_per_token[0]


def test_bad_routing_or_shape_is_one_argparse_line(capsys):
    for argv, match in ((["--routing", "uniform"], "unknown routing 'uniform'"),
                        (["--shapes", "qwen3"], "unknown shape 'qwen3'")):
        with pytest.raises(SystemExit) as exit_info:
            roofline.main(argv)
        assert exit_info.value.code == 2 and match in capsys.readouterr().err
