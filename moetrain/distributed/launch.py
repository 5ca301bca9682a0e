"""torchrun's environment and the process group.

``moetrain train`` is distributed when it runs under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set, world size 1
included) or when a parallel degree is above 1. The process group is NCCL on CUDA devices and gloo on the CPU, with
train.dist_timeout_s as every collective's timeout; rank r uses GPU LOCAL_RANK.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from moetrain.errors import UserError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int


def torchrun_launch() -> Launch | None:
    """This process's place in a torchrun job, or None outside torchrun."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise UserError(f"a distributed launch needs the environment variables {', '.join(TORCHRUN_VARS)}; "
                        f"{', '.join(missing)} missing (start the job with torchrun, or unset RANK/WORLD_SIZE)")
    return Launch(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))


def wants_distributed(cfg) -> bool:
    """Under torchrun, or with any parallel degree above 1 (which then needs torchrun: ``init`` says so)."""
    p = cfg.parallel
    return torchrun_launch() is not None or any(getattr(p, k) > 1 for k in ("dp", "tp", "pp", "cp", "ep", "etp"))


def device_for(cfg, launch: Launch) -> torch.device:
    """cuda:LOCAL_RANK where CUDA is wanted and present, else the CPU."""
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device = cuda but no CUDA device is available; use train.device=auto or cpu")
    if want == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if launch.local_rank >= torch.cuda.device_count():
        raise UserError(f"LOCAL_RANK {launch.local_rank} but this node has {torch.cuda.device_count()} GPU(s); "
                        "start at most that many processes per node (torchrun --nproc_per_node)")
    return torch.device("cuda", launch.local_rank)


def init_process_group(cfg, device: torch.device, launch: Launch) -> bool:
    """The default process group (NCCL for CUDA, gloo for the CPU) unless one exists (a test's); True where this
    call made it (its maker destroys it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != launch.world_size:
            raise UserError(f"a process group of {dist.get_world_size()} ranks exists, but WORLD_SIZE is "
                            f"{launch.world_size}")
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                            timeout=timedelta(seconds=cfg.train.dist_timeout_s), **kwargs)
    return True


def require_launch(cfg) -> Launch:
    launch = torchrun_launch()
    if launch is None:
        p = cfg.parallel
        degrees = ", ".join(f"parallel.{k} = {getattr(p, k)}" for k in ("dp", "tp", "pp", "cp", "ep", "etp")
                            if getattr(p, k) > 1)
        raise UserError(f"{degrees}: a parallel run starts one process per rank; launch it with torchrun, e.g. "
                        f"`torchrun --nproc_per_node {p.world_size} -m moetrain train ...`")
    return launch
