"""`moetrain model info`: parameter counts and training FLOPs of a config, as JSON or a table.

Pure accounting from the config (moetrain.models.accounting); imports no torch.
"""

from __future__ import annotations

import io
import json

from moetrain.config.schema import Config
from moetrain.models.accounting import COMPONENTS, count_params, flops_per_token


def model_info(cfg: Config) -> dict:
    """Everything `model info` reports, as plain JSON-able values.

    Stable keys (add, never rename): total_params, active_params, train_flops_per_token,
    breakdown {component: {total, active}}, mtp_included, total_params_with_mtp,
    active_params_with_mtp, active_params_no_embedding, seq_length, flops.
    """
    counts = count_params(cfg)
    flops = flops_per_token(cfg)
    out = {"name": cfg.model.name}
    out.update(counts.to_dict())
    out["train_flops_per_token"] = flops.train
    out["seq_length"] = flops.seq_length
    out["flops"] = {
        "forward_per_token": flops.forward,
        "matmul_forward_per_token": flops.matmul_forward,
        "attention_forward_per_token": flops.attention_forward,
        "train_per_token": flops.train,
        "includes_mtp": cfg.model.mtp_num_layers > 0,
    }
    out["mtp_num_layers"] = cfg.model.mtp_num_layers
    out["num_layers"] = cfg.model.num_layers
    out["num_moe_layers"] = sum(cfg.is_moe_layer(i) for i in range(cfg.model.num_layers))
    return out


def human_count(n: float) -> str:
    """1234 -> '1.2K', 15_706_000_000 -> '15.71B', 1.03e12 -> '1.036T'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            digits = 3 if v < 10 else 2 if v < 100 else 1
            return f"{v:.{digits}f}{unit}"
    return str(int(n))


def human_flops(f: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if f >= scale:
            return f"{f / scale:.3f} {unit}"
    return f"{f:.0f} FLOP"


def _render_table(info: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"model {info['name']}: parameters", title_justify="left")
    table.add_column("component")
    table.add_column("total", justify="right")
    table.add_column("active / token", justify="right")
    for name in COMPONENTS:
        c = info["breakdown"][name]
        if c["total"] == 0 and name in ("dense_mlp", "routed_experts", "shared_experts", "router", "mtp", "output_head"):
            continue  # absent from this model
        table.add_row(name, human_count(c["total"]), human_count(c["active"]))
    has_mtp = info["mtp_num_layers"] > 0
    table.add_section()
    table.add_row("total (without MTP)" if has_mtp else "total",
                  human_count(info["total_params"]), human_count(info["active_params"]))
    if has_mtp:
        table.add_row("total with MTP", human_count(info["total_params_with_mtp"]),
                      human_count(info["active_params_with_mtp"]))

    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=False, color_system=None)
    console.print(table)
    lines = [buf.getvalue().rstrip("\n")]
    moe = info["num_moe_layers"]
    layers = f"layers: {info['num_layers']} ({info['num_layers'] - moe} dense, {moe} MoE)"
    if has_mtp:
        layers += f" + {info['mtp_num_layers']} MTP"
    lines.append(layers)
    if has_mtp:
        lines.append(f"MTP ({info['mtp_num_layers']} depth) is NOT included in the headline total/active "
                     "(published convention); the 'total with MTP' row includes it.")
    else:
        lines.append("No MTP layers: nothing to exclude.")
    lines.append(f"active without the input embedding: {human_count(info['active_params_no_embedding'])} "
                 "(the convention of DeepSeek's and OpenAI's published active counts)")
    f = info["flops"]
    mtp_note = " incl. MTP" if has_mtp else ""
    lines.append(
        f"training FLOPs per token (seq {info['seq_length']}, causal{mtp_note}): "
        f"{human_flops(info['train_flops_per_token'])} = 3 x forward {human_flops(f['forward_per_token'])} "
        f"(matmuls {human_flops(f['matmul_forward_per_token'])} + attention "
        f"{human_flops(f['attention_forward_per_token'])})")
    return "\n".join(lines)


def model_info_report(cfg: Config, as_json: bool) -> str:
    """The `moetrain model info` output: JSON (stable keys, see model_info) or a readable table."""
    info = model_info(cfg)
    if as_json:
        return json.dumps(info, indent=2)
    return _render_table(info)
