"""The world layout: every parallel degree of a run stored once, data parallelism derived, and all the rank
arithmetic over them (which rank sits where along each mesh dimension, which ranks form a group).

    degrees = ParallelDegrees(tp=1, pp=1, sp=2, ep=1)        # RunPlan.parallel (zerotrain/plan/run_plan.py)
    layout = degrees.layout(world_size=4)                     # RunPlan.layout: dp 2 x sp 2
    layout.groups("sp") == [[0, 1], [2, 3]]                   # what the mesh builder (mesh.py) makes groups of

Pure arithmetic (imports only zerotrain.errors), so the launcher's layout lines (zerotrain/launch/launchers.py), the
mesh builder (zerotrain/distributed/mesh.py), the plan, the estimate and the engines all count the same ranks. This is
the only module that multiplies or divides degrees (tests/unit/test_parallel_owner.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import ConfigError

MESH_DIMS = ("pp", "dp", "sp", "tp")
"""The world's mesh dimensions, outermost first (torchtitan's ParallelDims order): pipeline stages
outermost, tensor parallelism innermost (neighbouring ranks share a layer). Expert parallelism is no
dimension of its own: as in torchtitan and DeepSpeed-MoE it splits the data-parallel ranks' experts
(WorldLayout.ep), so every rank still reads its own batch. Which dimensions compose on which backend is
the capability table's (zerotrain/plan/capabilities.py), not new layout classes."""

DEGREE_DIMS = ("tp", "pp", "sp", "ep")
"""The degrees a run asks for (parallel.tp / pp / sp / ep); dp is what the world leaves."""


@dataclass(frozen=True)
class ParallelDegrees:
    """The model-parallel degrees of a run, as asked (parallel.*): the one place they are stored. Known without a
    world (`zerotrain config`); `layout(world_size)` arranges them over a world."""

    tp: int = 1
    """Tensor-parallel degree: ranks that split each layer and read the same batch."""
    pp: int = 1
    """Pipeline-parallel degree: ranks that each hold a slice of the layer stack."""
    sp: int = 1
    """Sequence-parallel degree: ranks that split each sequence and read the same batch (Ulysses attention)."""
    ep: int = 1
    """Expert-parallel degree: data-parallel ranks that split a mixture-of-experts block's experts between
    them (each reads its own batch; tokens travel to their experts' ranks)."""

    @property
    def model_parallel(self) -> int:
        """Ranks that together hold one replica of the dense layers: pp x sp x tp."""
        return self.tp * self.pp * self.sp

    @property
    def asked(self) -> dict[str, int]:
        """The degrees above 1, by name ({"sp": 2}): what the capability table and the refusals name."""
        return {d: getattr(self, d) for d in DEGREE_DIMS if getattr(self, d) > 1}

    @property
    def in_use(self) -> frozenset[str]:
        """The model-parallel dimensions in use (size > 1, ep included): the capability table's key."""
        return frozenset(self.asked)

    def divides(self, world_size: int) -> bool:
        """Whether pp x sp x tp ranks fit a whole number of times into the world."""
        return world_size % self.model_parallel == 0

    def replicas(self, world_size: int) -> int:
        """Data-parallel ranks a world of world_size leaves, at least 1 (tune sizes its micro-batches by it before
        the rules refuse degrees that do not fit)."""
        return max(1, world_size // self.model_parallel)

    def layout(self, world_size: int) -> "WorldLayout":
        """These degrees arranged over a world of world_size ranks (refused in one line when they do not fit)."""
        return WorldLayout.of(world_size, self)


@dataclass(frozen=True, init=False)
class WorldLayout:
    """How the ranks are arranged (after torchtitan's ParallelDims): world = pp x dp x sp x tp, and the
    data-parallel ranks split into expert-parallel groups of ep.

    Ranks are ordered as MESH_DIMS: tensor parallelism innermost, then sequence and data parallelism,
    then pipeline stages. An expert-parallel group is ep neighbouring data-parallel ranks. The degrees are
    `parallel` (the very object RunPlan.parallel holds); tp / pp / sp / ep read it."""

    world_size: int
    """Every rank of the job (nodes x ranks per node)."""
    parallel: ParallelDegrees
    """The model-parallel degrees (stored once: RunPlan.parallel is this object)."""

    def __init__(self, world_size: int, tp: int = 1, pp: int = 1, sp: int = 1, ep: int = 1,
                 parallel: ParallelDegrees | None = None):
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "parallel", parallel if parallel is not None else ParallelDegrees(tp, pp, sp, ep))
        self._check()

    @classmethod
    def of(cls, world_size: int, parallel: ParallelDegrees) -> "WorldLayout":
        return cls(world_size, parallel=parallel)

    def _check(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1 (got {self.world_size})")
        split = {d: n for d, n in self.parallel.asked.items() if d != "ep"}
        if len(split) == 1 and min(self.tp, self.pp, self.sp, self.ep) >= 1 and not self.parallel.divides(
                self.world_size):
            (kind, degree), = split.items()
            raise ConfigError(f"--{kind} {degree} does not divide the world of {self.world_size} ranks; "
                              f"pick a {kind} that divides it")
        if min(self.tp, self.pp, self.sp, self.ep) < 1 or not self.parallel.divides(self.world_size):
            raise ConfigError(f"{self.world_size} ranks cannot be split into tensor-parallel {self.tp} x pipeline "
                              f"{self.pp} x sequence-parallel {self.sp} groups (--tp {self.tp} --pp {self.pp} --sp "
                              f"{self.sp}); pick tp x pp x sp dividing the world size")
        if self.dp % self.ep:
            raise ConfigError(f"--ep {self.ep} does not divide the {self.dp} data-parallel ranks (expert-parallel "
                              "groups are made of data-parallel ranks); pick an ep that divides them")

    tp = property(lambda self: self.parallel.tp, doc="Tensor-parallel degree (ParallelDegrees.tp).")
    pp = property(lambda self: self.parallel.pp, doc="Pipeline-parallel degree (ParallelDegrees.pp).")
    sp = property(lambda self: self.parallel.sp, doc="Sequence-parallel degree (ParallelDegrees.sp).")
    ep = property(lambda self: self.parallel.ep, doc="Expert-parallel degree (ParallelDegrees.ep).")

    @property
    def model_parallel(self) -> int:
        """Ranks that together hold one replica of the dense layers: pp x sp x tp."""
        return self.parallel.model_parallel

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that each read their own batches (the dense layers' replicas)."""
        return self.world_size // self.model_parallel

    @property
    def expert_dp(self) -> int:
        """Copies of each expert: the data-parallel ranks / ep (the ranks that shard or replicate one expert)."""
        return self.dp // self.ep

    @property
    def shard_ranks(self) -> int:
        """Ranks the dense parameters' ZeRO / FSDP shards spread over: dp x sp (the sequence-parallel ranks hold
        the same layers and read the same batch, so they shard them too)."""
        return self.dp * self.sp

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage: dp x sp x tp (the whole world without pipeline parallelism)."""
        return self.world_size // self.pp

    @property
    def degrees(self) -> dict[str, int]:
        """Every mesh dimension's size, in MESH_DIMS order (their product is the world size)."""
        return {dim: getattr(self, dim) for dim in MESH_DIMS}

    @property
    def parallel_dims(self) -> frozenset[str]:
        """The model-parallel dimensions in use (size > 1, ep included): the capability table's key."""
        return self.parallel.in_use

    def _stride(self, dim: str) -> int:
        stride = 1
        for d in reversed(MESH_DIMS):
            if d == dim:
                return stride
            stride *= self.degrees[d]
        raise ValueError(f"unknown mesh dimension {dim!r}")

    def coordinate(self, rank: int, dim: str) -> int:
        """The index of a global rank along one mesh dimension (rank order is MESH_DIMS, tp innermost); "ep":
        its place in its expert-parallel group (neighbouring data-parallel ranks)."""
        if dim == "ep":
            return self.coordinate(rank, "dp") % self.ep
        return (rank // self._stride(dim)) % self.degrees[dim]

    def rank_at(self, rank: int, **coords: int) -> int:
        """The global rank that shares `rank`'s coordinates except those given (e.g. pp=0: its first stage)."""
        out = rank
        for dim, index in coords.items():
            out += (index - self.coordinate(rank, dim)) * self._stride(dim)
        return out

    def groups(self, *dims: str) -> list[list[int]]:
        """The rank groups that vary only along `dims` (every rank in one of them), in the order of their lowest
        rank: groups("sp") are the sequence-parallel groups, groups("pp") the ranks that pass one micro-batch
        along the stages. Every rank must create every group in this order (torch.distributed.new_group)."""
        out: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            key = tuple(self.coordinate(r, d) for d in MESH_DIMS if d not in dims)
            out.setdefault(key, []).append(r)
        return list(out.values())

    def stages(self) -> Iterator[list[int]]:
        """The ranks of each pipeline stage, first stage first."""
        for s in range(self.pp):
            yield list(range(s * self.stage_ranks, (s + 1) * self.stage_ranks))

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel replica a global rank belongs to (keys its sampler and metrics)."""
        return self.coordinate(rank, "dp")

    def pp_stage(self, rank: int) -> int:
        """Which pipeline stage a global rank runs (0 = the embeddings' stage)."""
        return self.coordinate(rank, "pp")

    def counts_for_data(self, rank: int) -> bool:
        """Whether this rank's batch figures count once for its replica (its first tensor- and
        sequence-parallel rank on the last pipeline stage; every rank when there is data parallelism only)."""
        return (self.coordinate(rank, "tp") == 0 and self.coordinate(rank, "sp") == 0
                and self.pp_stage(rank) == self.pp - 1)

    def describe(self) -> str:
        parts = [f"data-parallel {self.dp}"]
        for dim, name in (("tp", "tensor-parallel"), ("pp", "pipeline"), ("sp", "sequence-parallel"),
                          ("ep", "expert-parallel")):
            if getattr(self, dim) > 1:
                parts.append(f"{name} {getattr(self, dim)}")
        return f"{self.world_size} ranks = " + " x ".join(parts)
