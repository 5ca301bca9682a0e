"""Median time of a GPU op with CUDA events, for picking kernels and backends at run time: candidates timed
in turns, and a skewed routing to time them on besides the caller's.

Plain torch (no triton import). Not triton.testing.do_bench: its 256 MB L2-flush buffer lands in the
first training step's peak memory (measured: +0.2 GiB on a small model's 0.33 GiB projection), and
run-time choices see warm caches in training anyway.
"""

from __future__ import annotations

import torch


def median_ms(run, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of ``run()`` on the current CUDA stream, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def queued_ms(run, reps: int, warmup: int = 0) -> float:
    """Milliseconds per call of ``run()`` issued ``reps`` times back to back on the current CUDA stream (one pair
    of events around them all, no synchronisation between calls: as kernels run inside a layer), after ``warmup``
    synchronised calls."""
    if warmup:
        for _ in range(warmup):
            run()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def profiled_once(*runs) -> None:
    """Each of ``runs`` called once between cudaProfilerStart and cudaProfilerStop, after a synchronisation: what
    Nsight Compute (--profile-from-start off) captures, one launch each."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def skewed_offs(m: int, g: int, seed: int, device: torch.device) -> torch.Tensor:
    """[G] int32 group ends of m rows over g groups with shares drawn from Dirichlet(0.3) (the benchmarks'
    skewed routing, and the second routing auto times grouped GEMMs on; a fixed draw per seed), built on
    the host and copied to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    shares = torch._standard_gamma(torch.full((g,), 0.3), generator=gen)
    counts = torch.floor(shares / shares.sum() * m).long()
    counts[torch.argmax(counts)] += m - counts.sum()  # exactly m rows
    return torch.cumsum(counts, 0).to(torch.int32).to(device)


def in_turns(candidates, time_one, rounds: int) -> tuple[dict, dict]:
    """Time every candidate once per round, in turns (A, B, A, B, ...), ``rounds`` rounds; returns
    ({candidate: median}, {candidate: the exception that dropped it}). Timed back to back, a later
    candidate runs on a GPU already hot from the earlier ones (on the H200 a later timing of the very
    same GEMM came out 4-13% slower), which biases a choice toward whatever is timed first. So each round
    starts at another candidate (round r at candidate r * n // rounds): every position in a round is taken
    by as many candidates (the same config timed 3-7% apart at DeepSeek-V3 and GPT-OSS sizes by
    its place in a fixed order)."""
    candidates = list(candidates)
    times: dict = {c: [] for c in candidates}
    failed: dict = {}
    for r in range(rounds):
        start = r * len(candidates) // rounds
        for c in candidates[start:] + candidates[:start]:
            if c in failed:
                continue
            try:
                times[c].append(float(time_one(c)))
            except Exception as err:  # a candidate that cannot run here (resources, dtype) is dropped
                failed[c] = err
    return {c: sorted(t)[len(t) // 2] for c, t in times.items() if c not in failed}, failed


def relabeled_tokens(token_of_row: torch.Tensor, inverse: torch.Tensor, topk: int, seed: int = 0) -> tuple:
    """(token_of_row', inverse') of the same routing with the T tokens relabeled by a fixed random permutation s: row r
    reads token s[token_of_row[r]], and token s[t] owns the rows token t owned. The groups and their sizes stay; what
    changes is the order in which the rows visit the tokens. The benchmarks' balanced routing sends token t to experts
    t*K .. t*K+K-1 (mod E), so a token's K rows are read close together in time and hit L2; a trained router's
    routing does not (bench/method.md). token_of_row [M] int32, inverse [M] int64, M = T*K -> the same
    shapes and dtypes, on their device."""
    tokens = inverse.shape[0] // topk
    gen = torch.Generator().manual_seed(seed)
    relabel = torch.randperm(tokens, generator=gen).to(inverse.device)
    # token relabel[t] takes over token t's K rows: inverse'[relabel[t]] = inverse[t] (viewed [T, K])
    new_inverse = torch.empty_like(inverse).view(tokens, topk).index_copy_(0, relabel, inverse.view(tokens, topk))
    return relabel.to(token_of_row.dtype)[token_of_row.long()], new_inverse.view(-1)
