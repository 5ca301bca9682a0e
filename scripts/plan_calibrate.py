"""Planner calibration data (GPU): where a real training step's time goes, on configs that are NOT
among `moetrain plan validate`'s, so that constants fitted to these stay out of sample there.

    python scripts/plan_calibrate.py [--json OUT.json] [--trainer] [NAME ...]

Per config: the trainer's model and optimizer (same classes, same order of calls as
moetrain/train/trainer.py), random tokens, and per step CUDA events around forward, backward and
the tail (grad norm, host sync, clipping, AdamW); medians after warm-up. Then one step under
torch.profiler: GPU kernel time by kind (GEMM, attention, our Triton kernels, optimizer,
other elementwise/reduction) and the number of kernels, forward and backward separately.
Then each decoder layer alone and the head + loss alone (forward and backward, event time and kernel
time by kind). Each config prints the measurement and the roofline's projection of the same phases,
components and kernel kinds (moetrain.plan), the numbers to fit the roofline's constants to (tests
nothing by itself). --trainer also runs the real trainer on each config and prints its median step beside
the script's (what the script's step leaves out: data, metrics, the per-step sync).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

CONFIGS = {  # name: (preset, overrides); none of these is a validation config
    "cal-tiny": ("tiny", []),
    "cal-qwen3-2l": ("qwen3-30b-a3b", ["model.num_layers=2", "train.seq_length=2048", "train.micro_batch_size=2",
                                       "train.global_batch_size=2"]),
    "cal-qwen3-bf16-s1k": ("qwen3-30b-a3b", ["model.num_layers=2", "train.seq_length=1024", "train.micro_batch_size=8",
                                             "train.global_batch_size=8", "precision.master_weights=false",
                                             "optim.main_grads_dtype=bf16", "optim.exp_avg_dtype=bf16",
                                             "optim.exp_avg_sq_dtype=bf16"]),
    "cal-llama-2l": ("llama3-8b", ["model.num_layers=2", "train.seq_length=2048", "train.micro_batch_size=4",
                                   "train.global_batch_size=4"]),
    "cal-mixtral-1l": ("mixtral-8x7b", ["model.num_layers=1", "train.seq_length=8192", "train.micro_batch_size=1",
                                        "train.global_batch_size=1"]),
    "cal-dsv3-32e": ("deepseek-v3", ["model.num_layers=2", "moe.first_k_dense=1", "moe.num_experts=32",
                                     "train.seq_length=2048", "train.micro_batch_size=2", "train.global_batch_size=2"]),
    "cal-gptoss-2l": ("gpt-oss-20b", ["model.num_layers=2", "train.seq_length=4096", "train.micro_batch_size=1",
                                      "train.global_batch_size=1"]),
}


def kind_of(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if any(s in n for s in ("adam", "multi_tensor", "foreach", "lpnorm")):
        return "optimizer"
    if any(s in n for s in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_")):
        return "gemm"
    if name.startswith("_") and "::" not in name:
        return "triton"
    return "elementwise"


def calibrate(name: str, steps: int = 8, warmup: int = 3) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moetrain.config.load import load_config
    from moetrain.models import build_model
    from moetrain.train.optim import DTYPES, PrecisionAwareAdamW

    preset, overrides = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(preset=preset, overrides=overrides + ["train.device=cuda", f"train.out_dir={tmp}"])
    t, o = cfg.train, cfg.optim
    torch.manual_seed(0)
    dev = torch.device("cuda")
    with torch.device(dev):
        model = build_model(cfg)
    model.to(DTYPES[cfg.precision.dtype])
    model.set_recompute(t.recompute, t.recompute_layer_ids)
    opt = PrecisionAwareAdamW(model.named_parameters(), o, cfg.precision.master_weights)
    accum = cfg.grad_accum_steps
    V = cfg.model.vocab_size

    def batch():
        ids = torch.randint(0, V, (t.micro_batch_size, t.seq_length + 1), device=dev)
        return ids[:, :-1], ids[:, 1:]

    def one_step(marks: list | None):
        ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        opt.zero_grad()
        model.reset_moe_stats()
        f = b = 0.0
        evs = []
        for _ in range(accum):
            x, y = batch()
            e0, e1, e2 = ev(), ev(), ev()
            e0.record()
            out = model(x, y)
            e1.record()
            (out.loss / accum).backward()
            e2.record()
            evs.append((e0, e1, e2))
        e3 = ev()
        e3.record()
        norm = opt.grad_norm()
        norm_host = norm.item()  # the trainer's one host sync per step
        if o.clip_grad > 0 and norm_host > o.clip_grad:
            opt.scale_grads(o.clip_grad / (norm_host + 1e-6))
        opt.step(1e-4)
        e4 = ev()
        e4.record()
        torch.cuda.synchronize()
        for e0, e1, e2 in evs:
            f += e0.elapsed_time(e1)
            b += e1.elapsed_time(e2)
        if marks is not None:
            marks.append({"fwd_ms": f, "bwd_ms": b, "tail_ms": e3.elapsed_time(e4),
                          "step_ms": evs[0][0].elapsed_time(e4)})

    marks: list = []
    for i in range(warmup + steps):
        one_step(marks if i >= warmup else None)
    res = {k: statistics.median(m[k] for m in marks) for k in marks[0]}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_step(None)
    kinds: dict[str, list] = {}
    for evt in prof.key_averages():
        if evt.device_type.name != "CUDA" or evt.self_device_time_total <= 0:
            continue
        k = kinds.setdefault(kind_of(evt.key), [0.0, 0])
        k[0] += evt.self_device_time_total / 1e3
        k[1] += evt.count
    res["kernels_ms"] = {k: round(v[0], 3) for k, v in sorted(kinds.items())}
    res["kernels_n"] = {k: v[1] for k, v in sorted(kinds.items())}
    res["config"] = name
    res["components"] = components(model, cfg)
    return res  # the model and optimizer go with this frame; main() empties the CUDA cache


def _timed(fn, reps: int = 5, warmup: int = 2) -> tuple[float, dict, dict]:
    """fn() -> callable for the backward: (forward ms, backward ms) medians by CUDA events, and one
    profiled call's kernel ms and counts by kind, keys 'fwd:<kind>' / 'bwd:<kind>'."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    f_ms, b_ms = [], []
    for i in range(warmup + reps):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        bwd = fn()
        e1.record()
        bwd()
        e2.record()
        torch.cuda.synchronize()
        if i >= warmup:
            f_ms.append(e0.elapsed_time(e1))
            b_ms.append(e1.elapsed_time(e2))
    kern_ms: dict[str, float] = {}
    kern_n: dict[str, int] = {}
    for phase in ("fwd", "bwd"):
        bwd = None if phase == "fwd" else fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            bwd = fn() if phase == "fwd" else bwd()
            torch.cuda.synchronize()
        for evt in prof.key_averages():
            if evt.device_type.name == "CUDA" and evt.self_device_time_total > 0:
                k = f"{phase}:{kind_of(evt.key)}"
                kern_ms[k] = round(kern_ms.get(k, 0.0) + evt.self_device_time_total / 1e3, 3)
                kern_n[k] = kern_n.get(k, 0) + evt.count
    return statistics.median(f_ms), statistics.median(b_ms), {"ms": kern_ms, "n": kern_n}


def components(model, cfg, device: str = "cuda") -> dict:
    """Each decoder layer alone and the head (final norm, logits, fp32 cross-entropy) alone, forward
    and backward on one micro-batch: where the roofline's per-block and head terms miss."""
    import torch

    from moetrain.models.transformer import cross_entropy

    t, H = cfg.train, cfg.model.hidden_size
    dev = torch.device(device)
    B, S = t.micro_batch_size, t.seq_length
    cos, sin = model.rope.tables(S, device=dev)
    dtype = next(model.parameters()).dtype
    h = torch.randn(B, S, H, device=dev, dtype=dtype).requires_grad_()
    grad = torch.randn(B, S, H, device=dev, dtype=dtype)
    labels = torch.randint(0, cfg.model.vocab_size, (B, S), device=dev)
    out = {}

    def layer_step(blk):
        def fn():
            y, aux = blk(h, cos, sin)
            if not aux.requires_grad:  # a dense layer's aux loss is a constant zero
                return lambda: y.backward(grad)
            return lambda: torch.autograd.backward((y, aux), (grad, torch.ones_like(aux)))
        return fn

    def head_step():
        loss = cross_entropy(model._logits(model.final_norm(h)), labels)
        return loss.backward

    for i, blk in enumerate(model.layers):
        out[f"layer{i}"] = _timed(layer_step(blk))
    out["head"] = _timed(head_step)
    model.zero_grad(set_to_none=True)
    return out


GEMM_PARTS = ("attn proj", "experts fc", "shared fc", "mlp fc", "head", "eh_proj", "router")


def projected(name: str) -> dict:
    """The roofline's view of the same config: forward, backward and tail ms (host launches included),
    and the GPU ms of its modelled kernels by kind (router GEMMs counted with gemm, their small
    elementwise ops too: a slight overcount of gemm)."""
    from moetrain.config.load import load_config
    from moetrain.plan.activations import resolve_dims
    from moetrain.plan.costs import Roofline, block_cost, embedding_cost, head_cost, mtp_extra_cost
    from moetrain.plan.hardware import load_hardware
    from moetrain.plan.memory import _window, block_mode
    from moetrain.plan.perf import project_perf

    preset, overrides = CONFIGS[name]
    cfg = load_config(preset=preset, overrides=overrides + ["train.device=cuda"])
    hw = load_hardware("h200-sxm")
    rep = project_perf(cfg, hw, dp_overlap=0.0)
    st = rep.per_rank[0]["stage_times_s"]
    out = {"fwd_ms": 1e3 * sum(s["fwd"] for s in st), "bwd_ms": 1e3 * sum(s["bwd"] + s["wgrad"] for s in st),
           "tail_ms": 1e3 * rep.breakdown["tail_max"], "step_ms": 1e3 * rep.step_time_s}
    d = resolve_dims(cfg, "auto", 1.0, "cuda")
    rf = Roofline(hw, cfg.precision.dtype)
    costs = [block_cost(cfg, d, rf, cfg.is_moe_layer(i), _window(cfg, i), block_mode(cfg, i))
             for i in range(cfg.model.num_layers)]  # as plan.perf.stage_times walks them (sliding windows too)
    costs += [head_cost(cfg, d, rf), embedding_cost(cfg, d, rf)]
    costs += [block_cost(cfg, d, rf, cfg.is_moe, None, "none")] * cfg.model.mtp_num_layers
    costs += [mtp_extra_cost(cfg, d, rf)] * cfg.model.mtp_num_layers
    kinds = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0}
    for bc in costs:
        for phase in (bc.fwd, bc.bwd_input, bc.bwd_weight):
            for part, sec in phase.parts.items():
                part = part.removeprefix("recompute ")
                kind = "gemm" if part.startswith(GEMM_PARTS) else "attention" if part == "attention" else "elementwise"
                kinds[kind] += 1e3 * sec * cfg.grad_accum_steps
    out["kernels_ms"] = {k: round(v, 3) for k, v in kinds.items()}
    launch = hw.launch_overhead_us * 1e-6
    comp = {f"layer{i}": c for i, c in enumerate(costs[:cfg.model.num_layers])}
    comp["head"] = costs[cfg.model.num_layers]
    out["components"] = {}
    for key, bc in comp.items():
        bwd_gpu = bc.bwd_input.gpu + bc.bwd_weight.gpu
        bwd_kernels = bc.bwd_input.kernels + bc.bwd_weight.kernels
        out["components"][key] = {
            "fwd_ms": 1e3 * bc.fwd.time(launch), "bwd_ms": 1e3 * max(bwd_gpu, bwd_kernels * launch),
            "fwd_gpu_ms": 1e3 * bc.fwd.gpu, "bwd_gpu_ms": 1e3 * bwd_gpu, "fwd_n": bc.fwd.kernels, "bwd_n": bwd_kernels,
            "parts_ms": {f"{ph}:{k}": round(1e3 * v, 3) for ph, c in (("fwd", bc.fwd), ("bwd", bc.bwd_input),
                                                                    ("wgrad", bc.bwd_weight))
                         for k, v in c.parts.items()}}
    return out


def trainer_step(name: str, steps: int = 16, device: str = "cuda") -> dict:
    """The real trainer (moetrain.train.trainer.run) on the same config in this process: its median step
    (host clock, synchronised) beside the script's CUDA-event step, to find what the script does not time."""
    import statistics
    import tempfile

    from moetrain.config.load import load_config
    from moetrain.train.trainer import run

    preset, overrides = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(preset=preset, overrides=overrides + [
            f"train.device={device}", f"train.out_dir={tmp}", f"train.steps={steps}", f"train.log_interval={steps}",
            "checkpoint.save_final=false", "optim.warmup_steps=1", "train.eval_interval=0"])
        times = [r["step_time_s"] for r in run(cfg, show_progress=False).records]
    return {"trainer_step_ms": 1e3 * statistics.median(times[4:] if len(times) > 4 else times)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", default=list(CONFIGS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--trainer", action="store_true", help="also time the real trainer's step on each config")
    args = ap.parse_args(argv)
    rows = []
    for name in args.names:
        try:
            r = calibrate(name)
        except Exception as err:  # one config's failure is reported, the rest still run
            r = {"config": name, "error": f"{type(err).__name__}: {err}"[:300]}
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
        if args.trainer and "error" not in r:
            try:
                r.update(trainer_step(name))
            except Exception as err:
                r["trainer_error"] = f"{type(err).__name__}: {err}"[:300]
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(r)
        if "error" in r:
            print(f"{name:22s} ERROR {r['error']}", flush=True)
            continue
        if "trainer_step_ms" in r:
            print(f"{name:20s} trainer   step {r['trainer_step_ms']:8.2f} ms (the script's step: {r['step_ms']:.2f})",
                  flush=True)
        elif "trainer_error" in r:
            print(f"{name:20s} trainer   ERROR {r['trainer_error']}", flush=True)
        r["projected"] = p = projected(name)
        for who, x in (("measured", r), ("roofline", p)):
            print(f"{name:20s} {who:9s} fwd {x['fwd_ms']:8.2f}  bwd {x['bwd_ms']:8.2f}  tail {x['tail_ms']:7.2f}  "
                  f"step {x['step_ms']:8.2f} ms | kernels ms {x['kernels_ms']}", flush=True)
        print(f"{'':20s} kernels launched per step: {r['kernels_n']}", flush=True)
        for key, (f_ms, b_ms, kern) in r["components"].items():
            pc = p["components"][key]
            gpu = {ph: sum(v for k, v in kern["ms"].items() if k.startswith(ph)) for ph in ("fwd", "bwd")}
            n = {ph: sum(v for k, v in kern["n"].items() if k.startswith(ph)) for ph in ("fwd", "bwd")}
            print(f"{'':4s}{key:7s} measured fwd {f_ms:7.2f} (gpu {gpu['fwd']:7.2f}, {n['fwd']:4d} k)  bwd {b_ms:7.2f} "
                  f"(gpu {gpu['bwd']:7.2f}, {n['bwd']:4d} k) | roofline fwd {pc['fwd_ms']:7.2f} (gpu {pc['fwd_gpu_ms']:7.2f}, "
                  f"{pc['fwd_n']:4.0f} k)  bwd {pc['bwd_ms']:7.2f} (gpu {pc['bwd_gpu_ms']:7.2f}, {pc['bwd_n']:4.0f} k)",
                  flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
