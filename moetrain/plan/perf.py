"""Step-time projection: per-stage compute (costs.py roofline or --measure), communication
(comm.py), the pipeline schedule (simulator.py, torch's order), data-parallel gradient reduction and the
optimizer step.

Per stage: forward F, input-gradient backward B and weight-gradient backward W are the sums
over its contents (embedding, blocks with their recompute mode, MTP depths, head + loss) plus
per block: TP collectives (sequence parallel: all-gather + reduce-scatter around attention and
MLP; otherwise all-reduce; forward and backward), EP all-to-all (dispatch + combine, forward
and backward), CP ring exchange of K/V (overlapped with attention; only the excess counts).
The main-grad hooks add (param bytes + 2 x grad bytes) per parameter per micro-batch to W.

step = pipeline makespan (simulator, p2p per boundary) + exposed DP communication
       ((1 - dp_overlap) x the data-parallel traffic: with more than one rank FSDP2's (``plan.fsdp``:
       parameter all-gathers in forward and backward per micro-batch, one gradient reduce-scatter), else
       nothing) + optimizer step (memory traffic of grad-norm, clipping, AdamW and
       master->param copy at the copy bandwidth; our Triton kernels (optim.triton_kernel, the default) at
       TRITON_ADAMW of it, floored by hardware.measured.triton_adamw_gelem_per_s; torch's fused multi-tensor
       AdamW at FUSED_ADAMW, floored by hardware.measured.fused_adamw_gelem_per_s) + zero_grad.

Outputs: step_time_s, tokens_per_s_per_gpu, tflops_per_gpu (accounting.train_flops_per_token,
the trainer's numerator), mfu (over the hardware's dense peak for precision.dtype),
bubble_fraction (of the peak rank), host_bound_fraction (the share of the step in which the modelled
GPU waits on eager kernel launches: such time scales with the host CPU, which the hardware profile
does not describe), per_rank.
Pure Python (``--measure`` imports torch in measure.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetrain.config.schema import Config
from moetrain.distributed.layout import RankLayout
from moetrain.models import accounting as acc
from moetrain.plan import comm, fsdp
from moetrain.plan.activations import expert_rows, resolve_dims
from moetrain.plan.costs import BlockCost, Cost, Roofline, block_cost, embedding_cost, head_cost, mtp_extra_cost
from moetrain.plan.layout import parse_layout
from moetrain.plan.memory import DTYPE_BYTES, block_mode, stage_params, StageParams, _window
from moetrain.plan.simulator import simulate

FUSED_ADAMW = 0.75  # fraction of the copy bandwidth the fused AdamW kernel streams at (H200 fit)
# Our Triton norm + AdamW kernels (kernels/adamw.py), `moetrain bench optim --params 2e9` on the H200: 0.93 of the
# copy bandwidth (fp32 master, 34 B/param: 17.1 ms); bf16 state (16 B/param) is bound by the update's element rate
# instead (8.8 ms for 2e9: hardware.measured.triton_adamw_gelem_per_s, 227)
TRITON_ADAMW = 0.93
STEP_OVERHEAD_S = 1.4e-3  # per step: host sync for metrics, loss bookkeeping; the median of (trainer - script step) on
# the GPU-bound calibration configs with the trainer reading data ahead (+2.2, -2.5, +1.4 ms;
# with clip inside the fused AdamW: +1.0, -2.5, -0.5 ms, kept at 1.4: see VALIDATION.md)
# train.cuda_graph: the same per-step host time with forward, backward and the update replayed from graphs (the host
# then does metrics, zero_grad, the input copies and the replays): fitted to the calibration configs cal-tiny-graph
# and cal-qwen3-2l-graph (validate_configs.CALIBRATION_CONFIGS)
STEP_OVERHEAD_GRAPH_S = 0.9e-3  # cal-tiny-graph 0.83, cal-qwen3-2l-graph 1.02 ms (measured mode)
TENSORS_PER_BLOCK = 11  # parameter tensors per block (hooks, zero_grad, explicit AdamW launch per tensor)


@dataclass
class StageTime:
    f: float
    b: float
    w: float
    comm: float  # communication inside f + b + w (reported)
    parts: dict[str, float] = field(default_factory=dict)
    host_excess: float = 0.0  # of f + b + w: time the GPU waits on the host's kernel launches (roofline phases)


@dataclass
class PerfReport:
    step_time_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    per_rank: list[dict]
    breakdown: dict[str, float]
    timeline: object = None
    mode: str = "roofline"
    host_bound_fraction: float = 0.0  # of the step: the GPU waiting on kernel launches (roofline-modelled parts)

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "bubble_fraction": self.bubble_fraction,
                "host_bound_fraction": self.host_bound_fraction,
                "compute_mode": self.mode, "breakdown_s": self.breakdown, "per_rank": self.per_rank}


def _phase(c: Cost, launch: float) -> float:
    return c.time(launch)


def captured_launch_s(cfg: Config, hw) -> float:
    """Host seconds per kernel launch of the phases train.cuda_graph replays (forward, backward, the update):
    none when graphed, else the hardware's eager launch cost."""
    return 0.0 if cfg.train.cuda_graph else hw.launch_overhead_us * 1e-6


def stage_times(cfg: Config, hw, d, rf: Roofline, layout, measured: dict | None, dp_extra: dict,
                measured_hooks: bool = False) -> list[StageTime]:
    p, m = cfg.parallel, cfg.model
    ranks = RankLayout.from_config(p)  # the trainer's rank order: group strides
    launch = captured_launch_s(cfg, hw)  # forward + backward, hooks included, are one graph when graphed
    b_p, b_g = DTYPE_BYTES[cfg.precision.dtype], DTYPE_BYTES[cfg.optim.main_grads_dtype]
    hook = cfg.optim.main_grads_dtype != cfg.precision.dtype

    def hook_cost(n_params: float, n_tensors: int) -> tuple[float, int]:
        """(GPU seconds, kernels) of the main-grad hooks over n_params in n_tensors: read the gradient, read and
        write the main grad (none without separate main grads)."""
        if not (hook and n_params):
            return 0.0, 0
        return (b_p + 2 * b_g) * n_params / hw.mem_bw, 3 * n_tensors

    H = m.hidden_size
    tp_link = comm.group_link(hw, p.tp, ranks.stride("tp"))
    tp_bytes = d.b * d.T * H  # one [T, H] activation
    out = []
    for st in layout.stages:
        f = b = w = cm = excess = 0.0
        parts: dict[str, float] = {}

        def add(name: str, bc: BlockCost, n_params: float = 0.0, n_tensors: int = TENSORS_PER_BLOCK) -> None:
            """Forward, and one backward (input + weight gradients + the main-grad hooks of n_params): the host
            runs ahead through the whole backward, so it takes max(GPU time, its kernels' launches), split
            between B and W by GPU time."""
            nonlocal f, b, w, excess
            hook_s, hook_kernels = hook_cost(n_params, n_tensors)
            gpu_b, gpu_w = bc.bwd_input.gpu, bc.bwd_weight.gpu + hook_s
            t_bwd = max(gpu_b + gpu_w, (bc.bwd_input.kernels + bc.bwd_weight.kernels + hook_kernels) * launch)
            share_w = gpu_w / (gpu_b + gpu_w) if gpu_b + gpu_w > 0 else 0.0
            tf, tb, tw = _phase(bc.fwd, launch), t_bwd * (1 - share_w), t_bwd * share_w
            f, b, w = f + tf, b + tb, w + tw
            excess += (tf - bc.fwd.gpu) + (t_bwd - gpu_b - gpu_w)
            parts[name] = parts.get(name, 0.0) + tf + tb + tw

        def add_measured(name: str, times: tuple[float, float], bc: BlockCost, n_params: float,
                         n_tensors: int) -> None:
            """Forward and backward seconds measured on a GPU (``plan perf --measure``), the backward split
            into B and W as the model splits it, plus the main-grad hooks where the measurement did not run
            them (``measured_hooks``: it did)."""
            nonlocal f, b, w
            mf, mb = times
            model_b = _phase(bc.bwd_input, launch) + _phase(bc.bwd_weight, launch)
            share = _phase(bc.bwd_weight, launch) / model_b if model_b else 0.0
            f += mf / p.tp
            b += mb * (1 - share) / p.tp
            w += mb * share / p.tp
            parts[name] = parts.get(name, 0.0) + (mf + mb) / p.tp
            if not measured_hooks:
                hook_s, hook_kernels = hook_cost(n_params, n_tensors)
                w += hook_s + hook_kernels * launch

        if st.has_embedding:
            add("embedding", embedding_cost(cfg, d, rf))
        blocks = [(i, cfg.is_moe_layer(i), _window(cfg, i)) for i in st.layers]
        fp8_blocks = set(cfg.fp8_dense_layers())
        blocks += [(m.num_layers + dep, cfg.is_moe, None) for dep in st.mtp]
        for gid, moe, win in blocks:
            mode = block_mode(cfg, gid)
            bc = block_cost(cfg, d, rf, moe, win, mode, ep=p.ep, fp8_dense=gid in fp8_blocks)
            kind = "moe" if moe else "dense"
            if measured and kind in measured:
                add_measured(kind, measured[kind], bc, dp_extra["block_params"].get(gid, 0.0), TENSORS_PER_BLOCK)
            else:
                add(kind, bc, dp_extra["block_params"].get(gid, 0.0))
            # TP: 2 collectives per block forward and backward
            if p.tp > 1:
                one = comm.all_gather(tp_bytes, p.tp, tp_link) * 2 if p.sequence_parallel else \
                    comm.all_reduce(tp_bytes, p.tp, tp_link)
                f += 2 * one
                b += 2 * one
                cm += 4 * one
            if moe and p.ep > 1:
                a2a = ep_all_to_all(cfg, d, hw, ranks)
                f += 2 * a2a
                b += 2 * a2a
                cm += 4 * a2a
            if p.cp > 1:
                kv_bytes = 2 * d.b * d.T * max(cfg.kv_heads / p.tp, 1) * cfg.attn_head_dim
                ring = (p.cp - 1) * comm.p2p(kv_bytes, comm.group_link(hw, p.cp, ranks.stride("cp")))
                attn = bc.fwd.parts.get("attention", 0.0)
                f += max(ring - attn, 0.0)
                b += 2 * max(ring - attn, 0.0)
                cm += 3 * ring
        # the embedding, head, final norms and MTP projections outside the blocks have main-grad hooks too
        sp = stage_params(cfg, st)
        n_other = sp.total - sum(sp.by_block.values())
        for _ in st.mtp:
            add("mtp head", mtp_extra_cost(cfg, d, rf))
        if st.has_loss and measured and "head" in measured:  # final norm + logits + cross-entropy timed on a GPU
            add_measured("head+loss", measured["head"], head_cost(cfg, d, rf), n_other, 3)
        elif st.has_loss:
            add("head+loss", head_cost(cfg, d, rf), n_other, 3)
        else:  # a stage without the loss: the hooks' GPU time (their few launches are not charged)
            w += hook_cost(n_other, 0)[0]
        out.append(StageTime(f, b, w, cm, parts, excess))
    return out


def optimizer_time(cfg: Config, hw, n_local: float, n_tensors: int) -> dict[str, float]:
    """Seconds of zero_grad, grad norm + clipping, AdamW and the master->param copy (optim.py)."""
    o = cfg.optim
    b_p, b_g = DTYPE_BYTES[cfg.precision.dtype], DTYPE_BYTES[o.main_grads_dtype]
    b_m, b_v = DTYPE_BYTES[o.exp_avg_dtype], DTYPE_BYTES[o.exp_avg_sq_dtype]
    master = cfg.precision.master_weights and b_p != 4
    b_t = 4 if master else b_p
    bw = hw.mem_bw
    eager_launch = hw.launch_overhead_us * 1e-6
    launch = captured_launch_s(cfg, hw)  # norm, clip, AdamW and the master copy (zero_grad stays eager)
    separate = o.main_grads_dtype != cfg.precision.dtype
    # each part: GPU time or host launch time, whichever is longer (the host runs ahead)
    # zero_grad drops param.grad (host only) and zeroes separate main grads with one multi-tensor op
    fused = b_t == b_g == b_m == b_v
    # the norm reads the gradients; on the fused path the clip is the AdamW kernel's grad_scale (optim.step_on_device),
    # on the explicit path a scaling pass reads and writes them again
    zero_grad = max(b_g * n_local / bw, 3 * eager_launch) if separate else 0.0
    if o.triton_kernel:  # one norm pass, then one update pass (clip as its grad_scale, the master copy written)
        update = b_g + 2 * b_t + 2 * b_m + 2 * b_v + (b_p if master else 0)
        rate = hw.measured.get("triton_adamw_gelem_per_s", 227.0 * hw.hbm_tbps / 4.8) * 1e9
        return {"zero_grad": zero_grad, "grad_norm_clip": max(b_g * n_local / (bw * TRITON_ADAMW), 3 * launch),
                "adamw": max(update * n_local / (bw * TRITON_ADAMW), n_local / rate, launch), "master_copy": 0.0}
    out = {"zero_grad": zero_grad,
           "grad_norm_clip": max((1 if fused else 3) * b_g * n_local / bw, (8 if fused else 3) * launch)}
    if fused:
        stream = (2 * b_t + b_g + 2 * b_m + 2 * b_v) * n_local / (bw * FUSED_ADAMW)
        floor = n_local / (hw.measured.get("fused_adamw_gelem_per_s", 147.0 * hw.hbm_tbps / 4.8) * 1e9)
        out["adamw"] = max(stream, floor, 4 * launch)
    else:
        up = lambda x: (x + 4) if x != 4 else 0  # noqa: E731  an fp32 copy of a 16-bit tensor
        # copies in, lerp, mul, addcmul, decay, v/bias, sqrt, add, addcdiv, copies back
        nbytes = up(b_g) + up(b_m) + up(b_v) + up(b_t) + 12 + 8 + 16 + 8 + 8 + 8 + 8 + 16 + up(b_m) + up(b_v) + up(b_t)
        out["adamw"] = max(nbytes * n_local / bw, 15 * n_tensors * launch)
    out["master_copy"] = max((4 + b_p) * n_local / bw, 3 * launch) if master else 0.0  # one multi-tensor copy
    return out


def ep_all_to_all(cfg: Config, d, hw, ranks: RankLayout) -> float:
    """One expert-parallel all-to-all (dispatch or combine, either direction): T x K rows of H (the slowest rank's
    share scaled by the imbalance), or the sync-free dispatcher's fixed ep x C rows (equal splits)."""
    p, H = cfg.parallel, cfg.model.hidden_size
    if cfg.moe.dispatcher == "sync_free":
        rows = expert_rows(cfg, d)
        return comm.all_to_all(d.b * rows * H, p.ep, ranks.stride("ep"), hw)
    return comm.all_to_all(d.b * d.Tr * cfg.moe.topk * H, p.ep, ranks.stride("ep"), hw, d.moe_imbalance)


def rank_tail(cfg: Config, hw, dense: float, expert: float, n_blocks: int, dp_overlap: float
              ) -> tuple[float, float, dict[str, float], float]:
    """What a pipeline rank holding ``dense`` and ``expert`` local parameters in ``n_blocks`` blocks adds after its
    pipeline work: (data-parallel communication seconds, the exposed part, the optimizer's parts, the whole tail =
    exposed + optimizer + the per-step overhead)."""
    p = cfg.parallel
    g, n_opt = 0.0, dense + expert  # one rank: nothing to reduce
    if fsdp.applies(cfg):
        ranks = RankLayout.from_config(p)
        sd, se = fsdp.shard_degrees(cfg)
        links = (comm.group_link(hw, sd, ranks.stride("cp")), comm.group_link(hw, se, ranks.stride("efsdp")),
                 comm.group_link(hw, p.dp_replicate, ranks.stride("dp_replicate")))
        g = fsdp.comm_seconds(cfg, comm, hw, dense, expert, cfg.grad_accum_steps, links)
        n_opt = dense / sd + expert / se
    exposed = (1.0 - dp_overlap) * g
    opt = optimizer_time(cfg, hw, n_opt, TENSORS_PER_BLOCK * max(n_blocks, 1) + 3)
    overhead = STEP_OVERHEAD_GRAPH_S if cfg.train.cuda_graph else STEP_OVERHEAD_S
    return g, exposed, opt, exposed + sum(opt.values()) + overhead


def project_perf(cfg: Config, hw, *, attention: str = "auto", moe_imbalance: float = 1.0, dp_overlap: float = 0.5,
                 measured: dict | None = None, measured_hooks: bool = False) -> PerfReport:
    p, t = cfg.parallel, cfg.train
    ranks = RankLayout.from_config(p)
    layout = parse_layout(cfg)
    d = resolve_dims(cfg, attention, moe_imbalance, "cuda")
    rf = Roofline(hw, cfg.precision.dtype)
    m_mb = cfg.grad_accum_steps
    ranks_params: list[StageParams] = []
    block_params: dict[int, float] = {}
    for r in range(layout.pp):
        sp = StageParams()
        for st in layout.stages_of_rank(r):
            sp.add(stage_params(cfg, st))
        ranks_params.append(sp)
        block_params.update(sp.by_block)
    stimes = stage_times(cfg, hw, d, rf, layout, measured, {"block_params": block_params}, measured_hooks)

    # pipeline
    p2p_s = comm.p2p(d.b * d.Th * cfg.model.hidden_size, comm.group_link(hw, 2, ranks.stride("pp"))) \
        if layout.pp > 1 else 0.0
    schedule = p.pp_schedule if layout.pp > 1 else "1f1b"
    tl = simulate(schedule, layout.pp, layout.vpp, m_mb, [s.f for s in stimes], [s.b for s in stimes],
                  [s.w for s in stimes], p2p_s)
    makespan = tl.step_time
    busy = [tl.busy(r) for r in range(layout.pp)]
    bubbles = [tl.bubble_fraction(r) for r in range(layout.pp)]

    # data parallel + optimizer, per pipeline rank
    per_rank, tails = [], []
    for r, sp in enumerate(ranks_params):
        g, exposed, opt, tail = rank_tail(cfg, hw, sp.dense, sp.expert, len(sp.by_block), dp_overlap)
        tails.append(tail)
        stg = layout.stages_of_rank(r)
        per_rank.append({
            "pp_rank": r, "stages": [s.describe() for s in stg], "compute_s": busy[r],
            "bubble_fraction": bubbles[r], "comm_in_pipeline_s": sum(stimes[s.index].comm for s in stg) * m_mb,
            "dp_comm_s": g, "dp_comm_exposed_s": exposed, "optimizer_s": sum(opt.values()),
            "stage_times_s": [{"stage": s.index, "fwd": stimes[s.index].f, "bwd": stimes[s.index].b,
                               "wgrad": stimes[s.index].w} for s in stg]})
    step = makespan + max(tails)
    world = p.world_size
    tokens = t.global_batch_size * t.seq_length
    flops = acc.train_flops_per_token(cfg, t.seq_length) * tokens
    tflops = flops / step / world / 1e12
    peak = hw.peak(cfg.precision.dtype)
    worst = max(range(len(bubbles)), key=lambda i: bubbles[i])
    breakdown = {"pipeline_makespan": makespan, "tail_max": max(tails)}
    stage_parts: dict[str, float] = {}
    for s in stimes:
        for k, v in s.parts.items():
            stage_parts[k] = stage_parts.get(k, 0.0) + v * m_mb
    breakdown.update({f"compute:{k}": v for k, v in stage_parts.items()})
    # launch-bound time on the busiest rank (per step): a host-speed-dependent share of the projection
    host_excess = max(sum(stimes[s.index].host_excess for s in layout.stages_of_rank(r)) * m_mb
                      for r in range(layout.pp))
    breakdown["host_launch_wait"] = host_excess
    return PerfReport(step_time_s=step, tokens_per_s_per_gpu=tokens / step / world, tflops_per_gpu=tflops,
                      mfu=tflops / peak, bubble_fraction=bubbles[worst], per_rank=per_rank, breakdown=breakdown,
                      timeline=tl, mode="measured" if measured else "roofline",
                      host_bound_fraction=min(max(host_excess / step, 0.0), 1.0) if step > 0 else 0.0)


def timeline_of(cfg: Config, rep: PerfReport):
    """The simulated pipeline timeline of a projection (JSON via ``.to_json()``)."""
    return rep.timeline
