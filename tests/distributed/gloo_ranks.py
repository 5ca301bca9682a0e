"""Run a test body on several CPU processes joined by a gloo process group.

``run_ranks(fn, *args, world_size=2)`` starts ``world_size`` spawned processes; each joins the
default process group (gloo, rank r of world_size) and calls ``fn(rank, world_size, *args)``. An
exception on any rank fails the calling test with that rank's traceback (the other ranks are
ended). ``fn`` must be a module-level function of an importable module (a test module is), and
its arguments picklable.

The rendezvous store is a TCPStore served by the calling process on a port the OS picks when it
binds (port 0), so concurrent test runs never race for a port. Each rank runs one intra-op thread:
the tests are small and CPU cores are shared.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=60)


def _rank_main(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()
    _exit_without_destructors()


def _exit_without_destructors() -> None:
    """End a rank whose body passed without running C++ static destructors.

    At interpreter exit the gloo/store threads' destructors can find a thread still joinable and
    call std::terminate (SIGABRT), failing a test whose checks all passed. The rank's work is done
    and checked here, so it flushes its output and leaves with status 0. A rank that raised never
    gets here: spawn reports its traceback and exit status as usual.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, *args, world_size: int = 2) -> None:
    """fn(rank, world_size, *args) on ``world_size`` gloo ranks; raises if any rank raised."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    mp.start_processes(_rank_main, args=(fn, world_size, store.port, args), nprocs=world_size,
                       start_method="spawn", join=True)


def cpu_mesh(world_size: int):
    """A 1-D CPU DeviceMesh over all ranks (call on every rank inside ``fn``)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (gathered), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
