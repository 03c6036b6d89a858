"""The one builder of device meshes and process groups: each by its role, built once on first use, from the
world layout (zerotrain/distributed/layout.py), after torchtitan's parallel_dims.get_mesh.

    meshes = ParallelMeshes(plan.world, "cuda")
    meshes.get("dp")          # the 1-D mesh the dense parameters are sharded over (FSDP2)
    meshes.get("tp")          # the 2-D ("dp", "tp") mesh: blocks split over tp, sharded over dp
    meshes.get("sp")          # this rank's sequence-parallel group (every sp group is created)
    meshes.get("pp")          # the 2-D ("pp", "dp") mesh of a pipeline; ("pp", "dp", "tp") with tensor parallelism
    meshes.get("ep")          # the expert mesh ("efsdp", "ep") and its dense sibling ("dp", "tp" of size 1)
    side_group("zerotrain_step_boundary", timeout_s)   # a gloo group beside training's (preemption, async save)

torch.distributed.new_group (which init_device_mesh calls) must be called by every rank, for every group, in the
same order: a role is built on its first get() and the engines ask for their roles at the same point on every rank,
so the groups are created in the same order everywhere. tests/unit/test_parallel_owner.py keeps every mesh and
process group of zerotrain built here.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional, Union

from .layout import WorldLayout

ROLES = ("dp", "tp", "sp", "pp", "pp_tie", "ep", "async_checkpoint")
"""The roles ParallelMeshes hands out (get): see _build."""


def side_group(desc: str, timeout_s: Optional[float] = None) -> Any:
    """A gloo group of every rank beside training's (its own CPU collectives, also next to NCCL): the preemption
    agreement (zerotrain/distributed/preemption.py) and the asynchronous checkpoint's writer thread."""
    import torch.distributed as tdist

    kw: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
    return tdist.new_group(backend="gloo", group_desc=desc, **kw)


def rank_groups(groups: list[list[int]], rank: int) -> Any:
    """Create every group of ranks (all of them, in order, on every rank: new_group's rule); this rank's or None."""
    import torch.distributed as tdist

    mine = None
    for ranks in groups:
        group = tdist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


class ParallelMeshes:
    """The meshes and process groups of one run, by role, each built once (on first get)."""

    def __init__(self, layout: WorldLayout, device_type: Union[str, Callable[[], str]]):
        self.layout = layout
        """The world's arrangement the meshes follow."""
        self._device_type = device_type
        self._built: dict[str, Any] = {}

    @property
    def device_type(self) -> str:
        """cuda or cpu: what init_device_mesh places the meshes on (a function is asked when the first mesh is
        built: an engine knows its device only once it has joined the world)."""
        return self._device_type if isinstance(self._device_type, str) else self._device_type()

    def get(self, role: str) -> Any:
        """The mesh or group of a role (ROLES), built on first use."""
        if role not in ROLES:
            raise ValueError(f"unknown mesh role {role!r} (roles: {', '.join(ROLES)})")
        if role not in self._built:
            self._built[role] = self._build(role)
        return self._built[role]

    def _rank(self) -> int:
        import torch.distributed as tdist

        return tdist.get_rank()

    def _build(self, role: str) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        lay = self.layout
        if role == "sp":  # ranks that differ only in their sp coordinate share a group
            return rank_groups(lay.groups("sp"), self._rank())
        if role == "pp_tie":  # a tied embedding/head: each first-stage rank with its last-stage peer
            first = [r for r in range(lay.world_size) if lay.pp_stage(r) == 0]
            return rank_groups([[r, lay.rank_at(r, pp=lay.pp - 1)] for r in first], self._rank())
        if role == "async_checkpoint":
            return side_group("zerotrain_async_checkpoint")
        dev = self.device_type  # the meshes only: the groups above need no device
        if role == "dp":
            # the ranks FSDP2 shards the dense parameters over: dp x sp (the sp ranks hold the same layers)
            return init_device_mesh(dev, (lay.shard_ranks,))
        if role == "tp":  # blocks split over tp first, then sharded over dp (torchtitan's order)
            return init_device_mesh(dev, (lay.dp, lay.tp), mesh_dim_names=("dp", "tp"))
        if role == "pp":  # with tp: (pp, dp, tp), torchtitan's order (stages outermost, a layer's splits neighbours)
            if lay.tp > 1:
                return init_device_mesh(dev, (lay.pp, lay.dp, lay.tp), mesh_dim_names=("pp", "dp", "tp"))
            return init_device_mesh(dev, (lay.pp, lay.dp), mesh_dim_names=("pp", "dp"))
        assert role == "ep", role
        # the dense parameters' 1-D data-parallel view whose tensor-parallel sibling (size 1) transformers'
        # dispatch needs, then the experts: ep neighbouring ranks split them, expert_dp copies shard each
        dense = init_device_mesh(dev, (lay.dp, 1), mesh_dim_names=("dp", "tp"))
        experts = init_device_mesh(dev, (lay.expert_dp, lay.ep), mesh_dim_names=("efsdp", "ep"))
        return dense, experts
