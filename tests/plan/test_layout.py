"""pipeline_layout grammar, validation errors and stage placement."""

import pytest

from moetrain.config.load import load_config
from moetrain.errors import ConfigError
from moetrain.plan.layout import expand, parse_layout


def cfg(layers=8, mtp=0, **par):
    over = [f"model.num_layers={layers}", f"model.mtp_num_layers={mtp}"] + [f"parallel.{k}={v}" for k, v in par.items()]
    return load_config(preset="tiny", overrides=over)


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
    lay = parse_layout(cfg(layers=8, mtp=1, pp=2, pipeline_layout="Et|tt|ttt|ttmL"))
    assert (lay.pp, lay.vpp) == (2, 2)
    assert [(s.rank, s.chunk) for s in lay.stages] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [s.layers for s in lay.stages] == [[0], [1, 2], [3, 4, 5], [6, 7]]
    assert lay.stages[3].mtp == [0] and lay.stages[3].has_loss and lay.stages[0].has_embedding
    assert [s.index for s in lay.stages_of_rank(1)] == [1, 3]


def test_default_layout_even_split():
    lay = parse_layout(cfg(layers=8, mtp=1, pp=2, vpp=2))
    assert [s.items for s in lay.stages] == [list("Ett"), list("tt"), list("tt"), list("ttmL")]


@pytest.mark.parametrize("layout, match", [
    ("Et*3|t*4L", "places 7 decoder layers"),
    ("Et*4|t*4", "exactly one E and one L"),
    ("t*4|Et*4L", "E .embedding. must be in the first stage"),
    ("Et*4L|t*4", "L .loss. must be in the last stage"),
    ("Et*4|t*4|L", "not a multiple of parallel.pp"),
    ("Et*4|tqL", "unknown symbol"),
    ("Et*4|(t*4L", "unclosed"),
    ("E*|t*8L", "must be followed by a count"),
    ("Et*0|t*8L", ">= 1"),
    ("Emt*4|t*4L", "MTP layer .m. must come after"),
])
def test_layout_errors_name_the_key(layout, match):
    c = cfg(layers=8, mtp=1 if "m" in layout else 0, pp=2, pipeline_layout=layout)
    with pytest.raises(ConfigError, match=match) as err:
        parse_layout(c)
    assert "parallel.pipeline_layout" in str(err.value) and "\n" not in str(err.value)


def test_vpp_must_agree():
    with pytest.raises(ConfigError, match="parallel.vpp = 3"):
        parse_layout(cfg(layers=8, pp=2, vpp=3, pipeline_layout="Et*2|t*2|t*2|t*2L"))
