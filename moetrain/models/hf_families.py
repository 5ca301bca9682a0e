"""Per-family tensor layouts: which Hugging Face tensors make up each moetrain parameter.

Legend: E experts, I expert intermediate, H hidden, F dense intermediate, S shared-expert
intermediate, nh heads, nope/rope/v the MLA per-head dims, kvl the KV latent rank.

``layout(cfg, model_type, hf, keys)`` returns ``Piece``s: one moetrain tensor slice <-> one or
more HF tensors, with the transform each way. Import copies ``load(hf tensors)`` into
``ours[index]``; export writes ``save(ours[index])``. Expert tensors are built slice by slice
(one HF per-expert tensor fills rows of the stacked ``w1 [E, 2I, H]`` / ``w2 [E, H, I]``), so a
checkpoint streams into a preallocated model without a second copy.

Conventions per family (HF names under ``model.layers.{i}``):
* all: embed_tokens, norm, lm_head (absent when tied), input_layernorm, post_attention_layernorm.
* DeepSeek: MLA (q_proj | q_a_proj + q_a_layernorm + q_b_proj, kv_a_proj_with_mqa,
  kv_a_layernorm, kv_b_proj, o_proj); dense mlp.{gate,up,down}_proj; MoE mlp.gate (+
  e_score_correction_bias on V3), mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.*.
  The rope rows of q and of kv_a_proj_with_mqa are *interleaved* in HF (pairs 2j, 2j+1 rotate
  together; HF de-interleaves at runtime) while moetrain rotates halves (j, j + rope/2): import
  reorders those rows [0, 2, 4, ..., 1, 3, 5, ...], export inverts it. Attention scores are
  invariant under this common reordering of q and k. (V3 with rope_interleave = false: no
  reordering.) V3 MTP depth d lives at HF layer num_hidden_layers + d: enorm, hnorm, eh_proj,
  shared_head.norm, the decoder block, plus copies of embed_tokens and shared_head.head (the
  shared embedding/head: ignored on import, written on export).
* Qwen3-MoE: self_attn.{q,k}_norm; mlp.gate; mlp.experts.{e}.{gate,up,down}_proj; dense layers
  (mlp_only_layers) mlp.{gate,up,down}_proj.
* Mixtral: block_sparse_moe.gate; block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down).
* GPT-OSS: q/k/v/o biases, self_attn.sinks, mlp.router.{weight,bias}; fused experts
  mlp.experts.gate_up_proj [E, H, 2I] (x @ W layout, gate/up interleaved on the last dim:
  gate = columns 0::2) + gate_up_proj_bias [E, 2I] (same interleave), down_proj [E, I, H] +
  down_proj_bias [E, H]. Released checkpoints store gate_up_proj / down_proj as MXFP4
  ``*_blocks`` + ``*_scales`` in [E, out, in] order (see mxfp4.py): accepted on import.
* transformers 5 fused experts (``save_pretrained(save_original_format=False)``, and what
  transformers holds in memory): mlp.experts.gate_up_proj [E, 2I, H] (gate rows first) and
  mlp.experts.down_proj [E, H, I] for DeepSeek/Qwen3/Mixtral (Mixtral then uses ``mlp.`` for
  ``block_sparse_moe.``): accepted on import, per layer. Export writes the per-expert form of
  the released checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moetrain.config.schema import Config


@dataclass
class Piece:
    ours: Optional[str]  # our parameter/buffer name; None: an HF-only copy of `copy_of`
    hf: tuple[str, ...]  # HF tensor names (export writes these; import reads them)
    index: Optional[tuple] = None  # where in `ours` (None: the whole tensor)
    load: Optional[Callable] = None  # list of HF tensors -> our slice (default: the one tensor)
    save: Optional[Callable] = None  # our slice -> list of HF tensors (default: [slice])
    shapes: Optional[tuple] = None  # expected HF shapes for import-only forms (else from `save`)
    copy_of: Optional[str] = None  # for ours=None: the moetrain tensor this HF tensor duplicates
    per_expert: bool = False  # load() maps expert e's HF slices to our [e] slice, one expert at a time


# ---- transforms -------------------------------------------------------------------------------

def _rope_order(rope: int, inverse: bool) -> torch.Tensor:
    order = torch.tensor(list(range(0, rope, 2)) + list(range(1, rope, 2)))
    return torch.argsort(order) if inverse else order


def permute_rope_rows(t: torch.Tensor, block: int, offset: int, rope: int, inverse: bool = False) -> torch.Tensor:
    """Rows of t [n*block, ...]: in each block of ``block`` rows, rows offset..offset+rope-1 go
    from HF's interleaved rope order to half-split (inverse: back)."""
    v = t.reshape(-1, block, *t.shape[1:])
    out = v.clone()
    out[:, offset:offset + rope] = v[:, offset + _rope_order(rope, inverse).to(t.device)]
    return out.reshape(t.shape)


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., 2n, ...] with gate/up alternating on ``dim`` -> [gate (n) | up (n)] (gate = even)."""
    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(t.device)
    return t.index_select(dim, order)


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of ``deinterleave``: [gate | up] -> alternating gate, up on ``dim``."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _first(ts):
    return ts[0]


# ---- layouts ----------------------------------------------------------------------------------

class _Builder:
    def __init__(self, cfg: Config, model_type: str, hf: dict, keys: Optional[set]):
        self.cfg, self.mt, self.hf, self.keys = cfg, model_type, hf, keys
        self.pieces: list[Piece] = []
        self.deepseek = model_type in ("deepseek_v2", "deepseek_v3")
        self.interleaved = self.deepseek and (model_type == "deepseek_v2" or hf.get("rope_interleave", True))

    def add(self, ours, hf, **kw):
        self.pieces.append(Piece(ours, (hf,) if isinstance(hf, str) else tuple(hf), **kw))

    def has(self, name: str) -> bool:
        return self.keys is not None and name in self.keys

    # -- attention --
    def attention(self, p: str, o: str):
        m = self.cfg.model
        if not self.deepseek:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                self.add(f"{o}.attn.{proj}.weight", f"{p}.self_attn.{proj}.weight")
            out_bias = m.attention_bias if m.attention_out_bias is None else m.attention_out_bias
            for proj, on in (("q_proj", m.attention_bias), ("k_proj", m.attention_bias),
                             ("v_proj", m.attention_bias), ("o_proj", out_bias)):
                if on:
                    self.add(f"{o}.attn.{proj}.bias", f"{p}.self_attn.{proj}.bias")
            if m.qk_norm:
                self.add(f"{o}.attn.q_norm.weight", f"{p}.self_attn.q_norm.weight")
                self.add(f"{o}.attn.k_norm.weight", f"{p}.self_attn.k_norm.weight")
            if m.attention_sinks:
                self.add(f"{o}.attn.sinks", f"{p}.self_attn.sinks")
            return
        nope, rope, kvl = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        q_kw, kv_kw = {}, {}
        if self.interleaved:
            q_kw = dict(load=lambda ts: permute_rope_rows(ts[0], nope + rope, nope, rope),
                        save=lambda t: [permute_rope_rows(t, nope + rope, nope, rope, inverse=True)])
            kv_kw = dict(load=lambda ts: permute_rope_rows(ts[0], kvl + rope, kvl, rope),
                         save=lambda t: [permute_rope_rows(t, kvl + rope, kvl, rope, inverse=True)])
        if m.q_lora_rank:
            self.add(f"{o}.attn.q_a_proj.weight", f"{p}.self_attn.q_a_proj.weight")
            self.add(f"{o}.attn.q_a_norm.weight", f"{p}.self_attn.q_a_layernorm.weight")
            self.add(f"{o}.attn.q_b_proj.weight", f"{p}.self_attn.q_b_proj.weight", **q_kw)
        else:
            self.add(f"{o}.attn.q_proj.weight", f"{p}.self_attn.q_proj.weight", **q_kw)
        self.add(f"{o}.attn.kv_a_proj.weight", f"{p}.self_attn.kv_a_proj_with_mqa.weight", **kv_kw)
        self.add(f"{o}.attn.kv_a_norm.weight", f"{p}.self_attn.kv_a_layernorm.weight")
        self.add(f"{o}.attn.kv_b_proj.weight", f"{p}.self_attn.kv_b_proj.weight")
        self.add(f"{o}.attn.o_proj.weight", f"{p}.self_attn.o_proj.weight")

    # -- feed-forward --
    def swiglu_mlp(self, ours: str, p: str):
        """A dense SwiGLU MLP: our gate_proj/up_proj/down_proj are HF's, one to one."""
        for proj in ("gate_proj", "up_proj", "down_proj"):
            self.add(f"{ours}.{proj}.weight", f"{p}.{proj}.weight")

    def moe(self, p: str, o: str):
        e = self.cfg.moe
        E, I = e.num_experts, e.moe_ffn_hidden_size
        mixtral = self.mt == "mixtral"
        fused = self.has(f"{p}.mlp.experts.gate_up_proj") and self.mt != "gpt_oss"
        block = f"{p}.block_sparse_moe" if mixtral and not fused else f"{p}.mlp"
        router = "router" if self.mt == "gpt_oss" else "gate"
        self.add(f"{o}.mlp.router.weight", f"{block}.{router}.weight")
        if e.router_bias:
            self.add(f"{o}.mlp.router.bias", f"{block}.{router}.bias")
        if e.expert_bias:
            self.add(f"{o}.mlp.router.expert_bias", f"{block}.gate.e_score_correction_bias")
        elif self.mt == "deepseek_v3":  # HF V3 always has the bias: write zeros (same network)
            self.add(None, f"{block}.gate.e_score_correction_bias", copy_of=f"zeros:{E}")
        ex = f"{o}.mlp.experts"
        if self.mt == "gpt_oss":
            self.gpt_oss_experts(block, ex)
        elif fused:
            self.add(f"{ex}.w1", f"{block}.experts.gate_up_proj")
            self.add(f"{ex}.w2", f"{block}.experts.down_proj")
        else:
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            g, u, d = names
            for k in range(E):
                q = f"{block}.experts.{k}"
                self.add(f"{ex}.w1", f"{q}.{g}.weight", index=(k, slice(0, I)))
                self.add(f"{ex}.w1", f"{q}.{u}.weight", index=(k, slice(I, 2 * I)))
                self.add(f"{ex}.w2", f"{q}.{d}.weight", index=(k,))
        if self.cfg.shared_ffn_size > 0:
            self.swiglu_mlp(f"{o}.mlp.shared", f"{block}.shared_experts")

    def gpt_oss_experts(self, block: str, ex: str):
        e = self.cfg.moe
        E, I, H = e.num_experts, e.moe_ffn_hidden_size, self.cfg.model.hidden_size
        q = f"{block}.experts"
        # Loaded one expert at a time (per_expert): the transient is one expert, not a
        # dequantized / transposed copy of the whole [E, ...] tensor.
        if self.has(f"{q}.gate_up_proj_blocks"):
            from moetrain.models.mxfp4 import dequantize_mxfp4

            def mx(ts):  # one expert: [out, in/32, 16] + [out, in/32] -> [out, in]
                return dequantize_mxfp4(ts[0], ts[1], dtype=torch.float32)

            self.add(f"{ex}.w1", (f"{q}.gate_up_proj_blocks", f"{q}.gate_up_proj_scales"),
                     per_expert=True, load=lambda ts: deinterleave(mx(ts), 0),
                     shapes=((E, 2 * I, H // 32, 16), (E, 2 * I, H // 32)))
            self.add(f"{ex}.w2", (f"{q}.down_proj_blocks", f"{q}.down_proj_scales"),
                     per_expert=True, load=mx, shapes=((E, H, I // 32, 16), (E, H, I // 32)))
        else:
            self.add(f"{ex}.w1", f"{q}.gate_up_proj", per_expert=True, load=lambda ts: deinterleave(ts[0].T, 0),
                     save=lambda t: [interleave(t, 1).transpose(1, 2)])
            self.add(f"{ex}.w2", f"{q}.down_proj", per_expert=True, load=lambda ts: ts[0].T,
                     save=lambda t: [t.transpose(1, 2)])
        self.add(f"{ex}.b1", f"{q}.gate_up_proj_bias", load=lambda ts: deinterleave(ts[0], 1),
                 save=lambda t: [interleave(t, 1)])
        self.add(f"{ex}.b2", f"{q}.down_proj_bias")

    def block(self, p: str, o: str, moe: bool):
        self.add(f"{o}.input_norm.weight", f"{p}.input_layernorm.weight")
        self.add(f"{o}.post_attn_norm.weight", f"{p}.post_attention_layernorm.weight")
        self.attention(p, o)
        if moe:
            self.moe(p, o)
        else:
            self.swiglu_mlp(f"{o}.mlp", f"{p}.mlp")

    def build(self) -> list[Piece]:
        cfg = self.cfg
        m = cfg.model
        self.add("embed.weight", "model.embed_tokens.weight")
        for i in range(m.num_layers):
            self.block(f"model.layers.{i}", f"layers.{i}", cfg.is_moe_layer(i))
        self.add("final_norm.weight", "model.norm.weight")
        if not m.tie_embeddings:
            self.add("head.weight", "lm_head.weight")
        for d in range(m.mtp_num_layers):
            p, o = f"model.layers.{m.num_layers + d}", f"mtp.{d}"
            for name in ("enorm", "hnorm", "eh_proj"):
                self.add(f"{o}.{name}.weight", f"{p}.{name}.weight")
            self.add(f"{o}.final_norm.weight", f"{p}.shared_head.norm.weight")
            self.add(None, f"{p}.embed_tokens.weight", copy_of="embed.weight")
            self.add(None, f"{p}.shared_head.head.weight", copy_of="embed.weight" if m.tie_embeddings else "head.weight")
            self.block(p, f"{o}.block", cfg.is_moe)
        return self.pieces


def layout(cfg: Config, model_type: str, hf: dict, keys: Optional[set] = None) -> list[Piece]:
    """The pieces of ``cfg`` in ``model_type``'s HF format. ``keys`` (the checkpoint's tensor
    names, on import) selects among accepted input forms; None gives the export form."""
    return _Builder(cfg, model_type, hf, keys).build()


def ignorable(cfg: Config, model_type: str, hf: dict, name: str) -> bool:
    """HF tensors an import may skip: MTP layers beyond the depths kept, rotary caches."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    parts = name.split(".")
    if model_type == "deepseek_v3" and len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        layer = int(parts[2])
        L = cfg.model.num_layers
        n_hf = hf.get("num_nextn_predict_layers") or 0
        return L + cfg.model.mtp_num_layers <= layer < L + n_hf
    return False


def load_piece(piece: Piece, tensors: list, dest: torch.Tensor) -> None:
    """Copy the HF ``tensors`` of ``piece`` into ``dest`` (our slice), transformed."""
    load = piece.load or _first
    if piece.per_expert:
        for e in range(dest.shape[0]):
            dest[e].copy_(load([t[e] for t in tensors]))
    else:
        dest.copy_(load(tensors))


def save_piece(piece: Piece, t: torch.Tensor) -> list:
    return piece.save(t) if piece.save else [t]
