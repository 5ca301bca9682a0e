"""How candidates are timed and one is picked: the tuner's single timing protocol.

Every candidate runs on each of the caller's inputs ("routings": the caller's own and, where the key cannot see what
matters, a second one such as a skewed routing of the same rows), in turns (runtime.timing.in_turns: each round starts
at another candidate, so none always runs on the hottest GPU), ROUNDS rounds of REPS calls queued back to back; the
FINALISTS fastest on the sum over routings (and the best candidate as fast as the peer on each routing) are timed again
over FINAL_ROUNDS longer rounds, since one short pass over a dozen configs left picks 5-9% off the best.

The pick: the fastest on the sum over routings. With a peer (torch._grouped_mm, itself a candidate), candidates at
least as fast as the peer on every routing ("safe") are preferred over one faster on the sum but slower than the peer
on one routing, and the peer wins where nothing beats it on the sum: auto must not lose to torch on either routing.

A timer is ``timer(run, reps) -> ms per call`` of ``run()`` issued ``reps`` times; ``queued_timer`` is the GPU one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUNDS = 3
REPS = 4
FINALISTS = 3
FINAL_ROUNDS = 4
FINAL_REPS = 10


def queued_timer(run, reps: int) -> float:
    """Milliseconds per call of ``run()`` queued ``reps`` times on the current CUDA stream, after one warm-up call:
    as a layer's kernels run (timed each from an idle GPU, a call also counts launch work the queue hides)."""
    from moetrain.runtime.timing import queued_ms

    return queued_ms(run, reps=reps, warmup=1)


@dataclass
class Measurement:
    """What the protocol saw: per candidate, the median ms on each routing; the candidates that raised."""

    medians: dict = field(default_factory=dict)  # candidate -> (ms on routing 0, ms on routing 1, ...)
    failed: dict = field(default_factory=dict)  # candidate -> exception
    first_pass: dict = field(default_factory=dict)  # candidate -> medians of the short pass (every candidate that ran)

    def total(self, cand) -> float:
        return sum(self.medians[cand])


def _median(values: list) -> float:
    return sorted(values)[len(values) // 2]


def _timed_pass(candidates: list, runs: tuple, timer, rounds: int, reps: int) -> Measurement:
    from moetrain.runtime.timing import in_turns

    per_round: dict = {}

    def time_one(cand) -> float:
        ms = tuple(float(timer(lambda run=run: run(cand), reps)) for run in runs)
        per_round.setdefault(cand, []).append(ms)
        return sum(ms)

    _, failed = in_turns(candidates, time_one, rounds)
    medians = {c: tuple(_median(list(col)) for col in zip(*rows)) for c, rows in per_round.items() if c not in failed}
    return Measurement(medians, failed)


def is_safe(cand, peer, m: Measurement) -> bool:
    """Whether ``cand`` is at least as fast as ``peer`` on every routing (False when either was not timed)."""
    if peer is None or peer not in m.medians or cand not in m.medians:
        return False
    return all(mine <= theirs for mine, theirs in zip(m.medians[cand], m.medians[peer]))


def measure(candidates: tuple, runs: tuple, timer, peer=None) -> Measurement:
    """Time ``candidates`` (``runs``: one callable run(candidate) per routing) by the protocol above; the result
    holds the final pass's medians (the candidates ``pick`` chooses among) and the short pass's of every one."""
    first = _timed_pass(list(candidates), runs, timer, ROUNDS, REPS)
    ranked = sorted(first.medians, key=first.total)
    finalists = [c for c in ranked if c != peer][:FINALISTS]
    safe = [c for c in ranked if c != peer and is_safe(c, peer, first)]
    if safe and safe[0] not in finalists:
        finalists.append(safe[0])
    if peer in first.medians:
        finalists.append(peer)
    first.first_pass = dict(first.medians)
    if len(finalists) < 2:
        return first
    final = _timed_pass(finalists, runs, timer, FINAL_ROUNDS, FINAL_REPS)
    final.failed.update(first.failed)
    final.first_pass = first.first_pass
    return final


def pick(m: Measurement, peer=None):
    """(winner, rule): see the module docstring. Raises ValueError when nothing ran."""
    if not m.medians:
        raise ValueError("no candidate ran")
    others = [c for c in m.medians if c != peer]
    safe = [c for c in others if is_safe(c, peer, m)]
    pool = safe or others
    best = min(pool, key=m.total) if pool else peer
    if peer in m.medians and (best is peer or m.total(peer) < m.total(best)):
        return peer, "peer fastest on the sum"
    if safe:
        return best, "as fast as the peer on each routing"
    return best, "fastest on the sum" + (" (none as fast as the peer on each routing)" if peer in m.medians else "")
