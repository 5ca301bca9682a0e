"""pipeline_layout grammar, the errors at config load, and stage placement."""

import re

import pytest

from moetrain.config.load import load_config
from moetrain.errors import ConfigError
from moetrain.plan.layout import expand, parse_layout


def overrides(layers=8, mtp=0, **par):
    if par.get("vpp", 1) > 1:
        par.setdefault("pp_schedule", "interleaved")
    # micro-batches of one sequence: enough of them for any schedule the tests name
    return [f"model.num_layers={layers}", f"model.mtp_num_layers={mtp}", "train.micro_batch_size=1"] + \
        [f"parallel.{k}={v}" for k, v in par.items()]


def cfg(layers=8, mtp=0, **par):
    return load_config(preset="tiny", overrides=overrides(layers, mtp, **par))


def load_error(layers=8, mtp=0, **par) -> str:
    with pytest.raises(ConfigError) as err:
        cfg(layers, mtp, **par)
    return str(err.value)


@pytest.mark.parametrize("text, stages", [
    ("Et*3|t*4|t*4|t*3mL", ["Ettt", "tttt", "tttt", "tttmL"]),
    ("E|(t*2|)*3t*2L", ["E", "tt", "tt", "tt", "ttL"]),
    ("E, t t | t(t)*2 L", ["Ett", "tttL"]),
    ("((t)*2)*3", ["tttttt"]),
    ("|", ["", ""]),
])
def test_expand(text, stages):
    assert expand(text) == stages


def test_explicit_layout_places_stages_round_robin():
    lay = parse_layout(cfg(layers=8, mtp=1, pp=2, vpp=2, pipeline_layout="Et|tt|ttt|ttmL"))
    assert (lay.pp, lay.vpp) == (2, 2)
    assert [(s.rank, s.chunk) for s in lay.stages] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [s.layers for s in lay.stages] == [[0], [1, 2], [3, 4, 5], [6, 7]]
    assert lay.stages[3].mtp == [0] and lay.stages[3].has_loss and lay.stages[0].has_embedding
    assert [s.index for s in lay.stages_of_rank(1)] == [1, 3]


def test_default_layout_even_split():
    lay = parse_layout(cfg(layers=8, mtp=1, pp=2, vpp=2))
    assert [s.items for s in lay.stages] == [list("Ett"), list("tt"), list("tt"), list("ttmL")]


def test_one_stage_layout_with_pp_1_is_accepted_and_placed_whole():
    lay = parse_layout(cfg(layers=8, mtp=1, pipeline_layout="Et*8mL"))
    assert (lay.pp, lay.vpp, len(lay.stages)) == (1, 1, 1)
    assert lay.stages[0].layers == list(range(8)) and lay.stages[0].mtp == [0]


@pytest.mark.parametrize("layout, par, message", [
    # more stages than pp x vpp: refused, not run as vpp = stages / pp behind parallel.vpp's back
    ("Et*2|t*2|t*2|t*2L", {"pp": 2},
     "parallel.pipeline_layout = 'Et*2|t*2|t*2|t*2L' has 4 stages, but parallel.pp (2) x parallel.vpp (1) = 2; "
     "set parallel.vpp = 2 or write 2 stages (parallel.pipeline_layout from command line, "
     "parallel.pp from command line)"),
    ("Et*2|t*2|t*2|t*2L", {"pp": 2, "vpp": 3},
     "parallel.pipeline_layout = 'Et*2|t*2|t*2|t*2L' has 4 stages, but parallel.pp (2) x parallel.vpp (3) = 6; "
     "set parallel.vpp = 2 or write 6 stages (parallel.pipeline_layout from command line, "
     "parallel.pp from command line, parallel.vpp from command line)"),
    ("Et*4|t*4|L", {"pp": 2},
     "parallel.pipeline_layout = 'Et*4|t*4|L' has 3 stages, but parallel.pp (2) x parallel.vpp (1) = 2; "
     "write 2 stages (parallel.pipeline_layout from command line, parallel.pp from command line)"),
    # pp = 1: the layout is checked too, not ignored
    ("Et*4|t*4L", {},
     "parallel.pipeline_layout = 'Et*4|t*4L' has 2 stages, but parallel.pp (1) x parallel.vpp (1) = 1; "
     "set parallel.pp = 2 or write one stage (no '|') (parallel.pipeline_layout from command line)"),
    ("Et*7L", {},
     "parallel.pipeline_layout = 'Et*7L' places 7 decoder layers (t) but model.num_layers = 8 "
     "(parallel.pipeline_layout from command line, model.num_layers from command line)"),
])
def test_layout_that_does_not_fit_the_pipeline_or_model_is_refused_at_load(layout, par, message):
    assert load_error(layers=8, pipeline_layout=layout, **par) == message


@pytest.mark.parametrize("layout, match", [
    ("Et*3|t*4L", "places 7 decoder layers"),
    ("Et*4|t*4mmL", "places 2 MTP layers .m. but model.mtp_num_layers = 1"),
    ("Et*4|t*4", "exactly one E and one L"),
    ("t*4|Et*4L", "E .embedding. must be in the first stage"),
    ("Et*4L|t*4", "L .loss. must be in the last stage"),
    ("Et*4|tqL", "unknown symbol"),
    ("Et*4|(t*4L", "unclosed"),
    ("E*|t*8L", "must be followed by a count"),
    ("Et*0|t*8L", ">= 1"),
    ("Emt*4|t*4L", "MTP layer .m. must come after"),
    ("tEt*3|t*4mL", "E must come before every t and m"),
])
def test_layout_errors_name_the_key(layout, match):
    msg = load_error(layers=8, mtp=1, pp=2, pipeline_layout=layout)
    assert msg.startswith(f"parallel.pipeline_layout = {layout!r}") and "\n" not in msg
    assert re.search(match, msg), msg


def test_parse_layout_applies_the_same_rules_to_an_unchecked_config():
    """A Config built in code (no load, no check) gets the same refusal from the planner."""
    c = cfg(layers=8, pp=2)
    c.parallel.pipeline_layout = "Et*2|t*2|t*2|t*2L"  # 4 stages, vpp 1
    with pytest.raises(ConfigError, match=r"has 4 stages, but parallel.pp \(2\) x parallel.vpp \(1\) = 2"):
        parse_layout(c)
