"""`moetrain plan memory | perf | validate | timeline | tune`: argparse wiring for the planner.

``register(commands, add_config_source)`` adds the ``plan`` command tree to the subparsers
object of moetrain/cli.py. ``plan memory`` and ``plan perf`` (without --measure) import torch only
for a pipeline (pp > 1): its schedule's order comes from torch.distributed.pipelining.
``python -m moetrain.plan ...`` runs the same commands standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moetrain.errors import UserError


def _load(args):
    from moetrain.config.load import load_config

    return load_config(path=args.config, preset=args.preset, overrides=args.overrides)


def _hardware(args):
    from moetrain.plan.hardware import load_hardware

    return load_hardware(args.hardware)


def _check_options(args) -> None:
    if getattr(args, "moe_imbalance", 1.0) < 1.0:
        raise UserError(f"--moe-imbalance = {args.moe_imbalance}: must be >= 1 (worst rank / average routed rows)")
    if not 0.0 <= getattr(args, "dp_overlap", 0.0) <= 1.0:
        raise UserError(f"--dp-overlap = {args.dp_overlap}: must be between 0 and 1")


def cmd_memory(args) -> int:
    _check_options(args)
    cfg = _load(args)
    hw = _hardware(args)
    from moetrain.plan.memory import project_memory
    from moetrain.plan.report import memory_json, memory_table

    rep = project_memory(cfg, hw, attention=args.attention, moe_imbalance=args.moe_imbalance)
    print(memory_json(cfg, rep, hw) if args.json else memory_table(cfg, rep))
    return 0


def cmd_perf(args) -> int:
    _check_options(args)
    cfg = _load(args)
    hw = _hardware(args)
    from moetrain.plan.perf import project_perf
    from moetrain.plan.report import perf_json, perf_table

    measured = None
    if args.measure:
        from moetrain.plan.measure import measure_blocks  # imports torch

        measured = measure_blocks(cfg)
    rep = project_perf(cfg, hw, attention=args.attention, moe_imbalance=args.moe_imbalance,
                       dp_overlap=args.dp_overlap, measured=measured, measured_hooks=measured is not None)
    if args.timeline or args.png:
        from moetrain.plan.perf import timeline_of

        tl = timeline_of(cfg, rep)
        if args.timeline:
            Path(args.timeline).write_text(tl.to_json())
        if args.png:
            from moetrain.plan.timeline_render import render_png

            render_png([tl], args.png)
    print(perf_json(cfg, rep, hw) if args.json else perf_table(cfg, rep, hw))
    return 0


def _simulated(cfg, hw, args, label: str):
    """The planner's timeline of ``cfg``: perf's per-stage times through the schedule, memory's peak per rank."""
    from moetrain.plan.memory import GiB, project_memory
    from moetrain.plan.perf import project_perf, timeline_of

    rep = project_perf(cfg, hw, attention=args.attention, moe_imbalance=args.moe_imbalance)
    tl = timeline_of(cfg, rep)
    mem = project_memory(cfg, hw, attention=args.attention, moe_imbalance=args.moe_imbalance)
    tl.label, tl.peak_mem_gib = label, [r.total / GiB for r in mem.ranks]
    return tl


SOURCE_HINT = "a SOURCE is a config YAML file, preset:NAME or a run directory holding pp_timeline/"


def _source_kind(source: str) -> str:
    """preset, config (simulated) or run (measured); UserError for anything else."""
    from moetrain.plan.timeline import has_run_timeline

    path = Path(source)
    if source.startswith("preset:"):
        return "preset"
    if path.is_dir():
        if not has_run_timeline(path):
            raise UserError(f"{source}: no pp_timeline/rank<r>.json files in this directory (a pipeline run writes "
                            "them with profile.dump_pp_data=true)")
        return "run"
    if path.is_file() and path.suffix.lower() in (".yaml", ".yml"):
        return "config"
    if path.is_file():
        raise UserError(f"{source}: not a config (.yaml) or a run directory; {SOURCE_HINT}")
    raise UserError(f"{source}: no such file or directory; {SOURCE_HINT}")


def _timelines(args) -> list:
    """One Timeline per SOURCE: preset:NAME or a config YAML file -> simulated (the overrides applied), a run
    directory -> measured."""
    from moetrain.config.load import load_config
    from moetrain.plan.timeline import read_run

    items = list(args.sources) + [f"preset:{name}" for name in args.preset or ()] + list(args.config or ())
    overrides = [s for s in items if "=" in s and not s.startswith("preset:") and not Path(s).exists()]
    overrides += args.overrides
    sources = [s for s in items if s not in overrides]
    if not sources:
        raise UserError(f"plan timeline needs a SOURCE: {SOURCE_HINT.removeprefix('a SOURCE is ')}")
    kinds = [(_source_kind(s), s) for s in sources]
    if overrides and all(kind == "run" for kind, _ in kinds):
        raise UserError(f"overrides ({' '.join(overrides)}) apply to config sources (a YAML file or preset:NAME); "
                        "only run directories were given")
    hw = _hardware(args) if any(kind != "run" for kind, _ in kinds) else None
    out = []
    for kind, s in kinds:
        if kind == "run":
            out.append(read_run(s, args.step))
        else:
            cfg = load_config(path=s if kind == "config" else None,
                              preset=s.removeprefix("preset:") if kind == "preset" else None, overrides=overrides)
            out.append(_simulated(cfg, hw, args, s))
    return out


def cmd_timeline(args) -> int:
    _check_options(args)
    if args.out is None and not args.json:
        raise UserError("plan timeline needs --out FILE.png|FILE.html (or --json)")
    from moetrain.plan.timeline_render import check_output, render

    if args.out is not None:
        check_output(args.out)
    timelines = _timelines(args)
    if args.out is not None:
        render(timelines, args.out)
    if args.json:
        print(json.dumps({"timelines": [tl.to_dict() for tl in timelines]}, indent=1))
    return 0


def cmd_validate(args) -> int:
    from moetrain.plan.validate import run_validation

    run_validation(args.configs, json_out=args.json, out_dir=args.out, steps=args.steps, hardware=args.hardware,
                   measure=not args.no_measure)
    return 0


def _tune_space(args, base):
    from moetrain.plan.tune_space import OPTIM, TUNED_KEYS, Space

    if args.gpus < 1:
        raise UserError(f"--gpus = {args.gpus}: must be >= 1")
    if args.top < 1:
        raise UserError(f"--top = {args.top}: must be >= 1")
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        raise UserError(f"--gpu-memory = {args.gpu_memory}: must be > 0 GiB")
    optim = tuple(x for x in args.optim.split(",") if x)
    bad = [x for x in optim if x not in OPTIM]
    if bad or not optim:
        raise UserError(f"--optim {args.optim!r}: valid names are {', '.join(OPTIM)} (comma-separated)")
    gbs = args.global_batch or base.train.global_batch_size
    if gbs < 1:
        raise UserError(f"--global-batch = {gbs}: must be >= 1")
    user = {text.partition("=")[0].strip() for text in args.overrides}  # the keys the command line set
    fixed = tuple((k, getattr(getattr(base, k.split(".")[0]), k.split(".")[1])) for k in TUNED_KEYS if k in user)
    return Space(gpus=args.gpus, global_batch=gbs, optim=optim, max_mbs=args.max_mbs, max_vpp=args.max_vpp,
                 plan_only=args.plan_only, fixed=fixed)


def _tune_command(args) -> str:
    """The search's inputs as one command line (the winner YAML's first line)."""
    parts = ["moetrain plan tune", f"--config {args.config}" if args.config else f"--preset {args.preset or 'tiny'}",
             *args.overrides, f"--gpus {args.gpus}", f"--hardware {args.hardware}"]
    for flag, value in (("--gpu-memory", args.gpu_memory), ("--global-batch", args.global_batch),
                        ("--optim", args.optim), ("--max-mbs", args.max_mbs), ("--max-vpp", args.max_vpp)):
        if value is not None:
            parts.append(f"{flag} {value}")
    return " ".join(parts + (["--plan-only"] if args.plan_only else []))


def cmd_tune(args) -> int:
    import dataclasses

    from moetrain.config.load import load_config
    from moetrain.plan import tune_report as R
    from moetrain.plan.tune import Options, tune

    _check_options(args)
    base = _load(args)
    hw = _hardware(args)
    if args.gpu_memory is not None:
        hw = dataclasses.replace(hw, hbm_gib=args.gpu_memory, sources={**hw.sources, "hbm_gib": "user (--gpu-memory)"})
    space = _tune_space(args, base)
    if args.global_batch:
        base = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch_size=args.global_batch))
    opts = Options(top_k=args.top, attention=args.attention, moe_imbalance=args.moe_imbalance,
                   dp_overlap=args.dp_overlap)
    result = tune(base, hw, space, opts, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    if not result.found:
        raise UserError(f"no configuration of {base.model.name} on {args.gpus} x {hw.name} fits "
                        f"{result.limit_gib:.1f} GiB per GPU (the planner's fits limit) with global batch "
                        f"{space.global_batch}: {result.stats.shapes} shapes, {result.stats.infeasible} pipeline "
                        "options out of memory even with every block recomputed; try more GPUs, a smaller "
                        "train.seq_length, or --plan-only for context parallelism")
    if args.plan_only:
        result.notes.append("--plan-only: candidates with parallel.cp or parallel.etp > 1 are projections only; "
                            "moetrain train refuses them today")
    extra = [f"train.global_batch_size={space.global_batch}"] if args.global_batch else []
    loader = lambda over: load_config(path=args.config, preset=args.preset,  # noqa: E731
                                      overrides=list(args.overrides) + extra + over)
    cands = R.official(result, loader, hw, args.attention, args.moe_imbalance, args.dp_overlap)
    path = args.out or f"runs/tune/{base.model.name}-{args.gpus}x{hw.name}.yaml"
    written = R.write_winner(cands[0], path, _tune_command(args))
    title = (f"{base.model.name} on {args.gpus} x {hw.name} ({hw.hbm_gib:g} GiB), global batch {space.global_batch} "
             f"x {base.train.seq_length}: top {len(cands)} of the search ({result.stats.seconds:.1f} s)")
    if not args.json:
        print(R.table(cands, result, hw, title))
        print(f"winner written to {written} (moetrain train --config {written})", flush=True)
    validation = None
    if args.validate:
        from moetrain.plan import tune_validate as V

        validation = V.run_validation(cands, hw, top=args.validate_top, steps=args.steps, out_dir=args.validate_out)
        if not args.json:
            print(V.text(validation))
    if args.json:
        print(R.result_json(cands, result, hw, args.gpus, written, validation))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", metavar="NAME|FILE", default="h200-sxm",
                   help="built-in profile (a100-80gb-sxm, h100-sxm, h200-sxm, b200, mi300x, mi355x) or a YAML file")
    p.add_argument("--json", action="store_true", help="machine-readable JSON")
    p.add_argument("--attention", choices=("auto", "fused", "unfused"), default="auto",
                   help="attention kernel assumed: auto (what torch picks on CUDA), fused (flash / memory-efficient), "
                        "unfused (math path storing the [S, S] scores)")
    p.add_argument("--moe-imbalance", type=float, default=1.0, metavar="X",
                   help="routed rows on the busiest rank / average (>= 1; default 1 = balanced)")


def register(commands, add_config_source) -> None:
    """Add `plan memory | perf | validate | timeline | tune` to the argparse subparsers object ``commands``."""
    plan = commands.add_parser("plan", help="project memory and step time before using GPUs").add_subparsers(
        dest="subcommand", metavar="SUBCOMMAND", required=True)

    p = plan.add_parser("memory", help="per-GPU memory per pipeline rank and a fits / at-risk / out-of-memory verdict")
    add_config_source(p)
    _common(p)
    p.set_defaults(func=cmd_memory)

    p = plan.add_parser("perf", help="step time, tokens/s/GPU, TFLOP/s/GPU, MFU, pipeline bubbles")
    add_config_source(p)
    _common(p)
    p.add_argument("--measure", action="store_true",
                   help="time one block of each kind and the head + loss forward+backward on the local GPU instead of the roofline")
    p.add_argument("--dp-overlap", type=float, default=0.5, metavar="F",
                   help="fraction of data-parallel gradient/parameter communication hidden behind compute (default 0.5)")
    p.add_argument("--timeline", metavar="FILE", help="write the pipeline timeline as JSON (per rank, per micro-batch)")
    p.add_argument("--png", metavar="FILE", help="render the pipeline timeline as a PNG (needs matplotlib)")
    p.set_defaults(func=cmd_perf)

    p = plan.add_parser("timeline", help="draw pipeline timelines, simulated (a config) or measured (a run), stacked",
                        description="SOURCE: a config YAML file or preset:NAME (simulated by the planner; key=value "
                                    "overrides apply to them) or a run directory holding pp_timeline/ (measured, "
                                    "profile.dump_pp_data=true). Several sources: one panel each, one time axis.")
    p.add_argument("sources", nargs="*", metavar="SOURCE", help="config YAML, preset:NAME or run directory; key=value")
    p.add_argument("--preset", action="append", metavar="NAME", help="a built-in preset as a source (repeatable)")
    p.add_argument("--config", action="append", metavar="FILE", help="a config YAML file as a source (repeatable)")
    p.add_argument("--out", metavar="FILE.png|FILE.html", help="the figure: PNG (matplotlib) or a self-contained HTML")
    p.add_argument("--step", type=int, metavar="N", help="the recorded step of run directories (default: the last)")
    _common(p)
    p.set_defaults(func=cmd_timeline, overrides=[])

    p = plan.add_parser("tune", help="search parallel degrees, pipeline layouts, schedules, recompute and "
                                     "precision for the fastest step that fits; write the winner as a YAML",
                        description="Keys set on the command line (key=value) stay fixed; the search takes the "
                                    "rest. parallel.cp and parallel.etp stay 1 (the trainer refuses more) unless "
                                    "--plan-only.")
    add_config_source(p)
    _common(p)
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs of the job")
    p.add_argument("--gpu-memory", type=float, metavar="GiB", help="memory per GPU instead of the profile's")
    p.add_argument("--global-batch", type=int, metavar="B", help="sequences per step (default: the config's)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="candidates to print (default 5)")
    p.add_argument("--out", metavar="FILE.yaml", help="where the winner goes (default runs/tune/MODEL-NxHW.yaml)")
    p.add_argument("--optim", default="fp32,bf16-moments,bf16-grads-moments", metavar="NAMES",
                   help="optimizer precisions to try: fp32, bf16-moments, bf16-grads-moments (fp32 master weights "
                        "kept), bf16-all (none); comma-separated")
    p.add_argument("--max-mbs", type=int, default=8, metavar="N", help="largest micro-batch tried (default 8)")
    p.add_argument("--max-vpp", type=int, default=8, metavar="N", help="most virtual stages per rank (default 8)")
    p.add_argument("--plan-only", action="store_true",
                   help="also parallel.cp and parallel.etp > 1: a projection only, moetrain train refuses them today")
    p.add_argument("--dp-overlap", type=float, default=0.5, metavar="F",
                   help="fraction of data-parallel communication hidden behind compute (default 0.5, as plan perf)")
    p.add_argument("--validate", action="store_true",
                   help="then run the top candidates that fit this machine with the real trainer (one GPU: reduced "
                        "depth proxies) and compare projected with measured step time, memory and ranking")
    p.add_argument("--validate-top", type=int, default=3, metavar="K", help="candidates --validate runs (default 3)")
    p.add_argument("--steps", type=int, default=12, metavar="N", help="steps per --validate run (default 12)")
    p.add_argument("--validate-out", metavar="DIR", default="runs/plan-tune-validate",
                   help="per-candidate results of --validate")
    p.set_defaults(func=cmd_tune)

    from moetrain.plan.validate_configs import ALL_CONFIGS, CALIBRATION_CONFIGS, CONFIG_NAMES

    p = plan.add_parser("validate", help="run the real trainer on the local GPU and compare with the projection")
    p.add_argument("--configs", nargs="+", metavar="NAME", choices=list(ALL_CONFIGS), default=None,
                   help=f"subset of the built-in validation configs ({', '.join(CONFIG_NAMES)}; default: all), or "
                        f"calibration configs ({', '.join(CALIBRATION_CONFIGS)})")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", metavar="DIR", default="runs/plan-validate", help="per-config JSON files go here")
    p.add_argument("--steps", type=int, default=20,
                   help="training steps per config (default 20: the median of the 18 after warm-up; "
                        "a host-bound config's steps varied by up to 40%%)")
    p.add_argument("--hardware", metavar="NAME|FILE", default="h200-sxm", help="profile used for the projection")
    p.add_argument("--no-measure", action="store_true", help="skip the --measure mode time projection")
    p.set_defaults(func=cmd_validate)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m moetrain.plan memory --preset tiny``."""
    from moetrain import cli

    parser = argparse.ArgumentParser(prog="moetrain plan-standalone")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(commands, cli._add_config_source)
    args = cli._parse(parser, ["plan", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except UserError as err:
        print(f"error: {cli._one_line(str(err))}", file=sys.stderr)
        return cli.EXIT_USER_ERROR
    except (FileNotFoundError, IsADirectoryError) as err:
        if err.filename is None:
            raise
        print(f"error: {err.strerror}: {err.filename}", file=sys.stderr)
        return cli.EXIT_USER_ERROR
