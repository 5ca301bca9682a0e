"""Discrete-event simulator of pipeline-parallel schedules: 1F1B, interleaved 1F1B, zero-bubble.

Model: p pipeline ranks, v virtual chunks per rank (stage s = chunk * p + rank), m micro-batches.
Each stage has a forward time f[s], a backward time b[s] (input gradients) and a weight-gradient
time w[s]. 1F1B and interleaved run b + w as one backward op; zero-bubble splits them (B and W)
and runs W later to fill idle time. A cross-rank dependency (F of stage s-1 -> F of stage s,
B of stage s+1 -> B of stage s) costs ``p2p_s`` seconds.

Orders per rank:
* 1f1b (Megatron's non-interleaved schedule): min(p - r - 1, m) warm-up forwards, then
  one-forward-one-backward, then the cool-down backwards.
* interleaved (Megatron's): virtual micro-batch k runs chunk (k // p) % v of micro-batch
  (k // (p v)) p + k % p forward; backward visits chunks in reverse; warm-up
  (p - r - 1) * 2 + (v - 1) * p. Needs m to be a multiple of p.
* zero_bubble (ZB-H1 style, greedy): at each free moment a rank runs a ready B, else a ready F
  while fewer than p - r micro-batches are in flight (1F1B's activation memory), else a pending
  W; W ops left over run at the end.

For uniform stages without communication the simulator reproduces the analytic bubbles:
1F1B (p-1)/(m+p-1) and interleaved (p-1)/(p-1+m v) of the step (tests/plan/test_simulator.py).

The timeline (``Timeline.to_json``) lists per rank every op with its micro-batch, chunk, stage,
start and end (seconds) -- the format the distributed trainer will dump. ``render_png`` draws it
(matplotlib, imported lazily). Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from moetrain.errors import ConfigError

SCHEDULES = ("1f1b", "interleaved", "zero_bubble")


@dataclass
class Op:
    kind: str  # F, B (input grad, or whole backward outside zero-bubble), W (weight grad)
    mb: int
    chunk: int
    stage: int
    start: float = 0.0
    end: float = 0.0


@dataclass
class Timeline:
    schedule: str
    pp: int
    vpp: int
    micro_batches: int
    ranks: list[list[Op]]
    step_time: float = 0.0

    def busy(self, rank: int) -> float:
        return sum(op.end - op.start for op in self.ranks[rank])

    def bubble_fraction(self, rank: int) -> float:
        return 0.0 if self.step_time <= 0 else 1.0 - self.busy(rank) / self.step_time

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule, "pp": self.pp, "vpp": self.vpp, "micro_batches": self.micro_batches,
            "step_time_s": self.step_time,
            "ranks": [{"rank": r, "busy_s": self.busy(r), "bubble_fraction": self.bubble_fraction(r),
                       "ops": [{"kind": op.kind, "micro_batch": op.mb, "chunk": op.chunk, "stage": op.stage,
                                "start": op.start, "end": op.end} for op in ops]}
                      for r, ops in enumerate(self.ranks)],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


# ---- static orders ----------------------------------------------------------------------------

def order_1f1b(p: int, m: int, r: int) -> list[Op]:
    warm = min(p - r - 1, m)
    ops = [Op("F", i, 0, r) for i in range(warm)]
    for i in range(m - warm):
        ops += [Op("F", warm + i, 0, r), Op("B", i, 0, r)]
    ops += [Op("B", i, 0, r) for i in range(m - warm, m)]
    return ops


def order_interleaved(p: int, v: int, m: int, r: int) -> list[Op]:
    if m % p:
        raise ConfigError(
            f"the interleaved schedule needs the micro-batches per step ({m} = train.global_batch_size / "
            f"(train.micro_batch_size x parallel.dp)) to be a multiple of parallel.pp = {p}")
    total = m * v

    def fwd(k: int) -> Op:
        c = (k // p) % v
        return Op("F", (k // (p * v)) * p + k % p, c, c * p + r)

    def bwd(k: int) -> Op:
        c = v - 1 - (k // p) % v
        return Op("B", (k // (p * v)) * p + k % p, c, c * p + r)

    warm = min((p - r - 1) * 2 + (v - 1) * p, total)
    ops = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        ops += [fwd(warm + i), bwd(i)]
    ops += [bwd(k) for k in range(total - warm, total)]
    return ops


def static_orders(schedule: str, p: int, v: int, m: int) -> list[list[Op]]:
    if schedule == "interleaved" or v > 1:
        return [order_interleaved(p, v, m, r) for r in range(p)]
    return [order_1f1b(p, m, r) for r in range(p)]


# ---- simulation -------------------------------------------------------------------------------

def _deps(op: Op, n_stages: int) -> list[tuple[str, int, int]]:
    if op.kind == "F":
        return [("F", op.mb, op.stage - 1)] if op.stage > 0 else []
    if op.kind == "B":
        return [("B", op.mb, op.stage + 1)] if op.stage < n_stages - 1 else [("F", op.mb, op.stage)]
    return [("B", op.mb, op.stage)]


def _ready_time(op: Op, done: dict, n_stages: int, p2p: float, p: int) -> float | None:
    t = 0.0
    for kind, mb, stage in _deps(op, n_stages):
        end = done.get((kind, mb, stage))
        if end is None:
            return None
        cross = (stage % p) != (op.stage % p)
        t = max(t, end + (p2p if cross else 0.0))
    return t


def simulate(schedule: str, p: int, v: int, m: int, f: list[float], b: list[float], w: list[float] | None = None,
             p2p_s: float = 0.0) -> Timeline:
    """Run the schedule; f, b, w are per-stage times (len p * v). Without zero-bubble, b + w is
    one backward op."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r}; valid: {', '.join(SCHEDULES)}")
    n = p * v
    w = w or [0.0] * n
    if not (len(f) == len(b) == len(w) == n):
        raise ValueError(f"need {n} stage times, got {len(f)}, {len(b)}, {len(w)}")
    if schedule == "zero_bubble" and v == 1:
        return _simulate_zero_bubble(p, m, f, b, w, p2p_s)
    if schedule == "zero_bubble":
        # Interleaved zero-bubble is not modelled: run the interleaved order with split W appended.
        schedule = "interleaved"
    bt = [b[s] + w[s] for s in range(n)]
    orders = static_orders(schedule, p, v, m)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    nxt = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progress = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                op = orders[r][nxt[r]]
                ready = _ready_time(op, done, n, p2p_s, p)
                if ready is None:
                    break
                op.start = max(free[r], ready)
                op.end = op.start + (f[op.stage] if op.kind == "F" else bt[op.stage])
                free[r] = op.end
                done[(op.kind, op.mb, op.stage)] = op.end
                nxt[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise RuntimeError(f"pipeline schedule {schedule} deadlocked (p={p}, v={v}, m={m})")
    tl = Timeline(schedule, p, v, m, orders)
    tl.step_time = max(free) if free else 0.0
    return tl


def _simulate_zero_bubble(p: int, m: int, f, b, w, p2p: float) -> Timeline:
    done: dict[tuple[str, int, int], float] = {}
    ops: list[list[Op]] = [[] for _ in range(p)]
    free = [0.0] * p
    next_f = [0] * p
    next_b = [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    total = 3 * m * p
    count = 0
    while count < total:
        # Each rank proposes its next op: a B or F that can start now (B first), else a pending
        # W to fill the wait, else the earliest B/F to become ready. The earliest proposal over
        # all ranks is committed (later commits cannot change earlier start times).
        best = None
        for r in range(p):
            cands = []
            if next_b[r] < next_f[r]:
                op = Op("B", next_b[r], 0, r)
                t = _ready_time(op, done, p, p2p, p)
                if t is not None:
                    cands.append((max(free[r], t), 0, op))
            if next_f[r] < m and next_f[r] - next_b[r] < p - r:
                op = Op("F", next_f[r], 0, r)
                t = _ready_time(op, done, p, p2p, p)
                if t is not None:
                    cands.append((max(free[r], t), 1, op))
            now = [c for c in cands if c[0] <= free[r]]
            if now:
                choice = min(now, key=lambda c: c[1])
            elif pending_w[r]:
                choice = (free[r], 2, Op("W", pending_w[r][0], 0, r))
            elif cands:
                choice = min(cands, key=lambda c: (c[0], c[1]))
            else:
                continue
            if best is None or choice[0] < best[0][0]:
                best = (choice, r)
        if best is None:
            raise RuntimeError(f"zero-bubble schedule deadlocked (p={p}, m={m})")
        (start, _, op), r = best
        op.start = start
        op.end = start + {"F": f[r], "B": b[r], "W": w[r]}[op.kind]
        free[r] = op.end
        done[(op.kind, op.mb, op.stage)] = op.end
        ops[r].append(op)
        if op.kind == "F":
            next_f[r] += 1
        elif op.kind == "B":
            next_b[r] += 1
            pending_w[r].append(op.mb)
        else:
            pending_w[r].pop(0)
        count += 1
    tl = Timeline("zero_bubble", p, 1, m, ops)
    tl.step_time = max(free)
    return tl


# ---- memory in flight -------------------------------------------------------------------------

def peak_in_flight(orders: list[Op], act: dict[int, float], wgrad: dict[int, float] | None = None) -> float:
    """Peak saved-activation bytes on one rank walking its ops in order: F adds the stage's
    activations, B frees them (keeping the wgrad part when a W op follows), W frees the rest."""
    wgrad = wgrad or {}
    split = any(op.kind == "W" for op in orders)
    cur = peak = 0.0
    for op in orders:
        if op.kind == "F":
            cur += act[op.stage]
            peak = max(peak, cur)
        elif op.kind == "B":
            cur -= act[op.stage] - (wgrad.get(op.stage, 0.0) if split else 0.0)
        else:
            cur -= wgrad.get(op.stage, 0.0)
    return peak


def render_png(tl: Timeline, path: str) -> None:
    """Draw the timeline: one row per rank, forward blue, backward green, weight-grad orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452"}
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * tl.pp))
    for r, ops in enumerate(tl.ranks):
        for op in ops:
            ax.barh(r, op.end - op.start, left=op.start, color=colors[op.kind], edgecolor="white", linewidth=0.3)
        ax.text(tl.step_time * 1.01, r, f"{tl.bubble_fraction(r):.1%}", va="center", fontsize=8)
    ax.set_yticks(range(tl.pp))
    ax.set_yticklabels([f"pp{r}" for r in range(tl.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"{tl.schedule}: pp={tl.pp} vpp={tl.vpp} m={tl.micro_batches} (bubble per rank on the right)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
