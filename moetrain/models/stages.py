"""Pipeline stages cut from a whole model by a ``parallel.pipeline_layout`` string.

``split_stages(model, layout)`` returns one module per stage (deep copies of ``model``, each reduced by
``MoETransformer.keep_only``), in pipeline order. Run one after the other, stage i's output is stage i+1's input:
token ids -> h [B, S, H] -> ... -> the last stage's ``ModelOutput`` (with labels) or logits. Parameter names are
the whole model's (layers keyed by global id), so a stage's state dict is a slice of the model's; a weight two
stages both need (the embedding of a tied head or of MTP on the last stage) is a copy in each, whose gradients
sum to the whole model's.

The MTP depths must sit on the stage with the loss (L): their outputs feed it directly.
"""

from __future__ import annotations

import copy

from moetrain.config.pipeline_layout import expand, layout_stages


def stage_contents(layout: str, num_layers: int, mtp_num_layers: int) -> list[dict]:
    """For each stage of ``layout``: {"layers": global layer ids, "mtp": depths, "embedding": bool, "loss": bool}.
    Raises ConfigError for a layout the grammar or the model refuses."""
    stages = layout_stages(layout, num_layers=num_layers, mtp_num_layers=mtp_num_layers,
                           pp=len(expand(layout)), vpp=1)
    out, layer, depth = [], 0, 0
    for text in stages:
        part = {"layers": [], "mtp": [], "embedding": "E" in text, "loss": "L" in text}
        for ch in text:
            if ch == "t":
                part["layers"].append(layer)
                layer += 1
            elif ch == "m":
                part["mtp"].append(depth)
                depth += 1
        if part["mtp"] and not part["loss"]:
            raise ValueError(f"pipeline layout {layout!r}: the MTP depths (m) must be on the stage with the loss (L)")
        out.append(part)
    return out


def split_stages(model, layout: str) -> list:
    """One MoETransformer per stage of ``layout`` (see the module doc); ``model`` itself is left whole."""
    m = model.cfg.model
    parts = stage_contents(layout, m.num_layers, m.mtp_num_layers)
    return [copy.deepcopy(model).keep_only(p["layers"], p["mtp"], embedding=p["embedding"], loss=p["loss"])
            for p in parts]
