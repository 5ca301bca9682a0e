"""Does the host probe (moetrain.plan.host.probe_us, CPU-only eager work) read the same in a fresh process as in
the trainer's? On a lent H200 host it read 443-538 us standalone and 715-738 us inside plan validate's worker,
minutes apart. Prints the probe after each step of building the trainer's context, in one process (GPU host).

    python scripts/host_probe_context.py
"""

from __future__ import annotations


def main() -> int:
    from moetrain.plan.host import probe_us

    def show(what: str) -> None:
        print(f"{what:44s} {probe_us():7.1f} us", flush=True)

    show("fresh (torch + moetrain.models)")
    import moetrain.train.trainer  # noqa: F401  (triton, rich, the ops)
    show("after importing moetrain.train.trainer")
    import torch

    if torch.cuda.is_available():
        torch.cuda.init()
        show("after torch.cuda.init()")
        a = torch.randn(1024, 1024, device="cuda")
        (a @ a).sum().item()
        show("after a CUDA matmul")
    show("again")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
