"""The optimizer step's GPU time against its HBM floor: the gradients' norm and the AdamW update (clip and skip on
the device) over a given parameter count, for a set of dtypes, on each path PrecisionAwareAdamW has, timed in turns
in one process.

    moetrain bench optim [--params 2e9] [--tensors 64] [--sets fp32-master,bf16-state,bf16-moments]
                         [--contenders triton,torch,explicit] [--tiles 8x4r64] [--rounds 5] [--json PATH]

Dtype sets (bf16 parameters throughout):
    fp32-master   fp32 master weights, fp32 main gradients, fp32 moments (the defaults)
    bf16-state    no master: the bf16 parameters updated in place, bf16 gradients (param.grad), bf16 moments
    bf16-moments  fp32 master weights, fp32 main gradients, bf16 moments

Contenders (the same optimizer state, the paths switched between turns):
    triton    ``grad_norm`` (one multi-tensor sum-of-squares pass) + ``step_on_device`` on the Triton kernel; also
              each pass alone ("triton norm", "triton update"), and each --tiles entry (WxPrR: W warps, P elements a
              thread, R registers a thread at most; cC: chunks of C elements)
    torch     ``grad_norm`` (torch._foreach_norm) + ``step_on_device`` on torch._fused_adamw_ (+ the master ->
              parameter copy): where every dtype agrees (not bf16-moments)
    explicit  ``grad_norm``, its host read, the clip's scaling pass, ``step`` on the per-tensor explicit path

The floor: the bytes a norm + update must move at the copy bandwidth measured in the same run (a 1 GiB device copy,
read + write). Per parameter, with G, T, M, V, P the bytes of an element of the gradient, the updated tensor (master
or parameter), exp_avg, exp_avg_sq and the parameter copy (0 without a master):
    norm G  +  update G + 2T + 2M + 2V + P
    = fp32-master 4 + 30 = 34 B, bf16-state 2 + 14 = 16 B, bf16-moments 4 + 22 = 26 B.
Prints ms (median over rounds), the floor's ms and the ratio (the issue's target: 1.25x). Inputs are random (never
zeros); the gradients are clipped on every step. bench/optimizer.md has the latest results.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass

from moetrain.bench.common import at_least, require_gpu
from moetrain.errors import UserError

BYTES = {"fp32": 4, "bf16": 2}
SMALL = 7169  # the size of each small tensor (a norm's weight, say): not a multiple of any block
COPY_BYTES = 1 << 30
LR = 1e-6  # small: the state stays in range over many timed steps


@dataclass(frozen=True)
class DtypeSet:
    name: str
    master: bool
    grads: str  # main gradients' dtype ("bf16": the bf16 parameters' own .grad)
    exp_avg: str
    exp_avg_sq: str

    def norm_bytes(self) -> int:
        return BYTES[self.grads]

    def update_bytes(self) -> int:
        """Per parameter: the gradient read, the updated tensor, both moments read and written, the copy written."""
        target = 4 if self.master else 2
        return BYTES[self.grads] + 2 * target + 2 * BYTES[self.exp_avg] + 2 * BYTES[self.exp_avg_sq] + (
            2 if self.master else 0)

    def floor_formula(self) -> str:
        t = 4 if self.master else 2
        g, m, v = BYTES[self.grads], BYTES[self.exp_avg], BYTES[self.exp_avg_sq]
        copy = " + 2 (copy)" if self.master else ""
        return (f"norm {g} + update {g} (grad) + 2x{t} ({'master' if self.master else 'param'}) + 2x{m} (m) + "
                f"2x{v} (v){copy} = {self.norm_bytes() + self.update_bytes()} B/param")


SETS = {s.name: s for s in (DtypeSet("fp32-master", True, "fp32", "fp32", "fp32"),
                            DtypeSet("bf16-state", False, "bf16", "bf16", "bf16"),
                            DtypeSet("bf16-moments", True, "fp32", "bf16", "bf16"))}
CONTENDERS = ("triton", "torch", "explicit")


def parse_list(option: str, text: str, known) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError(f"{option}: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(known)}")
    return names


def parse_tiles(text: str) -> list[tuple[int, int, int, int | None]]:
    """--tiles: comma-separated WxPrR[cC] -> (warps, per_thread, max_registers, chunk or None)."""
    out = []
    for spec in (t.strip() for t in text.split(",") if t.strip()):
        found = re.fullmatch(r"(\d+)x(\d+)r(\d+)(?:c(\d+))?", spec)
        if not found:
            raise UserError(f"--tiles: {spec!r} is not WxPrR[cC] (e.g. 8x4r64: 8 warps, 4 elements a thread, at most "
                            "64 registers; c16384: chunks of 16384 elements)")
        w, p, r, c = (int(x) if x else None for x in found.groups())
        if w & (w - 1) or p & (p - 1) or not 1 <= w <= 32 or not 1 <= p <= 64 or not 16 <= r <= 255:
            raise UserError(f"--tiles: {spec!r}: warps and elements a thread powers of two (1-32, 1-64), registers "
                            "16-255")
        if c is not None and c % (w * 32 * p):
            raise UserError(f"--tiles: {spec!r}: a chunk of {c} is not a whole number of {w * 32 * p}-element blocks")
        out.append((w, p, r, c))
    return out


def tensor_sizes(params: int, tensors: int) -> list[int]:
    """``tensors`` large matrices (rows of 7168) and as many small vectors of SMALL elements, ~``params`` in all."""
    rows = max(1, (params - tensors * SMALL) // (tensors * 7168))
    return [rows * 7168] * tensors + [SMALL] * tensors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain bench optim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=2e9, help="parameters in all (e.g. 2e9)")
    ap.add_argument("--tensors", type=int, default=64, help="large tensors (as many small ones join them)")
    ap.add_argument("--sets", default=",".join(SETS), help="comma-separated: " + ", ".join(SETS))
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated: " + ", ".join(CONTENDERS))
    ap.add_argument("--tiles", default="", help="more Triton tiles to time, WxPrR[cC] comma-separated (e.g. "
                                                "8x8r80,4x4r64)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="write every timing here")
    args = ap.parse_args(argv)
    sets = parse_list("--sets", args.sets, SETS)
    contenders = parse_list("--contenders", args.contenders, CONTENDERS)
    tiles = parse_tiles(args.tiles)
    at_least("--params", int(args.params), 1_000_000, "parameters (1e6: larger than the L2 cache in bytes)")
    at_least("--tensors", args.tensors, 1, "tensor")
    at_least("--rounds", args.rounds, 1, "round")
    require_gpu("optim")
    from moetrain.bench.optim_run import run_all

    rows = run_all(int(args.params), args.tensors, [SETS[s] for s in sets], contenders, tiles, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
