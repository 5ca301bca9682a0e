"""Which inputs of a projection are measured and which are datasheet numbers or assumptions.

A projection rests on the hardware profile (``Hardware.inputs``: each key measured on the profile's GPU, from a
datasheet or reference design, or assumed) and on the planner's own constants: the roofline's efficiencies
(costs.py, perf.py) fitted to our trainer on one H200, which carry to other GPUs as ratios of their peaks, an
assumption there; the memory model, counted from our modules' saved tensors and checked byte-exactly on CPU and
within 2% on the H200 (VALIDATION.md), with two assumed constants (fragmentation, NCCL buffers). With ``--measure``
the block times are measured on the local GPU instead of the roofline. Pure Python.
"""

from __future__ import annotations

H200_FITTED = ("h200-sxm",)


def inputs(hw, measured_blocks: bool = False) -> dict:
    """{"hardware": {source: [keys]}, "compute": ..., "memory": ...} for a projection on ``hw``."""
    fitted_here = hw.name in H200_FITTED
    compute = ("measured on this GPU (plan perf --measure): block and head times" if measured_blocks else
               "roofline constants fitted on one H200 (plan/costs.py, VALIDATION.md)"
               + ("" if fitted_here else f"; on {hw.name} an assumption (never measured there)"))
    return {"hardware": hw.inputs(), "compute": compute,
            "memory": "counted from the modules' saved tensors (byte-exact on CPU, within 2% on an H200); "
                      "assumed: fragmentation 5% of the dynamic part, NCCL buffers 1 GiB"}
