"""Rank 0 decides: under torch.distributed every rank asks the tuner the same questions in the same order (data
parallel ranks run the same shapes; an expert-parallel dispatcher must ask with its nominal, not received, row count),
and each answer is rank 0's, broadcast, so that no rank runs a kernel the others do not (a straggler). A rank that
asks another question than rank 0 at the same point raises instead of hanging or diverging."""

from __future__ import annotations


def distributed() -> bool:
    """Whether a default process group of more than one rank exists."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_rank0() -> bool:
    import torch.distributed as dist

    return not distributed() or dist.get_rank() == 0


def rank0_answer(key: str, answer: str | None) -> str | None:
    """Rank 0's ``answer`` to question ``key``, on every rank (a collective: every rank must call it)."""
    import torch.distributed as dist

    message = [key, answer]
    dist.broadcast_object_list(message, src=0)
    if message[0] != key:
        raise RuntimeError(f"moetrain tuner: rank {dist.get_rank()} asked {key!r} while rank 0 asked {message[0]!r}; "
                           "every rank must tune the same shapes in the same order (warm up with the same batch "
                           "shapes on every rank)")
    return message[1]
