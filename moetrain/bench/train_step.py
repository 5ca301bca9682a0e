"""Training-step throughput of `moetrain train` against a Hugging Face transformers peer.

Runs in one process on one GPU, same model shape, same synthetic batches, same FLOP count
(moetrain's accounting of the config, i.e. 6 x active matmul params + causal attention):

    moetrain bench train --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2
    moetrain bench train --proxy deepseek-v3-ep8     (a named proxy: PROXIES below, 32k tokens a step)

Contenders:
  moetrain (fp32 master)   bf16 params, fp32 master weights, fp32 main grads and Adam moments
  moetrain (bf16 state)    bf16 params updated in place, bf16 grads and Adam moments
  moetrain (bf16 state, fp8 R)   with --fp8 R: the bf16-state contender with precision.fp8_recipe=R
  moetrain (bf16 state, fp8 dense D)   with --fp8-dense D: the bf16-state contender with precision.fp8_dense=D
                           (torchao's float8 linears for attention, dense MLPs and shared experts)
  moetrain (..., cuda graph)   with --cuda-graph: the fp32-master contender with train.cuda_graph (forward +
                           backward replayed from one CUDA graph after two eager steps)
  moetrain (bf16 state, K=V)   with --with K=V[,K=V...]: the bf16-state contender with those overrides
                           (`master:K=V,...`: the fp32-master contender), e.g. --with train.fused_loss=true;
                           --with train.backend=jax runs the JAX backend's trainer (moetrain.jax) in this process
  moetrain (..., torchrun world 1)   with --distributed: the fp32-master and bf16-state contenders through the
                           distributed trainer (a one-rank NCCL group in this process: FSDP2, the sharded
                           fp32 parameters as masters), against the single-device path in the same run
  hf transformers          the model class from transformers (grouped_mm experts, SDPA),
                           bf16 params, torch.optim.AdamW(fused=True) -- moments in bf16 too
Each contender trains `--steps` steps; medians are taken over the steps after `--warmup`.
The moetrain contenders repeat after the peer, so drift in the machine shows as a spread.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moetrain.bench.kernel_classes import by_class
from moetrain.config.load import load_config
from moetrain.config.schema import Config
from moetrain.errors import UserError
from moetrain.models.accounting import train_flops_per_token
from moetrain.train.throughput import peak_tflops


# The training proxies: reduced-depth models at >= 32k tokens per step (gradient accumulation), so the optimizer is
# amortised as in real runs. deepseek-v3-ep8: the expert GEMM shapes one rank of EP8 runs (256 / 8 = 32 routed
# experts, top-8), 1 dense + 3 MoE layers; no MTP layer, as transformers (the peer) runs none.
PROXIES = {
    "qwen3-4l": dict(preset="qwen3-30b-a3b", layers=4, seq=4096, mbs=2, gbs=8, set=[]),
    "deepseek-v3-ep8": dict(preset="deepseek-v3", layers=4, seq=4096, mbs=1, gbs=8,
                            set=["moe.num_experts=32", "moe.first_k_dense=1"]),
    "mixtral-2l": dict(preset="mixtral-8x7b", layers=2, seq=4096, mbs=2, gbs=8, set=[]),
    "gpt-oss-4l": dict(preset="gpt-oss-20b", layers=4, seq=4096, mbs=1, gbs=8, set=[]),
}


def top_kernels(trace: Path, steps: int, count: int = 20) -> str:
    """The GPU kernels that took the most time in a Chrome trace, per step."""
    events = json.loads(trace.read_text())["traceEvents"]
    totals: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            totals[e["name"]] = totals.get(e["name"], 0.0) + e.get("dur", 0.0)
    busy = sum(totals.values())
    lines = [f"  GPU busy {busy / steps / 1e3:.1f} ms/step; by class (ms/step, share of busy):"]
    for label, dur in by_class(totals).items():
        lines.append(f"  {dur / steps / 1e3:8.2f}  {dur / max(busy, 1e-9):6.1%}  {label}")
    lines.append("  top kernels (ms/step):")
    for name, dur in sorted(totals.items(), key=lambda kv: -kv[1])[:count]:
        lines.append(f"  {dur / steps / 1e3:8.2f}  {name[:110]}")
    return "\n".join(lines)


@contextlib.contextmanager
def one_rank_launch():
    """torchrun's environment for a one-rank job in this process (the distributed trainer makes and destroys its
    process group), restored afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def moetrain_run(preset: str, base: list[str], name: str, steps: int, warmup: int, extra: list[str],
                 profile: bool = False, distributed: bool = False) -> dict:
    """One moetrain contender's row; a contender that does not fit (the trainer's refusal or out of memory) is
    reported in its row (``error``), and the others still run."""
    try:
        return _moetrain_run(preset, base, name, steps, warmup, extra, profile, distributed)
    except Exception as err:
        # refusals and out-of-memory (torch's, or XLA's RESOURCE_EXHAUSTED for a JAX contender) make a row; bugs raise
        if not isinstance(err, (UserError, torch.OutOfMemoryError)) and "RESOURCE_EXHAUSTED" not in str(err):
            raise
        gc.collect()
        torch.cuda.empty_cache()
        return {"name": name, "error": str(err).strip().splitlines()[0][:200]}


def _moetrain_run(preset: str, base: list[str], name: str, steps: int, warmup: int, extra: list[str],
                  profile: bool, distributed: bool) -> dict:
    from moetrain.train.trainer import run

    with tempfile.TemporaryDirectory() as out, (one_rank_launch() if distributed else contextlib.nullcontext()):
        prof = ["profile.enabled=true", f"profile.start_step={steps - 2}", f"profile.end_step={steps}"]
        cfg = load_config(preset=preset, overrides=[
            *base, f"train.out_dir={out}", f"train.steps={steps}", "checkpoint.save_final=false",
            "train.device=cuda", *extra, *(prof if profile else [])])
        result = run(cfg, show_progress=False)
        if profile:
            print(f"{name}:\n" + top_kernels(next(Path(out, "profile").glob("*.json")), 3), flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    timed = result.records[warmup:]
    return {
        "name": name,
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in timed),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in result.records),
        "peak_mem_fwd_bwd_gib": max(r["peak_mem_fwd_bwd_gib"] for r in result.records),
        "first_loss": result.records[0]["loss"], "last_loss": result.records[-1]["loss"],
    }


def hf_config(cfg: Config):
    """The transformers config of the same architecture (the HF export's mapping; MTP dropped: transformers runs no
    MTP head); UserError for a model no transformers family expresses."""
    import transformers

    from moetrain.models.hf_config import hf_config_from_cfg, infer_model_type

    hf = hf_config_from_cfg(cfg, infer_model_type(cfg), dtype="bfloat16", drop_mtp=True)
    hf["output_router_logits"] = False
    hf["max_position_embeddings"] = max(cfg.train.seq_length, hf["max_position_embeddings"])
    return transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)


def hf_run(cfg: Config, steps: int, warmup: int, profile: bool = False) -> dict:
    import transformers

    from moetrain.train.data import build_data

    torch.manual_seed(cfg.train.seed)
    hf_cfg = hf_config(cfg)
    # SDPA where the family takes it; GPT-OSS's attention sinks take flex attention (or eager) only
    attn = "sdpa" if getattr(transformers.AutoModelForCausalLM._model_mapping[type(hf_cfg)], "_supports_sdpa",
                             True) else "flex_attention"
    kwargs = dict(attn_implementation=attn, dtype=torch.bfloat16)
    # built on the GPU: transformers initialises every weight where it is created, which takes ~90 s on the host
    # for a 3B-parameter proxy and seconds on the device
    with torch.device("cuda"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, experts_implementation="grouped_mm",
                                                                  **kwargs)
            impl = "grouped_mm"
        except TypeError:  # older transformers without the experts interface
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, **kwargs)
            impl = "default"
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                            weight_decay=cfg.optim.weight_decay, fused=True)
    data = build_data(cfg, cfg.model.vocab_size, "train")
    accum = cfg.grad_accum_steps
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    flops = train_flops_per_token(cfg, cfg.train.seq_length) * tokens
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats()
    profiler = None
    for step in range(steps):
        if profile and step == steps - 3:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        torch.cuda.synchronize()
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device="cuda")
        for _ in range(accum):
            input_ids, _ = data.next_batch(cfg.train.micro_batch_size)
            input_ids = input_ids.cuda()
            loss = model(input_ids=input_ids, labels=input_ids).loss
            (loss / accum).backward()
            total += loss.detach() / accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
        opt.step()
        losses.append(total.item())
        times.append(time.perf_counter() - started)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    if profiler is not None:
        profiler.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as out:
            profiler.export_chrome_trace(f"{out}/hf.json")
            print("hf transformers:\n" + top_kernels(Path(out, "hf.json"), 3), flush=True)
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    step_time = statistics.median(times[warmup:])
    return {"name": f"hf transformers ({impl}, {attn})", "step_time_s": step_time, "tokens_per_s": tokens / step_time,
            "tflops_per_gpu": flops / step_time / 1e12, "peak_mem_gib": peak_gib,
            "first_loss": losses[0], "last_loss": losses[-1]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="moetrain bench train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proxy", choices=sorted(PROXIES), default=None,
                        help="a named training proxy (its preset, layers, seq, mbs, gbs and overrides; --set adds)")
    parser.add_argument("--preset", default=None, help="default: qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="default: 4")
    parser.add_argument("--seq", type=int, default=None, help="default: 4096")
    parser.add_argument("--mbs", type=int, default=None, help="default: 2")
    parser.add_argument("--gbs", type=int, default=None, help="global batch (default: one micro-batch)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    parser.add_argument("--profile", action="store_true", help="print each contender's top GPU kernels")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="add the fp32-master contender with train.cuda_graph=true")
    parser.add_argument("--distributed", action="store_true",
                        help="add both moetrain contenders through the distributed trainer (world size 1)")
    parser.add_argument("--fp8", default="", help="comma list of FP8 recipes (precision.fp8_recipe): add the "
                        "bf16-state contender with the experts' GEMMs in each")
    parser.add_argument("--fp8-dense", default="", help="comma list of precision.fp8_dense recipes (tensorwise, "
                        "rowwise): add the bf16-state contender with the dense linears in each (torchao)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every moetrain contender and the peer's shape (repeatable), "
                        "e.g. --set moe.num_experts=32 for a proxy")
    parser.add_argument("--with", dest="variants", action="append", default=[], metavar="[master:]K=V[,K=V]",
                        help="add the bf16-state (or with master: the fp32-master) contender with these overrides "
                        "(repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    shape = ("preset", "layers", "seq", "mbs", "gbs")
    if args.proxy:
        given = [f"--{k}" for k in shape if getattr(args, k) is not None]
        if given:
            raise UserError(f"--proxy {args.proxy} fixes the model and batch; drop {', '.join(given)} (or use --set)")
        for k in shape:
            setattr(args, k, PROXIES[args.proxy][k])
        args.set = PROXIES[args.proxy]["set"] + args.set
    for k, default in zip(shape, ("qwen3-30b-a3b", 4, 4096, 2, None)):
        if getattr(args, k) is None:
            setattr(args, k, default)
    dense = [d for d in args.fp8_dense.split(",") if d]
    bad = [d for d in dense if d not in ("tensorwise", "rowwise")]
    if bad:
        raise UserError(f"--fp8-dense {', '.join(bad)}: not a precision.fp8_dense recipe; valid: tensorwise, rowwise")
    base = [f"model.num_layers={args.layers}", f"train.seq_length={args.seq}", f"train.micro_batch_size={args.mbs}",
            f"train.global_batch_size={args.gbs or args.mbs}", "optim.warmup_steps=5", "optim.lr=3e-4",
            "model.mtp_num_layers=0", "train.eval_interval=0", "train.log_interval=1000000", *args.set]
    cfg = load_config(preset=args.preset, overrides=base)
    if not args.no_peer:
        try:
            hf_config(cfg)  # refuses, before any contender runs, a model the peer does not cover
        except UserError as e:
            raise UserError(f"the transformers peer: {e}; pass --no-peer to run without it") from None
    if not torch.cuda.is_available():
        raise UserError("moetrain bench train needs a CUDA GPU (none is visible)")
    # A JAX contender shares the GPU with torch in this process: JAX must allocate as it goes, not take 75% of the
    # memory when it starts (read when JAX starts its backend, so before any contender runs)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    bf16_state = ["precision.master_weights=false", "optim.main_grads_dtype=bf16",
                  "optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16"]
    rows = [moetrain_run(args.preset, base, "moetrain (fp32 master)", args.steps, args.warmup, [], args.profile),
            moetrain_run(args.preset, base, "moetrain (bf16 state)", args.steps, args.warmup, bf16_state,
                         args.profile)]
    for recipe in filter(None, args.fp8.split(",")):
        rows.append(moetrain_run(args.preset, base, f"moetrain (bf16 state, fp8 {recipe})", args.steps, args.warmup,
                                 [*bf16_state, f"precision.fp8_recipe={recipe}"], args.profile))
    for recipe in dense:
        rows.append(moetrain_run(args.preset, base, f"moetrain (bf16 state, fp8 dense {recipe})", args.steps,
                                 args.warmup, [*bf16_state, f"precision.fp8_dense={recipe}"], args.profile))
    for variant in args.variants:
        master, _, overrides = variant.partition(":") if variant.startswith("master:") else ("", "", variant)
        name = f"moetrain ({'fp32 master' if master else 'bf16 state'}, {overrides})"
        rows.append(moetrain_run(args.preset, base, name, args.steps, args.warmup,
                                 [*([] if master else bf16_state), *overrides.split(",")], args.profile))
    if args.distributed:
        rows.append(moetrain_run(args.preset, base, "moetrain (fp32 master, torchrun world 1)", args.steps, args.warmup,
                                 [], distributed=True))
        rows.append(moetrain_run(args.preset, base, "moetrain (bf16 state, torchrun world 1)", args.steps, args.warmup,
                                 bf16_state, distributed=True))
    if args.cuda_graph:
        rows.append(moetrain_run(args.preset, base, "moetrain (fp32 master, cuda graph)", args.steps, args.warmup,
                                 ["train.cuda_graph=true"], args.profile))
    if not args.no_peer:
        try:
            rows.append(hf_run(cfg, args.steps, args.warmup, args.profile))
        except torch.OutOfMemoryError as err:
            gc.collect()
            torch.cuda.empty_cache()
            rows.append({"name": "hf transformers", "error": str(err).strip().splitlines()[0][:200]})
        rows.append(moetrain_run(args.preset, base, "moetrain (bf16 state) again", args.steps, args.warmup,
                                 bf16_state))
    peak = peak_tflops(torch.cuda.get_device_name(), "bf16")
    print(f"\n{args.preset}, {args.layers} layers, seq {args.seq}, {cfg.train.global_batch_size} x {args.seq} "
          f"tokens/step, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    width = max(40, *(len(r["name"]) for r in rows))
    print(f"{'contender':{width}s} {'ms/step':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GiB':>9s} "
          f"{'loss first->last':>18s}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:{width}s} {r['error']}")
            continue
        r["mfu"] = r["tflops_per_gpu"] / peak if peak else None
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"{r['name']:{width}s} {r['step_time_s'] * 1e3:8.1f} {r['tokens_per_s']:10,.0f} "
              f"{r['tflops_per_gpu']:8.1f} "
              f"{mfu:>6s} {r['peak_mem_gib']:9.1f} {r['first_loss']:8.3f}->{r['last_loss']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
