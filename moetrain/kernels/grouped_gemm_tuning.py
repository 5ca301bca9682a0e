"""Tile configurations and autotuning of the grouped GEMM kernels (grouped_gemm.py).

The first call per (op, dtype, N, K, M/G bucket) times every candidate config with
queued_ms (calls back to back between two CUDA events, as a layer's kernels run: moetrain.runtime.timing) and keeps
the fastest; the CPU interpreter always uses one small config. Winners are kept on disk too
($MOETRAIN_CACHE_DIR/grouped_gemm_configs.json, keyed with the GPU's name and the triton version;
moetrain.runtime.disk_cache), so that a later process (a restart, the next run) skips the timing; a cached config that
is no longer a candidate is timed again.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from moetrain.runtime import cuda_device, disk_cache
from moetrain.runtime.timing import in_turns, queued_ms


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One tile configuration.

    forward / dgrad: BLOCK_M rows x BLOCK_N output columns per tile, BLOCK_K reduction step,
    GROUP_M row tiles per L2 band. wgrad: BLOCK_M (over N) x BLOCK_N (over K) tiles of dw[g],
    BLOCK_K group rows per reduction step, GROUP_M dw row tiles per band (1: row-major order).
    use_tma: TMA descriptors (else masked pointer loads); tma_store (wgrad): dw by TMA store, else
    from registers.
    programs_per_sm: persistent programs per SM; 2 lets one program's epilogue overlap the
    other's main loop (the config must then fit two blocks' shared memory and registers).
    kernel: "triton" (_rowgroup_kernel, _wgrad_kernel) or "pingpong" (Gluon, Hopper, bf16, TMA: wgrad_pingpong.py,
    rowgroup_pingpong.py; a producer warp and two consumer warpgroups, each with its own BLOCK_M x BLOCK_N tile;
    num_warps is per consumer).
    cohorts (pingpong): groups of programs that start at different points of the tile order (wgrad_pingpong._tile).
    mix (pingpong, forward / dgrad): groups heaviest first, half the programs walking backwards on skewed routing
    (schedule.py; the kernels' MIX).
    sorted_groups (pingpong weight gradient): groups heaviest first, every program in step (wgrad_pingpong SORTED).
    """

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    use_tma: bool = True
    group_m: int = 8
    programs_per_sm: int = 1
    tail_split: bool = False  # forward / dgrad: remainders of <= half a tile go to a half-height launch
    tma_store: bool = True  # wgrad with use_tma: dw stored by TMA (False: TMA loads, stores from registers)
    kernel: str = "triton"
    cohorts: int = 1
    mix: bool = False
    sorted_groups: bool = False  # pingpong weight gradient: groups heaviest first, programs in step (SORTED)

    def __str__(self) -> str:
        if self.kernel != "triton":
            cohorts = "" if self.cohorts == 1 else f"/c{self.cohorts}"
            mix = "/mix" if self.mix else "/sorted" if self.sorted_groups else ""
            return (f"{self.kernel}/{self.block_m}x{self.block_n}x{self.block_k}/s{self.num_stages}/g{self.group_m}"
                    f"{cohorts}{mix}")
        kind = "tma" if self.use_tma else "ptr"
        two = "/x2" if self.programs_per_sm == 2 else ""
        split = "/split" if self.tail_split else ""
        band = "" if self.group_m == 8 else f"/g{self.group_m}"
        store = "" if self.tma_store or not self.use_tma else "/rstore"
        mix = "/mix" if self.mix else ""
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/s{self.num_stages}/w{self.num_warps}/{kind}{two}{split}"
                f"{band}{store}{mix}")


@functools.cache  # every tail-split launch asks (dataclasses.replace: ~35 us of host time per layer call)
def tail_config(body: GemmConfig) -> GemmConfig:
    """The half-height tiles of a tail-split body config (128x256x64/s3/w8 -> 64x256x64/s4/w4, a
    shape that is itself a candidate)."""
    return dataclasses.replace(body, block_m=body.block_m // 2, num_stages=body.num_stages + 1,
                               num_warps=max(4, body.num_warps // 2), programs_per_sm=1, tail_split=False)


# H200 candidates (bf16); the tail-split variants: see grouped_gemm.py and pick_config. The fp32 accumulator of a 128x256 tile needs 8 warps to stay in registers.
# Shared memory of a 128x256x64 stage is 48 KiB; with the 64 KiB TMA-store buffer only 3 stages fit
# in the 227 KiB of an H100/H200 block.
ROWGROUP_CONFIGS = (
    GemmConfig(128, 256, 64, 3, 8, tail_split=True),
    GemmConfig(128, 128, 64, 4, 4, tail_split=True),
    GemmConfig(128, 256, 64, 3, 8),
    GemmConfig(128, 128, 64, 4, 4),
    GemmConfig(128, 128, 64, 4, 8),
    GemmConfig(64, 256, 64, 4, 4),
    GemmConfig(64, 128, 64, 4, 4),
    GemmConfig(128, 256, 64, 3, 8, use_tma=False),
    GemmConfig(128, 128, 64, 4, 4, use_tma=False),
    # 256-row tiles: a DeepSeek-V3 expert's balanced 256 rows in one tile, half the weight-tile loads of 128
    # (candidates: their bf16 GPU test on skewed routing passed)
    GemmConfig(256, 128, 64, 3, 8, tail_split=True),
    GemmConfig(256, 128, 64, 3, 8),
)
WGRAD_CONFIGS = (
    GemmConfig(128, 256, 64, 3, 8),
    GemmConfig(128, 128, 64, 4, 4),
    GemmConfig(128, 128, 64, 4, 8),
    GemmConfig(128, 256, 64, 3, 8, use_tma=False),
    GemmConfig(128, 128, 64, 4, 4, use_tma=False),
    GemmConfig(128, 128, 64, 4, 8, use_tma=False),
    GemmConfig(256, 128, 64, 3, 8),  # dw tiles 256 (over N) x 128 (over K); GPU-tested
)
# The warp-specialized ping-pong weight gradient (wgrad_pingpong.py; bench/NOTES.md): candidates where it
# applies (Hopper, bf16, TMA, rows not gathered). 128x128 consumer tiles; bands of 8 dw row tiles keep a big
# group's rows in L2 (row-major order, g1, lost 20% on skewed routing at DeepSeek-V3's FC1 but won at its FC2);
# 5 stages won at EP8's long reductions. 64x256 consumer tiles (m64n256 wgmma) were slower everywhere.
# Groups heaviest first (sorted_groups): the light groups' store-bound tiles come last, under the tail of
# the heavy ones. Timed queued (schedule.py made by one launch): 2-15% faster on the layers' skewed routing at
# DeepSeek-V3 and Qwen3 in 11 of 12 cases, 0-2% slower on balanced routing (once 7%: Qwen3's FC2 with bands of one),
# so each config is offered both ways and the autotuner, timing the caller's and a skewed routing, decides.
PINGPONG_WGRAD_CONFIGS = (
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong"),
    GemmConfig(128, 128, 64, 5, 4, group_m=8, kernel="pingpong"),
    GemmConfig(128, 128, 64, 4, 4, group_m=1, kernel="pingpong"),
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong", sorted_groups=True),
    GemmConfig(128, 128, 64, 5, 4, group_m=8, kernel="pingpong", sorted_groups=True),
    GemmConfig(128, 128, 64, 4, 4, group_m=1, kernel="pingpong", sorted_groups=True),
)
# The warp-specialized ping-pong forward / data gradient (rowgroup_pingpong.py; bench/NOTES.md): where it
# applies (Hopper, bf16, TMA, rows not gathered). Level with torch._grouped_mm on the six GEMMs' sums at Qwen3,
# GPT-OSS and Mixtral, 0-5% ahead of it on some ops, behind at DeepSeek-V3's (5-10%); the autotuner keeps it where
# it wins. 64x256 consumer tiles were slower everywhere but DeepSeek-V3's FC2 data gradient.
PINGPONG_ROWGROUP_CONFIGS = (
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong"),
    GemmConfig(128, 128, 64, 5, 4, group_m=8, kernel="pingpong"),
)
# On trial: the ping-pong with its programs in 2 or 4 cohorts, each starting at another point of the tile order, so that
# under skewed routing small groups' store-bound tiles overlap big groups' MMA-bound ones (skew cost the
# DeepSeek-V3 layer +30%, padding alone +13-16%). GPU-tested; timed against one cohort:
# 2 cohorts 6% faster at DeepSeek-V3's FC1 on skewed routing, 8% slower on balanced (half as many programs share
# each group's operands in L2), no gain at Qwen3; 4 slower everywhere. Kept for a skew-aware choice. And "mix"
# (schedule.py): groups heaviest first, and only where the routing is skewed, half the programs walking backwards
# (light groups under heavy ones). GPU-tested and refuted: at DeepSeek-V3's FC1 weight
# gradient 11.4 ms on skewed routing against 9.9 for the plain schedule (and +3% on balanced).
TRIAL_PINGPONG_WGRAD_CONFIGS = (
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong", cohorts=2),
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong", cohorts=4),
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong", mix=True),
)
# On trial (bench gemm's sweep, the sm_90a compile test and the GPU tests, not the autotuner): the ping-pong weight
# gradient with x's rows gathered by a fourth warpgroup (cp.async), the permuted copy of x never made; K a multiple
# of 128. GPU-tested: 1.3-1.8x slower than the copy + ping-pong (bench/NOTES.md).
TRIAL_PINGPONG_GATHER_CONFIGS = (
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong"),
    GemmConfig(128, 128, 64, 3, 4, group_m=8, kernel="pingpong"),
)
# The interpreter runs every program in Python: small tiles keep the CPU tests fast (tail split on, so
# that every op test also runs the body and tail launches).
INTERPRETER_CONFIG = GemmConfig(32, 32, 16, 1, 4, use_tma=False, tail_split=True)
TUNE_ROUNDS = 3
# The best few of the first pass are timed again, longer: one pass of 4 reps over 13 configs left the
# layer's kernel 5-9% slower than the sweep's best on some hosts (bench/NOTES.md).
FINALISTS = 3
FINAL_ROUNDS = 4
FINAL_REPS = 10
INTERPRETER_PROGRAMS = 3

_BEST: dict = {}  # autotune cache: key -> GemmConfig
_VERDICTS: dict = {}  # key -> why pick_config chose its config (tuning_verdicts)
CONFIG_CACHE_FILE = "grouped_gemm_configs.json"
# 2: the 256-row configs joined the candidates; 3: the ping-pong weight gradient; 4: the two-programs-per-SM configs
# left them; 5: the ping-pong forward / data gradient joined; 6: candidates timed on a skewed routing too (winners
# tuned otherwise are re-tuned); 7: the sorted ping-pong weight gradient joined (and each timing round starts at
# another candidate); 8: the sorted schedule made by one launch (its winners were judged with a 0.06-0.1
# ms schedule per call), and sorted variants of the other ping-pong weight gradient configs joined; 9: candidates timed
# queued, and no preference for tail-split configs; 10: torch._grouped_mm timed beside them, and a config at least as
# fast as it on both routings preferred (PEER)
CONFIG_CACHE_VERSION = 10
_DISK: dict | None = None  # the file's entries, read once per process
_SHIM_DONE = False


@functools.cache  # fixed once triton is imported; asked ~34 times per layer call (~60 us through triton.knobs)
def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 before import)."""
    return bool(triton.knobs.runtime.interpret)


# On trial: compiled and checked for sm_90a on the CPU (tests/kernels/test_grouped_gemm_sm90.py: they fit in
# shared memory, no spills, wgmma, pipelined) and timed by `moetrain bench gemm`, but not yet run on a GPU by
# the correctness tests, so the run-time autotuner does not pick them. Promote them once they have.
# Also here, though they passed their GPU tests: the two-programs-per-SM configs. They won only the gathered weight
# gradient, which no layer ran (the permuted copy + weight gradient beat it everywhere), and one
# launch of any of them left the ping-pong weight gradient ~27% slower for a while after
# (wgrad_state.py): timed after them, the ping-pong lost the autotuner's choice at DeepSeek-V3's FC1, where it makes
# the layer 5-7% faster than that pick (layer_wgrad_ab.py; bench/NOTES.md).
TWO_PER_SM_CONFIGS = (
    GemmConfig(128, 128, 64, 2, 4, programs_per_sm=2),
    GemmConfig(128, 128, 64, 3, 4, use_tma=False, programs_per_sm=2),
)
# On trial: the usual forward / data gradient pick with the "mix" schedule (schedule.py). GPU-tested:
# level with or slower than the plain schedule at DeepSeek-V3 on both routings (bench gemm's sweep).
TRIAL_ROWGROUP_CONFIGS: tuple = TWO_PER_SM_CONFIGS + (GemmConfig(128, 256, 64, 3, 8, tail_split=True, mix=True),)
TRIAL_WGRAD_CONFIGS: tuple = TWO_PER_SM_CONFIGS + (
    # TMA loads, dw stored from registers: the 64 KiB store buffer of a 128x256 tile becomes a fourth stage
    # (they lose everywhere; kept as the reference for the next ones). Refuted and dropped:
    # 128 rows per reduction step (128x256x128, 128x128x128) and two programs per SM with register stores
    # (128x128x64/s3/w4/x2): none beat 128x256x64/s3/w8 at DeepSeek-V3 (bench/NOTES.md). Refuted and
    # dropped: 32-row steps with 5-6 stages (more rows in flight across a tile's end) and bands of one tile (half
    # the per-tile divisions): within noise of it (439-456 against 434-440 TF/s). Also refuted: 5-stage
    # configs for the gathered weight gradient (3-4 stages let the index and row loads share one wait, one step of
    # prefetch; 5 keep two in flight) ran no faster: 311 / 398 / 388 TF/s at DeepSeek-V3 / EP8 / Qwen3 against
    # 309-336 / 386-439 / 368-401 for the usual configs, ~0.7x torch on the permuted copy
    GemmConfig(128, 256, 64, 4, 8, tma_store=False),
    GemmConfig(128, 256, 64, 3, 8, tma_store=False),
    GemmConfig(128, 128, 64, 4, 4, tma_store=False),
)


def configs_for(op: str, trial: bool = True) -> tuple:
    """Candidates of an op ("fwd", "fwd_gather", "dgrad", "wgrad", "wgrad_gather"): the autotuner's, and with
    ``trial`` the configs on trial (bench gemm, the sm_90a compile test)."""
    if op == "wgrad":
        return WGRAD_CONFIGS + PINGPONG_WGRAD_CONFIGS + (TRIAL_WGRAD_CONFIGS + TRIAL_PINGPONG_WGRAD_CONFIGS
                                                         if trial else ())
    if op == "wgrad_gather":
        return WGRAD_CONFIGS + (TRIAL_WGRAD_CONFIGS + TRIAL_PINGPONG_GATHER_CONFIGS if trial else ())
    if op == "fwd_gather":
        return ROWGROUP_CONFIGS + (TRIAL_ROWGROUP_CONFIGS if trial else ())
    return ROWGROUP_CONFIGS + PINGPONG_ROWGROUP_CONFIGS + (TRIAL_ROWGROUP_CONFIGS if trial else ())


def interpreter_numpy_shim() -> None:
    # Triton 3.6's interpreter holds scalars as 1-element numpy arrays and calls int() on them for
    # range(); numpy >= 2.4 refuses that. Read the element instead (interpreter only).
    global _SHIM_DONE
    if _SHIM_DONE:
        return
    _SHIM_DONE = True
    import numpy as np
    try:
        int(np.zeros(1))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter as itp
    original = itp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    itp._patch_lang_tensor = patched


def _valid_entry(entry: dict) -> bool:
    fields = {f.name for f in dataclasses.fields(GemmConfig)}
    return isinstance(entry.get("config"), dict) and set(entry["config"]) <= fields


def _disk_entries() -> dict:
    global _DISK
    if _DISK is None:
        _DISK = disk_cache.read_entries(disk_cache.cache_dir() / CONFIG_CACHE_FILE, CONFIG_CACHE_VERSION,
                                        _valid_entry, "grouped GEMM config cache")
    return _DISK


def disk_key(key: tuple) -> str:
    """The file's key of an in-memory key: devices by their GPU's name, plus the triton version."""
    parts = [cuda_device.device_name(k) if isinstance(k, torch.device) else str(k).removeprefix("torch.") for k in key]
    return "|".join(parts + [f"triton {triton.__version__}"])


def _from_disk(key: tuple, candidates: tuple):
    entry = _disk_entries().get(disk_key(key))
    if entry is None:
        return None
    try:
        cfg = GemmConfig(**entry["config"])
    except TypeError:
        return None
    return cfg if cfg in candidates else None


def _to_disk(key: tuple, best: GemmConfig, times: dict, verdict: dict) -> None:
    entry = {"config": dataclasses.asdict(best), "ms": {str(c): t for c, t in times.items()}, **verdict}
    _disk_entries()[disk_key(key)] = entry
    disk_cache.merge_and_write(disk_cache.cache_dir() / CONFIG_CACHE_FILE, CONFIG_CACHE_VERSION, _disk_entries(),
                               _valid_entry, "grouped GEMM config cache")


def tuned_configs() -> dict:
    """This process's autotuner choices so far: key -> GemmConfig (a copy; bench gemm reports what auto ran)."""
    return dict(_BEST)


def tuning_verdicts() -> dict:
    """Why this process's autotuner picked what it did, for the keys it timed: key -> {"rule", "sum_winner",
    "best_ms", "peer_ms"} (see pick_config; bench gemm prints them)."""
    return dict(_VERDICTS)


# What run(PEER) runs when pick_config is told the op has a peer: torch._grouped_mm on the same operands and routing.
# Timed in turns with the candidates, never chosen: it decides which candidates are safe (below).
PEER = "torch._grouped_mm"


def pick_config(key: tuple, candidates: tuple, config, run, run_skewed=None, peer: bool = False):
    """Explicit config, cached winner (this process, then the disk cache), or time the candidates in turns
    (per round the mean of calls queued back to back, median over the rounds; the FINALISTS fastest again over
    FINAL_ROUNDS longer rounds) and record
    the winner in both. ``run_skewed(cfg)``: the same op on a skewed routing of the same rows; each candidate is
    then judged by the sum of both times, as auto's torch-or-triton choice is (ops/autoselect.py): the key cannot
    see skew without a host sync, the first call's routing is near-uniform and training's skews later, and a config
    can lead on balanced routing yet collapse on skewed (the ping-pong weight gradient, bench/NOTES.md).
    ``peer``: run(PEER) and run_skewed(PEER) run torch._grouped_mm's form of the op. It is timed in the same turns,
    and a candidate at least as fast as the peer on each routing ("safe") wins over one that is faster on the sum
    but slower than the peer on one routing: auto (torch or this pick) must not lose to torch on either routing."""
    if config is not None:
        return config
    if interpreting():
        return INTERPRETER_CONFIG
    if key in _BEST:
        return _BEST[key]
    cached = _from_disk(key, candidates)
    if cached is not None:
        _BEST[key] = cached
        return cached
    if torch.cuda.is_current_stream_capturing():
        return candidates[0]  # cannot time inside a graph capture; warm up before capturing

    # Queued, not each call from an idle GPU (median_ms): from idle each call carries its launch (host work, GPU
    # start-up: 0.03-0.21 ms, differing between candidates), which a layer's queued kernels hide; timed so, the
    # autotuner's picks ran 1-16% slower in the layer's order than the best candidate (bench/NOTES.md)
    def timed(cfg, reps: int, parts: dict) -> float:
        ms = (queued_ms(lambda: run(cfg), reps=reps, warmup=1),)
        if run_skewed is not None:
            ms += (queued_ms(lambda: run_skewed(cfg), reps=reps, warmup=1),)
        parts.setdefault(cfg, []).append(ms)
        return sum(ms)

    # a config that does not fit (shared memory, registers) is dropped; so is a peer that cannot run here
    first: dict = {}
    times, failed = in_turns(candidates + ((PEER,) if peer else ()), lambda cfg: timed(cfg, 4, first), TUNE_ROUNDS)
    times.pop(PEER, None)
    failed.pop(PEER, None)
    if not times:
        raise RuntimeError(f"grouped GEMM: no config ran for {key}") from next(iter(failed.values()), None)
    ranked = sorted(times, key=times.get)
    finalists = ranked[:FINALISTS]
    safe_first = [c for c in ranked if _as_fast_as_peer(c, first)]
    if safe_first and safe_first[0] not in finalists:  # the best safe candidate gets its longer timing too
        finalists.append(safe_first[0])
    final: dict = {}
    if len(finalists) > 1:
        again, _ = in_turns(finalists + ([PEER] if PEER in first else []), lambda cfg: timed(cfg, FINAL_REPS, final),
                            FINAL_ROUNDS)
        again.pop(PEER, None)
        times.update(again)
        finalists = [c for c in finalists if c in again] or finalists
    # The fastest on the sum, tail-split or not: the skewed routing in the sum measures what the split saves on
    # uneven routing (a 3% preference for split configs, from before that, cost DeepSeek-V3's FC1 forward 1-3% on
    # both routings; bench/NOTES.md). Among the safe ones when there are any: a guard, so that auto does
    # not trade a loss to torch on one routing for a win on the other (at DeepSeek-V3 it changed no pick: every
    # sum's winner was also ahead of torch on both routings).
    parts = final or first
    safe = [c for c in finalists if _as_fast_as_peer(c, parts)]
    best = min(safe or finalists, key=times.get)
    verdict = {"rule": "as fast as torch on each routing" if safe else
               "fastest on the sum (none as fast as torch on each routing)" if PEER in parts else
               "fastest on the sum (torch not timed)",
               "sum_winner": str(min(finalists, key=times.get)),
               "best_ms": _medians(parts, best) if best in parts else None}
    if PEER in parts:
        verdict["peer_ms"] = _medians(parts, PEER)
        times[PEER] = sum(verdict["peer_ms"])
    _BEST[key] = best
    _VERDICTS[key] = verdict
    _to_disk(key, best, times, verdict)
    return best


def _medians(parts: dict, cfg) -> tuple:
    """Per routing (the caller's, then the skewed one), the median of cfg's times in ``parts``."""
    return tuple(sorted(column)[len(column) // 2] for column in zip(*parts[cfg]))


def _as_fast_as_peer(cfg, parts: dict) -> bool:
    """Whether cfg's median time on each routing is at most the peer's (False when the peer was not timed)."""
    if PEER not in parts or cfg not in parts:
        return False
    return all(mine <= theirs for mine, theirs in zip(_medians(parts, cfg), _medians(parts, PEER)))
