"""backend="auto": pick torch or triton per shape from measurements cached on disk.

The first time a (op kind, dtype, N, K, M/G bucket, device name) is seen on CUDA, every available
backend runs the op on the caller's own tensors and is timed with CUDA events, the candidates in
turns over ROUNDS rounds (median); the fastest is recorded in a JSON file and reused by later
calls and later processes. Elsewhere auto is the "loop" reference. The grouped GEMM kinds time each
candidate on the caller's routing and on a skewed one of the same rows (runtime.timing.skewed_offs) together: the
key cannot see skew (reading the counts would sync), routing at the first call is near-uniform and
skews later in training, and torch's GEMMs lose more to skew than ours (bench moe, DeepSeek-V3:
the choice made on uniform routing ran 11% slower than triton on skewed). The fused path's kinds time each
candidate on the caller's rows and on the same routing with its tokens relabeled (runtime.timing.relabeled_tokens):
a gather through the token index is fast where a token's K rows are read close together (the benchmarks'
round-robin balanced routing) and slower on a trained router's.

    op kind   "grouped_gemm_fwd", "grouped_gemm_dgrad", "grouped_gemm_wgrad" (one GEMM each; the MoE
              expert path's "auto" picks each of its GEMMs this way), "moe_fc1_fwd" (the fused path's
              FC1 forward: "gather" or "copy", see GPU_VALIDATED), "moe_fc1_wgrad" (its weight gradient),
              "moe_fc1_swiglu" (FC1 and SwiGLU: "separate" or "fused")
    N, K      the layer's forward output and reduction sizes, w [G, N, K]
    bucket    next power of two of M / G (rows per group); M = routed rows
Cache file: $MOETRAIN_CACHE_DIR/grouped_gemm_backends.json (default ~/.cache/moetrain/), see
moetrain.runtime.disk_cache (atomic writes; a file that does not parse is ignored with one warning and
rewritten on the next measurement; one of another version is measured again quietly).

Nothing is timed inside CUDA graph capture (a cached winner is used, else torch): warm up
(run the layer once) before capturing. ``time_backend`` is a module attribute so tests can
inject a fake timer.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch

from moetrain.runtime import cuda_device, disk_cache  # plain Python / torch, no triton
from moetrain.kernels.host import rows_bucket  # plain Python, no triton
from moetrain.runtime.packages import triton_available  # noqa: F401 (asked by ops as autoselect.triton_available)

# The backends "auto" may choose, per op kind: only those whose GPU tests have passed on real
# hardware. The Triton grouped GEMM (forward, dgrad, wgrad) passed on an H200 (bf16 at DeepSeek-V3
# and Qwen3 shapes, autograd, CUDA-graph replay). With one candidate, nothing is timed or cached.
GPU_VALIDATED = {
    "grouped_gemm_fwd": ("torch", "triton"),
    "grouped_gemm_dgrad": ("torch", "triton"),
    "grouped_gemm_wgrad": ("torch", "triton"),
    # FC1's forward on the fused path: our kernel reading token rows through the index ("gather"), or a
    # permuted copy of x fed to the auto-chosen forward GEMM and dropped right after ("copy"). The first
    # candidate is also what runs while a CUDA graph is captured before anything was measured.
    "moe_fc1_fwd": ("gather", "copy"),
    # FC1's weight gradient: x_perm written again for the auto-chosen wgrad ("copy"), or our wgrad kernel
    # reading x through the index ("gather"; its GPU tests passed on an H200).
    "moe_fc1_wgrad": ("copy", "gather"),
    # FC1 and SwiGLU (moe_fused.fc1_swiglu): the two kernels, or the ping-pong FC1 with SwiGLU in its epilogue
    # (Hopper only; its GPU tests passed on an H200).
    "moe_fc1_swiglu": ("separate", "fused"),
}
# What runs when every candidate of a kind failed to run (kinds not listed: the loop reference).
FALLBACK = {"moe_fc1_fwd": "gather", "moe_fc1_wgrad": "copy", "moe_fc1_swiglu": "separate"}

CACHE_FILE = "grouped_gemm_backends.json"
VERSION = 4  # 2: grouped GEMMs timed on the caller's and a skewed routing; 3: the fused path's on relabeled tokens too;
# 4: candidates timed queued (time_backend)

_memory: dict | None = None  # key -> {"backend": str, "ms": {backend: ms}}; loaded lazily
# The answers ``choose`` gave, by its arguments (no key string built): about 20 us of host time per lookup on the
# H200's host otherwise, seven lookups per MoE layer call. The kind's candidates are part of the key (tests narrow
# them); reset() clears it.
_chosen: dict = {}


def cache_path() -> Path:
    return disk_cache.cache_dir() / CACHE_FILE


def reset() -> None:
    """Forget the in-memory copy (tests; or after another process updated the file)."""
    global _memory
    _memory = None
    _chosen.clear()


def cache_key(kind: str, dtype: torch.dtype, n: int, k: int, rows: int, groups: int, device_name: str) -> str:
    return f"{kind}|{str(dtype).removeprefix('torch.')}|N{n}|K{k}|b{rows_bucket(rows, groups)}|{device_name}"


# Candidates are timed in turns over ROUNDS rounds and compared by their median (runtime.timing.in_turns).
ROUNDS = 5  # with 3, auto timed our Qwen3 dgrad 5-9% apart in two runs (bench/NOTES.md)


def time_backend(backend: str, run) -> float:
    """Milliseconds per call of ``run()`` (a callable that runs the op once with ``backend``), one round: 5 calls
    queued back to back, as a layer runs them (timed each from an idle GPU, a call also counts its host-side launch
    work, which a layer's queued kernels hide: kernels.grouped_gemm_tuning.pick_config)."""
    from moetrain.runtime.timing import queued_ms

    return queued_ms(run, reps=5, warmup=2)


def _valid(entry: dict) -> bool:
    return isinstance(entry.get("backend"), str)


WHAT = "backend cache"


def _entries() -> dict:
    global _memory
    if _memory is None:
        _memory = disk_cache.read_entries(cache_path(), VERSION, _valid, WHAT)
    return _memory


def entries() -> dict:
    """Every recorded choice: key -> {"backend": name, "ms": {backend: median ms or None}}."""
    return dict(_entries())


def describe_times(ms: dict) -> str:
    """An entry's timings as one phrase: "torch 2.653, triton failed" (ms; None = the candidate failed)."""
    return ", ".join(f"{name} {t:.3f}" if t is not None else f"{name} failed" for name, t in ms.items())


def lookup(key: str) -> str | None:
    entry = _entries().get(key)
    return entry["backend"] if entry else None


def pick(key: str, run_backend, *, capturing: bool = False) -> str:
    """The cached winner for ``key``, or measure every candidate with ``run_backend(name)`` and record it.

    Candidates: GPU_VALIDATED for the key's op kind (triton only when importable). A backend that raises is skipped;
    when none runs, FALLBACK (default "loop", always correct) is recorded. While capturing a CUDA graph nothing is
    timed: the kind's first candidate runs.
    """
    kind = key.split("|", 1)[0]
    candidates = [b for b in GPU_VALIDATED.get(kind, ("torch",)) if b != "triton" or triton_available()]
    if len(candidates) == 1:
        return candidates[0]
    cached = lookup(key)
    if cached is not None:
        return cached
    if capturing:
        return candidates[0]
    from moetrain.runtime.timing import in_turns

    finite, failed = in_turns(candidates, lambda name: time_backend(name, lambda: run_backend(name)), ROUNDS)
    for name, err in failed.items():  # e.g. torch._grouped_mm on a GPU or dtype it does not support
        warnings.warn(f"moetrain: backend {name} failed for {key}: {type(err).__name__}: {err}"[:300],
                      RuntimeWarning, stacklevel=2)
    times = {name: finite.get(name, math.inf) for name in candidates}
    winner = min(finite, key=finite.get) if finite else FALLBACK.get(kind, "loop")
    entry = {"backend": winner, "ms": {n: (t if math.isfinite(t) else None) for n, t in times.items()}}
    # Merge with what other processes may have written since we loaded, then write back.
    _entries()[key] = entry
    disk_cache.merge_and_write(cache_path(), VERSION, _entries(), _valid, WHAT)
    return winner


def on_both(run_one, own: tuple, make_other):
    """A measurement closure for ``choose``: run(name) runs run_one(name, *own) and then run_one(name, *other), where
    other = make_other() (a tuple) is made on the first timed call only (nothing is made when the answer is cached).
    The grouped GEMMs' second input is a skewed routing, the fused path's a relabeled token order (module docstring)."""
    other = []

    def run(name: str):
        if not other:
            other.append(make_other())
        run_one(name, *own)
        return run_one(name, *other[0])
    return run


def measures(device: torch.device) -> bool:
    """Whether "auto" measures on this device (CUDA); elsewhere it is the loop reference."""
    return device.type == "cuda"


def device_name(device: torch.device) -> str:
    """The GPU's name, part of every cache key (a module attribute so tests can fake a GPU)."""
    return cuda_device.device_name(device)


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def choose(kind: str, x: torch.Tensor, n: int, k: int, rows: int, groups: int, run_backend) -> str:
    """Resolve backend="auto" for one op call on ``x``'s device (see the module docstring)."""
    if not measures(x.device):
        return "loop"
    memo = (kind, x.dtype, n, k, rows, groups, x.device, GPU_VALIDATED.get(kind))
    chosen = _chosen.get(memo)
    if chosen is not None:
        return chosen
    key = cache_key(kind, x.dtype, n, k, rows, groups, device_name(x.device))
    during_capture = capturing()
    chosen = pick(key, run_backend, capturing=during_capture)
    if not during_capture or lookup(key) is not None:  # not the placeholder a capture runs before any measurement
        _chosen[memo] = chosen
    return chosen
