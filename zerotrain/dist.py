"""Rank/world from the launcher env, process-group init with a timeout, and a clean teardown.

Works under torchrun, the deepspeed launcher (both set RANK/WORLD_SIZE/LOCAL_RANK) and plain
`python` (no env: a world of one process). Every collective waits at most `timeout_s`, so a dead
peer fails the job instead of hanging it.
"""
from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as the launcher said."""

    rank: int
    world_size: int
    local_rank: int


def _env_int(*names: str, default: int) -> int:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return default


def env() -> DistEnv:
    """Rank, world size and local rank from torchrun / deepspeed / mpirun variables; absent = 1 process."""
    rank = _env_int("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", default=0)
    world = _env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)
    local = _env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", default=0)
    return DistEnv(rank, world, local)


def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    return tdist.get_rank() if is_initialized() else env().rank


def world_size() -> int:
    return tdist.get_world_size() if is_initialized() else env().world_size


def is_main() -> bool:
    return rank() == 0


def init(backend_name: str, timeout_s: float) -> DistEnv:
    """Initialise torch.distributed (gloo on CPU, nccl on CUDA) once, with a collective timeout.

    backend_name is the engine backend ('deepspeed' or 'fsdp'): under DeepSpeed we go through
    deepspeed.init_distributed so deepspeed.comm shares the same process group.
    A world of one without a launcher env still gets a process group (on a free local port), so
    engines run the same code in one process.
    """
    e = env()
    if is_initialized():
        return DistEnv(tdist.get_rank(), tdist.get_world_size(), e.local_rank)
    if "MASTER_ADDR" not in os.environ:  # plain `python`: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    timeout = timedelta(seconds=float(timeout_s))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(e.local_rank)
    if backend_name == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", timeout=timeout, verbose=False)
    else:
        tdist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return DistEnv(tdist.get_rank(), tdist.get_world_size(), e.local_rank)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier() -> None:
    """Wait for every rank (bounded by the process group's timeout); no-op without a process group."""
    if is_initialized():
        tdist.barrier()


def print0(*args: Any, **kwargs: Any) -> None:
    """print on rank 0 only, flushed."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def teardown(*objects_to_drop: Any) -> None:
    """The clean-exit path: gc (so engine/model cycles holding group references go first), then
    barrier + destroy of every process group, DeepSpeed's registry of groups included.

    Why (measured, see the teardown test and the report): destroy_process_group() unregisters the
    groups but gloo's worker threads ('pt_gloo_runloop' x2 per group, 'gloo_tcp_loop') keep
    running while any reference to the group remains; ZeRO-3 stores the group on every
    partitioned parameter (`param.ds_process_group`), on its zero.Init object and in module
    globals, so without this path the threads are still running during interpreter finalization,
    where the C++ objects are destroyed in arbitrary order racing them (the SIGABRT
    "terminate called without an active exception"). Safe to call twice and without a group.
    """
    del objects_to_drop  # the caller's references are the ones that matter; this only documents intent
    gc.collect()
    if not is_initialized():
        return
    try:
        tdist.barrier()
    finally:
        _destroy_all()
        gc.collect()


def gloo_threads() -> int:
    """Live gloo worker threads in this process (Linux; 0 elsewhere): 0 after a clean teardown."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    n = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += "gloo" in f.read()
        except OSError:
            pass
    return n


def _destroy_all() -> None:
    """Destroy the world group (and with it every subgroup), and DeepSpeed's references to them."""
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None and ds_comm.cdb.is_initialized():
        ds_comm.destroy_process_group()  # also releases deepspeed.utils.groups' references
        ds_comm.cdb = None
    if is_initialized():
        tdist.destroy_process_group()
