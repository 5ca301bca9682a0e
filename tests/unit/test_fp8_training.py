"""precision.fp8_recipe: the config accepts what is built and names what is not; the tiny model trains with FP8
expert GEMMs (on the CPU through the references: fp32 math on the quantized values) close to the 32-bit run."""

import pytest

from moetrain.config.load import load_config
from moetrain.errors import ConfigError


def _cfg(tmp_path, *overrides):
    return load_config(preset="tiny", overrides=[
        "train.steps=8", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_length=32",
        f"train.out_dir={tmp_path}", "train.device=cpu", "checkpoint.save_final=false", *overrides])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_recipes_without_kernels_are_refused_by_name(recipe, tmp_path):
    with pytest.raises(ConfigError, match=f"precision.fp8_recipe = {recipe} is not built yet; valid now: none, "
                                          "blockwise"):
        _cfg(tmp_path, f"precision.fp8_recipe={recipe}")


def test_blockwise_fp8_experts_train_like_the_32_bit_run(tmp_path):
    from moetrain.train.trainer import run

    def losses(out, *overrides):
        return [r["loss"] for r in run(_cfg(out, *overrides), show_progress=False).records]

    full = losses(tmp_path / "fp32")
    fp8 = losses(tmp_path / "fp8", "precision.fp8_recipe=blockwise")
    assert fp8 != full  # the experts really ran in FP8
    for step, (a, b) in enumerate(zip(fp8, full), start=1):
        assert a == pytest.approx(b, rel=0.01), f"step {step}"


def test_a_cuda_run_with_fp8_is_refused_until_the_kernels_are_validated_on_gpus(tmp_path):
    import torch

    from moetrain.errors import UserError
    from moetrain.train.trainer import refuse_unvalidated_fp8

    cfg = _cfg(tmp_path, "precision.fp8_recipe=blockwise")
    refuse_unvalidated_fp8(cfg, torch.device("cpu"))
    refuse_unvalidated_fp8(_cfg(tmp_path), torch.device("cuda"))
    with pytest.raises(UserError, match="not yet validated on GPUs"):
        refuse_unvalidated_fp8(cfg, torch.device("cuda"))
