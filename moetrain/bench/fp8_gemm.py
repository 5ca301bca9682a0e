"""`moetrain bench gemm --precision fp8`: the routed experts' FC1 -> SwiGLU -> FC2, forward + backward, in FP8
against bf16, in one process on one GPU (bench/fp8_gemm.md reports it).

Contenders, each quantizing its own inputs inside the timed region (weights: once per optimizer step, so ours
quantizes them outside it, as training does across the micro-batches of a step; torchao quantizes them per call):
    bf16 torch      torch._grouped_mm (CUTLASS) for the six GEMMs
    our bf16        moetrain's grouped GEMMs as moe.backend=auto picks them (the tuner; first call measures)
    our blockwise   ops.grouped_gemm_fp8 (1 x 128 / 128 x 128 E4M3, fused quantization, cached weight blocks)
    our rowwise     ops.grouped_gemm_fp8 (per-row E4M3, our quantizers + torch._scaled_grouped_mm, cached weights)
    our tensorwise  the same with one scale per tensor (per expert for the weights)
    our mxfp8 (emulated) ops.grouped_gemm_fp8 mxfp8 (1 x 32 E4M3, E8M0 scales, tl.dot_scaled): on Hopper Triton
                    emulates the block-scaled dot in bf16, so its time is not an MXFP8 speed
    torchao rowwise torchao's _to_fp8_rowwise_then_scaled_grouped_mm (the MoE FP8 path of torchtitan), where
                    torchao >= 0.18 is installed
Rows: the issue's shapes (balanced routing, uniform groups). Before timing, each FP8 contender's forward is checked
against the bf16 result (SNR in dB); a contender that fails to run is reported, not timed.
"""

from __future__ import annotations

import argparse
import json

from moetrain.bench.common import SHAPES, parse_shapes, require_gpu

DEFAULT_SHAPES = ("deepseek-v3-ep8", "deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b")


def _mlp(gemm):
    """x [M, H], w1 [E, 2I, H], w2 [E, H, I], offs -> FC2(SwiGLU(FC1(x))) with ``gemm(x, w, offs)``."""
    from moetrain.ops.moe_rows import swiglu_torch

    def run(x, w1, w2, offs):
        return gemm(swiglu_torch(gemm(x, w1, offs)), w2, offs)
    return run


def contenders() -> dict:
    from moetrain import ops

    out = {
        "bf16 torch": _mlp(lambda x, w, o: ops.grouped_gemm(x, w, o, backend="torch")),
        "our bf16": _mlp(lambda x, w, o: ops.grouped_gemm(x, w, o, backend="auto")),
        "our blockwise": _mlp(lambda x, w, o: ops.grouped_gemm(x, w, o, recipe="blockwise")),
        "our rowwise": _mlp(lambda x, w, o: ops.grouped_gemm(x, w, o, recipe="rowwise")),
        "our tensorwise": _mlp(lambda x, w, o: ops.grouped_gemm(x, w, o, recipe="tensorwise")),
        "our mxfp8 (emulated)": _mlp(lambda x, w, o: ops.grouped_gemm(x, w, o, recipe="mxfp8")),
    }
    rowwise = _torchao_rowwise()
    if rowwise is not None:  # groups here are multiples of 16: torchao's padding pass is not needed
        out["torchao rowwise"] = _mlp(lambda x, w, o: rowwise(x, w.transpose(-2, -1), o,
                                                              pad_token_groups_for_grouped_mm=False))
    return out


def _torchao_rowwise():
    """torchao's rowwise FP8 grouped GEMM (torchao >= 0.18), or None without it."""
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
    except ImportError as err:
        print(f"bench: torchao's rowwise FP8 column is left out (torchao >= 0.18 does not import: {err})")
        return None
    return _to_fp8_rowwise_then_scaled_grouped_mm


def _inputs(shape, torch):
    M, E = shape.T * shape.K, shape.E
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, shape.H, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = (torch.randn(E, 2 * shape.I, shape.H, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, shape.H, shape.I, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    offs = (torch.arange(1, E + 1, device="cuda") * (M // E)).to(torch.int32)
    return x, w1, w2, offs


def measure(shape, names, reps_ms: int, torch) -> dict:
    import triton

    from moetrain.ops.fp8_quant import snr_db

    x, w1, w2, offs = _inputs(shape, torch)
    xg = x.clone().requires_grad_(True)
    w1g, w2g = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    dy = torch.randn_like(x)
    runs = contenders()
    result = {}
    bf16 = runs["bf16 torch"]
    reference = bf16(x, w1, w2, offs).float()
    for name in names:
        run = runs[name]

        def step():
            xg.grad = w1g.grad = w2g.grad = None
            run(xg, w1g, w2g, offs).backward(dy)
        try:
            with torch.no_grad():
                snr = snr_db(reference, run(x, w1, w2, offs).float())
            ms = triton.testing.do_bench(step, warmup=25, rep=reps_ms, return_mode="median")
        except Exception as err:  # a peer that does not run here is reported, not fatal
            result[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"}
            continue
        result[name] = {"ms": ms, "snr_db": snr}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moetrain bench gemm --precision fp8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--rep-ms", type=int, default=300, help="timed milliseconds per contender (median kept)")
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args(argv)
    shapes = [SHAPES[name] for name in parse_shapes(args.shapes)]
    require_gpu("gemm --precision fp8")
    import torch

    names = list(contenders())
    rows = {}
    print(f"{'shape':18} " + " ".join(f"{n:>16}" for n in names) + "   best fp8 / our bf16")
    for shape in shapes:
        r = measure(shape, names, args.rep_ms, torch)
        rows[shape.name] = r
        cells = [f"{r[n]['ms']:9.2f} ms {r[n]['snr_db']:3.0f}dB" if "ms" in r[n] else f"{'failed':>16}" for n in names]
        fp8 = [r[n]["ms"] for n in names if n not in ("bf16 torch", "our bf16") and "ms" in r[n]]
        ratio = f"{r['our bf16']['ms'] / min(fp8):.2f}x" if fp8 and "ms" in r["our bf16"] else "-"
        print(f"{shape.name:18} " + " ".join(cells) + f"   {ratio}", flush=True)
    for shape_name, r in rows.items():
        for n, v in r.items():
            if "error" in v:
                print(f"{shape_name} {n}: {v['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
