"""Hugging Face config.json <-> moetrain architecture keys.

Imports no torch: ``moetrain.config.load`` uses this module to resolve ``model.from_hf`` for
commands that never build a model (``config show``, ``model info``).

Families (HF ``model_type``): deepseek_v2, deepseek_v3, qwen3_moe, mixtral, gpt_oss.

* ``arch_from_hf(hf)`` gives every *architecture key* (the model.* and moe.* keys that shape
  the network, see ``ARCH_KEYS``) as a dict of dotted keys; keys a family does not use get
  the schema defaults. ``hints_from_hf`` gives soft defaults (name, init_std, aux loss) that
  any explicit setting overrides.
* ``hf_config_from_cfg(cfg, model_type, base)`` is the inverse, used by export; it refuses
  (UserError naming the keys) configs the family cannot express, checked by a round trip.
* the weights' files are listed by ``moetrain.models.hf_files.CheckpointFiles`` (headers only).

Deliberate deviations from transformers 5.17 (none affects a released checkpoint):
DeepSeek-V2's ``norm_topk_prob`` and DeepSeek's ``moe_layer_freq`` are honoured on import, as
DeepSeek's own code does (transformers ignores them; every released config has norm_topk_prob
false on V2 and moe_layer_freq 1; export refuses the layer patterns transformers would build
differently); DeepSeek's q/kv latent norms use model.norm_eps while HF hard-codes 1e-6 (equal
for every released config: a warning says so otherwise).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

from moetrain.config.schema import Config, ModelConfig, MoEConfig
from moetrain.errors import UserError
from moetrain.models.hf_files import CheckpointFiles, mtp_layers_present

# model_type -> the architecture class written to config.json
FAMILIES = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")

# model.*/moe.* keys that do not shape the network (training choices); every other key of
# those two sections is an architecture key and comes from the HF config.
NOT_ARCH = {
    "model.name", "model.from_hf", "model.mtp_loss_scale", "model.init_std", "model.fused_rope",
    "moe.expert_bias_update_rate", "moe.aux_loss_coeff", "moe.aux_loss_type", "moe.z_loss_coeff",
    "moe.capacity_factor", "moe.force_balance", "moe.backend",
}
_SECTIONS = (("model", ModelConfig), ("moe", MoEConfig))
ARCH_KEYS = [f"{s}.{f.name}" for s, cls in _SECTIONS for f in dataclasses.fields(cls)
             if f"{s}.{f.name}" not in NOT_ARCH]
_DEFAULTS = {f"{s}.{f.name}": getattr(cls(), f.name) for s, cls in _SECTIONS for f in dataclasses.fields(cls)}

SUPPORTED_TEXT = ", ".join(f"{cls} ({mt})" for mt, cls in FAMILIES.items())


# ---- reading config.json ----------------------------------------------------------------------

def read_hf_config(path: str | Path) -> dict:
    """The parsed config.json of a HF checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise UserError(f"{path}: no such Hugging Face checkpoint directory")
    if not file.is_file():
        raise UserError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{file}: cannot read the Hugging Face config ({err})") from None
    if not isinstance(data, dict):
        raise UserError(f"{file}: expected a JSON object")
    return data


def model_type_of(hf: dict, where: str = "config.json") -> str:
    """The family of a HF config; UserError naming the architecture when it is not supported."""
    mt = hf.get("model_type")
    if mt in FAMILIES:
        return mt
    archs = hf.get("architectures") or []
    for mt2, cls in FAMILIES.items():
        if cls in archs:
            return mt2
    name = ", ".join(archs) or "unknown architecture"
    raise UserError(f"{where}: unsupported architecture {name} (model_type {mt!r}); supported: {SUPPORTED_TEXT}")


def _need(hf: dict, key: str, where: str, *alts: str):
    for k in (key, *alts):
        if hf.get(k) is not None:
            return hf[k]
    raise UserError(f"{where}: missing {key!r}")


def _rope(hf: dict, mt: str, where: str) -> dict:
    """RoPE keys (YaRN scales: see ``_yarn_mscales``)."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rp.get("rope_type") or rp.get("type") or "default"
    out = {k: _DEFAULTS[k] for k in ARCH_KEYS if k.startswith(("model.rope_", "model.yarn_"))}
    out["model.rope_theta"] = float(theta)
    if kind == "default":
        return out
    if kind != "yarn":
        raise UserError(f"{where}: RoPE type {kind!r} is not supported (supported: default, yarn)")
    orig = rp.get("original_max_position_embeddings")
    if orig is None:
        raise UserError(f"{where}: yarn RoPE needs original_max_position_embeddings")
    factor = rp.get("factor")
    if factor is None:
        factor = _need(hf, "max_position_embeddings", where) / orig
    ym, ya = _yarn_mscales(rp, float(factor), mt, where)
    out.update({
        "model.rope_scaling": "yarn", "model.rope_scaling_factor": float(factor),
        "model.rope_original_max_position": int(orig),
        "model.yarn_beta_fast": float(rp.get("beta_fast") or 32.0),
        "model.yarn_beta_slow": float(rp.get("beta_slow") or 1.0),
        "model.yarn_mscale": ym, "model.yarn_mscale_all_dim": ya,
        "model.yarn_truncate": bool(rp.get("truncate", True)),
    })
    return out


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_mscales(rp: dict, factor: float, mt: str, where: str) -> tuple[float, float]:
    """(model.yarn_mscale, model.yarn_mscale_all_dim) for the YaRN ``rp`` of a HF config.

    transformers scales cos/sin by ``attention_factor`` when given, else by mscale(s, mscale) /
    mscale(s, mscale_all_dim) when both are set, else by mscale(s, 1); DeepSeek's softmax scale
    is also x mscale(s, mscale_all_dim)^2. moetrain scales cos/sin by mscale(s, yarn_mscale) /
    mscale(s, yarn_mscale_all_dim), with the same softmax factor: yarn_mscale_all_dim is
    mscale_all_dim and yarn_mscale solves for the cos/sin factor.
    """
    mscale, all_dim, given = rp.get("mscale"), rp.get("mscale_all_dim"), rp.get("attention_factor")
    if all_dim and mt not in DEEPSEEK:
        raise UserError(f"{where}: yarn mscale_all_dim is only supported for the DeepSeek families")
    ya = float(all_dim or 0.0)
    if given is None:
        if mscale and all_dim:
            return float(mscale), ya
        if all_dim:
            raise UserError(f"{where}: yarn mscale_all_dim without mscale is not supported")
        return 1.0, 0.0
    if mscale is not None and math.isclose(_mscale(factor, mscale) / _mscale(factor, ya), given, rel_tol=1e-9):
        return float(mscale), ya  # the exact value, when the config carries it (as our export writes)
    if factor <= 1:
        if math.isclose(given, 1.0, rel_tol=1e-9):
            return 1.0, ya
        raise UserError(f"{where}: yarn attention_factor = {given} with factor {factor} <= 1 is not supported "
                        "(only 1.0: YaRN does not scale unscaled positions)")
    return (given * _mscale(factor, ya) - 1.0) / (0.1 * math.log(factor)), ya


def _yarn_mscale_keys(m: ModelConfig) -> dict[str, float]:
    """The rope_parameters keys for our YaRN scales: ``mscale`` (when not 1, or beside
    mscale_all_dim: our import reads it back exactly), ``mscale_all_dim`` (when set) and
    ``attention_factor`` when transformers would infer another cos/sin factor from those two."""
    f, ym, ya = m.rope_scaling_factor, m.yarn_mscale, m.yarn_mscale_all_dim
    keys = {}
    if ya or ym != 1.0:
        keys["mscale"] = ym
    if ya:
        keys["mscale_all_dim"] = ya
    ours = _mscale(f, ym) / _mscale(f, ya)
    inferred = ours if ym and ya else _mscale(f, 1.0)
    if not math.isclose(ours, inferred, rel_tol=1e-12):
        keys["attention_factor"] = ours
    return keys


def _layer_pattern(moe_layers: list[bool], where: str) -> tuple[int, int]:
    """(first_k_dense, layer_freq) reproducing which layers are MoE, or UserError."""
    L = len(moe_layers)
    for k in range(L):
        for f in range(1, L + 1):
            if all(moe_layers[i] == (i >= k and (i - k) % f == 0) for i in range(L)):
                return k, f
    raise UserError(f"{where}: the MoE/dense layer pattern {moe_layers} cannot be expressed as "
                    "moe.first_k_dense + moe.layer_freq")


def _deepseek_layers(hf: dict, L: int, where: str) -> tuple[int, int]:
    """(first_k_dense, layer_freq) of a DeepSeek config: layer i is MoE when i >= first_k_dense_replace
    and i % moe_layer_freq == 0, as in DeepSeek's code (transformers ignores moe_layer_freq)."""
    k, f = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
    if f == 1 or k >= L:
        return k, f
    return _layer_pattern([i >= k and i % f == 0 for i in range(L)], where)


def _window_every(windowed: list[bool], where: str) -> int | None:
    """sliding_window_every k with windowed[i] == (i % k == 0), None when no layer is windowed."""
    if not any(windowed):
        return None
    for k in range(1, len(windowed) + 1):
        if all(w == (i % k == 0) for i, w in enumerate(windowed)):
            return k
    raise UserError(f"{where}: the sliding-window layer pattern {windowed} cannot be expressed as "
                    "model.sliding_window_every")


def arch_from_hf(hf: dict, *, mtp_layers: int | None = None, where: str = "config.json") -> dict[str, Any]:
    """Every architecture key (dotted) for a HF config. ``mtp_layers``: DeepSeek-V3 MTP depths whose
    weights exist (None: trust num_nextn_predict_layers)."""
    mt = model_type_of(hf, where)
    a = {k: _DEFAULTS[k] for k in ARCH_KEYS}
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}: hidden_act {act!r} is not supported (only silu / SwiGLU)")
    L = _need(hf, "num_hidden_layers", where)
    nh = _need(hf, "num_attention_heads", where)
    H = _need(hf, "hidden_size", where)
    a.update({
        "model.vocab_size": _need(hf, "vocab_size", where), "model.hidden_size": H, "model.num_layers": L,
        "model.num_attention_heads": nh, "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "model.activation": "swiglu", "model.mtp_num_layers": 0,
    })
    a.update(_rope(hf, mt, where))

    if mt in DEEPSEEK:
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise UserError(f"{where}: DeepSeek attention/MLP biases are not supported")
        if mt == "deepseek_v3" and hf.get("n_group") is None:
            raise UserError(f"{where}: deepseek_v3 needs n_group")
        a.update({
            "model.attention_type": "mla", "model.q_lora_rank": hf.get("q_lora_rank"),
            "model.kv_lora_rank": _need(hf, "kv_lora_rank", where),
            "model.qk_nope_head_dim": _need(hf, "qk_nope_head_dim", where),
            "model.qk_rope_head_dim": _need(hf, "qk_rope_head_dim", where),
            "model.v_head_dim": _need(hf, "v_head_dim", where),
            "model.ffn_hidden_size": _need(hf, "intermediate_size", where),
        })
        if a["model.norm_eps"] != 1e-6:
            warnings.warn(f"{where}: rms_norm_eps = {a['model.norm_eps']}: HF DeepSeek uses 1e-6 in the q/kv "
                          "latent norms, moetrain uses model.norm_eps everywhere (logits differ slightly)")
        a.update({
            "moe.num_experts": _need(hf, "n_routed_experts", where, "num_experts", "num_local_experts"),
            "moe.moe_ffn_hidden_size": _need(hf, "moe_intermediate_size", where),
            "moe.topk": _need(hf, "num_experts_per_tok", where),
            "moe.num_shared_experts": hf.get("n_shared_experts") or 0,
            "moe.normalize_topk": bool(hf.get("norm_topk_prob", False)),
            "moe.scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        })
        a["moe.first_k_dense"], a["moe.layer_freq"] = _deepseek_layers(hf, L, where)
        ng, tg = hf.get("n_group"), hf.get("topk_group")
        if mt == "deepseek_v3":  # sigmoid scores, aux-free bias, top-2-sum group ranking, MTP
            a.update({"moe.score_function": "sigmoid", "moe.expert_bias": True, "moe.group_score": "top2_sum"})
            grouped = ng is not None and ng > 1
            n_mtp = hf.get("num_nextn_predict_layers") or 0
            a["model.mtp_num_layers"] = n_mtp if mtp_layers is None else min(n_mtp, mtp_layers)
        else:  # softmax scores, groups ranked by their best expert
            a.update({"moe.score_function": "softmax", "moe.group_score": "max"})
            method = hf.get("topk_method", "greedy")
            if method not in ("greedy", "group_limited_greedy"):
                raise UserError(f"{where}: deepseek_v2 topk_method {method!r} is not supported "
                                "(supported: greedy, group_limited_greedy)")
            grouped = method == "group_limited_greedy" and ng is not None and ng > 1
        if grouped:  # one group (n_group 1) limits nothing
            a.update({"moe.num_groups": ng, "moe.topk_groups": tg})
        return a

    # GQA families
    hd = hf.get("head_dim") or H // nh
    a.update({
        "model.attention_type": "gqa", "model.num_query_groups": hf.get("num_key_value_heads") or nh,
        "model.head_dim": hd, "model.ffn_hidden_size": _need(hf, "intermediate_size", where),
        "model.attention_bias": bool(hf.get("attention_bias", False)),
    })
    a.update({"moe.num_experts": _need(hf, "num_local_experts", where, "num_experts"),
              "moe.topk": _need(hf, "num_experts_per_tok", where), "moe.score_function": "softmax"})
    window = hf.get("sliding_window")
    if mt == "mixtral":
        a.update({"moe.moe_ffn_hidden_size": hf["intermediate_size"], "moe.normalize_topk": True})
        if window is not None:
            a["model.sliding_window"], a["model.sliding_window_every"] = window, 1
    elif mt == "qwen3_moe":
        step, only = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
        k, f = _layer_pattern([i not in only and (i + 1) % step == 0 for i in range(L)], where)
        a.update({"moe.moe_ffn_hidden_size": _need(hf, "moe_intermediate_size", where),
                  "moe.normalize_topk": bool(hf.get("norm_topk_prob", False)), "model.qk_norm": True,
                  "moe.first_k_dense": k, "moe.layer_freq": f})
        if window is not None and hf.get("use_sliding_window", False):
            a["model.sliding_window"], a["model.sliding_window_every"] = window, 1
    else:  # gpt_oss
        limit = hf.get("swiglu_limit", 7.0)
        if limit != 7.0:
            raise UserError(f"{where}: gpt_oss swiglu_limit = {limit} is not supported (only 7.0)")
        a.update({"moe.moe_ffn_hidden_size": hf["intermediate_size"], "moe.normalize_topk": True,
                  "moe.router_bias": True, "moe.expert_linear_bias": True, "moe.activation": "swiglu_clamped",
                  "model.attention_sinks": True})
        types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
        every = _window_every([t == "sliding_attention" for t in types], where)
        if every is not None and window is not None:
            a["model.sliding_window"], a["model.sliding_window_every"] = window, every
    return a


def hints_from_hf(hf: dict, name: str) -> dict[str, Any]:
    """Soft defaults from a HF config (used unless the user sets them): name, init_std, aux loss."""
    out = {"model.name": name}
    if hf.get("initializer_range") is not None:
        out["model.init_std"] = float(hf["initializer_range"])
    coeff = hf.get("router_aux_loss_coef", hf.get("aux_loss_alpha"))
    if coeff is not None:
        out["moe.aux_loss_coeff"] = float(coeff)
    if hf.get("seq_aux") is not None:
        out["moe.aux_loss_type"] = "sequence" if hf["seq_aux"] else "batch"
    return out


def cfg_arch(cfg: Config) -> dict[str, Any]:
    """The architecture keys of a Config as a dotted dict."""
    return {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in ARCH_KEYS}


def effective_arch(a: dict[str, Any]) -> dict[str, Any]:
    """Architecture keys with derived values filled in and keys that do not affect the network
    blanked (None), so that two spellings of the same network compare equal."""
    a = dict(a)
    gqa = a["model.attention_type"] == "gqa"
    mla_keys = ["model.q_lora_rank", "model.kv_lora_rank", "model.qk_nope_head_dim", "model.qk_rope_head_dim",
                "model.v_head_dim"]
    if gqa:
        a["model.num_query_groups"] = a["model.num_query_groups"] or a["model.num_attention_heads"]
        a["model.head_dim"] = a["model.head_dim"] or a["model.hidden_size"] // a["model.num_attention_heads"]
        if a["model.attention_out_bias"] is None:
            a["model.attention_out_bias"] = a["model.attention_bias"]
        blank = mla_keys
    else:
        blank = ["model.num_query_groups", "model.head_dim", "model.qk_norm", "model.attention_bias",
                 "model.attention_out_bias", "model.attention_sinks"]
    if a["model.rope_scaling"] is None:
        blank += [k for k in a if k.startswith("model.yarn_") or k in ("model.rope_scaling_factor",
                                                                       "model.rope_original_max_position")]
    elif a["model.yarn_truncate"] is None:
        a["model.yarn_truncate"] = not (gqa and a["model.attention_sinks"])
    if a["model.sliding_window"] is None:
        blank.append("model.sliding_window_every")
    E, L = a["moe.num_experts"], a["model.num_layers"]
    if E == 0:
        blank += [k for k in a if k.startswith("moe.")]
    else:
        shared = a["moe.shared_expert_ffn_hidden_size"]
        if shared is None:
            shared = a["moe.num_shared_experts"] * a["moe.moe_ffn_hidden_size"]
        a["moe.shared_expert_ffn_hidden_size"], a["moe.num_shared_experts"] = shared, None
        if a["moe.num_groups"] is None:
            blank.append("moe.group_score")
        k, f = a["moe.first_k_dense"], a["moe.layer_freq"]
        moe_layers = [i >= k and (i - k) % f == 0 for i in range(L)]
        if all(moe_layers):
            a["moe.first_k_dense"], a["moe.layer_freq"] = 0, 1
            blank += ["model.ffn_hidden_size", "model.activation"]  # no dense MLP anywhere
        elif any(moe_layers):  # the smallest (k, f) giving the same MoE layers
            a["moe.first_k_dense"], a["moe.layer_freq"] = _layer_pattern(moe_layers, "")
    for key in blank:
        a[key] = None
    return a


# ---- export: Config -> config.json -------------------------------------------------------------

def infer_model_type(cfg: Config) -> str:
    """The HF family whose format fits a Config trained from scratch."""
    m, e = cfg.model, cfg.moe
    if e.num_experts == 0:
        raise UserError("Hugging Face export supports MoE models only (moe.num_experts = 0)")
    if m.attention_type == "mla":
        if e.score_function == "sigmoid" or e.expert_bias or m.mtp_num_layers:
            return "deepseek_v3"
        return "deepseek_v2"
    if m.attention_sinks or e.router_bias or e.expert_linear_bias or e.activation == "swiglu_clamped":
        return "gpt_oss"
    if m.qk_norm or m.attention_bias or e.first_k_dense or e.layer_freq > 1 or not e.normalize_topk:
        return "qwen3_moe"
    return "mixtral"


def hf_config_from_cfg(cfg: Config, model_type: str, base: dict | None = None, *, dtype: str = "float32",
                       drop_mtp: bool = False) -> dict:
    """config.json for ``cfg`` in family ``model_type``; ``base`` (the original config.json, if
    any) keeps the keys moetrain does not model (token ids, max positions, ...).
    UserError naming the keys when the family cannot express ``cfg``."""
    if model_type not in FAMILIES:
        raise UserError(f"unsupported Hugging Face family {model_type!r}; supported: {SUPPORTED_TEXT}")
    m, e = cfg.model, cfg.moe
    if m.mtp_num_layers and model_type != "deepseek_v3" and not drop_mtp:
        raise UserError(f"model.mtp_num_layers = {m.mtp_num_layers}: the {model_type} format has no MTP weights; "
                        "drop them (--drop-mtp / drop_mtp=True) or export as deepseek_v3")
    hf = {k: v for k, v in (base or {}).items()
          if k not in ("quantization_config", "torch_dtype", "rope_scaling", "rope_theta", "rope_parameters")}
    hf.update({
        "architectures": [FAMILIES[model_type]], "model_type": model_type, "dtype": dtype,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu", "initializer_range": m.init_std,
    })
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "yarn":
        rope.update({"rope_type": "yarn", "factor": m.rope_scaling_factor,
                     "original_max_position_embeddings": m.rope_original_max_position,
                     "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow,
                     "truncate": effective_arch(cfg_arch(cfg))["model.yarn_truncate"]})
        rope.update(_yarn_mscale_keys(m))
        hf.setdefault("max_position_embeddings", int(m.rope_original_max_position * m.rope_scaling_factor))
    hf["rope_parameters"] = rope  # transformers 5; the legacy keys below for older readers
    hf["rope_theta"] = m.rope_theta
    hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"} if m.rope_scaling else None
    hf.setdefault("max_position_embeddings", 4096)
    hf["router_aux_loss_coef"] = e.aux_loss_coeff
    moe_layers = [cfg.is_moe_layer(i) for i in range(m.num_layers)]
    window = m.sliding_window

    if model_type in DEEPSEEK:
        _check_deepseek_layers(cfg, moe_layers, model_type)
        shared = cfg.shared_ffn_size
        hf.update({
            "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim,
            "qk_head_dim": m.qk_nope_head_dim + m.qk_rope_head_dim,
            "num_key_value_heads": m.num_attention_heads, "intermediate_size": m.ffn_hidden_size,
            "moe_intermediate_size": e.moe_ffn_hidden_size, "n_routed_experts": e.num_experts,
            "n_shared_experts": shared // e.moe_ffn_hidden_size if shared % e.moe_ffn_hidden_size == 0 else -1,
            "num_experts_per_tok": e.topk, "first_k_dense_replace": e.first_k_dense,
            "moe_layer_freq": 1, "norm_topk_prob": e.normalize_topk,
            "routed_scaling_factor": e.scaling_factor, "attention_bias": False,
            "aux_loss_alpha": e.aux_loss_coeff, "seq_aux": e.aux_loss_type == "sequence",
        })
        hf.pop("router_aux_loss_coef")
        if model_type == "deepseek_v3":
            hf.update({"n_group": e.num_groups or 1, "topk_group": e.topk_groups or 1, "scoring_func": "sigmoid",
                       "topk_method": "noaux_tc", "num_nextn_predict_layers": 0 if drop_mtp else m.mtp_num_layers})
            hf.setdefault("rope_interleave", True)
        else:
            hf.update({"n_group": e.num_groups, "topk_group": e.topk_groups, "scoring_func": "softmax",
                       "topk_method": "group_limited_greedy" if e.num_groups else "greedy"})
    else:
        hf.update({"num_key_value_heads": cfg.kv_heads, "head_dim": cfg.attn_head_dim,
                   "num_experts_per_tok": e.topk})
        if model_type == "mixtral":
            hf.update({"intermediate_size": e.moe_ffn_hidden_size, "num_local_experts": e.num_experts,
                       "sliding_window": window})
        elif model_type == "qwen3_moe":
            hf.pop("num_local_experts", None)
            hf.update({"intermediate_size": m.ffn_hidden_size, "moe_intermediate_size": e.moe_ffn_hidden_size,
                       "num_experts": e.num_experts, "norm_topk_prob": e.normalize_topk,
                       "decoder_sparse_step": 1, "mlp_only_layers": [i for i, x in enumerate(moe_layers) if not x],
                       "attention_bias": m.attention_bias, "use_sliding_window": window is not None,
                       "sliding_window": window})
        else:
            every = m.sliding_window_every
            hf.update({"intermediate_size": e.moe_ffn_hidden_size, "num_local_experts": e.num_experts,
                       "attention_bias": m.attention_bias, "swiglu_limit": 7.0, "sliding_window": window or 128,
                       "layer_types": ["sliding_attention" if window is not None and i % every == 0
                                       else "full_attention" for i in range(m.num_layers)]})
    _check_round_trip(cfg, hf, model_type, drop_mtp)
    return hf


def _check_deepseek_layers(cfg: Config, moe_layers: list[bool], model_type: str) -> None:
    """transformers' DeepSeek models are MoE on every layer from first_k_dense_replace on (they
    ignore moe_layer_freq): refuse any other pattern instead of writing one they would misread."""
    k = moe_layers.index(True) if any(moe_layers) else len(moe_layers)
    if moe_layers != [i >= k for i in range(len(moe_layers))]:
        moe = [i for i, x in enumerate(moe_layers) if x]
        raise UserError(f"moe.layer_freq = {cfg.moe.layer_freq} cannot be written in the Hugging Face {model_type} "
                        f"format: transformers makes every layer from first_k_dense_replace on MoE (it ignores "
                        f"moe_layer_freq) but this model's MoE layers are {moe} of {len(moe_layers)}; only "
                        "moe.layer_freq = 1 (MoE on every layer from moe.first_k_dense on) can be exported")


def _check_round_trip(cfg: Config, hf: dict, model_type: str, drop_mtp: bool) -> None:
    want = cfg_arch(cfg)
    if drop_mtp:
        want["model.mtp_num_layers"] = 0
    if model_type == "deepseek_v3" and not cfg.moe.expert_bias:
        want["moe.expert_bias"] = True  # exported as an all-zero e_score_correction_bias: same network
    got = effective_arch(arch_from_hf(hf, where=f"{model_type} export"))
    want = effective_arch(want)
    bad = [k for k in ARCH_KEYS if want[k] != got[k]]
    if bad:
        listed = "; ".join(f"{k} = {want[k]!r} would become {got[k]!r}" for k in bad)
        raise UserError(f"this model cannot be written in the Hugging Face {model_type} format: {listed}")


# ---- moetrain model directories (written by `moetrain convert hf-to-moetrain`) ---------------------

MOETRAIN_CONFIG = "config.yaml"


def is_moetrain_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / MOETRAIN_CONFIG).is_file() and not (p / "config.json").is_file()


def source_arch(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(architecture keys, hints, label) of a ``model.from_hf`` directory: a HF checkpoint or a
    moetrain model directory."""
    p = Path(path)
    if is_moetrain_dir(p):
        from moetrain.config.load import load_config

        cfg = load_config(path=str(p / MOETRAIN_CONFIG))
        hints = {"model.name": cfg.model.name, "model.init_std": cfg.model.init_std}
        return cfg_arch(cfg), hints, str(p / MOETRAIN_CONFIG)
    hf = read_hf_config(p)
    label = str(p / "config.json")
    mt = model_type_of(hf, label)
    mtp = mtp_layers_present(CheckpointFiles(p), hf) if mt == "deepseek_v3" else None
    return arch_from_hf(hf, mtp_layers=mtp, where=label), hints_from_hf(hf, p.resolve().name), label
