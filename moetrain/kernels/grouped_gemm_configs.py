"""Tile configurations of the grouped GEMM kernels (grouped_gemm.py): the candidates moetrain.tuning times.

The run-time tuner (moetrain.tuning) picks one per (op, dtype, N, K, M/G bucket) among the lists below, with
torch._grouped_mm an ordinary candidate beside them when the backend is "auto"; the CPU interpreter always uses
INTERPRETER_CONFIG. The TRIAL_* lists are offered only to `moetrain bench gemm` and the sm_90a compile tests.
"""

from __future__ import annotations

import dataclasses
import functools

import triton



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


# H200 candidates (bf16); the tail-split variants: see grouped_gemm.py. The fp32 accumulator of a 128x256 tile needs 8 warps to stay in registers.
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
# The warp-specialized ping-pong weight gradient (wgrad_pingpong.py; bench/grouped_gemm.md): candidates where it
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
# The warp-specialized ping-pong forward / data gradient (rowgroup_pingpong.py; bench/grouped_gemm.md, per shape
# bench/archive/2026-11-29_2114-2254.md): where it applies (Hopper, bf16, TMA, rows not gathered). Level with
# torch._grouped_mm on the six GEMMs' sums at Qwen3, GPT-OSS and Mixtral, 0-5% ahead of it on some ops, behind at
# DeepSeek-V3's (5-10%); the autotuner keeps it where it wins. 64x256 consumer tiles were slower everywhere but
# DeepSeek-V3's FC2 data gradient.
PINGPONG_ROWGROUP_CONFIGS = (
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong"),
    GemmConfig(128, 128, 64, 5, 4, group_m=8, kernel="pingpong"),
)
# Trial configs: the ping-pong with its programs in 2 or 4 cohorts, each starting at another point of the tile order,
# so that under skewed routing small groups' store-bound tiles overlap big groups' MMA-bound ones (skew cost the
# DeepSeek-V3 layer +30%, padding alone +13-16%). GPU-tested; timed against one cohort:
# 2 cohorts 6% faster at DeepSeek-V3's FC1 on skewed routing, 8% slower on balanced (half as many programs share
# each group's operands in L2), no gain at Qwen3; 4 slower everywhere. Kept for a skew-aware choice. And "mix"
# (schedule.py): groups heaviest first, and only where the routing is skewed, half the programs walking backwards
# (light groups under heavy ones). GPU-tested and slower: at DeepSeek-V3's FC1 weight
# gradient 11.4 ms on skewed routing against 9.9 for the plain schedule (and +3% on balanced; bench/grouped_gemm.md).
TRIAL_PINGPONG_WGRAD_CONFIGS = (
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong", cohorts=2),
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong", cohorts=4),
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong", mix=True),
)
# Trial configs (bench gemm's sweep, the sm_90a compile test and the GPU tests, not the autotuner): the ping-pong weight
# gradient with x's rows gathered by a fourth warpgroup (cp.async), the permuted copy of x never made; K a multiple
# of 128. GPU-tested: 1.3-1.8x slower than the copy + ping-pong (bench/grouped_gemm.md).
TRIAL_PINGPONG_GATHER_CONFIGS = (
    GemmConfig(128, 128, 64, 4, 4, group_m=8, kernel="pingpong"),
    GemmConfig(128, 128, 64, 3, 4, group_m=8, kernel="pingpong"),
)
# The interpreter runs every program in Python: small tiles keep the CPU tests fast (tail split on, so
# that every op test also runs the body and tail launches).
INTERPRETER_CONFIG = GemmConfig(32, 32, 16, 1, 4, use_tma=False, tail_split=True)
INTERPRETER_PROGRAMS = 3
_SHIM_DONE = False


@functools.cache  # fixed once triton is imported; asked ~34 times per layer call (~60 us through triton.knobs)
def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 before import)."""
    return bool(triton.knobs.runtime.interpret)


# Trial configs: compiled and checked for sm_90a on the CPU (tests/kernels/test_grouped_gemm_sm90.py: they fit in
# shared memory, no spills, wgmma, pipelined) and timed by `moetrain bench gemm`, but not run on a GPU by
# the correctness tests, so the run-time autotuner does not pick them.
# Also here, though they pass their GPU tests: the two-programs-per-SM configs. They win only the gathered weight
# gradient, which no layer runs (the permuted copy + weight gradient beat it everywhere), and one
# launch of any of them leaves the ping-pong weight gradient ~27% slower for a while after (bench/grouped_gemm.md):
# timed after them, the ping-pong loses the autotuner's choice at DeepSeek-V3's FC1, where it makes
# the layer 5-7% faster than that pick (bench/archive/2026-11-29_2114-2254.md).
TWO_PER_SM_CONFIGS = (
    GemmConfig(128, 128, 64, 2, 4, programs_per_sm=2),
    GemmConfig(128, 128, 64, 3, 4, use_tma=False, programs_per_sm=2),
)
# Trial config: the usual forward / data gradient pick with the "mix" schedule (schedule.py). GPU-tested:
# level with or slower than the plain schedule at DeepSeek-V3 on both routings (bench gemm's sweep).
TRIAL_ROWGROUP_CONFIGS: tuple = TWO_PER_SM_CONFIGS + (GemmConfig(128, 256, 64, 3, 8, tail_split=True, mix=True),)
TRIAL_WGRAD_CONFIGS: tuple = TWO_PER_SM_CONFIGS + (
    # TMA loads, dw stored from registers: the 64 KiB store buffer of a 128x256 tile becomes a fourth stage
    # (they lose everywhere; kept as the reference for other register-store configs). Not among the configs, as
    # none beat 128x256x64/s3/w8 at DeepSeek-V3 (bench/grouped_gemm.md): 128 rows per reduction step
    # (128x256x128, 128x128x128) and two programs per SM with register stores (128x128x64/s3/w4/x2); 32-row steps
    # with 5-6 stages (more rows in flight across a tile's end) and bands of one tile (half the per-tile
    # divisions), within noise of it (439-456 against 434-440 TF/s). Nor 5-stage configs for the gathered weight
    # gradient (3-4 stages let the index and row loads share one wait, one step of prefetch; 5 keep two in
    # flight): no faster, 311 / 398 / 388 TF/s at DeepSeek-V3 / EP8 / Qwen3 against 309-336 / 386-439 / 368-401
    # for the usual configs, ~0.7x torch on the permuted copy
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


def interpreter_rounding_shim() -> None:
    """Triton 3.6's interpreter casts float32 -> e4m3 and float32 -> bfloat16 by dropping mantissa bits (no
    rounding, no carry into the exponent), where the GPU rounds to nearest even (cvt.rn), as torch does: make those
    two casts go through torch (interpreter only; other conversions untouched), so interpreted kernels write the
    GPU's bits."""
    global _ROUNDING_SHIM_DONE
    if _ROUNDING_SHIM_DONE:
        return
    _ROUNDING_SHIM_DONE = True
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as itp

    original = itp._convert_float
    through_torch = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.uint16)}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in through_torch:
            dtype, bits = through_torch[output_dtype]
            t = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
            return t.to(dtype).view(bits).numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    itp._convert_float = convert


_ROUNDING_SHIM_DONE = False


# The "auto" backend's extra candidate beside the configs: torch._grouped_mm's form of the op (torch_grouped_mm.py).
TORCH = "torch"
