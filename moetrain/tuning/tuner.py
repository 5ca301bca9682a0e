"""The Tuner: answers "which candidate runs this op at this shape?" once per question and process.

    choose(kind, x, n, k, rows, groups, candidates, runs, variant=(), peer=None, fallback=None) -> candidate

``kind`` names the op and its candidate set ("gemm_fwd+torch": the forward GEMM among torch and our configs;
"moe_fc1_fwd": the fused path's gather or copy); ``variant`` holds the flags that change the candidates (TMA
alignment, ping-pong applicability), so a kind and its variant always come with the same candidates. Candidates are
hashable with a stable ``str`` (their label in the cache). ``runs`` holds one callable ``run(candidate)`` per routing
(protocol.py). The answer comes from, in order: this process's memo; with one candidate, that one; inside a CUDA
graph capture, the first candidate (nothing can be timed; not remembered: warm up before capturing); the cache file
(rank 0's); else every candidate is measured (on every rank, so nested questions stay in step) and rank 0's pick is
broadcast, recorded and written. A candidate that raises is dropped (with a warning unless it merely did not fit the
GPU's resources); when none runs, ``fallback`` is used if given, else RuntimeError.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from moetrain.tuning import agree, cache, protocol


@dataclass(frozen=True)
class Decision:
    """One measured question: its key, the winner's label, why it won, and each candidate's median ms per routing
    (None: it raised)."""

    key: str
    choice: str
    rule: str
    ms: dict

    def summary(self) -> str:
        """The pick's and torch's ms per routing (caller's / other) and how many candidates ran."""
        def cell(label: str) -> str:
            t = self.ms.get(label)
            return f"{label} " + ("failed" if t is None else "/".join(f"{v:.3f}" for v in t))

        shown = [self.choice] + (["torch"] if "torch" in self.ms and self.choice != "torch" else [])
        ran = sum(t is not None for t in self.ms.values())
        return ", ".join(cell(label) for label in shown) + f" ms; {ran} of {len(self.ms)} candidates ran"


class Tuner:
    """Memo, cache file and timer of one process (or one test). ``timer(run, reps) -> ms`` (protocol.queued_timer on
    a GPU); ``cache_file`` None means $MOETRAIN_CACHE_DIR/tuning.json, read when first needed."""

    def __init__(self, timer=protocol.queued_timer, cache_file=None):
        self.timer = timer
        self.cache = cache.CacheFile(cache_file)
        self._memo: dict = {}
        self.decisions: list[Decision] = []  # what this tuner measured, in order
        self.from_cache: list[str] = []  # keys answered by the cache file

    def choose(self, kind: str, x: torch.Tensor, n: int, k: int, rows: int, groups: int, candidates: tuple, runs,
               variant: tuple = (), peer=None, fallback=None):
        memo = (kind, x.dtype, x.device, n, k, rows, groups, variant)
        chosen = self._memo.get(memo)
        if chosen is not None:
            return chosen
        if len(candidates) == 1:
            self._memo[memo] = candidates[0]
            return candidates[0]
        if _capturing():
            return candidates[0]
        key = cache.key_string(kind, x.dtype, x.device, n, k, rows, groups, variant)
        chosen = self._answer(key, candidates, runs, peer, fallback)
        self._memo[memo] = chosen
        return chosen

    def _answer(self, key: str, candidates: tuple, runs, peer, fallback):
        by_label = {str(c): c for c in candidates}
        if fallback is not None:
            by_label.setdefault(str(fallback), fallback)
        shared = agree.distributed()
        cached = self.cache.choice(key) if agree.is_rank0() else None
        if shared:
            cached = agree.rank0_answer(key, cached)
        if cached in by_label:
            self.from_cache.append(key)
            return by_label[cached]
        label, entry = self._measure(key, candidates, tuple(runs), peer, fallback)
        if shared:
            label = agree.rank0_answer(key, label)
        if agree.is_rank0():
            self.cache.record(key, entry)
        return by_label[label]

    def _measure(self, key: str, candidates: tuple, runs: tuple, peer, fallback) -> tuple[str, dict]:
        m = protocol.measure(candidates, runs, self.timer, peer)
        _warn_failures(key, m.failed)
        try:
            winner, rule = protocol.pick(m, peer)
        except ValueError:
            if fallback is None:
                raise RuntimeError(f"moetrain tuner: no candidate ran for {key}") from next(iter(m.failed.values()),
                                                                                          None)
            winner, rule = fallback, "fallback: no candidate ran"
        ms = {str(c): list(t) for c, t in {**m.first_pass, **m.medians}.items()}
        ms.update({str(c): None for c in m.failed})
        decision = Decision(key, str(winner), rule, ms)
        self.decisions.append(decision)
        return str(winner), {"choice": decision.choice, "rule": rule, "ms": ms}

    def forget(self) -> None:
        """Drop the memo (the cache file is read again when next needed)."""
        self._memo.clear()
        self.cache = cache.CacheFile(self.cache._path)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _warn_failures(key: str, failed: dict) -> None:
    # A tile config that does not fit the GPU's shared memory or registers is an expected loss, not news
    news = {c: err for c, err in failed.items() if type(err).__name__ != "OutOfResources"}
    if news:
        cand, err = next(iter(news.items()))
        warnings.warn(f"moetrain tuner: {len(news)} candidate(s) failed for {key}, e.g. {cand}: "
                      f"{type(err).__name__}: {err}"[:400], RuntimeWarning, stacklevel=4)


_ACTIVE: Tuner | None = None


def active() -> Tuner:
    """The process's tuner (made on first use)."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = Tuner()
    return _ACTIVE


@contextlib.contextmanager
def use(tuner: Tuner):
    """Answer every question with ``tuner`` inside the block (a test's fake timer, a benchmark's own cache)."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, tuner
    try:
        yield tuner
    finally:
        _ACTIVE = previous


def reset() -> None:
    """A fresh process tuner: no memo, the cache file read again (tests; after another process tuned)."""
    global _ACTIVE
    _ACTIVE = None


def choose(kind: str, x: torch.Tensor, n: int, k: int, rows: int, groups: int, candidates: tuple, runs,
           variant: tuple = (), peer=None, fallback=None):
    """``active().choose(...)``: see the module docstring."""
    return active().choose(kind, x, n, k, rows, groups, candidates, runs, variant, peer, fallback)

