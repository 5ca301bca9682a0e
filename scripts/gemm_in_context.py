"""Does our grouped GEMM lose to torch's on the layer's own operands where it wins on random ones? (GPU)

    python scripts/gemm_in_context.py [--shape qwen3-30b-a3b] [--rounds 5]

In `bench moe`, auto timed our FC1 data gradient at Qwen3 6-10% slower than torch._grouped_mm (sessions 6-7),
while `bench gemm` (random operands) timed it 4% faster. This runs one forward+backward of our layer
(backend auto), keeps the operands FC1's data gradient got (dh [M, 2I], w1, offs), and times in turns, one
process: torch and each of our configs on those operands, and on random operands of the same shape and scale.
"""

from __future__ import annotations

import argparse

import torch

from moetrain.bench import moe_layer as bench
from moetrain.kernels import grouped_gemm as gg
from moetrain.kernels.timing import in_turns, median_ms
from moetrain.ops import moe_fused


def capture_fc1_dgrad(s):
    """(dh, w1, offs) as our layer's FC1 data gradient receives them."""
    seen = {}
    original = moe_fused.gemm_dgrad  # FC1's and FC2's data gradients; FC1's (2I columns in dh) runs last

    def spy(dy, w, offs, backend):
        seen["operands"] = (dy.detach().clone(), w.detach(), offs.clone())
        return original(dy, w, offs, backend)

    moe_fused.gemm_dgrad = spy
    try:
        args = bench.layer_inputs(s, "balanced", torch.Generator(device="cuda").manual_seed(0))
        bench._fwd_bwd(bench.ours("auto"), args)
    finally:
        moe_fused.gemm_dgrad = original
    return seen["operands"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(bench.SHAPES))
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    s = bench.SHAPES[a.shape]
    dh, w1, offs = capture_fc1_dgrad(s)
    random_dh = torch.randn_like(dh, dtype=torch.float32).mul_(dh.float().std()).to(dh.dtype)
    print(f"{a.shape} FC1 dgrad: dh {tuple(dh.shape)} std {dh.float().std():.3e}, zero fraction "
          f"{(dh == 0).float().mean():.3f}; w1 {tuple(w1.shape)}", flush=True)
    flops = 2.0 * dh.shape[0] * dh.shape[1] * w1.shape[2]
    out = torch.empty(dh.shape[0], w1.shape[2], dtype=dh.dtype, device=dh.device)
    runs = {}
    for label, a_op in (("layer", dh), ("random", random_dh)):
        runs[f"torch {label}"] = lambda a_op=a_op: torch._grouped_mm(a_op, w1, offs=offs)
        for cfg in gg.configs_for("dgrad", trial=False):
            runs[f"{cfg} {label}"] = lambda a_op=a_op, cfg=cfg: gg.grouped_gemm_dgrad(a_op, w1, offs, config=cfg, out=out)
    med, failed = in_turns(list(runs), lambda name: median_ms(runs[name], warmup=2, reps=10), a.rounds)
    for name in sorted(med, key=med.get):
        print(f"  {name:45s} {med[name]:7.3f} ms {flops / med[name] / 1e9:6.0f} TF/s", flush=True)
    for name, err in failed.items():
        print(f"  {name}: failed {type(err).__name__}", flush=True)


if __name__ == "__main__":
    main()
