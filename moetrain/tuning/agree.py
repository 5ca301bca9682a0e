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
    """Rank 0's ``answer`` to question ``key``, on every rank (a collective: every rank must call it). Every rank
    sees every rank's question, so a mismatch raises on all of them at once."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (key, answer))
    others = {rank: asked for rank, (asked, _) in enumerate(everyone) if asked != everyone[0][0]}
    if others:
        rank, asked = next(iter(others.items()))
        raise RuntimeError(f"moetrain tuner: rank {rank} asked {asked!r} while rank 0 asked {everyone[0][0]!r}; "
                           "every rank must tune the same shapes in the same order (warm up with the same batch "
                           "shapes on every rank)")
    return everyone[0][1]
