"""Why the autotuner picks what it picks for one weight-gradient shape: runs grouped_gemm_wgrad's autotuner from
an empty config cache and prints every candidate's time as the autotuner measured it (its disk entry), then times
its pick against each ping-pong config in turns (median ms).

    python scripts/autotune_probe.py --shape dsv3 --layer fc1 [--routing balanced] [--groups G]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch


def main(argv=None) -> int:
    from moetrain.kernels.sweep_grouped_gemm import SHAPES  # (the config cache is read only at the first tuning)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="dsv3", choices=sorted(SHAPES))
    ap.add_argument("--layer", default="fc1", choices=("fc1", "fc2"))
    ap.add_argument("--routing", default="balanced", choices=("balanced", "skewed"))
    ap.add_argument("--groups", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("scripts/autotune_probe.py times GPU kernels: no CUDA device visible")
    os.environ["MOETRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="moetrain-probe-")
    from moetrain.kernels import grouped_gemm as gg
    from moetrain.kernels import grouped_gemm_tuning as tuning
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels.timing import in_turns, median_ms

    m, g, h, i = sweep.SHAPES[args.shape]
    if args.groups:
        m, g = m // g * args.groups, args.groups
    n, k = sweep.layer_gemms(h, i)[args.layer]
    inputs, offs = sweep.make_inputs(m, g, n, k, 1, seed=0, gather=False, routing=args.routing)
    _, _, dy, _, _ = inputs[0]
    x = inputs[0][0]
    out = torch.empty(g, n, k, device="cuda", dtype=torch.bfloat16)
    gg.grouped_gemm_wgrad(dy, x, offs, out=out)
    (key, picked), = tuning.tuned_configs().items()
    entry = tuning._disk_entries()[tuning.disk_key(key)]
    print(f"{args.shape} {args.layer} {args.routing} M={m} G={g} N={n} K={k}: autotuner picked {picked}", flush=True)
    for name, ms in sorted(entry["ms"].items(), key=lambda kv: kv[1]):
        print(f"  autotuner's time {ms:8.3f} ms  {name}", flush=True)
    runs = {str(picked): picked, **{str(c): c for c in tuning.PINGPONG_WGRAD_CONFIGS}}
    med, failed = in_turns(list(runs), lambda name: median_ms(lambda: gg.grouped_gemm_wgrad(
        dy, x, offs, config=runs[name], out=out), warmup=2, reps=10), args.rounds)
    for name, exc in failed.items():
        print(f"  FAILED {name}: {type(exc).__name__}: {exc}"[:300], flush=True)
    for name, ms in med.items():
        print(f"  in turns        {ms:8.3f} ms  {name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
