"""The planner's activation terms under tensor parallelism equal what one rank of TP2 really keeps for backward.

As tests/plan/test_activations.py does on one device: a block runs forward under
torch.autograd.graph.saved_tensors_hooks and every saved tensor's storage is counted once while alive (parameters and
the RoPE tables excluded; a DTensor counts its local tensor, an AsyncCollectiveTensor its data), plus the inputs
activation checkpointing keeps. The block is made tensor-parallel by ``distributed.tensor_parallel.parallelize_block``
and gets this rank's input ([B, S/2, H] with sequence parallelism, [B, S, H] without). The count must equal
``activations.block_terms`` with tp = 2 exactly: a GQA dense block and two MoE blocks (GQA with sinks, batch aux and z
loss; MLA with the sequence aux loss), every recompute mode, fp32 and bf16. The whole model (blocks, MTP, head and
vocab-parallel loss) within 1%, as the single-device test allows.
"""

import torch
from gloo_ranks import run_ranks

from moetrain.bench.saved_bytes import StorageTracker, block_saved_bytes, seeded_block, storage
from moetrain.config.load import load_config

B, S = 2, 16
BASE = ["model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=48", "moe.moe_ffn_hidden_size=24",
        "train.micro_batch_size=2", "train.seq_length=16"]
GQA = ["model.attention_type=gqa", "model.num_query_groups=2", "model.mtp_num_layers=0"]
BLOCKS = {  # name: (overrides, MoE block?)
    "gqa-dense-qknorm": (GQA + ["model.qk_norm=true"], False),
    "gqa-moe-sinks-batch-aux-z": (GQA + ["model.attention_sinks=true", "moe.aux_loss_type=batch",
                                         "moe.z_loss_coeff=0.01"], True),
    "mla-moe-sequence-aux": ([], True),
}


def tp_block_saved_bytes(cfg, moe: bool, sp: bool, mesh, mode: str, dtype) -> int:
    from moetrain.distributed.tensor_parallel import parallelize_block

    blk = seeded_block(cfg, moe, None, mode, dtype)
    parallelize_block(blk, mesh, sequence_parallel=sp)
    x = torch.randn(B, S // mesh.size() if sp else S, cfg.model.hidden_size, dtype=dtype, requires_grad=True)
    return block_saved_bytes(cfg, blk, x)


def _blocks_ranks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from moetrain.plan import activations as A

    mesh = init_device_mesh("cpu", (world_size,))
    for name, (overrides, moe) in BLOCKS.items():
        cfg = load_config(preset="tiny", overrides=BASE + overrides)
        for b, dtype in ((4, torch.float32), (2, torch.bfloat16)):
            for mode in ("none", "selective", "full"):
                for sp in (False, True):
                    measured = tp_block_saved_bytes(cfg, moe, sp, mesh, mode, dtype)
                    d = A.Dims(B=B, S=S, b=b, tp=world_size, sp=sp, device="cpu")
                    projected = A.total(A.block_terms(cfg, d, moe, None, mode))
                    assert projected == measured, (name, b, mode, sp, projected, measured)


def test_block_saved_bytes_under_tensor_parallelism_equal_the_formula():
    run_ranks(_blocks_ranks)


def _model_ranks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from moetrain.distributed.tensor_parallel import apply_tensor_parallel, tp_loss_context
    from moetrain.models.transformer import MoETransformer
    from moetrain.plan import activations as A

    mesh = init_device_mesh("cpu", (world_size,))
    cfg = load_config(preset="tiny", overrides=BASE)  # MLA, MoE with a shared expert, MTP 1
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, cfg.model.vocab_size, (B, S), generator=g) for _ in range(2))
    for sp in (False, True):
        torch.manual_seed(0)
        model = MoETransformer(cfg)
        apply_tensor_parallel(model, mesh, sequence_parallel=sp)
        tracker = StorageTracker({storage(p) for p in model.parameters()} | {storage(ids), storage(labels)})
        with tp_loss_context(model):
            with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
                out = model(ids, labels)
            kept = tracker.alive_bytes()
            out.loss.backward()
        d = A.Dims(B=B, S=S, b=4, tp=world_size, sp=sp, device="cpu")
        expected = sum(A.total(A.block_terms(cfg, d, cfg.is_moe_layer(i), None, "none")) for i in range(4))
        expected += A.total(A.block_terms(cfg, d, True, None, "none")) + A.total(A.mtp_extra_terms(cfg, d))
        expected += A.total(A.head_terms(cfg, d)) + 2 * S * (cfg.model.qk_rope_head_dim // 2) * 4  # + cos/sin
        assert abs(kept - expected) <= 0.01 * expected, (sp, kept, expected)


def test_model_saved_bytes_under_tensor_parallelism_match_the_formula():
    run_ranks(_model_ranks)
