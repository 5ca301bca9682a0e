"""The SwiGLU fusions alone (GPU), each config, in turns in one process, on one layer shape:
  forward:  the plain FC1 forward then the SwiGLU kernel, against FC1 with SwiGLU in its epilogue
            (moetrain.kernels.fc1_swiglu: paired and two-accumulator variants);
  backward: FC2's plain data gradient then SwiGLU's backward kernel, against FC2's data gradient with SwiGLU's
            backward in its epilogue (moetrain.kernels.fc2_dgrad_swiglu).

    python scripts/swiglu_fusion_alone.py [--shape mixtral-8x7b] [--rounds 3] [--gather] [--side fwd,bwd]

Why: in session 7 (call H) the fused path (then with two accumulators) made Mixtral's layer 4.7 ms slower, i.e.
the fused FC1 ran ~40% slower than the plain one. This separates the kernel from the layer, the paired variant
(one accumulator, the plain forward's MMA shape) from the two-accumulator one, and shows which configs lose how much.
Rows are routed balanced (bench moe's round-robin): M = T*K rows over E experts. TF/s counts the GEMM only.
"""

from __future__ import annotations

import argparse

import torch

from moetrain.bench.moe_layer import SHAPES, routed_offs
from moetrain.kernels import fc1_swiglu as fused
from moetrain.kernels import fc2_dgrad_swiglu as fused_bwd
from moetrain.kernels import grouped_gemm as gg
from moetrain.kernels import moe_rows
from moetrain.kernels.timing import in_turns, median_ms


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="mixtral-8x7b", choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gather", action="store_true", help="read the token rows through an index (the fused path's way)")
    p.add_argument("--side", default="fwd,bwd", help="fwd, bwd or both (comma-separated)")
    a = p.parse_args()
    sides = a.side.split(",")
    if not set(sides) <= {"fwd", "bwd"}:
        p.error(f"--side {a.side!r}: fwd, bwd or fwd,bwd")
    s = SHAPES[a.shape]
    M = s.T * s.K
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(s.T if a.gather else M, s.H, device="cuda", generator=gen, dtype=bf)
    w1 = torch.randn(s.E, 2 * s.I, s.H, device="cuda", generator=gen, dtype=bf).div_(s.H**0.5)
    probs = torch.rand(M, device="cuda", generator=gen)
    rows = (torch.randperm(M, device="cuda", generator=gen) // s.K) if a.gather else None
    offs = routed_offs(s, "balanced", "cuda")
    h = torch.empty(M, 2 * s.I, device="cuda", dtype=bf)
    act = torch.empty(M, s.I, device="cuda", dtype=bf)

    if "fwd" in sides:
        forward(a, s, M, x, w1, probs, rows, offs, h, act)
    if "bwd" in sides:
        backward(a, s, M, w1, probs, offs, h, gen)


def report(title: str, runs: dict, flops: float, rounds: int) -> None:
    med, failed = in_turns(list(runs), lambda name: median_ms(runs[name], warmup=2, reps=8), rounds)
    print(title, flush=True)
    for name in sorted(med, key=med.get):
        print(f"  {name:50s} {med[name]:8.3f} ms  {flops / med[name] / 1e9:6.0f} TF/s", flush=True)
    for name, e in failed.items():
        print(f"  {name}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)


def rel(pairs) -> float:
    return max(((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in pairs)


def forward(a, s, M, x, w1, probs, rows, offs, h, act) -> None:
    runs = {}
    for cfg in gg.configs_for("fwd", trial=False):
        def plain(cfg=cfg):
            gg.grouped_gemm_fwd(x, w1, offs, gather_rows=rows, config=cfg, out=h)
            moe_rows.swiglu_fwd(h, "swiglu", probs)
        runs[f"plain + swiglu  {cfg}"] = plain
    # the fused variants on the TMA configs of 128-row tiles (where the plain forward's winners are)
    fused_configs = [c for c in fused.FC1_SWIGLU_CONFIGS if c.use_tma and c.block_m == 128 and c.programs_per_sm == 1]
    for paired, tma_h in ((True, True), (True, False), (False, True), (False, False)):
        label = ("fused, paired" if paired else "fused, two acc") + (", tma h" if tma_h else "")
        for cfg in fused_configs:
            runs[f"{label:21s} {cfg}"] = lambda cfg=cfg, paired=paired, tma_h=tma_h: fused.fc1_swiglu(
                x, w1, offs, "swiglu", probs, gather_rows=rows, config=cfg, out=(h, act), paired=paired, tma_h=tma_h)
    # correctness first: the fused result against plain + swiglu (autotuned), bf16
    want_h = gg.grouped_gemm_fwd(x, w1, offs, gather_rows=rows)
    want_a = moe_rows.swiglu_fwd(want_h, "swiglu", probs)
    got_h, got_a = fused.fc1_swiglu(x, w1, offs, "swiglu", probs, gather_rows=rows)
    report(f"{a.shape} forward, M={M} H={s.H} I={s.I} E={s.E} gather={a.gather}: fused vs plain + swiglu rel err "
           f"{rel(((got_h, want_h), (got_a, want_a))):.1e}", runs, 2.0 * M * 2 * s.I * s.H, a.rounds)


def backward(a, s, M, w1, probs, offs, h, gen) -> None:
    w2 = torch.randn(s.E, s.H, s.I, device="cuda", generator=gen, dtype=torch.bfloat16).div_(s.I**0.5)
    dy = torch.randn(M, s.H, device="cuda", generator=gen, dtype=torch.bfloat16)
    h.normal_(generator=gen)
    da = torch.empty(M, s.I, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty_like(h)
    runs = {}
    for cfg in gg.configs_for("dgrad", trial=False):
        def plain(cfg=cfg):
            gg.grouped_gemm_dgrad(dy, w2, offs, config=cfg, out=da)
            moe_rows.swiglu_bwd(h, da, "swiglu", probs)
        runs[f"plain dgrad + swiglu bwd  {cfg}"] = plain
    for cfg in fused_bwd.FC2_DGRAD_SWIGLU_CONFIGS:
        runs[f"fused dgrad + swiglu bwd  {cfg}"] = lambda cfg=cfg: fused_bwd.fc2_dgrad_swiglu(
            dy, w2, offs, h, "swiglu", probs, config=cfg, out=dh)
    want = moe_rows.swiglu_bwd(h, gg.grouped_gemm_dgrad(dy, w2, offs), "swiglu", probs)
    got = fused_bwd.fc2_dgrad_swiglu(dy, w2, offs, h, "swiglu", probs)
    report(f"{a.shape} backward, M={M} H={s.H} I={s.I} E={s.E}: fused vs plain rel err {rel(zip(got, want)):.1e}",
           runs, 2.0 * M * s.H * s.I, a.rounds)


if __name__ == "__main__":
    main()
