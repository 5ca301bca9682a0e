"""Per-block compute cost: a roofline over the kernels our modules launch, no GPU needed.

Legend as in activations.py (T tokens, H hidden, M routed rows, E experts, I expert
intermediate, b activation bytes, V vocab). Each op is (flops, bytes, kind):

* gemm: time = max(flops / (peak * efficiency(M, N, K)), bytes / bandwidth) + a kernel floor;
  efficiency(M, N, K) = 1 / (1 + 32/M + 64/N + 128/K) on top of the hardware's gemm_efficiency
  (small dimensions waste tiles: a fit to GEMMs timed on our H200, +-20%), taken for each GEMM
  of a linear layer with its own output rows/cols and reduction size (the weight gradient reduces
  over the rows). Grouped GEMMs use the rows per expert in place of M, and GROUPED_FACTOR. fp32 matmuls run at the fp32 (non-tensor) peak.
* attention: fused causal attention FLOPs (4 * B * nh * S * ctx * d) at ATTN_FWD / ATTN_BWD of
  the GEMM rate; the math / explicit paths as GEMMs plus memory traffic of the [S, S] scores.
* mem: elementwise / norm / permute / sort kernels: bytes read + written at ELEMENTWISE of the
  achievable copy bandwidth; the cross-entropy's GB-sized passes over the logits at CE_FWD / CE_BWD;
  the fused expert path's x_perm written token by token ("x rows": auto's FC1 forward, and FC1's
  weight gradient on both backends) at ROW_COPY, outside the BWD_MEM scaling.

Backward = GEMM FLOPs x 2 (input and weight gradients: the weight part is what zero-bubble
moves to W), attention backward, elementwise traffic x BWD_MEM, and the main-grad hook traffic.
The host launches every kernel (eager PyTorch): a phase takes max(GPU time, kernels x
hardware.launch_overhead_us). The constants below were fitted to forward/backward times of our
trainer on one H200 (plan calibration, see notes) and are ratios, so they carry to other
hardware through its peaks and bandwidth.
Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moetrain.config.schema import FP8_FUSED, Config
from moetrain.models.accounting import sink_attention_blocks
from moetrain.plan.activations import Dims, attention_kernel, fused_rope, gqa_rope_fused, moe_plan, routed_rows

GROUPED_FACTOR = 0.90  # bench gemm on the H200: auto's six GEMMs at DSv3, Qwen3, EP8, Mixtral 0.87-0.95
ATTN_FWD = 0.60  # fused attention forward vs the large-GEMM rate
ATTN_BWD = 0.57
ELEMENTWISE = 0.54  # of the achievable copy bandwidth (many small fp32 kernels); fitted with BWD_MEM to each
BWD_MEM = 2.0  # layer timed alone (plan calibration); backward elementwise traffic / forward traffic
# x_perm [M, H] written token by token (kernels.moe_rows.token_rows: each token's row read once, stored K times), of the
# achievable bandwidth: two such copies at Qwen3 (1.21 GB) took 0.321 ms on the H200
ROW_COPY = 0.92
CE_FWD = 0.62  # the cross-entropy's passes over [T, V] fp32 logits: few GB-sized streaming kernels, faster
CE_BWD = 0.76  # than the blocks' elementwise mix (head alone, plan calibration: 0.60-0.68 / 0.72-0.78)
CE_KERNEL = 0.80  # the fused loss's Triton kernels (kernels.cross_entropy), of the copy bandwidth: not measured,
                  # set below the Triton AdamW's measured 0.93 (one program per row: a max reduction per block)
KERNEL_FLOOR_S = 4e-6  # GPU time of the smallest kernel
BWD_KERNELS = 2.0  # backward kernels / forward kernels (autograd nodes, accumulation); fitted to host-bound
                  # block backward times (tiny preset, H200 host)


@dataclass
class Cost:
    """Seconds and kernel counts of one phase; ``gemm_flops`` for reporting."""

    gpu: float = 0.0
    kernels: float = 0.0
    flops: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float, kernels: float = 1, flops: float = 0.0) -> None:
        self.gpu += seconds
        self.kernels += kernels
        self.flops += flops
        self.parts[name] = self.parts.get(name, 0.0) + seconds

    def time(self, launch_s: float) -> float:
        return max(self.gpu, self.kernels * launch_s)


@dataclass
class BlockCost:
    fwd: Cost
    bwd_input: Cost  # input gradients (+ recompute, + elementwise backward)
    bwd_weight: Cost  # weight gradients (GEMM wgrad, main-grad hooks)


class Roofline:
    def __init__(self, hw, dtype: str):
        self.hw = hw
        self.dtype = dtype  # bf16 | fp16 | fp32
        self.mm_dtype = dtype if dtype != "fp32" else "fp32"
        self.bw = hw.mem_bw * ELEMENTWISE

    def gemm_eff(self, M: float, N: float, K: float) -> float:
        return 1.0 / (1.0 + 32.0 / max(M, 1) + 64.0 / max(N, 1) + 128.0 / max(K, 1))

    def gemm(self, M: float, N: float, K: float, b: int, dtype: str | None = None,
             eff_shape: tuple[float, float, float] | None = None, factor: float = 1.0) -> tuple[float, float]:
        """(seconds, flops) of [M, K] x [K, N]; ``eff_shape`` (rows, cols, reduction) sets the efficiency
        when it differs from (M, N, K): one expert's share of a grouped GEMM."""
        flops = 2.0 * M * N * K
        if M <= 0 or N <= 0 or K <= 0:
            return 0.0, 0.0
        dt = dtype or self.mm_dtype
        peak = self.hw.peak(dt) * 1e12 * (self.hw.gemm_efficiency if dt != "fp32" else 0.85)
        eff = self.gemm_eff(*(eff_shape or (M, N, K))) * factor
        t = max(flops / (peak * eff), b * (M * K + K * N + M * N) / self.hw.mem_bw)
        return t + KERNEL_FLOOR_S, flops

    def mem(self, nbytes: float, kernels: float = 1, frac: float | None = None) -> float:
        """Seconds of elementwise kernels moving nbytes, at ELEMENTWISE of the copy bandwidth (or frac)."""
        bw = self.bw if frac is None else self.hw.mem_bw * frac
        return nbytes / bw + kernels * KERNEL_FLOOR_S

    def attention(self, flops: float, backward: bool) -> float:
        peak = self.hw.peak(self.mm_dtype) * 1e12 * (self.hw.gemm_efficiency if self.dtype != "fp32" else 0.85)
        return flops / (peak * (ATTN_BWD if backward else ATTN_FWD)) + KERNEL_FLOOR_S


def _norm(c: Cost, rf: Roofline, name: str, elems: float, b: int) -> None:
    # to fp32, pow, mean, add+rsqrt, mul, weight mul, cast back
    c.add(name, rf.mem((36 + 2 * b) * elems, 7), 8)


def _fp8_quantize_bytes(rf, M: float, T: float, C: float, b: int, from_tokens: bool) -> float:
    """Time of quantizing an [M, C] GEMM operand to FP8 rows and transposed columns: one pass over the rows, or
    (from_tokens, the fused FP8 path) the T token rows read once for the rows and the M rows gathered for the
    columns, 1 byte written per value each."""
    if from_tokens:
        return rf.mem(T * C * b + M * C * (b + 2), 2)
    return rf.mem(M * C * (b + 2), 1)


def _linear(fw: Cost, bi: Cost, bw: Cost, rf: Roofline, name: str, M: float, N: float, K: float, b: int,
            rows_pe: float | None = None, factor: float = 1.0, dtype: str | None = None) -> None:
    """y [M, N] = x [M, K] w^T and its two gradients, each GEMM at the efficiency of its own output and
    reduction sizes. Grouped (rows_pe = rows per expert): each expert's GEMM has rows_pe rows, and
    the weight gradient reduces over them (DeepSeek-V3's 256 rows per expert: its slowest GEMM)."""
    r = M if rows_pe is None else rows_pe
    for cost, shape in ((fw, (r, N, K)), (bi, (r, K, N)), (bw, (N, K, r))):  # fwd, dgrad dx [M, K], wgrad dw [N, K]
        t, fl = rf.gemm(M, N, K, b, dtype=dtype, eff_shape=shape, factor=factor)
        cost.add(name, t, 1, fl)


def _fp8_linear(fw: Cost, bi: Cost, bw: Cost, rf: Roofline, name: str, M: float, N: float, K: float,
                b: int) -> None:
    """A dense linear under precision.fp8_dense (torchao's Float8Linear): its GEMMs at the FP8 rate on 1-byte
    operands, plus the casts, each an amax pass and a cast pass (read 2b, write 1 byte per element): input and
    weight forward; the output gradient, and input and weight again from their saved high-precision copies, backward."""
    _linear(fw, bi, bw, rf, name, M, N, K, 1, dtype="fp8")
    fw.add("fp8 cast", rf.mem((M + N) * K * (2 * b + 1), 4), 4)
    bi.add("fp8 cast", rf.mem((M * N + (M + N) * K) * (2 * b + 1), 6), 6)


def block_cost(cfg: Config, d: Dims, rf: Roofline, moe: bool, window: int | None, mode: str,
               ep: int = 1, fp8_dense: bool = False) -> BlockCost:
    """Forward / backward cost of one decoder block on one rank (recompute ``mode`` adds the
    recomputed forward part to the backward; ``fp8_dense``: the block's dense linears in FP8, precision.fp8_dense)."""
    m, e = cfg.model, cfg.moe
    b, T, Th, H, B, S = d.b, d.T, d.Th, m.hidden_size, d.B, d.S
    nh = max(m.num_attention_heads / d.tp, 1)
    fw, bi, bw = Cost(), Cost(), Cost()
    _dense = _fp8_linear if fp8_dense else _linear
    _norm(fw, rf, "norms", 2 * Th * H, b)
    fw.add("residual", rf.mem(2 * 3 * b * Th * H, 2), 2)
    # ---- attention
    if m.attention_type == "mla":
        qk, dv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        if m.q_lora_rank:
            _dense(fw, bi, bw, rf, "attn proj", T, m.q_lora_rank, H, b)
            _norm(fw, rf, "attn norms", T * m.q_lora_rank, b)
            _dense(fw, bi, bw, rf, "attn proj", T, nh * qk, m.q_lora_rank, b)
        else:
            _dense(fw, bi, bw, rf, "attn proj", T, nh * qk, H, b)
        _dense(fw, bi, bw, rf, "attn proj", T, m.kv_lora_rank + m.qk_rope_head_dim, H, b)
        _norm(fw, rf, "attn norms", T * m.kv_lora_rank, b)
        _dense(fw, bi, bw, rf, "attn proj", T, nh * (m.qk_nope_head_dim + dv), m.kv_lora_rank, b)
        _dense(fw, bi, bw, rf, "attn proj", T, H, nh * dv, b)
        rope_elems = T * (nh + 1) * m.qk_rope_head_dim
        if fused_rope(cfg, d):
            _fused_rope_cost(fw, bi, rf, rope_elems, b, norm=False)
            fw.add("cat", rf.mem(4 * b * T * nh * qk, 2), 2)
        else:
            fw.add("rope+cat", rf.mem(10 * b * rope_elems + 4 * b * T * nh * qk, 12), 16)
        kv, same = nh, qk == dv
    else:
        hd = cfg.attn_head_dim
        kvh = max(cfg.kv_heads / d.tp, 1)
        qk = dv = hd
        _dense(fw, bi, bw, rf, "attn proj", T, (nh + 2 * kvh) * hd, H, b)
        bi.add("attn proj", 0, 2)  # three projections in the model, one cost above
        fw.add("attn proj", 0, 2)
        _dense(fw, bi, bw, rf, "attn proj", T, H, nh * hd, b)
        if gqa_rope_fused(cfg, d):
            _fused_rope_cost(fw, bi, rf, T * (nh + kvh) * hd, b, norm=m.qk_norm)
        else:
            if m.qk_norm:
                _norm(fw, rf, "attn norms", T * (nh + kvh) * hd, b)
            fw.add("rope", rf.mem(10 * b * T * (nh + kvh) * hd, 14), 16)
        kv, same = kvh, True
    ctx = S / 2 if window is None else min(window, S / 2)
    attn_flops = 2 * B * nh * S * ctx * (qk + dv)
    if m.attention_type == "gqa" and m.attention_sinks:
        # models.attention.sink_attention: the memory-efficient kernel with a mask computes every tile of each
        # block's [queries, keys] (no causal or window skipping inside it) at the padded head dim; the pads, bands and
        # the kv repeat copy q, k, v (and the backward their gradients) once
        blk = sink_attention_blocks(qk, S, window)
        run = 4 * B * nh * blk.query_rows * blk.keys * blk.head_dim
        copies = rf.mem(2 * b * B * nh * (blk.query_rows + 2 * blk.key_slots) * blk.head_dim, 6)
        fw.add("attention", rf.attention(run, False) + copies, 7, attn_flops)
        bi.add("attention", rf.attention(2.5 * run, True) + copies, 7, 2.5 * attn_flops)
    elif attention_kernel(d, kv != nh, same, window is not None) == "unfused":
        # math SDPA, scores and probabilities materialised: GEMMs over the full [S, S]; scale, softmax, cast
        # (bytes per score element, read + write)
        full = 2 * B * nh * S * S * (qk + dv)
        t = full / (rf.hw.peak(rf.mm_dtype) * 1e12 * 0.5)
        elems = B * nh * S * S
        fw.add("attention", t + rf.mem((24 + 2 * b) * elems, 6), 8, attn_flops)
        bi.add("attention", 2 * t + rf.mem(2 * (24 + 2 * b) * elems, 8), 10, 2.5 * attn_flops)
    else:
        fw.add("attention", rf.attention(attn_flops, False), 1, attn_flops)
        bi.add("attention", rf.attention(2.5 * attn_flops, True), 2, 2.5 * attn_flops)
    # ---- MLP
    if moe:
        E, I = e.num_experts, e.moe_ffn_hidden_size / d.etp
        M = routed_rows(cfg, d)
        plan = moe_plan(cfg, d)
        E_l = E / ep
        rpe = M / E_l
        # the routing's backward: one kernel (ops.route's Triton backward: logits read, their gradient written), or
        # PyTorch's chain rule
        route_bytes, route_kernels = (8 * Th * E, 1) if plan.routing == "triton" else (30 * Th * E, 15)
        if plan.logits == "tensor_core":  # bf16 GEMMs, fp32 out; the backward's split gradient doubles their work
            t, fl = rf.gemm(Th, E, H, b)
            fw.add("router", t + rf.mem(40 * Th * E, 25), 26, fl)
            # + the gradient split into hi | lo (two kernels) and [w; w] (one), then the dx GEMM
            bi.add("router", 2 * t + rf.mem(route_bytes + 14 * Th * E, route_kernels + 3), route_kernels + 4, 2 * fl)
            bw.add("router", 2 * t, 2, 2 * fl)
        else:  # fp32 copies of x and the weight, an fp32 (SIMT) GEMM
            t, fl = rf.gemm(Th, E, H, 4, dtype="fp32")
            fw.add("router", t + rf.mem((b + 4) * Th * H + 40 * Th * E, 25), 30, fl)
            bi.add("router", t + rf.mem(route_bytes, route_kernels), route_kernels, fl)
            bw.add("router", t, 1, fl)
        fp8 = cfg.precision.fp8_recipe != "none"
        # rowwise / tensorwise FP8 without expert biases keeps the fused path (ops.moe_experts_fp8: the token rows
        # quantized straight into their permuted rows); the other recipes run on dispatched rows
        fused_fp8 = fp8 and cfg.precision.fp8_recipe in FP8_FUSED and not cfg.moe.expert_linear_bias
        fused = plan.fused and (fused_fp8 or not fp8)
        if fused and fused_fp8:  # the sort only: no 16-bit copy of x's rows, forward or backward
            fw.add("permute", rf.mem(40 * M, 7), 8)
        elif fused:  # the sort; FC1's forward reads the token rows through an index ("gather")...
            fw.add("permute", rf.mem(40 * M, 7), 8)
            x_rows = rf.mem(b * (M + Th) * H, 1, ROW_COPY)  # x_perm written token by token
            if cfg.moe.backend == "auto":  # ...or, as auto picks on the H200, from x_perm
                fw.add("x rows", x_rows, 1)
            # FC1's weight gradient writes x_perm again ("copy": both backends' choice; its gather ran 1.7x slower)
            bw.add("x rows", x_rows, 1)
        else:  # sort and a permuted copy of x
            fw.add("permute", rf.mem(2 * b * M * H + 40 * M, 8), 10)
        for name, N, Kd in (("experts fc1", 2 * I, H), ("experts fc2", H, I)):
            _linear(fw, bi, bw, rf, name, M, N, Kd, 1 if fp8 else b, rows_pe=rpe, factor=GROUPED_FACTOR,
                    dtype="fp8" if fp8 else None)
            if fp8:  # the GEMM's input quantized (rows + transposed columns) forward, its gradient backward
                fw.add("fp8 quantize", _fp8_quantize_bytes(rf, M, Th, Kd, b, fused_fp8 and name == "experts fc1"), 1)
                bi.add("fp8 quantize", _fp8_quantize_bytes(rf, M, Th, N, b, fused_fp8 and name == "experts fc2"), 1)
        if fused:  # SwiGLU and the combine are one kernel each
            fw.add("swiglu", rf.mem(3 * b * M * I, 1), 1)
            fw.add("combine", rf.mem(b * M * H + b * Th * H + 16 * M, 2), 3)
        else:
            fw.add("swiglu", rf.mem(5 * b * M * I, 3), 4)
            fw.add("combine", rf.mem(3 * b * M * H + b * Th * H + 16 * M, 6), 8)  # gather + batched [1,K]x[K,H]
        sh = cfg.shared_ffn_size / d.tp
        if sh > 0:
            _dense(fw, bi, bw, rf, "shared fc1", T, 2 * sh, H, b)
            _dense(fw, bi, bw, rf, "shared fc2", T, H, sh, b)
            fw.add("swiglu", rf.mem(5 * b * T * sh, 3), 4)
    else:
        F = m.ffn_hidden_size / d.tp
        rows = F if m.activation == "gelu" else 2 * F
        _dense(fw, bi, bw, rf, "mlp fc1", T, rows, H, b)
        _dense(fw, bi, bw, rf, "mlp fc2", T, H, F, b)
        fw.add("act", rf.mem(5 * b * T * F, 3), 4)
    # elementwise backward ~ BWD_MEM x forward traffic (all non-GEMM, non-attention parts; the router's backward
    # is costed above, so its forward is not scaled again here)
    mem_fwd = sum(v for k, v in fw.parts.items() if not k.startswith(("attn proj", "attention", "mlp fc",
                                                                        "experts fc", "shared fc", "router",
                                                                        "x rows", "fp8 cast", "fused rope")))
    mem_kernels = fw.kernels
    bi.add("elementwise", BWD_MEM * mem_fwd, (BWD_KERNELS - 1) * mem_kernels)
    if mode == "full":
        for k, v in fw.parts.items():
            bi.add(f"recompute {k}", v, 0)
        bi.kernels += fw.kernels
        bi.flops += fw.flops
    elif mode == "selective":
        for k in ("attention", "permute", "x rows", "experts fc1", "experts fc2", "swiglu", "combine"):
            if k in fw.parts:
                bi.add(f"recompute {k}", fw.parts[k], 4)
    return BlockCost(fw, bi, bw)


def _fused_rope_cost(fw: Cost, bi: Cost, rf: Roofline, elems: float, b: int, norm: bool) -> None:
    """moetrain.ops.rope's kernels (kernels/rope.py counts their bytes) over the q and k elements: forward reads x and
    writes y (the q/k norm inside), backward reads dy (and x with the norm) and writes dx; one launch a tensor."""
    fw.add("fused rope", rf.mem(2 * b * elems, 2), 2)
    bi.add("fused rope", rf.mem((3 if norm else 2) * b * elems, 2), 2)


def head_cost(cfg: Config, d: Dims, rf: Roofline) -> BlockCost:
    """Final norm + output head + fp32 cross-entropy (and its backward)."""
    H, b, T, Th = cfg.model.hidden_size, d.b, d.T, d.Th
    V = cfg.model.vocab_size / d.tp
    fw, bi, bw = Cost(), Cost(), Cost()
    _norm(fw, rf, "final norm", Th * H, b)
    if cfg.train.fused_loss:
        _fused_loss_cost(fw, bi, rf, T, V, H, b, kernels=d.device == "cuda")
        bi.add("final norm", 2 * fw.parts["final norm"], 10)
        return BlockCost(fw, bi, bw)
    _linear(fw, bi, bw, rf, "head", T, V, H, b)
    # logits -> fp32 (b + 4), log-softmax (max, sum-exp, write: ~3 passes), nll
    ce = (b + 4) * T * V + 12 * T * V
    fw.add("cross-entropy", rf.mem(ce, 6, CE_FWD), 10)
    # nll backward (zeros + scatter), log-softmax backward (read 2, write 1), fp32 -> b
    bi.add("cross-entropy", rf.mem(4 * T * V + 12 * T * V + (4 + b) * T * V, 6, CE_BWD), 10)
    bi.add("final norm", 2 * fw.parts["final norm"], 10)
    return BlockCost(fw, bi, bw)


def _fused_loss_cost(fw: Cost, bi: Cost, rf: Roofline, T: float, V: float, H: float, b: int,
                     kernels: bool = True) -> None:
    """train.fused_loss (``ops.linear_cross_entropy``), modelled, not yet measured: the head's three GEMMs all in the
    forward, chunk by chunk (C = ``runtime.loss_chunk.chunk_tokens`` tokens, the kernels' chunk on a GPU); per chunk
    the fp32 dW accumulator is read and written by its GEMM below fp32 (8VH bytes); the backward scales dh and dW.
    The elementwise work over the chunk's logits: on a GPU (``kernels``) the Triton kernels of
    ``kernels.cross_entropy``, 3b bytes per logit (the fused kernel reads the b-byte logits twice and writes the
    gradient over them once; the vocab-parallel statistics + gradient kernels move the same) at CE_KERNEL of the copy
    bandwidth, one launch beside the chunk's small [C] ops; else PyTorch's passes, ~44 bytes per logit (fp32 copy,
    max, exp, sums, gradient, cast: the module docstring of ``ops.linear_cross_entropy`` counts them)."""
    from moetrain.runtime.loss_chunk import chunk_tokens

    C = min(T, chunk_tokens(math.ceil(V), 4, b if kernels else None))
    chunks = math.ceil(T / C)
    for name, shape in (("head", (C, V, H)), ("head dgrad", (C, H, V)), ("head wgrad", (V, H, C))):
        t, fl = rf.gemm(T, V, H, b, eff_shape=shape)  # the chunks' GEMMs: all T tokens at one chunk's efficiency
        fw.add(name, t, chunks, fl)
    acc = 8 * V * H * chunks if b != 4 else 0
    if kernels:
        fw.add("cross-entropy", rf.mem(3 * b * T * V, 4 * chunks, CE_KERNEL) + rf.mem(acc, 0, CE_FWD), 4 * chunks)
    else:
        fw.add("cross-entropy", rf.mem(44 * T * V + acc, 6, CE_FWD), 10 * chunks)
    bi.add("cross-entropy", rf.mem(2 * b * (T * H + V * H), 2), 2)


def embedding_cost(cfg: Config, d: Dims, rf: Roofline) -> BlockCost:
    H, b = cfg.model.hidden_size, d.b
    V = cfg.model.vocab_size / d.tp
    fw, bi, bw = Cost(), Cost(), Cost()
    fw.add("embedding", rf.mem(2 * b * d.T * H, 1), 2)
    bw.add("embedding", rf.mem(b * V * H + 3 * b * d.T * H + 16 * d.T, 6), 8)
    return BlockCost(fw, bi, bw)


def mtp_extra_cost(cfg: Config, d: Dims, rf: Roofline) -> BlockCost:
    H, b = cfg.model.hidden_size, d.b
    hc = head_cost(cfg, d, rf)
    fw, bi, bw = hc.fwd, hc.bwd_input, hc.bwd_weight
    _norm(fw, rf, "mtp norms", 2 * d.Th * H, b)
    _linear(fw, bi, bw, rf, "eh_proj", d.T, H, 2 * H, b)
    fw.add("mtp embedding", rf.mem(2 * b * d.T * H + 4 * b * d.T * H, 4), 8)
    return BlockCost(fw, bi, bw)
