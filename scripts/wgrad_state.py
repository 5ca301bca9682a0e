"""Which earlier kernel slows the ping-pong weight gradient for the rest of a process? (Session 10, call G: after
the autotuner's search at DeepSeek-V3's FC1 the ping-pong kernel ran at ~10 ms in that process; in a process that
ran only it and our 128x256 Triton kernel, at ~7.5 ms, on the same GPU.)

    python scripts/wgrad_state.py --shape dsv3 --layer fc1

Times ping-pong and Triton (128x256x64/s3/w8/tma) in turns, then runs each other weight-gradient config once and
times the two again after each, printing one row per step.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> int:
    from moetrain.kernels import grouped_gemm as gg
    from moetrain.kernels import grouped_gemm_tuning as tuning
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels.timing import in_turns, median_ms, profiled_once, queued_ms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="dsv3", choices=sorted(sweep.SHAPES))
    ap.add_argument("--layer", default="fc1", choices=("fc1", "fc2"))
    ap.add_argument("--first", default=None, help="OP:CONFIG (fwd, fwd_gather, dgrad, wgrad_gather, wgrad): launch only "
                    "this one, once, between the two baseline measurements and the last, instead of every wgrad config")
    ap.add_argument("--protocols", action="store_true", help="also time under do_bench (L2 flush) and queued")
    ap.add_argument("--probes", action="store_true", help="with --first, after it: the ping-pong with fewer programs "
                    "than SMs, and after 2 s idle")
    ap.add_argument("--profile", action="store_true", help="with --first: one ping-pong launch before it and one after, "
                    "each between cudaProfilerStart and cudaProfilerStop (Nsight Compute), instead of timing")
    args = ap.parse_args(argv)
    first = None
    if args.first:
        op, _, name = args.first.partition(":")
        ops = sweep.OPS + sweep.EXTRA_OPS
        cfg = next((c for c in gg.configs_for(op) if str(c) == name), None) if op in ops else None
        if cfg is None:
            raise SystemExit(f"--first {args.first!r}: not OP:CONFIG with OP one of {', '.join(ops)} and CONFIG one "
                             "of its configs_for(OP), as printed")
        first = (op, cfg)
    if not torch.cuda.is_available():
        raise SystemExit("scripts/wgrad_state.py times GPU kernels: no CUDA device visible")
    m, g, h, i = sweep.SHAPES[args.shape]
    n, k = sweep.layer_gemms(h, i)[args.layer]
    inputs, offs = sweep.make_inputs(m, g, n, k, 1, seed=0, gather=False)
    x, _, dy, _, _ = inputs[0]
    out = torch.empty(g, n, k, device="cuda", dtype=torch.bfloat16)
    pair = {"triton": tuning.WGRAD_CONFIGS[0], "pingpong": tuning.PINGPONG_WGRAD_CONFIGS[0]}

    def run(cfg, num_programs=None):
        gg.grouped_gemm_wgrad(dy, x, offs, config=cfg, out=out, num_programs=num_programs)

    def profiled(cfg):
        profiled_once(lambda: run(cfg))

    def measure(label):
        med, failed = in_turns(list(pair), lambda name: median_ms(lambda: run(pair[name]), warmup=1, reps=6), 3)
        if failed:
            raise next(iter(failed.values()))
        print(f"  after {label:36s} triton {med['triton']:7.3f}  pingpong {med['pingpong']:7.3f}", flush=True)
        if args.protocols:  # the same two under bench gemm's protocol (L2 flush before each call) and queued
            import triton

            bench = {n_: triton.testing.do_bench(lambda c=c: run(c), warmup=5, rep=60, return_mode="median")
                     for n_, c in pair.items()}
            queued = {n_: queued_ms(lambda c=c: run(c), reps=20) for n_, c in pair.items()}
            print(f"    do_bench (flush) triton {bench['triton']:7.3f}  pingpong {bench['pingpong']:7.3f};  queued "
                  f"triton {queued['triton']:7.3f}  pingpong {queued['pingpong']:7.3f}", flush=True)

    if args.profile:
        run(pair["pingpong"])
        profiled(pair["pingpong"])
    else:
        measure("nothing else")
        measure("nothing else (again)")
    if first:
        op, cfg = first
        inputs_op, offs_op = sweep.make_inputs(m, g, n, k, 1, seed=1, gather=op.endswith("_gather"))
        want = sweep.torch_op(op, *sweep.op_inputs(op, inputs_op[0]), offs_op)
        sweep.run_ours(gg, op, inputs_op[0], offs_op, cfg, torch.empty_like(want))
        del want, inputs_op
        torch.cuda.synchronize()
        if args.profile:
            profiled(pair["pingpong"])
            print(f"profiled one ping-pong launch before and one after {op} {cfg}", flush=True)
            return 0
        measure(f"one launch of {op} {cfg}")
        measure("(again)")
        if args.probes:
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            for programs in (sms, sms - 4, sms - 12, sms // 2):
                ms = median_ms(lambda p=programs: run(pair["pingpong"], p), warmup=1, reps=6)
                print(f"    pingpong with {programs:3d} programs {ms:7.3f}", flush=True)
            time.sleep(2)
            print(f"    pingpong after 2 s idle {median_ms(lambda: run(pair['pingpong']), warmup=0, reps=1):7.3f}",
                  flush=True)
        return 0
    for cfg in tuning.WGRAD_CONFIGS[1:] + tuning.PINGPONG_WGRAD_CONFIGS[1:]:
        try:
            run(cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 (report and go on: the question is what a launch leaves behind)
            print(f"  {cfg} failed: {type(exc).__name__}: {exc}"[:200], flush=True)
            continue
        measure(f"one launch of {cfg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
