"""One pipeline timeline format for the simulated schedule and a measured run.

A ``Timeline`` holds, per pipeline rank, the ops of one step: kind F (forward), B (input-gradient backward where a
W of the same stage and micro-batch follows, else the whole backward) or W (weight-gradient backward), with
micro-batch, global stage, chunk (the stage's position on its rank) and start / end in seconds since the step's
start. JSON (``to_dict``; a stable interface: fields are added, never renamed)::

    {"source": "simulated" | "measured", "label", "step", "schedule", "pp", "vpp", "micro_batches", "step_time_s",
     "ranks": [{"rank", "busy_s", "bubble_fraction", "peak_mem_gib" (null when unknown),
                "ops": [{"kind", "micro_batch", "chunk", "stage", "start", "end"}]}]}

A measured run (``profile.dump_pp_data``) writes one file per pipeline rank, ``out_dir/pp_timeline/rank<r>.json``:
``{"rank", "schedule", "pp", "vpp", "micro_batches", "steps": [{"step", "ops", "peak_mem_gib"}]}``, op times in
seconds since that rank's step start (right after a barrier over the pipeline group, so the ranks' zeros agree to
within the barrier's skew). ``RankTimelineWriter`` writes it (the trainer), ``read_run`` merges the ranks of one
step into a Timeline. Pure Python.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from moetrain.errors import UserError

KINDS = ("F", "B", "W")
META = ("schedule", "pp", "vpp", "micro_batches")  # what every rank file of one run must agree on
OP_KEYS = ("kind", "micro_batch", "stage", "chunk", "start", "end")


@dataclass
class Op:
    kind: str  # F, B, W (see the module doc)
    mb: int
    chunk: int
    stage: int
    start: float = 0.0
    end: float = 0.0

    def to_dict(self) -> dict:
        return {"kind": self.kind, "micro_batch": self.mb, "chunk": self.chunk, "stage": self.stage,
                "start": self.start, "end": self.end}

    @staticmethod
    def from_dict(d: dict) -> "Op":
        return Op(str(d["kind"]), int(d["micro_batch"]), int(d["chunk"]), int(d["stage"]), float(d["start"]),
                  float(d["end"]))


@dataclass
class Timeline:
    schedule: str
    pp: int
    vpp: int
    micro_batches: int
    ranks: list[list[Op]]
    step_time: float = 0.0
    source: str = "simulated"  # or "measured"
    peak_mem_gib: list[float | None] = field(default_factory=list)  # per rank; empty or None: unknown
    label: str = ""  # what it was made from: a config file, preset:NAME, a run directory
    step: int | None = None  # the training step a measured timeline recorded

    def busy(self, rank: int) -> float:
        return sum(op.end - op.start for op in self.ranks[rank])

    def bubble_fraction(self, rank: int) -> float:
        return 0.0 if self.step_time <= 0 else 1.0 - self.busy(rank) / self.step_time

    def peak_mem(self, rank: int) -> float | None:
        return self.peak_mem_gib[rank] if rank < len(self.peak_mem_gib) else None

    def gaps(self, rank: int) -> list[tuple[float, float]]:
        """The rank's idle intervals inside [0, step_time] (its bubbles); shorter than 1e-9 of the step: none
        (rounding between back-to-back ops)."""
        eps = 1e-9 * self.step_time
        out, t = [], 0.0
        for op in sorted(self.ranks[rank], key=lambda o: o.start):
            if op.start > t + eps:
                out.append((t, op.start))
            t = max(t, op.end)
        if self.step_time > t + eps:
            out.append((t, self.step_time))
        return out

    def orders(self) -> list[list[tuple[str, int, int]]]:
        """Per rank, (kind, micro_batch, stage) of its ops in start order."""
        return [[(op.kind, op.mb, op.stage) for op in sorted(ops, key=lambda o: o.start)] for ops in self.ranks]

    def to_dict(self) -> dict:
        return {
            "source": self.source, "label": self.label, "step": self.step,
            "schedule": self.schedule, "pp": self.pp, "vpp": self.vpp, "micro_batches": self.micro_batches,
            "step_time_s": self.step_time,
            "ranks": [{"rank": r, "busy_s": self.busy(r), "bubble_fraction": self.bubble_fraction(r),
                       "peak_mem_gib": self.peak_mem(r), "ops": [op.to_dict() for op in ops]}
                      for r, ops in enumerate(self.ranks)],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


# ---- a measured run: one file per pipeline rank --------------------------------------------------------------------

def rank_file(out_dir, rank: int) -> Path:
    return Path(out_dir) / "pp_timeline" / f"rank{rank}.json"


class RankTimelineWriter:
    """Writes ``out_dir/pp_timeline/rank<rank>.json`` for one pipeline rank.

    ``meta``: {"schedule", "pp", "vpp", "micro_batches"} of the run. ``add_step(step, ops, peak_mem_gib)`` after
    each recorded step: ``ops`` are dicts with the keys of ``OP_KEYS`` (seconds since this rank's step start),
    ``peak_mem_gib`` this rank's peak memory in the step (None when unknown). Every call rewrites the file
    atomically (temporary file, then rename), so a crash keeps every step recorded before it. A file left by an
    earlier run of the same pipeline (same meta: a resumed run) keeps its steps; a step recorded again replaces
    its older record."""

    def __init__(self, out_dir, rank: int, meta: dict):
        self.path = rank_file(out_dir, rank)
        self.head = {"rank": int(rank), **{k: meta[k] for k in META}}
        self.steps: list[dict] = self._earlier_steps()

    def _earlier_steps(self) -> list[dict]:
        try:
            old = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        same = isinstance(old, dict) and all(old.get(k) == v for k, v in self.head.items())
        return list(old.get("steps", [])) if same else []

    def add_step(self, step: int, ops: list[dict], peak_mem_gib: float | None = None) -> None:
        missing = [k for op in ops for k in OP_KEYS if k not in op]
        if missing:
            raise ValueError(f"pipeline timeline ops need the keys {OP_KEYS}; missing {sorted(set(missing))}")
        record = {"step": int(step), "ops": [dict(op) for op in ops],
                  "peak_mem_gib": None if peak_mem_gib is None else float(peak_mem_gib)}
        self.steps = [s for s in self.steps if s.get("step") != record["step"]] + [record]
        self._write()

    def close(self) -> None:
        """Nothing is pending (every add_step wrote the file); kept so callers may close what they open."""

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        with open(tmp, "w") as fh:
            json.dump({**self.head, "steps": self.steps}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)


def _timeline_dir(run_dir) -> Path:
    d = Path(run_dir)
    return d / "pp_timeline" if (d / "pp_timeline").is_dir() else d


def has_run_timeline(run_dir) -> bool:
    return any(_timeline_dir(run_dir).glob("rank*.json"))


def _read_rank_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        data, why = None, f"not JSON: {err}"
    else:
        missing = [k for k in ("rank", *META, "steps") if not isinstance(data, dict) or k not in data]
        why = f"missing {', '.join(missing)}" if missing else None
    if why:
        raise UserError(f"{path}: not a pipeline timeline file ({why}); a pipeline run writes them with "
                        "profile.dump_pp_data=true")
    return data


def _step_ops(path: Path, record: dict) -> list[Op]:
    try:
        return sorted((Op.from_dict(op) for op in record["ops"]), key=lambda o: o.start)
    except (KeyError, ValueError, TypeError) as err:
        raise UserError(f"{path}: step {record.get('step')} has an op without {err} (an op has {', '.join(OP_KEYS)})") \
            from None


def read_run(run_dir, step: int | None = None) -> Timeline:
    """The measured Timeline of one step of a run (the last step every rank recorded by default), merged from
    ``run_dir/pp_timeline/rank<r>.json`` (or ``run_dir/rank<r>.json``). UserError (one line) when there are no
    such files, they disagree on the schedule or degrees, a rank is missing, or the step was not recorded."""
    folder = _timeline_dir(run_dir)
    files = sorted(folder.glob("rank*.json"))
    if not files:
        raise UserError(f"{run_dir}: no pp_timeline/rank<r>.json files (a pipeline run writes them with "
                        "profile.dump_pp_data=true, for the steps profile.start_step..profile.end_step)")
    data = [_read_rank_file(f) for f in files]
    meta = {k: data[0][k] for k in META}
    for f, d in zip(files, data):
        other = {k: d[k] for k in META}
        if other != meta:
            raise UserError(f"{folder}: the rank files disagree: {files[0].name} has {_describe(meta)}, {f.name} has "
                            f"{_describe(other)}; keep one run's files in a directory")
    by_rank = {int(d["rank"]): d for d in data}
    missing = [r for r in range(int(meta["pp"])) if r not in by_rank]
    if missing:
        raise UserError(f"{folder}: pp = {meta['pp']} needs rank0.json..rank{int(meta['pp']) - 1}.json; missing "
                        f"rank {', '.join(map(str, missing))}")
    if len(by_rank) != len(data):
        raise UserError(f"{folder}: two files claim the same rank; keep one run's files in a directory")
    path_of = {int(d["rank"]): f for f, d in zip(files, data)}
    steps = [{s["step"]: s for s in by_rank[r]["steps"]} for r in range(int(meta["pp"]))]
    common = set(steps[0]).intersection(*steps[1:])
    if step is None:
        if not common:
            raise UserError(f"{folder}: no step was recorded by every rank (recorded: "
                            f"{', '.join(f'rank {r}: {sorted(s)}' for r, s in enumerate(steps))})")
        step = max(common)
    elif step not in common:
        raise UserError(f"{folder}: step {step} was not recorded by every rank; steps recorded by all: "
                        f"{sorted(common) or 'none'}")
    ranks = [_step_ops(path_of[r], s[step]) for r, s in enumerate(steps)]
    end = max((op.end for ops in ranks for op in ops), default=0.0)
    return Timeline(schedule=meta["schedule"], pp=int(meta["pp"]), vpp=int(meta["vpp"]),
                    micro_batches=int(meta["micro_batches"]), ranks=ranks, step_time=end, source="measured",
                    peak_mem_gib=[s[step].get("peak_mem_gib") for s in steps], label=str(run_dir), step=step)


def _describe(meta: dict) -> str:
    return f"{meta['schedule']} pp={meta['pp']} vpp={meta['vpp']} micro-batches={meta['micro_batches']}"
