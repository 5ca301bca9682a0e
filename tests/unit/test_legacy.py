"""State dicts saved before the dense MLPs were split into gate/up/down (``...mlp.w1`` [2F, H] =
[gate; up], ``...mlp.w2`` = down; gelu: w1 = up) still load everywhere moetrain reads weights by
name: ``load_state_dict``, moetrain model directories, export of a state dict, checkpoint resume
(weights and optimizer moments)."""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models import batch, build, family, randomize

from moetrain.models.hf import export_hf, load_hf_weights, save_moetrain_dir
from moetrain.models.legacy import legacy_mlp_plan, upgrade_state_dict
from moetrain.models.mlp import MLP
from moetrain.models.transformer import MoETransformer
from moetrain.train import checkpoint as ckpt
from moetrain.train.optim import PrecisionAwareAdamW
from moetrain.train.resume import RunStart, load_into

_SPLIT = re.compile(r"^(.*?)(gate|up|down)_proj\.weight$")


def to_legacy(state: dict) -> dict:
    """The names and layout of the earlier format, written independently of moetrain.models.legacy."""
    out = {}
    for name, t in state.items():
        match = _SPLIT.match(name)
        if match is None:
            out[name] = t
            continue
        p, part = match.groups()
        if part == "gate":
            out[p + "w1"] = torch.cat([t, state[p + "up_proj.weight"]])
        elif part == "up" and p + "gate_proj.weight" not in state:
            out[p + "w1"] = t
        elif part == "down":
            out[p + "w2"] = t
    return out


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_mlp_loads_w1_w2(activation):
    src = MLP(12, 10, activation)
    randomize(src, 1)
    legacy = to_legacy(src.state_dict())
    assert set(legacy) == {"w1", "w2"} and legacy["w1"].shape == ((20 if activation == "swiglu" else 10), 12)
    dst = MLP(12, 10, activation)
    randomize(dst, 2)
    dst.load_state_dict(legacy)  # strict: every key consumed, none missing
    assert_same_state(dst.state_dict(), src.state_dict())
    x = torch.randn(4, 12)
    assert torch.equal(dst(x), src(x))


@pytest.mark.parametrize("name", ["deepseek", "dense_gelu"])
def test_model_loads_a_legacy_state_dict(name):
    """deepseek: a dense first layer, shared experts in the MoE layers and in the MTP block; the
    routed experts' mlp.experts.w1 keeps its name."""
    src = build(name, seed=1)
    want = src.state_dict()
    legacy = to_legacy(want)
    assert any(k.endswith("mlp.w1") for k in legacy)
    if name == "deepseek":
        assert "layers.1.mlp.shared.w1" in legacy and "mtp.0.block.mlp.shared.w2" in legacy
        assert "layers.1.mlp.experts.w1" in legacy
    assert legacy_mlp_plan({k: tuple(v.shape) for k, v in want.items()}) == {}  # current names: nothing to do
    assert_same_state(upgrade_state_dict(legacy), want)
    dst = build(name, seed=2)
    dst.load_state_dict(legacy)
    assert_same_state(dst.state_dict(), want)
    ids, labels = batch()
    assert torch.equal(dst(ids, labels).loss, src(ids, labels).loss)


def test_moetrain_dir_and_export_accept_legacy_names(tmp_path):
    cfg = family("deepseek")
    src = build("deepseek", seed=1)
    want = src.state_dict()
    d = save_moetrain_dir(src, cfg, tmp_path / "dir")
    files = sorted(d.glob("*.safetensors"))
    assert len(files) == 1
    save_file({k: v.contiguous() for k, v in to_legacy(load_file(files[0])).items()}, files[0], metadata={"format": "pt"})
    dst = build("deepseek", seed=2)
    load_hf_weights(dst, d)
    assert_same_state(dst.state_dict(), want)

    new, old = export_hf(src, cfg, tmp_path / "new"), export_hf(to_legacy(want), cfg, tmp_path / "old")
    a, b = load_file(new / "model.safetensors"), load_file(old / "model.safetensors")
    assert "model.layers.0.mlp.gate_proj.weight" in a
    assert_same_state(b, a)


class _NoData:
    def load_state_dict(self, state):
        pass


def test_resume_from_a_legacy_checkpoint_restores_weights_and_moments(tmp_path):
    cfg = family("deepseek")
    src = build("deepseek", seed=1)
    opt = PrecisionAwareAdamW(src.named_parameters(), cfg.optim, master_weights=False)
    src(*batch()).loss.backward()
    opt.step(1e-3)
    opt_state = opt.state_dict()
    moments = {field: to_legacy({n: e[field] for n, e in opt_state["params"].items()})
               for field in ("exp_avg", "exp_avg_sq")}
    legacy_opt = {"step": opt_state["step"],
                  "params": {n: {f: moments[f][n] for f in moments} for n in moments["exp_avg"]}}
    path = ckpt.save_checkpoint(
        tmp_path, 1, model_state=to_legacy(src.state_dict()), optimizer_state=legacy_opt,
        trainer_state={"step": 1, "rng": ckpt.rng_state(), "data": {}}, config_yaml="", run_id="run-a").path

    dst = build("deepseek", seed=2)
    dst_opt = PrecisionAwareAdamW(dst.named_parameters(), cfg.optim, master_weights=False)
    got, trainer = load_into(RunStart("run-a", candidates=[path]), cfg, dst, dst_opt, _NoData(), True, print)
    assert got == path and trainer["step"] == 1
    assert_same_state(dst.state_dict(), src.state_dict())
    restored = dst_opt.state_dict()
    assert restored["step"] == 1
    for n, entry in opt_state["params"].items():
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(restored["params"][n][field], entry[field]), (n, field)
    assert restored["params"]["layers.0.mlp.up_proj.weight"]["exp_avg"].abs().sum() > 0


def test_meta_model_loads_legacy_state_dict_with_assign():
    """A model built on meta and filled by ``load_state_dict(assign=True)`` (what a distributed loader does)."""
    src = build("deepseek", seed=1)
    with torch.device("meta"):
        dst = MoETransformer(family("deepseek"))
    dst.load_state_dict(to_legacy(src.state_dict()), assign=True)
    assert_same_state(dst.state_dict(), src.state_dict())
