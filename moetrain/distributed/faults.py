"""How a distributed run fails: every rank goes down, and the first error is printed once.

A rank that raises exits non-zero; one that is killed just ends. torchrun then ends the other ranks and exits
non-zero itself. The other ranks may meet the failure first, in a collective: the peer's connection closes, or,
when it hangs, the collective times out after ``train.dist_timeout_s`` (gloo raises, NCCL's watchdog aborts),
so no rank waits longer than that even without torchrun's agent (a Slurm ``srun`` launch).

Only the first rank to fail prints its error, prefixed with its rank: it claims the job's error in the
rendezvous store (torchrun's, which outlives the ranks). The rest are consequences (a lost peer, a timeout, the
same configuration error raised by every rank) and stay silent; where the store cannot be reached, a rank
prints anyway rather than risk printing nothing.
"""

from __future__ import annotations

import re
import sys

ERROR_KEY = "moetrain/first_error"
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "timeout",
              "communicator was aborted", "nccl error", "socket", "recv", "send")


def _group():
    """torch.distributed when this process belongs to an initialized process group, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def rank_prefix() -> str:
    """'rank r of n: ' inside a process group of several ranks, else ''."""
    dist = _group()
    if dist is None or dist.get_world_size() == 1:
        return ""
    return f"rank {dist.get_rank()} of {dist.get_world_size()}: "


def claim_first_error() -> bool:
    """True where this rank should print its error: the first to fail, or outside a process group."""
    dist = _group()
    if dist is None or dist.get_world_size() == 1:
        return True
    try:
        return dist.distributed_c10d._get_default_store().add(ERROR_KEY, 1) == 1
    except Exception:  # the store went down with its host: print rather than stay silent
        return True


def lost_peer(err: BaseException) -> str | None:
    """A one-line reason where ``err`` is a collective failing because another rank did (its connection gone, or a
    timeout), else None."""
    dist = _group()
    if dist is None:
        return None
    text = str(err).lower()
    if not isinstance(err, (RuntimeError, ConnectionError, TimeoutError)) or not any(s in text for s in _PEER_GONE):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip().splitlines()[0])  # gloo's "[source.cc:123] " prefix
    return (f"a collective failed: another rank failed, was killed or stopped answering ({first[:200]}); the wait "
            "for a silent rank is train.dist_timeout_s")
