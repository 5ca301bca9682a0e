"""precision.fp8_recipe: the config accepts what is built and refuses sizes a recipe cannot tile; the tiny model trains with FP8
expert GEMMs (on the CPU through the references: fp32 math on the quantized values) close to the 32-bit run."""

import pytest

from moetrain.config.load import load_config
from moetrain.errors import ConfigError


def _cfg(tmp_path, *overrides):
    return load_config(preset="tiny", overrides=[
        "train.steps=8", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_length=32",
        f"train.out_dir={tmp_path}", "train.device=cpu", "checkpoint.save_final=false", *overrides])


def test_every_recipe_the_schema_names_is_built():
    from typing import get_args, get_type_hints

    from moetrain.config.schema import FP8_BUILT, PrecisionConfig

    assert set(get_args(get_type_hints(PrecisionConfig)["fp8_recipe"])) == set(FP8_BUILT)


def test_mxfp8_refuses_expert_sizes_that_are_not_whole_scale_tiles(tmp_path):
    with pytest.raises(ConfigError, match=r"precision.fp8_recipe = mxfp8 needs the experts' sizes to be multiples of "
                                          r"32 .*; moe.moe_ffn_hidden_size = 48 is not: use blockwise or resize"):
        _cfg(tmp_path, "precision.fp8_recipe=mxfp8", "moe.moe_ffn_hidden_size=48")
    with pytest.raises(ConfigError, match=r"model.hidden_size = 80, moe.moe_ffn_hidden_size = 40 are not"):
        _cfg(tmp_path, "precision.fp8_recipe=mxfp8", "model.hidden_size=80", "moe.moe_ffn_hidden_size=40")
    assert _cfg(tmp_path, "precision.fp8_recipe=mxfp8", "moe.moe_ffn_hidden_size=96").precision.fp8_recipe == "mxfp8"


def test_per_row_recipes_refuse_expert_sizes_their_gemm_cannot_stride(tmp_path):
    with pytest.raises(ConfigError, match="moe.moe_ffn_hidden_size = 40 is not: use blockwise"):
        _cfg(tmp_path, "precision.fp8_recipe=rowwise", "moe.moe_ffn_hidden_size=40")
    _cfg(tmp_path, "precision.fp8_recipe=blockwise", "moe.moe_ffn_hidden_size=40")


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "tensorwise", "mxfp8"])
def test_fp8_experts_train_like_the_32_bit_run(recipe, tmp_path, monkeypatch):
    from moetrain.ops import grouped_gemm_fp8
    from moetrain.train.trainer import run

    # the references, also where an earlier kernel test switched Triton to its interpreter for the whole process
    # (the kernels' own tests run them there, 50-100x slower than these runs)
    monkeypatch.setattr(grouped_gemm_fp8, "kernels_run_here", lambda x: False)

    def losses(out, *overrides):
        return [r["loss"] for r in run(_cfg(out, *overrides), show_progress=False).records]

    full = losses(tmp_path / "fp32")
    fp8 = losses(tmp_path / "fp8", f"precision.fp8_recipe={recipe}")
    assert fp8 != full  # the experts really ran in FP8
    for step, (a, b) in enumerate(zip(fp8, full), start=1):
        assert a == pytest.approx(b, rel=0.01), f"step {step}"


@pytest.mark.parametrize("extra", [[], ["precision.master_weights=false"]])
def test_the_optimizer_step_makes_the_cached_fp8_weights_stale(monkeypatch, extra):
    """The update writes through .data (no version counter moves): without the optimizer's notice the forward kept
    the FP8 copies of the initial expert weights for the whole run."""
    import torch

    from moetrain.config.load import load_config
    from moetrain.models import build_model
    from moetrain.ops.grouped_gemm_fp8 import WEIGHTS, WeightCache
    from moetrain.train.optim import PrecisionAwareAdamW

    made = []
    monkeypatch.setattr(WeightCache, "_quantize", staticmethod(lambda w, recipe: made.append(w.clone()) or (w,)))
    cfg = load_config(overrides=["train.device=cpu", *extra])
    model = build_model(cfg)
    model.init_weights(0)
    opt = PrecisionAwareAdamW(model.named_parameters(), cfg.optim, cfg.precision.master_weights)
    w = next(p for n, p in model.named_parameters() if n.endswith("experts.w1"))
    WEIGHTS.get(w, "rowwise")
    WEIGHTS.get(w, "rowwise")
    assert len(made) == 1  # one quantization per step, however many micro-batches
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step(1e-2)
    WEIGHTS.get(w, "rowwise")
    assert len(made) == 2 and not torch.equal(made[0], made[1])  # the moved weight, quantized again
