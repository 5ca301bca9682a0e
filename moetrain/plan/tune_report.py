"""What `moetrain plan tune` prints and writes: the official projection of each candidate, a table, why the winner
wins, JSON, and the winner as a ready YAML.

Each candidate the search found is loaded again the way ``moetrain train`` loads a config (``load_config`` on the
user's file or preset, their overrides, then the candidate's: ``Config.check`` runs) and projected with
``project_memory`` and ``project_perf``, whose numbers are the ones reported. The JSON contract (add, never rename):
``{"candidates": [...], "search": {...}, "hardware": ..., "gpus": ..., "winner_yaml": ...}``, best first; each
candidate has ``overrides`` (dotted key -> value, as ``moetrain train`` and ``plan memory|perf`` take them; ``args``
the same as key=value strings), ``step_time_s``, ``peak_mem_gib`` (the worst rank's allocated peak) and the rest.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

from moetrain.plan.memory import GiB, MemoryReport
from moetrain.plan.tune import Found, TuneResult


@dataclass
class Candidate:
    found: Found
    cfg: object
    memory: MemoryReport
    perf: object  # PerfReport

    @property
    def critical(self) -> dict:
        """The pipeline rank with the most compute (its work sets the pace)."""
        return max(self.perf.per_rank, key=lambda r: r["compute_s"])

    @property
    def comm_share(self) -> float:
        r = self.critical
        return (r["comm_in_pipeline_s"] + r["dp_comm_exposed_s"]) / self.perf.step_time_s

    def to_dict(self, rank: int) -> dict:
        f, mem, perf = self.found, self.memory, self.perf
        return {
            "rank": rank, "overrides": f.overrides, "args": override_args(f.overrides),
            "step_time_s": perf.step_time_s, "peak_mem_gib": mem.peak_gib, "peak_reserved_gib": mem.reserved_gib,
            "verdict": mem.verdict, "per_rank_peak_gib": [round(r.total / GiB, 3) for r in mem.ranks],
            "bubble_fraction": perf.bubble_fraction, "critical_rank_bubble_fraction": self.critical["bubble_fraction"],
            "comm_share": self.comm_share,
            "tokens_per_s_per_gpu": perf.tokens_per_s_per_gpu, "tflops_per_gpu": perf.tflops_per_gpu,
            "mfu": perf.mfu, "host_bound_fraction": perf.host_bound_fraction, "shape": f.shape.describe(),
            "schedule": f.schedule if f.shape.pp > 1 else None, "layout": f.layout,
            "recompute": {"mode": f.recompute.base, "layer_ids": f.recompute.ids,
                          "blocks_per_rank": f.recompute.per_rank},
            "breakdown_s": {"compute": f.busy_s, "of_which_recompute": f.recompute_s, "bubble": f.makespan_s - f.busy_s,
                            "tail": f.tail_s, "comm_in_compute": f.comm_s}}


def _value_text(value) -> str:
    from moetrain.config.load import parse_yaml_value

    if value is None or isinstance(value, (bool, list)):
        return json.dumps(value)
    text = str(value)
    return text if parse_yaml_value(text) == value else json.dumps(value)


def override_args(overrides: dict) -> list[str]:
    """``key=value`` strings that ``load_config`` (and so every command) reads back as ``overrides``."""
    return [f"{k}={_value_text(v)}" for k, v in overrides.items()]


def official(result: TuneResult, loader, hw, attention: str, moe_imbalance: float, dp_overlap: float
             ) -> list[Candidate]:
    """Each found candidate loaded with ``loader(override_args)`` and projected; best first by that projection."""
    from moetrain.plan.memory import project_memory
    from moetrain.plan.perf import project_perf

    out = []
    for f in result.found:
        cfg = loader(override_args(f.overrides))
        mem = project_memory(cfg, hw, attention=attention, moe_imbalance=moe_imbalance)
        perf = project_perf(cfg, hw, attention=attention, moe_imbalance=moe_imbalance, dp_overlap=dp_overlap)
        out.append(Candidate(f, cfg, mem, perf))
    return sorted(out, key=lambda c: c.perf.step_time_s)


def _rel(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.1f}%" if b else "-"


def why(cands: list[Candidate], result: TuneResult) -> list[str]:
    """Sentences: what the winner's step is made of, how it beats the runner-up, what the search ruled out."""
    if not cands:
        return []
    w = cands[0]
    f = w.found
    lines = [f"winner {f.shape.describe()}, {f.schedule if f.shape.pp > 1 else 'no pipeline'}"
             f"{f' vpp {f.vpp}' if f.vpp > 1 else ''}: {w.perf.step_time_s:.3f} s = compute {f.busy_s:.3f} s "
             f"(recompute {f.recompute_s:.3f}, tp/ep communication {f.comm_s:.3f}) + bubble "
             f"{f.makespan_s - f.busy_s:.3f} + tail {f.tail_s:.3f} (data-parallel communication left exposed, "
             f"optimizer); peak {w.memory.peak_gib:.1f} GiB allocated on the worst rank, "
             f"{w.memory.reserved_gib:.1f} with fragmentation and first-step tuning, limit {result.limit_gib:.1f}"]
    for other in cands[1:3]:
        o = other.found
        parts = [("compute", f.busy_s - f.recompute_s, o.busy_s - o.recompute_s),
                 ("recompute", f.recompute_s, o.recompute_s),
                 ("bubble", f.makespan_s - f.busy_s, o.makespan_s - o.busy_s), ("tail", f.tail_s, o.tail_s)]
        parts.sort(key=lambda p: p[1] - p[2])
        gains = ", ".join(f"{name} {a:.3f} vs {b:.3f} s" for name, a, b in parts
                          if abs(a - b) > 1e-4 * w.perf.step_time_s)
        lines.append(f"against {o.shape.describe()} {o.schedule if o.shape.pp > 1 else ''}"
                     f"{f' vpp {o.vpp}' if o.vpp > 1 else ''} ({other.perf.step_time_s:.3f} s, "
                     f"{_rel(other.perf.step_time_s, w.perf.step_time_s)}): {gains or 'equal parts'}")
    s = result.stats
    if s.stop_bound_s is not None:
        lines.append(f"everything not evaluated is bounded below by {s.stop_bound_s:.3f} s (the model's work over "
                     f"pp, the busiest rank's work, plus the tail): no better candidate was pruned")
    return lines


def table(cands: list[Candidate], result: TuneResult, hw, title: str) -> str:
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    con = Console(file=buf, width=160, force_terminal=False, color_system=None)
    tab = Table(title=title, title_justify="left")
    for col in ("#", "step s", "tok/s/GPU", "peak GiB", "bubble", "comm", "shape", "pipeline", "recompute/rank"):
        tab.add_column(col, justify="left" if col in ("shape", "pipeline", "recompute/rank") else "right")
    for i, c in enumerate(cands, 1):
        f = c.found
        pipe = f"{f.schedule} vpp{f.vpp}" if f.shape.pp > 1 else "-"
        counts = "".join(str(n) if n < 10 else "+" for n in f.recompute.per_rank)
        rec = f.recompute.base if not f.recompute.ids else f"{f.recompute.base}, ids {counts}"
        tab.add_row(str(i), f"{c.perf.step_time_s:.3f}", f"{c.perf.tokens_per_s_per_gpu:,.0f}",
                    f"{c.memory.peak_gib:.1f}", f"{c.critical['bubble_fraction']:.1%}", f"{c.comm_share:.1%}",
                    f.shape.describe(), pipe, rec if len(rec) <= 44 else rec[:43] + "~")
    con.print(tab)
    con.print("peak GiB: the worst pipeline rank's allocated peak; bubble and comm: the busiest rank's idle share and "
              "its tp/ep + exposed data-parallel communication share of the step; recompute/rank: blocks recomputed "
              "in full on each pipeline rank")
    for line in why(cands, result):
        con.print(line)
    if cands and cands[0].found.layout:
        con.print(f"winner layout: {cands[0].found.layout}")
    for note in result.notes:
        con.print(f"note: {note}")
    return buf.getvalue().rstrip()


def result_json(cands: list[Candidate], result: TuneResult, hw, gpus: int, winner_yaml: str | None,
                validation: dict | None = None) -> str:
    from moetrain.plan.provenance import inputs

    out = {"candidates": [c.to_dict(i) for i, c in enumerate(cands, 1)], "why": why(cands, result),
           "search": result.stats.to_dict(), "limit_gib": result.limit_gib, "hardware": hw.name, "gpus": gpus,
           "inputs": inputs(hw), "notes": result.notes, "winner_yaml": winner_yaml}
    if validation is not None:
        out["validation"] = validation
    return json.dumps(out, indent=1)


def write_winner(c: Candidate, path: str, command: str) -> str:
    """The winner's whole config as YAML (``moetrain train --config PATH`` runs it) with its projection on top."""
    from moetrain.config.load import dump_config

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = (f"# {command}\n# winner: {c.perf.step_time_s:.3f} s/step, {c.perf.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
            f"peak {c.memory.peak_gib:.1f} GiB allocated on the worst pipeline rank ({c.memory.verdict})\n")
    if c.cfg.parallel.cp > 1 or c.cfg.parallel.etp > 1:
        head += "# plan only: moetrain train refuses parallel.cp > 1 and parallel.etp > 1 today\n"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(head + dump_config(c.cfg) + "\n")
    tmp.replace(out)
    return str(out)
