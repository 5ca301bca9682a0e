"""Parallelism applied from outside the single-device model, on PyTorch's own engine (torchrun, DeviceMesh,
FSDP2, DTensor, torch.distributed.checkpoint).

Order, as a model is made parallel (``distributed.parallelize``): expert parallelism (each rank keeps its experts,
a DTensor sharded over the ep mesh, and an expert-parallel dispatcher) -> activation checkpointing (the trainer's
recompute settings) -> FSDP2 (``fully_shard`` per decoder block, per MTP depth, then the root; expert weights over
the efsdp mesh). Tensor parallelism (``tensor_parallel``, applied first, before expert parallelism) is built but
not yet wired into the trainer; context and pipeline parallelism are refused with a clear message until they are.

Modules: ``layout`` (the rank order, pure Python, shared with the planner), ``launch`` (torchrun's environment,
the process group), ``mesh`` (device meshes), ``fsdp``, ``expert_parallel`` (dispatchers), ``tensor_parallel``
(TP/SP plan, the trainer's gradient contract), ``reduce`` (norms and metrics over ranks).

Nothing here runs at import: torch.distributed is imported by the functions that need it.
"""
