"""`moetrain bench optim`'s GPU side (the command line and the floor's byte count: bench/optim.py): one
PrecisionAwareAdamW per dtype set over random state, its paths switched between turns, timed against a device copy."""

from __future__ import annotations

import torch
from torch import nn

from moetrain.bench.optim import COPY_BYTES, LR, DtypeSet, tensor_sizes
from moetrain.config.schema import OptimConfig
from moetrain.runtime.timing import in_turns, median_ms
from moetrain.train.optim import PrecisionAwareAdamW

DEVICE = "cuda"


def build(params: int, tensors: int, dset: DtypeSet) -> tuple[PrecisionAwareAdamW, float]:
    """The optimizer over random bf16 parameters with random gradients and moments (v > 0); returns it and a clip
    below the gradients' norm (every step clipped)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    named = []
    for i, n in enumerate(tensor_sizes(params, tensors)):
        shape = (n // 7168, 7168) if n % 7168 == 0 else (n,)  # matrices decay, vectors do not
        named.append((f"p{i}", nn.Parameter(torch.randn(shape, device=DEVICE, generator=gen, dtype=torch.bfloat16))))
    cfg = OptimConfig(main_grads_dtype=dset.grads, exp_avg_dtype=dset.exp_avg, exp_avg_sq_dtype=dset.exp_avg_sq)
    opt = PrecisionAwareAdamW(named, cfg, master_weights=dset.master)
    with torch.no_grad():
        for s in opt.slots:
            grad = torch.randn(s.param.shape, device=DEVICE, generator=gen) * 1e-3
            if s.main_grad is not None:
                s.main_grad.copy_(grad)
            else:
                s.param.grad = grad.to(s.param.dtype)
            s.exp_avg.copy_(torch.randn(s.param.shape, device=DEVICE, generator=gen) * 1e-4)
            s.exp_avg_sq.copy_(torch.rand(s.param.shape, device=DEVICE, generator=gen) * 1e-6 + 1e-9)
    opt.step_count = 10
    return opt, 0.5 * opt.grad_norm().item()


def runs(opt: PrecisionAwareAdamW, clip: float, contenders: list[str], tiles: list) -> dict:
    """name -> (path settings, run, floor part: "all", "norm" or "update")."""
    lr = torch.full((), LR, device=DEVICE)
    keep = torch.ones((), device=DEVICE)
    fixed_norm = torch.full((), 2.0 * clip, device=DEVICE)

    def device_step():
        norm = opt.grad_norm()
        opt.step_on_device(lr, norm, torch.isfinite(norm).float() * keep, clip)

    def host_step():  # EagerStep's update with every step clipped (the scaling pass is what it costs)
        norm = opt.grad_norm().item()
        opt.scale_grads(min(1.0, clip / (norm + 1e-6)) if norm > 0 else 1.0)
        opt.step(LR)

    out = {}
    if "triton" in contenders:
        out["triton"] = (dict(kernel=True, fused=True, tile=None), device_step, "all")
        out["triton norm"] = (dict(kernel=True, fused=True, tile=None), opt.grad_norm, "norm")
        out["triton update"] = (dict(kernel=True, fused=True, tile=None),
                                lambda: opt.step_on_device(lr, fixed_norm, keep, clip), "update")
        for w, p, r, c in tiles:
            name = f"triton {w}x{p}r{r}" + (f"c{c}" if c else "")
            out[name] = (dict(kernel=True, fused=True, tile=(w, p, r, c)), device_step, "all")
    opt.kernel, opt.fused = False, True
    if "torch" in contenders and not opt.explicit_slots():
        out["torch fused"] = (dict(kernel=False, fused=True, tile=None), device_step, "all")
    if "explicit" in contenders:
        out["explicit"] = (dict(kernel=False, fused=False, tile=None), host_step, "all")
    return out


def switch(opt: PrecisionAwareAdamW, settings: dict) -> None:
    from moetrain.kernels.adamw import DEFAULT_TILE, Tile

    opt.kernel, opt.fused = settings["kernel"], settings["fused"]
    if settings["kernel"]:
        t = settings["tile"]
        opt._kernels().tile = DEFAULT_TILE if t is None else Tile(warps=t[0], per_thread=t[1], max_registers=t[2],
                                                                  chunk=t[3] or DEFAULT_TILE.chunk)


def time_set(params: int, tensors: int, dset: DtypeSet, contenders: list[str], tiles: list, rounds: int) -> list:
    opt, clip = build(params, tensors, dset)
    n = sum(s.param.numel() for s in opt.slots)
    src = torch.randint(0, 255, (COPY_BYTES,), device=DEVICE, dtype=torch.uint8)
    dst = torch.empty_like(src)
    cases = runs(opt, clip, contenders, tiles)
    for settings, run, _ in cases.values():  # compile and warm every path once
        switch(opt, settings)
        run()
    torch.cuda.synchronize()

    def time_one(name):
        if name == "copy":
            return median_ms(lambda: dst.copy_(src), warmup=1, reps=5)
        settings, run, _ = cases[name]
        switch(opt, settings)
        return median_ms(run, warmup=1, reps=3)

    times, failed = in_turns(["copy"] + list(cases), time_one, rounds)
    bw = 2 * COPY_BYTES / (times["copy"] * 1e-3)  # bytes/s, read + write
    floors = {"norm": dset.norm_bytes() * n, "update": dset.update_bytes() * n}
    floors["all"] = floors["norm"] + floors["update"]
    print(f"\n{dset.name}: {n / 1e9:.3f} B parameters in {len(opt.slots)} tensors; copy {bw / 1e12:.2f} TB/s; floor "
          f"{dset.floor_formula()} -> {floors['all'] * 1e3 / bw:.2f} ms")
    print(f"  {'contender':24s} {'ms':>9s} {'floor ms':>9s} {'x floor':>8s}")
    rows = []
    for name, (_, _, part) in cases.items():
        floor_ms = floors[part] * 1e3 / bw
        if name in failed:
            print(f"  {name:24s} failed: {str(failed[name]).splitlines()[0][:80]}")
            continue
        ms = times[name]
        print(f"  {name:24s} {ms:9.2f} {floor_ms:9.2f} {ms / floor_ms:7.2f}x")
        rows.append(dict(set=dset.name, contender=name, ms=ms, floor_ms=floor_ms, ratio=ms / floor_ms, params=n,
                         floor_bytes=floors[part], copy_tb_s=bw / 1e12))
    opt.close()
    return rows


def run_all(params: int, tensors: int, sets: list[DtypeSet], contenders: list[str], tiles: list, rounds: int) -> list:
    print(f"moetrain bench optim on {torch.cuda.get_device_name()}: norm + AdamW update, {rounds} rounds in turns")
    rows = []
    for dset in sets:
        rows += time_set(params, tensors, dset, contenders, tiles, rounds)
        torch.cuda.empty_cache()
    return rows
