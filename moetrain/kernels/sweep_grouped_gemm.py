"""GPU sweep: our Triton grouped GEMM (every autotune config) against torch._grouped_mm.

    python -m moetrain.kernels.sweep_grouped_gemm [--shapes dsv3,qwen3] [--ops fwd,wgrad] [--json PATH]

(--ops fwd_gather adds the forward with A rows gathered through an index array, wgrad_gather the weight
gradient with x's rows gathered so, each against torch on the already-permuted copy.)

One GPU, one process. For each benchmark shape (balanced routing: M/G rows per expert; --routing
skewed adds Dirichlet(0.3) shares, labelled SHAPE/skew) and each
of FC1 (N = 2I, K = H) and FC2 (N = H, K = I), and each op:
    fwd   y [M, N]     = x_g @ w[g]^T       x [M, K], w [G, N, K]
    dgrad dx [M, K]    = dy_g @ w[g]        dy [M, N]
    wgrad dw [G, N, K] = dy_g^T @ x_g
it first checks every config (NaN-poisoned output, relative error against torch._grouped_mm over
the whole output, and against float64 on the first and last non-empty group), then times it with
triton.testing.do_bench (median; the L2 is flushed between runs and the input sets rotate so
that they exceed the L2). Random bf16 data, never zeros. Then backend="auto" (moetrain.ops): its
own first-call measurement picks torch or ours for the op (in a fresh cache directory unless
MOETRAIN_CACHE_DIR is set). The reported numbers come from a final round in which torch, our best
config and auto are timed interleaved (FINAL_ROUNDS rounds, median of each): the config search's
own timings favour ours (the best of many noisy samples) and drift with the GPU's clocks over a
long sweep. Prints progress, then one table:
shape, op, torch TFLOP/s, ours TFLOP/s (best config) and ratio, auto TFLOP/s, ratio and pick, best
config; and per shape the six GEMMs of a layer (ms). --json writes every number (default: $OUT/ when set).
"""

from __future__ import annotations

import dataclasses

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time

import torch

from moetrain.errors import UserError
from moetrain.runtime.timing import in_turns, skewed_offs
from moetrain.kernels.torch_grouped_mm import torch_grouped_mm as torch_op  # the peer (scripts call it by this name)

# name: (routed rows M, experts G, hidden H, expert intermediate I)
SHAPES = {  # the many-small-experts shapes first: they decide the 1.1x claim
    "dsv3": (65536, 256, 7168, 2048),
    "qwen3": (131072, 128, 2048, 768),
    "dsv3-ep8": (65536, 32, 7168, 2048),
    "gptoss": (65536, 32, 2880, 2880),
    "mixtral": (32768, 8, 4096, 14336),
}
OPS = ("fwd", "dgrad", "wgrad")
EXTRA_OPS = ("fwd_gather", "wgrad_gather")
FINAL_ROUNDS = 5
BOUND = 1e-2  # bf16 outputs of two fp32-accumulating GEMMs, and bf16 vs fp64


def layer_gemms(h: int, i: int) -> dict:
    """A layer's two expert GEMMs as (N, K) of their weights w [G, N, K]: FC1 [2I, H] (gate and up), FC2 [H, I]."""
    return {"fc1": (2 * i, h), "fc2": (h, i)}


def log(msg: str, t0: float) -> None:
    print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error in fp32, chunked so that no full fp32 copy of a 15 GB tensor is made."""
    chunk = max(1, (1 << 27) // max(1, got[0].numel()))
    num = den = 0.0
    for a, b in zip(got.split(chunk), want.split(chunk)):
        num += (a.float() - b.float()).pow(2).sum().item()
        den += b.float().pow(2).sum().item()
    return math.sqrt(num / den)


def group_fp64(op: str, a: torch.Tensor, b: torch.Tensor, g: int, s: int, e: int) -> torch.Tensor:
    """Group g's output of a grouped GEMM in float64 (rows [s, e) of a; op "fwd" / "fwd_gather", "dgrad" or
    "wgrad"/"wgrad_gather", a and b as the op reads them): the sweep's and the GPU tests' reference."""
    if op in ("fwd", "fwd_gather"):
        return a[s:e].double() @ b[g].double().T
    if op == "dgrad":
        return a[s:e].double() @ b[g].double()
    return a[s:e].double().T @ b[s:e].double()


def fp64_group_err(op: str, got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: int, e: int, g: int) -> float:
    have = got[s:e] if op in ("fwd", "fwd_gather", "dgrad") else got[g]
    want = group_fp64(op, a, b, g, s, e)
    return ((have.double() - want).norm() / want.norm()).item()


def group_ends(m: int, g: int, routing: str, seed: int = 0) -> torch.Tensor:
    """[G] int32 group ends on the GPU: balanced (M/G rows per group) or skewed (``skewed_offs``)."""
    if routing == "skewed":
        return skewed_offs(m, g, seed, torch.device("cuda"))
    return torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (m // g)


# sweep shape -> bench moe's shape of the same routed rows (its "skewed" routing: K distinct experts per token)
LAYER_SHAPES = {"dsv3": "deepseek-v3", "qwen3": "qwen3-30b-a3b", "dsv3-ep8": "deepseek-v3-ep8",
                "gptoss": "gpt-oss-20b", "mixtral": "mixtral-8x7b"}


def script_group_ends(shape: str, routing: str) -> torch.Tensor:
    """[G] int32 group ends on the GPU for the kernel scripts' --routing: balanced, skewed (``group_ends``) or
    layer-skewed (bench moe's skewed routing of the same shape: moe_layer.routed_offs)."""
    m, g = SHAPES[shape][:2]
    if routing == "layer-skewed":
        from moetrain.bench import moe_layer

        return moe_layer.routed_offs(moe_layer.SHAPES[LAYER_SHAPES[shape]], "skewed", torch.device("cuda"))
    return group_ends(m, g, routing)


def script_times(runs: dict, rounds: int, queued: bool) -> dict:
    """The kernel scripts' timing: name -> median ms of ``runs[name]()`` over ``rounds`` rounds in turns, each round
    10 calls queued back to back (``queued``: timing.queued_ms, as a layer runs them) or timed each from an idle GPU
    (timing.median_ms); the first failure is raised."""
    from moetrain.runtime.timing import median_ms, queued_ms

    def time_one(name):
        if queued:
            return queued_ms(runs[name], reps=10, warmup=2)
        return median_ms(runs[name], warmup=2, reps=10)

    med, failed = in_turns(list(runs), time_one, rounds)
    if failed:
        raise next(iter(failed.values()))
    return med


def script_shapes(text: str) -> list:
    """The kernel scripts' --shapes (comma-separated SHAPES names); an unknown one exits with one line."""
    names = text.split(",")
    unknown = [sh for sh in names if sh not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(sorted(SHAPES))}")
    return names


def script_routings(text: str, layer_skewed: bool = False) -> list:
    """The kernel scripts' --routing: balanced and/or skewed (and layer-skewed where the script takes it: see
    ``script_group_ends``); anything else exits with one line."""
    names = text.split(",")
    known = ("balanced", "skewed", "layer-skewed") if layer_skewed else ("balanced", "skewed")
    if any(r not in known for r in names):
        raise SystemExit(f"--routing: {text!r}: any of {', '.join(known)}")
    return names


def script_stages(text: str, most: int) -> list:
    """The fused-kernel scripts' --stages: comma-separated pipeline depths, each 2..most; else one line and exit."""
    try:
        stages = [int(s) for s in text.split(",")]
    except ValueError:
        stages = []
    if not stages or any(not 2 <= s <= most for s in stages):
        raise SystemExit(f"--stages: {text!r}: each 2..{most}")
    return stages


def require_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} times GPU kernels: no CUDA device visible")


def make_inputs(m: int, g: int, n: int, k: int, sets: int, seed: int, gather: bool, routing: str = "balanced"):
    """``sets`` independent input sets (x, w, dy, x[perm], perm) of random bf16 data, and offs: balanced
    (M/G rows per group) or skewed (``skewed_offs``)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(sets):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(g, n, k, device="cuda", generator=gen) / math.sqrt(k)).to(torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        perm = torch.randperm(m, device="cuda", generator=gen).to(torch.int32) if gather else None
        out.append((x, w, dy, x[perm] if gather else None, perm))
    return out, group_ends(m, g, routing, seed)


def op_inputs(op: str, inp):
    """The two operands as the GEMM sees them (torch and the fp64 checks use these)."""
    x, w, dy, x_perm, _ = inp
    return {"fwd": (x, w), "fwd_gather": (x_perm, w), "dgrad": (dy, w), "wgrad": (dy, x), "wgrad_gather": (dy, x_perm)}[op]


def run_ours(gg, op: str, inp, offs, cfg, out):
    x, w, dy, _, perm = inp
    if op == "fwd":
        return gg.grouped_gemm_fwd(x, w, offs, config=cfg, out=out)
    if op == "fwd_gather":
        return gg.grouped_gemm_fwd(x, w, offs, gather_rows=perm, config=cfg, out=out)
    if op == "wgrad_gather":
        return gg.grouped_gemm_wgrad(dy, x, offs, gather_rows=perm, config=cfg, out=out)
    if op == "dgrad":
        return gg.grouped_gemm_dgrad(dy, w, offs, config=cfg, out=out)
    return gg.grouped_gemm_wgrad(dy, x, offs, config=cfg, out=out)


def bench(fn, sets: int) -> float:
    import triton

    counter = [0]

    def rotated():
        fn(counter[0] % sets)
        counter[0] += 1

    return triton.testing.do_bench(rotated, warmup=10, rep=40, return_mode="median")


def run_case(label, m, g, n, k, ops, gg, t0, results, routing="balanced"):
    """One GEMM shape (FC1 or FC2 of a model): every op, torch and every config."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    set_bytes = 2 * (m * k + g * n * k + m * n)
    sets = max(1, min(4, math.ceil(2 * l2 / set_bytes)))  # rotate so the working set exceeds the L2
    inputs, offs = make_inputs(m, g, n, k, sets, seed=m + n + k, gather=any(o.endswith("_gather") for o in ops), routing=routing)
    flops = 2.0 * m * n * k
    ends = offs.tolist()  # host copy for the fp64 spot checks only (outside any timed region)
    starts = [0] + ends[:-1]
    nonempty = [j for j in range(g) if ends[j] > starts[j]]  # an empty group's relative error is 0/0
    first = (starts[nonempty[0]], ends[nonempty[0]], nonempty[0])
    last = (starts[nonempty[-1]], ends[nonempty[-1]], nonempty[-1])
    for op in ops:
        a0, b0 = op_inputs(op, inputs[0])
        want = torch_op(op, a0, b0, offs)
        torch_err = max(fp64_group_err(op, want, a0, b0, *first), fp64_group_err(op, want, a0, b0, *last))
        torch_ms = bench(lambda i: torch_op(op, *op_inputs(op, inputs[i]), offs), sets)
        row = {"shape": label, "op": op, "M": m, "G": g, "N": n, "K": k, "sets": sets,
               "torch_ms": torch_ms, "torch_tflops": flops / torch_ms / 1e9, "torch_fp64_err": torch_err,
               "configs": []}
        out = torch.empty(want.shape, dtype=want.dtype, device=want.device)
        for cfg in gg.configs_for(op):
            entry = {"config": str(cfg)}
            try:
                out.fill_(float("nan"))
                run_ours(gg, op, inputs[0], offs, cfg, out)
                torch.cuda.synchronize()
                nan = bool(torch.isnan(out).any())
                err = rel_err(out, want)
                e64 = max(fp64_group_err(op, out, a0, b0, *first), fp64_group_err(op, out, a0, b0, *last))
                entry.update(vs_torch=err, fp64_err=e64, ok=not nan and err < BOUND and e64 < BOUND)
                if entry["ok"]:
                    ms = bench(lambda i: run_ours(gg, op, inputs[i], offs, cfg, out), sets)
                    entry.update(ms=ms, tflops=flops / ms / 1e9)
                else:
                    print(f"    WRONG {label} {op} {cfg}: nan={nan} vs_torch={err:.2e} fp64={e64:.2e}", flush=True)
            except Exception as exc:  # a config that does not fit this GPU is reported, not fatal
                entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                print(f"    FAILED {label} {op} {cfg}: {entry['error']}", flush=True)
            row["configs"].append(entry)
        good = [c for c in row["configs"] if c.get("ok")]
        best = min(good, key=lambda c: c["ms"]) if good else None
        row["best"] = best
        if op in OPS:  # backend="auto": its own measurement picks torch or ours; then timed like the others
            from moetrain import tuning
            from moetrain.ops.grouped_gemm import grouped_gemm_op

            def auto(i, op=op):
                return grouped_gemm_op(op, "auto", *op_inputs(op, inputs[i]), offs)

            measured_before = len(tuning.active().decisions)
            auto(0)
            # what auto's tuner compared: torch._grouped_mm and the configs, each timed on the caller's and a skewed
            # routing (when its pick differs from the sweep's best, it judged on other timings than this sweep's)
            mine = [d for d in tuning.active().decisions[measured_before:] if d.key.startswith(f"gemm_{op}+torch|")]
            row["tuner_decision"] = dataclasses.asdict(mine[-1]) if mine else None
        final = {"torch": lambda i: torch_op(op, *op_inputs(op, inputs[i]), offs)}
        if best is not None:
            best_cfg = next(c for c in gg.configs_for(op) if str(c) == best["config"])
            final["ours"] = lambda i: run_ours(gg, op, inputs[i], offs, best_cfg, out)
        if op in OPS:
            final["auto"] = auto
        med, failed = in_turns(list(final), lambda name: bench(final[name], sets), FINAL_ROUNDS)
        if failed:  # each of these already ran above: a failure here is a real error, not a config that does not fit
            raise next(iter(failed.values()))
        row["search_torch_ms"] = row["torch_ms"]
        row["torch_ms"] = med["torch"]
        row["torch_tflops"] = flops / med["torch"] / 1e9
        if best is not None:
            best.update(search_ms=best["ms"], ms=med["ours"], tflops=flops / med["ours"] / 1e9)
        if "auto" in med:
            row["auto_ms"] = med["auto"]
            row["auto_tflops"] = flops / med["auto"] / 1e9
        results.append(row)
        ours = f"{best['tflops']:.0f} TF/s ({best['config']})" if best else "no valid config"
        log(f"{label} {op}: torch {row['torch_tflops']:.0f} TF/s, ours {ours}", t0)
        if row.get("tuner_decision"):  # set only where auto measured above (not answered by the cache)
            from moetrain.tuning import Decision

            d = Decision(**row["tuner_decision"])
            print(f"    auto picked {d.choice}: {d.rule}; {d.summary()}", flush=True)
        print("    " + ", ".join(f"{c['config']} {c['tflops']:.0f}" for c in good), flush=True)
        want = out = None  # free this op's outputs before the next op allocates its own


def _split_precision(argv: list[str]) -> tuple[str, list[str]]:
    """(--precision's value, the other arguments): bf16 (this sweep) or fp8 (``moetrain.bench.fp8_gemm``)."""
    for i, arg in enumerate(argv):
        if arg == "--precision" or arg.startswith("--precision="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            if value not in ("bf16", "fp8"):
                raise UserError(f"--precision {value!r}: valid: bf16, fp8")
            return value, rest
    return "bf16", argv


def main(argv=None) -> int:
    import sys

    precision, argv = _split_precision(list(sys.argv[1:] if argv is None else argv))
    if precision == "fp8":
        from moetrain.bench import fp8_gemm

        return fp8_gemm.main(argv)
    parser = argparse.ArgumentParser(prog="moetrain bench gemm", description=__doc__.split("\n\n")[0] +
                                     " (--precision fp8: the FP8 expert MLP against bf16, bench/fp8_gemm.md)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--ops", default=",".join(OPS), help="comma list of fwd, dgrad, wgrad, fwd_gather, wgrad_gather")
    parser.add_argument("--json", default=None, help="write every config's numbers here")
    parser.add_argument("--routing", default="balanced",
                        help="comma list of balanced (M/G rows per expert) and skewed (Dirichlet(0.3) shares)")
    parser.add_argument("--budget", type=float, default=320.0,
                        help="seconds; no new GEMM shape starts after this (the table covers what ran)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise UserError("moetrain bench gemm needs a CUDA GPU (none is visible)")
    if importlib.util.find_spec("triton") is None:
        raise UserError("moetrain bench gemm needs the triton package (pip install triton)")
    from moetrain.kernels import grouped_gemm as gg

    if gg.interpreting():
        raise UserError("moetrain bench gemm times the compiled kernels: unset TRITON_INTERPRET")
    shapes = [s for s in args.shapes.split(",") if s]
    ops = [o for o in args.ops.split(",") if o]
    for s in shapes:
        if s not in SHAPES:
            parser.error(f"unknown shape {s!r}; valid: {', '.join(SHAPES)}")
    for o in ops:
        if o not in OPS + EXTRA_OPS:
            parser.error(f"unknown op {o!r}; valid: {', '.join(OPS + EXTRA_OPS)}")
    routings = [r for r in args.routing.split(",") if r]
    for r in routings:
        if r not in ("balanced", "skewed"):
            parser.error(f"unknown routing {r!r}; valid: balanced, skewed")

    if not os.environ.get("MOETRAIN_CACHE_DIR"):  # auto measures afresh here, not from an old cache
        os.environ["MOETRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="moetrain-bench-gemm-")
    t0 = time.time()
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}, SMs {torch.cuda.get_device_properties(0).multi_processor_count}",
          flush=True)
    results = []
    for s in shapes:
        m, g, h, i = SHAPES[s]
        for routing in routings:
            name = s if routing == "balanced" else f"{s}/skew"
            for fc, (n, k) in layer_gemms(h, i).items():
                if time.time() - t0 > args.budget:
                    log(f"budget of {args.budget:.0f}s reached: skipping {name} {fc}", t0)
                    continue
                log(f"{name} {fc}: M={m} G={g} N={n} K={k}", t0)
                run_case(f"{name} {fc}", m, g, n, k, ops, gg, t0, results, routing)
                torch.cuda.empty_cache()  # the case's inputs are gone: return their memory

    print("\nshape               op          torch TF/s  ours TF/s   ratio  auto TF/s   ratio  (auto's pick)  best config")
    for r in results:
        b = r["best"]
        ours = f"{b['tflops']:9.0f}  {r['torch_ms'] / b['ms']:6.2f}" if b else "      n/a     n/a"
        auto = (f"{r['auto_tflops']:9.0f}  {r['torch_ms'] / r['auto_ms']:6.2f}  ({r['auto_choice']})"
                if "auto_ms" in r else f"{'':9s}  {'':6s}  {'':8s}")
        print(f"{r['shape']:19s} {r['op']:10s}  {r['torch_tflops']:10.0f}  {ours}  {auto:>24s}  "
              f"{b['config'] if b else '(no valid config)'}")
    if set(OPS) <= set(ops):
        print("\nlayer (six GEMMs, best config each)   torch ms   ours ms   ratio   auto ms   ratio")
        for s in dict.fromkeys(r["shape"].split()[0] for r in results):  # shape (and /skew), in run order
            rows = [r for r in results if r["shape"].split()[0] == s and r["op"] in OPS]
            if len(rows) == 2 * len(OPS) and all(r["best"] for r in rows):
                t_ms = sum(r["torch_ms"] for r in rows)
                o_ms = sum(r["best"]["ms"] for r in rows)
                a_ms = sum(r["auto_ms"] for r in rows)
                print(f"{s:37s}  {t_ms:8.2f}  {o_ms:8.2f}  {t_ms / o_ms:6.2f}  {a_ms:8.2f}  {t_ms / a_ms:6.2f}")
    path = args.json or (os.path.join(os.environ["OUT"], "sweep_grouped_gemm.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nfull results: {path}")
    print(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
