"""The relations between configuration keys that ``Config.check`` enforces after the value ranges: one function per
section, each raising ConfigError for the first relation broken. A relation between sections sits with the key its
message names first. checkpoint.* has value ranges only (``schema.VALUE_RANGES``).

Imports no torch.
"""

from __future__ import annotations

from moetrain.config.pipeline_layout import check_schedule, layout_stages
from moetrain.config.schema import FP8_BUILT, FP8_FUSED, Config, MoEConfig
from moetrain.errors import ConfigError


def check_model(cfg: Config) -> None:
    """Attention head sizes (divisibility, RoPE's even dimension) and YaRN's betas."""
    m = cfg.model
    if m.attention_type == "gqa":
        kv = cfg.kv_heads
        if m.num_attention_heads % kv:
            raise ConfigError(
                f"model.num_attention_heads = {m.num_attention_heads} is not divisible by "
                f"model.num_query_groups = {kv}")
        if m.head_dim is None and m.hidden_size % m.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size = {m.hidden_size} is not divisible by model.num_attention_heads = "
                f"{m.num_attention_heads}; set model.head_dim explicitly")
        if cfg.attn_head_dim % 2:
            what = (f"model.head_dim = {m.head_dim}" if m.head_dim is not None else
                    f"model.hidden_size / model.num_attention_heads = {cfg.attn_head_dim} (the head dim)")
            raise ConfigError(f"{what}: RoPE needs an even dimension")
    else:
        if m.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim = {m.qk_rope_head_dim}: RoPE needs an even dimension")
    if m.rope_scaling == "yarn" and m.yarn_beta_fast < m.yarn_beta_slow:
        raise ConfigError(
            f"model.yarn_beta_fast = {m.yarn_beta_fast} must be >= model.yarn_beta_slow = {m.yarn_beta_slow} "
            "(YaRN's high- and low-frequency boundaries, in rotations)")


def check_moe(cfg: Config) -> None:
    """Top-k and expert groups against the expert count, experts against parallel.ep, at least one MoE layer."""
    e, m = cfg.moe, cfg.model
    if e.num_experts == 0:
        return
    if e.topk > e.num_experts:
        raise ConfigError(
            f"moe.topk = {e.topk} must be between 1 and moe.num_experts = {e.num_experts}")
    if (e.num_groups is None) != (e.topk_groups is None):
        raise ConfigError("moe.num_groups and moe.topk_groups must be set together (or both null)")
    if e.num_groups is not None:
        _check_expert_groups(e)
    if e.num_experts % cfg.parallel.ep:
        raise ConfigError(
            f"moe.num_experts = {e.num_experts} is not divisible by parallel.ep = {cfg.parallel.ep}")
    if e.first_k_dense >= m.num_layers:
        raise ConfigError(
            f"moe.first_k_dense = {e.first_k_dense} leaves no MoE layer among model.num_layers = "
            f"{m.num_layers}; set moe.num_experts = 0 for a dense model")


def _check_expert_groups(e: MoEConfig) -> None:
    if e.num_experts % e.num_groups:
        raise ConfigError(
            f"moe.num_groups = {e.num_groups} does not divide moe.num_experts = {e.num_experts}")
    if e.topk_groups > e.num_groups:
        raise ConfigError(
            f"moe.topk_groups = {e.topk_groups} must be between 1 and moe.num_groups = {e.num_groups}")
    per_group = e.num_experts // e.num_groups
    if e.topk > e.topk_groups * per_group:
        raise ConfigError(
            f"moe.topk = {e.topk} exceeds the experts reachable in moe.topk_groups = {e.topk_groups} "
            f"groups of {per_group}")
    if e.group_score == "top2_sum" and per_group < 2:
        raise ConfigError(
            "moe.group_score = top2_sum needs at least 2 experts per group "
            f"(moe.num_experts / moe.num_groups = {per_group})")


def check_parallel(cfg: Config) -> None:
    """Degrees that must divide one another, the heads (tp), the layers (pp x vpp) and the sequence (cp)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.dp % p.dp_replicate:
        raise ConfigError(f"parallel.dp_replicate = {p.dp_replicate} does not divide parallel.dp = {p.dp} "
                          "(FSDP shards over dp / dp_replicate ranks)")
    if (p.dp_shard * p.cp * p.tp) % (p.ep * p.etp):
        raise ConfigError(
            f"parallel.ep ({p.ep}) x parallel.etp ({p.etp}) must divide the sharded data-parallel ranks "
            f"parallel.dp / parallel.dp_replicate ({p.dp_shard}) x parallel.cp ({p.cp}) x parallel.tp ({p.tp}): "
            "expert parallelism folds over them")
    if (p.dp * p.cp * p.tp) % (p.ep * p.etp):
        raise ConfigError(
            f"parallel.ep ({p.ep}) x parallel.etp ({p.etp}) must divide parallel.dp ({p.dp}) x "
            f"parallel.cp ({p.cp}) x parallel.tp ({p.tp})")
    if p.ep % p.tp and p.tp % p.ep:
        raise ConfigError(f"parallel.tp = {p.tp} and parallel.ep = {p.ep}: one must divide the other (expert "
                          "parallelism folds over the tensor-parallel ranks)")
    check_tensor_parallel(cfg, p.tp)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1")
    check_schedule(p.pp_schedule, p.pp, p.vpp, t.global_batch_size // max(1, t.micro_batch_size * p.dp))
    if p.pp > 1 and p.pp_schedule in ("zero_bubble", "dualpipev") and t.compile:
        raise ConfigError(f"parallel.pp_schedule = {p.pp_schedule} splits each backward into input and weight "
                          "gradients, which torch.compile'd stages do not support; set train.compile=false or "
                          "parallel.pp_schedule=1f1b / interleaved")
    if p.pipeline_layout is not None:
        layout_stages(p.pipeline_layout, num_layers=m.num_layers, mtp_num_layers=m.mtp_num_layers,
                      pp=p.pp, vpp=p.vpp)
    elif m.num_layers % (p.pp * p.vpp):
        raise ConfigError(
            f"model.num_layers = {m.num_layers} is not divisible by parallel.pp ({p.pp}) x parallel.vpp "
            f"({p.vpp}); set parallel.pipeline_layout for uneven stages")
    if t.seq_length % p.cp:
        raise ConfigError(f"train.seq_length = {t.seq_length} is not divisible by parallel.cp = {p.cp}")
    if p.tp > 1 and (p.sequence_parallel or cfg.is_moe) and t.seq_length % p.tp:
        why = "sequence parallelism shards" if p.sequence_parallel else "the MoE layers split"
        raise ConfigError(f"train.seq_length = {t.seq_length} is not divisible by parallel.tp = {p.tp}: {why} each "
                          "sequence over the tensor-parallel ranks")
    if p.tp > 1 and t.compile:
        raise ConfigError("train.compile with parallel.tp > 1 is not supported yet (compiled tensor-parallel blocks "
                          "gave other gradients than eager ones: TP2 + SP on the tiny preset, gloo); set "
                          "train.compile=false")
    if cfg.moe.overlap_a2a and p.tp > 1:
        raise ConfigError("moe.overlap_a2a runs two micro-batches' work at once; with parallel.tp > 1 both would "
                          "issue tensor-parallel collectives on one group: set parallel.tp=1 or moe.overlap_a2a=false")
    if cfg.moe.overlap_a2a and (p.pp_schedule != "dualpipev" or p.pp == 1 or p.ep == 1):
        raise ConfigError(
            f"moe.overlap_a2a overlaps the expert all-to-all of one micro-batch with another's compute inside "
            f"DualPipe-V's steady state: it needs parallel.pp > 1, parallel.pp_schedule=dualpipev and parallel.ep > 1 "
            f"(now pp={p.pp}, pp_schedule={p.pp_schedule}, ep={p.ep})")


def check_tensor_parallel(cfg: Config, tp: int) -> None:
    """What tensor parallelism over tp ranks splits must divide by tp (distributed.tensor_parallel): the query heads,
    the GQA key/value heads, the vocab (embedding and head), the dense MLPs' and shared experts' intermediate sizes.
    The hidden size is never split. precision.fp8_dense's float8 linears have no tensor-parallel plan."""
    if tp == 1:
        return
    m = cfg.model
    sizes = {"model.num_attention_heads": m.num_attention_heads}
    if m.attention_type != "mla":
        sizes["model.num_query_groups (key/value heads)"] = cfg.kv_heads
    sizes["model.vocab_size"] = m.vocab_size
    if any(not cfg.is_moe_layer(i) for i in range(m.num_layers)):
        sizes["model.ffn_hidden_size"] = m.ffn_hidden_size
    if cfg.is_moe and cfg.shared_ffn_size:
        key = ("moe.shared_expert_ffn_hidden_size" if cfg.moe.shared_expert_ffn_hidden_size is not None
               else "moe.num_shared_experts x moe.moe_ffn_hidden_size (the shared experts' size)")
        sizes[key] = cfg.shared_ffn_size
    for key, size in sizes.items():
        if size % tp:
            raise ConfigError(f"{key} = {size} is not divisible by parallel.tp = {tp}: tensor parallelism splits it "
                              f"over the tp ranks; use a parallel.tp that divides it")
    if cfg.precision.fp8_dense != "none":
        raise ConfigError(f"precision.fp8_dense = {cfg.precision.fp8_dense} does not combine with parallel.tp = {tp} "
                          "(the float8 linears have no tensor-parallel plan); set precision.fp8_dense=none or "
                          "parallel.tp=1")


def check_train(cfg: Config) -> None:
    """The global batch in whole micro-batches per data-parallel rank, recompute layer ids, and what
    train.cuda_graph cannot combine with."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by train.micro_batch_size "
            f"({t.micro_batch_size}) x parallel.dp ({p.dp}) = {per_step}")
    if t.recompute_layer_ids is not None:
        total = m.num_layers + m.mtp_num_layers
        bad = [i for i in t.recompute_layer_ids if not 0 <= i < total]
        if bad:
            raise ConfigError(
                f"train.recompute_layer_ids has {bad}: valid ids are 0..{total - 1} "
                f"(decoder layers then MTP depths)")
    if t.cuda_graph:
        _check_cuda_graph(cfg)


def _check_cuda_graph(cfg: Config) -> None:
    t, o, precision = cfg.train, cfg.optim, cfg.precision
    clash = [what for what, on in (
        (f"train.recompute={t.recompute}", t.recompute != "none"),
        ("train.recompute_layer_ids", bool(t.recompute_layer_ids)),
        ("train.compile", t.compile),
        ("moe.backend=reference", cfg.is_moe and cfg.moe.backend == "reference"),
    ) if on]
    if clash:
        raise ConfigError(
            f"train.cuda_graph does not combine with {', '.join(clash)} (recompute re-runs the forward inside "
            "the backward, compile has its own graphs, the reference expert loop reads expert counts on the "
            "host); turn one of them off")
    # the captured update is torch's fused AdamW (updated tensor, gradient and both moments in one dtype), or with
    # optim.triton_kernel the Triton AdamW kernel for any state (without triton on the device, refused when the
    # graph is built: graphed_step.GraphedStep knows the device)
    if o.triton_kernel:
        return
    target = "fp32" if precision.master_weights and precision.dtype != "fp32" else precision.dtype
    state = {"optim.main_grads_dtype": o.main_grads_dtype, "optim.exp_avg_dtype": o.exp_avg_dtype,
             "optim.exp_avg_sq_dtype": o.exp_avg_sq_dtype}
    odd = [f"{k}={v}" for k, v in state.items() if v != target]
    if odd:
        raise ConfigError(
            f"train.cuda_graph captures the optimizer step, which needs the weights it updates ({target}: "
            f"precision.dtype={precision.dtype}, master_weights={precision.master_weights}), their "
            f"gradients and both Adam moments in one dtype; {', '.join(odd)} differ: set them to {target}, "
            "set optim.triton_kernel=true, or train.cuda_graph=false")


def check_precision(cfg: Config) -> None:
    """FP8 recipes that have kernels; the per-row recipes' GEMM (torch._scaled_grouped_mm) needs 16-byte strides,
    mxfp8's GEMMs reductions in whole 1x32 scale tiles (each expert size is the reduction of one of them);
    precision.fp8_dense's linears (``_check_fp8_dense``)."""
    r = cfg.precision.fp8_recipe
    if r not in FP8_BUILT:
        raise ConfigError(f"precision.fp8_recipe = {r} is not built yet; valid now: {', '.join(FP8_BUILT)}")
    sizes = {"model.hidden_size": cfg.model.hidden_size, "moe.moe_ffn_hidden_size": cfg.moe.moe_ffn_hidden_size}
    if r in FP8_FUSED:
        odd = [f"{k} = {v}" for k, v in sizes.items() if v % 16]
        if odd:
            raise ConfigError(f"precision.fp8_recipe = {r} needs the experts' sizes to be multiples of 16 (its FP8 "
                              f"GEMM's 16-byte strides); {', '.join(odd)} is not: use blockwise or resize")
    if r == "mxfp8":
        odd = [f"{k} = {v}" for k, v in sizes.items() if v % 32]
        if odd:
            raise ConfigError(f"precision.fp8_recipe = mxfp8 needs the experts' sizes to be multiples of 32 (its "
                              f"scales cover 1x32 tiles of each GEMM's reduction); {', '.join(odd)} "
                              f"{'is' if len(odd) == 1 else 'are'} not: use blockwise or resize")
    if cfg.precision.fp8_dense != "none":
        _check_fp8_dense(cfg)


def _check_fp8_dense(cfg: Config) -> None:
    """Some linear to convert, and each converted linear's sizes (and the tokens its weight gradient reduces over)
    multiples of 16, as torch._scaled_mm needs."""
    r, m = cfg.precision.fp8_dense, cfg.model
    if not cfg.fp8_dense_layers():
        raise ConfigError(f"precision.fp8_dense = {r} converts nothing: precision.fp8_dense_bf16_edges keeps every "
                          f"layer of model.num_layers = {m.num_layers} in bf16; set it to false")
    odd = [f"{k} = {v}" for k, v in _fp8_dense_sizes(cfg).items() if v % 16]
    if odd:
        raise ConfigError(f"precision.fp8_dense = {r} needs the converted linears' sizes to be multiples of 16 "
                          f"(torch._scaled_mm); {', '.join(odd)} is not: resize, or set precision.fp8_dense=none")


def _fp8_dense_sizes(cfg: Config) -> dict[str, int]:
    """The in/out sizes of the linears precision.fp8_dense converts, each named by the keys it comes from."""
    m, t, ids = cfg.model, cfg.train, cfg.fp8_dense_layers()
    nh = "model.num_attention_heads"
    sizes = {"model.hidden_size": m.hidden_size,
             "train.micro_batch_size x train.seq_length (tokens)": t.micro_batch_size * t.seq_length}
    if m.attention_type == "mla":
        if m.q_lora_rank:
            sizes["model.q_lora_rank"] = m.q_lora_rank
        sizes[f"{nh} x (model.qk_nope_head_dim + model.qk_rope_head_dim)"] = (
            m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim))
        sizes["model.kv_lora_rank"] = m.kv_lora_rank
        sizes["model.kv_lora_rank + model.qk_rope_head_dim"] = m.kv_lora_rank + m.qk_rope_head_dim
        sizes[f"{nh} x (model.qk_nope_head_dim + model.v_head_dim)"] = (
            m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim))
        sizes[f"{nh} x model.v_head_dim"] = m.num_attention_heads * m.v_head_dim
    else:
        sizes[f"{nh} x head dim"] = m.num_attention_heads * cfg.attn_head_dim
        sizes["key/value heads x head dim"] = cfg.kv_heads * cfg.attn_head_dim
    if any(not cfg.block_is_moe(i) for i in ids):
        sizes["model.ffn_hidden_size"] = m.ffn_hidden_size
    if cfg.shared_ffn_size and any(cfg.block_is_moe(i) for i in ids):
        sizes["shared expert size (moe.shared_expert_ffn_hidden_size)"] = cfg.shared_ffn_size
    return sizes


def check_optim(cfg: Config) -> None:
    """The decayed learning rate's floor below its peak; the retired ZeRO-1 switch off."""
    o = cfg.optim
    if o.distributed:
        raise ConfigError("optim.distributed (ZeRO-1) is retired: with more than one rank FSDP2 shards the optimizer "
                          "state, gradients and parameters anyway; remove the key")
    if o.min_lr is not None and o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr = {o.min_lr} is larger than optim.lr = {o.lr}")


def check_data(cfg: Config) -> None:
    """A token dataset names its directory."""
    if cfg.data.source == "tokens" and not cfg.data.path:
        raise ConfigError("data.source = tokens needs data.path (a directory from `moetrain data prepare`)")


def check_profile(cfg: Config) -> None:
    """The profiled steps in order."""
    pr = cfg.profile
    if pr.enabled and pr.end_step < pr.start_step:
        raise ConfigError(
            f"profile.end_step = {pr.end_step} is before profile.start_step = {pr.start_step}")


# Config.check runs these in this order (the sections' order) after the value ranges.
SECTION_CHECKS = (check_model, check_moe, check_parallel, check_train, check_optim, check_precision, check_data,
                  check_profile)
