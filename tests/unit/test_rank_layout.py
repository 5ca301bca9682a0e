"""The rank order (distributed.layout) and the parallel degrees' checks, without processes."""

import pytest

from moetrain.config.load import load_config
from moetrain.distributed.layout import RankLayout, check_world
from moetrain.errors import ConfigError


def test_dense_and_expert_readings_of_the_same_ranks():
    layout = RankLayout(dp_replicate=2, dp_shard=4, ep=2)
    assert layout.world_size == 8 and layout.efsdp == 2
    assert layout.stride("dp_shard") == 1 and layout.stride("dp_replicate") == 4
    assert layout.stride("ep") == 1 and layout.stride("efsdp") == 2
    # rank 5: replica 1, shard 1 of it; read by experts: efsdp 0, ep 1
    assert layout.coords(5) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 0}
    assert layout.coords(5, expert=True) == {"pp": 0, "dp_replicate": 1, "efsdp": 0, "ep": 1, "etp": 0}
    # every ep group is ep consecutive ranks inside one replica
    groups = {}
    for r in range(8):
        c = layout.coords(r, expert=True)
        groups.setdefault((c["dp_replicate"], c["efsdp"]), []).append(r)
    assert sorted(groups.values()) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_tp_is_innermost_and_pp_outermost():
    layout = RankLayout(pp=2, dp_shard=2, tp=4)
    assert layout.stride("tp") == 1 and layout.stride("dp_shard") == 4 and layout.stride("pp") == 8


def test_world_size_mismatch_names_the_degrees():
    with pytest.raises(ValueError, match=r"4 process\(es\) but parallel.pp \(1\) x parallel.dp \(2\).* = 2"):
        check_world(RankLayout(dp_shard=2), 4)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.dp=4", "parallel.dp_replicate=3"], "dp_replicate = 3 does not divide parallel.dp = 4"),
    (["parallel.dp=4", "parallel.dp_replicate=4", "parallel.ep=2"], "must divide the sharded data-parallel"),
    (["parallel.dp=2", "parallel.ep=4"], "must divide"),
])
def test_parallel_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*overrides, "train.global_batch_size=8"])


def test_parallel_degrees_outside_torchrun_say_how_to_launch(tmp_path, monkeypatch):
    from moetrain.errors import UserError
    from moetrain.train.trainer import run

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_config(overrides=["parallel.dp=2", "train.micro_batch_size=4", f"train.out_dir={tmp_path}"])
    with pytest.raises(UserError, match=r"parallel.dp = 2: .*torchrun --nproc_per_node 2 -m moetrain train"):
        run(cfg, show_progress=False)


def test_unbuilt_parallelism_is_refused_before_any_process_group(tmp_path, monkeypatch):
    import torch.distributed as dist

    from moetrain.errors import UserError
    from moetrain.train.trainer import run

    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = load_config(overrides=["parallel.cp=2", f"train.out_dir={tmp_path}"])
    with pytest.raises(UserError, match="parallel.cp = 2: context parallelism is not built yet"):
        run(cfg, show_progress=False)
    assert not dist.is_initialized()
