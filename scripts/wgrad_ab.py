"""Our Triton weight gradient (128x256x64/s3/w8/tma) against the ping-pong kernel at one shape, under several timing
protocols, because the autotuner (timing in turns right after a 12-config search) and the sweep (bench gemm) ranked
them differently at DeepSeek-V3's FC1 (session 10, calls D and E).

    python scripts/wgrad_ab.py --shape dsv3 --layer fc1

Protocols, each printing ms per call for both:
  turns-AB / turns-BA  in turns (median_ms: warmup 2, 10 synchronized reps), 5 rounds, in both orders
  stream               40 calls queued back to back (no sync between), total / 40: sustained load
  cool                 one synchronized call after 100 ms idle, median of 10
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> int:
    from moetrain.kernels import grouped_gemm as gg
    from moetrain.kernels import grouped_gemm_tuning as tuning
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels.timing import in_turns, median_ms, queued_ms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="dsv3", choices=sorted(sweep.SHAPES))
    ap.add_argument("--layer", default="fc1", choices=("fc1", "fc2"))
    ap.add_argument("--routing", default="balanced", choices=("balanced", "skewed"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("scripts/wgrad_ab.py times GPU kernels: no CUDA device visible")
    m, g, h, i = sweep.SHAPES[args.shape]
    n, k = sweep.layer_gemms(h, i)[args.layer]
    inputs, offs = sweep.make_inputs(m, g, n, k, 1, seed=0, gather=False, routing=args.routing)
    x, _, dy, _, _ = inputs[0]
    out = torch.empty(g, n, k, device="cuda", dtype=torch.bfloat16)
    cfgs = {"triton": tuning.WGRAD_CONFIGS[0], "pingpong": tuning.PINGPONG_WGRAD_CONFIGS[0]}
    runs = {name: (lambda c=c: gg.grouped_gemm_wgrad(dy, x, offs, config=c, out=out)) for name, c in cfgs.items()}
    print(f"{args.shape} {args.layer} {args.routing}: " + ", ".join(f"{n_} = {c}" for n_, c in cfgs.items()), flush=True)
    for name in runs:
        runs[name]()
    torch.cuda.synchronize()

    def stream(name):
        return queued_ms(runs[name], reps=40)

    def cool(name, reps=10):
        times = []
        for _ in range(reps):
            time.sleep(0.1)
            times.append(median_ms(runs[name], warmup=0, reps=1))
        return sorted(times)[reps // 2]

    for label, order in (("turns-AB", ["triton", "pingpong"]), ("turns-BA", ["pingpong", "triton"])):
        med, failed = in_turns(order, lambda name: median_ms(runs[name], warmup=2, reps=10), 5)
        if failed:
            raise next(iter(failed.values()))
        print(f"  {label:9s} " + "  ".join(f"{n_} {med[n_]:7.3f}" for n_ in cfgs), flush=True)
    for label, fn in (("stream", stream), ("cool", cool), ("stream", stream)):
        got = {name: fn(name) for name in cfgs}
        print(f"  {label:9s} " + "  ".join(f"{n_} {got[n_]:7.3f}" for n_ in cfgs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
