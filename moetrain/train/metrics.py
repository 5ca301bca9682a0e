"""Per-step metrics: metrics.jsonl (one JSON object per step), optional TensorBoard, and the
rich progress bar and summary table shown on the terminal."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from moetrain.errors import UserError


class MetricsLog:
    """Appends one JSON object per step to <out_dir>/metrics.jsonl.

    A fresh run truncates the file; a resumed run keeps the records up to the resumed step and
    drops later ones (they belong to the interrupted run's unsaved future).
    """

    def __init__(self, out_dir: str | Path, resume_step: int | None, tensorboard: bool = False):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if record.get("step", math.inf) <= resume_step:
                    kept.append(line)
        self._file = open(self.path, "w")
        for line in kept:
            self._file.write(line + "\n")
        self._file.flush()
        self._tb = _open_tensorboard(Path(out_dir) / "tensorboard") if tensorboard else None

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step" and value is not None:
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _open_tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise UserError("train.tensorboard needs the tensorboard package: pip install 'moetrain[tensorboard]'") from err
    return SummaryWriter(str(path))


def fmt(value, spec: str, missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


def fmt_tflops(value) -> str:
    # CPU runs reach milli-TFLOP/s: keep significant digits instead of printing 0.0.
    return fmt(value, ".1f" if value is not None and value >= 10 else ".3g")


class ProgressDisplay:
    """A rich progress bar whose description carries the latest step's numbers.

    When stderr is not a terminal (logs, CI), the same numbers are printed as one plain line
    per logged step instead of a bar.
    """

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True, quiet: bool = False):
        """``quiet``: print nothing at all (the ranks of a distributed run but rank 0)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.enabled, self.quiet = enabled and not quiet, quiet
        enabled = self.enabled
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(bar_width=20), MofNCompleteColumn(),
            TimeRemainingColumn(), TextColumn("{task.description}"), disable=not enabled,
        )
        self.task = self.progress.add_task("", total=total_steps, completed=start_step)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def update(self, record: dict) -> None:
        text = (f"loss {fmt(record['loss'], '.4f')}  lr {fmt(record['lr'], '.2e')}  "
                f"tok/s {fmt(record['tokens_per_s'], ',.0f')}  TFLOP/s {fmt_tflops(record['tflops_per_gpu'])}  "
                f"MFU {fmt(record['mfu'], '.1%')}  mem {fmt(record['peak_mem_gib'], '.2f')} GiB")
        if self.quiet:
            return
        if self.enabled:
            self.progress.update(self.task, completed=record["step"], description=text)
        else:
            print(f"step {record['step']}/{self.progress.tasks[0].total}  {text}", file=sys.stderr, flush=True)

    def log(self, message: str, style: str | None = None) -> None:
        """One line above the bar."""
        if self.quiet:
            return
        log_line(message, style, self.progress.console if self.enabled else None)


def log_line(message: str, style: str | None = None, console=None) -> None:
    """One line on stderr: through a rich ``console`` when given (a terminal), else plain. The message is
    plain text either way: brackets in paths or lists are not markup."""
    if console is not None:
        from rich.text import Text

        console.log(Text(message, style=style or ""))
    else:
        print(message, file=sys.stderr, flush=True)


def summary_table(records: list[dict], title: str):
    """A rich Table summarising a run from its per-step records (medians over timed steps)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    if not records:
        table.add_row("steps", "0")
        return table
    # The first steps include compilation and allocator warm-up: leave them out of medians.
    timed = records[min(2, len(records) - 1):]

    def median(key):
        values = sorted(r[key] for r in timed if r.get(key) is not None)
        return values[len(values) // 2] if values else None

    first = records[: min(10, len(records))]
    last = records[-min(10, len(records)):]
    rows = [
        ("steps", f"{records[0]['step']}..{records[-1]['step']}"),
        ("loss (first 10 steps, mean)", fmt(sum(r["loss"] for r in first) / len(first), ".4f")),
        ("loss (last 10 steps, mean)", fmt(sum(r["loss"] for r in last) / len(last), ".4f")),
        ("tokens/s (median)", fmt(median("tokens_per_s"), ",.0f")),
        ("TFLOP/s per GPU (median)", fmt_tflops(median("tflops_per_gpu"))),
        ("MFU (median)", fmt(median("mfu"), ".1%", "n/a (unknown device peak)")),
        ("peak memory GiB", fmt(max(r["peak_mem_gib"] for r in records), ".2f")),
        ("skipped steps", str(sum(1 for r in records if r.get("skipped")))),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
