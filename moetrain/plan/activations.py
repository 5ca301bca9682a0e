"""Activation bytes saved for backward, per block, derived from what OUR modules keep.

Legend: B sequences per micro-batch, S sequence length (per CP rank), T = B*S tokens, H hidden,
nh/kv query/key-value heads (per TP rank), hd head dim, F dense intermediate, I expert
intermediate, E experts, K top-k, M routed rows (T*K), V vocab (per TP rank), b bytes of the
parameter/activation dtype (2 bf16/fp16, 4 fp32).

Every term below is a tensor that autograd keeps alive between forward and backward in
moetrain.models (measured with torch.autograd.graph.saved_tensors_hooks, unique storages,
parameters excluded: tests/plan/test_activations.py), for example:

* RMSNorm (fp32 math): the fp32 input (a copy for bf16, the input itself for fp32), the fp32
  normalised tensor and rsqrt [T, 1]: 8*T*D + 4*T bytes (+ an fp32 copy of the weight for bf16).
* Linear / grouped GEMM: its input (kept for the weight gradient: ``wgrad`` terms).
* Fused attention (flash / memory-efficient SDPA): q, k, v, the output and the fp32 log-sum-exp
  [B, nh, S]; GQA keeps k/v with kv heads. ``attention="unfused"`` models torch's math SDPA
  (fp32 copies of q, k, v and the fp32 probabilities [B, nh, S, S]); learned sinks (GPT-OSS) run as one more
  key (models.attention.sink_attention): the kernel keeps q, k, v and the output padded to the sink's head dim
  (with a short window in blocks of queries against their bands of keys), k and v repeated to nh heads, and the
  mask as a bias.
* RoPE keeps only its cos/sin tables (a b-byte copy per call in bf16). On CUDA (model.fused_rope, the default) RoPE
  and GQA's q/k norms run as one fused op per tensor (moetrain.ops.rope), which keeps only its input and an fp32
  rstd per row with the norm, and nothing of its own without it (``rope_terms``).
* MoE: the router's fp32 input copy, fp32 scores [T, E], indices (the group-limited selection
  keeps nothing: no gradient flows through it); the expert path keeps FC1's input (the permuted
  rows [M, H]; on the fused path, moe.backend auto/triton on CUDA, the token rows [T, H] and a
  row index instead), FC1 output [M, 2I] (SwiGLU's only input), FC2 input [M, I], and the
  combine's FC2 output rows [M, H], fp32 weights and dropped-assignment mask. Under expert parallelism
  FC1 keeps the received rows [M, H] and their int64 regroup index (never the fused gather), and the
  all-to-all's backward holds a receive buffer [M, H] (not measured on a GPU yet: the terms follow
  distributed.expert_parallel's code).
* Routed rows M = tokens x top-k (x --moe-imbalance on the busiest rank). A capacity factor
  does not shrink them: our ops keep every assignment (dropped ones ride with the last expert
  and are weighted by zero), so capacity only adds its mask.
* Recompute: full keeps the block input only; selective drops the attention core (keeps q, k,
  v) and the routed-expert path (keeps its inputs x and the top-k weights).

Tensor/sequence/context parallel splits, as ``distributed.tensor_parallel`` runs them (measured on one rank of
TP2 with and without SP: tests/distributed/test_activations_tp.py): per-head and intermediate tensors / tp; the
norms' [T, H] tensors / tp only with sequence parallelism; the inputs of the column-parallel projections (q/k/v or
MLA's down projections, the dense MLP's and shared experts' FC1, the head) whole [T, H] with or without SP (DTensor
keeps the all-gathered tensor for the weight gradient); everything an MoE layer routes over Tr = T / tp tokens with
or without SP (each rank routes its slice of every sequence), its router's balancing statistics a view of the
[2, G, E] (+ z) sums over tp; T / cp everywhere; vocab / tp.

Compared with Megatron-LM (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"): a plain GPT layer (16-bit, MHA, GELU with 4H, dropout) keeps 34 s b h / t bytes with TP + SP and selective
recompute. Our terms for the same layer (no dropout; RoPE; selective recompute) give (40 / t + 4) s b h, plus the
norms' rsqrt and fp32 weight copies and the RoPE tables (tests/plan/test_activations.py checks it):
* norms: 16 / t against 4 / t: our RMSNorm computes in fp32 and keeps the fp32 input and normalised tensor (8 bytes
  per element each norm) where Megatron's LayerNorm keeps its 16-bit input (2);
* q/k/v and FC1 inputs: 2 + 2 = 4 whole, against 4 / t: Megatron keeps the sequence shard and all-gathers it again
  in backward; DTensor keeps the gathered tensor (a re-gather would cost an all-gather per projection in backward);
* dropout masks: Megatron's 2 / t (attention output, MLP output), none here.
Equal: attention 8 / t (q, k, v, o_proj input), GELU 16 / t (FC1 output, FC2 input). So ours is 1.3x Megatron's at
t = 1 and 2.2x at t = 8, the gap dominated by the gathered projection inputs at large t.
Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetrain.config.schema import Config
from moetrain.models.accounting import sink_attention_blocks
from moetrain.runtime.expert_plan import ExpertPlan, expert_plan


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    wgrad: bool = False  # kept only for a weight gradient (freed by the W pass in zero-bubble)


@dataclass(frozen=True)
class Dims:
    """Per-rank shapes of one micro-batch."""

    B: int
    S: int  # sequence length on this rank (seq_length / cp)
    b: int  # bytes of the parameter / activation dtype
    tp: int = 1
    sp: bool = False
    etp: int = 1
    attention: str = "auto"  # auto | fused | unfused
    moe_imbalance: float = 1.0  # routed rows on the worst rank / average
    device: str = "cuda"  # which SDPA kernels "auto" assumes, and whether RoPE runs fused (rope_terms): cuda | cpu
    ep: int = 1

    @property
    def T(self) -> int:
        return self.B * self.S

    @property
    def Th(self) -> float:
        """Tokens of the [T, H] tensors between a block's parts on this rank (sequence parallel shards them over TP):
        the norms' and residuals'. The inputs of column-parallel projections are gathered: T tokens."""
        return self.T / self.tp if self.sp else self.T

    @property
    def Tr(self) -> float:
        """Tokens this rank routes through an MoE layer: tensor parallelism splits every sequence over the tp ranks,
        with or without sequence parallelism (models.moe.layer's token split)."""
        return self.T / self.tp


ATTENTION = ("auto", "fused", "unfused")


def resolve_dims(cfg: Config, attention: str = "auto", moe_imbalance: float = 1.0, device: str = "cuda",
                 dtype_bytes: int | None = None) -> Dims:
    """Per-rank shapes from the config; ``dtype_bytes`` overrides precision.dtype (CPU runs fp32)."""
    p = cfg.parallel
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}; valid: {', '.join(ATTENTION)}")
    b = dtype_bytes or (4 if cfg.precision.dtype == "fp32" else 2)
    return Dims(B=cfg.train.micro_batch_size, S=cfg.train.seq_length // p.cp, b=b, tp=p.tp,
                sp=p.sequence_parallel, etp=p.etp, attention=attention, moe_imbalance=moe_imbalance, device=device,
                ep=p.ep)


dims_for = resolve_dims


def attention_kernel(d: Dims, gqa: bool, same_dims: bool, masked: bool) -> str:
    """Which SDPA path torch takes (torch 2.11): on CUDA flash (16-bit, equal q/v head dims,
    GQA, no mask) or memory-efficient (any dtype, masks, no GQA); otherwise the math path.
    On CPU the flash kernel needs equal q/v head dims."""
    if d.attention != "auto":
        return d.attention
    if d.device == "cpu":
        return "fused" if same_dims else "unfused"
    flash = d.b != 4 and same_dims and not masked
    mem_efficient = not gqa
    return "fused" if (flash or mem_efficient) else "unfused"


def _heads(n: int, tp: int) -> float:
    return max(n / tp, 1.0)


def norm(name: str, rows: float, dim: int, b: int) -> list[Term]:
    return [Term(name, 8 * rows * dim + 4 * rows + (4 * dim if b != 4 else 0))]


def rope_tables(d: Dims, rope_dim: int, calls: int = 2) -> list[Term]:
    # Each apply_rope keeps its cos and sin [S, 1, rope/2] cast to the activation dtype; in fp32
    # the cast is a no-op and all layers share the model's two fp32 tables (negligible).
    if d.b == 4:
        return []
    return [Term("rope tables", calls * 2 * d.S * (rope_dim // 2) * d.b)]


def fused_rope(cfg: Config, d: Dims) -> bool:
    """Whether the attention's RoPE (and GQA's q/k norms) runs as moetrain.ops.rope's fused op: on CUDA unless
    model.fused_rope is off (models.attention's rule at run time, on a machine with triton)."""
    return d.device == "cuda" and cfg.model.fused_rope


def gqa_rope_fused(cfg: Config, d: Dims) -> bool:
    """Whether GQA's RoPE with its q/k norms runs fused: fused_rope, except q/k norms under tensor parallelism (their
    weights are DTensors, which the fused op does not take)."""
    return fused_rope(cfg, d) and not (cfg.model.qk_norm and d.tp > 1)


def rope_terms(cfg: Config, d: Dims) -> list[Term]:
    """What RoPE, with GQA's per-head q/k RMSNorm before it, keeps for backward in one attention block.

    Eager (the CPU, model.fused_rope off, and GQA's q/k norms under tensor parallelism, whose weights are DTensors):
    each norm's fp32 input copy, normalised tensor and rsqrt, and the tables cast per call in 16-bit.
    Fused (moetrain.ops.rope on CUDA): with the norm, x itself (a view of the q / k projection's output, b bytes,
    kept by nothing else) and the fp32 rstd [rows]; the fp32 tables (shared by every layer) and the norm weight (a
    parameter) by reference, so nothing else: without the norm (MLA's rope parts, GQA without qk_norm) nothing."""
    m = cfg.model
    T, b = d.T, d.b
    if m.attention_type == "mla":
        return [] if fused_rope(cfg, d) else rope_tables(d, m.qk_rope_head_dim)
    nh, kv, hd = _heads(m.num_attention_heads, d.tp), _heads(cfg.kv_heads, d.tp), cfg.attn_head_dim
    if not gqa_rope_fused(cfg, d):
        out = norm("q_norm", T * nh, hd, b) + norm("k_norm", T * kv, hd, b) if m.qk_norm else []
        return out + rope_tables(d, hd)
    if not m.qk_norm:
        return []
    return [Term("q norm+rope input, rstd", b * T * nh * hd + 4 * T * nh),
            Term("k norm+rope input, rstd", b * T * kv * hd + 4 * T * kv)]


# ---- attention ----------------------------------------------------------------------------------

def _core_fused(d: Dims, nh: float, kv: float, dq: int, dv: int, v_storage: float) -> list[Term]:
    T, b = d.T, d.b
    return [Term("attn q", b * T * nh * dq), Term("attn k", b * T * kv * dq), Term("attn v", v_storage),
            Term("attn out", b * T * nh * dv), Term("attn lse", 4 * T * nh)]


def _core_unfused(d: Dims, nh: float, dq: int, dv: int) -> list[Term]:
    # torch's math SDPA: scaled copies of q and k (k expanded to nh heads), v (expanded),
    # probabilities [B, nh, S, S]; on CPU all in fp32 (16-bit inputs are upcast). The output is
    # a new tensor that o_proj keeps.
    T, S = d.T, d.S
    c = 4 if d.device == "cpu" else d.b
    return [Term("attn q", c * T * nh * dq), Term("attn k", c * T * nh * dq),
            Term("attn v", c * T * nh * dv), Term("attn probs", c * d.B * nh * S * S),
            Term("attn out", d.b * T * nh * dv, wgrad=True)]


def gqa_attention(cfg: Config, d: Dims, window: int | None, selective: bool) -> list[Term]:
    m = cfg.model
    T, b, H = d.T, d.b, m.hidden_size
    nh, kv, hd = _heads(m.num_attention_heads, d.tp), _heads(cfg.kv_heads, d.tp), cfg.attn_head_dim
    out = [Term("qkv input", b * T * H, wgrad=True)]  # gathered under SP (module doc)
    out += rope_terms(cfg, d)
    q, k, v = b * T * nh * hd, b * T * kv * hd, b * T * kv * hd
    if selective:
        # checkpointed core: its inputs q, k, v stay; o_proj keeps the core output.
        out += [Term("attn q", q), Term("attn k", k), Term("attn v", v)]
        out.append(Term("attn out", b * T * nh * hd, wgrad=m.attention_sinks))
        return out
    if m.attention_sinks:
        # sink_attention: the kernel keeps the padded q and output [B * blocks, nh, queries, dp], k and v
        # [B * blocks, nh, keys, dp] (repeated to nh heads), the fp32 log-sum-exp and the mask as a b-byte bias
        # [B * blocks, 1, queries, keys]; o_proj keeps the output's copy
        blk = sink_attention_blocks(hd, d.S, window)
        rows, slots, dp = d.B * blk.query_rows, d.B * blk.key_slots, blk.head_dim
        out += [Term("attn q", b * nh * rows * dp), Term("attn k", b * nh * slots * dp),
                Term("attn v", b * nh * slots * dp), Term("attn out padded", b * nh * rows * dp),
                Term("attn lse", 4 * nh * rows), Term("attn mask", b * rows * blk.keys),
                Term("attn out", b * T * nh * hd, wgrad=True)]
        return out
    if attention_kernel(d, kv != nh, True, window is not None) == "unfused":
        return out + _core_unfused(d, nh, hd, hd)
    out += _core_fused(d, nh, kv, hd, hd, v)
    if window is not None:
        out.append(Term("attn mask", d.S * d.S))
    return out


def mla_attention(cfg: Config, d: Dims, selective: bool) -> list[Term]:
    m = cfg.model
    T, b, H = d.T, d.b, m.hidden_size
    nh = _heads(m.num_attention_heads, d.tp)
    qk, dv, kvl = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    out = [Term("q/kv down input", b * T * H, wgrad=True)]  # gathered under SP
    if m.q_lora_rank:
        out += norm("q_a_norm", T, m.q_lora_rank, b) + [Term("q_b input", b * T * m.q_lora_rank, wgrad=True)]
    out += norm("kv_a_norm", T, kvl, b) + [Term("kv_b input", b * T * kvl, wgrad=True)]
    if b == 4:  # fp32: the norm keeps the latent as a view of kv_a_proj's whole output (latent | rope key)
        out.append(Term("kv_a output (rope part)", 4 * T * m.qk_rope_head_dim))
    out += rope_terms(cfg, d)
    kv_storage = b * T * nh * (m.qk_nope_head_dim + dv)  # v is a view of kv_b_proj's output
    if selective:
        return out + [Term("attn q", b * T * nh * qk), Term("attn k", b * T * nh * qk), Term("attn v", kv_storage),
                      Term("attn out", b * T * nh * dv)]
    if attention_kernel(d, False, qk == dv, False) == "unfused":
        return out + _core_unfused(d, nh, qk, dv)
    return out + _core_fused(d, nh, nh, qk, dv, kv_storage)


# ---- feed-forward -------------------------------------------------------------------------------

def ffn_intermediates(rows: float, ffn: float, activation: str, b: int) -> list[Term]:
    """What an FFN keeps besides its input: FC1 output, activation parts, FC2 input."""
    if activation == "gelu":
        return [Term("fc1 out", b * rows * ffn), Term("fc2 input", b * rows * ffn, wgrad=True)]
    parts = 1 if activation == "swiglu" else 4  # silu out | clamped gate, sigmoid, gate*sig, up+1
    return [Term("fc1 out", b * rows * 2 * ffn), Term("act parts", parts * b * rows * ffn),
            Term("fc2 input", b * rows * ffn, wgrad=True)]


def dense_mlp(cfg: Config, d: Dims) -> list[Term]:
    m = cfg.model
    return [Term("mlp input", d.b * d.T * m.hidden_size, wgrad=True)] + \
        ffn_intermediates(d.T, m.ffn_hidden_size / d.tp, m.activation, d.b)


def routed_rows(cfg: Config, d: Dims) -> float:
    """Routed rows M on the worst rank: tokens this rank routes x top-k x imbalance."""
    return d.Tr * cfg.moe.topk * d.moe_imbalance


def expert_rows(cfg: Config, d: Dims) -> float:
    """Rows of the experts' input and output buffers on the worst rank: the routed rows, or under expert
    parallelism with the sync-free dispatcher its static ep x C receive buffer (``distributed.capacity``; the
    grouped GEMMs compute only the routed rows of it, ``routed_rows``)."""
    e = cfg.moe
    if d.ep > 1 and e.dispatcher == "sync_free":
        from moetrain.distributed.capacity import capacity

        return d.ep * capacity(math.ceil(d.Tr), e.topk, d.ep, e.num_experts // d.ep, e.dispatcher_capacity)
    return routed_rows(cfg, d)


def router(cfg: Config, d: Dims) -> list[Term]:
    e, H = cfg.moe, cfg.model.hidden_size
    T, E, K = d.Tr, e.num_experts, e.topk
    out = []
    # fp32 logits GEMM: a copy of the input and of the weight (fp32 models use both as is); the
    # tensor-core GEMM keeps x itself (counted as the MoE input in moe_mlp)
    if d.b != 4 and moe_plan(cfg, d).logits != "tensor_core":
        out += [Term("router input fp32", 4 * T * H, wgrad=True), Term("router weight fp32", 4 * E * H)]
    out.append(Term("router scores", 4 * T * E))
    if e.z_loss_coeff > 0:
        out.append(Term("router z-loss", 4 * T * E + 4 * T))  # logits and logsumexp
    if e.aux_loss_coeff > 0:
        # sigmoid scores are normalised by their sum [T, 1]; the loss keeps f [G, E] (G = B sequences or 1). Under
        # tensor parallelism f is a view of the statistics summed over tp: counts and probability sums [2, G, E]
        # and the z sum (models.moe.router's token split)
        G = d.B if e.aux_loss_type == "sequence" else 1
        f = 4 * G * E if d.tp == 1 else 4 * (2 * G * E + (e.z_loss_coeff > 0))
        out.append(Term("router aux", (4 * T if e.score_function == "sigmoid" else 0) + f))
    if e.force_balance != "none":
        return out
    # Group-limited selection only produces indices (no gradient flows through it): autograd
    # frees what its ops saved as soon as the forward moves on, so nothing stays.
    out.append(Term("top-k idx", 8 * T * K))
    if moe_plan(cfg, d).routing == "triton":
        # the fused routing kernel's backward recomputes the weights from the logits (the z-loss keeps them too)
        if e.z_loss_coeff <= 0:
            out.append(Term("router logits", 4 * T * E))
    elif e.normalize_topk:
        out.append(Term("top-k normalise", 4 * T * K + 4 * T))
    if e.capacity_factor is not None:
        out.append(Term("capacity mask", T * K))  # the kept-assignment mask of the weights' where
    return out


def moe_plan(cfg: Config, d: Dims) -> ExpertPlan:
    """The kernels the MoE layer runs on ``d.device`` in the configured dtype (runtime.expert_plan: the rule the
    layer's ops follow at run time), on a machine with triton and a torch with mm(out_dtype=)."""
    return expert_plan(cfg.moe.backend, cfg.moe.router_gemm, device=d.device, dtype=cfg.precision.dtype,
                       compiling=cfg.train.compile)


def routed_experts(cfg: Config, d: Dims) -> list[Term]:
    e, H = cfg.moe, cfg.model.hidden_size
    M, b, I = expert_rows(cfg, d), d.b, e.moe_ffn_hidden_size / d.etp
    out = [Term("permute idx", 8 * M)]  # the inverse permutation, shared by FC1's backward and the combine
    if d.ep > 1:
        # expert parallelism (distributed.expert_parallel): the experts compute on the received rows, regrouped by
        # an int64 index that the regrouping, the probs' regrouping and the combine's way back all keep; FC1 keeps
        # the received rows themselves (no fused gather from x on this path)
        out += [Term("expert input (received rows)", b * M * H, wgrad=True), Term("regroup idx", 8 * M)]
    elif moe_plan(cfg, d).fused:  # FC1 reads x [T, H] (see moe_mlp) through int32 row indices; offs [E] int32
        out += [Term("gather idx", 4 * M + 4 * e.num_experts / d.ep)]
    else:
        out += [Term("expert input", b * M * H, wgrad=True)]
    out += [Term("fc1 out", b * M * 2 * I), Term("fc2 input", b * M * I, wgrad=True)]
    if e.expert_linear_bias:
        out.append(Term("bias idx", 8 * M))
    if moe_plan(cfg, d).fused and not e.expert_linear_bias:
        # the routing weights scale SwiGLU's rows (fp32 [M] kept, put in row order by the sort, which zeroes
        # dropped assignments itself: no mask kept); the combine is a plain sum that keeps nothing
        out += [Term("row probs", 4 * M)]
    else:  # combine: FC2's output rows, the fp32 top-k weights and the where-mask of dropped assignments
        out += [Term("combine mask+weights", M + 4 * M), Term("combine rows", b * M * H)]
    return out


def moe_mlp(cfg: Config, d: Dims, selective: bool) -> list[Term]:
    e, H, b = cfg.moe, cfg.model.hidden_size, d.b
    shared = cfg.shared_ffn_size
    out = router(cfg, d)
    # The MoE input x (b*T*H): kept by the shared experts' FC1, by the selective checkpoint, by the
    # fused expert path's FC1, or by the router (fp32 models, or the tensor-core logits GEMM), which
    # then uses it without a copy. Under tensor parallelism the routed path and the shared experts see different
    # tensors: this rank's routed tokens [Tr, H] (x itself under SP, a slice copy without) and the whole sequence
    # [T, H] for the shared experts (x without SP, its all-gather with).
    fused = moe_plan(cfg, d).fused and not selective
    by_router = b == 4 or moe_plan(cfg, d).logits == "tensor_core"
    routed_keeps = selective or by_router or fused
    if d.tp == 1 and (shared > 0 or routed_keeps):
        out.append(Term("moe input", b * d.T * H, wgrad=shared > 0 or by_router or fused))
    elif d.tp > 1:
        if routed_keeps:
            out.append(Term("moe input", b * d.Tr * H, wgrad=by_router or fused))
        if shared > 0:
            out.append(Term("shared input", b * d.T * H, wgrad=True))
    if selective:
        # checkpoint inputs: the final top-k weights, and with capacity the new (dropped) indices
        out.append(Term("top-k weights", 4 * d.Tr * e.topk + (8 * d.Tr * e.topk if e.capacity_factor else 0)))
    else:
        out += routed_experts(cfg, d)
    if shared > 0:
        out += [Term(f"shared {t.name}", t.bytes, t.wgrad)
                for t in ffn_intermediates(d.T, shared / d.tp, e.activation, b)]
    return out


# ---- blocks -------------------------------------------------------------------------------------

def block_terms(cfg: Config, d: Dims, moe: bool, window: int | None, mode: str) -> list[Term]:
    """Activations of one decoder block (or MTP block) for recompute mode none|selective|full."""
    H = cfg.model.hidden_size
    if mode == "full":
        return [Term("block input (full recompute)", d.b * d.Th * H)]
    selective = mode == "selective"
    out = norm("input_norm", d.Th, H, d.b)
    if cfg.model.attention_type == "mla":
        out += mla_attention(cfg, d, selective)
    else:
        out += gqa_attention(cfg, d, window, selective)
    out += norm("post_attn_norm", d.Th, H, d.b)
    out += moe_mlp(cfg, d, selective) if moe else dense_mlp(cfg, d)
    return out


def mtp_extra_terms(cfg: Config, d: Dims) -> list[Term]:
    """An MTP depth around its block: enorm, hnorm, eh_proj input, final norm, head input, loss."""
    H = cfg.model.hidden_size
    return (norm("mtp enorm", d.Th, H, d.b) + norm("mtp hnorm", d.Th, H, d.b)
            + [Term("eh_proj input", 2 * d.b * d.Th * H, wgrad=True), Term("mtp tokens", 16 * d.T)]
            + head_terms(cfg, d))


def head_terms(cfg: Config, d: Dims) -> list[Term]:
    """Final norm + output head + fp32 cross-entropy: the head input and the log-softmax kept in fp32 (4*T*V); with
    train.fused_loss (``ops.linear_cross_entropy``) the input gradient [T, H] and the weight's gradient [V, H] made in
    the forward, in the parameter dtype, instead (V / tp rows under tensor parallelism, every token on each rank)."""
    H, V = cfg.model.hidden_size, cfg.model.vocab_size / d.tp
    if cfg.train.fused_loss:
        return norm("final_norm", d.Th, H, d.b) + [
            Term("fused loss dh", d.b * d.T * H), Term("fused loss dW", d.b * V * H)]
    return norm("final_norm", d.Th, H, d.b) + [
        Term("head input", d.b * d.T * H, wgrad=True),  # gathered under SP
        Term("log-softmax fp32", 4 * d.T * V)]


def ce_transients(cfg: Config, d: Dims) -> tuple[float, float]:
    """(forward, backward) bytes above the saved activations at one cross-entropy.

    forward: the logits [T, V] in the parameter dtype plus their fp32 upcast (none for fp32)
    while the log-softmax is computed; backward: the fp32 gradients of the log-softmax output
    and input (8*T*V) while the saved log-softmax is still alive.
    train.fused_loss: forward, one chunk's [C, V] buffers (C = ``runtime.loss_chunk.chunk_tokens`` tokens) beside
    the fp32 dW accumulator [V, H] (below fp32; in fp32 it is the kept dW itself): on a GPU the Triton kernels' (the
    GEMM's b-byte output, the gradient written over it: bCV, at 3x the chunk below fp32), else PyTorch's (fp32 logits,
    and below fp32 the GEMM's output, then the gradient: 4CV + bCV); backward, the scaled copies of dh and dW (the
    saved ones alive until the node returns)."""
    H, V = cfg.model.hidden_size, cfg.model.vocab_size / d.tp
    if cfg.train.fused_loss:
        from moetrain.runtime.loss_chunk import chunk_tokens, transient_bytes_per_logit

        kernels = d.device == "cuda"
        C = min(d.T, chunk_tokens(math.ceil(V), 4, d.b if kernels else None))
        low = d.b != 4
        chunk = transient_bytes_per_logit(d.b, kernels) * C * V
        return chunk + (4 * V * H if low else 0), d.b * (d.T * H + V * H)
    TV = d.T * V
    fwd = d.b * TV + (4 * TV if d.b != 4 else 0)
    return fwd, 8 * TV


def _attention_backward(cfg: Config, d: Dims, window: int | None) -> float:
    """Transient bytes of the attention core's backward: fused kernels make dq, dk, dv, an fp32
    dq accumulator and the output gradient; the math / explicit paths also the gradients of the
    probabilities [B, nh, S, S] (two of them alive in the softmax backward)."""
    m, b, T, S = cfg.model, d.b, d.T, d.S
    nh = _heads(m.num_attention_heads, d.tp)
    if m.attention_type == "mla":
        dq, dv, kv, same = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, nh, False
        same = dq == dv
    else:
        dq = dv = cfg.attn_head_dim
        kv, same = _heads(cfg.kv_heads, d.tp), True
    grads = b * T * (nh * dq + kv * dq + kv * dv) + b * T * nh * dv
    if m.attention_type == "gqa" and m.attention_sinks:  # + the padded q, k, v and output gradients
        blk = sink_attention_blocks(dq, S, window)
        rows = d.B * blk.query_rows
        return grads + b * nh * blk.head_dim * (2 * rows + 2 * d.B * blk.key_slots) + 4 * nh * rows
    if attention_kernel(d, kv != nh, same, window is not None) == "unfused":
        c = 4 if d.device == "cpu" else b
        return grads + 2 * c * d.B * nh * S * S
    return grads + 4 * T * nh * dq


def block_backward_extra(cfg: Config, d: Dims, moe: bool, window: int | None, grads: str, b_param: int,
                         saved: list[Term]) -> float:
    """Bytes above "all of this block's saved activations alive" at the block's worst backward
    moment (the block runs without recompute here; recompute adds its rebuilt part separately).

    Moments in backward order: MoE combine (gradients of the gathered rows and FC2 output), expert FC2
    and FC1 backward (gradients of their inputs/outputs; the combine rows and the activation
    parts already freed), dense FC2/FC1 likewise, then the attention core with the MLP's
    activations freed. ``grads``: "hook" adds the one parameter-dtype gradient that a main-grad
    hook is folding in (the largest of that moment); "lazy" adds every param.grad this block
    has created so far (they persist); "none" adds none."""
    m, e, b = cfg.model, cfg.moe, d.b
    H, T = m.hidden_size, d.T
    bp = b_param

    def g(numel_now: float, numel_so_far: float) -> float:
        return bp * (numel_now if grads == "hook" else numel_so_far if grads == "lazy" else 0.0)

    moments = []
    so_far = 0.0
    mlp_saved = 0.0
    if moe:
        M, I = routed_rows(cfg, d), e.moe_ffn_hidden_size / d.etp
        fused = moe_plan(cfg, d).fused
        sh = cfg.shared_ffn_size / d.tp
        if sh > 0:
            so_far += 3 * sh * H
            moments.append(b * T * (2 * sh + H) + g(2 * sh * H, so_far))
        # FC2's output rows, kept by the weighted combine (the fused path without biases weighs in SwiGLU)
        rows_kept = 0.0 if fused and not e.expert_linear_bias else b * M * H
        # expert parallelism: the all-to-all's backward receives each gradient into a buffer of its own beside the
        # one it sends (the combine's, then FC1's input gradient on its way back)
        a2a = b * M * H if d.ep > 1 else 0.0
        # combine backward: the gradient of FC2's output rows (the torch version also gathers the rows)
        moments.append((1 if fused else 2) * b * M * H + a2a + g(0.0, so_far))
        so_far += d_expert_params(cfg, d) / 3
        moments.append(b * M * H + b * M * I - rows_kept + g(d_expert_params(cfg, d) / 3, so_far))
        so_far += 2 * d_expert_params(cfg, d) / 3
        freed = rows_kept + b * M * I + b * M * 2 * I  # combine rows, FC2 input, FC1 output
        # FC1 backward: dh, dx_perm, and on the fused path x_perm gathered again for the weight gradient
        moments.append(b * M * 2 * I + (2 if fused else 1) * b * M * H + a2a - freed
                       + g(2 * d_expert_params(cfg, d) / 3, so_far))
        so_far += e.num_experts * H
        mlp_saved = sum(t.bytes for t in saved if t.name.startswith(("router", "group", "top-k", "capacity",
                        "moe", "permute", "regroup", "expert", "fc", "act", "bias",
                        "combine", "shared")))
    else:
        F = m.ffn_hidden_size / d.tp
        rows = F if m.activation == "gelu" else 2 * F
        parts = 0 if m.activation == "gelu" else 1
        so_far += H * F
        moments.append(b * T * H + b * T * F + g(H * F, so_far))
        so_far += rows * H
        freed = b * T * F * (1 + parts) + b * T * rows
        moments.append(b * T * rows + b * d.Th * H - freed + g(rows * H, so_far))
        mlp_saved = sum(t.bytes for t in saved if t.name.startswith(("mlp", "fc", "act")))
    attn_params = (2 * m.num_attention_heads * cfg.attn_head_dim * H + 2 * cfg.kv_heads * cfg.attn_head_dim * H
                   if m.attention_type == "gqa" else 0) / d.tp
    so_far += attn_params
    moments.append(_attention_backward(cfg, d, window) - mlp_saved + g(attn_params / 2, so_far))
    return max(max(moments), 0.0)


def d_expert_params(cfg: Config, d: Dims) -> float:
    """Routed-expert weights (w1 + w2) of one MoE layer on this rank."""
    e, H = cfg.moe, cfg.model.hidden_size
    return e.num_experts / d.ep * 3 * (e.moe_ffn_hidden_size / d.etp) * H


def total(terms: list[Term], wgrad_only: bool = False) -> float:
    return sum(t.bytes for t in terms if t.wgrad or not wgrad_only)
