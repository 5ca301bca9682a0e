"""Parameter names of state dicts saved by earlier moetrain versions, and how they map to today's.

Legend: H hidden, F intermediate of a dense MLP (or of the shared experts).

Dense MLPs and shared experts were one module with ``<p>.w1`` [2F, H] (rows 0..F-1 gate, F..2F-1
up; [F, H] for gelu, no gate) and ``<p>.w2`` [H, F]; today they are ``<p>.gate_proj.weight``,
``<p>.up_proj.weight`` [F, H] and ``<p>.down_proj.weight`` [H, F] (see mlp.py). <p> is a dense
layer's ``...mlp`` or a MoE layer's ``...mlp.shared``; the routed experts' ``...mlp.experts.w1`` is
a current name and is never renamed.

A *plan* maps each old name to its new names with the rows of the old tensor each one takes.
Pure Python on names and shapes: loaders that copy by name (checkpoint resume, moetrain model
directories, export) apply the same plan as ``MLP.load_state_dict``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeVar

Plan = dict[str, list[tuple[str, slice]]]
V = TypeVar("V")

_LEGACY_W1 = re.compile(r"(?:^|\.)mlp(?:\.shared)?\.w1$")


def mlp_entries(prefix: str, gated: bool, ffn: int, present: Collection[str]) -> Plan:
    """The plan of one MLP whose parameter names start with ``prefix`` (e.g. "layers.0.mlp."), for
    those of its legacy names that are in ``present``. ``ffn``: F; ``gated``: not gelu."""
    plan: Plan = {}
    if prefix + "w1" in present:
        if gated:
            plan[prefix + "w1"] = [(prefix + "gate_proj.weight", slice(0, ffn)),
                                   (prefix + "up_proj.weight", slice(ffn, 2 * ffn))]
        else:
            plan[prefix + "w1"] = [(prefix + "up_proj.weight", slice(None))]
    if prefix + "w2" in present:
        plan[prefix + "w2"] = [(prefix + "down_proj.weight", slice(None))]
    return plan


def legacy_mlp_plan(shapes: Mapping[str, Sequence[int]]) -> Plan:
    """The plan of every legacy MLP among ``shapes`` (name -> shape, a whole state dict). The
    activation is read off the shapes: a w1 with twice as many rows as its w2 has columns is gated,
    one with as many is gelu. Empty for a current state dict. A legacy w1 without its w2, or of any
    other height, is not planned: the loader then reports it as an unexpected tensor."""
    plan: Plan = {}
    for name, shape in shapes.items():
        if not _LEGACY_W1.search(name):
            continue
        prefix = name[: -len("w1")]
        w2 = shapes.get(prefix + "w2")
        if w2 is None or len(w2) != 2 or len(shape) != 2 or shape[0] not in (w2[1], 2 * w2[1]):
            continue
        plan.update(mlp_entries(prefix, gated=shape[0] == 2 * w2[1], ffn=w2[1], present=shapes.keys()))
    return plan


def apply_plan(mapping: Mapping[str, V], plan: Plan,
               take: Callable[[V, slice], V] = lambda t, rows: t[rows]) -> dict[str, V]:
    """``mapping`` with each planned old entry replaced by its new ones, ``take(value, rows)`` each
    (default: the rows of a tensor, a view). The other entries keep their order and values."""
    out: dict[str, V] = {}
    for name, value in mapping.items():
        if name in plan:
            for new, rows in plan[name]:
                out[new] = take(value, rows)
        else:
            out[name] = value
    return out


def upgrade_state_dict(state: Mapping[str, V]) -> dict[str, V]:
    """A model state dict (name -> tensor) under today's names: legacy MLP tensors become views of
    their rows. A current state dict comes back unchanged (as a new dict)."""
    return apply_plan(state, legacy_mlp_plan({k: tuple(v.shape) for k, v in state.items()}))
