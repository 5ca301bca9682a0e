"""Shared by the kernel test modules (plain torch: safe to import before triton): the relative error against a
float64 reference, with the NaN check that catches outputs a kernel never wrote (they are poisoned first), a
fresh Python process without the interpreter (for compiled-kernel checks from a process that set it), and the GPU
tests' skewed routing with empty groups and their per-group float64 checks of bf16 grouped GEMMs."""

import os
import subprocess
import sys

import torch

from moetrain.kernels.sweep_grouped_gemm import group_fp64  # (the sweep's float64 reference too)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FP32_BOUND = 1e-5  # fp32 accumulation over <= 100 terms, compared with fp64
BF16_BOUND = 1e-2  # bf16 inputs and outputs, fp32 accumulation, compared with fp64
SMEM_BLOCK = 232448  # bytes of shared memory one block may use on H100/H200


FP8_SIZES = [70, 0, 50, 1, 29]  # the FP8 kernel tests' groups: uneven, empty, one row; M = 150 + 6 rows of no group


def fp8_grouped_data(device, M: int, N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 kernel tests' operands on ``device``, fp32: x [M, K] with one 40x outlier row (row 3), and
    w [len(FP8_SIZES), N, K] scaled by 0.05."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[3] *= 40.0
    w = torch.randn(len(FP8_SIZES), N, K, generator=g) * 0.05
    return x.to(device), w.to(device)


def fp8_group_offs(device) -> torch.Tensor:
    """FP8_SIZES' cumulative group ends, int32 on ``device``."""
    return torch.tensor(FP8_SIZES).cumsum(0).to(torch.int32).to(device)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 on the CPU; fails on NaN (an unwritten, poisoned element)."""
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) or NaN outputs"
    want = want.double().cpu()
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-30)).item()


def run_without_interpreter(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``python -c code`` with the repository importable and TRITON_INTERPRET unset (a process that set it
    cannot load compiled kernels); stdout and stderr captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


def script_result(code: str) -> str:
    """The last line ``code`` printed, run by run_without_interpreter; the test fails (with the script's stderr) unless
    it exited 0. The compile checks print their findings, or "ok", last."""
    proc = run_without_interpreter(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def check_pingpong_compiled(row: dict) -> None:
    """A ping-pong kernel's sm_90a compile (grouped_gemm_aot.compiled_facts in ``row``): it fits a block's shared
    memory, spills nothing, issues wgmma and TMA, and its consumers take registers that the producer gives up."""
    assert row["shared"] <= SMEM_BLOCK, row
    assert row["spill"] == 0, row
    assert row["wgmma"] and row["tma"], row
    assert row["setmaxnreg"] >= 3, row


def skewed_offs_cuda(m: int, g: int, seed: int, trailing: int = 37) -> torch.Tensor:
    """[G] int32 group ends on the GPU: a few groups get most of the m - trailing rows, g // 8 get none, and the
    last ``trailing`` rows belong to no group."""
    gen = torch.Generator().manual_seed(seed)
    shares = torch.rand(g, generator=gen, dtype=torch.float64) ** 3  # a few experts get most rows
    counts = (shares / shares.sum() * (m - trailing)).floor().long()
    counts[torch.randperm(g, generator=gen)[: g // 8]] = 0  # some empty experts
    return torch.cumsum(counts, 0).to(torch.int32).cuda()


def group_ranges(offs: torch.Tensor) -> list:
    """[(first row, row end)] of each group."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def rows_fp64(op: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A forward's or data gradient's whole output [M, N] in float64; rows past offs[-1] zero."""
    out = torch.zeros(a.shape[0], b.shape[1] if op == "fwd" else b.shape[2], dtype=torch.float64, device=a.device)
    for g, (s, e) in enumerate(group_ranges(offs)):
        out[s:e] = group_fp64(op, a, b, g, s, e)
    return out


def check_groups_fp64(op: str, got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, groups) -> None:
    """A grouped GEMM's bf16 output against float64, group by group (a, b: the op's two inputs as the op reads
    them; op "fwd", "dgrad" or "wgrad"); an empty group's output must be exactly zero. Computed on the inputs'
    device (no host copies of large groups)."""
    rng = group_ranges(offs)
    for g in groups:
        s, e = rng[g]
        want, have = group_fp64(op, a, b, g, s, e), got[g] if op == "wgrad" else got[s:e]
        if e == s:
            assert torch.equal(have, torch.zeros_like(have)), (op, g, "empty group not zero")
        else:
            err = ((have.double() - want).norm() / want.norm()).item()
            assert err < BF16_BOUND, (op, g, e - s, err)


def hopper_kernels(module: str):
    """moetrain.kernels.<module>, a Hopper-only compiled kernel module (the Gluon ping-pong kernels); skips the test
    without a Hopper GPU or in a process that set TRITON_INTERPRET (compiled kernels unavailable there)."""
    import importlib

    import pytest

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    from moetrain.kernels import grouped_gemm

    if grouped_gemm.interpreting():
        pytest.skip("TRITON_INTERPRET is set in this process: the compiled kernels are unavailable")
    return importlib.import_module(f"moetrain.kernels.{module}")


def check_graph_replays(step, offs: torch.Tensor, rows: int, outs, check, seeds=(2, 5)) -> None:
    """Sync-free kernels read the routing on the device only: ``step()`` runs once (compiles, autotunes), is captured
    in one CUDA graph, and replayed on new skewed routings of ``rows`` rows (skewed_offs_cuda, written into offs in
    place; ``outs`` NaN-poisoned first), each replay followed by ``check()``."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in seeds:
        offs.copy_(skewed_offs_cuda(rows, offs.numel(), seed=seed))
        for t in outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check()
