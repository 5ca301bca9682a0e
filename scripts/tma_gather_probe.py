"""Can producer warps feed a Hopper GEMM's A operand by TMA, one row per copy? (the gathered-rows question)

Qwen3's layer spends ~0.5 ms per call writing permuted copies of token rows (x for FC1's forward and again for its
weight gradient, dout for FC2's backward: `_combine_bwd_kernel`, bench/NOTES.md session 24 F), because the TMA loads
of our GEMMs read A as one [BM, BK] box of consecutive rows. Hopper's TMA has no row gather (Blackwell's gather4
does), but a box can be one row: [1, BK], 128 bytes, written at its row of a 128-byte-swizzled [BM, BK] stage
(the swizzle follows the shared address, so single rows land where a whole box would put them). Per stage that is
BM copies instead of one, each after a load of the row's index.

The probe: persistent programs, one per SM; loader warps fill a ring of STAGES [BM, BK] bf16 stages from x [T, K]
either as whole boxes of consecutive rows (one warp) or row by row through an index (random token rows, as a trained
router's order): from 1, 2 or 4 warps (each its share of a stage's rows, each arriving on the stage's barrier with its
bytes), each loading its rows' indices right before each copy or eight at a time before eight copies (ROW_WAYS). A
consumer warpgroup waits for each stage and either just releases it ("load") or also runs a [BM, BK] x [BK, 128]
wgmma on it first ("mma": one ping-pong consumer's tile). Reported: us per stage per SM, and A's bytes per second. A
GEMM consumer's MMA takes ~0.28 us per 128x128x64 stage at the H200's ~4,000 FLOP per clock per SM; a row-fed producer
slower than that starves the tensor cores. Session 25 A: four warps loading indices eight at a time match the whole
box here (HBM-bound); inside a GEMM the same copies still lost (bench/NOTES.md session 25).

    python scripts/tma_gather_probe.py [--rows 131072] [--tokens 16384] [--k 2048] [--stages 4] [--reps 7]

Checks first that the "rows" variant's stages hold the indexed rows: each program sums its last stage into a
checksum weighted by position, compared against torch on the same rows.
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from moetrain.kernels.launch import launch
from moetrain.kernels.timing import in_turns, median_ms

ROWS, COLS = 128, 64  # a stage's rows and columns (host side)
# the consumer's MMA tile is ROWS x MMA_COLS, as each ping-pong consumer's (a 128x256 accumulator in one warpgroup
# spills)
MMA_COLS = 128
BM = gl.constexpr(ROWS)
BK = gl.constexpr(COLS)
SWIZZLED = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
PLAIN_ROWS = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))


@gluon.jit
def _row_copies8(x_desc, idx_ptr, k0, bar, rows_view, r: gl.constexpr):
    """Rows r..r+7 of a stage: the eight indices loaded first, then the eight copies, so the loads' latency is paid
    once per eight copies (an index load ahead of each copy waits for it: ~26 clocks per copy, session 24 H)."""
    i0 = gl.load(idx_ptr + r)
    i1 = gl.load(idx_ptr + r + 1)
    i2 = gl.load(idx_ptr + r + 2)
    i3 = gl.load(idx_ptr + r + 3)
    i4 = gl.load(idx_ptr + r + 4)
    i5 = gl.load(idx_ptr + r + 5)
    i6 = gl.load(idx_ptr + r + 6)
    i7 = gl.load(idx_ptr + r + 7)
    tma.async_copy_global_to_shared(x_desc, [i0, k0], bar, rows_view.slice(r, 1))
    tma.async_copy_global_to_shared(x_desc, [i1, k0], bar, rows_view.slice(r + 1, 1))
    tma.async_copy_global_to_shared(x_desc, [i2, k0], bar, rows_view.slice(r + 2, 1))
    tma.async_copy_global_to_shared(x_desc, [i3, k0], bar, rows_view.slice(r + 3, 1))
    tma.async_copy_global_to_shared(x_desc, [i4, k0], bar, rows_view.slice(r + 4, 1))
    tma.async_copy_global_to_shared(x_desc, [i5, k0], bar, rows_view.slice(r + 5, 1))
    tma.async_copy_global_to_shared(x_desc, [i6, k0], bar, rows_view.slice(r + 6, 1))
    tma.async_copy_global_to_shared(x_desc, [i7, k0], bar, rows_view.slice(r + 7, 1))


@gluon.jit
def _fill(x_desc, w_desc, rows_ptr, a_bufs, w_buf, ready, empty, w_ready, per_prog, k_tiles, M,
          GATHER: gl.constexpr, MMA: gl.constexpr, PART: gl.constexpr, LOADERS: gl.constexpr, BATCH: gl.constexpr):
    """One loader warp: the whole box, or rows [PART, PART + 1) * BM / LOADERS of each stage, one copy per row."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROWS_PER: gl.constexpr = BM // LOADERS
    if MMA and PART == 0:
        mbarrier.expect(w_ready, w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [0, 0], w_ready, w_buf)
    first = gl.program_id(0) * per_prog
    for it in range(per_prog):
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        step = first + it
        m0 = (step // k_tiles) * BM % M
        k0 = (step % k_tiles) * BK
        if GATHER:
            # every loader arrives once on the stage's barrier (initialized with LOADERS arrivals) and adds its bytes
            mbarrier.expect(ready.index(s), ROWS_PER * x_desc.block_type.nbytes)
            # Gluon will not slice a swizzled buffer inside its 8-row swizzle atom, so the copies target the same
            # bytes viewed as unswizzled rows (row r at byte 128 r); the TMA unit swizzles by shared address bits,
            # as for a whole box (the check below verifies the rows land where the MMA reads them)
            rows_view = a_bufs.index(s)._reinterpret(gl.bfloat16, [BM, BK], PLAIN_ROWS)
            if BATCH == 8:
                for r in gl.static_range(PART * ROWS_PER, (PART + 1) * ROWS_PER, 8):
                    _row_copies8(x_desc, rows_ptr + m0, k0, ready.index(s), rows_view, r)
            else:
                for r in gl.static_range(PART * ROWS_PER, (PART + 1) * ROWS_PER):  # (a slice takes a constant start)
                    row = gl.load(rows_ptr + m0 + r)
                    tma.async_copy_global_to_shared(x_desc, [row, k0], ready.index(s), rows_view.slice(r, 1))
        else:
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [m0, k0], ready.index(s), a_bufs.index(s))


@gluon.jit
def _drain(a_bufs, w_buf, ready, empty, w_ready, sums_ptr, per_prog, BN: gl.constexpr, MMA: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
    if MMA:
        mbarrier.wait(w_ready, 0)
    for it in range(per_prog):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if MMA:
            acc = warpgroup_mma(a_bufs.index(s), w_buf.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if it > 0:
                mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
        else:
            if it == per_prog - 1:  # the last stage's values, for the check
                tile_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
                vals = a_bufs.index(s).load(tile_layout).to(gl.float32)
                i = gl.arange(0, BM, layout=gl.SliceLayout(1, tile_layout))
                j = gl.arange(0, BK, layout=gl.SliceLayout(0, tile_layout))
                # weighted by position: a row or a column out of place changes the sum
                place = (gl.expand_dims(i, 1) * BK + gl.expand_dims(j, 0)) % 97 + 1
                gl.store(sums_ptr + gl.program_id(0), gl.sum(gl.sum(vals * place.to(gl.float32), axis=1), axis=0))
            mbarrier.arrive(empty.index(s), count=1)
    if MMA:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.store(sums_ptr + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))


@gluon.jit
def _probe_kernel(x_desc, w_desc, rows_ptr, sums_ptr, per_prog, k_tiles, M, STAGES: gl.constexpr,
                  BN: gl.constexpr, GATHER: gl.constexpr, MMA: gl.constexpr, LOADERS: gl.constexpr,
                  BATCH: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], SWIZZLED)
    w_buf = gl.allocate_shared_memory(gl.bfloat16, [BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=LOADERS)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(w_ready, count=1)
    # (warp_specialize takes a literal list of partitions: one branch per loader count)
    if LOADERS == 1:
        gl.warp_specialize([
            (_drain, (a_bufs, w_buf, ready, empty, w_ready, sums_ptr, per_prog, BN, MMA)),
            (_fill, (x_desc, w_desc, rows_ptr, a_bufs, w_buf, ready, empty, w_ready, per_prog, k_tiles, M, GATHER, MMA,
                     0, LOADERS, BATCH)),
        ], [1], [40])
    elif LOADERS == 2:
        gl.warp_specialize([
            (_drain, (a_bufs, w_buf, ready, empty, w_ready, sums_ptr, per_prog, BN, MMA)),
            (_fill, (x_desc, w_desc, rows_ptr, a_bufs, w_buf, ready, empty, w_ready, per_prog, k_tiles, M, GATHER, MMA,
                     0, LOADERS, BATCH)),
            (_fill, (x_desc, w_desc, rows_ptr, a_bufs, w_buf, ready, empty, w_ready, per_prog, k_tiles, M, GATHER, MMA,
                     1, LOADERS, BATCH)),
        ], [1, 1], [40, 40])
    else:
        gl.static_assert(LOADERS == 4, "1, 2 or 4 loader warps")
        gl.warp_specialize([
            (_drain, (a_bufs, w_buf, ready, empty, w_ready, sums_ptr, per_prog, BN, MMA)),
            (_fill, (x_desc, w_desc, rows_ptr, a_bufs, w_buf, ready, empty, w_ready, per_prog, k_tiles, M, GATHER, MMA,
                     0, LOADERS, BATCH)),
            (_fill, (x_desc, w_desc, rows_ptr, a_bufs, w_buf, ready, empty, w_ready, per_prog, k_tiles, M, GATHER, MMA,
                     1, LOADERS, BATCH)),
            (_fill, (x_desc, w_desc, rows_ptr, a_bufs, w_buf, ready, empty, w_ready, per_prog, k_tiles, M, GATHER, MMA,
                     2, LOADERS, BATCH)),
            (_fill, (x_desc, w_desc, rows_ptr, a_bufs, w_buf, ready, empty, w_ready, per_prog, k_tiles, M, GATHER, MMA,
                     3, LOADERS, BATCH)),
        ], [1, 1, 1, 1], [40, 40, 40, 40])


def _descs(x: torch.Tensor, w: torch.Tensor, gather: bool):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [1, COLS] if gather else [ROWS, COLS]  # a row box carries the whole stage's swizzle
    x_desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], block, SWIZZLED.value)
    w_desc = TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [MMA_COLS, COLS],
                              gl.NVMMASharedLayout.get_default_for([MMA_COLS, COLS], gl.bfloat16))
    return x_desc, w_desc


# how the A rows are loaded: (row by row?, loader warps, index loads per batch); the whole box takes one warp
BOX = (False, 1, 1)
ROW_WAYS = [(True, 1, 1), (True, 1, 8), (True, 2, 8), (True, 4, 8), (True, 4, 1)]


def way_name(way) -> str:
    gather, loaders, batch = way
    if not gather:
        return "whole box"
    return f"rows, {loaders} warp{'s' if loaders > 1 else ''}, idx x{batch}"


def run(x, w, rows, stages: int, way, mma: bool, per_prog: int, programs: int) -> torch.Tensor:
    """One launch; returns each program's checksum [programs] fp32 (w [MMA_COLS, K] the MMA's operand). A rows:
    ``rows`` (gather) or consecutive rows of x (block); step i of program p is row tile (p * per_prog + i) //
    k_tiles, column step i % k_tiles."""
    gather, loaders, batch = way
    sums = torch.empty(programs, dtype=torch.float32, device=x.device)
    x_desc, w_desc = _descs(x, w, gather)
    k_tiles = x.shape[1] // COLS
    m = rows.shape[0] if gather else x.shape[0]
    launch(_probe_kernel, (programs,), x_desc, w_desc, rows, sums, per_prog, k_tiles, m,
           STAGES=stages, BN=MMA_COLS, GATHER=gather, MMA=mma, LOADERS=loaders, BATCH=batch, num_warps=4)
    return sums


def expected_sums(x, rows, gather: bool, per_prog: int, programs: int) -> torch.Tensor:
    """The "load" variant's checksums by torch: each program's last stage, weighted by position, summed."""
    k_tiles = x.shape[1] // COLS
    m = rows.shape[0] if gather else x.shape[0]
    out = []
    for p in range(programs):
        step = p * per_prog + per_prog - 1
        m0, k0 = (step // k_tiles) * ROWS % m, (step % k_tiles) * COLS
        idx = rows[m0:m0 + ROWS].long() if gather else torch.arange(m0, m0 + ROWS, device=x.device)
        place = (torch.arange(ROWS, device=x.device)[:, None] * COLS + torch.arange(COLS, device=x.device)) % 97 + 1
        out.append((x[idx, k0:k0 + COLS].float() * place).sum())
    return torch.stack(out)


def aot_compile(way, mma: bool, stages: int = 4, capability: int = 90):
    """The probe compiled for sm_``capability`` without a GPU (a CPU test's compile check)."""
    gather, loaders, batch = way
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    w_layout = gl.NVMMASharedLayout.get_default_for([MMA_COLS, COLS], gl.bfloat16)
    sig = {"x_desc": f"tensordesc<bf16[{1 if gather else ROWS}, {COLS}],{SWIZZLED.value!r}>",
           "w_desc": f"tensordesc<bf16[{MMA_COLS}, {COLS}],{w_layout!r}>", "rows_ptr": "*i32", "sums_ptr": "*fp32",
           "per_prog": "i32", "k_tiles": "i32", "M": "i32", "STAGES": "constexpr", "BN": "constexpr",
           "GATHER": "constexpr", "MMA": "constexpr", "LOADERS": "constexpr", "BATCH": "constexpr"}
    src = GluonASTSource(_probe_kernel, sig, constexprs={"STAGES": stages, "BN": MMA_COLS, "GATHER": gather,
                                                         "MMA": mma, "LOADERS": loaders, "BATCH": batch})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=131072, help="routed rows M (Qwen3: 16384 tokens x top-8)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--k", type=int, default=2048, help="x's columns (Qwen3's hidden size)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    if a.k % COLS or a.rows % ROWS:
        raise SystemExit(f"--k must be a multiple of {COLS} and --rows of {ROWS}")
    if not 1 <= a.stages <= 8 or a.reps < 1 or a.tokens < 1:
        raise SystemExit(f"--stages {a.stages} must be 1..8 (shared memory), --reps {a.reps} and --tokens {a.tokens} "
                         "at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("scripts/tma_gather_probe.py needs a CUDA GPU (Hopper)")
    dev = torch.device("cuda")
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(a.tokens, a.k, device=dev, dtype=torch.bfloat16, generator=gen)
    x_perm = torch.randn(a.rows, a.k, device=dev, dtype=torch.bfloat16, generator=gen)  # the block variant's rows
    rows = torch.randint(0, a.tokens, (a.rows,), device=dev, dtype=torch.int32, generator=gen)
    w = torch.randn(MMA_COLS, a.k, device=dev, dtype=torch.bfloat16, generator=gen)
    steps = a.rows // ROWS * (a.k // COLS)  # one pass over the routed rows' A operand
    per_prog = steps // programs
    a_bytes = per_prog * programs * ROWS * COLS * 2

    def run_case(way, mma: bool) -> torch.Tensor:
        return run(x if way[0] else x_perm, w, rows, a.stages, way, mma, per_prog, programs)

    for way in [BOX] + ROW_WAYS:
        got = run_case(way, False)
        want = expected_sums(x if way[0] else x_perm, rows, way[0], per_prog, programs)
        err = ((got - want).abs() / want.abs().clamp_min(1.0)).max().item()
        print(f"check {way_name(way)}: max rel err of the last stages' sums {err:.2e}", flush=True)
        if err > 1e-3:
            raise SystemExit("the stages do not hold the rows they should")

    cases = [(way, mma) for mma in (False, True) for way in [BOX] + ROW_WAYS]
    times, _ = in_turns(cases, lambda c: median_ms(lambda: run_case(*c), warmup=1, reps=1), a.reps)
    print(f"\n{programs} programs x {per_prog} stages of [{ROWS}, {COLS}] bf16 ({a_bytes / 1e9:.2f} GB of A), "
          f"{a.stages} stages in the ring; x [{a.tokens}, {a.k}], rows random tokens; median of {a.reps}")
    print("consumer        A by                         ms   us/stage/SM   A GB/s")
    for way, mma in cases:
        ms = times[(way, mma)]
        what = f"mma {ROWS}x{MMA_COLS}x{COLS}" if mma else "load only"
        print(f"{what:15s} {way_name(way):24s} {ms:7.3f}  {ms * 1e3 / per_prog:11.3f}  {a_bytes / ms / 1e6:7.0f}")


if __name__ == "__main__":
    main()
