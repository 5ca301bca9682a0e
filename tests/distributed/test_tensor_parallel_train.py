"""`moetrain train` with tensor parallelism on gloo ranks against one process on the same global batch and seed
(per-step loss, grad norm, LM, aux and MTP losses within 1e-4 relative, fp32): TP2 and TP2 with sequence
parallelism (MTP on and off, recompute ids, the vocab-parallel fused loss), and TP composed on one mesh with FSDP2 (TP2 x DP2), pipelining
(TP2 x PP2 with SP and an explicit layout) and expert parallelism folded over the tp ranks (TP2 x EP2 x DP2)."""

import pytest
from train_runs import NO_MTP, assert_match, single, train_on_ranks

TWO_RANKS = {
    "tp2_recompute_ids_fused_loss": ["parallel.tp=2", "train.recompute_layer_ids=[1,3]", "train.fused_loss=true"],
    "tp2_sp_no_mtp_selective": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=selective",
                                *NO_MTP],
}
FOUR_RANKS = {
    "tp2_dp2": ["parallel.tp=2", "parallel.dp=2"],
    "tp2_pp2_sp_layout": ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                          "parallel.pipeline_layout=Et|t*3mL"],
    "tp2_ep2_dp2_sp": ["parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.sequence_parallel=true"],
}


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    return {"mtp": single(tmp_path_factory.mktemp("single")),
            "no_mtp": single(tmp_path_factory.mktemp("single"), *NO_MTP)}


@pytest.mark.parametrize("world_size, runs", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["two_ranks", "four_ranks"])
def test_tensor_parallel_training_matches_one_process(world_size, runs, singles, tmp_path):
    got = train_on_ranks(tmp_path, runs, world_size=world_size)
    for name, overrides in runs.items():
        assert_match(got[name], singles["no_mtp" if NO_MTP[0] in overrides else "mtp"], name)
