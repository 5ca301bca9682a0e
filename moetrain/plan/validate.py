"""`moetrain plan validate`: projected vs measured peak memory and step time on the local GPU.

For every built-in config (validate_configs.py) the parent process projects memory and step
time (roofline, and --measure mode: blocks timed on this GPU), then runs the real trainer
(``moetrain.train.trainer.run``, a few steps, no checkpoint) in a fresh subprocess -- one per
config, so that each starts with an empty allocator and nothing leaks between configs -- and
compares: peak memory = the largest ``peak_mem_gib`` (torch.cuda.max_memory_allocated, reset
each step) over the steps; step time = the median ``step_time_s`` over the steps after the
first two. Prints a progress line per config, a table at the end, writes ``<out>/<config>.json``
and ``<out>/summary.json``.

    python -m moetrain.plan.validate --worker NAME --out FILE [--steps N] [--measure]
is the subprocess side.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from moetrain.errors import UserError
from moetrain.plan.validate_configs import ALL_CONFIGS, CONFIG_NAMES

WORKER_TIMEOUT_S = 180


def validation_config(name: str, steps: int, out_dir: str):
    """The config ``name`` as validate runs it."""
    from moetrain.config.load import load_config

    preset, overrides = ALL_CONFIGS[name]
    return load_config(preset=preset, overrides=overrides + [
        f"train.steps={steps}", "checkpoint.save_final=false", "train.device=cuda", f"train.out_dir={out_dir}",
        "optim.warmup_steps=1", f"train.log_interval={steps}", "train.eval_interval=0"])


def subprocess_runner(name: str, steps: int, measure: bool) -> dict:
    """Run one config in a fresh Python process; returns its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "moetrain.plan.validate", "--worker", name, "--out", str(out),
               "--steps", str(steps)] + (["--measure"] if measure else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {WORKER_TIMEOUT_S} s"}
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"worker exit {proc.returncode}: {' | '.join(tail)}"}
        return json.loads(out.read_text())


def worker(name: str, out: str, steps: int, measure: bool) -> None:
    from moetrain.train.trainer import run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = validation_config(name, steps, tmp)
        started = time.perf_counter()
        res = run(cfg, show_progress=False)
        wall = time.perf_counter() - started
    recs = res.records
    times = [r["step_time_s"] for r in recs]
    result = {"config": name, "peak_mem_gib": max(r["peak_mem_gib"] for r in recs),
              "peak_mem_gib_per_step": [r["peak_mem_gib"] for r in recs],
              "step_time_s": statistics.median(times[2:] if len(times) > 2 else times), "step_times_s": times,
              "train_wall_s": wall}
    if measure:
        import gc

        import torch

        from moetrain.plan.measure import measure_blocks

        del res
        gc.collect()
        torch.cuda.empty_cache()
        result["measured_blocks"] = {k: list(v) for k, v in measure_blocks(cfg).items()}
        result["measured_hooks"] = True  # the blocks' backward ran the main-grad hooks (older results: not)
    result["device"] = __import__("torch").cuda.get_device_name()
    Path(out).write_text(json.dumps(result, indent=1))


def _err(proj: float | None, meas: float | None) -> float | None:
    if proj is None or not meas:
        return None
    return 100.0 * (proj / meas - 1.0)


def compare(name: str, measured: dict, hardware) -> dict:
    """Projections for config ``name`` next to a worker's measurements (the table row)."""
    from moetrain.plan.memory import project_memory
    from moetrain.plan.perf import project_perf

    cfg = validation_config(name, 1, "unused")
    mem = project_memory(cfg, hardware)
    roof = project_perf(cfg, hardware, dp_overlap=0.0)
    row = {"config": name, "proj_mem_gib": mem.peak_gib, "proj_time_roofline_s": roof.step_time_s,
           "proj_time_measured_s": None, "meas_mem_gib": measured.get("peak_mem_gib"),
           "meas_time_s": measured.get("step_time_s"), "error": measured.get("error"),
           "peak_phase": mem.peak.phase, "host_bound_pct": 100 * roof.host_bound_fraction}
    blocks = measured.get("measured_blocks")
    if blocks:
        row["proj_time_measured_s"] = project_perf(
            cfg, hardware, dp_overlap=0.0, measured={k: tuple(v) for k, v in blocks.items()},
            measured_hooks=bool(measured.get("measured_hooks"))).step_time_s
    row["mem_err_pct"] = _err(row["proj_mem_gib"], row["meas_mem_gib"])
    row["time_err_roofline_pct"] = _err(row["proj_time_roofline_s"], row["meas_time_s"])
    row["time_err_measured_pct"] = _err(row["proj_time_measured_s"], row["meas_time_s"])
    return row


def table(rows: list[dict]) -> str:
    f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    head = (f"{'config':26s} {'mem proj':>9s} {'mem meas':>9s} {'err':>7s} | {'t roofline':>10s} {'t measured':>10s} "
            f"{'t meas':>8s} {'err roof':>8s} {'err meas':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['config']:26s} error: {r['error']}")
            continue
        lines.append(
            f"{r['config']:26s} {f(r['proj_mem_gib'], '9.2f')} {f(r['meas_mem_gib'], '9.2f')} "
            f"{f(r['mem_err_pct'], '+6.1f')}% | {f(r['proj_time_roofline_s'], '10.4f')} "
            f"{f(r['proj_time_measured_s'], '10.4f')} {f(r['meas_time_s'], '8.4f')} "
            f"{f(r['time_err_roofline_pct'], '+7.1f')}% {f(r['time_err_measured_pct'], '+7.1f')}%")
    from moetrain.plan.report import HOST_BOUND_WARN

    ok = [r for r in rows if not r.get("error")]
    host = [r for r in ok if (r.get("host_bound_pct") or 0) >= 100 * HOST_BOUND_WARN]
    for label, group in (("", ok), (" without the host-bound", [r for r in ok if r not in host])):
        if not group or (label and not host):
            continue
        worst = lambda k: max((abs(r[k]) for r in group if r[k] is not None), default=None)  # noqa: E731
        lines.append(f"worst |error|{label}: memory {f(worst('mem_err_pct'), '.1f')}%, time roofline "
                     f"{f(worst('time_err_roofline_pct'), '.1f')}%, time measured {f(worst('time_err_measured_pct'), '.1f')}%")
    if host:
        lines.append("host-bound (projected step waiting on kernel launches; its time follows the host CPU, not the "
                     "GPU; train.cuda_graph replays the step instead): "
                     + ", ".join(f"{r['config']} {r['host_bound_pct']:.0f}%" for r in host))
    return "\n".join(lines)


def run_validation(names: list[str] | None = None, *, json_out: bool = False, out_dir: str = "runs/plan-validate",
                   steps: int = 20, hardware: str = "h200-sxm", measure: bool = True,
                   runner: Callable[[str, int, bool], dict] | None = None, require_gpu: bool = True) -> list[dict]:
    from moetrain.plan.hardware import load_hardware

    if require_gpu:
        import torch

        if not torch.cuda.is_available():
            raise UserError("plan validate runs the real trainer on a CUDA GPU and none is available here; "
                            "use `moetrain plan memory|perf` for CPU-only projections")
    if steps < 3:
        raise UserError(f"--steps = {steps}: need at least 3 (the first two steps are warm-up for the timing)")
    hw = load_hardware(hardware)
    runner = runner or subprocess_runner
    names = names or CONFIG_NAMES
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(names, 1):
        started = time.perf_counter()
        measured = runner(name, steps, measure)
        row = compare(name, measured, hw)
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        (out / f"{name}.json").write_text(json.dumps({"row": row, "measured": measured}, indent=1))
        status = row["error"] or (f"mem {row['proj_mem_gib']:.2f}/{row['meas_mem_gib']:.2f} GiB "
                                  f"({row['mem_err_pct']:+.1f}%), time {row['proj_time_roofline_s']:.4f}/"
                                  f"{row['meas_time_s']:.4f} s ({row['time_err_roofline_pct']:+.1f}%)")
        print(f"[{i}/{len(names)}] {name}: {status} [{row['seconds']:.0f} s]", file=sys.stderr, flush=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows, indent=1) if json_out else table(rows))
    return rows


def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="plan validate worker (one config)")
    ap.add_argument("--worker", required=True, choices=list(ALL_CONFIGS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--measure", action="store_true")
    args = ap.parse_args(argv)
    worker(args.worker, args.out, args.steps, args.measure)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
