"""`moetrain plan tune --validate`: run the top candidates that fit this machine, projected against measured.

For each of the top candidates, in the tuner's order:
* with at least as many local GPUs as the candidate's degrees multiply to, the candidate itself runs under torchrun
  (``moetrain train --config``, a few steps, no checkpoint);
* otherwise a reduced-depth proxy runs on one GPU: the candidate's per-GPU work (its micro-batch, optimizer
  precision, recompute mode and share, its local experts: moe.num_experts = experts / ep with the same top-k, so each
  GPU computes the same routed rows on the same expert weights; at least top-k experts, where ep leaves fewer than
  that per GPU, to keep the rows) with every parallel degree 1 and the deepest depth
  (<= 8 layers) the planner says fits this GPU. Tensor parallelism, pipelines, communication and the MTP depths (one
  pipeline rank's work at scale, a whole MoE block of state on one GPU) are not in a proxy.

A proxy that repeats an earlier run's config (candidates differing only in their pipeline or data parallelism) is
skipped: the runs rank distinct configs, so ask for more candidates (--top) than runs (--validate-top).
Every run is projected on this GPU's hardware profile (the built-in one its name maps to, else the tuner's) and
measured in a fresh process: step time = the median of the steps after the first two (metrics.jsonl), peak memory
= the largest ``peak_mem_gib`` (rank 0's) or, for pipelines, the largest per-rank peak of pp_timeline. Printed: per
run projected vs measured, and the rankings: the tuner's (full scale), the runs' projected, the runs' measured, with
Spearman's rank correlation between the last two. ``runner`` is injectable (tests run a fake on the CPU).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from moetrain.errors import UserError

PROXY_MAX_LAYERS = 8
RUN_TIMEOUT_S = 900
GPU_PROFILES = (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-80gb-sxm"), ("B200", "b200"),
                ("MI300X", "mi300x"), ("MI355X", "mi355x"))


@dataclass
class Run:
    """One measured run: the candidate's own config or its proxy."""

    name: str
    candidate: int  # the tuner's rank, 1-based
    kind: str  # "real" or "proxy"
    cfg: object
    nproc: int
    config_path: str = ""
    out_dir: str = ""
    steps: int = 12
    projected_s: float = 0.0
    projected_gib: float = 0.0
    measured: dict = field(default_factory=dict)

    def command(self) -> list[str]:
        over = [f"train.steps={self.steps}", f"train.out_dir={self.out_dir}", "checkpoint.save_final=false",
                "train.eval_interval=0", "optim.warmup_steps=1", f"train.log_interval={self.steps}",
                "train.overwrite=true"]
        if self.cfg.parallel.pp > 1:
            over += ["profile.dump_pp_data=true", f"profile.start_step={self.steps - 1}",
                     f"profile.end_step={self.steps}"]
        head = [sys.executable, "-m", "moetrain"] if self.nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}", "-m",
             "moetrain"]
        return head + ["train", "--config", self.config_path] + over


def local_gpus() -> tuple[int, str, float]:
    """(count, name, GiB of one) of this machine's CUDA GPUs; UserError without one."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("plan tune --validate runs the real trainer on CUDA GPUs and none is available here; "
                        "drop --validate for the projection alone")
    props = torch.cuda.get_device_properties(0)
    return torch.cuda.device_count(), props.name, props.total_memory / 2**30


def local_profile(device_name: str, fallback):
    from moetrain.plan.hardware import load_hardware

    for key, profile in GPU_PROFILES:
        if key in device_name.upper():
            return load_hardware(profile)
    return fallback


def proxy_overrides(cfg, layers: int) -> dict:
    """A one-GPU, ``layers``-deep stand-in for ``cfg``'s per-GPU work (see the module doc)."""
    m, e, p, t = cfg.model, cfg.moe, cfg.parallel, cfg.train
    over = {"parallel.dp": 1, "parallel.dp_replicate": 1, "parallel.tp": 1, "parallel.sequence_parallel": False,
            "parallel.pp": 1, "parallel.vpp": 1, "parallel.pp_schedule": "1f1b", "parallel.pipeline_layout": None,
            "parallel.cp": 1, "parallel.ep": 1, "parallel.etp": 1, "model.num_layers": layers,
            "model.mtp_num_layers": 0, "train.global_batch_size": 2 * t.micro_batch_size}
    if e.num_experts:  # the local experts; at least top-k of them, so that the routed rows stay T x top-k
        local = max(e.num_experts // p.ep, e.topk)
        over.update({"moe.num_experts": local, "moe.num_groups": None, "moe.topk_groups": None,
                     "moe.first_k_dense": min(e.first_k_dense, layers - 1)})
    share = len(t.recompute_layer_ids or ()) / (m.num_layers + m.mtp_num_layers)
    keep = round(share * layers)
    over["train.recompute_layer_ids"] = list(range(keep)) if keep else None
    return over


def plan_runs(cands, hw_local, gpus: int, gpu_gib: float, top: int, steps: int, out_dir: str) -> list[Run]:
    """Up to ``top`` runs for the candidates (``tune_report.Candidate``) in order, each projected on ``hw_local``.
    A candidate whose run would repeat an earlier one's config (proxies of candidates that differ only in what a
    proxy leaves out: the pipeline, data parallelism) is skipped, so the runs rank distinct configs."""
    import dataclasses

    from moetrain.config.load import dump_config
    from moetrain.plan.memory import project_memory
    from moetrain.plan.perf import project_perf
    from moetrain.plan.tune_space import derive

    hw_here = dataclasses.replace(hw_local, hbm_gib=gpu_gib)
    runs, seen = [], set()
    for i, c in enumerate(cands, 1):
        if len(runs) == top:
            break
        cfg, kind = c.cfg, "real"
        if cfg.parallel.world_size > gpus:
            kind, cfg = "proxy", None
            for layers in range(min(c.cfg.model.num_layers, PROXY_MAX_LAYERS), 0, -1):
                trial = derive(c.cfg, proxy_overrides(c.cfg, layers))
                if project_memory(trial, hw_here).verdict == "fits":
                    cfg = trial
                    break
            if cfg is None:
                continue  # not even one layer of its per-GPU work fits here
        text = dump_config(cfg)
        if text in seen:
            continue
        seen.add(text)
        run = Run(f"candidate-{i}-{kind}", i, kind, cfg, cfg.parallel.world_size, steps=steps)
        folder = Path(out_dir) / run.name
        folder.mkdir(parents=True, exist_ok=True)
        run.config_path, run.out_dir = str(folder / "config.yaml"), str(folder / "run")
        Path(run.config_path).write_text(text + "\n")
        run.projected_s = project_perf(cfg, hw_here, dp_overlap=0.0).step_time_s
        run.projected_gib = project_memory(cfg, hw_here).peak_gib
        runs.append(run)
    return runs


def subprocess_runner(run: Run) -> dict:
    """Run one config in a fresh process (torchrun for several GPUs); its median step and peak memory."""
    try:
        proc = subprocess.run(run.command(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {RUN_TIMEOUT_S} s"}
    metrics = Path(run.out_dir) / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    return read_measurement(run.out_dir)


def read_measurement(out_dir: str) -> dict:
    """Median step time after the first two steps and the peak memory (the pipeline ranks' largest, where
    recorded) of a run directory."""
    recs = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in recs]
    peak = max(r["peak_mem_gib"] for r in recs)
    if (Path(out_dir) / "pp_timeline").is_dir():
        from moetrain.plan.timeline import read_run

        ranks = [x for x in read_run(out_dir).peak_mem_gib if x is not None]
        peak = max([peak] + ranks)
    return {"step_time_s": statistics.median(times[2:] if len(times) > 2 else times), "peak_mem_gib": peak,
            "step_times_s": times}


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation of two equally long lists (no ties expected); None for fewer than 2."""
    n = len(a)
    if n < 2:
        return None
    rank = lambda xs: {i: r for r, i in enumerate(sorted(range(n), key=lambda i: xs[i]))}  # noqa: E731
    ra, rb = rank(a), rank(b)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def summarize(runs: list[Run]) -> dict:
    ok = [r for r in runs if "error" not in r.measured]
    rows = []
    for r in runs:
        m = r.measured
        row = {"run": r.name, "candidate": r.candidate, "kind": r.kind, "gpus": r.nproc,
               "layers": r.cfg.model.num_layers, "projected_step_s": r.projected_s,
               "projected_peak_gib": r.projected_gib,
               "measured_step_s": m.get("step_time_s"), "measured_peak_gib": m.get("peak_mem_gib"),
               "error": m.get("error")}
        if "error" not in m:
            row["step_error_pct"] = 100 * (r.projected_s / m["step_time_s"] - 1)
            row["peak_error_pct"] = 100 * (r.projected_gib / m["peak_mem_gib"] - 1)
        rows.append(row)
    proj = [r.projected_s for r in ok]
    meas = [r.measured["step_time_s"] for r in ok]
    order = lambda xs: [ok[i].candidate for i in sorted(range(len(xs)), key=lambda i: xs[i])]  # noqa: E731
    return {"runs": rows, "tuner_order": [r.candidate for r in runs], "projected_order": order(proj),
            "measured_order": order(meas), "spearman": spearman(proj, meas),
            "same_winner": bool(ok) and order(proj)[0] == order(meas)[0]}


def text(summary: dict) -> str:
    f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    lines = [f"{'run':22s} {'gpus':>4s} {'layers':>6s} {'t proj s':>9s} {'t meas s':>9s} {'err':>7s} "
             f"{'mem proj':>9s} {'mem meas':>9s} {'err':>7s}"]
    for r in summary["runs"]:
        if r["error"]:
            lines.append(f"{r['run']:22s} error: {r['error']}")
            continue
        lines.append(f"{r['run']:22s} {r['gpus']:4d} {r['layers']:6d} {f(r['projected_step_s'], '9.4f')} "
                     f"{f(r['measured_step_s'], '9.4f')} {f(r['step_error_pct'], '+6.1f')}% "
                     f"{f(r['projected_peak_gib'], '9.2f')} {f(r['measured_peak_gib'], '9.2f')} "
                     f"{f(r['peak_error_pct'], '+6.1f')}%")
    lines.append(f"ranking: tuner (full scale) {summary['tuner_order']}, runs projected {summary['projected_order']}, "
                 f"runs measured {summary['measured_order']}; Spearman {f(summary['spearman'], '.2f')}; same winner: "
                 f"{summary['same_winner']}")
    return "\n".join(lines)


def run_validation(cands, hw, *, top: int = 3, steps: int = 12, out_dir: str = "runs/plan-tune-validate",
                   runner: Callable[[Run], dict] | None = None, machine: tuple[int, str, float] | None = None) -> dict:
    """Plan, run and compare (see the module doc); the summary (``text`` prints it), also written to
    out_dir/summary.json. ``machine`` = (GPUs, device name, GiB) instead of this machine's CUDA devices; ``runner``
    instead of the subprocesses."""
    if steps < 3:
        raise UserError(f"--steps = {steps}: need at least 3 (the first two are warm-up for the timing)")
    gpus, name, gib = machine or local_gpus()
    hw_local = local_profile(name, hw)
    runs = plan_runs(cands, hw_local, gpus, gib, top, steps, out_dir)
    if not runs:
        raise UserError(f"none of the top {top} candidates fits {gpus} x {name} ({gib:.0f} GiB), not even as a "
                        "one-layer proxy")
    runner = runner or subprocess_runner
    for i, run in enumerate(runs, 1):
        run.measured = runner(run)
        status = run.measured.get("error") or (f"{run.projected_s:.4f} / {run.measured['step_time_s']:.4f} s, "
                                               f"{run.projected_gib:.2f} / {run.measured['peak_mem_gib']:.2f} GiB")
        print(f"validate [{i}/{len(runs)}] {run.name} ({run.kind}, {run.nproc} GPU): projected / measured {status}",
              file=sys.stderr, flush=True)
    summary = summarize(runs)
    summary.update(device=name, gpus=gpus, hardware=hw_local.name)
    (Path(out_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
