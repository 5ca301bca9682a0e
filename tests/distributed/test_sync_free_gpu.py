"""The sync-free dispatcher on one GPU (a one-rank NCCL group in this process): a MoE layer using it runs forward +
backward under ``torch.cuda.set_sync_debug_mode("error")``, eagerly and captured in a CUDA graph (the replay
matching the eager result); and ``torchrun``-style single-rank training (the distributed trainer) trains."""

import socket

import pytest
import torch

from moetrain.config.load import load_config

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _sync_free_layer(group, backend):
    """A bf16 MoE layer on the GPU whose dispatcher is the sync-free one over ``group``, and an input for it."""
    from moetrain.distributed.sync_free import SyncFreeDispatcher
    from moetrain.models import build_model

    cfg = load_config(overrides=[f"moe.backend={backend}", "model.hidden_size=128", "moe.moe_ffn_hidden_size=64"])
    with torch.device("cuda"):
        model = build_model(cfg)
    model.to(torch.bfloat16)
    layer = model.moe_layers()[0]
    layer.dispatcher = SyncFreeDispatcher(group, 1, cfg.moe.num_experts)
    x = torch.randn(4, 64, cfg.model.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return layer, x


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_sync_free_layer_reads_nothing_on_the_host(nccl_group, backend):
    layer, x = _sync_free_layer(nccl_group, backend)
    for _ in range(2):  # warm-up: lazy initialisation, autotuning, the tuner's timing
        layer(x).float().sum().backward()
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # eager forward + backward: no host sync
        eager = layer(x)
        eager.float().sum().backward()
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(eager).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_sync_free_layer_captures_in_a_cuda_graph(nccl_group, backend):
    layer, x = _sync_free_layer(nccl_group, backend)
    stream = torch.cuda.Stream()  # warm-up and capture on one side stream, as the trainer's graphed step does
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            layer(x).float().sum().backward()
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            y = layer(x)
            y.float().sum().backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    x_eager = x.detach().clone().requires_grad_(True)
    ref = layer(x_eager)
    ref.float().sum().backward()
    assert torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.allclose(x.grad.float(), x_eager.grad.float(), rtol=2e-2, atol=2e-2)


def test_one_rank_distributed_training_on_gpu(tmp_path, monkeypatch):
    import json

    from moetrain.train.trainer import run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    cfg = load_config(overrides=[f"train.out_dir={tmp_path}", "train.device=cuda", "train.steps=40",
                                 "checkpoint.save_final=false"])
    run(cfg, show_progress=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 40
    assert sum(r["loss"] for r in records[-10:]) < 0.9 * sum(r["loss"] for r in records[:10])
