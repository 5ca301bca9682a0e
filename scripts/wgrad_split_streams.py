"""Would the weight gradient's light groups overlap its heavy ones if they ran as a second launch beside the first?

    python scripts/wgrad_split_streams.py [--shapes dsv3,qwen3] [--light 64,128] [--splits 32,48,66] [--rounds 3]

An experiment for #6's DeepSeek-V3 skew (bench/NOTES.md session 18): on the layers' skewed routing, groups of at most
--light rows ("light": one or two reduction steps per dw tile) are bound by their dw stores and the others by the
tensor cores; inside one launch the two kinds run in step and do not overlap. Here the groups are split on the host
(an experiment: the real thing would need a device-side split) into a heavy problem and a light one, each a ping-pong
weight gradient of its own, and timed, calls queued back to back:
  plain       the whole problem in one launch (what the layer runs)
  sequential  heavy launch, then light launch, one stream
  streams P   light launch with P programs on a second stream, beside the heavy launch with (SMs - P) programs
Outputs are checked against torch._grouped_mm of the same groups first. ms and the best split over plain.
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    from moetrain.kernels import cuda_device
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels import wgrad_pingpong as wp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3,qwen3")
    ap.add_argument("--light", default="64,128", help="rows at most in a light group (comma-separated thresholds)")
    ap.add_argument("--splits", default="32,48,66", help="programs of the light launch (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    lights, splits = _positive_ints("--light", args.light), _positive_ints("--splits", args.splits)
    shapes = sweep.script_shapes(args.shapes)
    sweep.require_cuda("scripts/wgrad_split_streams.py")
    dev = torch.device("cuda")
    sms = cuda_device.sm_count(dev)
    if max(splits) >= sms:
        raise SystemExit(f"--splits: {args.splits!r}: each below the GPU's {sms} SMs (the heavy launch takes the rest)")
    side = torch.cuda.Stream()
    for shape in shapes:
        m, g, h, i = sweep.SHAPES[shape]
        offs = sweep.script_group_ends(shape, "layer-skewed")
        counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
        for layer, (n, k) in sweep.layer_gemms(h, i).items():
            gen = torch.Generator(device="cuda").manual_seed(0)
            dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            for light_rows in lights:
                parts = {}
                for name, keep in (("heavy", lambda c: c > light_rows), ("light", lambda c: c <= light_rows)):
                    rows, ends, start = [], [], 0
                    for c in counts:
                        if keep(c):
                            rows.append(torch.arange(start, start + c, device=dev))
                            ends.append((ends[-1] if ends else 0) + c)
                        start += c
                    idx = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=dev)
                    parts[name] = (dy[idx].contiguous(), x[idx].contiguous(),
                                   torch.tensor(ends, dtype=torch.int32, device=dev))
                (dy_h, x_h, offs_h), (dy_l, x_l, offs_l) = parts["heavy"], parts["light"]
                if not len(offs_h) or not len(offs_l):
                    print(f"{shape} {layer} light<={light_rows}: {len(offs_l)} light groups, {len(offs_h)} heavy: "
                          "nothing to split", flush=True)
                    continue
                for a, b, o in ((dy_h, x_h, offs_h), (dy_l, x_l, offs_l)):
                    err = sweep.rel_err(wp.grouped_gemm_wgrad_pingpong(a, b, o), torch._grouped_mm(a.t(), b, offs=o))
                    if not err < sweep.BOUND:
                        raise SystemExit(f"{shape} {layer}: a split part disagrees with torch (rel err {err:.2e})")

                def both(light_programs: int | None):
                    if light_programs is None:  # one stream, one after the other
                        wp.grouped_gemm_wgrad_pingpong(dy_h, x_h, offs_h)
                        wp.grouped_gemm_wgrad_pingpong(dy_l, x_l, offs_l)
                        return
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        wp.grouped_gemm_wgrad_pingpong(dy_l, x_l, offs_l, num_programs=light_programs)
                    wp.grouped_gemm_wgrad_pingpong(dy_h, x_h, offs_h, num_programs=sms - light_programs)
                    torch.cuda.current_stream().wait_stream(side)

                runs = {"plain": lambda: wp.grouped_gemm_wgrad_pingpong(dy, x, offs),
                        "heavy only": lambda: wp.grouped_gemm_wgrad_pingpong(dy_h, x_h, offs_h),
                        "light only": lambda: wp.grouped_gemm_wgrad_pingpong(dy_l, x_l, offs_l),
                        "sequential": lambda: both(None)}
                for p in splits:
                    runs[f"streams {p}"] = lambda p=p: both(p)
                med = sweep.script_times(runs, args.rounds, queued=True)
                best = min((name for name in runs if name.startswith("streams")), key=med.get)
                print(f"{shape} {layer} light<={light_rows}: {len(offs_l)} light groups ({int(offs_l[-1])} rows), "
                      f"{len(offs_h)} heavy; " + ", ".join(f"{name} {ms:.3f}" for name, ms in med.items())
                      + f"; {best} / plain {med[best] / med['plain']:.3f}", flush=True)
    return 0


def _positive_ints(flag: str, text: str) -> list[int]:
    """A comma-separated list of positive integers; else one line and exit."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"{flag}: {text!r}: comma-separated positive integers")
    return values


if __name__ == "__main__":
    raise SystemExit(main())
