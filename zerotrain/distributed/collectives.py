"""Small reductions over every rank of the default process group (each is a collective: call it on every rank)."""
from __future__ import annotations

import torch


def is_distributed() -> bool:
    import torch.distributed as tdist

    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def comm_device() -> torch.device:
    """Where a tensor for the default process group must live: NCCL only moves CUDA tensors."""
    import torch.distributed as tdist

    if "nccl" in str(tdist.get_backend()) and "gloo" not in str(tdist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(values: list[float], op: str) -> list[float]:
    import torch.distributed as tdist

    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM if op == "sum" else tdist.ReduceOp.MAX)
    return t.tolist()


def reduce_sum(*values: float) -> list[float]:
    """Sum over ranks (collective)."""
    return _reduce(list(values), "sum")


def reduce_max(*values: float) -> list[float]:
    """Max over ranks (collective)."""
    return _reduce(list(values), "max")
