"""Where one grouped GEMM's time goes: ours (one fixed config) and torch._grouped_mm on the same routed inputs.

    python scripts/gemm_anatomy.py --shape dsv3 --layer fc1 --op wgrad [--config 128x256x64/s3/w8/tma] [--groups 64]
    ncu --profile-from-start off --clock-control none --set full --import-source yes -o REPORT \\
        python scripts/gemm_anatomy.py ... --profile

Without --profile: both timed in turns (median ms and TFLOP/s, outputs checked against each other first).
With --profile: each is compiled and run once, then run once more between cudaProfilerStart and cudaProfilerStop,
so that Nsight Compute (--profile-from-start off) sees exactly one launch of each and no autotuning.
--groups keeps the shape's rows per expert with fewer experts (a smaller dw for the profiler's replays).
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    from moetrain.kernels import grouped_gemm as gg
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels.timing import in_turns, median_ms, profiled_once

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="dsv3", choices=sorted(sweep.SHAPES))
    ap.add_argument("--layer", default="fc1", choices=("fc1", "fc2"))
    ap.add_argument("--op", default="wgrad", choices=sweep.OPS + sweep.EXTRA_OPS)
    ap.add_argument("--config", default="128x256x64/s3/w8/tma", help="one of configs_for(op), as printed")
    ap.add_argument("--groups", type=int, default=None, help="experts (rows per expert kept)")
    ap.add_argument("--routing", default="balanced", choices=("balanced", "skewed"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("scripts/gemm_anatomy.py runs GPU kernels: no CUDA device visible")
    configs = {str(c): c for c in gg.configs_for(args.op)}
    if args.config not in configs:
        raise SystemExit(f"--config {args.config!r} is not a candidate of {args.op}: {', '.join(configs)}")
    cfg = configs[args.config]
    m, g, h, i = sweep.SHAPES[args.shape]
    if args.groups:
        m, g = m // g * args.groups, args.groups
    n, k = sweep.layer_gemms(h, i)[args.layer]
    inputs, offs = sweep.make_inputs(m, g, n, k, 1, seed=0, gather=args.op.endswith("_gather"), routing=args.routing)
    a, b = sweep.op_inputs(args.op, inputs[0])
    want = sweep.torch_op(args.op, a, b, offs)
    out = torch.full_like(want, float("nan"))
    runs = {"ours": lambda: sweep.run_ours(gg, args.op, inputs[0], offs, cfg, out),
            "torch": lambda: sweep.torch_op(args.op, a, b, offs)}
    runs["ours"]()
    err = sweep.rel_err(out, want)
    label = f"{args.shape} {args.layer} {args.op} M={m} G={g} N={n} K={k} {args.routing}, ours {cfg}"
    print(f"{label}: rel err vs torch {err:.2e}", flush=True)
    if not err < sweep.BOUND:
        raise SystemExit(f"ours disagrees with torch._grouped_mm (rel err {err:.2e})")
    if args.profile:
        profiled_once(*runs.values())
        return 0
    flops = 2.0 * m * n * k
    med, failed = in_turns(list(runs), lambda name: median_ms(runs[name], warmup=2, reps=10), args.rounds)
    if failed:
        raise next(iter(failed.values()))
    for name, ms in med.items():
        print(f"  {name:6s} {ms:8.3f} ms {flops / ms / 1e9:7.0f} TF/s", flush=True)
    print(f"  ours / torch: {med['torch'] / med['ours']:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
