"""How fast this machine's CPU drives eager PyTorch: the host side of host-bound steps. CPU only.

A step whose kernels are short waits on the host (Python, the dispatcher, autograd, kernel launches),
so its time follows the host CPU: the same tiny config measured 0.037-0.076 s a step on five lent H200
hosts. The roofline charges ``hardware.launch_overhead_us`` per modelled kernel, a number fitted on one
host. ``probe_us()`` times a fixed piece of eager work on this CPU (a pre-norm SwiGLU block of the
model's own modules, forward and backward on tiny CPU tensors, so that it is all host work) and
``scaled_launch_overhead_us`` rescales the profile's launch cost by how much faster or slower this
host runs that piece than the host the profile was fitted on (``hardware.host_probe_us``).
Meaningful where the plan runs on the host that will train (``plan validate``, ``plan perf
--host-probe`` on a compute node).
"""

from __future__ import annotations

import statistics
import time


def probe_us(rounds: int = 7, calls: int = 60) -> float:
    """Median over ``rounds`` of the mean microseconds of one forward + backward of the reference block
    (``calls`` per round, after a warm-up), on CPU tensors of [4, 16]: ~35 eager ops, all host time."""
    import torch

    from moetrain.models.mlp import MLP
    from moetrain.models.norm import RMSNorm

    torch.manual_seed(0)
    norm, mlp = RMSNorm(16), MLP(16, 32, "swiglu")
    x = torch.randn(4, 16, requires_grad=True)

    def call():
        (x + mlp(norm(x))).float().square().mean().backward()
        x.grad = None
        for module in (norm, mlp):
            module.zero_grad(set_to_none=True)

    with torch.inference_mode(False):
        for _ in range(calls):
            call()
        per_round = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            per_round.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_round)


def scaled_launch_overhead_us(hw, probe: float) -> float:
    """The profile's launch cost scaled to a host whose probe took ``probe`` microseconds."""
    if not hw.host_probe_us:
        raise ValueError(f"hardware {hw.name} has no host_probe_us: its launch cost cannot be rescaled to this host")
    return hw.launch_overhead_us * probe / hw.host_probe_us
