"""precision.fp8_dense: the dense linears in FP8 through torchao's float8 training (``convert_to_float8_training``).

Converted: each ``nn.Linear`` of the attention (q/k/v/o and MLA's down/up projections), of the dense MLPs and of
the shared experts, in the blocks ``Config.fp8_dense_layers`` lists (every decoder layer and MTP block, less layer 0
and the last layer with precision.fp8_dense_bf16_edges). Left in the compute dtype: the embedding, the output head,
MTP's eh_proj, the routers and the routed experts (neither is an ``nn.Linear``; the experts' FP8 is
precision.fp8_recipe). torchao's ``Float8Linear`` takes over the module's own ``weight`` / ``bias`` parameters, so
parameter names, state_dict keys, checkpoints and HF export are those of the unconverted model.

The model code stays precision-agnostic: the trainer converts the model as built (on the device, or on meta in the
distributed trainer) before torch.compile and FSDP (``Trainer.prepare_model``). torchao is imported only here, when
a run asks for it.
"""

from __future__ import annotations

import importlib.util

from moetrain.errors import UserError

PROJECTIONS = ("attn", "mlp")  # a block's children holding the dense linears (mlp: dense MLP or shared expert)
NEVER = ("router", "experts")  # inside an MoE mlp: the router's gate and the routed experts stay as they are


def require_torchao(cfg) -> None:
    """UserError before anything is allocated when precision.fp8_dense is on and torchao is not installed."""
    if cfg.precision.fp8_dense != "none" and importlib.util.find_spec("torchao") is None:
        raise UserError(f"precision.fp8_dense = {cfg.precision.fp8_dense} needs torchao's float8 training: "
                        "pip install torchao (or pip install 'moetrain[fp8]')")


def require_scaled_mm(cfg, device) -> None:
    """UserError up front when precision.fp8_dense = rowwise trains on the CPU and this torch's CPU torch._scaled_mm
    scales per tensor only (torch 2.11's asserts inside the first step; 2.13's runs): probed on 16 x 16 operands."""
    if cfg.precision.fp8_dense != "rowwise" or device.type != "cpu":
        return
    import torch

    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        raise UserError(f"precision.fp8_dense = rowwise: torch {torch.__version__}'s CPU torch._scaled_mm scales per "
                        "tensor only; use precision.fp8_dense=tensorwise on the CPU (or a newer torch)") from None


def block_of(fqn: str, num_layers: int) -> tuple[int, list[str]] | None:
    """(global block id, path inside the block) of a module name, or None outside the decoder blocks:
    ``layers.3.attn.q_proj`` -> (3, [attn, q_proj]); ``mtp.0.block.mlp.up_proj`` -> (num_layers, [mlp, up_proj])."""
    parts = fqn.split(".")
    if len(parts) > 2 and parts[0] == "layers":
        return int(parts[1]), parts[2:]
    if len(parts) > 3 and parts[0] == "mtp" and parts[2] == "block":
        return num_layers + int(parts[1]), parts[3:]
    return None


def converts(fqn: str, cfg, layers: frozenset[int]) -> bool:
    """Whether module ``fqn`` (an nn.Linear) is one precision.fp8_dense converts, ``layers`` being
    ``cfg.fp8_dense_layers()``."""
    found = block_of(fqn, cfg.model.num_layers)
    if found is None:
        return False
    block, path = found
    return block in layers and path[0] in PROJECTIONS and not any(p in NEVER for p in path)


def apply_fp8_dense(model, cfg) -> list[str]:
    """Swap the dense linears of ``model`` for torchao's Float8Linear with precision.fp8_dense's recipe (in place);
    returns the converted module names. A no-op returning [] when fp8_dense is none."""
    if cfg.precision.fp8_dense == "none":
        return []
    require_torchao(cfg)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    layers = frozenset(cfg.fp8_dense_layers())
    chosen = []

    def keep(module, fqn: str) -> bool:
        if converts(fqn, cfg, layers):
            chosen.append(fqn)
            return True
        return False

    config = Float8LinearConfig.from_recipe_name(cfg.precision.fp8_dense)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return chosen
