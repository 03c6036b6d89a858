"""Rank/world from the launcher env, process-group init with a timeout, and a clean teardown.

Works under torchrun, the deepspeed launcher (both set RANK/WORLD_SIZE/LOCAL_RANK) and plain
`python` (no env: a world of one process). Every collective waits at most `timeout_s`, so a dead
peer fails the job instead of hanging it.

Ending a process that used a process group: `teardown()` (what every engine's `close()` calls),
then `exit_cleanly(code)` instead of returning to the interpreter. Why both, measured here
(torch 2.13 CPU, gloo, DeepSpeed 0.19.8, 2 ranks; gdb stopped at libc `exit()`):

- `destroy_process_group()` only unregisters the groups. gloo's `ProcessGroupGloo` has no
  `shutdown()`/`abort()` of its own in torch 2.13 (only the destructor), so its worker threads
  ('pt_gloo_runloop' x2 per group) and its transport's event loop ('gloo_tcp_loop') are joined
  only when the last C++ reference to the group goes. DeepSpeed (ZeRO-3 puts the group on every
  partitioned parameter as `ds_process_group`, on its zero.Init object, in module globals) and
  torch keep references that Python's finalization does not reliably release; after teardown
  and gc, 6 gloo threads (two groups: world + DeepSpeed's data-parallel group) were still
  running when libc `exit()` began, on both ranks, in every run inspected.
- `exit()` then runs the C++ static destructors and atexit handlers of libtorch/gloo and of
  the JIT-built DeepSpeed ops while those threads still run. That is the window where a
  joinable `std::thread` can be destroyed ("terminate called without an active exception",
  SIGABRT) or a destructor can block on a running thread (a hang at exit).
- `exit_cleanly()` closes that window instead of racing it: it runs Python's own atexit
  handlers (logging, user handlers), flushes stdout/stderr, and leaves with `os._exit(code)`,
  so no C++ static destructor runs while gloo threads are alive. The OS reclaims the threads,
  sockets and memory. Use it only after a successful-or-failed `close()`: it never changes the
  code (non-zero stays non-zero), it just skips the unsafe part of interpreter shutdown.
  `python -m zerotrain ...` / the `zerotrain` script do this; for your own script:

      engine.close()
      dist.exit_cleanly(0)
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, Optional

import torch
import torch.distributed as tdist

from ..util import free_port


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as the launcher said."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int = 0
    """Ranks on this host (torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE, OpenMPI's); 0: not said."""


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
    per_host = _env_int("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", default=0)
    return DistEnv(rank, world, local, per_host)


_USED_PROCESS_GROUP = False  # set by init(): this process started gloo/nccl threads


def used_process_group() -> bool:
    """True once init() created a process group in this process (even if torn down since)."""
    return _USED_PROCESS_GROUP or is_initialized()


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
    global _USED_PROCESS_GROUP
    e = env()
    _USED_PROCESS_GROUP = True
    if is_initialized():
        return DistEnv(tdist.get_rank(), tdist.get_world_size(), e.local_rank, e.local_world_size)
    if "MASTER_ADDR" not in os.environ:  # plain `python`: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    timeout = timedelta(seconds=float(timeout_s))
    # torch's flight recorder keeps each group's last collectives (gloo too): a hang dump names them (watchdog.py)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(e.local_rank)
    name = "nccl" if cuda else "gloo"
    store = _elastic_store(timeout)
    if store is not None:  # DeepSpeed adopts a process group that exists
        tdist.init_process_group(name, store=store, rank=e.rank, world_size=e.world_size, timeout=timeout)
    if backend_name == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=name, timeout=timeout, verbose=False)
    elif store is None:
        tdist.init_process_group(name, timeout=timeout)
    return DistEnv(tdist.get_rank(), tdist.get_world_size(), e.local_rank, e.local_world_size)


def _elastic_store(timeout: timedelta) -> Optional[tdist.Store]:
    """Under torch's elastic agent, the agent's own TCP store, its keys prefixed by the restart count; None
    elsewhere. The agent shares one store across restarts and torch's env:// init adds no prefix, so a
    restarted group could read a dead attempt's gloo addresses ('Gloo connectFullMesh failed ... Connection
    refused', seen here on the first restart)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout)
    return tdist.PrefixStore(f"zerotrain/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def barrier(timeout_s: Optional[float] = None) -> None:
    """Wait for every rank (bounded by the process group's timeout, or timeout_s where the backend can
    bound one barrier: gloo); no-op without a process group. timeout_s: failures are ignored (best effort)."""
    if not is_initialized():
        return
    if timeout_s is None:
        tdist.barrier()
        return
    try:
        if tdist.get_backend() == "gloo":
            tdist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
        else:
            tdist.barrier()
    except Exception:  # noqa: BLE001 - a peer that already died: nothing left to wait for
        pass


def teardown(*, barrier: bool = True) -> None:
    """The clean-exit path: gc (so engine/model cycles holding group references go first), then
    barrier + destroy of every process group, DeepSpeed's registry of groups included. gc frees only
    what nothing references: the caller drops its own references to the engine and model first.

    This makes every rank leave the group together and drops the groups from torch's and
    DeepSpeed's registries, but it cannot stop gloo's threads (see the module docstring): end
    the process with exit_cleanly(code) afterwards. Safe to call twice and without a group.
    barrier=False on a failure path: a failed rank must not wait (until the collective timeout)
    for peers that are still inside a training collective.
    """
    gc.collect()
    if not is_initialized():
        return
    try:
        if barrier:
            tdist.barrier()
    finally:
        _destroy_all()
        gc.collect()


def _destroy_all() -> None:
    """Destroy the world group (and with it every subgroup), and DeepSpeed's references to them."""
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None and ds_comm.cdb.is_initialized():
        ds_comm.destroy_process_group()  # also releases deepspeed.utils.groups' references
        ds_comm.cdb = None
    if is_initialized():
        tdist.destroy_process_group()


def exit_cleanly(code: int = 0) -> NoReturn:
    """End the process with `code` without running C++ static destructors (see the module docstring).

    Tears down a still-initialised process group first (no barrier: a failed rank must not wait
    for its peers), runs Python's atexit handlers (logging.shutdown among them), flushes
    stdout/stderr, then `os._exit(code)`. A process that never created a process group exits the
    ordinary way (`sys.exit`), so this is safe to call from any entry point.
    """
    code = _exit_code(code)
    if is_initialized():
        try:
            _destroy_all()
        except Exception as e:  # report, but the exit code of the run is what matters
            print(f"zerotrain: process-group teardown failed at exit: {e!r}", file=sys.stderr)
    if not used_process_group():
        sys.exit(code)
    try:
        atexit._run_exitfuncs()
    except BaseException as e:  # an atexit handler failing must not turn into a different exit path
        print(f"zerotrain: atexit handler failed: {e!r}", file=sys.stderr)
        code = code or 1
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
    os._exit(code)


def _exit_code(code: Any) -> int:
    """sys.exit semantics: None -> 0, int -> itself, anything else (a message: printed) -> 1."""
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code if 0 <= code <= 255 else 1  # never let a failure wrap round to 0
    print(code, file=sys.stderr)
    return 1
