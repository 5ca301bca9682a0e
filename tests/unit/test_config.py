"""Config loading: extends chains, ${ENV} interpolation, overrides, exact-type validation, messages."""

import dataclasses
import math
import textwrap
import typing

import pytest

from moetrain.config import Config, ConfigError, config_docs, dump_config, list_presets, load_config
from moetrain.config.load import PRESET_DIR, parse_yaml_value, resolve
from moetrain.config.schema import SECTIONS, VALUE_RANGES


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """Run in tmp_path so files can be named relatively and messages asserted exactly."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def error_of(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    return str(info.value)


# ---- defaults and presets -------------------------------------------------------------------

def test_default_is_tiny_preset_and_matches_its_yaml():
    cfg = load_config()
    assert cfg == load_config(preset="tiny")
    raw = parse_yaml_value((PRESET_DIR / "tiny.yaml").read_text())
    assert "extends" not in raw
    for section, values in raw.items():
        for key, value in values.items():
            got = getattr(getattr(cfg, section), key)
            assert got == value and isinstance(got, bool) == isinstance(value, bool), (section, key)
    # every key tiny.yaml does not set keeps the schema default
    default = Config().to_dict()
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            if key not in raw.get(section, {}):
                assert value == default[section][key], (section, key)


def test_list_presets_names_the_yaml_files():
    names = list_presets()
    assert "tiny" in names
    assert names == sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_round_trips_through_dump(name, tmp_path):
    cfg = load_config(preset=name)
    f = write(tmp_path / "dumped.yaml", dump_config(cfg))
    assert load_config(str(f)) == cfg


def test_unknown_preset_suggests_closest():
    msg = error_of(preset="tinyy")
    assert msg.startswith("unknown preset 'tinyy'; did you mean tiny? (available: ")
    assert ", ".join(list_presets()) in msg


def test_path_and_preset_together_is_an_error(cwd):
    write(cwd / "a.yaml", "{}")
    assert error_of(path="a.yaml", preset="tiny") == "give either a config file or a preset, not both"


# ---- extends --------------------------------------------------------------------------------

def test_extends_relative_path_deep_merge_and_own_keys_win(cwd):
    write(cwd / "base" / "base.yaml", """
        model: {hidden_size: 128, num_layers: 3, vocab_size: 1000}
        train: {steps: 7}
    """)
    write(cwd / "exp" / "run.yaml", """
        extends: ../base/base.yaml
        model: {hidden_size: 256}
        moe:
    """)
    cfg = load_config("exp/run.yaml")
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.vocab_size) == (256, 3, 1000)
    assert cfg.train.steps == 7
    assert cfg.moe == Config().moe  # an empty `moe:` section changes nothing
    r = resolve("exp/run.yaml")
    assert r.source_of("model.hidden_size") == "exp/run.yaml"
    assert r.source_of("model.num_layers") == "base/base.yaml"
    assert r.source_of("optim.lr") == "default"


def test_extends_preset_name(cwd):
    write(cwd / "small.yaml", """
        extends: tiny
        model: {num_layers: 2}
        train: {steps: 3}
    """)
    cfg = load_config("small.yaml")
    tiny = load_config(preset="tiny")
    assert cfg.model.num_layers == 2 and cfg.train.steps == 3
    assert dataclasses.replace(cfg.model, num_layers=tiny.model.num_layers) == tiny.model
    assert cfg.moe == tiny.moe
    r = resolve("small.yaml")
    assert r.source_of("moe.num_experts") == "preset tiny"
    assert r.source_of("model.num_layers") == "small.yaml"


def test_extends_list_applies_in_order_then_own_keys(cwd):
    write(cwd / "a.yaml", "model: {hidden_size: 120, vocab_size: 111, num_layers: 5}\n")
    write(cwd / "b.yaml", "model: {hidden_size: 200, vocab_size: 222}\n")
    write(cwd / "c.yaml", "extends: [a.yaml, b.yaml]\nmodel: {vocab_size: 333, num_attention_heads: 2}\n")
    cfg = load_config("c.yaml")
    assert (cfg.model.hidden_size, cfg.model.vocab_size, cfg.model.num_layers) == (200, 333, 5)
    write(cwd / "d.yaml", "extends: [b.yaml, a.yaml]\n")
    assert load_config("d.yaml").model.hidden_size == 120


def test_extends_diamond_is_not_a_cycle(cwd):
    write(cwd / "root.yaml", "train: {steps: 11}\n")
    write(cwd / "l.yaml", "extends: root.yaml\nmodel: {num_layers: 2}\n")
    write(cwd / "r.yaml", "extends: root.yaml\nmodel: {num_layers: 6}\n")
    write(cwd / "top.yaml", "extends: [l.yaml, r.yaml]\n")
    cfg = load_config("top.yaml")
    assert (cfg.train.steps, cfg.model.num_layers) == (11, 6)


def test_extends_cycle_is_named(cwd):
    write(cwd / "a.yaml", "extends: sub/b.yaml\n")
    write(cwd / "sub" / "b.yaml", "extends: ../a.yaml\n")
    assert error_of(path="a.yaml") == "extends cycle: a.yaml -> sub/b.yaml -> a.yaml"
    write(cwd / "self.yaml", "extends: self.yaml\n")
    assert error_of(path="self.yaml") == "extends cycle: self.yaml -> self.yaml"


def test_extends_missing_target(cwd):
    write(cwd / "sub" / "a.yaml", "extends: nothere.yaml\n")
    assert error_of(path="sub/a.yaml") == (
        "sub/a.yaml: extends 'nothere.yaml': no such file (sub/nothere.yaml) and no preset of that name "
        f"(presets: {', '.join(list_presets())})")


# ---- environment interpolation ---------------------------------------------------------------

def test_env_interpolation(cwd, monkeypatch):
    monkeypatch.setenv("MT_STEPS", "42")
    monkeypatch.setenv("MT_RUN", "exp1")
    monkeypatch.delenv("MT_UNSET", raising=False)
    write(cwd / "e.yaml", """
        train:
          steps: ${MT_STEPS}
          seed: ${MT_UNSET:7}
          out_dir: runs/${MT_RUN}/${MT_UNSET:x}
          recompute_layer_ids: ${MT_UNSET:[0, 2]}
        optim: {lr: "${MT_UNSET:2e-4}", min_lr: 0}
        model: {name: "${MT_UNSET:}"}
    """)
    cfg = load_config("e.yaml")
    assert cfg.train.steps == 42 and type(cfg.train.steps) is int
    assert cfg.train.seed == 7
    assert cfg.train.out_dir == "runs/exp1/x"
    assert cfg.train.recompute_layer_ids == [0, 2]
    assert cfg.optim.lr == 2e-4
    assert cfg.model.name == ""


def test_env_missing_without_default(cwd, monkeypatch):
    monkeypatch.delenv("MT_UNSET", raising=False)
    write(cwd / "e.yaml", "train:\n  out_dir: /data/${MT_UNSET}\n")
    assert error_of(path="e.yaml") == (
        "environment variable MT_UNSET is not set (used by train.out_dir in e.yaml); "
        "set it or write ${MT_UNSET:default}")


# ---- overrides ------------------------------------------------------------------------------

def test_dotted_overrides_parse_yaml_values(cwd):
    write(cwd / "o.yaml", "model: {q_lora_rank: 16, num_layers: 4}\n")
    cfg = load_config("o.yaml", overrides=[
        "moe.num_experts=4", "moe.topk=1", "train.recompute_layer_ids=[0,1]", "model.q_lora_rank=null",
        "optim.lr=1e-3", "optim.min_lr=0", "model.name=my model", "train.compile=true",
        "parallel.pp=2", "parallel.pipeline_layout=Et*2|t*2L", "train.micro_batch_size=1", "train.global_batch_size=2",
    ])
    assert (cfg.moe.num_experts, cfg.moe.topk) == (4, 1)
    assert cfg.train.recompute_layer_ids == [0, 1]
    assert cfg.model.q_lora_rank is None
    assert cfg.optim.lr == 1e-3 and cfg.optim.min_lr == 0.0 and type(cfg.optim.min_lr) is float
    assert cfg.model.name == "my model"
    assert cfg.train.compile is True
    assert cfg.parallel.pipeline_layout == "Et*2|t*2L"
    r = resolve("o.yaml", overrides=["moe.topk=1"])
    assert r.source_of("moe.topk") == "command line"
    assert r.source_of("model.q_lora_rank") == "o.yaml"


def test_later_override_wins():
    cfg = load_config(overrides=["train.steps=5", "train.steps=9"])
    assert cfg.train.steps == 9


@pytest.mark.parametrize("text", ["moe.topk", "=3", "moe..topk=2"])
def test_malformed_override(text):
    assert error_of(overrides=[text]) == f"override {text!r}: expected section.key=value (e.g. moe.topk=2)"


def test_yaml_1_2_scalars(cwd):
    write(cwd / "s.yaml", "optim: {lr: 1e-3, min_lr: 5E-5}\nmodel: {name: yes}\ntrain: {out_dir: 1:30}\n")
    cfg = load_config("s.yaml")
    assert cfg.optim.lr == 1e-3 and cfg.optim.min_lr == 5e-5  # PyYAML's default reads these as strings
    assert cfg.model.name == "yes"
    assert cfg.train.out_dir == "1:30"


# ---- validation messages ---------------------------------------------------------------------

def test_unknown_key_suggests_and_names_source(cwd):
    write(cwd / "f.yaml", "model: {hidden_sizee: 3}\n")
    assert error_of(path="f.yaml") == (
        "unknown key model.hidden_sizee (from f.yaml); did you mean model.hidden_size?")
    assert error_of(overrides=["moe.top_k=3"]) == (
        "unknown key moe.top_k (from command line); did you mean moe.topk?")
    # the right key in the wrong section
    assert error_of(overrides=["model.topk=3"]) == (
        "unknown key model.topk (from command line); did you mean moe.topk?")
    assert error_of(overrides=["model.top_kk=3"]) == (
        "unknown key model.top_kk (from command line); did you mean moe.topk?")
    assert error_of(overrides=["model.zzzzzz=3"]) == (
        "unknown key model.zzzzzz (from command line); see `moetrain config show --doc` for the valid keys")


def test_unknown_section(cwd):
    write(cwd / "f.yaml", "modle: {hidden_size: 3}\n")
    assert error_of(path="f.yaml") == "unknown section modle (from f.yaml); did you mean model?"
    assert error_of(overrides=["topk=3"]) == "unknown section topk (from command line); did you mean moe.topk?"
    write(cwd / "g.yaml", "qqq: 1\n")
    assert error_of(path="g.yaml") == (
        "unknown section qqq (from g.yaml); valid sections: " + ", ".join(SECTIONS))


def test_section_must_be_a_mapping(cwd):
    write(cwd / "f.yaml", "model: 5\n")
    assert error_of(path="f.yaml") == "model: expected a mapping of model.* keys; got 5 (from f.yaml)"


def test_wrong_type(cwd):
    write(cwd / "f.yaml", "model: {hidden_size: 64x}\n")
    assert error_of(path="f.yaml") == "model.hidden_size: expected int; got '64x' (from f.yaml)"
    assert error_of(overrides=["model.hidden_size=64.0"]) == (
        "model.hidden_size: expected int; got 64.0 (from command line)")
    assert error_of(overrides=["model.num_query_groups=two"]) == (
        "model.num_query_groups: expected int or null; got 'two' (from command line)")
    assert error_of(overrides=["model.name=5"]) == (
        "model.name: expected str; got 5 (from command line); quote it for a string: '5'")
    assert error_of(overrides=["parallel.pipeline_layout=1.5"]) == (
        "parallel.pipeline_layout: expected str or null; got 1.5 (from command line); quote it for a string: '1.5'")
    assert error_of(overrides=["train.recompute_layer_ids=[0, a]"]) == (
        "train.recompute_layer_ids: expected list of int or null; got [0, 'a'] (from command line)")
    # floats accept ints and store floats
    cfg = load_config(overrides=["model.rope_theta=500000"])
    assert cfg.model.rope_theta == 500000.0 and type(cfg.model.rope_theta) is float


def test_literal_lists_choices(cwd):
    write(cwd / "f.yaml", "moe: {score_function: softmx}\n")
    assert error_of(path="f.yaml") == (
        "moe.score_function: expected one of softmax, sigmoid; got 'softmx' (from f.yaml); did you mean softmax?")
    assert error_of(overrides=["train.recompute=everything"]) == (
        "train.recompute: expected one of none, selective, full; got 'everything' (from command line)")
    assert error_of(overrides=["model.rope_scaling=linear"]) == (
        "model.rope_scaling: expected one of yarn or null; got 'linear' (from command line)")
    assert load_config(overrides=["model.rope_scaling=yarn"]).model.rope_scaling == "yarn"


@pytest.mark.parametrize("text,shown", [("1", "1"), ("0", "0"), ("yes", "'yes'"), ("'true'", "'true'"),
                                        ("off", "'off'"), ("null", "null")])
def test_bool_is_strict(text, shown):
    assert error_of(overrides=[f"train.compile={text}"]) == (
        f"train.compile: expected bool (true or false); got {shown} (from command line)")


def test_bool_accepts_true_false():
    assert load_config(overrides=["train.compile=True"]).train.compile is True
    assert load_config(overrides=["train.compile=false"]).train.compile is False


# ---- value ranges ---------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("optim.lr=.nan", "optim.lr = nan: must be a finite number > 0"),
    ("optim.lr=.inf", "optim.lr = inf: must be a finite number > 0"),
    ("optim.lr=0", "optim.lr = 0.0: must be > 0"),
    ("optim.beta1=2", "optim.beta1 = 2.0: must be in [0, 1)"),
    ("optim.beta2=1", "optim.beta2 = 1.0: must be in [0, 1)"),
    ("optim.eps=-1", "optim.eps = -1.0: must be > 0"),
    ("optim.weight_decay=-.inf", "optim.weight_decay = -inf: must be a finite number >= 0"),
    ("model.init_std=-1", "model.init_std = -1.0: must be > 0"),
    ("model.head_dim=-1", "model.head_dim = -1: must be >= 1 or null"),
    ("model.num_query_groups=-2", "model.num_query_groups = -2: must be >= 1 or null"),
    ("model.rope_theta=1", "model.rope_theta = 1.0: must be > 1"),
    ("model.rope_scaling_factor=0.5", "model.rope_scaling_factor = 0.5: must be >= 1"),
    ("moe.scaling_factor=0", "moe.scaling_factor = 0.0: must be > 0"),
    ("moe.capacity_factor=0", "moe.capacity_factor = 0.0: must be > 0 or null"),
    ("train.eval_steps=0", "train.eval_steps = 0: must be >= 1"),
    ("train.seed=-1", "train.seed = -1: must be in [0, 4294967296)"),
    ("profile.start_step=0", "profile.start_step = 0: must be >= 1"),
    ("parallel.gpus_per_node=0", "parallel.gpus_per_node = 0: must be >= 1"),
])
def test_out_of_range_value_is_one_line_naming_key_range_and_source(override, message):
    assert error_of(overrides=[override]) == f"{message} ({override.split('=')[0]} from command line)"


def _numeric_keys() -> dict[str, type]:
    out = {}
    for section, cls in SECTIONS.items():
        for name, tp in typing.get_type_hints(cls).items():
            base = {a for a in typing.get_args(tp) or (tp,) if a is not type(None)}
            if base in ({int}, {float}):
                out[f"{section}.{name}"] = base.pop()
    return out


def test_every_numeric_key_has_a_range_and_its_default_is_in_it():
    assert set(VALUE_RANGES) == set(_numeric_keys())
    default = Config().to_dict()
    for key, valid in VALUE_RANGES.items():
        section, name = key.split(".")
        value = default[section][name]
        assert value is None or valid.holds(value), key


@pytest.mark.parametrize("key", sorted(VALUE_RANGES))
def test_each_range_bound_is_enforced(key):
    """Just outside each bound is refused with the range; nan is refused for every float."""
    valid, tp = VALUE_RANGES[key], _numeric_keys()[key]
    outside = []
    if valid.low is not None:
        outside.append(valid.low if valid.low_open else valid.low - (1 if tp is int else 0.5))
    if valid.high is not None:
        outside.append(valid.high if valid.high_open else valid.high + 1)
    if tp is float:
        outside.append(math.nan)
    assert outside
    for value in outside:
        text = ".nan" if value != value else repr(tp(value))
        msg = error_of(overrides=[f"{key}={text}"])
        assert msg.startswith(f"{key} = ") and "must be " in msg and str(valid) in msg, msg
        assert msg.endswith(f"({key} from command line)") and "\n" not in msg


def test_range_edges_that_are_valid_load():
    cfg = load_config(overrides=["optim.beta1=0", "optim.weight_decay=0", "optim.clip_grad=0", "optim.warmup_steps=0",
                                 "model.mtp_num_layers=0", "model.mtp_loss_scale=0", "moe.expert_bias_update_rate=0",
                                 "train.seed=4294967295", "model.rope_scaling_factor=1", "data.eval_fraction=0"])
    assert (cfg.optim.beta1, cfg.train.seed) == (0.0, 2**32 - 1)


def test_rope_needs_an_even_head_dim_and_yarn_ordered_betas():
    assert error_of(overrides=["model.attention_type=gqa", "model.head_dim=3"]) == (
        "model.head_dim = 3: RoPE needs an even dimension (model.head_dim from command line)")
    assert error_of(overrides=["model.attention_type=gqa", "model.hidden_size=60"]).startswith(
        "model.hidden_size / model.num_attention_heads = 15 (the head dim): RoPE needs an even dimension")
    assert error_of(overrides=["model.rope_scaling=yarn", "model.yarn_beta_fast=0.5"]).startswith(
        "model.yarn_beta_fast = 0.5 must be >= model.yarn_beta_slow = 1.0")
    # the betas only matter with YaRN on
    assert load_config(overrides=["model.yarn_beta_fast=0.5"]).model.rope_scaling is None


def test_min_lr_defaults_to_a_tenth_of_lr_and_an_explicit_one_is_checked(cwd):
    cfg = load_config(path=str(write(cwd / "lr.yaml", "optim: {lr: 2.0e-4, decay: cosine}\n")))
    assert cfg.optim.min_lr is None and cfg.optim.min_lr_value == pytest.approx(2e-5)
    for preset in (None, "deepseek-v3", "qwen3-30b-a3b"):  # lr alone on top of a preset: min_lr follows it
        assert load_config(preset=preset, overrides=["optim.lr=2e-6"]).optim.min_lr_value == pytest.approx(2e-7)
    assert load_config(overrides=["optim.lr=2e-4", "optim.min_lr=1e-6"]).optim.min_lr_value == 1e-6
    assert error_of(overrides=["optim.lr=2e-4", "optim.min_lr=3e-4"]) == (
        "optim.min_lr = 0.0003 is larger than optim.lr = 0.0002 (optim.min_lr from command line, "
        "optim.lr from command line)")
    assert error_of(overrides=["optim.min_lr=-1"]) == (
        "optim.min_lr = -1.0: must be >= 0 or null (optim.min_lr from command line)")
    # null survives a dump and load (config show)
    text = dump_config(cfg)
    assert "  min_lr: null\n" in text
    assert load_config(str(write(cwd / "shown.yaml", text))) == cfg


# ---- cross-field checks, with sources appended ---------------------------------------------

def test_topk_larger_than_experts(cwd):
    write(cwd / "m.yaml", "moe: {num_experts: 8, topk: 2}\n")
    assert error_of(path="m.yaml", overrides=["moe.topk=9"]) == (
        "moe.topk = 9 must be between 1 and moe.num_experts = 8 "
        "(moe.topk from command line, moe.num_experts from m.yaml)")


def test_num_groups_must_divide_experts(cwd):
    write(cwd / "m.yaml", "moe: {num_experts: 8, topk: 2, num_groups: 3, topk_groups: 1}\n")
    assert error_of(path="m.yaml") == (
        "moe.num_groups = 3 does not divide moe.num_experts = 8 (moe.num_groups from m.yaml, "
        "moe.num_experts from m.yaml)")


def test_global_batch_must_divide():
    assert error_of(overrides=["train.micro_batch_size=3", "train.global_batch_size=8"]) == (
        "train.global_batch_size = 8 is not divisible by train.micro_batch_size (3) x parallel.dp (1) = 3 "
        "(train.global_batch_size from command line, train.micro_batch_size from command line)")


def test_ep_must_divide_experts(cwd):
    write(cwd / "m.yaml", "extends: tiny\nparallel: {dp: 3}\ntrain: {micro_batch_size: 1, global_batch_size: 3}\n")
    assert error_of(path="m.yaml", overrides=["parallel.ep=3"]) == (
        "moe.num_experts = 8 is not divisible by parallel.ep = 3 "
        "(moe.num_experts from preset tiny, parallel.ep from command line)")


def test_check_error_on_defaults_has_no_sources(cwd):
    write(cwd / "m.yaml", "model: {num_attention_heads: 3}\n")
    assert error_of(path="m.yaml") == (
        "model.hidden_size = 64 is not divisible by model.num_attention_heads = 3; set model.head_dim "
        "explicitly (model.num_attention_heads from m.yaml)")


# ---- files ----------------------------------------------------------------------------------

def test_missing_file(cwd):
    assert error_of(path="nope.yaml") == "config file not found: nope.yaml"


def test_yaml_syntax_error_names_file_and_line(cwd):
    write(cwd / "bad.yaml", "model:\n  hidden_size: 64\n  num_layers: [1, 2\ntrain: {}\n")
    msg = error_of(path="bad.yaml")
    assert msg.startswith("invalid YAML in bad.yaml at line 4, column 6: ")
    write(cwd / "bad2.yaml", "model:\n  hidden_size: 64\n    oops: 1\n")
    assert error_of(path="bad2.yaml") == (
        "invalid YAML in bad2.yaml at line 3, column 9: mapping values are not allowed here")


def test_duplicate_key_is_an_error(cwd):
    write(cwd / "dup.yaml", "model:\n  hidden_size: 64\n  hidden_size: 128\n")
    assert error_of(path="dup.yaml") == "invalid YAML in dup.yaml at line 3, column 3: duplicate key 'hidden_size'"


def test_top_level_must_be_mapping(cwd):
    write(cwd / "l.yaml", "- 1\n- 2\n")
    assert error_of(path="l.yaml") == (
        "l.yaml: expected a mapping of sections (model:, moe:, train:, ...) at the top level; got list")


# ---- output ---------------------------------------------------------------------------------

def test_dump_round_trip_and_order(cwd):
    cfg = load_config(overrides=["train.recompute_layer_ids=[0,2]", "model.name='1e3'", "train.out_dir=yes",
                                 "model.q_lora_rank=null"])
    text = dump_config(cfg)
    assert [line[:-1] for line in text.splitlines() if line and not line[0].isspace()] == list(SECTIONS)
    assert "  recompute_layer_ids: [0, 2]\n" in text
    write(cwd / "d.yaml", text)
    again = load_config("d.yaml")
    assert again == cfg
    assert again.model.name == "1e3" and again.train.out_dir == "yes"


def test_config_docs_lists_every_field_with_type_default_doc():
    text = config_docs()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"  {section}.{f.name}: " in text, f.name
            assert f"      {f.metadata['doc']}\n" in text
    assert "  model.hidden_size: int (>= 1) = 64\n      Model width H.\n" in text
    assert "  model.num_query_groups: int or null (>= 1) = null\n" in text
    assert "  moe.score_function: one of softmax, sigmoid = softmax\n" in text
    assert "  train.recompute_layer_ids: list of int or null = null\n" in text
    assert "  model.norm_eps: float (> 0) = 1.0e-06\n" in text
    assert "  train.compile: bool = false\n" in text
    assert "  optim.beta1: float (in [0, 1)) = 0.9\n" in text
    assert "  optim.min_lr: float or null (>= 0) = null\n      Learning rate at the end of decay; null = lr / 10.\n" in text


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp=2", "parallel.vpp=2"],
     "parallel.pp_schedule = 1f1b runs one stage per rank, but parallel.vpp = 2; set parallel.pp_schedule=interleaved"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved"],
     "parallel.pp_schedule = interleaved needs parallel.vpp >= 2"),
    (["parallel.pp=2", "parallel.vpp=4", "parallel.pp_schedule=zero_bubble"],
     "parallel.pp_schedule = zero_bubble places exactly two stages per rank in a V; set parallel.vpp=2 (it is 4)"),
    (["parallel.pp=2", "train.micro_batch_size=8"], "parallel.pp_schedule = 1f1b needs at least parallel.pp = 2 "
     "micro-batches per step; micro-batches per step (train.global_batch_size / (train.micro_batch_size x "
     "parallel.dp)) = 1"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=dualpipev", "train.micro_batch_size=4"],
     "parallel.pp_schedule = dualpipev needs at least 2 x parallel.pp = 4 micro-batches per step"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved", "train.micro_batch_size=1",
      "train.global_batch_size=5"], "= 5, not a multiple of its 2 rounds: use a multiple of 2"),
    (["moe.overlap_a2a=true"], "moe.overlap_a2a overlaps the expert all-to-all"),
    (["parallel.tp=2", "train.compile=true"], "train.compile with parallel.tp > 1"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zero_bubble", "train.micro_batch_size=1",
      "train.compile=true"], "set train.compile=false"),
    (["parallel.tp=2", "parallel.dp=6", "parallel.ep=3", "moe.num_experts=6", "moe.num_groups=null",
      "moe.topk_groups=null"], "parallel.tp = 2 and parallel.ep = 3: one must divide the other"),
    (["parallel.tp=2", "parallel.dp=1", "train.seq_length=63"],
     "train.seq_length = 63 is not divisible by parallel.tp = 2: the MoE layers split each sequence"),
    (["parallel.tp=2", "parallel.dp=1", "model.attention_type=gqa", "model.num_query_groups=1"],
     "model.num_query_groups (key/value heads) = 1 is not divisible by parallel.tp = 2: tensor parallelism splits"),
    (["parallel.tp=4", "parallel.dp=1", "model.num_attention_heads=2"],
     "model.num_attention_heads = 2 is not divisible by parallel.tp = 4"),
    (["parallel.tp=2", "parallel.dp=1", "model.vocab_size=511"],
     "model.vocab_size = 511 is not divisible by parallel.tp = 2"),
    (["parallel.tp=2", "parallel.dp=1", "model.ffn_hidden_size=191"],
     "model.ffn_hidden_size = 191 is not divisible by parallel.tp = 2"),
    (["parallel.tp=2", "parallel.dp=1", "moe.shared_expert_ffn_hidden_size=63"],
     "moe.shared_expert_ffn_hidden_size = 63 is not divisible by parallel.tp = 2"),
    (["parallel.tp=2", "parallel.dp=1", "moe.moe_ffn_hidden_size=63"],
     "moe.num_shared_experts x moe.moe_ffn_hidden_size (the shared experts' size) = 63 is not divisible"),
])
def test_pipeline_schedule_and_tensor_parallel_refusals(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(preset="tiny", overrides=overrides)
    assert message in str(err.value)


def test_schedules_place_stages_looped_or_in_a_v():
    from moetrain.config.pipeline_layout import stage_rank

    assert [stage_rank(i, 3, "interleaved") for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [stage_rank(i, 3, "zero_bubble") for i in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [stage_rank(i, 3, "dualpipev") for i in range(6)] == [0, 1, 2, 2, 1, 0]
