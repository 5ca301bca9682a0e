"""Typed configuration schema: one dataclass per section, one documented field per key.

Every field carries a one-line doc in ``metadata["doc"]``; ``moetrain config show --doc``
prints them. Types are checked by ``moetrain.config.load`` (see ``coerce``); ``Config.check``
(called after loading) then checks every numeric value against its range in ``VALUE_RANGES``
and the consistency between keys (``moetrain.config.relations``). Field names follow Megatron/HF where users would look for them.

This module only declares; it builds nothing and imports no torch.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Literal, Optional


def doc(default, text: str, **kw):
    """A dataclass field with a default and its one-line documentation."""
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"doc": text, **kw})
    return field(default=default, metadata={"doc": text, **kw})


from moetrain.errors import ConfigError  # noqa: E402  (re-exported for callers of the schema)


Dtype = Literal["fp32", "bf16"]

FP8_BUILT = ("none", "tensorwise", "rowwise", "blockwise", "mxfp8")

# The FP8 recipes whose GEMM is torch._scaled_grouped_mm: they keep the fused expert path (ops.moe_experts_fp8)
# where the experts have no biases; the others run on dispatched rows.
FP8_FUSED = ("rowwise", "tensorwise")


@dataclass
class ModelConfig:
    name: str = doc("tiny", "Free-form model name shown in logs and reports.")
    from_hf: Optional[str] = doc(
        None, "Initialise from this Hugging Face checkpoint directory (or a `moetrain convert` output); "
        "its config sets every architecture key of model.* and moe.*.")
    vocab_size: int = doc(512, "Vocabulary size (rows of the embedding and the output head).")
    hidden_size: int = doc(64, "Model width H.")
    num_layers: int = doc(4, "Number of decoder layers (MTP layers not included).")
    num_attention_heads: int = doc(4, "Number of query heads.")
    num_query_groups: Optional[int] = doc(
        None, "Key/value heads for GQA; null means MHA (= num_attention_heads). Ignored by MLA.")
    head_dim: Optional[int] = doc(None, "Per-head dimension for MHA/GQA; null means hidden_size / heads.")
    ffn_hidden_size: int = doc(256, "Intermediate size of the dense MLP layers.")
    activation: Literal["swiglu", "gelu"] = doc("swiglu", "Activation of the dense MLP layers.")
    norm_eps: float = doc(1e-6, "RMSNorm epsilon.")
    attention_type: Literal["gqa", "mla"] = doc(
        "gqa", "gqa: multi/grouped-query attention; mla: DeepSeek multi-head latent attention.")
    q_lora_rank: Optional[int] = doc(None, "MLA: rank of the query down-projection; null = full-rank query.")
    kv_lora_rank: int = doc(512, "MLA: rank of the compressed key/value latent.")
    qk_nope_head_dim: int = doc(128, "MLA: per-head query/key dimension without RoPE.")
    qk_rope_head_dim: int = doc(64, "MLA: per-head query/key dimension carrying RoPE (key part shared by heads).")
    v_head_dim: int = doc(128, "MLA: per-head value dimension.")
    qk_norm: bool = doc(False, "RMSNorm on each query and key head before RoPE (Qwen3).")
    attention_bias: bool = doc(False, "Bias on the q/k/v projections (and the output projection, GPT-OSS).")
    attention_out_bias: Optional[bool] = doc(
        None, "Bias on the attention output projection; null = same as attention_bias.")
    sliding_window: Optional[int] = doc(None, "Sliding-window size in tokens; null = full causal attention.")
    sliding_window_every: int = doc(
        1, "Layer i uses the sliding window when i % sliding_window_every == 0 (GPT-OSS: 2).")
    attention_sinks: bool = doc(False, "Learned per-head attention sink logits (GPT-OSS).")
    rope_theta: float = doc(10000.0, "RoPE base frequency.")
    rope_scaling: Optional[Literal["yarn"]] = doc(None, "RoPE scaling: null or 'yarn'.")
    rope_scaling_factor: float = doc(1.0, "YaRN: context extension factor.")
    rope_original_max_position: int = doc(4096, "YaRN: original training context length.")
    yarn_beta_fast: float = doc(32.0, "YaRN: high-frequency boundary (rotations).")
    yarn_beta_slow: float = doc(1.0, "YaRN: low-frequency boundary (rotations).")
    yarn_mscale: float = doc(1.0, "YaRN: attention temperature coefficient (DeepSeek mscale).")
    yarn_mscale_all_dim: float = doc(0.0, "YaRN: DeepSeek mscale_all_dim; 0 disables the softmax-scale correction.")
    yarn_truncate: Optional[bool] = doc(
        None, "YaRN: round the correction range to whole dimensions; null = true except for GPT-OSS (sinks).")
    tie_embeddings: bool = doc(False, "Share the input embedding with the output head.")
    mtp_num_layers: int = doc(0, "Multi-token-prediction depth (DeepSeek-V3: 1).")
    mtp_loss_scale: float = doc(0.1, "Weight of the MTP loss (averaged over depths).")
    init_std: float = doc(0.02, "Standard deviation of the normal weight initialisation.")
    fused_rope: bool = doc(
        True, "RoPE, with the q/k RMSNorm before it where the model has one, as one Triton kernel per tensor and "
        "direction (moetrain.ops.rope) on CUDA with triton installed; it keeps only its input and an fp32 rstd per "
        "row for backward. false: the eager RMSNorm and RoPE ops (the CPU always runs those). The planner follows it.")


@dataclass
class MoEConfig:
    num_experts: int = doc(0, "Routed experts per MoE layer; 0 makes a dense model.")
    moe_ffn_hidden_size: int = doc(128, "Intermediate size I of each routed expert.")
    topk: int = doc(2, "Experts per token.")
    num_shared_experts: int = doc(0, "Shared experts (always active); each of moe_ffn_hidden_size.")
    shared_expert_ffn_hidden_size: Optional[int] = doc(
        None, "Total intermediate size of the shared expert MLP; null = num_shared_experts * moe_ffn_hidden_size.")
    first_k_dense: int = doc(0, "The first k decoder layers use a dense MLP instead of MoE.")
    layer_freq: int = doc(1, "After first_k_dense, layer i is MoE when (i - first_k_dense) % layer_freq == 0.")
    score_function: Literal["softmax", "sigmoid"] = doc("softmax", "Router score function (computed in fp32).")
    num_groups: Optional[int] = doc(None, "Expert groups for group-limited routing; null disables it.")
    topk_groups: Optional[int] = doc(None, "Groups each token may route into (group-limited routing).")
    group_score: Literal["max", "top2_sum"] = doc(
        "top2_sum", "Group ranking: max expert score (DeepSeek-V2) or sum of top-2 (DeepSeek-V3).")
    normalize_topk: bool = doc(True, "Renormalise the top-k weights to sum to one.")
    scaling_factor: float = doc(1.0, "Multiply the top-k weights by this (DeepSeek routed_scaling_factor).")
    router_bias: bool = doc(False, "Learned bias on the router logits (GPT-OSS).")
    router_gemm: Literal["auto", "fp32"] = doc(
        "auto", "Router logits GEMM. auto: in bf16 on CUDA, on the tensor cores with fp32 accumulation and "
        "output (the same fp32 logits up to summation order, no fp32 copy of the input kept; "
        "moetrain.ops.router_logits), else fp32; fp32: upcast copies and an fp32 GEMM, as the reference "
        "backend always does.")
    expert_bias: bool = doc(False, "Aux-loss-free balancing: a per-expert bias added for selection only.")
    expert_bias_update_rate: float = doc(1e-3, "Step of the expert-bias update after each optimizer step.")
    aux_loss_coeff: float = doc(0.0, "Load-balancing auxiliary loss coefficient; 0 disables it.")
    aux_loss_type: Literal["batch", "sequence"] = doc(
        "batch", "Aux loss computed over the whole micro-batch or per sequence (DeepSeek-V3 style).")
    z_loss_coeff: float = doc(0.0, "Router z-loss coefficient; 0 disables it.")
    activation: Literal["swiglu", "swiglu_clamped"] = doc(
        "swiglu", "Expert activation; swiglu_clamped is GPT-OSS's (alpha 1.702, limit 7, up + 1).")
    expert_linear_bias: bool = doc(False, "Biases on the expert FC1/FC2 (GPT-OSS).")
    capacity_factor: Optional[float] = doc(
        None, "Per-expert capacity = factor * tokens * topk / experts; overflow tokens are dropped. null = dropless.")
    force_balance: Literal["none", "even", "uniform"] = doc(
        "none", "Benchmark routing: even = deterministic round-robin, uniform = random logits.")
    backend: Literal["auto", "triton", "torch", "reference"] = doc(
        "auto", "Backend of the expert ops (moetrain.ops): auto = fused Triton path with each GEMM measured "
        "against torch._grouped_mm (CUDA, 16-bit), PyTorch elsewhere; triton, torch, reference force one.")
    dispatcher: Literal["alltoall", "sync_free"] = doc(
        "alltoall", "How routed rows reach other expert-parallel ranks (parallel.ep > 1): alltoall exchanges the "
        "counts first and sends exactly the rows (one host read per layer); sync_free sends fixed-size worst-case "
        "buffers and reads nothing routing-dependent on the host (CUDA-graph capturable).")
    dispatcher_capacity: Optional[float] = doc(
        None, "sync_free: rows each rank may send to one peer, as a factor of its even share (tokens * topk / ep); "
        "rows past it are dropped and counted. null = the worst case (tokens * min(topk, local experts)), "
        "dropping nothing.")
    overlap_a2a: bool = doc(
        False, "Pipeline steady state (parallel.pp_schedule=dualpipev): one micro-batch's expert-parallel "
        "dispatch/combine runs on a communication stream while another micro-batch's forward or backward computes "
        "(DualPipe's forward-backward chunk overlap). Needs parallel.ep > 1.")


@dataclass
class ParallelConfig:
    dp: int = doc(1, "Data-parallel size (dp_replicate x the FSDP shard degree dp / dp_replicate).")
    dp_replicate: int = doc(1, "Data-parallel replicas (HSDP): parameters are sharded over dp / dp_replicate "
                               "ranks and replicated over dp_replicate groups of them.")
    tp: int = doc(1, "Tensor-parallel size.")
    pp: int = doc(1, "Pipeline-parallel size.")
    vpp: int = doc(1, "Virtual pipeline stages per pipeline rank (interleaved 1F1B).")
    cp: int = doc(1, "Context-parallel size.")
    ep: int = doc(1, "Expert-parallel size.")
    etp: int = doc(1, "Expert tensor-parallel size.")
    sequence_parallel: bool = doc(False, "Shard norms/dropout activations over TP ranks.")
    pipeline_layout: Optional[str] = doc(
        None, "Explicit stage layout of pp x vpp stages, e.g. 'Et*3|t*4|t*4|t*3mL' (E embedding, t layer, m MTP, "
        "L loss); null = the decoder layers split evenly. Stage i runs on pipeline rank i mod pp (looped: 1f1b, "
        "interleaved), or on rank i for i < pp and 2 pp - 1 - i after (V: zero_bubble, dualpipev).")
    pp_schedule: Literal["1f1b", "interleaved", "zero_bubble", "dualpipev"] = doc(
        "1f1b", "Pipeline schedule (torch.distributed.pipelining): 1f1b (parallel.vpp = 1), interleaved 1F1B "
        "(vpp >= 2, looped placement), zero_bubble (ZB-V: vpp = 2, V placement, weight gradients deferred to "
        "fill the bubbles), dualpipev (DeepSeek's DualPipe-V: vpp = 2, V placement).")
    gpus_per_node: int = doc(8, "GPUs per node (communication model of the planner).")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_shard(self) -> int:
        """Ranks FSDP shards the parameters over (per replica)."""
        return self.dp // self.dp_replicate


@dataclass
class TrainConfig:
    backend: Literal["torch", "jax"] = doc(
        "torch", "Framework the model trains in: torch, or jax (moetrain.jax: the same model in Flax NNX, jitted "
        "steps, the same run directory, metrics and checkpoints; data and expert parallelism over the devices of one "
        "process; pip install -e \".[jax]\").")
    steps: int = doc(200, "Optimizer steps to run.")
    micro_batch_size: int = doc(4, "Sequences per micro-batch per data-parallel rank.")
    global_batch_size: int = doc(4, "Sequences per optimizer step over all data-parallel ranks.")
    seq_length: int = doc(64, "Tokens per sequence.")
    out_dir: str = doc("runs/default", "Where metrics, checkpoints and traces are written.")
    seed: int = doc(1234, "Seed for initialisation, data order and dropout-free sampling.")
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "auto = cuda when available, else cpu.")
    log_interval: int = doc(1, "Print and record metrics every N steps.")
    eval_interval: int = doc(0, "Run the eval split every N steps; 0 disables eval.")
    eval_steps: int = doc(4, "Micro-batches per evaluation.")
    recompute: Literal["none", "selective", "full"] = doc(
        "none", "Activation recompute: selective recomputes attention core and expert activations; full whole layers.")
    recompute_layer_ids: Optional[list[int]] = doc(
        None, "Global layer ids recomputed in full (MTP depth d, 0-based, is num_layers + d); others follow recompute.")
    manual_gc: bool = doc(False, "Disable automatic Python GC and collect every manual_gc_interval steps.")
    manual_gc_interval: int = doc(50, "Steps between manual garbage collections.")
    compile: bool = doc(False, "torch.compile each decoder layer.")
    cuda_graph: bool = doc(False, "After two eager steps, replay each micro-batch's forward + backward and each "
                                  "step's update (norm, clip, AdamW) from CUDA graphs (for host-bound steps: small "
                                  "models, small micro-batches). CUDA only; not with recompute, compile or "
                                  "moe.backend=reference; optimizer state in one dtype, unless "
                                  "optim.triton_kernel updates mixed-precision state on the device.")
    max_skipped_steps: int = doc(5, "Abort after this many consecutive steps with a non-finite loss or grad.")
    tensorboard: bool = doc(False, "Also write TensorBoard scalars under out_dir/tensorboard.")
    overwrite: bool = doc(
        False, "Start a fresh run in an out_dir that holds another run: its files move to out_dir/replaced/ "
        "(never deleted). Without it such an out_dir is refused.")
    dist_timeout_s: float = doc(
        600.0, "Distributed runs: seconds a collective may wait for the other ranks (NCCL/gloo timeout) before the "
        "job stops with the stalled operation named.")
    skip_memory_check: bool = doc(
        False, "Train even when the planner projects that the run will not fit the device's memory.")
    fused_loss: bool = doc(
        False, "The LM and MTP cross-entropy through moetrain.ops.linear_cross_entropy: chunked over tokens with the "
        "gradient computed in the same pass, no [tokens, vocab] logits kept (vocab-parallel under tensor "
        "parallelism). Measured on an H100: 13.6% faster and 12 GiB lighter on a 4-layer qwen3-30b-a3b (vocab "
        "151936, hidden 2048), 1% slower on a DeepSeek-V3 EP8 proxy (hidden 7168; the planner agrees: the fp32 "
        "accumulation of the head's weight gradient per chunk grows with hidden). Off by default; `moetrain plan "
        "perf` projects both ways.")
    pp_warmup: bool = doc(
        False, "Pipeline runs: before step 1, one forward + backward of each local stage on its own (gradients "
        "and MoE counts discarded), so the first step's allocations and kernel autotuning do not stall the "
        "pipeline.")


@dataclass
class OptimConfig:
    lr: float = doc(3e-3, "Peak learning rate.")
    min_lr: Optional[float] = doc(None, "Learning rate at the end of decay; null = lr / 10.")
    warmup_steps: int = doc(10, "Linear warmup steps from 0 to lr.")
    decay: Literal["cosine", "linear", "constant"] = doc("cosine", "Decay shape after warmup.")
    decay_steps: Optional[int] = doc(None, "Steps over which to decay (after warmup); null = train.steps - warmup.")
    weight_decay: float = doc(0.1, "AdamW decoupled weight decay.")
    decay_norms_biases_embeddings: bool = doc(
        False, "Apply weight decay to norms, biases and embeddings too (off by default).")
    beta1: float = doc(0.9, "Adam beta1.")
    beta2: float = doc(0.95, "Adam beta2.")
    eps: float = doc(1e-8, "Adam epsilon.")
    clip_grad: float = doc(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    main_grads_dtype: Dtype = doc("fp32", "Dtype gradients are accumulated in.")
    exp_avg_dtype: Dtype = doc("fp32", "Dtype of Adam's first moment.")
    exp_avg_sq_dtype: Dtype = doc("fp32", "Dtype of Adam's second moment.")
    triton_kernel: bool = doc(
        True, "The optimizer step as Triton multi-tensor kernels on CUDA (moetrain.kernels.adamw): the gradient "
        "norm in one pass, then AdamW and the master -> parameter copy in one pass per dtype combination, "
        "mixed-precision state included (then updated on the device, capturable by train.cuda_graph); within "
        "1.06-1.24x of the HBM floor on an H200 where torch's fused AdamW takes 1.55-1.89x (bench/optimizer.md). "
        "false: torch's fused AdamW where the state has one dtype, else the explicit per-tensor path (the "
        "kernel's reference). The CPU always takes the latter.")
    distributed: bool = doc(False, "Retired (must stay false): with more than one rank FSDP2 shards the optimizer "
                                   "state, gradients and parameters (beyond ZeRO-1's optimizer-state sharding).")

    @property
    def min_lr_value(self) -> float:
        """The learning rate decay ends at: optim.min_lr, or lr / 10 where that is null."""
        return self.lr / 10 if self.min_lr is None else self.min_lr


@dataclass
class DataConfig:
    source: Literal["synthetic", "tokens"] = doc(
        "synthetic", "synthetic: generated sequences a model can learn; tokens: a dataset from `moetrain data prepare`.")
    path: Optional[str] = doc(None, "Directory written by `moetrain data prepare` (source: tokens).")
    eval_fraction: float = doc(0.05, "Fraction of documents held out for evaluation.")
    shuffle: bool = doc(True, "Shuffle sequences deterministically by train.seed.")


@dataclass
class PrecisionConfig:
    dtype: Literal["fp32", "bf16", "fp16"] = doc(
        "bf16", "Parameter/compute dtype on GPU; CPU runs always use fp32.")
    master_weights: bool = doc(
        True, "Keep fp32 master weights for the optimizer when dtype is bf16/fp16.")
    fp8_recipe: Literal["none", "tensorwise", "rowwise", "blockwise", "mxfp8"] = doc(
        "none", "FP8 (E4M3) for the routed experts' GEMMs, forward and backward, weights quantized once per "
                "optimizer step: blockwise = 1x128 activation tiles and 128x128 weight blocks; rowwise = one scale "
                "per row (per column of each expert's rows in the weight gradient); tensorwise = one scale per tensor "
                "(per expert for weights), all with fp32 scales; mxfp8 = 1x32 tiles along each GEMM's reduction with "
                "power-of-two (E8M0) scales, on Blackwell's block-scaled tensor cores (on Hopper the MX GEMM runs "
                "Triton's emulation: correct, not fast).")
    fp8_dense: Literal["none", "tensorwise", "rowwise"] = doc(
        "none", "FP8 for the dense linears (attention projections, dense MLPs, shared experts), forward and backward, "
                "through torchao's float8 training with this recipe (pip install torchao). The embedding, output "
                "head, MTP's eh_proj, routers and routed experts (precision.fp8_recipe) stay in precision.dtype.")
    fp8_dense_bf16_edges: bool = doc(
        True, "With precision.fp8_dense: keep decoder layer 0 and the last decoder layer in precision.dtype (the "
              "layers most sensitive to quantization); false converts every layer.")


@dataclass
class CheckpointConfig:
    interval: int = doc(0, "Save every N steps; 0 saves only at the end.")
    resume: Optional[str] = doc(None, "null: start fresh; auto: latest under out_dir; or a checkpoint path.")
    keep_last: int = doc(0, "Keep only the last N checkpoints; 0 keeps all.")
    save_final: bool = doc(True, "Save a checkpoint at the end of training.")


@dataclass
class ProfileConfig:
    enabled: bool = doc(False, "Write a PyTorch profiler trace for a window of steps.")
    start_step: int = doc(3, "First profiled step.")
    end_step: int = doc(5, "Last profiled step.")
    dump_pp_data: bool = doc(
        False, "Pipeline runs: every rank writes the start and end of each micro-batch's forward, backward and "
        "weight-gradient step and its peak memory, for the steps start_step..end_step, to "
        "out_dir/pp_timeline/rank<r>.json (the planner's timeline format; `moetrain plan timeline` draws it).")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "profile": ProfileConfig,
}


# ---- value ranges ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key: an interval (a bound of None is unbounded).

    nan and inf are never valid; null is valid where the key's type allows it (``Optional``).
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # True: low itself is not valid
    high_open: bool = False

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


AT_LEAST_1 = Range(1)  # sizes and counts that must exist
AT_LEAST_0 = Range(0)  # counts that may be zero; coefficients and intervals where 0 disables
ABOVE_0 = Range(0, low_open=True)  # scales, epsilons, rates
FRACTION = Range(0, 1, high_open=True)  # [0, 1): Adam betas, held-out fractions

# Every int/float key of the schema and its valid values, checked first by Config.check (a test
# keeps this table complete). Relations between keys (topk <= num_experts, min_lr <= lr, ...)
# are checked after it.
VALUE_RANGES: dict[str, Range] = {
    "model.vocab_size": AT_LEAST_1,
    "model.hidden_size": AT_LEAST_1,
    "model.num_layers": AT_LEAST_1,
    "model.num_attention_heads": AT_LEAST_1,
    "model.num_query_groups": AT_LEAST_1,
    "model.head_dim": AT_LEAST_1,
    "model.ffn_hidden_size": AT_LEAST_1,
    "model.norm_eps": ABOVE_0,
    "model.q_lora_rank": AT_LEAST_1,
    "model.kv_lora_rank": AT_LEAST_1,
    "model.qk_nope_head_dim": AT_LEAST_1,
    "model.qk_rope_head_dim": AT_LEAST_1,
    "model.v_head_dim": AT_LEAST_1,
    "model.sliding_window": AT_LEAST_1,
    "model.sliding_window_every": AT_LEAST_1,
    "model.rope_theta": Range(1, low_open=True),  # theta^(-2i/D) must fall with i; YaRN divides by ln(theta)
    "model.rope_scaling_factor": Range(1),  # YaRN stretches the trained context, never shrinks it
    "model.rope_original_max_position": AT_LEAST_1,
    "model.yarn_beta_fast": ABOVE_0,  # YaRN takes ln(max_position / (2 pi beta))
    "model.yarn_beta_slow": ABOVE_0,
    "model.yarn_mscale": AT_LEAST_0,
    "model.yarn_mscale_all_dim": AT_LEAST_0,
    "model.mtp_num_layers": AT_LEAST_0,
    "model.mtp_loss_scale": AT_LEAST_0,
    "model.init_std": ABOVE_0,
    "moe.num_experts": AT_LEAST_0,
    "moe.moe_ffn_hidden_size": AT_LEAST_1,
    "moe.topk": AT_LEAST_1,
    "moe.num_shared_experts": AT_LEAST_0,
    "moe.shared_expert_ffn_hidden_size": AT_LEAST_0,
    "moe.first_k_dense": AT_LEAST_0,
    "moe.layer_freq": AT_LEAST_1,
    "moe.num_groups": AT_LEAST_1,
    "moe.topk_groups": AT_LEAST_1,
    "moe.scaling_factor": ABOVE_0,
    "moe.expert_bias_update_rate": AT_LEAST_0,
    "moe.aux_loss_coeff": AT_LEAST_0,
    "moe.z_loss_coeff": AT_LEAST_0,
    "moe.capacity_factor": ABOVE_0,
    "moe.dispatcher_capacity": ABOVE_0,
    "parallel.dp": AT_LEAST_1,
    "parallel.dp_replicate": AT_LEAST_1,
    "parallel.tp": AT_LEAST_1,
    "parallel.pp": AT_LEAST_1,
    "parallel.vpp": AT_LEAST_1,
    "parallel.cp": AT_LEAST_1,
    "parallel.ep": AT_LEAST_1,
    "parallel.etp": AT_LEAST_1,
    "parallel.gpus_per_node": AT_LEAST_1,
    "train.steps": AT_LEAST_1,
    "train.micro_batch_size": AT_LEAST_1,
    "train.global_batch_size": AT_LEAST_1,
    "train.seq_length": AT_LEAST_1,
    "train.seed": Range(0, 2**32, high_open=True),  # numpy's seed range (seed_everything)
    "train.log_interval": AT_LEAST_1,
    "train.eval_interval": AT_LEAST_0,
    "train.eval_steps": AT_LEAST_1,  # the eval loss is a mean over these micro-batches
    "train.manual_gc_interval": AT_LEAST_1,
    "train.max_skipped_steps": AT_LEAST_0,
    "train.dist_timeout_s": ABOVE_0,
    "optim.lr": ABOVE_0,
    "optim.min_lr": AT_LEAST_0,
    "optim.warmup_steps": AT_LEAST_0,
    "optim.decay_steps": AT_LEAST_1,
    "optim.weight_decay": AT_LEAST_0,
    "optim.beta1": FRACTION,
    "optim.beta2": FRACTION,
    "optim.eps": ABOVE_0,
    "optim.clip_grad": AT_LEAST_0,
    "data.eval_fraction": FRACTION,
    "checkpoint.interval": AT_LEAST_0,
    "checkpoint.keep_last": AT_LEAST_0,
    "profile.start_step": AT_LEAST_1,  # steps count from 1
    "profile.end_step": AT_LEAST_1,
}


@functools.cache
def _nullable(key: str) -> bool:
    section, name = key.split(".")
    return type(None) in typing.get_args(typing.get_type_hints(SECTIONS[section])[name])


def check_ranges(cfg: "Config") -> None:
    """ConfigError for the first value outside its range in VALUE_RANGES, e.g.
    ``optim.beta1 = 2.0: must be in [0, 1)``."""
    for key, valid in VALUE_RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None or valid.holds(value):  # null got past coerce() only where the type allows it
            continue
        finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
        null = " or null" if _nullable(key) else ""
        raise ConfigError(f"{key} = {value!r}: must be {finite}{valid}{null}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    # ---- derived quantities used across the code base -------------------------------

    @property
    def is_moe(self) -> bool:
        return self.moe.num_experts > 0

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` (0-based) uses MoE instead of a dense MLP."""
        m = self.moe
        if m.num_experts == 0 or layer_id < m.first_k_dense:
            return False
        return (layer_id - m.first_k_dense) % m.layer_freq == 0

    def fp8_dense_layers(self) -> list[int]:
        """Global block ids (decoder layer i = i, MTP depth d = num_layers + d) whose dense linears run in FP8
        (precision.fp8_dense): every block, less layers 0 and num_layers - 1 with fp8_dense_bf16_edges."""
        m, p = self.model, self.precision
        if p.fp8_dense == "none":
            return []
        edges = {0, m.num_layers - 1} if p.fp8_dense_bf16_edges else set()
        return [i for i in range(m.num_layers + m.mtp_num_layers) if i not in edges]

    def block_is_moe(self, block_id: int) -> bool:
        """Whether global block ``block_id`` (a decoder layer, or an MTP depth past num_layers) has an MoE MLP."""
        return self.is_moe if block_id >= self.model.num_layers else self.is_moe_layer(block_id)

    @property
    def kv_heads(self) -> int:
        m = self.model
        return m.num_query_groups or m.num_attention_heads

    @property
    def attn_head_dim(self) -> int:
        m = self.model
        return m.head_dim or m.hidden_size // m.num_attention_heads

    @property
    def shared_ffn_size(self) -> int:
        m = self.moe
        if m.shared_expert_ffn_hidden_size is not None:
            return m.shared_expert_ffn_hidden_size
        return m.num_shared_experts * m.moe_ffn_hidden_size

    @property
    def grad_accum_steps(self) -> int:
        t = self.train
        return t.global_batch_size // (t.micro_batch_size * self.parallel.dp)

    def to_dict(self) -> dict:
        out = {}
        for name in SECTIONS:
            section = getattr(self, name)
            out[name] = {f.name: getattr(section, f.name) for f in fields(section)}
        return out

    # ---- validation -------------------------------------------------------------------

    def check(self) -> None:
        """Raise ConfigError naming the keys involved when a value is out of range or values disagree: every
        value against its range first, then each section's relations (``SECTION_CHECKS``, in that order)."""
        from moetrain.config.relations import SECTION_CHECKS  # relations.py reads Config's fields: a cycle

        check_ranges(self)
        for check_section in SECTION_CHECKS:
            check_section(self)
